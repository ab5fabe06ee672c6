"""Run a function in N gloo processes and collect what each rank returns."""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import time
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

from lowband.runtime.launcher import free_port

POLL_S = 0.5


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue, timeout_s: float,
           backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    # Leave without the interpreter's finalization: tearing down torch and torch._dynamo (which
    # every optimizer imports) takes 1-2 s of CPU per rank, all of it after the result is in.
    # Flush the queue first (its feeder thread), as multiprocessing's own fork children do
    # before their os._exit.
    sys.stdout.flush()
    sys.stderr.flush()
    queue.close()
    queue.join_thread()
    os._exit(0)


_CTX = None


def _context():
    """A forkserver whose server has already imported torch, torch._dynamo (what constructing
    an optimizer imports) and lowband: each rank is a fork of it, so a rank starts in
    milliseconds instead of 4-5 s of imports. The server is started on first use and
    imports nothing but these modules, so no thread pool or process group is forked.
    Unlike spawn, a rank inherits the environment the server started with, not the test's
    current ``os.environ``: set variables inside the rank function (as the kernel-mode tests
    do). ``LOWBAND_TEST_START_METHOD=spawn`` restores the old start."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context(os.environ.get("LOWBAND_TEST_START_METHOD", "forkserver"))
        if _CTX.get_start_method() == "forkserver":
            _CTX.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "lowband", "tests.distributed"])
    return _CTX


#: attempts when rank 0's store finds its port taken (free_port's port can be taken by another
#: process before rank 0 binds it: seen with pytest-xdist running tests side by side)
PORT_ATTEMPTS = 3


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 90.0,
                    backend: str = "gloo") -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks (gloo, or ``backend``);
    returns results by rank.
    Raises with the failing rank's traceback; never waits longer than ``timeout_s`` per attempt
    (a new port and attempt only when the first one was taken: EADDRINUSE)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _run_once(fn, world_size, args, timeout_s, backend)
        except AssertionError as e:
            if "EADDRINUSE" not in str(e) or attempt == PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float, backend: str) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, timeout_s, backend)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s + 30
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=POLL_S)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    errors.append(f"rank {dead[0]} exited with status {procs[dead[0]].exitcode} before reporting")
                elif time.monotonic() > deadline:
                    errors.append(f"no result after {timeout_s + 30:.0f} s")
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
