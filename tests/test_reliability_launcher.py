"""The launcher names the cause of a failed run, not the worker that merely noticed it."""
from __future__ import annotations

import signal

import pytest

from lowband.runtime.launcher import EXIT_PEER_LOST, LaunchResult, _cause

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
