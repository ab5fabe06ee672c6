#!/usr/bin/env python3
"""What does the non-finite gradient guard cost per step?

Two (or more) gloo ranks train three copies of the same model with S-SGD, one engine per
``nonfinite`` policy (``off``, ``raise``, ``skip``), and take their steps round-robin, so any
drift in machine load hits the three alike; the table gives the median step time of each and
its difference to ``off``. ``raise`` adds an ``isfinite`` pass over each gradient inside the
backward hooks plus one all-reduce of ``world_size`` int64 per step; ``skip`` in addition
defers all communication until backward has finished (no overlap).

    python benchmarks/guard_cost.py --model cnn --workers 2 --steps 150
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ranks import run_ranks

POLICIES = ("off", "raise", "skip")
#: first steps of each engine left out of the median (allocation, first touch)
WARMUP_STEPS = 10


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import lowband
    from lowband.data import ShardedBatches, make_synthetic
    from lowband.guard import all_finite
    from lowband.models import make_model
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = make_synthetic(args.batch_size * world * 8, seed=1)
    batches = ShardedBatches(data, args.batch_size, rank, world, seed=2)
    runs = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        model = make_model(args.model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        runs[policy] = (model, opt, lowband.distribute(model, opt, "ssgd", bucket_mb=args.bucket_mb, nonfinite=policy))
    times = {p: [] for p in POLICIES}
    for step in range(args.steps):
        x, y = batches.dataset.images[batches.indices(0, step % batches.steps_per_epoch)], \
            batches.dataset.labels[batches.indices(0, step % batches.steps_per_epoch)]
        for policy in POLICIES:
            model, opt, engine = runs[policy]
            dist.barrier()                       # all ranks start the step together
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            engine.step()
            times[policy].append(time.perf_counter() - t0)
    # the two parts of the guard's cost, separately: the local isfinite pass over all
    # gradients, and the per-step agreement (an all-reduce of world_size int64)
    model = runs["raise"][0]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    check, agree = [], []
    flags = torch.zeros(world, dtype=torch.int64)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        [bool(all_finite(g)) for g in grads]
        t1 = time.perf_counter()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        t2 = time.perf_counter()
        check.append(t1 - t0)
        agree.append(t2 - t1)
    result = {p: t[WARMUP_STEPS:] for p, t in times.items()}
    result["isfinite pass"], result["agreement all-reduce"] = check, agree
    queue.put((rank, result))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    print("command: python " + " ".join(sys.argv))
    results = run_ranks(worker, args.workers, args)
    times = results[0]   # rank 0's view; every rank waits for the same collectives
    base = statistics.median(times["off"])
    print("| nonfinite | median step ms | vs off |")
    print("|---|---|---|")
    for policy in POLICIES:
        m = statistics.median(times[policy])
        print(f"| {policy} | {1e3 * m:.2f} | {1e3 * (m - base):+.2f} ms ({100 * (m - base) / base:+.1f}%) |")
    for part in ("isfinite pass", "agreement all-reduce"):
        print(f"| ({part} alone) | {1e3 * statistics.median(times[part]):.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
