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
clones the whole optimizer state each call; the closed form reads and writes each tensor a
few times and allocates nothing.
"""
from __future__ import annotations

import copy
import ctypes
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch

Tensors = Sequence[torch.Tensor]


#: the param group settings that schedulers change between steps (torch's LR schedulers:
#: ``lr``; OneCycleLR and CyclicLR with cycle_momentum: ``momentum`` or ``betas``)
SCHEDULED_SETTINGS = ("lr", "momentum", "betas", "weight_decay")


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's scheduled settings (:data:`SCHEDULED_SETTINGS`), as a step reads
    them. Not the rest: a setting the step itself changes (a counter some optimizers keep in
    the group) must go on from where it is."""
    return [{k: g[k] for k in SCHEDULED_SETTINGS if k in g} for g in optimizer.param_groups]


@contextmanager
def using_hyperparameters(optimizer: torch.optim.Optimizer, saved: Optional[list[dict[str, Any]]]) -> Iterator[None]:
    """Run a step with the settings ``saved`` (:func:`hyperparameters`; None: as they are):
    a step applied later than the step that computed its gradient (CP-SGD's in-flight average
    at ``synchronize()``, the lazy update's open window) uses that step's learning rate, not
    what a scheduler has set since. The settings that differed are put back after."""
    if saved is None:
        yield
        return
    groups = optimizer.param_groups
    changed = [{k: g[k] for k, v in s.items() if k in g and g[k] is not v} for g, s in zip(groups, saved)]
    for g, s, c in zip(groups, saved, changed):
        g.update({k: s[k] for k in c})
    try:
        yield
    finally:
        for g, c in zip(groups, changed):
            g.update(c)


def unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without its step pre/post hooks (and without an LR scheduler's
    count of calls): for steps that are not the user's step (a tentative one)."""
    step = type(optimizer).step
    raw = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if raw is None:
        optimizer.step()
    else:
        raw(optimizer)


def param_group_of(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[Optional[int]]:
    """Index of the optimizer's param group holding each parameter (None: no group holds it)."""
    index = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
    return [index.get(id(p)) for p in params]


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


class Scratch:
    """Work space shaped like ``params``: ``lists(n)`` is n lists of one tensor per parameter,
    allocated at the first call that needs them and kept. Steps that never run at the same time
    (CP-SGD's tentative step and its fused step) may share one."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self._lists: list[list[torch.Tensor]] = []

    def lists(self, n: int) -> list[list[torch.Tensor]]:
        while len(self._lists) < n:
            self._lists.append([torch.empty_like(p) for p in self.params])
        return self._lists[:n]


class TentativeStep:
    """``step(start, grads, out)``: ``out[i] = optimizer step of start[i] with grads[i]``.

    ``params`` are the parameters the optimizer steps (aligned with ``start``/``grads``/``out``);
    a parameter whose gradient is None, or that no param group holds, is copied unchanged (a
    torch optimizer skips it). ``out`` may be ``params`` themselves; it must not alias ``start``.
    ``generic=True`` forces the fallback (tests compare the two). ``scratch``: the closed forms'
    work space (:class:`Scratch`, default its own).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], generic: bool = False,
                 scratch: Optional[Scratch] = None):
        self.optimizer = optimizer
        self.params = list(params)
        self.group_of = param_group_of(optimizer, self.params)
        self.kind = None if generic else closed_form_kind(optimizer)
        self.scratch = scratch or Scratch(self.params)

    @property
    def _scratch(self) -> list[list[torch.Tensor]]:
        return self.scratch.lists({"sgd": 2, "adam": 3}.get(self.kind, 0))

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
        scratch = self._scratch
        d = [scratch[0][i] for i in idx]
        torch._foreach_copy_(d, [grads[i] for i in idx])
        if group.get("maximize", False):
            torch._foreach_neg_(d)
        w = [start[i] for i in idx]
        if wd != 0:
            torch._foreach_add_(d, w, alpha=wd)
        if momentum != 0:
            states = [self.optimizer.state.get(self.params[i], {}) for i in idx]
            bufs = [scratch[1][i] for i in idx]
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
        lr, eps = group["lr"], group["eps"]
        beta1, beta2 = group["betas"]
        amsgrad = group.get("amsgrad", False)
        decoupled, wd = _adam_group_options(self.optimizer, group)
        states = [self.optimizer.state.get(self.params[i], {}) for i in idx]
        scratch = self._scratch
        m = [scratch[0][i] for i in idx]
        v = [scratch[1][i] for i in idx]
        denom = [scratch[2][i] for i in idx]      # first the (decayed) gradient, then the denominator
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
        optimizer state, its param groups' settings, the parameters' values (when ``out`` is
        not the parameters) and their ``.grad`` are restored. The step's hooks do not run:
        it is not one of the user's steps."""
        opt, params = self.optimizer, self.params
        saved_state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                       for p, st in opt.state.items()}
        saved_groups = [{k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in g.items()
                         if k != "params"} for g in opt.param_groups]
        in_place = all(o.data_ptr() == p.data_ptr() for o, p in zip(out, params))
        saved_values = None if in_place else [p.detach().clone() for p in params]
        saved_grads = [p.grad for p in params]
        for p, s, g in zip(params, start, grads):
            p.copy_(s)
            p.grad = g
        unhooked_step(opt)
        if not in_place:
            for o, p, v in zip(out, params, saved_values):
                o.copy_(p)
                p.copy_(v)
        for p, g in zip(params, saved_grads):
            p.grad = g
        opt.state.clear()
        for p, st in saved_state.items():
            opt.state[p] = st
        for g, saved in zip(opt.param_groups, saved_groups):
            for k in [k for k in g if k != "params" and k not in saved]:
                del g[k]
            g.update(saved)


# -- CP-SGD's global step and local update in one native pass ------------------------------
_SGD_GLOBAL, _SGD_HAS_BUF, _SGD_LOCAL, _SGD_MOMENTUM, _SGD_WD, _SGD_NESTEROV, _SGD_MAXIMIZE = 1, 2, 4, 8, 16, 32, 64


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optim_module
    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None) or
                getattr(optimizer, "_optimizer_step_post_hooks", None) or
                optim_module._global_optimizer_pre_hooks or optim_module._global_optimizer_post_hooks)


class _FusedStep:
    """What the fused optimizer steps share: the optimizer, its parameters and their groups, the
    native library, and the walk over parameters that have a gradient to apply."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
                 scratch: Optional[Scratch] = None):
        from .. import _native as kernels
        self.optimizer = optimizer
        self.params = list(params)
        self.group_of = param_group_of(optimizer, self.params)
        self._lib = kernels.library()
        self.scratch = scratch or Scratch(self.params)    # work space, where a kernel needs one

    def _operands(self, W: Tensors, G: Sequence[Optional[torch.Tensor]], g: Sequence[Optional[torch.Tensor]],
                  w: Tensors) -> Iterator[tuple[int, torch.nn.Parameter, dict, Optional[torch.Tensor],
                                                Optional[torch.Tensor]]]:
        """``(i, parameter, param group, G[i], g[i])`` of every parameter with an averaged or a
        local gradient (a parameter no group holds has neither); ``w[i] = W[i]`` for the others."""
        groups = self.optimizer.param_groups
        for i, p in enumerate(self.params):
            k = self.group_of[i]
            Gi = G[i] if k is not None else None
            gi = g[i] if k is not None else None
            if Gi is None and gi is None:
                w[i].copy_(W[i])
                continue
            yield i, p, groups[k], Gi, gi

    def _record_step(self) -> None:
        if hasattr(self.optimizer.step, "_wrapped_by_lr_sched"):
            self.optimizer._opt_called = True    # what the scheduler's wrapper of step() records


class FusedSGDStep(_FusedStep):
    """``step(W, G, g, w)``: the user's ``torch.optim.SGD`` step of the global weights ``W``
    with the averaged gradients ``G`` (in place, momentum buffers in the optimizer's state,
    as ``optimizer.step()`` leaves them) and the tentative step of ``g`` from the new ``W``
    into ``w`` (:class:`TentativeStep`), in one pass of the native kernel per tensor
    (``lowband_sgd.c``) instead of two optimizer passes of about a dozen torch operations.
    Bit-identical to ``optimizer.step()`` followed by ``TentativeStep.step`` (tested).

    A ``G[i]`` of None leaves ``W[i]`` and its state alone (a torch optimizer skips it);
    a ``g[i]`` of None makes ``w[i] = W[i]``.

    :meth:`unavailable` says why it cannot be used (None: it can): not plain SGD, step
    hooks registered (they would not run), tensors not contiguous fp32 on the CPU, the
    native library missing, or its rounding differs from torch's on this CPU (probed once).
    """

    _probe: Optional[bool] = None

    @classmethod
    def unavailable(cls, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> Optional[str]:
        from .. import _native as kernels
        if closed_form_kind(optimizer) != "sgd":
            return "the optimizer is not a plain torch.optim.SGD"
        if any(g.get("foreach") for g in optimizer.param_groups):
            return "foreach=True"
        if _has_step_hooks(optimizer):
            return "optimizer step hooks are registered"
        if any(p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous() for p in params):
            return "parameters are not contiguous fp32 CPU tensors"
        if kernels.library() is None:
            return kernels.unavailable_reason() or f"{kernels.ENV}=torch"
        if not cls._agrees_with_torch():
            return "the native SGD step rounds differently from torch's on this CPU"
        return None

    @classmethod
    def _agrees_with_torch(cls) -> bool:
        """One-time probe: the kernel against ``optimizer.step()`` + ``TentativeStep`` on
        small random tensors, for every flag the kernel has."""
        if cls._probe is None:
            cls._probe = all(_probe_case(**kw) for kw in (
                dict(momentum=0.9, weight_decay=1e-4), dict(momentum=0.9, nesterov=True, weight_decay=5e-4),
                dict(momentum=0.5, dampening=0.25, maximize=True), dict()))
        return cls._probe

    @torch.no_grad()
    def step(self, W: Tensors, G: Sequence[Optional[torch.Tensor]], g: Sequence[Optional[torch.Tensor]],
             w: Tensors) -> None:
        lib, state = self._lib, self.optimizer.state
        for i, p, group, Gi, gi in self._operands(W, G, g, w):
            mu, wd = group["momentum"], group["weight_decay"]
            flags = ((_SGD_GLOBAL if Gi is not None else 0) | (_SGD_LOCAL if gi is not None else 0) |
                     (_SGD_MOMENTUM if mu != 0 else 0) | (_SGD_WD if wd != 0 else 0) |
                     (_SGD_NESTEROV if group["nesterov"] else 0) | (_SGD_MAXIMIZE if group.get("maximize") else 0))
            buf = state[p].get("momentum_buffer") if p in state else None
            if mu != 0 and buf is None and Gi is not None:    # first step: torch's buf = grad.clone()
                buf = torch.empty_like(W[i])
                state[p]["momentum_buffer"] = buf
            elif buf is not None and mu != 0:
                flags |= _SGD_HAS_BUF
            Gi, gi = _kernel_operand(Gi), _kernel_operand(gi)
            lib.lb_sgd_pipeline(W[i].data_ptr(), None if buf is None or mu == 0 else buf.data_ptr(),
                                None if Gi is None else Gi.data_ptr(), None if gi is None else gi.data_ptr(),
                                w[i].data_ptr(), W[i].numel(), -group["lr"], wd, mu, 1 - group["dampening"], flags)
        self._record_step()


def _kernel_operand(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A gradient as the kernel reads it: contiguous fp32 on the CPU (copied only if not)."""
    if t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"):
        return t
    return t.detach().to("cpu", torch.float32).contiguous()


def _probe_case(n: int = 67, **options) -> bool:
    """Two fused steps (the first creates the momentum buffer) equal the torch sequence."""
    gen = torch.Generator().manual_seed(n)
    start = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    results = []
    for fused in (False, True):
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.SGD([p], lr=0.1, **options)
        w = torch.empty(n)
        for G, g in ((grads[0], grads[1]), (grads[2], grads[3])):
            if fused:
                FusedSGDStep(opt, [p]).step([p.data], [G], [g], [w])
            else:
                p.grad = G
                opt.step()
                TentativeStep(opt, [p]).step([p.data], [g], [w])
        buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
        results.append((p.detach().clone(), w.clone(), None if buf is None else buf.clone()))
    (p0, w0, b0), (p1, w1, b1) = results
    same_buf = (b0 is None and b1 is None) or (b0 is not None and b1 is not None and torch.equal(b0, b1))
    return torch.equal(p0, p1) and torch.equal(w0, w1) and same_buf


# -- the same for torch.optim.Adam / AdamW, in two native passes ---------------------------
_ADAM_GLOBAL, _ADAM_LOCAL, _ADAM_STATE, _ADAM_DECOUPLED = 1, 2, 4, 8
_ADAM_LERP_FMA, _ADAM_ADDCMUL_FMA, _ADAM_LERP_BIG = 16, 32, 64
#: how torch may round its lerp and addcmul (each one fused multiply-add or not), in the order
#: the probe tries them; the first that reproduces torch bit for bit is used
_ADAM_ROUNDINGS = (_ADAM_LERP_FMA | _ADAM_ADDCMUL_FMA, _ADAM_LERP_FMA, _ADAM_ADDCMUL_FMA, 0)


def _adam_group_options(optimizer: torch.optim.Optimizer, group: dict) -> tuple[bool, float]:
    """(decoupled, weight decay) of a param group, as torch's Adam / AdamW read them."""
    decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
    return bool(decoupled), group["weight_decay"]


class FusedAdamStep(_FusedStep):
    """:class:`FusedSGDStep` for ``torch.optim.Adam`` and ``AdamW``: the user's optimizer step
    of the global weights ``W`` with the averaged gradients ``G`` (state updated as
    ``optimizer.step()`` leaves it) and the tentative step of ``g`` from the new ``W`` into
    ``w``, in two native passes per tensor (``lowband_adam.c``) around one ``torch.sqrt`` of
    all tensors (torch's float square root is not always correctly rounded, so it stays
    torch's), instead of two optimizer passes of about a dozen torch operations each.
    Bit-identical to ``optimizer.step()`` followed by ``TentativeStep.step`` (probed at
    start-up, tested).

    :meth:`unavailable` says why it cannot be used (None: it can): not a plain Adam / AdamW,
    amsgrad, maximize, foreach, Adam's coupled weight decay, step hooks, tensors not contiguous
    fp32 on the CPU, the native library missing, or no rounding of the kernel's that agrees with
    torch's on this CPU.
    """

    _rounding: Optional[int] = None     # the probed flags; -1: none agrees

    @classmethod
    def unavailable(cls, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> Optional[str]:
        from .. import _native as kernels
        if closed_form_kind(optimizer) != "adam":
            return "the optimizer is not a plain torch.optim.Adam or AdamW"
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("foreach"):
                return "amsgrad, maximize or foreach=True"
            decoupled, wd = _adam_group_options(optimizer, group)
            if wd != 0 and not decoupled:
                return "Adam's coupled weight decay (use AdamW)"
        if _has_step_hooks(optimizer):
            return "optimizer step hooks are registered"
        if any(p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous() for p in params):
            return "parameters are not contiguous fp32 CPU tensors"
        lib = kernels.library()
        if lib is None:
            return kernels.unavailable_reason() or f"{kernels.ENV}=torch"
        if not getattr(lib, "has_adam", False):
            return "the native library was built without the Adam kernel"
        if cls.rounding() is None:
            return "no rounding of the native Adam step agrees with torch's on this CPU"
        return None

    @classmethod
    def rounding(cls) -> Optional[int]:
        """One-time probe: the flags (lerp and addcmul fused or not) with which the kernel
        equals ``optimizer.step()`` + ``TentativeStep`` on random tensors, every variant it
        has; None if no choice does."""
        if cls._rounding is None:
            cls._rounding = next((r for r in _ADAM_ROUNDINGS if all(
                _adam_probe_case(r, **kw) for kw in (
                    dict(kind="adamw", weight_decay=0.1), dict(kind="adam", betas=(0.8, 0.95)),
                    dict(kind="adamw", weight_decay=1e-2, betas=(0.3, 0.9), n=4099)))), -1)
        return None if cls._rounding < 0 else cls._rounding

    @torch.no_grad()
    def step(self, W: Tensors, G: Sequence[Optional[torch.Tensor]], g: Sequence[Optional[torch.Tensor]],
             w: Tensors, rounding: Optional[int] = None) -> None:
        lib, state = self._lib, self.optimizer.state
        rounding = self.rounding() if rounding is None else rounding
        vg, ml, vl = self.scratch.lists(3)    # vg, vl: the moments whose sqrt torch takes; ml
        jobs, roots, options = [], [], {}
        for i, p, group, Gi, gi in self._operands(W, G, g, w):
            st = state[p] if Gi is not None or p in state else {}    # (a defaultdict: no entry made)
            if Gi is not None and not st:        # torch's _init_group
                st["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if id(group) not in options:
                options[id(group)] = self._group_flags(group, rounding)
            group_flags, lr, eps, beta1, beta2, decay = options[id(group)]
            flags = group_flags | (_ADAM_GLOBAL if Gi is not None else 0) | (_ADAM_LOCAL if gi is not None else 0)
            if "exp_avg" in st:
                flags |= _ADAM_STATE
            if Gi is not None:
                st["step"] += 1
            s_global = float(st["step"]) if "step" in st else 0.0
            s_local = s_global + 1
            Gi, gi = _kernel_operand(Gi), _kernel_operand(gi)
            m, v = (st["exp_avg"], st["exp_avg_sq"]) if "exp_avg" in st else (None, None)
            lib.lb_adam_moments(W[i].data_ptr(), _address(m), _address(v), _address(Gi), _address(gi),
                                ml[i].data_ptr(), vl[i].data_ptr(), vg[i].data_ptr(), W[i].numel(),
                                decay, 1 - beta1, beta2, 1 - beta2, flags)
            if Gi is not None:
                roots.append(vg[i])
            if gi is not None:
                roots.append(vl[i])
            bc_g = (1 - beta2 ** s_global) ** 0.5 if Gi is not None else 1.0
            ss_g = -(lr / (1 - beta1 ** s_global)) if Gi is not None else 0.0
            jobs.append((i, m, flags, bc_g, ss_g, (1 - beta2 ** s_local) ** 0.5, -(lr / (1 - beta1 ** s_local)),
                         eps, decay))
        if roots:
            torch._foreach_sqrt_(roots)
        for i, m, flags, bc_g, ss_g, bc_l, ss_l, eps, decay in jobs:
            lib.lb_adam_apply(W[i].data_ptr(), _address(m), vg[i].data_ptr(), w[i].data_ptr(), ml[i].data_ptr(),
                              vl[i].data_ptr(), W[i].numel(), bc_g, ss_g, bc_l, ss_l, eps, decay, flags)
        self._record_step()

    def _group_flags(self, group: dict, rounding: int) -> tuple[int, float, float, float, float, float]:
        """A param group's part of the kernel flags, and its lr, eps, betas and decay factor."""
        beta1, beta2 = group["betas"]
        decoupled, wd = _adam_group_options(self.optimizer, group)
        flags = rounding | (_ADAM_DECOUPLED if decoupled and wd != 0 else 0)
        if abs(ctypes.c_float(1 - beta1).value) >= 0.5:     # torch tests the weight as a float
            flags |= _ADAM_LERP_BIG
        return flags, group["lr"], group["eps"], beta1, beta2, 1 - group["lr"] * wd


def _address(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _scalar_dtype() -> torch.dtype:
    """The dtype of torch's Adam ``state["step"]`` (float64 under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _adam_probe_case(rounding: int, kind: str, n: int = 67, weight_decay: float = 0.0,
                     betas: tuple[float, float] = (0.9, 0.999)) -> bool:
    """Three fused steps (the first creates the state; the last without a global gradient)
    equal the torch sequence: W, the state and w, bit for bit."""
    gen = torch.Generator().manual_seed(n)
    start = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(6)]
    grads[4] = None                      # step 3: only a local gradient
    make = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    results = []
    for fused in (False, True):
        p = torch.nn.Parameter(start.clone())
        opt = make([p], lr=1e-3, betas=betas, weight_decay=weight_decay)
        w = torch.empty(n)
        for G, gl in zip(grads[0::2], grads[1::2]):
            if fused:
                FusedAdamStep(opt, [p]).step([p.data], [G], [gl], [w], rounding=rounding)
            else:
                if G is not None:
                    p.grad = G
                    opt.step()
                TentativeStep(opt, [p]).step([p.data], [gl], [w])
        st = opt.state[p]
        results.append((p.detach().clone(), w.clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(),
                        float(st["step"])))
    (p0, w0, m0, v0, s0), (p1, w1, m1, v1, s1) = results
    return torch.equal(p0, p1) and torch.equal(w0, w1) and torch.equal(m0, m1) and torch.equal(v0, v1) and s0 == s1
