"""Spawn N worker processes on this machine (gloo over loopback) and watch them.

Each worker is ``python -m lowband.app.worker CONFIG`` with the standard torch.distributed
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the very same worker code runs
under torchrun on many nodes. A ``prefix``/``extra_env`` per rank lets the network emulation run
each worker inside its own network namespace.

If a worker exits with an error, the others get ``grace_s`` seconds to notice (their
collectives fail) and are then terminated, and the launch returns the status of the worker
that caused it (see :func:`_cause`: a worker that lost contact with its peers exits with
:data:`EXIT_PEER_LOST`, so a survivor is never blamed for a peer that stopped responding).
A worker that *died* (killed by a signal, or exited with its own error) cuts the grace to
``dead_grace_s``: its peers usually notice at once (a reset connection), but a receive posted
after the connection closed waits for the whole collective timeout, and nothing can answer it
any more. No process is left behind, also on Ctrl-C, and (Linux) also when the launcher itself is
killed: each worker gets a parent-death signal. With the default loopback master address the
rendezvous store and gloo's sockets listen on loopback only (see :mod:`lowband.runtime.rendezvous`).
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
PR_SET_PDEATHSIG = 1            # prctl(2) option
#: exit status of a worker that stopped because a collective with its peers broke or timed
#: out (``lowband.app.worker``): the effect of another worker's failure, never its cause
EXIT_PEER_LOST = 3


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
    grace_s: float = 0.0
    #: the grace period was the short one after a worker died (``dead_grace_s``)
    after_death: bool = False

    def _what(self, rank: int) -> str:
        if rank in self.terminated:
            if self.after_death and rank != self.failed_rank:
                return (f"was still waiting for the other workers {self.grace_s:g} s after rank {self.failed_rank} "
                        f"failed and was terminated")
            return f"stopped responding: it was still running {self.grace_s:g} s after the first failure and was terminated"
        code = self.returncodes[rank]
        if code == EXIT_PEER_LOST:
            return f"lost contact with the other workers (exit status {EXIT_PEER_LOST})"
        return describe_status(code)

    def describe(self) -> str:
        """One line naming the rank that caused the failure and how, then what became of the others."""
        if self.failed_rank is None:
            return "all workers exited with status 0"
        first = f"worker rank {self.failed_rank} {self._what(self.failed_rank)} (first to fail)"
        others = [f"rank {rank} {self._what(rank)}" for rank, code in enumerate(self.returncodes)
                  if rank != self.failed_rank and (code != 0 or rank in self.terminated)]
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
    dead_grace_s: float = 5.0,
    module: str = "lowband.app.worker",
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
        return _watch(procs, grace_s, dead_grace_s)
    except KeyboardInterrupt:
        _terminate(procs)
        raise
    finally:
        _terminate(procs)


def _cause(codes: list, terminated: list[int], seen: dict[int, int]) -> Optional[int]:
    """The rank that most likely caused the failure, by kind, then by the poll in which it
    was first seen failing (``seen``), then by rank: one killed by a signal (a SIGKILLed
    worker's sockets reset its peers before the kernel reports its death, so it may be seen
    after them), then one that exited with its own error, then one that stopped responding
    (still running when the grace period ended), and only then one that merely lost contact."""
    def kind(r: int) -> int:
        if r in terminated:
            return 2
        if codes[r] < 0:
            return 0
        return 3 if codes[r] == EXIT_PEER_LOST else 1
    failed = [r for r, c in enumerate(codes) if c != 0 or r in terminated]
    return min(failed, key=lambda r: (kind(r), seen.get(r, 0), r)) if failed else None


def _died(code: Optional[int]) -> bool:
    """A worker that ended by itself in failure (a signal, or its own error), not one that
    merely lost contact with its peers."""
    return code is not None and code != 0 and code != EXIT_PEER_LOST


def _watch(procs: list[subprocess.Popen], grace_s: float, dead_grace_s: Optional[float] = None) -> LaunchResult:
    deadline: Optional[float] = None
    terminated: list[int] = []
    seen: dict[int, int] = {}          # rank -> poll in which it was first seen failing
    polls = 0
    after_death = False
    while True:
        codes = [p.poll() for p in procs]
        polls += 1
        for rank, c in enumerate(codes):
            if c not in (None, 0):
                seen.setdefault(rank, polls)
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if seen and deadline is None:
            deadline = now + grace_s
        if (dead_grace_s is not None and dead_grace_s < grace_s and not after_death
                and any(_died(c) for c in codes)):
            after_death = True
            deadline = min(deadline, now + dead_grace_s)
        if deadline is not None and now > deadline:
            terminated = [r for r, c in enumerate(codes) if c is None]
            _terminate(procs)
            codes = [p.wait() for p in procs]
            break
        time.sleep(POLL_S)
    failed_rank = _cause(codes, terminated, seen)
    rc = 0 if failed_rank is None else codes[failed_rank]
    # a worker killed by a signal (or terminated here) has a negative code: a plain failure
    return LaunchResult(returncode=rc if rc >= 0 else 1, failed_rank=failed_rank, returncodes=codes,
                        terminated=terminated, grace_s=dead_grace_s if after_death else grace_s,
                        after_death=after_death)


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
