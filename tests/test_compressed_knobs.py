"""Validation of the ``compressed`` algorithm's knobs (no process group needed)."""
from __future__ import annotations

import pytest

from lowband.algorithms import make_algorithm
from lowband.algorithms.warmup import DEFAULT_COMPRESSION_WARMUP_STEPS as DEFAULT_WARMUP_STEPS


@pytest.mark.parametrize("bad", [{"warmup_steps": -1}, {"warmup_steps": 1.5}, {"warmup_steps": True},
                                 {"compressor_options": {"relative": 1.0, "threshold": 0.1}},
                                 {"compressor_options": {"scale_block": 256, "threshold": 0.1}}])
def test_invalid_knobs_are_rejected(bad):
    with pytest.raises(ValueError):
        make_algorithm("compressed", **bad)


def test_defaults():
    algo = make_algorithm("compressed")
    assert (algo.compressor, algo.collective, algo.warmup_steps, algo.compress_vectors) == ("2bit", "auto", DEFAULT_WARMUP_STEPS, False)


def test_auto_collective_is_allgather_up_to_4_ranks_then_two_stage():
    from lowband.comm.plans import resolve_collective
    assert [resolve_collective("auto", n) for n in (1, 2, 3, 4, 5, 64)] == ["allgather"] * 4 + ["two-stage"] * 2
    assert resolve_collective("two-stage", 2) == "two-stage" and resolve_collective("allgather", 64) == "allgather"
    with pytest.raises(ValueError, match="unknown collective 'ring'"):
        resolve_collective("ring", 2)
