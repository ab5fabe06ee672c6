"""Compute-only headroom probe: no communication at all.

Like PyTorch's ``noop_hook``: each rank steps on its own gradient and ranks drift apart, so
the model it trains is meaningless. It exists to measure the step time a perfect network would
give ("if removing all communication gives <10% speedup, communication is not your
bottleneck"). ``drain()`` re-broadcasts rank 0's weights so evaluation stays well-defined.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .base import Algorithm, BoundAlgorithm, EngineContext, Finiteness
from ..comm.communicator import flatten, unflatten_into


@dataclass
class NoComm(Algorithm):
    """No knobs: the point is to do nothing but compute."""

    name: ClassVar[str] = "noop"

    def bind(self, ctx: EngineContext) -> "BoundNoComm":
        return BoundNoComm(self, ctx)


class BoundNoComm(BoundAlgorithm):
    """Each rank steps on its own gradient."""

    uses_gradient_hooks: ClassVar[bool] = False
    clips: ClassVar[bool] = True
    scales: ClassVar[bool] = True

    def step(self) -> None:
        self.ctx.optimizer_step()         # the local gradient (there is no other)

    def finiteness(self) -> Finiteness:
        """The ranks' replicas never meet, so no rank's NaN can poison another's: the
        engine's finiteness check is decided one step late, and the compute-only reference
        pays no per-step barrier (a NaN still stops every rank, one step later)."""
        return Finiteness.LATE

    def drain(self) -> None:
        with torch.no_grad():
            flat = flatten([p.data for p in self.ctx.params])
            self.ctx.comm.broadcast(flat, src=0)
            unflatten_into(flat, [p.data for p in self.ctx.params])

    @torch.no_grad()
    def global_parameters(self) -> Optional[list[torch.Tensor]]:
        """Rank 0's parameters, broadcast into copies (what ``drain()`` would install)."""
        values = [p.detach().clone() for p in self.ctx.params]
        flat = flatten(values)
        self.ctx.comm.broadcast(flat, src=0)
        unflatten_into(flat, values)
        return values

    def replicated_state(self) -> tuple[Optional[list[torch.Tensor]], bool]:
        """Nothing: the ranks train independently."""
        return None, False
