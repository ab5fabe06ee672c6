"""Which CPU cores a worker runs on (``--cpu-binding none|spread``).

* ``spread``: the ranks of one machine split the cores this process may use
  (``os.sched_getaffinity``, so a container's or ``taskset``'s limit is respected) into
  disjoint, contiguous slices, one per local rank (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``); with
  more ranks than cores, rank ``r`` gets core ``r mod cores``. Every thread the worker starts
  afterwards (intra-op threads, gloo's, lowband's pipeline thread) inherits the slice.
* ``none``: the operating system places every thread.

Binding is off by default: on a small machine it made no method faster in ``lowband bench``
(docs/architecture.md). It is what ``numactl --physcpubind`` or Intel's
``torch.backends.xeon.run_cpu`` launcher do, as one flag applied the same way to every
algorithm of a ``lowband bench`` run, for machines where placement matters (several sockets, a
GPU per rank).
"""
from __future__ import annotations

import os
from typing import Optional

CPU_BINDINGS = ("none", "spread")


def check_mode(mode: str) -> None:
    """ValueError, one sentence naming the flag, unless ``mode`` is a binding."""
    if mode not in CPU_BINDINGS:
        raise ValueError(f"--cpu-binding must be one of: {', '.join(CPU_BINDINGS)}, got {mode!r}")


def slice_for(cores: list[int], local_rank: int, local_world: int) -> list[int]:
    """The cores of local rank ``local_rank`` of ``local_world`` under ``spread``."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is outside 0..{local_world - 1}")
    cores = sorted(cores)
    if local_world > len(cores):
        return [cores[local_rank % len(cores)]]
    per = len(cores) // local_world
    return cores[local_rank * per:(local_rank + 1) * per]


def bind(mode: str, env: Optional[dict] = None) -> Optional[list[int]]:
    """Bind this process to its slice under ``mode``; the cores it now runs on, or None when
    ``mode`` is ``none`` or the platform cannot bind (not Linux)."""
    check_mode(mode)
    if mode == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1)))
    local_rank = int(env.get("LOCAL_RANK", env.get("RANK", 0))) % local_world
    mine = slice_for(list(os.sched_getaffinity(0)), local_rank, local_world)
    os.sched_setaffinity(0, mine)
    return mine
