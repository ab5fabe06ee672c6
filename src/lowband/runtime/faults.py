"""Fault injection for the reliability tests: crash a worker at an exact point.

Timing a ``kill`` from outside cannot hit "halfway through writing the checkpoint"
reliably, so the checkpoint writer calls these hooks. They do nothing unless the environment
sets ``LOWBAND_FAULT=KIND@STEP`` (and optionally ``LOWBAND_FAULT_RANK``, default 0); the
injected failure is a SIGKILL of the worker itself, exactly what an OOM killer or a lost
machine does (no exception handlers, no flushing, no cleanup).

Kinds:
    ``checkpoint-write@STEP``: write half of this rank's checkpoint temp file, fsync, die.
"""
from __future__ import annotations

import os
import signal
from typing import BinaryIO, Optional

ENV = "LOWBAND_FAULT"
ENV_RANK = "LOWBAND_FAULT_RANK"
CHECKPOINT_WRITE = "checkpoint-write"


def _armed(kind: str, step: int, rank: int) -> bool:
    spec: Optional[str] = os.environ.get(ENV)
    if not spec:
        return False
    name, _, at = spec.partition("@")
    return name == kind and at.isdigit() and int(at) == step and rank == int(os.environ.get(ENV_RANK, "0"))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def during_checkpoint_write(f: BinaryIO, data: bytes, step: int, rank: int) -> None:
    if _armed(CHECKPOINT_WRITE, step, rank):
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        _die()
