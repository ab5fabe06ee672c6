"""CP-SGD: compressed, pipelined SGD with periodic full-precision correction (spec A.2).

Per worker: global weights W (identical on every rank; the user's optimizer acts on them),
compute weights w (the model's parameters), a worker residual e, one communication in flight.
For iteration t after the warm-up::

    backward at w             -> local mean gradient g_t; its buckets are handed, during
                                 backward, to a background thread that compresses (with error
                                 feedback) and averages them; every k-th step full precision
    engine.step():  wait for step t-1's average G_{t-1} (it ran while t was computed)
                    W <- optimizer(W, G_{t-1})                        (= W_{t-1})
                    w <- local_update(W_{t-1}, g_t)                   (e.g. W_{t-1} - alpha g_t)
    go to t+1 with w: compression and communication of g_t overlap with iteration t+1

Degenerate cases (tested against a slow single-process simulation): warm-up forever is S-SGD;
``correction_period=1`` is one-step-delayed full-precision SGD with local compensation;
``local_update="none"`` with no correction is one-step-stale compressed SGD with error feedback.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from ..pipeline import PendingReduce, make_collective
from .base import Algorithm, EngineContext
from .buckets import Bucket, BucketSet
from ..compressors import build_compressor
from .compressed import bucket_segments, check_compression_knobs
from ..collectives.wire import MIB

LOCAL_UPDATES = ("sgd", "optimizer", "none")


@dataclass
class CPSGD(Algorithm):
    """Knobs (defaults chosen by the measurements in docs/cpsgd.md):

        compressor, compressor_options, collective, bucket_mb: as for ``compressed``; the
            default is the paper's 2-bit threshold codec on the two-stage collective.
        warmup_steps: plain synchronous full-precision SGD for this many steps first (the
            paper's code: 1000 iterations). Early gradients are large and change fast, which
            is where both staleness and quantization hurt most.
        correction_period: k. Every k-th post-warm-up step sends the full-precision gradient
            (the "k-step correction"), removing that step's quantization error. ``None`` never
            corrects; 1 never compresses.
        flush_residual_on_correction: False (faithful to the paper's code) leaves the residual
            untouched on correction steps; True adds it to the full-precision step and zeroes it,
            delivering everything compression held back.
        local_update: how w is formed from W_{t-1} and the worker's own gradient g_t:
            ``"sgd"``: w = W - local_lr * g_t (the paper's plain-SGD local optimizer);
            ``"optimizer"``: w = the user's optimizer applied tentatively to W with g_t
            (momentum and weight decay included; a look-ahead estimate of W_t; its state is
            restored afterwards); ``"none"``: w = W_{t-1} (no local compensation).
        local_lr: alpha for ``"sgd"``; ``None`` uses the optimizer's current learning rate of
            each parameter group (the paper's code uses 0.01/P with its summed gradients).
    """

    compressor: str = "2bit"
    compressor_options: dict[str, Any] = field(default_factory=dict)
    collective: str = "two-stage"
    bucket_mb: float = 1.0
    warmup_steps: int = 50
    correction_period: Optional[int] = 5
    flush_residual_on_correction: bool = False
    local_update: str = "optimizer"
    local_lr: Optional[float] = None

    name: ClassVar[str] = "cpsgd"

    def __post_init__(self) -> None:
        check_compression_knobs(self.name, self.compressor, self.compressor_options, self.collective,
                                self.bucket_mb, error_feedback=True)
        if self.warmup_steps < 0:
            raise ValueError(f"cpsgd: warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.correction_period is not None and self.correction_period < 1:
            raise ValueError(f"cpsgd: correction_period must be >= 1 or None, got {self.correction_period}")
        if self.local_update not in LOCAL_UPDATES:
            raise ValueError(f"cpsgd: local_update must be one of {LOCAL_UPDATES}, got {self.local_update!r}")
        if self.local_lr is not None and self.local_lr < 0:
            raise ValueError(f"cpsgd: local_lr must be >= 0, got {self.local_lr}")

    # -- setup ---------------------------------------------------------------------------
    def bind(self, ctx: EngineContext) -> None:
        self.ctx = ctx
        codec = build_compressor(self.compressor, self.compressor_options, error_feedback=True)
        self.reducer = make_collective(self.collective, ctx.comm, codec)
        self.buckets = BucketSet(ctx.params, range(len(ctx.params)), int(self.bucket_mb * MIB), self._launch)
        self.segments = [bucket_segments(ctx.names, ctx.params, b.param_indices) for b in self.buckets.buckets]
        group_index = {id(p): k for k, g in enumerate(ctx.optimizer.param_groups) for p in g["params"]}
        self.group_of = [group_index.get(id(p)) for p in ctx.params]   # optimizer group (None: not optimized)
        self.t = 0                                   # iterations completed
        self.global_weights: Optional[list[torch.Tensor]] = None   # W while pipelining
        self.in_flight: Optional[list[PendingReduce]] = None       # step t-1's averages
        self.corrections = 0

    # -- schedule (pure functions of the agreed step counter) ------------------------------
    def in_warmup(self, t: int) -> bool:
        return t < self.warmup_steps

    def is_correction(self, t: int) -> bool:
        if self.in_warmup(t):
            return True
        return self.correction_period is not None and (t - self.warmup_steps) % self.correction_period == 0

    # -- iteration ----------------------------------------------------------------------
    def _launch(self, b: Bucket) -> PendingReduce:
        key, segments = f"bucket{b.index}", self.segments[b.index]
        if self.is_correction(self.t):
            flush = self.flush_residual_on_correction and not self.in_warmup(self.t)
            return self.reducer.start_full_precision(b.grads, key, segments, flush_residuals=flush)
        return self.reducer.start(b.grads, key, segments)

    def on_gradient_ready(self, index: int) -> None:
        self.buckets.mark_ready(index)

    def step(self) -> None:
        self.buckets.launch_remaining()
        handles = [b.handle for b in self.buckets.buckets]
        if self.in_warmup(self.t):
            # plain synchronous SGD: the model holds the global weights
            self._apply(handles)
            self.ctx.optimizer.step()
        else:
            local_grads = [p.grad for p in self.ctx.params]
            if self.global_weights is None:      # first pipelined step: W = current weights
                self.global_weights = [p.detach().clone() for p in self.ctx.params]
            else:
                self._apply_to_global(self.in_flight)
            self._local_update(local_grads)
            self.in_flight = handles
        if self.is_correction(self.t) and not self.in_warmup(self.t):
            self.corrections += 1
        self.t += 1
        self.buckets.reset()

    def _apply(self, handles: list[PendingReduce]) -> None:
        """Wait for averaged buckets and write them into ``.grad``."""
        for b, h in zip(self.buckets.buckets, handles):
            b.grads.copy_(h.wait())
            b.flags.fill_(1.0)
            self.buckets.write_gradients(b)

    def _apply_to_global(self, handles: list[PendingReduce]) -> None:
        """W <- optimizer(W, averaged gradient of the previous step). The optimizer's
        parameters are the model's tensors, so W is swapped into them for the step."""
        params = self.ctx.params
        with torch.no_grad():
            for p, w in zip(params, self.global_weights):
                p.copy_(w)
        for p in params:
            p.grad = None
        self._apply(handles)
        self.ctx.optimizer.step()
        with torch.no_grad():
            for p, w in zip(params, self.global_weights):
                w.copy_(p)

    def _local_update(self, local_grads: list[Optional[torch.Tensor]]) -> None:
        """w <- local_update(W, g_t); the model then holds w."""
        params = self.ctx.params
        with torch.no_grad():
            for p, w in zip(params, self.global_weights):
                p.copy_(w)
        if self.local_update == "none":
            return
        if self.local_update == "sgd":
            groups = self.ctx.optimizer.param_groups
            with torch.no_grad():
                for p, g, k in zip(params, local_grads, self.group_of):
                    if g is not None and k is not None:
                        p.add_(g, alpha=-(groups[k]["lr"] if self.local_lr is None else self.local_lr))
            return
        # "optimizer": a tentative step of the user's optimizer, its state restored afterwards
        opt = self.ctx.optimizer
        saved = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()} for p, st in opt.state.items()}
        for p, g in zip(params, local_grads):
            p.grad = g
        opt.step()
        opt.state.clear()
        for p, st in saved.items():
            opt.state[p] = st

    def drain(self) -> None:
        """Finish the in-flight step; the model then holds W and the pipeline restarts empty."""
        if self.in_flight is not None:
            self._apply_to_global(self.in_flight)
            self.in_flight = None
        if self.global_weights is not None:
            with torch.no_grad():
                for p, w in zip(self.ctx.params, self.global_weights):
                    p.copy_(w)
            self.global_weights = None

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.in_flight is not None:
            raise RuntimeError("cpsgd has a step in flight: call engine.synchronize() before state_dict()")
        return {"t": self.t, "corrections": self.corrections, "collective": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = int(state["t"])
        self.corrections = int(state["corrections"])
        self.reducer.load_state_dict(state["collective"])
        self.in_flight, self.global_weights = None, None

    def close(self) -> None:
        self.reducer.close()
