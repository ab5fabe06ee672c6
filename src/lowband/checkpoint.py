"""Crash-safe, per-rank checkpoints of a training run.

Layout inside the run directory::

    checkpoints/step-000000040/rank0.pt, rank1.pt, ...   one file per rank (its own state:
                                                          model, optimizer, scheduler, engine
                                                          state, RNG, data position)
    checkpoints/latest.json                               the manifest: which step directory
                                                          is complete, and the run's config

Commit protocol: every rank writes its file atomically (temp file, flush, fsync, rename,
fsync of the directory); a barrier; then rank 0 replaces the manifest atomically. A crash at
any point therefore leaves ``latest.json`` naming the previous complete checkpoint, whose
files are never touched by a later save (older step directories are pruned only after the
new manifest is durable). Files hold only tensors and plain containers and are read with
``torch.load(weights_only=True)``, so a checkpoint cannot run code when loaded.
"""
from __future__ import annotations

import io
import json
import os
import shutil
from typing import Any, Callable, Optional

import torch

from . import faults

FORMAT = 1
DIRNAME = "checkpoints"
MANIFEST = "latest.json"
#: configuration fields a resumed run may change: they do not alter the trajectory so far
#: (how long to train, how to report, how long to wait, what to do on a future NaN)
RESUMABLE_CHANGES = frozenset({
    "epochs", "max_steps", "progress", "timeout_s", "run_dir", "eval_every_epoch", "checkpoint_every",
    "keep_checkpoints", "resume", "data_dir", "threads", "nonfinite", "master_addr",
})


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the run being resumed."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, *, step: int = -1, rank: int = -1) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old file or the new one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        faults.during_checkpoint_write(f, data, step, rank)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, DIRNAME, f"step-{step:09d}")


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def manifest_path(run_dir: str) -> str:
    return os.path.join(run_dir, DIRNAME, MANIFEST)


def save(run_dir: str, rank: int, world_size: int, step: int, state: dict[str, Any], info: dict[str, Any],
         barrier: Callable[[], None], keep: int) -> None:
    """Collective: write this rank's ``state`` for ``step`` and commit it once all ranks have.
    ``info`` (JSON-able: position, config) goes into the manifest; ``keep`` complete
    checkpoints are retained."""
    directory = step_dir(run_dir, step)
    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "step": step, "rank": rank, "world_size": world_size, **state}, buf)
    atomic_write(os.path.join(directory, rank_file(rank)), buf.getvalue(), step=step, rank=rank)
    barrier()                      # every rank's file is durable before the manifest names it
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                    "dir": os.path.basename(directory),
                    "files": [rank_file(r) for r in range(world_size)], **info}
        atomic_write(manifest_path(run_dir), json.dumps(manifest, indent=2, sort_keys=True).encode())
        _prune(run_dir, step, keep)


def _prune(run_dir: str, committed: int, keep: int) -> None:
    """Keep ``committed`` and the ``keep - 1`` newest before it; remove older ones and any
    later, never-committed leftovers of a run that crashed after its last checkpoint."""
    root = os.path.join(run_dir, DIRNAME)
    steps = sorted(int(d.split("-", 1)[1]) for d in os.listdir(root)
                   if d.startswith("step-") and d.split("-", 1)[1].isdigit())
    older = [s for s in steps if s < committed]
    doomed = older[: max(0, len(older) - (keep - 1))] + [s for s in steps if s > committed]
    for s in doomed:
        shutil.rmtree(step_dir(run_dir, s), ignore_errors=True)


def read_manifest(run_dir: str) -> dict[str, Any]:
    path = manifest_path(run_dir)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint to resume from: {path} does not exist "
                              "(was the run started with --checkpoint-every?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {path} is unreadable: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint manifest {path} has format {manifest.get('format')!r}, expected {FORMAT}")
    return manifest


def check_resumable(manifest: dict[str, Any], config: dict[str, Any], world_size: int) -> None:
    """Raise CheckpointError unless a run with ``config`` on ``world_size`` ranks can continue it."""
    if manifest["world_size"] != world_size:
        raise CheckpointError(f"the checkpoint was written by {manifest['world_size']} workers, "
                              f"but this run has {world_size}; resume with --workers {manifest['world_size']}")
    saved = manifest.get("config", {})
    differ = sorted(k for k in set(saved) | set(config)
                    if k not in RESUMABLE_CHANGES and saved.get(k) != config.get(k))
    if differ:
        detail = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {config.get(k)!r}" for k in differ)
        raise CheckpointError(f"the run configuration differs from the checkpointed one ({detail}); "
                              "only " + ", ".join(sorted(RESUMABLE_CHANGES)) + " may change on resume")


def load(run_dir: str, rank: int, world_size: int, manifest: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """This rank's state from the latest complete checkpoint."""
    manifest = manifest or read_manifest(run_dir)
    path = os.path.join(run_dir, DIRNAME, manifest["dir"], rank_file(rank))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} named by the manifest is missing") from None
    except Exception as e:   # torch raises several types for a damaged zip / pickle
        raise CheckpointError(f"checkpoint file {path} is unreadable: {e}") from None
    if (state.get("format"), state.get("step"), state.get("rank"), state.get("world_size")) != \
            (FORMAT, manifest["step"], rank, world_size):
        raise CheckpointError(f"checkpoint file {path} does not belong to step {manifest['step']} of "
                              f"rank {rank} in a world of {world_size}")
    return state
