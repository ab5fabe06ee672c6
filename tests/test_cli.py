"""`lowband train`: bad input exits 2 with one clear line; a small run reaches its summary."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lowband.app import cli

from .test_data import FILES, make_fake_dataset

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def lowband(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-m", "lowband.app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("args, expected", [
    (["--model", "vgg99"], "unknown model 'vgg99'"),
    (["--algorithm", "magic"], "unknown algorithm 'magic'"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--batch-size", "-3"], "--batch-size must be an integer >= 1"),
    (["--workers", "0"], "--workers must be an integer >= 1"),
    (["--data-dir", "/nonexistent"], "is missing"),
    (["--option", "no_such_knob=1"], "bad options for algorithm 'ssgd'"),
    (["--epochs", "two"], "invalid int value"),
])
def test_bad_input_exits_2_with_one_line(args, expected, tmp_path, capsys):
    """In this process (``cli.main``, which the command runs): each case is refused before
    anything starts, so only the parser and the checks run; the command itself is run once
    below."""
    try:
        rc = cli.main(["train", "--run-dir", str(tmp_path / "run"), *args])
    except SystemExit as e:           # argparse's own errors leave through its error()
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0] and "Traceback" not in err


def test_bad_input_through_the_command_exits_2_with_one_line(tmp_path):
    for args, expected in ((["--algorithm", "magic"], "unknown algorithm 'magic'"),
                           (["--epochs", "two"], "invalid int value")):
        r = lowband("train", "--run-dir", str(tmp_path / "run"), *args)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_corrupt_dataset_file_exits_2(tmp_path):
    d = make_fake_dataset(tmp_path)
    path = os.path.join(d, FILES["test"][0])
    open(path, "wb").write(b"\x1f\x8b garbage")
    r = lowband("train", "--data-dir", str(d), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "corrupt or truncated" in r.stderr


def test_small_run_writes_metrics_and_summary(tmp_path):
    run = tmp_path / "run"
    r = lowband("train", "--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--max-steps", "30",
                "--batch-size", "32", "--lr", "0.05", "--no-progress", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert "| ssgd | 2 | mlp | 30 |" in r.stdout
    summary = json.load(open(run / "summary.json"))
    assert summary["steps"] == 30 and summary["workers"] == 2
    assert summary["test_accuracy"] > 0.5          # synthetic classes are easy to separate
    steps = [json.loads(line) for line in open(run / "steps.jsonl")]
    assert [s["step"] for s in steps] == list(range(1, 31))
    assert all(s["bytes_sent"] > 0 and s["compute_s"] > 0 for s in steps)
    config = json.load(open(run / "config.json"))
    assert config["algorithm"] == "ssgd" and config["workers"] == 2
    assert (run / "epochs.jsonl").exists()


def test_a_failed_link_emulation_command_is_one_line_not_a_traceback(monkeypatch, capsys):
    """An ip/tc command that fails mid-run (after the availability probe passed) ends the
    command with one precise line and exit 1."""
    from lowband.app import cli
    from lowband import netem

    def bench(_args):
        raise netem.NetemError(["ip", "-n", "lb-w0", "route", "replace"], 2, "Error: invalid argument\n")

    monkeypatch.setitem(cli.COMMANDS, "bench", bench)
    assert cli.main(["bench", "--algorithms", "noop"]) == 1
    err = capsys.readouterr().err
    assert err == ("lowband: error: network emulation: command failed (exit 2): ip -n lb-w0 route replace: "
                   "Error: invalid argument\n")


def test_bench_goes_on_after_a_failed_run_and_exits_nonzero(tmp_path, monkeypatch, capsys):
    """One failed run (a worker dies) neither stops the other runs nor passes silently: the
    finished run's row is in results.json, the failure is named there and on stderr, and the
    exit status is the failure's."""
    from lowband.app import bench as bench_module, cli
    from lowband.runtime.launcher import LaunchResult
    from lowband.app.runner import RunFailed

    real = bench_module.run_on_link

    def first_fails(cfg, rate, burst=None, rtt=0.0):
        if cfg.algorithm == "ssgd":
            raise RunFailed(cfg, LaunchResult(returncode=3, failed_rank=1, returncodes=[0, 3]))
        return real(cfg, rate, burst, rtt)

    monkeypatch.setattr(bench_module, "run_on_link", first_fails)
    out = tmp_path / "bench"
    rc = cli.main(["bench", "--algorithms", "ssgd,noop", "--model", "mlp", "--dataset", "synthetic",
                   "--batch-size", "16", "--max-steps", "4", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 3
    results = json.loads((out / "results.json").read_text())
    assert [r["algorithm"] for r in results["rows"]] == ["noop"]
    assert results["failed"] == ["ssgd x2 over none"]
    assert "1 of 2 runs failed: ssgd x2 over none" in err


@pytest.mark.parametrize("args, message", [
    (["--burst", "8kb"], "--burst shapes emulated links; it needs --bandwidth with a rate (e.g. 8mbit)"),
    (["--burst", "8kb", "--bandwidth", "none"], "--burst shapes emulated links"),
    (["--burst", "1kb", "--bandwidth", "8mbit"], "--burst: burst must be at least 2048 bytes"),
    (["--burst", "8kbit", "--bandwidth", "8mbit"], "--burst: invalid size '8kbit'"),
])
@pytest.mark.parametrize("command", ["train", "bench"])
def test_bad_burst_is_one_usage_line(command, args, message, capsys):
    assert cli.main([command, *args, "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lowband: error: {message}") and err.count("\n") == 1


@pytest.mark.parametrize("command", ["train", "bench"])
def test_burst_reaches_every_emulated_run(command, monkeypatch, tmp_path):
    """``--burst`` is parsed once (bytes) and handed to each run on a link; 'none' (a paced
    link) is None."""
    from lowband.app import bench as bench_module
    from lowband import netem
    seen = []

    def fake_run(cfg, rate, burst=None, rtt=0.0):
        seen.append((rate, burst))
        raise SystemExit(0)

    monkeypatch.setattr(bench_module, "run_on_link", fake_run)
    monkeypatch.setattr(netem, "check_available", lambda: None)
    monkeypatch.setattr(netem, "cleanup_stale", lambda: None)
    out = ["--run-dir", str(tmp_path / "t")] if command == "train" else ["--out", str(tmp_path / "b")]
    for burst, expected in (("8kb", 8192), ("none", None)):
        with pytest.raises(SystemExit):
            cli.main([command, "--bandwidth", "8mbit", "--burst", burst, "--max-steps", "1", *out])
    assert seen == [(8_000_000, 8192), (8_000_000, None)]


def test_bench_takes_each_algorithms_codec_options(tmp_path, capsys):
    """``--algorithms NAME:compressor_options.KEY=VALUE`` sets one codec option of that entry
    (over ``--compressor-option``'s); another dotted key, or an option the codec does not
    have, is one usage line before anything runs."""
    opts = {"compressor_options": {"relative": 1.0}}
    cli._update_options(opts, ["compressor=topk", "compressor_options.ratio=0.01", "sync_every=4"])
    assert opts == {"compressor": "topk", "compressor_options": {"relative": 1.0, "ratio": 0.01}, "sync_every": 4}
    for spec, expected in (("cp-diloco:sync.every=2", "only compressor_options.KEY=VALUE takes a dotted key"),
                           ("cp-diloco:compressor=topk:compressor_options.bits=2", "unknown option(s) ['bits']")):
        rc = cli.main(["bench", "--algorithms", f"noop,{spec}", "--max-steps", "1", "--out", str(tmp_path / "b")])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
