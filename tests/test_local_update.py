"""The closed-form tentative step equals the generic fallback and a real optimizer.step(), bit
for bit, for every SGD and Adam/AdamW variant; neither touches the optimizer's state. CP-SGD's
fused native SGD and Adam steps (global step + tentative step in one or two passes) equal the
two in sequence."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowband.optim.tentative import FusedAdamStep, FusedSGDStep, TentativeStep, closed_form_kind
from lowband import _native as kernels

VARIANTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd-momentum-wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd-maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adam-wd": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=1e-2),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, weight_decay=1e-3),
    "adam-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-3, maximize=True, betas=(0.8, 0.99)),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, amsgrad=True),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 2))


def _groups(model):
    """Two param groups (different learning rates); the last layer's weight gets no gradient."""
    ps = list(model.parameters())
    return [{"params": ps[:4]}, {"params": ps[4:], "lr": 0.01}]


def _grads(model, seed):
    torch.manual_seed(seed)
    gs = [torch.randn_like(p) for p in model.parameters()]
    gs[-2] = None                       # a parameter without a gradient this step
    return gs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("history", [0, 3])
def test_closed_form_equals_generic_and_real_step(variant, history):
    model = _model()
    opt = VARIANTS[variant](_groups(model))
    params = list(model.parameters())
    for s in range(history):             # build optimizer state (momentum, moments, step)
        for p, g in zip(params, _grads(model, 100 + s)):
            p.grad = g
        opt.step()
    start = [p.detach().clone() + 0.01 for p in params]   # W, distinct from the model's values
    grads = _grads(model, 7)
    state_before = copy.deepcopy(opt.state_dict())
    values_before = [p.detach().clone() for p in params]

    closed = TentativeStep(opt, params)
    assert closed.closed_form and closed_form_kind(opt) in ("sgd", "adam")
    out_closed = [torch.empty_like(p) for p in params]
    closed.step(start, grads, out_closed)
    out_generic = [torch.empty_like(p) for p in params]
    TentativeStep(opt, params, generic=True).step(start, grads, out_generic)

    real = copy.deepcopy(opt.state_dict())
    model2 = _model()
    opt2 = VARIANTS[variant](_groups(model2))
    opt2.load_state_dict(real)
    with torch.no_grad():
        for p, s in zip(model2.parameters(), start):
            p.copy_(s)
    for p, g in zip(model2.parameters(), grads):
        p.grad = None if g is None else g.clone()
    opt2.step()

    for a, b, c in zip(out_closed, out_generic, model2.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(a, c.detach())
    assert torch.equal(out_closed[-2], start[-2])           # no gradient: unchanged
    # the optimizer state and the model's values are untouched by both
    after = opt.state_dict()
    for k, st in state_before["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][name])), (k, name)
    assert set(after["state"]) == set(state_before["state"])
    for p, v in zip(params, values_before):
        assert torch.equal(p.detach(), v)


def test_in_place_output_and_other_optimizers_fall_back():
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.RMSprop(params, lr=1e-3, momentum=0.5)
    step = TentativeStep(opt, params)
    assert not step.closed_form
    start = [p.detach().clone() for p in params]
    step.step(start, _grads(model, 1), params)              # out = the parameters themselves
    assert not opt.state or all(not st for st in opt.state.values())
    assert any(not torch.equal(p.detach(), s) for p, s in zip(params, start))
    assert closed_form_kind(torch.optim.SGD(params, lr=torch.tensor(0.1))) is None


SGD_VARIANTS = sorted(v for v in VARIANTS if v.startswith("sgd"))


@pytest.mark.skipif(kernels.library() is None, reason="native kernels not built")
@pytest.mark.parametrize("variant", SGD_VARIANTS)
def test_fused_sgd_step_equals_optimizer_step_then_tentative_step(variant):
    """Five pipelined steps (the first creates the momentum buffers), with parameters that
    lack the averaged gradient, the local one, or both at some steps: W, w and the optimizer
    state equal ``optimizer.step()`` followed by ``TentativeStep.step`` bit for bit."""
    def grads(model, params, s):
        G, g = _grads(model, 10 + s), _grads(model, 20 + s)
        if s == 1:
            G[0] = None          # no rank had this gradient at this step
        if s == 2:
            g[1] = None          # this rank had no local gradient
        return G, g

    _assert_fused_equals_torch(FusedSGDStep, _model, lambda model: VARIANTS[variant](_groups(model)), grads)


def _assert_fused_equals_torch(fused_step, make_model, make_optimizer, grads, steps: int = 5):
    """``steps`` pipelined steps (``grads(model, params, s)`` gives step s's averaged and local
    gradients) through ``fused_step`` and through ``optimizer.step()`` + ``TentativeStep``: W,
    w and the optimizer state (values and dtypes) equal bit for bit."""
    runs = []
    for fused in (False, True):
        model = make_model()
        params = list(model.parameters())
        opt = make_optimizer(model)
        assert fused_step.unavailable(opt, params) is None
        W = [p.data for p in params]
        w = [torch.empty_like(p) for p in params]
        for s in range(steps):
            G, g = grads(model, params, s)
            if fused:
                fused_step(opt, params).step(W, G, g, w)
            else:
                for p, x in zip(params, G):
                    p.grad = x
                opt.step()
                TentativeStep(opt, params).step(W, g, w)
        state = {k: {n: v.clone() for n, v in st.items()} for k, st in opt.state_dict()["state"].items()}
        runs.append(([x.clone() for x in W], [x.clone() for x in w], state))
    (W0, w0, st0), (W1, w1, st1) = runs
    assert all(torch.equal(a, b) for a, b in zip(W0, W1))
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert st0.keys() == st1.keys()
    for k in st0:
        assert st0[k].keys() == st1[k].keys()
        for n in st0[k]:
            assert torch.equal(st0[k][n], st1[k][n]), (k, n)
            assert st0[k][n].dtype == st1[k][n].dtype, (k, n)


def test_fused_sgd_step_says_why_it_is_not_used():
    model = _model()
    params = list(model.parameters())
    assert "not a plain torch.optim.SGD" in FusedSGDStep.unavailable(torch.optim.Adam(params), params)
    assert FusedSGDStep.unavailable(torch.optim.SGD(params, lr=0.1, foreach=True), params) == "foreach=True"
    opt = torch.optim.SGD(params, lr=0.1)
    handle = opt.register_step_post_hook(lambda *a: None)
    assert FusedSGDStep.unavailable(opt, params) == "optimizer step hooks are registered"
    handle.remove()
    half = [p.detach().half() for p in params]
    assert "fp32" in FusedSGDStep.unavailable(opt, half)


@pytest.mark.skipif(kernels.library() is None, reason="native kernels not built")
def test_fused_sgd_step_reads_a_non_contiguous_gradient_correctly():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, 5))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    G = torch.randn(5, 6).t()            # same shape, transposed strides
    g = torch.randn(5, 6).t()
    assert not G.is_contiguous()
    W, w = p.detach().clone(), torch.empty(6, 5)
    FusedSGDStep(opt, [p]).step([W], [G], [g], [w])
    ref = nn.Parameter(p.detach().clone())
    opt2 = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    ref.grad = G.contiguous()
    opt2.step()
    w2 = torch.empty(6, 5)
    TentativeStep(opt2, [ref]).step([ref.data], [g.contiguous()], [w2])
    assert torch.equal(W, ref.detach()) and torch.equal(w, w2)


#: the Adam variants the fused kernel takes (AdamW's decoupled decay; Adam without decay;
#: 1 - beta1 >= 0.5, torch's other lerp branch; another eps)
ADAM_FUSED_VARIANTS = {
    "adam": VARIANTS["adam"],
    "adamw": VARIANTS["adamw"],
    "adamw-betas": lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.3, 0.9), weight_decay=1e-2, eps=1e-6),
}


class _Wide(nn.Module):
    """Small layers and a 70,000-element one: on an MKL build torch's float sqrt is one ulp off
    for some elements of a tensor that size, so a kernel taking its own square root fails."""

    def __init__(self):
        super().__init__()
        self.small = _model()
        self.wide = nn.Linear(700, 100)


def _skip_without_fused_adam() -> None:
    """Skip (saying why) where the kernel is not built or no rounding of it reproduces this
    torch build's on this CPU: CP-SGD then takes the torch operations (tested elsewhere)."""
    lib = kernels.library()
    if lib is None or not getattr(lib, "has_adam", False):
        pytest.skip("native Adam kernel not built")
    if FusedAdamStep.rounding() is None:
        pytest.skip("no rounding of the native Adam step agrees with this torch build on this CPU")


@pytest.mark.parametrize("variant", sorted(ADAM_FUSED_VARIANTS))
def test_fused_adam_step_equals_optimizer_step_then_tentative_step(variant):
    """Five pipelined steps (the first creates the state), with parameters that lack the averaged
    gradient, the local one, or both at some steps: W, w and the optimizer state equal
    ``optimizer.step()`` followed by ``TentativeStep.step`` bit for bit (a larger layer than
    the start-up probe's, where torch's sqrt is not correctly rounded)."""
    _skip_without_fused_adam()
    def make_model():
        torch.manual_seed(0)
        return _Wide()

    def make_optimizer(model):
        params = list(model.parameters())
        return ADAM_FUSED_VARIANTS[variant]([{"params": params[:4]}, {"params": params[4:], "lr": 0.01}])

    def grads(model, params, s):
        torch.manual_seed(10 + s)
        G = [torch.randn_like(p) * 1e-2 for p in params]
        g = [torch.randn_like(p) * 1e-2 for p in params]
        G[-4] = None                 # the small model's last weight: no averaged gradient, ever
        if s == 1:
            G[0] = None              # no rank had this gradient at this step
        if s == 2:
            g[1] = None              # this rank had no local gradient
        if s == 3:
            G[-4], g[-4] = None, None
        return G, g

    _assert_fused_equals_torch(FusedAdamStep, make_model, make_optimizer, grads)


def test_fused_adam_step_says_why_it_is_not_used():
    model = _model()
    params = list(model.parameters())
    assert "not a plain torch.optim.Adam" in FusedAdamStep.unavailable(torch.optim.SGD(params, lr=0.1), params)
    for opt in (torch.optim.Adam(params, amsgrad=True), torch.optim.AdamW(params, maximize=True),
                torch.optim.AdamW(params, foreach=True)):
        assert FusedAdamStep.unavailable(opt, params) == "amsgrad, maximize or foreach=True"
    assert "coupled weight decay" in FusedAdamStep.unavailable(torch.optim.Adam(params, weight_decay=1e-2), params)
    opt = torch.optim.AdamW(params)
    handle = opt.register_step_pre_hook(lambda *a: None)
    assert FusedAdamStep.unavailable(opt, params) == "optimizer step hooks are registered"
    handle.remove()
    assert "fp32" in FusedAdamStep.unavailable(opt, [p.detach().half() for p in params])
    lib = kernels.library()
    if lib is not None and getattr(lib, "has_adam", False):
        if FusedAdamStep.rounding() is None:
            assert "no rounding" in FusedAdamStep.unavailable(opt, params)
        else:
            assert FusedAdamStep.unavailable(opt, params) is None
