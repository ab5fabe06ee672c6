"""Synchronous SGD: bucketed all-reduce (average), overlapped with backward."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.distributed as dist

from ..comm.wire import MIB
from .base import Algorithm, BoundAlgorithm, EngineContext
from .buckets import Bucket, BucketSet


@dataclass
class SSGD(Algorithm):
    """Plain data-parallel SGD, the reference every other algorithm is measured against.

    Knobs:
        bucket_mb: bucket size cap in MiB. Larger buckets mean fewer, more efficient
            collectives but less overlap (the first launch waits for more gradients). 25 MiB is
            DDP's default; on slow links the overlap matters more than per-call overhead, so
            smaller caps (1-4 MiB) can win — measure with ``benchmarks/overlap.py``.
        overlap: launch each bucket's all-reduce during backward (True) or only after
            backward (False, the "no overlap" baseline of the overlap benchmark).
        gradient_as_bucket_view: as DDP's knob of that name, off by default as there: after
            the all-reduce each ``.grad`` becomes its parameter's view of the bucket instead of
            a copy (``BucketSet.write_gradients``). Set it to save memory, as with DDP: with
            ``zero_grad(set_to_none=False)`` the gradients then live in the buckets, one
            gradient-sized allocation less (and a pass over the gradients less per step). The
            views are overwritten by the next backward's gradients, so a ``.grad`` kept across
            steps silently changes: opt in where no code does that.
    """

    bucket_mb: float = 1.0
    overlap: bool = True
    gradient_as_bucket_view: bool = False

    name: ClassVar[str] = "ssgd"

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"ssgd: bucket_mb must be > 0, got {self.bucket_mb}")

    def bind(self, ctx: EngineContext) -> "BoundSSGD":
        return BoundSSGD(self, ctx)


class BoundSSGD(BoundAlgorithm):
    """S-SGD bound to one engine: its gradient buckets."""

    cfg: SSGD
    captures_gradients: ClassVar[bool] = True
    clips: ClassVar[bool] = True
    scales: ClassVar[bool] = True

    def __init__(self, cfg: SSGD, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        self.buckets = BucketSet(ctx.params, range(len(ctx.params)), int(cfg.bucket_mb * MIB), self._launch)

    def _launch(self, b: Bucket):
        return self.ctx.comm.all_reduce(b.buffer, op=dist.ReduceOp.AVG, async_op=True)

    def on_gradient_ready(self, index: int) -> None:
        self.buckets.mark_ready(index, overlap=self.cfg.overlap)

    def step(self) -> None:
        self.buckets.launch_remaining()
        for b in self.buckets.buckets:
            b.handle.wait()
            self.buckets.write_gradients(b, as_views=self.cfg.gradient_as_bucket_view)
        self.ctx.optimizer_step()         # DDP + GradScaler + clip_grad_norm_: the averaged gradient
        self.buckets.reset()
