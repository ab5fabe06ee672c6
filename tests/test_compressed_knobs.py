"""Validation of the ``compressed`` algorithm's knobs (no process group needed)."""
from __future__ import annotations

import pytest

from lowband.algorithms import make_algorithm
from lowband.algorithms.schedule import DEFAULT_COMPRESSION_WARMUP_STEPS as DEFAULT_WARMUP_STEPS


@pytest.mark.parametrize("bad", [{"warmup_steps": -1}, {"warmup_steps": 1.5}, {"warmup_steps": True},
                                 {"compressor_options": {"relative": 1.0, "threshold": 0.1}},
                                 {"compressor_options": {"scale_block": 256, "threshold": 0.1}}])
def test_invalid_knobs_are_rejected(bad):
    with pytest.raises(ValueError):
        make_algorithm("compressed", **bad)


def test_defaults():
    algo = make_algorithm("compressed")
    assert (algo.compressor, algo.collective, algo.warmup_steps, algo.compress_vectors) == ("2bit", "two-stage", DEFAULT_WARMUP_STEPS, False)
