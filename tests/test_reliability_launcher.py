"""The launcher names the cause of a failed run, not the worker that merely noticed it."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from lowband.runtime.launcher import EXIT_PEER_LOST, LaunchResult, _cause, _watch

KILLED, TERMINATED = -signal.SIGKILL, -signal.SIGTERM


@pytest.mark.parametrize("codes, terminated, seen, cause", [
    # SIGKILL of rank 1; rank 0 lost contact and was even seen first (its socket reset first)
    ([EXIT_PEER_LOST, KILLED], [], {0: 1, 1: 3}, 1),
    # SIGSTOP of rank 1: rank 0 lost contact, rank 1 never exited and was terminated
    ([EXIT_PEER_LOST, TERMINATED], [1], {0: 1}, 1),
    # rank 2 raised by itself; the others lost contact
    ([EXIT_PEER_LOST, EXIT_PEER_LOST, 1], [], {0: 2, 1: 2, 2: 3}, 2),
    # every rank raised the same agreed error: the lowest rank
    ([1, 1, 1], [], {0: 1, 1: 1, 2: 1}, 0),
    # nobody failed
    ([0, 0], [], {}, None),
])
def test_cause(codes, terminated, seen, cause):
    assert _cause(codes, terminated, seen) == cause


def test_description_of_a_stalled_worker():
    r = LaunchResult(returncode=1, failed_rank=1, returncodes=[EXIT_PEER_LOST, TERMINATED], terminated=[1],
                     grace_s=8.0)
    assert r.describe() == ("worker rank 1 stopped responding: it was still running 8 s after the first failure "
                            "and was terminated (first to fail); rank 0 lost contact with the other workers "
                            "(exit status 3)")


def test_description_of_survivors_terminated_after_a_death():
    r = LaunchResult(returncode=1, failed_rank=1, returncodes=[TERMINATED, KILLED], terminated=[0], grace_s=5.0,
                     after_death=True)
    assert r.describe() == ("worker rank 1 was killed by signal SIGKILL (first to fail); rank 0 was still waiting "
                            "for the other workers 5 s after rank 1 failed and was terminated")


def _procs(*codes_after: tuple) -> list:
    """One process per (exit code or -signal, seconds before it ends; None: sleeps a minute)."""
    out = []
    for code, after in codes_after:
        if code is None:
            body = "import time; time.sleep(60)"
        elif code < 0:
            body = f"import os, time; time.sleep({after}); os.kill(os.getpid(), {-code})"
        else:
            body = f"import sys, time; time.sleep({after}); sys.exit({code})"
        out.append(subprocess.Popen([sys.executable, "-c", body]))
    return out


def test_a_death_cuts_the_grace_period_a_lost_contact_does_not():
    """A worker killed by a signal: the survivor still waiting on it is terminated after the
    short grace, not after --timeout's; a worker that only lost contact (a silent peer) leaves
    the other the whole grace period."""
    t0 = time.monotonic()
    r = _watch(_procs((None, 0), (KILLED, 0.2)), grace_s=60.0, dead_grace_s=0.5)
    assert time.monotonic() - t0 < 10
    assert (r.failed_rank, r.terminated, r.after_death, r.grace_s) == (1, [0], True, 0.5)
    t0 = time.monotonic()
    r = _watch(_procs((EXIT_PEER_LOST, 0.2), (None, 0)), grace_s=2.0, dead_grace_s=0.5)
    assert time.monotonic() - t0 >= 2.0
    assert (r.failed_rank, r.terminated, r.after_death) == (1, [1], False)
