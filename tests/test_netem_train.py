"""`lowband train --bandwidth`: real training over shaped links, and nothing left behind after a
normal run, a killed worker, or Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowband import netem

SRC = Path(__file__).resolve().parent.parent / "src"
_WHY = netem.check_available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"netem unavailable: {_WHY}")
DEADLINE_S = 90


def start(run_dir: Path, steps: int, rate: str = "100mbit") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "lowband.app.cli", "train", "--workers", "2", "--model", "mlp", "--dataset", "synthetic",
           "--batch-size", "32", "--max-steps", str(steps), "--bandwidth", rate, "--no-progress",
           "--timeout", "20", "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals)


def _default_signals() -> None:
    """In the child before exec: SIGINT and SIGTERM at their defaults, as a terminal's job gets
    them, whatever the test process inherited (a signal ignored there stays ignored in every
    child, and Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def namespaces_of(pid: int) -> list[str]:
    return [n for n in netem.cluster._list_netns() if n.startswith(f"{netem.NS_PREFIX}-{pid}-")]


def wait_for_steps(run_dir: Path, proc: subprocess.Popen, count: int) -> None:
    end = time.monotonic() + DEADLINE_S
    path = run_dir / "steps.jsonl"
    while time.monotonic() < end:
        if path.exists() and sum(1 for _ in open(path)) >= count:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("training made no progress")


def test_normal_run_trains_over_shaped_link_and_cleans_up(tmp_path):
    proc = start(tmp_path / "run", 20)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, err
    assert "100mbit" in out
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["steps"] == 20
    assert namespaces_of(proc.pid) == []


def test_killed_worker_fails_the_run_and_cleans_up(tmp_path):
    proc = start(tmp_path / "run", 100000, rate="50mbit")
    wait_for_steps(tmp_path / "run", proc, 3)
    ns = namespaces_of(proc.pid)
    worker_ns = [n for n in ns if n.endswith("-w1")]
    assert worker_ns, ns
    pids = netem.cluster._netns_pids(worker_ns[0])
    assert pids
    os.kill(pids[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode != 0
    assert "rank" in err
    assert namespaces_of(proc.pid) == []


def test_ctrl_c_cleans_up(tmp_path):
    proc = start(tmp_path / "run", 100000, rate="50mbit")
    wait_for_steps(tmp_path / "run", proc, 3)
    assert namespaces_of(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)          # what a terminal's Ctrl-C does
    proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode != 0
    assert namespaces_of(proc.pid) == []
