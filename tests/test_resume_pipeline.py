"""Kill and resume through ``lowband train`` well past the warm-up: compressed SGD (residuals
on the background queue) and CP-SGD (a step in flight at every checkpoint: W, the in-flight
average, residuals, schedule) continue bit for bit like a run that never stopped, with the
same checkpoint schedule."""
from __future__ import annotations

import os

import pytest

from lowband import checkpoint
from lowband.metrics import read_jsonl

from .cli_runs import PAST_WARMUP, SMALL, train
from .test_checkpoint import assert_same

TOTAL, EVERY, STOP_AT = 16, 5, 10     # checkpoints at 5, 10, 15, 16; rank 1 dies writing step 10's
TRAJECTORY = ("model", "optimizer", "scheduler", "engine", "rng", "epoch", "step_in_epoch")


def _flags(algorithm: str) -> list[str]:
    return [*SMALL, "--algorithm", algorithm, *PAST_WARMUP[algorithm], "--max-steps", str(TOTAL),
            "--checkpoint-every", str(EVERY), "--lr-schedule", "cosine", "--timeout", "20"]


def _final(run_dir: str) -> list[dict]:
    manifest = checkpoint.read_manifest(run_dir)
    assert manifest["step"] == TOTAL
    return [checkpoint.load(run_dir, r, 2, manifest) for r in range(2)]


@pytest.mark.parametrize("algorithm", ["cpsgd", "compressed"])
def test_kill_mid_pipeline_then_resume_equals_uninterrupted_run(tmp_path, algorithm):
    reference = str(tmp_path / "reference")
    done = train([*_flags(algorithm), "--run-dir", reference])
    assert done.returncode == 0, done.stderr
    run_dir = str(tmp_path / "run")
    crashed = train([*_flags(algorithm), "--run-dir", run_dir],
                    LOWBAND_FAULT=f"checkpoint-write@{STOP_AT}", LOWBAND_FAULT_RANK="1")
    assert crashed.returncode != 0 and "SIGKILL" in crashed.stderr, crashed.stderr
    manifest = checkpoint.read_manifest(run_dir)
    assert manifest["step"] == STOP_AT - EVERY          # resumes from step 5, past the 3-step warm-up
    state = checkpoint.load(run_dir, 0, 2, manifest)["engine"]["algorithm"]
    if algorithm == "cpsgd":
        assert state["pipelining"] and "in_flight" in state and "global_weights" in state
    else:
        assert state["steps_done"] == STOP_AT - EVERY
    resumed = train([*_flags(algorithm), "--resume", run_dir])
    assert resumed.returncode == 0, resumed.stderr
    for got, want in zip(_final(run_dir), _final(reference)):
        for key in TRAJECTORY:
            if key == "engine":     # wall-clock waits differ; everything else must not
                got[key]["stats"].pop("comm_wait_s"), want[key]["stats"].pop("comm_wait_s")
            assert_same(got[key], want[key], key)
    steps = read_jsonl(os.path.join(run_dir, "steps.jsonl"))
    assert [r["step"] for r in steps] == list(range(1, TOTAL + 1))
    if algorithm == "cpsgd":     # the schedule continued where it stopped: phases 0, 1, 2, 0, ...
        assert [r["correction_phase"] for r in steps] == [None] * 3 + [(t - 3) % 3 for t in range(3, TOTAL)]
