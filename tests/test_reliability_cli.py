"""Through ``lowband train``: evaluation and extending a run leave the trajectory alone, and
a diverging run ends with one clear line per process, never a traceback or exit 0."""
from __future__ import annotations

import os

from lowband.app import checkpoint
from lowband.app.metrics import format_table, read_jsonl

from .cli_runs import SMALL, train
from .test_checkpoint import assert_same

#: local SGD is the algorithm whose trajectory an evaluation or a resume used to change
#: (an average outside its period); constant LR, so a longer run is the same run extended
LOCALSGD = [*SMALL, "--algorithm", "localsgd", "--option", "warmup_steps=1", "--option", "period=3", "--timeout", "30"]
TOTAL, FIRST = 12, 7     # the first leg ends between two averages (they follow steps 2, 5, 8, 11)


def _losses(run_dir: str) -> list[float]:
    return [r["loss"] for r in read_jsonl(os.path.join(run_dir, "steps.jsonl"))]


def test_evaluating_and_extending_a_run_follow_the_uninterrupted_trajectory(tmp_path):
    """12 straight steps without evaluation == 7 steps with --eval-every 2, then --resume
    --max-steps 12 with --eval-every 3: per-step losses and the final model, optimizer and
    algorithm state are bit-identical."""
    straight, legs = str(tmp_path / "straight"), str(tmp_path / "legs")
    done = train([*LOCALSGD, "--max-steps", str(TOTAL), "--checkpoint-every", str(TOTAL), "--run-dir", straight])
    assert done.returncode == 0, done.stderr
    first = train([*LOCALSGD, "--max-steps", str(FIRST), "--eval-every", "2", "--checkpoint-every", str(TOTAL),
                   "--run-dir", legs])
    assert first.returncode == 0, first.stderr
    second = train([*LOCALSGD, "--max-steps", str(TOTAL), "--eval-every", "3", "--checkpoint-every", str(TOTAL),
                    "--resume", legs])
    assert second.returncode == 0, second.stderr
    evals = [r["step"] for r in read_jsonl(os.path.join(legs, "epochs.jsonl"))]
    assert evals == [2, 4, 6, FIRST, 9, TOTAL]
    assert _losses(legs) == _losses(straight)
    for rank in range(2):
        got, want = checkpoint.load(legs, rank, 2), checkpoint.load(straight, rank, 2)
        for key in ("model", "optimizer", "rng", "epoch", "step_in_epoch"):
            assert_same(got[key], want[key], key)
        assert_same(got["engine"]["algorithm"], want["engine"]["algorithm"], "algorithm")


def test_nonfinite_off_ends_with_one_line_per_process(tmp_path):
    r = train([*SMALL, "--lr", "1e30", "--nonfinite", "off", "--max-steps", "20", "--run-dir", str(tmp_path / "run")])
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "FloatingPointError" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 3, r.stderr          # each worker's line, then the launcher's
    assert all(" error: " in line for line in lines)
    assert "lowband worker rank 0: error: loss became " in r.stderr and "(--nonfinite off" in r.stderr


def test_skip_limit_stops_a_diverged_run(tmp_path):
    r = train([*SMALL, "--lr", "1e30", "--nonfinite", "skip", "--max-skips", "3", "--max-steps", "50",
               "--run-dir", str(tmp_path / "run")])
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    for rank in range(2):
        assert f"lowband worker rank {rank}: error: non-finite gradient at step " in r.stderr
    assert "the 3 steps before it were skipped for the same reason, the limit (max_consecutive_skips, " \
           "CLI: --max-skips): training has diverged" in r.stderr, r.stderr
    skipped = [s["skipped"] for s in read_jsonl(str(tmp_path / "run" / "steps.jsonl"))]
    assert skipped[-3:] == [True, True, True] and len(skipped) < 10


def test_the_summary_table_shows_skipped_steps():
    table = format_table([{"algorithm": "ssgd", "workers": 2, "model": "mlp", "steps": 10, "skipped_steps": 9}])
    assert "| skipped |" in table.splitlines()[0]
    assert "| ssgd | 2 | mlp | 10 | 9 |" in table
