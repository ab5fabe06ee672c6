"""Run a training function on every rank, under torchrun or spawned on this machine.

A user's script calls :func:`launch` once; it works unchanged under ``python script.py``
(``nproc`` local ranks, spawned here, rendezvous on loopback) and under ``torchrun`` or any
launcher that sets ``RANK``/``WORLD_SIZE`` (it joins that world)."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .launcher import free_port
from .rendezvous import init_process_group

__all__ = ["launch"]


def _rank_main(local_rank: int, fn: Callable[..., Any], args: tuple, nproc: int, port: Optional[int],
               timeout_s: float) -> None:
    if port is not None:                      # spawned here: the environment torchrun would set
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")        # gloo on Linux's loopback interface
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    if torch.cuda.is_available():             # NCCL when every local rank has a GPU of its own
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl" if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)) else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    init_process_group(backend, timedelta(seconds=timeout_s))   # a loopback rendezvous stays on loopback
    try:
        fn(*args, device)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], *args: Any, nproc: int = 2, timeout_s: float = 300.0) -> None:
    """Call ``fn(*args, device)`` on every rank inside an initialized process group.

    Under torchrun (``RANK`` set) this process is one rank; otherwise ``nproc`` ranks are
    spawned here (``fn`` and ``args`` must pickle: a module-level function). ``device`` is the
    rank's GPU when CUDA is available (backend NCCL when every local rank has one, else gloo),
    else the CPU with gloo. The process group is destroyed when ``fn`` returns or raises."""
    if "RANK" in os.environ:
        _rank_main(int(os.environ.get("LOCAL_RANK", 0)), fn, args, 1, None, timeout_s)
    else:
        if not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc must be an integer >= 1, got {nproc!r}")
        torch.multiprocessing.spawn(_rank_main, args=(fn, args, nproc, free_port(), timeout_s), nprocs=nproc)
