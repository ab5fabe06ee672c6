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


def allreduce_messages(world: int) -> int:
    """Messages each rank sends, one after another, in a ring all-reduce: 2(N-1) (reduce-scatter,
    then all-gather); each costs the link's latency once."""
    return 2 * (world - 1) if world > 1 else 0


def allgather_bytes(nbytes: float, world: int) -> float:
    """Bytes sent (= received) per rank by a ring all-gather of ``nbytes`` from each rank."""
    return float((world - 1) * nbytes)


def alltoall_bytes(nbytes: float, world: int) -> float:
    """Bytes sent (= received) per rank by an even-split all-to-all of ``nbytes`` per rank."""
    return (world - 1) / world * nbytes if world > 1 else 0.0


def broadcast_bytes(nbytes: float, world: int) -> float:
    """Bytes the root sends for a flat-tree broadcast of ``nbytes`` (every other rank receives
    ``nbytes`` once)."""
    return float((world - 1) * nbytes) if world > 1 else 0.0


def ps_link_bytes(push_bytes: float, pull_bytes: float, world: int, servers: int) -> tuple[float, float]:
    """(worker link, busiest server link) bytes of one parameter-server push of ``push_bytes``
    and pull of ``pull_bytes`` per worker, with the keys sharded evenly over ``servers``.

    Each server receives ``world / servers`` pushes and sends as many pulls. With servers
    co-located on the workers (``servers == world``, MXNet's usual launch), a worker keeps its
    own shard local, so each link carries ``(world-1)/world`` of a push plus the other ranks'
    shards: the same per-link bytes as a ring all-reduce, in two message rounds instead of
    ``2 (world-1)``."""
    if world <= 1:
        return 0.0, 0.0
    if servers >= world:     # co-located: own shard stays local
        share = (world - 1) / world
        worker = share * (push_bytes + pull_bytes)
        return worker, worker
    worker = push_bytes + pull_bytes
    server = world / servers * (push_bytes + pull_bytes)
    return worker, server
