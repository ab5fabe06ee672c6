"""Schedules as data: when an algorithm warms up, when it corrects, as pure functions of the
agreed step counter.

Every rank advances the step counter ``t`` identically (it counts ``engine.step()`` calls that
reached the algorithm, 0-based: ``t`` is the number of steps completed before this one), so a
decision that is a function of ``t`` alone (plus state every rank updates from agreed values) is
the same on every rank. These objects hold no mutable state; an algorithm keeps ``t`` (and, for
an adaptive period, the current period and cycle start) in its own checkpointable state.

* :class:`Warmup` — ``steps`` synchronous full-precision steps before an algorithm's own phase
  (compressed SGD, CP-SGD, local SGD, PowerSGD all have one).
* :class:`Periodic` — "every ``period``-th step from ``start`` on" (a correction burst, a
  local-SGD model average).
* :func:`share_bounds` — the contiguous element range ``[lo, hi)`` of share ``j`` of ``k``
  near-equal shares of a flat tensor (CP-SGD's spread correction sends one share exact per step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


#: fp32 warm-up steps of every compressing method (``compressed``, ``cpsgd``, the DDP compression
#: hook): early gradients are large and change fast, where compression error and staleness hurt
#: most. 100 is about a tenth of the 2-epoch ResNet-20 run that reached S-SGD's accuracy only
#: with it (docs/compression.md). Local SGD and PowerSGD keep their own, shorter warm-ups (their
#: docstrings say why).
DEFAULT_COMPRESSION_WARMUP_STEPS = 100


def _check_int(owner: str, name: str, value, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}{extra}, got {value!r}")


@dataclass(frozen=True)
class Warmup:
    """``steps`` warm-up steps: steps ``t < steps`` are in the warm-up.

    ``phase_step(t)`` counts the steps since the warm-up ended (0 for the first step after it,
    negative inside it)."""

    steps: int = 0

    def __post_init__(self) -> None:
        _check_int("Warmup", "steps", self.steps, 0)

    def active(self, t: int) -> bool:
        return t < self.steps

    def phase_step(self, t: int) -> int:
        return t - self.steps


@dataclass(frozen=True)
class Periodic:
    """Fires at every step ``t >= start`` with ``(t - start) % period == 0`` (so at ``start``
    itself); ``period=None`` never fires."""

    period: Optional[int]
    start: int = 0

    def __post_init__(self) -> None:
        _check_int("Periodic", "period", self.period, 1, allow_none=True)
        _check_int("Periodic", "start", self.start, 0)

    def fires(self, t: int) -> bool:
        return self.period is not None and t >= self.start and (t - self.start) % self.period == 0

    def phase(self, t: int) -> Optional[int]:
        """Position of step ``t`` inside its period (0 = the firing step); None before ``start``
        or without a period."""
        if self.period is None or t < self.start:
            return None
        return (t - self.start) % self.period


def share_bounds(numel: int, k: int, j: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of share ``j`` (0 <= j < k) when ``numel`` elements are cut into
    ``k`` contiguous shares whose sizes differ by at most one (equal bytes for one dtype). The
    shares of ``j = 0..k-1`` partition ``[0, numel)``; a share may be empty when k > numel."""
    if k < 1 or not 0 <= j < k:
        raise ValueError(f"share {j} of {k} does not exist")
    return j * numel // k, (j + 1) * numel // k
