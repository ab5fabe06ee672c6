"""Run a benchmark's worker on N spawned gloo ranks of this machine and collect their results.

``worker(rank, world, port, *args, queue)`` must put ``(rank, result)`` on ``queue`` once;
:func:`run_ranks` starts the ranks (spawn context, a free loopback port for the rendezvous),
waits for every rank's result and returns them by rank. Each rank's C heap is in the mode of
lowband's workers (``--malloc``, default ``cached``: ``lowband.runtime.memory``) before the worker's
first tensor, so a bare loop measures the step ``lowband train`` and ``lowband bench`` run."""
from __future__ import annotations

from typing import Any, Callable

import torch.multiprocessing as mp

from lowband.runtime import memory
from lowband.runtime.launcher import free_port


def _rank(malloc: str, worker: Callable[..., None], *args: Any) -> None:
    memory.configure(malloc)
    worker(*args)


def run_ranks(worker: Callable[..., None], world: int, *args: Any,
              malloc: str = memory.DEFAULT_MODE) -> dict[int, Any]:
    memory.check_mode(malloc)
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(malloc, worker, r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return results
