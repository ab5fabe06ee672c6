"""A tentative optimizer step: what the user's optimizer *would* make of some weights and
gradients, written into other tensors, with the optimizer's state left untouched.

CP-SGD uses it twice: its look-ahead local update (w = step(W_{t-1}, g_t), an estimate of W_t
from the worker's own gradient) and :meth:`CPSGD.global_parameters` (the global model with the
in-flight average applied, for evaluation without draining).

For ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, maximize) and
``torch.optim.Adam`` / ``AdamW`` (weight decay coupled or decoupled, amsgrad, maximize) the
step is computed in closed form into buffers allocated once, with the same elementwise
operations in the same order as PyTorch's single-tensor implementations, so the result equals
a real ``optimizer.step()`` bit for bit (tests/test_local_update.py). Any other optimizer, or
these with ``capturable``/``differentiable``/``fused``/tensor learning rates, goes through the
generic fallback: save the state, step for real, copy the result out, restore. The fallback
clones the whole optimizer state each call (77 ms per step for 25M parameters with
SGD+momentum, 206 ms with Adam, on one core); the closed form reads and writes each tensor a
few times and allocates nothing.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

Tensors = Sequence[torch.Tensor]


def _plain_group(group: dict) -> bool:
    """Whether a param group uses only options the closed forms reproduce."""
    if any(group.get(k) for k in ("capturable", "differentiable", "fused")):
        return False
    return not torch.is_tensor(group.get("lr"))


def closed_form_kind(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """``"sgd"``, ``"adam"`` or None (generic fallback) for this optimizer instance."""
    if type(optimizer) is torch.optim.SGD:
        kind = "sgd"
    elif type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        kind = "adam"
    else:
        return None
    if not all(_plain_group(g) for g in optimizer.param_groups):
        return None
    if kind == "adam" and any(torch.is_tensor(b) for g in optimizer.param_groups for b in g["betas"]):
        return None
    return kind


class TentativeStep:
    """``step(start, grads, out)``: ``out[i] = optimizer step of start[i] with grads[i]``.

    ``params`` are the parameters the optimizer steps (aligned with ``start``/``grads``/``out``);
    a parameter whose gradient is None, or that no param group holds, is copied unchanged (a
    torch optimizer skips it). ``out`` may be ``params`` themselves; it must not alias ``start``.
    ``generic=True`` forces the fallback (tests compare the two).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], generic: bool = False):
        self.optimizer = optimizer
        self.params = list(params)
        group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.group_of = [group_of.get(id(p)) for p in self.params]
        self.kind = None if generic else closed_form_kind(optimizer)
        n_scratch = {"sgd": 2, "adam": 3}.get(self.kind, 0)
        self._scratch = [[torch.empty_like(p) for p in self.params] for _ in range(n_scratch)]

    @property
    def closed_form(self) -> bool:
        return self.kind is not None

    @torch.no_grad()
    def step(self, start: Tensors, grads: Sequence[Optional[torch.Tensor]], out: Tensors) -> None:
        if self.kind is None:
            self._generic(start, grads, out)
            return
        torch._foreach_copy_(list(out), list(start))
        by_group: dict[int, list[int]] = {}
        for i, (g, k) in enumerate(zip(grads, self.group_of)):
            if g is not None and k is not None:
                by_group.setdefault(k, []).append(i)
        run = self._sgd if self.kind == "sgd" else self._adam
        for k, idx in by_group.items():
            run(self.optimizer.param_groups[k], idx, start, grads, out)

    # -- closed forms (torch/optim/sgd.py and adam.py, single-tensor path) -----------------
    def _sgd(self, group: dict, idx: list[int], start: Tensors, grads, out: Tensors) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        dampening, nesterov = group["dampening"], group["nesterov"]
        d = [self._scratch[0][i] for i in idx]
        torch._foreach_copy_(d, [grads[i] for i in idx])
        if group.get("maximize", False):
            torch._foreach_neg_(d)
        w = [start[i] for i in idx]
        if wd != 0:
            torch._foreach_add_(d, w, alpha=wd)
        if momentum != 0:
            states = [self.optimizer.state.get(self.params[i], {}) for i in idx]
            bufs = [self._scratch[1][i] for i in idx]
            old = [st.get("momentum_buffer") for st in states]
            fresh = [b for b, o in zip(bufs, old) if o is None]
            if fresh:                                   # first step: buf = grad
                torch._foreach_copy_(fresh, [x for x, o in zip(d, old) if o is None])
            cont = [(b, o, x) for b, o, x in zip(bufs, old, d) if o is not None]
            if cont:
                cb, co, cd = (list(z) for z in zip(*cont))
                torch._foreach_copy_(cb, co)
                torch._foreach_mul_(cb, momentum)
                torch._foreach_add_(cb, cd, alpha=1 - dampening)
            if nesterov:
                torch._foreach_add_(d, bufs, alpha=momentum)
            else:
                d = bufs
        torch._foreach_add_([out[i] for i in idx], d, alpha=-lr)

    def _adam(self, group: dict, idx: list[int], start: Tensors, grads, out: Tensors) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        amsgrad = group.get("amsgrad", False)
        decoupled = group.get("decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW)
        states = [self.optimizer.state.get(self.params[i], {}) for i in idx]
        m = [self._scratch[0][i] for i in idx]
        v = [self._scratch[1][i] for i in idx]
        denom = [self._scratch[2][i] for i in idx]      # first the (decayed) gradient, then the denominator
        o = [out[i] for i in idx]
        g = [grads[i] for i in idx]
        if group.get("maximize", False) or (wd != 0 and not decoupled):
            torch._foreach_copy_(denom, g)
            if group.get("maximize", False):
                torch._foreach_neg_(denom)
            if wd != 0 and not decoupled:
                torch._foreach_add_(denom, [start[i] for i in idx], alpha=wd)
            g = denom
        if wd != 0 and decoupled:
            torch._foreach_mul_(o, 1 - lr * wd)
        for mi, vi, st in zip(m, v, states):
            if "exp_avg" in st:
                mi.copy_(st["exp_avg"])
                vi.copy_(st["exp_avg_sq"])
            else:
                mi.zero_()
                vi.zero_()
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        steps = [(float(st["step"]) if "step" in st else 0.0) + 1 for st in states]
        step_sizes = [-(lr / (1 - beta1 ** s)) for s in steps]
        bias_correction2_sqrt = [(1 - beta2 ** s) ** 0.5 for s in steps]
        if amsgrad:
            for di, vi, st in zip(denom, v, states):
                if "max_exp_avg_sq" in st:
                    torch.maximum(st["max_exp_avg_sq"], vi, out=di)
                else:
                    di.copy_(vi)        # the state starts at zeros and v >= 0
        else:
            torch._foreach_copy_(denom, v)
        torch._foreach_sqrt_(denom)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(o, m, denom, step_sizes)

    # -- fallback ------------------------------------------------------------------------
    def _generic(self, start: Tensors, grads, out: Tensors) -> None:
        """Step the real optimizer from ``start`` and copy the result to ``out``; the
        optimizer state, the parameters' values (when ``out`` is not the parameters) and
        their ``.grad`` are restored."""
        opt, params = self.optimizer, self.params
        saved_state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                       for p, st in opt.state.items()}
        in_place = all(o.data_ptr() == p.data_ptr() for o, p in zip(out, params))
        saved_values = None if in_place else [p.detach().clone() for p in params]
        saved_grads = [p.grad for p in params]
        for p, s, g in zip(params, start, grads):
            p.copy_(s)
            p.grad = g
        opt.step()
        if not in_place:
            for o, p, v in zip(out, params, saved_values):
                o.copy_(p)
                p.copy_(v)
        for p, g in zip(params, saved_grads):
            p.grad = g
        opt.state.clear()
        for p, st in saved_state.items():
            opt.state[p] = st
