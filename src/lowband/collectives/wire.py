"""Bytes each rank puts on its link for one collective, under the standard bandwidth-optimal
schedules. One place for these formulas: the communicator's accounting, the DDP hooks, the
benchmarks and the performance model all use them.

* ring all-reduce: ``2 (N-1)/N`` of the tensor (reduce-scatter + all-gather);
* ring all-gather: ``(N-1)`` inputs (each rank forwards every other rank's input once);
* pairwise all-to-all: ``(N-1)/N`` of the input (all but the chunk a rank keeps);
* broadcast (flat tree): the root sends ``N-1`` copies, every other rank receives one.
"""
from __future__ import annotations

#: bytes in a mebibyte (bucket caps are given in MiB)
MIB = 1 << 20


def allreduce_bytes(nbytes: float, world: int) -> float:
    """Bytes sent (= received) per rank by a ring all-reduce of ``nbytes``."""
    return 2.0 * (world - 1) / world * nbytes if world > 1 else 0.0


def allgather_bytes(nbytes: float, world: int) -> float:
    """Bytes sent (= received) per rank by a ring all-gather of ``nbytes`` from each rank."""
    return float((world - 1) * nbytes)


def alltoall_bytes(nbytes: float, world: int) -> float:
    """Bytes sent (= received) per rank by an even-split all-to-all of ``nbytes`` per rank."""
    return (world - 1) / world * nbytes if world > 1 else 0.0
