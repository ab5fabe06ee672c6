"""Bench report: derived ratios, and regenerating one section of a document in place."""
from __future__ import annotations

from lowband.app.report import derive, markdown_table, update_doc


def row(algorithm, step_ms, bytes_sent=0.0, rate=200e6):
    return {"bandwidth": "200mbit", "workers": 2, "algorithm": algorithm, "median_step_ms": step_ms,
            "median_compute_ms": step_ms, "median_comm_wait_ms": 0.0, "median_bytes_sent": bytes_sent,
            "rate_bits": rate}


def test_derive_ratios_against_noop_and_wire_time():
    rows = derive([row("noop", 40.0), row("ssgd", 110.0, bytes_sent=1.75e6)])
    ssgd = rows[1]
    assert ssgd["step_over_noop"] == 110.0 / 40.0
    assert abs(ssgd["wire_ms_at_rate"] - 70.0) < 1e-9          # 1.75 MB * 8 / 200 Mbit/s
    assert abs(ssgd["comm_over_wire"] - 1.0) < 1e-9             # (110 - 40) / 70
    assert "| 200mbit | 2 | ssgd |" in markdown_table(rows)


def test_update_doc_replaces_only_its_section(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nhand-written intro\n")
    update_doc(str(doc), "first table", "peers")
    update_doc(str(doc), "other table", "lowband")
    update_doc(str(doc), "second table", "peers")
    text = doc.read_text()
    assert "hand-written intro" in text and "other table" in text and "second table" in text
    assert "first table" not in text
    assert text.count("<!-- lowband-peers:begin -->") == 1


def test_bench_repeats_report_the_run_with_the_median_step_time():
    from lowband.app.cli import median_runs
    rows = [{"bandwidth": "none", "workers": 2, "algorithm": a, "median_step_ms": ms, "repeat": r}
            for r, (a, ms) in enumerate([("noop", 30.0), ("ssgd", 50.0), ("noop", 40.0), ("ssgd", 45.0),
                                         ("noop", 35.0), ("ssgd", 60.0)], 1)]
    merged = {m["algorithm"]: m for m in median_runs(rows)}
    assert merged["noop"]["median_step_ms"] == 35.0 and merged["noop"]["repeat"] == 5
    assert merged["noop"]["median_step_ms_repeats"] == [30.0, 40.0, 35.0]
    assert merged["ssgd"]["median_step_ms"] == 50.0 and merged["ssgd"]["repeat"] == 2
    two = median_runs(rows[:4])          # even count: the lower middle run
    assert {m["algorithm"]: m["median_step_ms"] for m in two} == {"noop": 30.0, "ssgd": 45.0}


def test_bench_medians_leave_out_the_algorithms_logged_warm_up():
    """An fp32 warm-up of 100 slow steps must not pull a 200-step run's median toward it."""
    from lowband.app.bench import WARMUP_STEPS, RunResult, steady_start
    warm = [{"step_s": 0.100, "warmup": True} for _ in range(100)]
    steady = [{"step_s": 0.030 + 0.001 * (k % 3), "warmup": False} for k in range(100)]
    run = RunResult(config=None, summary={}, steps=warm + steady)
    assert steady_start(run.steps) == 100
    assert run.median("step_s") == 0.031
    # without logged warm-up (ssgd, noop): only the first WARMUP_STEPS are left out
    plain = [{"step_s": 1.0}] * WARMUP_STEPS + [{"step_s": 0.02}] * 10
    assert steady_start(plain) == WARMUP_STEPS and RunResult(None, {}, plain).median("step_s") == 0.02
    # a run that never left its warm-up still reports its steps
    assert RunResult(None, {}, warm[:10]).median("step_s") == 0.100
    # an explicit skip is honoured: over all 200 steps the median sits between the two phases
    assert abs(run.median("step_s", skip=0) - (0.032 + 0.100) / 2) < 1e-12


def test_bench_says_when_a_run_never_left_its_warm_up(tmp_path, monkeypatch, capsys):
    """A bench shorter than the algorithm's warm-up reports the warm-up's step times: the row
    says how many steps the medians counted, and the command prints one line about it."""
    from lowband.app import cli
    from lowband.app.bench import RunResult
    warm = [{"step": t, "step_s": 0.1, "compute_s": 0.05, "comm_wait_s": 0.05, "cpu_s": 0.05, "thread_cpu_s": 0.05,
             "bytes_sent": 100, "warmup": True} for t in range(1, 21)]
    assert RunResult(None, {}, warm).row()["steady_steps"] == 0
    assert RunResult(None, {}, warm).row()["warmup_steps_logged"] == 20
    plain = [{k: v for k, v in s.items() if k != "warmup"} for s in warm]
    assert RunResult(None, {}, plain).row()["steady_steps"] == 15 and RunResult(None, {}, plain).row()["warmup_steps_logged"] == 0

    def fake_run(cfg, rate, burst=None, rtt=0.0):
        import os
        os.makedirs(cfg.run_dir, exist_ok=True)
        open(os.path.join(cfg.run_dir, "epochs.jsonl"), "w").close()
        steps = warm if cfg.algorithm == "cpsgd" else plain
        return RunResult(cfg, {"algorithm": cfg.algorithm, "workers": cfg.workers, "steps": 20}, steps).row()
    monkeypatch.setattr("lowband.app.bench.run_on_link", fake_run)
    monkeypatch.setattr("lowband.app.report.plot", lambda rows, out: [])
    assert cli.main(["bench", "--algorithms", "noop,cpsgd", "--max-steps", "20", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "note: cpsgd x2 over none: all 20 steps were in the algorithm's warm-up" in err
    assert "note: noop" not in err


def test_bench_rounds_run_the_algorithms_in_the_listed_order(tmp_path, monkeypatch, capsys):
    """``--repeat``: round by round, each round every configuration once in the listed order,
    and the per-round ratios pair each run with its own round's noop."""
    from lowband.app import cli
    from lowband.app.bench import RunResult
    plain = [{"step": t, "step_s": 0.02, "compute_s": 0.01, "comm_wait_s": 0.01, "cpu_s": 0.01,
              "thread_cpu_s": 0.01, "bytes_sent": 100} for t in range(1, 21)]
    ran = []

    def fake_run(cfg, rate, burst=None, rtt=0.0):
        import os
        os.makedirs(cfg.run_dir, exist_ok=True)
        open(os.path.join(cfg.run_dir, "epochs.jsonl"), "w").close()
        ran.append((os.path.basename(cfg.run_dir)[-2:], cfg.algorithm))
        return RunResult(cfg, {"algorithm": cfg.algorithm, "workers": cfg.workers, "steps": 20}, plain).row()
    monkeypatch.setattr("lowband.app.bench.run_on_link", fake_run)
    monkeypatch.setattr("lowband.app.report.plot", lambda rows, out: [])
    assert cli.main(["bench", "--algorithms", "noop,ssgd,localsgd", "--max-steps", "20", "--repeat", "4",
                     "--out", str(tmp_path)]) == 0
    listed = ["noop", "ssgd", "localsgd"]
    rounds = [[a for r, a in ran if r == f"r{k}"] for k in range(1, 5)]
    assert [r for r, _ in ran] == [f"r{k}" for k in range(1, 5) for _ in listed]      # round by round
    assert rounds == [listed] * 4
    assert "| none | 2 | ssgd | 20.0, 20.0, 20.0, 20.0 | 1.00, 1.00, 1.00, 1.00 |" in capsys.readouterr().out



def _round(algorithm, repeat, median_ms, mean_ms=None, bandwidth="none"):
    return {"bandwidth": bandwidth, "workers": 2, "algorithm": algorithm, "repeat": repeat,
            "median_step_ms": median_ms, "step_ms": mean_ms if mean_ms is not None else median_ms}


def test_round_ratios_pair_each_run_with_the_noop_of_its_own_round():
    """The machine drifts between rounds (noop 10, 20, 10 ms): each round's ratio is to its own
    noop (1.1, 1.1, 1.2 -> median 1.1), where a ratio of the medians over rounds reads 1.2; a
    round without noop is left out of the ratios, not paired with another round's."""
    from lowband.app.report import round_ratios, rounds_table
    runs = [_round("noop", 1, 10.0), _round("x", 1, 11.0, 13.0), _round("noop", 2, 20.0), _round("x", 2, 22.0, 26.0),
            _round("noop", 3, 10.0), _round("x", 3, 12.0, 12.5), _round("x", 4, 50.0),
            _round("noop", 1, 40.0, bandwidth="200mbit")]
    got = {(r["bandwidth"], r["algorithm"]): r for r in round_ratios(runs)}
    x = got["none", "x"]
    assert x["step_ms_rounds"] == [11.0, 22.0, 12.0, 50.0]
    assert [round(v, 9) for v in x["over_noop_rounds"]] == [1.1, 1.1, 1.2]
    assert abs(x["over_noop_median"] - 1.1) < 1e-12
    assert [round(v, 9) for v in x["mean_over_noop_rounds"]] == [1.3, 1.3, 1.25]
    assert abs(x["mean_over_noop_median"] - 1.3) < 1e-12
    assert "over_noop_median" not in got["none", "noop"] and "over_noop_median" not in got["200mbit", "noop"]
    table = rounds_table(runs)
    assert "| none | 2 | x | 11.0, 22.0, 12.0, 50.0 | 1.10, 1.10, 1.20 | 1.10 | 1.30 |" in table
    assert rounds_table([_round("noop", 1, 10.0), _round("x", 1, 11.0)]) == ""    # one round: no table


def test_report_prints_the_rounds_of_a_repeat_bench(tmp_path, capsys):
    import json
    from lowband.app.report import main_report
    runs = [dict(_round(a, rep, ms), median_compute_ms=ms, median_comm_wait_ms=0.0, median_bytes_sent=0.0,
                 steps=10, test_accuracy=0.5)
            for rep in (1, 2) for a, ms in (("noop", 10.0), ("x", 12.0))]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": runs[:2], "all_runs": runs, "command": "lowband bench ..."}))
    assert main_report(str(path), None, None) == 0
    out = capsys.readouterr().out
    assert "Per round (each run over the noop of its own round)" in out
    assert "| none | 2 | x | 12.0, 12.0 | 1.20, 1.20 | 1.20 |" in out
