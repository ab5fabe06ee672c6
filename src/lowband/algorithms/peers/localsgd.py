"""Local SGD with periodic model averaging — PyTorch's post-local SGD recipe
(``post_localSGD_hook`` for the warm-up + ``PeriodicModelAverager`` + ``PostLocalSGDOptimizer``).

Communication is traded for staleness: between averages each rank follows its own gradients,
so a run sends one parameter all-reduce every ``period`` steps instead of one gradient
all-reduce per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from ...comm.communicator import flatten, unflatten_into
from ..base import Algorithm, BoundAlgorithm, EngineContext, Finiteness
from ..buckets import Bucket, BucketSet
from ..warmup import Periodic, Warmup

#: one bucket for the whole model: the warm-up all-reduce runs after backward, so there is no
#: overlap to gain from smaller buckets, and one call has the least per-call overhead
ONE_BUCKET_BYTES = 1 << 62


@dataclass
class LocalSGD(Algorithm):
    """Each rank steps its optimizer on its local gradient; every ``period`` steps the
    parameters are averaged across ranks with one coalesced all-reduce (per dtype).

    The schedule is ``PeriodicModelAverager``'s exactly: with step counter s (0-based, counted
    in ``step()``), steps s < ``warmup_steps`` are ordinary synchronous SGD (gradients averaged
    before the optimizer step, as ``post_localSGD_hook`` does during its warm-up), and from then
    on the model is averaged after the optimizer step whenever (s - warmup_steps) % period == 0
    — so the first local step is followed by an average. Optimizer state (momentum, Adam
    moments) stays local, as in PyTorch.

    Knobs:
        period: optimizer steps between model averages. 1 with plain SGD is synchronous SGD;
            larger values divide the communication by ``period``. Default 4, a common choice in
            the local SGD literature that already cuts traffic 4x without much accuracy loss
            on small models.
        warmup_steps: synchronous gradient-averaging steps before local SGD starts. Early
            training is the most sensitive to replica drift (the "post-local SGD" finding of
            Lin et al., 2020). PyTorch's averager defaults to 0; lowband defaults to 10, 5% of
            a 200-step run, the same early-phase budget as ``ddp-powersgd``'s plain steps.
    """

    period: int = 4
    warmup_steps: int = 10

    name: ClassVar[str] = "localsgd"

    def __post_init__(self) -> None:
        if not isinstance(self.period, int) or isinstance(self.period, bool) or self.period < 1:
            raise ValueError(f"localsgd: period must be an integer >= 1, got {self.period!r}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ValueError(f"localsgd: warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")

    def bind(self, ctx: EngineContext) -> "BoundLocalSGD":
        return BoundLocalSGD(self, ctx)


class BoundLocalSGD(BoundAlgorithm):
    """Local SGD bound to one engine: the step counter, the in-sync flag, the warm-up buckets."""

    cfg: LocalSGD
    uses_gradient_hooks: ClassVar[bool] = False
    clips: ClassVar[bool] = True

    def __init__(self, cfg: LocalSGD, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        self._warmup = Warmup(cfg.warmup_steps)
        self._averaging = Periodic(cfg.period, start=cfg.warmup_steps)   # the averager's schedule
        self._step = 0
        # True while every rank is known to hold the same parameters (after a warm-up step or
        # an average); drain() then has nothing to do.
        self._in_sync = True
        self._grads = BucketSet(ctx.params, range(len(ctx.params)), ONE_BUCKET_BYTES, self._launch)

    def _launch(self, b: Bucket):
        return self.ctx.comm.all_reduce(b.buffer, op=dist.ReduceOp.AVG, async_op=True)

    # -- per iteration -------------------------------------------------------------------
    def _kind(self, t: int) -> str:
        """What step ``t`` does: ``"warmup"`` (gradients all-reduced), ``"average"`` (a local
        step ending with a parameter average) or ``"local"``."""
        if self._warmup.active(t):
            return "warmup"
        return "average" if self._averaging.fires(t) else "local"

    def finiteness(self) -> Finiteness:
        """A local step changes only this rank's replica, so the engine's finiteness check is
        decided at the next ``step()``, before anything of that step is applied or sent:
        local steps pay no per-step barrier. Warm-up steps (gradients all-reduced) and steps
        that end with an average decide at once, before the NaN could reach another rank."""
        return Finiteness.LATE if self._kind(self._step) == "local" else Finiteness.NOW

    def step(self) -> None:
        kind = self._kind(self._step)
        if kind == "warmup":
            self._average_gradients()
        # clipping: the averaged gradient in a warm-up step (DDP's), the local one otherwise
        if self.ctx.clip is not None:
            self.ctx.clip_gradients([p.grad for p in self.ctx.params])
        if kind == "warmup":
            self.ctx.optimizer.step()
        else:
            self.ctx.optimizer.step()
            self._in_sync = False
            if kind == "average":
                self._average_parameters()
        self._step += 1

    def step_metrics(self) -> dict[str, Any]:
        """``warmup``: whether the step just taken was a synchronous warm-up step;
        ``averaged``: whether it ended with a parameter average."""
        kind = self._kind(self._step - 1)
        return {"warmup": kind == "warmup", "averaged": kind == "average"}

    def _average_gradients(self) -> None:
        """Synchronous SGD for a warm-up step: one all-reduce of every gradient (with the
        had-a-gradient flags, so a parameter no rank used is still skipped)."""
        for i, p in enumerate(self.ctx.params):
            if p.grad is not None:
                self._grads.mark_ready(i, overlap=False)
        self._grads.launch_remaining()
        for b in self._grads.buckets:
            b.handle.wait()
            self._grads.write_gradients(b)
        self._grads.reset()

    def _averages(self) -> list[tuple[list[int], torch.Tensor]]:
        """Per dtype: the parameter indices and one all-reduced (averaged) flat copy of them."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(self.ctx.params):
            by_dtype.setdefault(p.dtype, []).append(i)
        out = []
        for indices in by_dtype.values():
            flat = flatten([self.ctx.params[i].detach() for i in indices])
            self.ctx.comm.all_reduce(flat, op=dist.ReduceOp.AVG)
            out.append((indices, flat))
        return out

    @torch.no_grad()
    def _average_parameters(self) -> None:
        if self.ctx.world_size > 1:
            for indices, flat in self._averages():
                unflatten_into(flat, [self.ctx.params[i].data for i in indices])
        self._in_sync = True

    @torch.no_grad()
    def global_parameters(self) -> Optional[list[torch.Tensor]]:
        """Between averages: the average of the replicas, computed on copies (one all-reduce
        per dtype, the same as an average; the replicas, the period and the optimizer are
        untouched). In sync: None (every replica is the global model)."""
        if self._in_sync or self.ctx.world_size == 1:
            return None
        values: list[Optional[torch.Tensor]] = [None] * len(self.ctx.params)
        for indices, flat in self._averages():
            offset = 0
            for i in indices:
                n = self.ctx.params[i].numel()
                values[i] = flat[offset:offset + n].view_as(self.ctx.params[i])
                offset += n
        return values

    def replicated_state(self) -> tuple[Optional[list[torch.Tensor]], bool]:
        """The parameters while in sync; the optimizer state only while every step so far was
        a warm-up step (local steps keep it local, as in PyTorch)."""
        return (list(self.ctx.params) if self._in_sync else None), self._step <= self.cfg.warmup_steps

    def drain(self) -> None:
        """Average the parameters (unless they are already identical) so evaluation and
        checkpoints see the global model. This is an extra average outside the schedule; it
        does not reset the period."""
        if not self._in_sync:
            self._average_parameters()

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "in_sync": self._in_sync}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state["step"])
        self._in_sync = bool(state["in_sync"])
