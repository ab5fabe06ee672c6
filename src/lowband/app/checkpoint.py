"""Crash-safe, per-rank checkpoints of a training run.

Layout inside the run directory::

    checkpoints/step-000000040/rank0.pt, rank1.pt, ...   one file per rank (its own state:
                                                          model, optimizer, scheduler, engine
                                                          state, RNG, data position)
    checkpoints/latest.json                               the manifest: which step directory
                                                          is complete, and the run's config

Commit protocol: every rank writes its file atomically (temp file, flush, fsync, rename,
fsync of the directory) and computes its SHA-256; the ranks gather the digests (which is also
the barrier: every file is durable before the manifest names it); then rank 0 replaces the
manifest atomically. A crash at any point therefore leaves ``latest.json`` naming the previous
complete checkpoint, whose files are never touched by a later save (older step directories are
pruned only after the new manifest is durable).

Verification on resume: the manifest carries the SHA-256 of every rank file and of its own
contents, and :func:`verify` / :func:`load` refuse a file whose bytes differ (``torch.load``
does not check the zip CRCs: flipped bits inside a tensor load silently). Files hold only
tensors and plain containers and are read with ``torch.load(weights_only=True)``, so a
checkpoint cannot run code when loaded.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from typing import Any, Callable, Optional

import torch

from ..algorithms import ALGORITHMS
from ..runtime import faults
from ..runtime.device import to_device

#: 2: the manifest carries SHA-256 digests (format-1 checkpoints cannot be verified, so they
#: are refused rather than trusted)
FORMAT = 2
DIRNAME = "checkpoints"
MANIFEST = "latest.json"
#: configuration fields a resumed run may change: they do not alter the trajectory so far
#: (how long to train, how to report and evaluate, how long to wait, what to do on a future
#: NaN); a changed length stretches a cosine schedule from the resume point (schedule.py)
RESUMABLE_CHANGES = frozenset({
    "epochs", "max_steps", "progress", "timeout_s", "run_dir", "eval_every_epoch", "eval_every_steps",
    "checkpoint_every", "keep_checkpoints", "resume", "data_dir", "threads", "cpu_binding", "malloc", "nonfinite",
    "max_consecutive_skips", "master_addr",
    # where the tensors live: state reloads onto the model's device (a run moved between CPU
    # and GPU continues, though not bit for bit); checkpoints from before --device lack it
    "device",
})


#: configuration fields added after checkpoints were first written, with the value every run
#: before them had: a checkpoint that lacks one is compared as if it held that value
ADDED_FIELDS = {"micro_batches": 1}
#: configuration fields that checkpoints of earlier versions hold and this version no longer has
#: (none of them altered a trajectory): left out of the comparison. An algorithm's removed knobs
#: are its own (``Algorithm.removed_knobs``), in ``algorithm_options`` here and in each rank's
#: engine state
REMOVED_FIELDS = frozenset({"comm_slice_us"})


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


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON without its own digest field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return sha256(json.dumps(body, sort_keys=True).encode())


def save(run_dir: str, rank: int, world_size: int, step: int, state: dict[str, Any], info: dict[str, Any],
         all_gather: Callable[[str], list[str]], keep: int) -> None:
    """Collective: write this rank's ``state`` for ``step`` and commit it once all ranks have.
    ``all_gather(digest)`` returns every rank's digest, in rank order (on all ranks; it is the
    barrier before the commit). ``info`` (JSON-able: position, config) goes into the manifest;
    ``keep`` complete checkpoints are retained."""
    directory = step_dir(run_dir, step)
    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "step": step, "rank": rank, "world_size": world_size, **state}, buf)
    data = buf.getvalue()
    atomic_write(os.path.join(directory, rank_file(rank)), data, step=step, rank=rank)
    digests = all_gather(sha256(data))   # every rank's file is durable before the manifest names it
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                    "dir": os.path.basename(directory),
                    "files": [rank_file(r) for r in range(world_size)],
                    "sha256": {rank_file(r): d for r, d in enumerate(digests)}, **info}
        manifest["manifest_sha256"] = _manifest_digest(manifest)
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
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"checkpoint manifest {path} has format {found!r}, expected {FORMAT} "
                              "(a checkpoint of another lowband version cannot be verified)")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointError(f"checkpoint manifest {path} is corrupted: its contents do not match its SHA-256")
    return manifest


def check_resumable(manifest: dict[str, Any], config: dict[str, Any], world_size: int, *,
                    torchrun: bool = False) -> None:
    """Raise CheckpointError unless a run with ``config`` on ``world_size`` ranks can continue it.
    The world size cannot change: each rank's file holds that rank's own algorithm state
    (residuals, accumulators, a step in flight) and data position. ``torchrun``: the run was
    started by torchrun, so the advice names its flags instead of ``--workers``."""
    if manifest["world_size"] != world_size:
        saved = manifest["world_size"]
        how = (f"torchrun with {saved} processes in all (--nnodes x --nproc-per-node)" if torchrun
               else f"--workers {saved}")
        raise CheckpointError(f"the checkpoint was written by {saved} workers, but this run has {world_size}; "
                              f"resume with {how} (a checkpoint resumes only at the world size that wrote it)")
    saved = {k: v for k, v in {**ADDED_FIELDS, **manifest.get("config", {})}.items() if k not in REMOVED_FIELDS}
    algorithm = ALGORITHMS.get(saved.get("algorithm"))
    if algorithm is not None and saved.get("algorithm_options"):
        # the algorithm's own removed knobs (Algorithm.removed_knobs), as the engine reads its state
        try:
            saved["algorithm_options"] = algorithm.current_config(saved["algorithm_options"])
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    if algorithm is not None and saved.get("algorithm") == config.get("algorithm"):
        # a knob added since, now given at the value the versions before it ran with
        options = algorithm.options_from_before(saved.get("algorithm_options") or {},
                                                config.get("algorithm_options") or {})
        if options:
            saved["algorithm_options"] = options
    config = {**ADDED_FIELDS, **config}
    differ = sorted(k for k in set(saved) | set(config)
                    if k not in RESUMABLE_CHANGES and saved.get(k) != config.get(k))
    if differ:
        detail = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {config.get(k)!r}" for k in differ)
        raise CheckpointError(f"the run configuration differs from the checkpointed one ({detail}); "
                              "only " + ", ".join(sorted(RESUMABLE_CHANGES)) + " may change on resume")


def file_path(run_dir: str, manifest: dict[str, Any], rank: int) -> str:
    return os.path.join(run_dir, DIRNAME, manifest["dir"], rank_file(rank))


def _read_verified(run_dir: str, manifest: dict[str, Any], rank: int) -> tuple[str, bytes]:
    """The bytes of ``rank``'s file, after checking them against the manifest's SHA-256."""
    path = file_path(run_dir, manifest, rank)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} named by the manifest is missing") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable: {e}") from None
    want = manifest.get("sha256", {}).get(rank_file(rank))
    if sha256(data) != want:
        raise CheckpointError(f"checkpoint file {path} is corrupted: its SHA-256 differs from the one recorded "
                              "in the manifest when it was written")
    return path, data


def verify(run_dir: str, manifest: dict[str, Any]) -> None:
    """Check every rank's file of the manifest's checkpoint (exists, SHA-256 matches); raises
    CheckpointError naming the first bad file. ``lowband train --resume`` runs this before
    any worker starts."""
    for rank in range(manifest["world_size"]):
        _read_verified(run_dir, manifest, rank)


def load(run_dir: str, rank: int, world_size: int, manifest: Optional[dict[str, Any]] = None,
         map_location: Optional[torch.device] = None) -> dict[str, Any]:
    """This rank's state from the latest complete checkpoint, verified against the manifest.
    With ``map_location`` (the model's device) every tensor but the RNG states is moved there,
    so algorithm state (residuals, accumulators, in-flight gradients) is where the next step
    computes with it; the RNG states stay on the CPU, where ``torch.set_rng_state`` wants them."""
    manifest = manifest or read_manifest(run_dir)
    path, data = _read_verified(run_dir, manifest, rank)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:   # torch raises several types for a damaged zip / pickle
        raise CheckpointError(f"checkpoint file {path} is unreadable: {e}") from None
    if (state.get("format"), state.get("step"), state.get("rank"), state.get("world_size")) != \
            (FORMAT, manifest["step"], rank, world_size):
        raise CheckpointError(f"checkpoint file {path} does not belong to step {manifest['step']} of "
                              f"rank {rank} in a world of {world_size}")
    if map_location is not None:
        state = {k: v if k == "rng" else to_device(v, map_location) for k, v in state.items()}
    return state
