"""Entry point of one spawned worker: ``python -m lowband.app.worker RUN_DIR/config.json``.

Failures that lowband detects on purpose (ranks that disagree, a non-finite gradient or
loss, an unusable checkpoint) end the worker with one line naming its rank and exit status 1;
a peer that died or went silent, with exit status :data:`~lowband.runtime.launcher.EXIT_PEER_LOST`
(so the launcher blames the peer, not this worker), unless this worker's own network interface
is down: then it is the cause, says so, and exits with status 1; anything else keeps its traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Any, NoReturn, Optional

import torch.distributed as dist

from ..comm.agreement import ConfigMismatchError
from .checkpoint import CheckpointError
from .config import TrainConfig
from ..engine.guard import NonFiniteGradientError, NonFiniteLossError
from ..runtime.launcher import EXIT_PEER_LOST
from ..runtime.rendezvous import links_down
from .train import run_worker

EXIT_FAILURE = 1


def is_peer_failure(e: BaseException) -> bool:
    """A broken or timed-out collective. gloo raises plain RuntimeErrors whose text names its
    own source files; newer torch code raises DistError subclasses."""
    return isinstance(e, dist.DistError) or "gloo" in str(e)


def fail(message: str, status: int = EXIT_FAILURE) -> NoReturn:
    """Report and leave at once. A normal interpreter exit would run the process group's
    destructors with collectives still in flight on a broken connection, which aborts the
    process (SIGABRT, "terminate called without an active exception") and hides the status."""
    sys.stdout.flush()
    sys.stderr.flush()
    # one write(2) of the whole line: the workers share the launcher's stderr, and a separate
    # write of the newline let two ranks' lines run together (seen in tests)
    os.write(sys.stderr.fileno(), (message + "\n").encode("utf-8", "backslashreplace"))
    os._exit(status)


def run_reported(cfg: TrainConfig) -> Optional[dict[str, Any]]:
    """:func:`~lowband.app.train.run_worker`, with the failures above reported as one line
    and the exit statuses above. ``lowband train`` under torchrun runs its worker through this
    too, so a torchrun job's workers fail the same way."""
    rank = os.environ.get("RANK", "?")
    try:
        return run_worker(cfg)
    except (ConfigMismatchError, NonFiniteGradientError, NonFiniteLossError, CheckpointError) as e:
        fail(f"lowband worker rank {rank}: error: {e}")
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        down = links_down()
        if down:   # this rank is the one cut off: the cause, not a survivor (exit status 1)
            fail(f"lowband worker rank {rank}: error: its network interface {', '.join(down)} is down: lost "
                 f"contact with the other workers for --timeout {cfg.timeout_s:g} s: {first_line}")
        fail(f"lowband worker rank {rank}: error: lost contact with the other workers (one died or sent "
             f"nothing for --timeout {cfg.timeout_s:g} s): {first_line}", EXIT_PEER_LOST)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m lowband.app.worker CONFIG_JSON", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        cfg = TrainConfig.from_json(f.read())
    run_reported(cfg)
    return 0


def exit_now(status: int) -> NoReturn:
    """Leave without the interpreter's finalization. Every file of the run is closed and every
    rank is past the final barrier by now; what is left is tearing down torch and
    torch._dynamo (which constructing an optimizer imports), 1-2 s of CPU per worker that
    the launcher would wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
