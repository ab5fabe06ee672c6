"""cp-diloco's inner steps at a multiple of the optimizer's rate (lowband.optim.lr_scale)
against the optimizer itself at the scaled rate, step by step."""
from __future__ import annotations

import math

import pytest
import torch

from lowband.optim.lr_scale import resolve_scale, step_scaled


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _backward(model: torch.nn.Module, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_scaled_step_is_the_optimizer_at_the_scaled_rate(kind):
    """Adam (L2 decay inside the gradient) and SGD with momentum: ``step_scaled(opt, s)`` is the
    same optimizer built with ``lr * s``, over steps; the group's own rate is kept."""
    make = {"adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr, weight_decay=1e-2),
            "sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=1e-2)}[kind]
    a, b = _model(), _model()
    opt_a, opt_b = make(a.parameters(), 1e-2), make(b.parameters(), 1e-2 * 1.7)
    for t in range(5):
        _backward(a, t)
        _backward(b, t)
        step_scaled(opt_a, 1.7)
        opt_b.step()
        assert opt_a.param_groups[0]["lr"] == 1e-2
    assert torch.allclose(_flat(a), _flat(b), rtol=0, atol=1e-7)
    plain = _model()
    opt_p = make(plain.parameters(), 1e-2)
    for t in range(5):
        _backward(plain, t)
        opt_p.step()
    assert (_flat(plain) - _flat(a)).abs().max() > 1e-4


def test_adamw_decay_keeps_its_rate():
    """AdamW: the gradient's step is scaled, the decoupled decay ``p (1 - lr wd)`` is not. With
    zero gradients only the decay acts; with gradients the step is AdamW's at ``lr * s`` with
    ``wd / s``."""
    model = _model()
    start = _flat(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    step_scaled(opt, 2.0)
    assert torch.allclose(_flat(model), start * (1 - 1e-2 * 0.5), rtol=1e-7, atol=0)
    assert opt.param_groups[0]["weight_decay"] == 0.5 and opt.param_groups[0]["lr"] == 1e-2
    a, b = _model(), _model()
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.5)
    opt_b = torch.optim.AdamW(b.parameters(), lr=2e-2, weight_decay=0.25)
    for t in range(4):
        _backward(a, t)
        _backward(b, t)
        step_scaled(opt_a, 2.0)
        opt_b.step()
    assert torch.allclose(_flat(a), _flat(b), rtol=0, atol=1e-7)


def test_rates_are_put_back_when_the_step_raises():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _backward(model, 0)

    def broken():
        raise RuntimeError("boom")
    opt.step = broken
    with pytest.raises(RuntimeError, match="boom"):
        step_scaled(opt, 3.0)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_auto_is_sqrt_world_for_adam_family_only():
    ps = list(_model().parameters())
    assert resolve_scale("auto", torch.optim.Adam(ps), 2) == math.sqrt(2)
    assert resolve_scale("auto", torch.optim.AdamW(ps), 4) == 2.0
    assert resolve_scale("auto", torch.optim.SGD(ps, lr=0.1), 4) == 1.0
    assert resolve_scale("auto", torch.optim.Adam(ps), 1) == 1.0
    assert resolve_scale(0.5, torch.optim.SGD(ps, lr=0.1), 4) == 0.5
