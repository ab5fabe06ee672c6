"""Spawn N worker processes on this machine (gloo over loopback) and watch them.

Each worker is ``python -m lowband.worker CONFIG`` with the standard torch.distributed
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the very same worker code runs
under torchrun on many nodes. A ``prefix``/``extra_env`` per rank lets the network emulation run
each worker inside its own network namespace.

If a worker exits with an error, the others get ``grace_s`` seconds to notice (their
collectives fail) and are then terminated, and the launch returns that worker's exit status;
no process is left behind, also on Ctrl-C, and (Linux) also when the launcher itself is
killed: each worker gets a parent-death signal. With the default loopback master address the
rendezvous store and gloo's sockets listen on loopback only (see :mod:`lowband.rendezvous`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

LOOPBACK = "127.0.0.1"
LOOPBACK_IFNAME = "lo"
POLL_S = 0.1
#: after the first worker failure, how long to wait for others before naming the cause
CAUSE_SETTLE_S = 1.0
PR_SET_PDEATHSIG = 1            # prctl(2) option


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_status(code: Optional[int]) -> str:
    """'exited with status 1', 'was killed by signal SIGKILL', ... for a Popen return code."""
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class LaunchResult:
    returncode: int
    failed_rank: Optional[int] = None
    returncodes: list = field(default_factory=list)
    #: ranks still running at the end of the grace period, terminated by the launcher
    terminated: list = field(default_factory=list)

    def describe(self) -> str:
        """One line naming the first rank that failed and how, then what became of the others."""
        if self.failed_rank is None:
            return "all workers exited with status 0"
        first = f"worker rank {self.failed_rank} {describe_status(self.returncodes[self.failed_rank])} (first to fail)"
        others = []
        for rank, code in enumerate(self.returncodes):
            if rank == self.failed_rank:
                continue
            if rank in self.terminated:
                others.append(f"rank {rank} did not exit within the grace period and was terminated")
            elif code != 0:
                others.append(f"rank {rank} {describe_status(code)}")
        return first + ("; " + "; ".join(others) if others else "")


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if the launcher dies, so no worker is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):   # not Linux: Ctrl-C / normal exits are still handled
        pass


def launch_workers(
    world_size: int,
    config_path: str,
    *,
    threads: int = 1,
    master_addr: str = LOOPBACK,
    prefix: Optional[Callable[[int], Sequence[str]]] = None,
    extra_env: Optional[Callable[[int], dict]] = None,
    grace_s: float = 30.0,
    module: str = "lowband.worker",
) -> LaunchResult:
    """Run ``world_size`` workers to completion; see the module docstring for failure handling."""
    port = free_port(LOOPBACK) if master_addr == LOOPBACK else free_port("0.0.0.0")
    procs: list[subprocess.Popen] = []
    base_env = dict(os.environ)
    src_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base_env["PYTHONPATH"] = src_dir + (os.pathsep + base_env["PYTHONPATH"] if base_env.get("PYTHONPATH") else "")
    try:
        for rank in range(world_size):
            env = dict(base_env)
            env.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(threads), "LOWBAND_LAUNCHED": "1",
            })
            if master_addr == LOOPBACK:
                # gloo otherwise listens on the address the host name resolves to
                env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
            if extra_env is not None:
                env.update(extra_env(rank))
            cmd = list(prefix(rank) if prefix else []) + [sys.executable, "-m", module, config_path]
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))
        return _watch(procs, grace_s)
    except KeyboardInterrupt:
        _terminate(procs)
        raise
    finally:
        _terminate(procs)


def _cause_first(codes: list, failed: list[int]) -> int:
    """Of the failed ranks, the likely cause: one killed by a signal before one that exited
    with an error (its collectives broke because of the other), then the lowest rank."""
    return min(failed, key=lambda r: (codes[r] >= 0, r))


def _watch(procs: list[subprocess.Popen], grace_s: float) -> LaunchResult:
    failed_rank, first_failure, deadline = None, None, None
    terminated: list[int] = []
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        failed = [rank for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed and first_failure is None:
            first_failure, deadline = now, now + grace_s
        # a SIGKILLed worker's sockets reset its peers before the kernel reports its death, so
        # a survivor may be seen exiting first: wait a moment before naming the cause
        if failed_rank is None and first_failure is not None and now >= first_failure + CAUSE_SETTLE_S:
            failed_rank = _cause_first(codes, failed)
        if deadline is not None and now > deadline:
            terminated = [r for r, c in enumerate(codes) if c is None]
            _terminate(procs)
            codes = [p.wait() for p in procs]
            break
        time.sleep(POLL_S)
    if failed_rank is None:
        bad = [r for r, c in enumerate(codes) if c != 0 and r not in terminated]
        failed_rank = _cause_first(codes, bad) if bad else None
    rc = 0 if failed_rank is None else codes[failed_rank]
    # a worker killed by a signal has a negative code; report it as a plain failure
    return LaunchResult(returncode=rc if rc >= 0 else 1, failed_rank=failed_rank, returncodes=codes,
                        terminated=terminated)


def _terminate(procs: list[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """SIGTERM (and SIGCONT) what still runs, then SIGKILL what ignores it."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.send_signal(signal.SIGCONT)   # a stopped (SIGSTOP) worker acts on it now
            except ProcessLookupError:
                pass
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
