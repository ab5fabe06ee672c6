"""Many machines under torchrun, with restarts and link outages.

Two emulated hosts (the worker namespaces of :class:`lowband.netem.EmulatedCluster`, joined by a
shaped link) each run one ``torchrun --nnodes 2 --nproc-per-node 1`` with c10d rendezvous, as a
user runs ``lowband train`` on two machines. Every run trains the same few steps with the same
checkpoint schedule, so each one's final checkpoint must equal the uninterrupted run's bit for bit:
after a worker is killed and torchrun restarts the job, and after a short link outage and then one
past ``--timeout`` followed by ``--resume``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from itertools import count
from typing import Optional

import pytest
import torch

from lowband import netem
from lowband.app import checkpoint
from lowband.runtime import elastic

from .cli_runs import SRC, alive, children, rank_of, steps_logged, wait_until

_WHY = netem.check_available()
needs_netns = pytest.mark.skipif(_WHY is not None, reason=f"netem unavailable: {_WHY}")
pytestmark = needs_netns

RATE = "100mbit"          # ~90 ms per step of the mlp (1 MB each way): the tests act between steps
STEPS, EVERY = 20, 5
FLAGS = ["--model", "mlp", "--dataset", "synthetic", "--batch-size", "16", "--threads", "1",
         "--max-steps", str(STEPS), "--checkpoint-every", str(EVERY), "--no-progress"]
#: torchrun's own rendezvous port in host 0's namespace; each job takes the next one
_PORTS = count(29400)
#: one job: two torch start-ups per host on a loaded 2-core machine, and a few seconds of steps
JOB_DEADLINE_S = 300.0
#: the short outage: TCP retransmits with backoff (0.2, 0.4, 0.8, 1.6 s, ...), so training
#: stalls for up to about twice this, well inside TIMEOUT_S; long enough that a cut that cuts
#: nothing shows (9 steps went through in 1 s with set_link's "down" disabled)
SHORT_OUTAGE_S = 1.0
#: --timeout of the outage run: above the short outage's stall and the start-up skew of two
#: workers on a loaded 2-core machine (about 1 s, tests/test_failures.py); the long outage
#: lasts until both workers gave up
TIMEOUT_S = 6.0
#: set by a launcher above pytest; inherited, they would confuse torchrun's workers
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "LOWBAND_LAUNCHED", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def _env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", **(extra or {}))
    return env


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@dataclass
class Job:
    """One torchrun per host, training into ``run_dir``; output in ``logs``."""
    procs: list[subprocess.Popen]
    logs: list[str]
    run_dir: str
    outputs: list[str] = field(default_factory=list)

    def worker(self, rank: int) -> tuple[int, int]:
        """(pid, host) of the training process of global ``rank``: a child of that host's torchrun."""
        found: dict[int, tuple[int, int]] = {}

        def started() -> bool:
            for host, proc in enumerate(self.procs):
                for pid in children(proc.pid) if alive(proc.pid) else []:
                    try:
                        r = rank_of(pid)
                    except OSError:
                        continue
                    if r is not None:
                        found[r] = (pid, host)
            return rank in found or any(p.poll() is not None for p in self.procs)
        wait_until(started, JOB_DEADLINE_S, f"the training process of rank {rank}")
        assert rank in found, self.finish()
        return found[rank]

    def finish(self, deadline_s: float = JOB_DEADLINE_S) -> list[int]:
        """Wait for both torchruns; their exit statuses (outputs in ``self.outputs``)."""
        end = time.monotonic() + deadline_s
        try:
            for proc in self.procs:
                proc.wait(timeout=max(1.0, end - time.monotonic()))
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            self.outputs = [open(log).read() for log in self.logs]
        return [p.returncode for p in self.procs]

    @property
    def output(self) -> str:
        return "\n".join(self.outputs)


class TwoHosts:
    """Two emulated hosts joined by a ``RATE`` link; :meth:`start` runs a two-node torchrun job."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.cluster = netem.EmulatedCluster(2, netem.parse_rate(RATE))
        self.jobs = 0

    def __enter__(self) -> "TwoHosts":
        self.cluster.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.cluster.close()

    def start(self, run_dir: str, *flags: str, max_restarts: int = 0, env: Optional[dict[str, str]] = None) -> Job:
        c = self.cluster
        port, self.jobs = next(_PORTS), self.jobs + 1
        procs, logs = [], []
        for host in range(2):
            log = str(self.tmp_path / f"job{self.jobs}-host{host}.log")
            cmd = c.worker_prefix(host) + torchrun(
                "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", str(max_restarts),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.master_addr}:{port}",
                "--rdzv-id", f"job{self.jobs}", "--local-addr", c.addresses[host],
                # both emulated hosts share one host name: say which one serves the rendezvous
                "--rdzv-conf", f"is_host={'true' if host == 0 else 'false'}",
                "-m", "lowband.app.cli", "train", *FLAGS, *flags, "--run-dir", run_dir)
            with open(log, "w") as out:
                procs.append(subprocess.Popen(cmd, env=_env({**(env or {}), "GLOO_SOCKET_IFNAME": c.worker_if[host]}),
                                              stdout=out, stderr=subprocess.STDOUT))
            logs.append(log)
        return Job(procs, logs, run_dir)

    def link(self, host: int, up: bool) -> None:
        """Cut ``host``'s link or restore it (:meth:`lowband.netem.EmulatedCluster.set_link`)."""
        self.cluster.set_link(host, up)


def final_state(run_dir: str, rank: int) -> dict:
    manifest = checkpoint.read_manifest(run_dir)
    assert manifest["step"] == STEPS, manifest["step"]
    return checkpoint.load(run_dir, rank, 2, manifest)


def assert_same_tensors(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), what
        for k in a:
            assert_same_tensors(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def assert_same_final_weights(run_dir: str, reference: str) -> None:
    """Model and optimizer state of both ranks' final checkpoints, and every step's loss."""
    for rank in range(2):
        got, want = final_state(run_dir, rank), final_state(reference, rank)
        assert_same_tensors(got["model"], want["model"], f"rank {rank} model")
        assert_same_tensors(got["optimizer"], want["optimizer"], f"rank {rank} optimizer")
    assert [r["loss"] for r in _records(run_dir)] == [r["loss"] for r in _records(reference)]


def _checkpointed_step(run_dir: str) -> int:
    try:
        return checkpoint.read_manifest(run_dir)["step"]
    except checkpoint.CheckpointError:
        return 0


def _mid_run(job: Job, checkpointed: int) -> None:
    """Wait until the job has written the checkpoint of step ``checkpointed`` and taken a step
    past it (the tests act there)."""
    wait_until(lambda: (_checkpointed_step(job.run_dir) >= checkpointed and steps_logged(job.run_dir) > checkpointed)
               or any(p.poll() is not None for p in job.procs), JOB_DEADLINE_S, f"the checkpoint of step {checkpointed}")
    assert all(p.poll() is None for p in job.procs), job.finish()
    assert steps_logged(job.run_dir) < STEPS, "the run ended before the test could act mid-run"


class Reference:
    """The uninterrupted two-host run, started in the background when the first test asks for
    it (the restart test's job runs beside it); :meth:`run_dir` waits for it and checks that
    its steps crossed the shaped link."""

    def __init__(self, tmp):
        self.hosts = TwoHosts(tmp).__enter__()
        self.before = self.hosts.cluster.link_counters()
        # --max-restarts 1 on the agent's shared store, as torchrun starts by default: the
        # workers warn about it (test_two_torchrun_hosts_train_to_identical_replicas)
        self.job = self.hosts.start(str(tmp / "reference"), max_restarts=1)
        self.done: Optional[str] = None

    def run_dir(self) -> str:
        if self.done is None:
            try:
                assert self.job.finish() == [0, 0], self.job.output
                after = self.hosts.cluster.link_counters()
            finally:
                self.close()
            for host in range(2):     # ssgd sends ~1 MB per step each way: all of it over the link
                assert after[host][0] - self.before[host][0] > STEPS * 0.9e6, (self.before, after)
            self.done = self.job.run_dir
        return self.done

    def close(self) -> None:
        if not self.job.outputs:
            self.job.finish(deadline_s=0)
        self.hosts.__exit__()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("multinode"))
    yield ref
    ref.close()


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_from_its_checkpoint(reference, tmp_path):
    """(First in the file: its job runs beside the reference run.) SIGKILL of rank 1's training
    process (not its torchrun) after the first checkpoint: torchrun (--max-restarts 1) restarts
    both hosts' workers, they continue from the latest checkpoint by themselves, and the job
    ends with the uninterrupted run's weights."""
    run_dir = str(tmp_path / "run")
    with TwoHosts(tmp_path) as hosts:
        # every attempt on a store of its own (elastic.restart_hazard: torch's shared store
        # keeps the killed attempt's gloo addresses)
        job = hosts.start(run_dir, max_restarts=1, env={elastic.DISABLE_SHARED_STORE: "1"})
        victim, _ = job.worker(1)
        _mid_run(job, EVERY)
        at_kill = _checkpointed_step(run_dir)
        os.kill(victim, signal.SIGKILL)
        codes = job.finish()
    assert codes == [0, 0], job.output
    assert job.output.count("lowband: torchrun restart 1 of at most 1: continuing from the checkpoint of "
                            f"step {at_kill} ({run_dir})") == 1, job.output
    assert "lowband: warning:" not in job.output, job.output
    assert [r["step"] for r in _records(run_dir)] == list(range(1, STEPS + 1))
    assert_same_final_weights(run_dir, reference.run_dir())


def test_two_torchrun_hosts_train_to_identical_replicas(reference):
    run_dir = reference.run_dir()
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["workers"] == 2 and summary["steps"] == STEPS
    assert len(_records(run_dir)) == STEPS
    assert_same_tensors(final_state(run_dir, 0)["model"], final_state(run_dir, 1)["model"], "rank 0 vs 1")
    warning = f"lowband: warning: {elastic.restart_hazard({elastic.AGENT_STORE: 'True', elastic.MAX_RESTARTS: '1'})}"
    assert reference.job.output.count(warning) == 1, reference.job.output


def test_resuming_with_another_world_size_is_refused_in_one_line(reference, tmp_path):
    """One host, one process, a checkpoint of two: the worker stops with one line, exit
    non-zero, and the run directory is untouched."""
    run_dir = str(tmp_path / "copy")
    shutil.copytree(reference.run_dir(), run_dir)
    before = {f: os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(run_dir) for f in fs}
    proc = subprocess.run(torchrun("--standalone", "--nproc-per-node", "1", "-m", "lowband.app.cli", "train",
                                   *FLAGS, "--resume", run_dir),
                          env=_env({"GLOO_SOCKET_IFNAME": "lo"}), capture_output=True, text=True,
                          timeout=JOB_DEADLINE_S)
    assert proc.returncode != 0
    line = ("lowband worker rank 0: error: the checkpoint was written by 2 workers, but this run has 1; resume "
            "with torchrun with 2 processes in all (--nnodes x --nproc-per-node) (a checkpoint resumes only at "
            "the world size that wrote it)")
    assert proc.stderr.count(line) == 1, proc.stderr
    assert "lowband/app" not in proc.stderr, proc.stderr     # no traceback of the worker
    assert {f: os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(run_dir) for f in fs} == before


def test_link_outages_a_short_one_only_delays_training_one_past_the_timeout_stops_it(reference, tmp_path):
    """Host 1's link goes down for a second: training stalls, goes on and checkpoints
    again. Then it stays down past --timeout: the worker on host 1 says in one line that its
    network interface is down, the other that it lost contact; the latest checkpoint stays
    intact, and --resume (torchrun again) ends with the uninterrupted run's weights, so neither
    outage changed a bit."""
    run_dir = str(tmp_path / "run")
    with TwoHosts(tmp_path) as hosts:
        job = hosts.start(run_dir, "--timeout", f"{TIMEOUT_S:g}")
        workers = [job.worker(r) for r in range(2)]            # (pid, host) of rank 0 and 1
        cut = next(r for r, (_, host) in enumerate(workers) if host == 1)
        _mid_run(job, EVERY)
        hosts.link(1, up=False)
        at_down = steps_logged(run_dir)
        time.sleep(SHORT_OUTAGE_S)
        stalled = steps_logged(run_dir) - at_down
        hosts.link(1, up=True)
        assert stalled <= 1, f"{stalled} steps went through a link that was down"
        _mid_run(job, 2 * EVERY)     # it goes on, and checkpoints again
        hosts.link(1, up=False)
        t0 = time.monotonic()
        wait_until(lambda: not any(alive(pid) for pid, _ in workers), 2 * TIMEOUT_S + 20, "the workers to stop")
        waited = time.monotonic() - t0
        hosts.link(1, up=True)       # torchrun's agents settle their rendezvous over it
        codes = job.finish()
        assert codes != [0, 0], job.output
        assert waited >= TIMEOUT_S - 1, waited
        lines = [line for line in job.output.splitlines() if line.startswith("lowband worker rank")]
        assert len(lines) == 2, job.output
        assert sum(line.startswith(f"lowband worker rank {cut}: error: its network interface "
                                   f"{hosts.cluster.worker_if[1]} is down: lost contact with the other workers "
                                   f"for --timeout {TIMEOUT_S:g} s: ") for line in lines) == 1, lines
        assert sum(line.startswith(f"lowband worker rank {1 - cut}: error: lost contact with the other workers "
                                   f"(one died or sent nothing for --timeout {TIMEOUT_S:g} s): ")
                   for line in lines) == 1, lines
        assert "lowband/app" not in job.output, job.output       # no traceback of a worker
        manifest = checkpoint.read_manifest(run_dir)
        checkpoint.verify(run_dir, manifest)
        assert 2 * EVERY <= manifest["step"] < STEPS
        resumed = hosts.start(run_dir, "--resume", run_dir)
        assert resumed.finish() == [0, 0], resumed.output
    assert_same_final_weights(run_dir, reference.run_dir())
