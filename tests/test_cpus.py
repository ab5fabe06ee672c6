"""`--cpu-binding`: each local rank gets its own slice of the allowed cores, and where a
worker runs never changes what it computes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from lowband.runtime import cpus

from .test_cli import SRC, lowband

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")


@settings(max_examples=200, deadline=None)
@given(cores=st.sets(st.integers(0, 255), min_size=1, max_size=64), local_world=st.integers(1, 80))
def test_slices_are_disjoint_equal_and_inside_the_allowed_set(cores, local_world):
    slices = [cpus.slice_for(list(cores), r, local_world) for r in range(local_world)]
    assert all(s and set(s) <= cores for s in slices)
    if local_world <= len(cores):
        flat = [c for s in slices for c in s]
        assert len(flat) == len(set(flat))                     # no core shared
        assert {len(s) for s in slices} == {len(cores) // local_world}
    else:                                                      # round-robin, one core each
        ordered = sorted(cores)
        assert slices == [[ordered[r % len(cores)]] for r in range(local_world)]


def test_slices_are_contiguous_runs_of_the_sorted_cores():
    assert [cpus.slice_for([7, 1, 3, 5], r, 2) for r in range(2)] == [[1, 3], [5, 7]]
    assert [cpus.slice_for([0, 1, 2], r, 2) for r in range(2)] == [[0], [1]]


def test_a_local_rank_outside_the_world_and_an_unknown_mode_are_errors():
    with pytest.raises(ValueError, match="local rank 2 is outside 0..1"):
        cpus.slice_for([0, 1], 2, 2)
    with pytest.raises(ValueError, match="--cpu-binding must be one of: none, spread"):
        cpus.bind("pinned")
    from lowband.app.config import TrainConfig
    with pytest.raises(ValueError, match="--cpu-binding must be one of: none, spread, got 'pinned'"):
        TrainConfig(cpu_binding="pinned").validate()


def _affinity_after_bind(mode: str, env: dict) -> list:
    """``cpus.bind`` in a fresh interpreter (the test process keeps all its cores)."""
    code = ("import json, os; from lowband.runtime import cpus; got = cpus.bind(%r); "
            "print(json.dumps([got, sorted(os.sched_getaffinity(0))]))" % mode)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=SRC, **env))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_affinity
@pytest.mark.parametrize("local_rank", [0, 1])
def test_spread_binds_the_process_to_its_slice(local_rank):
    allowed = sorted(os.sched_getaffinity(0))
    got, now = _affinity_after_bind("spread", {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2"})
    assert got == now == cpus.slice_for(allowed, local_rank, 2)


@needs_affinity
def test_none_leaves_the_affinity_alone():
    got, now = _affinity_after_bind("none", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert got is None and now == sorted(os.sched_getaffinity(0))


def _losses(run) -> list:
    return [json.loads(line)["loss"] for line in open(run / "steps.jsonl")]


@needs_affinity
def test_training_bound_to_cores_follows_the_unbound_trajectory_bit_for_bit(tmp_path):
    """cpsgd past its warm-up (its pipeline thread inherits the binding) on 2 workers."""
    runs = {}
    for mode in ("none", "spread"):
        run = tmp_path / mode
        r = lowband("train", "--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--max-steps", "24",
                    "--batch-size", "32", "--algorithm", "cpsgd", "--option", "warmup_steps=4",
                    "--option", "correction_period=5", "--no-progress", "--cpu-binding", mode, "--run-dir", str(run))
        assert r.returncode == 0, r.stderr
        runs[mode] = run
    spread = json.load(open(runs["spread"] / "summary.json"))
    assert spread["cpu_binding"] == "spread"
    assert spread["rank0_cores"] == cpus.slice_for(sorted(os.sched_getaffinity(0)), 0, 2)
    assert json.load(open(runs["none"] / "summary.json"))["rank0_cores"] is None
    assert _losses(runs["spread"]) == _losses(runs["none"])
