"""Learning-rate schedules as data, so that a resumed run can change its length sensibly.

A schedule is a list of segments ``[start, end, factor_at_start]`` over the scheduler's step
counter (optimizer steps applied, so a step skipped for a non-finite gradient does not
advance it). Within a segment the factor decays by a half cosine from ``factor_at_start`` at
``start`` to 0 at ``end``; each parameter group's learning rate is its initial learning rate
times the factor. A fresh cosine run has one segment ``[0, total, 1.0]``.

Changing the length on resume (``lowband train --resume RUN --max-steps M`` with a larger or
smaller M, or more ``--epochs``): :meth:`CosineSchedule.retarget` appends a segment from the
resume point, starting at the factor the old schedule had reached there, so the learning
rate continues from where it was and decays smoothly to 0 at the new end, instead of
following the old cosine past its end (where it rises again). With the length unchanged
nothing is appended and a resumed run is bit-identical to an uninterrupted one.
"""
from __future__ import annotations

import math
from typing import Any

import torch


class CosineSchedule:
    """Half-cosine decay to 0 over ``total`` steps, retargetable; the ``state_dict`` is plain data."""

    def __init__(self, optimizer: torch.optim.Optimizer, total: int):
        self.optimizer = optimizer
        self.base = [float(g["lr"]) for g in optimizer.param_groups]
        self.t = 0
        self.segments: list[list[float]] = [[0, max(1, int(total)), 1.0]]
        self._apply()

    def factor(self, t: int) -> float:
        start, end, f0 = self.segments[-1]
        for seg in self.segments:          # the last segment that has begun at t
            if seg[0] <= t:
                start, end, f0 = seg
        if t >= end:
            return 0.0
        return f0 * 0.5 * (1.0 + math.cos(math.pi * (t - start) / (end - start)))

    def _apply(self) -> None:
        f = self.factor(self.t)
        for g, base in zip(self.optimizer.param_groups, self.base):
            g["lr"] = base * f

    def step(self) -> None:
        self.t += 1
        self._apply()

    @property
    def total(self) -> int:
        return int(self.segments[-1][1])

    def retarget(self, total: int) -> bool:
        """Make the schedule end at ``total`` steps from now on (see the module docstring).
        Returns whether anything changed."""
        total = max(1, int(total))
        if total == self.total:
            return False
        # a shorter run than the point reached keeps the learning rate it has (nothing is left)
        self.segments.append([self.t, max(total, self.t + 1), self.factor(self.t)])
        self._apply()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "cosine", "t": self.t, "base": list(self.base), "segments": [list(s) for s in self.segments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "cosine":
            raise ValueError(f"not a cosine schedule state: {sorted(state)}")
        self.t = int(state["t"])
        self.base = [float(b) for b in state["base"]]
        self.segments = [[int(s[0]), int(s[1]), float(s[2])] for s in state["segments"]]
        self._apply()
