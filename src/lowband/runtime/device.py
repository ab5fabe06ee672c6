"""Where a run's tensors live (``--device cpu|cuda|auto``) and which backend carries them.

* ``cpu`` (default): everything on the CPU, gloo.
* ``cuda``: model, batches and algorithm state on the GPU of this rank (``LOCAL_RANK``, else
  ``rank % device_count``). The backend is NCCL when every rank of this machine has a GPU of
  its own (NCCL refuses two ranks on one GPU), else gloo with CUDA tensors (it copies through
  the host). ``LOWBAND_BACKEND=gloo|nccl`` overrides the choice.
* ``auto``: ``cuda`` if torch sees a GPU, else ``cpu``.

CPU tests check the plumbing; tests/test_cuda.py and benchmarks/gpu_check.sh check the GPU path
(1 rank over NCCL, 2 over gloo with CUDA tensors).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

DEVICES = ("cpu", "cuda", "auto")
BACKEND_ENV = "LOWBAND_BACKEND"
BACKENDS = ("gloo", "nccl")


def resolve(name: str) -> str:
    """``cpu`` or ``cuda`` for a ``--device`` value; ValueError (one sentence) for an unknown
    name, or for ``cuda`` on a machine where torch sees no GPU."""
    if name not in DEVICES:
        raise ValueError(f"--device must be one of: {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
        raise ValueError(f"--device cuda: CUDA is not available ({why}, torch {torch.__version__}); "
                         "use --device cpu or auto")
    return name


def backend_for(device: str, local_world_size: int, env: Optional[dict] = None) -> str:
    """The process-group backend of a run on ``device`` with ``local_world_size`` ranks on this
    machine: NCCL when each of them gets a GPU of its own, else gloo."""
    env = os.environ if env is None else env
    forced = env.get(BACKEND_ENV, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={forced!r}; choose one of: {', '.join(BACKENDS)}")
        return forced
    if device == "cuda" and local_world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def local_world_size(world_size: int, env: Optional[dict] = None) -> int:
    """Ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else the whole world (the
    launcher spawns every rank here)."""
    env = os.environ if env is None else env
    return int(env.get("LOCAL_WORLD_SIZE", world_size))


def bind(device: str, rank: int, env: Optional[dict] = None) -> torch.device:
    """This rank's ``torch.device``: GPU ``LOCAL_RANK`` (else ``rank``) modulo the GPU count, so
    ranks beyond the GPUs share them (over gloo); on CUDA it also becomes the current device
    (NCCL and the default stream follow it)."""
    if device != "cuda":
        return torch.device("cpu")
    env = os.environ if env is None else env
    index = int(env.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def collective_device(group: Any = None) -> torch.device:
    """Where tensors handed to ``group``'s collectives must live: the current GPU under NCCL,
    else the CPU (gloo takes both; small control tensors are cheapest on the host)."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (nested dicts, lists and tuples of tensors and plain values) with every tensor
    moved to ``device``; tensors already there are returned as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        items = [to_device(v, device) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj
