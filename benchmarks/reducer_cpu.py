"""Process CPU per step of the compressed reducer alone, on real gloo ranks (no model).

Why: on a machine with one core per worker, CPU a background thread spends is not hidden by
any overlap, so the reducer's CPU per step is what a pipelined method really pays. This times
``CompressedReducer.start(...).wait()`` over a model's parameter count split into buckets of
``--bucket-mb``, 2-bit with error feedback, and prints the process CPU (all threads: codec,
gloo, glue) and the wall time per iteration, per rank.

    PYTHONPATH=src python benchmarks/reducer_cpu.py --model cnn --bucket-mb 1 64 --collective two-stage allgather
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, port, model_name, bucket_mb, collective, iters, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lowband.collectives.communicator import Communicator
    from lowband.collectives.wire import MIB
    from lowband.compressors import build_compressor
    from lowband.models import make_model
    from lowband.pipeline import make_reducer
    numel = sum(p.numel() for p in make_model(model_name).parameters())
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    cap = max(1, int(bucket_mb * MIB) // 4)
    buckets = [flat[i:i + cap] for i in range(0, numel, cap)]
    reducer = make_reducer(collective, Communicator(), build_compressor("2bit", {}, error_feedback=True))

    def once():
        handles = [reducer.start(b, f"b{i}", [(f"b{i}", b.numel())]) for i, b in enumerate(buckets)]
        for h in handles:
            h.wait()
    for _ in range(10):
        once()
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        once()
    c1, t1 = time.process_time(), time.perf_counter()
    queue.put((rank, len(buckets), 1e3 * (c1 - c0) / iters, 1e3 * (t1 - t0) / iters))
    reducer.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[1.0, 64.0])
    ap.add_argument("--collective", nargs="+", default=["two-stage", "allgather"])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"# {args.model}, {args.workers} gloo ranks on loopback, 2-bit with error feedback, {args.iters} iterations")
    print("| collective | bucket MB | buckets | process CPU ms / step (mean of ranks) | wall ms / step |")
    print("|---|---:|---:|---:|---:|")
    for collective in args.collective:
        for mb in args.bucket_mb:
            queue, port = ctx.Queue(), _free_port()
            procs = [ctx.Process(target=_worker, args=(r, args.workers, port, args.model, mb, collective,
                                                        args.iters, queue)) for r in range(args.workers)]
            for p in procs:
                p.start()
            rows = [queue.get() for _ in procs]
            for p in procs:
                p.join()
            cpu = sum(r[2] for r in rows) / len(rows)
            wall = max(r[3] for r in rows)
            print(f"| {collective} | {mb:g} | {rows[0][1]} | {cpu:.2f} | {wall:.2f} |")


if __name__ == "__main__":
    main()
