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


#: where ``warmup-cosine`` ends, as a share of the peak rate (the usual LM recipe decays to 10%)
COSINE_FINAL_RATIO = 0.1


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, final_ratio: float = COSINE_FINAL_RATIO) -> float:
    """The factor of a fresh ``warmup-cosine`` run: linear warm-up over ``warmup_steps`` (step 0
    trains at 1/warmup of the peak), then a cosine from the peak to ``final_ratio`` of it at
    ``total_steps``; flat after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CosineSchedule:
    """Half-cosine decay over ``total`` steps to ``final_ratio`` of the initial rate (0 for the
    ``cosine`` schedule), after an optional linear warm-up of ``warmup_steps`` (the LMs'
    ``warmup-cosine``); retargetable; the ``state_dict`` is plain data."""

    def __init__(self, optimizer: torch.optim.Optimizer, total: int, warmup_steps: int = 0, final_ratio: float = 0.0):
        self.optimizer = optimizer
        self.base = [float(g["lr"]) for g in optimizer.param_groups]
        self.t = 0
        self.warmup_steps = int(warmup_steps)
        self.final_ratio = float(final_ratio)
        self.segments: list[list[float]] = [[min(self.warmup_steps, max(1, int(total)) - 1), max(1, int(total)), 1.0]]
        self._apply()

    def factor(self, t: int) -> float:
        first = self.segments[0]
        if len(self.segments) == 1 and t < first[0]:          # linear warm-up of a fresh schedule
            return (t + 1) / self.warmup_steps
        start, end, f0 = first
        for seg in self.segments:          # the last segment that has begun at t
            if seg[0] <= t:
                start, end, f0 = seg
        floor = self.final_ratio
        if t >= end:
            return min(f0, floor)
        return floor + (f0 - floor) * 0.5 * (1.0 + math.cos(math.pi * (t - start) / (end - start)))

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
        return {"kind": "cosine", "t": self.t, "base": list(self.base), "segments": [list(s) for s in self.segments],
                "warmup_steps": self.warmup_steps, "final_ratio": self.final_ratio}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "cosine":
            raise ValueError(f"not a cosine schedule state: {sorted(state)}")
        self.t = int(state["t"])
        self.base = [float(b) for b in state["base"]]
        self.segments = [[int(s[0]), int(s[1]), float(s[2])] for s in state["segments"]]
        self.warmup_steps = int(state.get("warmup_steps", 0))
        self.final_ratio = float(state.get("final_ratio", 0.0))
        self._apply()
