"""Lazy parameter update with an adaptive per-layer update interval (spec A.4, B.2).

Input-side layers get their gradients *last* in backprop, so their communication cannot hide
behind computation. This algorithm lets those layers ("lazy" layers) accumulate their local
gradients and synchronize only every ``tau`` steps, in one fused all-reduce, followed by one
optimizer step with the accumulated sum (momentum and weight decay applied once per sync). All
other layers are averaged every step by bucketed all-reduces overlapped with backward.

``tau`` adapts at each sync from the probe layer (the deepest lazy layer), comparing its latest
global gradient g with the accumulated global sum A (which includes g) over the n steps:

    angle_ok     := |g - A|^2 + |g|^2 <= |A|^2        (equivalently <g, A - g> >= 0)
    magnitude_ok := n |g|^2 <= |A|^2
    both -> tau + 1;  neither -> max(1, tau - 1);  otherwise tau unchanged

Both tests compare norms of agreed (all-reduced) tensors, so every rank takes the same decision,
and neither has a tunable threshold (scaling g and A together does not change them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..collectives.communicator import flatten
from .base import Algorithm, EngineContext
from .buckets import Bucket, BucketSet
from ..collectives.wire import MIB

VARIANTS = ("probe", "vote")
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
#: PCNN's NUM_LAZY_LAYERS: conv1 + stage 1 + the first stage-2 layer of ResNet-20
DEFAULT_LAZY_LAYERS = 8


def interval_update(g: torch.Tensor, acc: torch.Tensor, n: int, tau: int) -> tuple[int, bool, bool]:
    """The probe-layer rule of B.2.4: returns (new tau, angle_ok, magnitude_ok)."""
    g2 = float(torch.dot(g, g))
    a2 = float(torch.dot(acc, acc))
    d = g - acc
    angle_ok = float(torch.dot(d, d)) + g2 <= a2
    magnitude_ok = n * g2 <= a2
    if angle_ok and magnitude_ok:
        return tau + 1, angle_ok, magnitude_ok
    if not angle_ok and not magnitude_ok:
        return max(1, tau - 1), angle_ok, magnitude_ok
    return tau, angle_ok, magnitude_ok


def vote_update(gs: list[torch.Tensor], accs: list[torch.Tensor], tau: int) -> tuple[int, int]:
    """The all-layer variant: the angle test on every lazy layer; tau + 1 when none violates it,
    tau - 1 when more than half do. Returns (new tau, violations)."""
    violations = 0
    for g, a in zip(gs, accs):
        d = g - a
        if float(torch.dot(d, d)) + float(torch.dot(g, g)) > float(torch.dot(a, a)):
            violations += 1
    if violations == 0:
        return tau + 1, 0
    if violations > len(gs) / 2:
        return max(1, tau - 1), violations
    return tau, violations


def input_side_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own parameters, in registration order (the forward order of the usual
    sequential CNNs), excluding normalisation layers, which are always synchronized."""
    out = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and not isinstance(module, NORM_LAYERS):
            out.append((name, module))
    return out


@dataclass
class LazyUpdate(Algorithm):
    """Knobs:
        lazy_layers: how many input-side parameterized layers (norm layers excluded) are lazy.
            ``None`` (default) = PCNN's 8, but at most half of the model's layers: 8 is conv1,
            stage 1 and one stage-2 layer of ResNet-20 (8 of 21 layers, 5% of the weights),
            whereas on a 4-layer LeNet it would make the 400K-weight fc1 lazy too (measured:
            diverges at lr 0.05, momentum 0.9); the paper targets the input side, not most of
            the model. 0 = S-SGD.
        variant: ``"probe"`` (the released code: the deepest lazy layer decides) or ``"vote"``
            (the angle test on every lazy layer; its latest gradients are all reduced at syncs).
        tau_max: optional cap on the interval (not in the paper's code; None = no cap).
        bucket_mb: bucket cap for the regular layers' overlapped all-reduce.
    """

    lazy_layers: Optional[int] = None
    variant: str = "probe"
    tau_max: Optional[int] = None
    bucket_mb: float = 1.0

    name: ClassVar[str] = "lazy"

    def __post_init__(self) -> None:
        if self.lazy_layers is not None and self.lazy_layers < 0:
            raise ValueError(f"lazy: lazy_layers must be >= 0, got {self.lazy_layers}")
        if self.variant not in VARIANTS:
            raise ValueError(f"lazy: variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.tau_max is not None and self.tau_max < 1:
            raise ValueError(f"lazy: tau_max must be >= 1 or None, got {self.tau_max}")
        if not self.bucket_mb > 0:
            raise ValueError(f"lazy: bucket_mb must be > 0, got {self.bucket_mb}")

    def bind(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        layers = input_side_layers(ctx.model)
        wanted = min(DEFAULT_LAZY_LAYERS, len(layers) // 2) if self.lazy_layers is None else self.lazy_layers
        count = min(wanted, max(0, len(layers) - 1))
        index_of = {id(p): i for i, p in enumerate(ctx.params)}
        self.lazy_modules = [name for name, _ in layers[:count]]
        self.lazy_indices: list[int] = []
        self.layer_slices: list[list[int]] = []          # param indices per lazy layer
        for _, module in layers[:count]:
            idx = [index_of[id(p)] for p in module.parameters(recurse=False) if id(p) in index_of]
            self.layer_slices.append(idx)
            self.lazy_indices.extend(idx)
        lazy = set(self.lazy_indices)
        regular = [i for i in range(len(ctx.params)) if i not in lazy]
        self.is_lazy = [i in lazy for i in range(len(ctx.params))]
        self.buckets = BucketSet(ctx.params, regular, int(self.bucket_mb * MIB), self._launch)
        self.probe = self.layer_slices[-1] if self.layer_slices else []
        self.acc = [torch.zeros_like(ctx.params[i]) for i in self.lazy_indices]
        self.acc_of = {i: k for k, i in enumerate(self.lazy_indices)}   # parameter index -> accumulator
        self.tau = 1
        self.n = 0
        self.syncs = 0
        self.history: list[tuple[int, int]] = []         # (step, tau) after each sync
        self.t = 0

    def _launch(self, b: Bucket):
        return self.ctx.comm.all_reduce(b.buffer, op=dist.ReduceOp.AVG, async_op=True)

    def on_gradient_ready(self, index: int) -> None:
        if not self.is_lazy[index]:
            self.buckets.mark_ready(index)

    def step(self) -> None:
        params = self.ctx.params
        self.buckets.launch_remaining()
        sync_handle = None
        if self.lazy_indices:
            latest = []
            for k, i in enumerate(self.lazy_indices):
                g = params[i].grad
                if g is not None:
                    self.acc[k].add_(g)
                latest.append(g)
                params[i].grad = None           # the optimizer skips lazy layers between syncs
            self.n += 1
            if self.n >= self.tau:
                sync_handle, fused = self._launch_sync(latest)
        for b in self.buckets.buckets:
            b.handle.wait()
            self.buckets.write_gradients(b)
        if sync_handle is not None:
            sync_handle.wait()
            self._finish_sync(fused)
        self.ctx.optimizer.step()
        self.buckets.reset()
        self.t += 1

    def _launch_sync(self, latest: list[Optional[torch.Tensor]]):
        """One fused all-reduce: every lazy accumulator plus the latest gradients the interval
        rule needs (the probe layer's, or every lazy layer's for the vote variant)."""
        need = self.lazy_indices if self.variant == "vote" else self.probe
        pos = self.acc_of
        extra = [latest[pos[i]] if latest[pos[i]] is not None else torch.zeros_like(self.ctx.params[i]) for i in need]
        fused = flatten(self.acc + extra)
        return self.ctx.comm.all_reduce(fused, op=dist.ReduceOp.AVG, async_op=True), fused

    def _finish_sync(self, fused: torch.Tensor) -> None:
        params, offset = self.ctx.params, 0
        accs = []
        for k, i in enumerate(self.lazy_indices):
            n = params[i].numel()
            accs.append(fused[offset:offset + n])
            params[i].grad = fused[offset:offset + n].view_as(params[i]).clone()   # sum over n steps of global means
            offset += n
        pos = self.acc_of
        if self.variant == "probe":
            g = fused[offset:].clone()
            a = torch.cat([accs[pos[i]] for i in self.probe])
            tau, _, _ = interval_update(g, a, self.n, self.tau)
        else:
            gs, accs_by_layer, off = [], [], offset
            for layer in self.layer_slices:
                size = sum(params[i].numel() for i in layer)
                gs.append(fused[off:off + size])
                accs_by_layer.append(torch.cat([accs[pos[i]] for i in layer]))
                off += size
            tau, _ = vote_update(gs, accs_by_layer, self.tau)
        self.tau = tau if self.tau_max is None else min(tau, self.tau_max)
        for a in self.acc:
            a.zero_()
        self.n = 0
        self.syncs += 1
        self.history.append((self.t + 1, self.tau))

    def state_dict(self) -> dict[str, Any]:
        return {
            "tau": self.tau, "n": self.n, "syncs": self.syncs, "t": self.t,
            "accumulators": {self.ctx.names[i]: a.clone() for i, a in zip(self.lazy_indices, self.acc)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tau, self.n, self.syncs, self.t = int(state["tau"]), int(state["n"]), int(state["syncs"]), int(state["t"])
        saved = state["accumulators"]
        names = [self.ctx.names[i] for i in self.lazy_indices]
        if sorted(saved) != sorted(names):
            raise ValueError(f"lazy: checkpoint has accumulators for {sorted(saved)}, this model's lazy layers are {names}")
        for name, a in zip(names, self.acc):
            a.copy_(saved[name])
