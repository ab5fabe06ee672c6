"""Helpers for tests that run ``lowband train`` as a real command (workers are subprocesses)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional, Sequence

import lowband

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "src")
#: a tiny, fast run: the mlp on synthetic data, 256 steps per epoch with 2 workers
SMALL = ["--workers", "2", "--dataset", "synthetic", "--model", "mlp", "--batch-size", "16", "--no-progress"]
#: Algorithms whose command-line failure paths are exercised by default: one of each kind of
#: state a dead peer can leave a survivor blocked in: a collective on the background queue
#: (compressed), a pipelined round in flight beside per-step finiteness exchanges (cp-diloco),
#: lazy accumulators beside per-step all-reduces (lazy), and torch's DDP. Every algorithm's own
#: state round trip is tested in-process (tests/test_resume.py); LOWBAND_ALL_ALGORITHMS=1 runs
#: the command-line tests for all of them (about 5 more minutes).
ALL_ALGORITHMS = os.environ.get("LOWBAND_ALL_ALGORITHMS") == "1"
CLI_ALGORITHMS = sorted(lowband.ALGORITHMS) if ALL_ALGORITHMS else ["compressed", "cp-diloco", "ddp", "lazy"]
#: The crash-mid-checkpoint-then-resume command-line test (three launches of two workers each,
#: ~20 s per algorithm) by default runs the state whose resume through the command line has the
#: most to lose: a step in flight on the background queue (cpsgd: its checkpoint waits for the
#: step and saves W, the in-flight average and the residuals). The atomic write, the manifest
#: and the pruning under test do not depend on the algorithm, and every algorithm's state
#: round trip (torch's DDP included) is bit-exact in tests/test_resume.py.
CRASH_ALGORITHMS = sorted(lowband.ALGORITHMS) if ALL_ALGORITHMS else ["cpsgd"]
#: flags that end an algorithm's warm-up after a few steps, so a short command-line run reaches
#: the compressed and pipelined phases (resume tests must run well past the warm-up)
PAST_WARMUP = {
    "compressed": ["--option", "warmup_steps=3"],
    "cpsgd": ["--option", "warmup_steps=3", "--option", "correction_period=3"],
    "cp-diloco": ["--option", "sync_every=3", "--option", "correction_every=2"],
}
#: generous bound on one small run (a loaded 2-core machine needs ~10 s to start torch twice)
RUN_DEADLINE_S = 120.0
POLL_S = 0.05


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = SRC + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.update(extra)
    return e


def command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "lowband.app.cli", "train", *args]


def train(args: Sequence[str], **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(args), env=env(**extra_env), capture_output=True, text=True,
                          timeout=RUN_DEADLINE_S)


def start(args: Sequence[str], **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen(command(args), env=env(**extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_until(predicate, deadline_s: float, what: str) -> None:
    """Bounded polling for a condition another process brings about."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(POLL_S)


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except FileNotFoundError:     # that thread ended between the listing and the read
            continue
    return kids


def rank_of(pid: int) -> Optional[int]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    return None


def workers_by_rank(cli_pid: int, world: int, deadline_s: float = RUN_DEADLINE_S) -> dict[int, int]:
    found: dict[int, int] = {}

    def all_started() -> bool:
        for pid in children(cli_pid):
            try:
                r = rank_of(pid)
            except OSError:
                continue
            if r is not None:
                found[r] = pid
        return len(found) == world
    wait_until(all_started, deadline_s, f"{world} workers of lowband train (pid {cli_pid})")
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def steps_logged(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "steps.jsonl")) as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0
