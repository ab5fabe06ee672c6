"""Time to target: the target from the ssgd run of the same model, the first evaluation that
reaches it, who gets there first, the sentences and plots of the report."""
from __future__ import annotations

import math

import pytest

from lowband.app.report import (ACCURACY_TARGET_SHARE, UNTRAINED_LM_LOSS, plot_to_target, target_summary, target_table,
                            time_to_target)


def row(algorithm, model, task, evals, bandwidth="20mbit", workers=2, **extra):
    key = "test_loss" if task == "lm" else "test_accuracy"
    final = evals[-1][2]
    return {"algorithm": algorithm, "model": model, "task": task, "bandwidth": bandwidth, "workers": workers,
            key: final, "median_step_ms": 10.0, "mb_sent_per_step": 1.0, **extra,
            "evals": [{"step": s, "train_s": t, "wall_s": t + 1, key: v} for s, t, v in evals]}


def rows():
    return [
        row("noop", "cnn", "classification", [(10, 1.0, 0.70), (20, 2.0, 0.80)]),
        row("ssgd", "cnn", "classification", [(10, 5.0, 0.60), (20, 10.0, 0.75), (30, 15.0, 0.80)]),
        row("cpsgd", "cnn", "classification", [(10, 2.0, 0.50), (20, 4.0, 0.77), (30, 6.0, 0.79)]),
        row("diloco", "cnn", "classification", [(10, 1.5, 0.40), (20, 3.0, 0.60)]),
        row("ssgd", "gpt", "lm", [(10, 5.0, 4.0), (20, 10.0, 3.0), (30, 15.0, 2.5)]),
        row("lazy", "gpt", "lm", [(10, 4.0, 3.5), (20, 8.0, 2.6)]),
    ]


def test_targets_and_first():
    out = {(r["model"], r["algorithm"]): r for r in time_to_target(rows())}
    cnn_target = ACCURACY_TARGET_SHARE * 0.80
    assert out["cnn", "cpsgd"]["target"] == pytest.approx(cnn_target)
    assert (out["cnn", "ssgd"]["time_to_target_s"], out["cnn", "ssgd"]["steps_to_target"]) == (15.0, 30)
    assert (out["cnn", "cpsgd"]["time_to_target_s"], out["cnn", "cpsgd"]["steps_to_target"]) == (4.0, 20)
    assert out["cnn", "diloco"]["time_to_target_s"] is None                # never reached
    assert out["cnn", "noop"]["time_to_target_s"] == 2.0                   # shown, but not ranked
    assert out["cnn", "cpsgd"]["first"] == "yes" and out["cnn", "noop"]["first"] == ""
    gpt_target = 2.5 + 0.05 * (UNTRAINED_LM_LOSS - 2.5)                       # lower is better
    assert out["gpt", "lazy"]["target"] == pytest.approx(gpt_target)
    assert out["gpt", "lazy"]["time_to_target_s"] == 8.0 and out["gpt", "lazy"]["first"] == "yes"
    assert out["gpt", "ssgd"]["time_to_target_s"] == 15.0


def test_without_an_ssgd_run_there_is_no_target():
    out = time_to_target([r for r in rows() if r["algorithm"] != "ssgd"])
    assert all(r["target"] is None and r["time_to_target_s"] is None and r["first"] == "" for r in out)


def test_summary_names_the_winner_and_the_misses(tmp_path):
    lines = target_summary(rows())
    assert any(line.startswith("cnn, 2 workers, 20mbit: target test accuracy >= 76.00%; first: cpsgd after 4.0 s")
               and "(ssgd 15.0 s)" in line and "not reached within the run: diloco" in line for line in lines)
    assert any(line.startswith("gpt, 2 workers, 20mbit: target validation loss <= ") and "first: lazy" in line for line in lines)
    table = target_table(rows())
    assert "| cnn | 20mbit | 2 | cpsgd |" in table and "| yes |" in table
    assert sorted(plot_to_target(rows(), str(tmp_path))) == ["to_target_cnn.png", "to_target_gpt.png"]
    assert (tmp_path / "to_target_gpt.png").stat().st_size > 0
    assert math.isfinite(UNTRAINED_LM_LOSS)
