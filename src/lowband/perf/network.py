"""Time of one collective on a homogeneous network: every worker has its own full-duplex link
of ``bandwidth`` bits/s, and every message pays ``latency`` seconds (the alpha-beta model).

Bytes come from :mod:`lowband.comm.wire` (one place for the formulas); the message
counts are those of the same bandwidth-optimal schedules:

* ring all-reduce: ``2 (N-1)`` steps (reduce-scatter + all-gather), each one message;
* ring all-gather: ``N-1`` steps;
* pairwise all-to-all: ``N-1`` exchange rounds;
* flat broadcast: the root sends ``N-1`` messages;
* parameter server: one push round and one pull round, with the busiest server link as the
  bottleneck when servers are fewer than workers.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..comm import wire


@dataclass(frozen=True)
class Network:
    """Knobs:
        bandwidth_bps: per-worker link rate, bits per second, each direction.
        latency_s: fixed cost per message (wire latency plus software overhead per hop).
        efficiency: achieved fraction of ``bandwidth_bps`` for bulk transfers (tc tbf shaping
            here delivers 94-96%, ``MACHINE-FACTS``; 1.0 = the nominal rate).
        burst_bytes: depth of a token bucket in front of the link (tc tbf's ``burst``): after
            an idle period that many bytes pass at line speed, and the bucket refills at
            ``bandwidth_bps``. 0 (default): a plain rate limit, as a NIC's line rate is. The
            paced links of ``lowband bench`` have a bucket of a fraction of a millisecond
            (``lowband.netem.paced``); a bursting link (``--burst 96kb``) lets a small compressed
            message through in a fraction of its nominal time. The closed forms below ignore it; the step model
            (:mod:`lowband.perf.model`) applies it per collective, with the bucket's state
            carried from one collective to the next.
    """

    bandwidth_bps: float
    latency_s: float = 0.0
    efficiency: float = 1.0
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth must be > 0 bit/s, got {self.bandwidth_bps}")
        if self.latency_s < 0:
            raise ValueError(f"latency must be >= 0 s, got {self.latency_s}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")
        if self.burst_bytes < 0:
            raise ValueError(f"burst must be >= 0 bytes, got {self.burst_bytes}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over one link."""
        return 8.0 * nbytes / (self.bandwidth_bps * self.efficiency)

    # -- collectives: seconds for one call of N workers ------------------------------------
    def allreduce_s(self, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        return self.transfer_s(wire.allreduce_bytes(nbytes, world)) + wire.allreduce_messages(world) * self.latency_s

    def allgather_s(self, nbytes: float, world: int) -> float:
        """``nbytes`` contributed by each worker."""
        if world <= 1:
            return 0.0
        return self.transfer_s(wire.allgather_bytes(nbytes, world)) + (world - 1) * self.latency_s

    def alltoall_s(self, nbytes: float, world: int) -> float:
        """``nbytes`` sent by each worker in total, split evenly over the workers."""
        if world <= 1:
            return 0.0
        return self.transfer_s(wire.alltoall_bytes(nbytes, world)) + (world - 1) * self.latency_s

    def broadcast_s(self, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        return self.transfer_s(wire.broadcast_bytes(nbytes, world)) + (world - 1) * self.latency_s

    def ps_pushpull_s(self, push_bytes: float, pull_bytes: float, world: int, servers: int) -> float:
        """One push of ``push_bytes`` and one pull of ``pull_bytes`` per worker through
        ``servers`` parameter servers holding even shards of the keys."""
        if world <= 1:
            return 0.0
        worker, server = wire.ps_link_bytes(push_bytes, pull_bytes, world, servers)
        return self.transfer_s(max(worker, server)) + 2 * self.latency_s


#: unit suffixes -> multiplier, longest suffixes first (so "ms" is not read as "s")
_TIME_UNITS = {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}
_SIZE_UNITS = {"kb": 1024.0, "mb": 1024.0 ** 2, "b": 1.0}


def _parse_quantity(text: str, units: dict[str, float], default_unit: str, what: str, expected: str) -> float:
    """A non-negative number with an optional unit suffix of ``units``; ValueError naming ``what``."""
    t = text.strip().lower()
    unit = next((u for u in units if t.endswith(u)), None)
    number = t[: -len(unit)] if unit else t
    try:
        value = float(number) * units[unit or default_unit]
    except ValueError:
        raise ValueError(f"invalid {what} {text!r}: expected {expected}") from None
    if value < 0:
        raise ValueError(f"invalid {what} {text!r}: must be >= 0")
    return value


def parse_latency(text: str) -> float:
    """``"2us"``, ``"0.2ms"``, ``"0"`` or a plain number of seconds -> seconds."""
    return _parse_quantity(text, _TIME_UNITS, "s", "latency", "a number with unit s, ms, us or ns (e.g. '5us')")


def parse_bytes(text: str) -> float:
    """``"96kb"``, ``"1mb"``, ``"98304b"`` or a plain number of bytes -> bytes (tc's units: kb = 1024)."""
    return _parse_quantity(text, _SIZE_UNITS, "b", "size", "a number of bytes with unit b, kb or mb (e.g. '96kb')")
