"""Compressed collectives against plain all-reduce and against per-payload decoding (gloo).

Spawning a process group costs seconds, so each world size is spawned once (``_all_checks``)
and the tests assert on its cached results."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from lowband.collectives.communicator import Communicator
from lowband.collectives.compressed import AllgatherCollective, TwoStageAllreduce
from lowband.compressors import ErrorFeedback, make_compressor

from .distributed import run_distributed

SIZES = [1, 7, 16, 33, 1000, 4099]


def _identity_equals_allreduce(rank: int, world: int):
    comm = Communicator()
    out = []
    for cls in (AllgatherCollective, TwoStageAllreduce):
        coll = cls(comm, make_compressor("none"))
        for n in SIZES:
            x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n))
            ref = x.clone()
            dist.all_reduce(ref)
            ref /= world
            got = coll.reduce(x, f"t{n}")
            out.append((cls.name, n, float((got - ref).abs().max())))
        coll.close()
    return out


ALLGATHER_CASES = [("2bit", {"threshold": 0.5}), ("1bit", {}), ("randomk", {"ratio": 0.25})]
BYTES_CASES = [("2bit", {"threshold": 0.01}, 1 / 12), ("2bit", {"relative": 1.0, "scale_block": 256}, 1 / 12),
               ("1bit", {}, 1 / 24)]
BYTES_N, BYTES_WORLD = 1_000_003, 4


def _all_checks(rank: int, world: int) -> dict:
    out = {"identity": _identity_equals_allreduce(rank, world)}
    if world in (2, 3):
        for codec, options in ALLGATHER_CASES:
            out[("allgather", codec)] = _allgather_exact(rank, world, codec, options)
    if world == BYTES_WORLD:
        for codec, options, _ in BYTES_CASES:
            out[("bytes", codec, repr(options))] = _bytes(rank, world, codec, options, BYTES_N)
    return out


@functools.lru_cache(maxsize=None)
def _results(world: int) -> list[dict]:
    return run_distributed(_all_checks, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_identity_compressor_equals_allreduce(world):
    for rank_result in (r["identity"] for r in _results(world)):
        for name, n, err in rank_result:
            assert err < 1e-6, (name, n, err)


def _allgather_exact(rank: int, world: int, codec: str, options: dict):
    comm = Communicator()
    coll = AllgatherCollective(comm, ErrorFeedback(make_compressor(codec, **options)))
    # a twin codec on this rank reproduces what every rank sends (same seeds, same inputs)
    twins = [ErrorFeedback(make_compressor(codec, **options)) for _ in range(world)]
    results = []
    for step in range(3):
        for n in (5, 16, 301):
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(97 * r + 13 * step + n)) for r in range(world)]
            got = coll.reduce(xs[rank], f"p{n}")
            expected = torch.zeros(n)
            for r in range(world):
                payload, ctx = twins[r].compress(xs[r], f"p{n}")
                expected += twins[r].decompress(payload, ctx).reshape(-1)
            expected /= world
            results.append(torch.equal(got, expected))
    coll.close()
    return results, comm.stats.snapshot()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec, options", ALLGATHER_CASES)
def test_allgather_is_exact_sum_of_decoded_payloads(world, codec, options):
    for results, stats in (r[("allgather", codec)] for r in _results(world)):
        assert all(results)
        assert stats["by_op"]["all_gather"][0] == 9


def _bytes(rank: int, world: int, codec: str, options: dict, n: int):
    comm = Communicator()
    coll = TwoStageAllreduce(comm, ErrorFeedback(make_compressor(codec, **options)))
    coll.reduce(torch.randn(n), "g")
    coll.close()
    return comm.stats.bytes_sent


@pytest.mark.parametrize("codec, options, bound", BYTES_CASES)
def test_two_stage_bytes_per_rank_at_4_workers(codec, options, bound):
    sent = [r[("bytes", codec, repr(options))] for r in _results(BYTES_WORLD)]
    ring = 2 * (BYTES_WORLD - 1) / BYTES_WORLD * 4 * BYTES_N
    for s in sent:
        assert s <= bound * ring, (s / ring)
