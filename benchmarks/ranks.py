"""Run a benchmark's worker on N spawned gloo ranks of this machine and collect their results.

``worker(rank, world, port, *args, queue)`` must put ``(rank, result)`` on ``queue`` once;
:func:`run_ranks` starts the ranks (spawn context, a free loopback port for the rendezvous),
waits for every rank's result and returns them by rank."""
from __future__ import annotations

from typing import Any, Callable

import torch.multiprocessing as mp

from lowband.launcher import free_port


def run_ranks(worker: Callable[..., None], world: int, *args: Any) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return results
