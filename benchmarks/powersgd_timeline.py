"""Where PyTorch's ``powerSGD_hook`` spends a step after backward, at N ranks (gloo, loopback).

The performance model (#13) under-predicts ``ddp-powersgd`` by 10-19% at 2 and 4 workers
(docs/results.md, the validation section). This benchmark times the hook's chain without
lowband's engine: ``--workers`` processes train ``cnn`` under DDP with the hook (lowband's
knobs: rank 2, one bucket, warm start and error feedback), and record, per step, when the
hook is entered, when each of its three all-reduces is launched and completes (uncompressed
tensors, P, Q) and when its future completes. The spans between them are the hook's phases:

* entry -> first launch: error feedback and the copies of the uncompressed tensors;
* first launch -> hook returns: P = MQ (on the main thread);
* each all-reduce, launch -> done (the first one also absorbs the ranks' skew);
* done -> next launch: the phase a callback runs on gloo's thread (unpack, Q = M^T P, M = PQ^T).

It prints the medians over the steps after ``--skip``, per rank.

    PYTHONPATH=src python benchmarks/powersgd_timeline.py --workers 2 --steps 80
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ranks import run_ranks

PHASES = ["entry -> all_reduce 1 launched", "P = MQ (hook returns)", "all_reduce 1 (uncompressed)",
          "unpack (callback)", "all_reduce 2 (P)", "Q = M^T P (callback)", "all_reduce 3 (Q)",
          "M = PQ^T (callback)", "hook entry -> future done", "step"]


def phases(ev: dict) -> list[float]:
    (l1, d1), (l2, d2), (l3, d3) = ev["ar"][:3]
    return [l1 - ev["entry"], ev["returned"] - l1, d1 - l1, l2 - d1, d2 - l2, l3 - d2, d3 - l3,
            ev["done"] - d3, ev["done"] - ev["entry"], ev["step"]]


def worker(rank: int, world: int, port: int, steps: int, skip: int, queue) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from lowband.models import make_model
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model("cnn"), bucket_cap_mb=64)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3)
    ev: dict = {}
    real_all_reduce = dist.all_reduce

    def traced_all_reduce(tensor, *args, **kwargs):
        launched = time.perf_counter()
        work = real_all_reduce(tensor, *args, **kwargs)
        slot = [launched, None]
        ev["ar"].append(slot)
        work.get_future().add_done_callback(lambda _: slot.__setitem__(1, time.perf_counter()))
        return work

    psgd.dist.all_reduce = traced_all_reduce     # the hook's own module-level reference

    def hook(st, bucket):
        ev["entry"] = time.perf_counter()
        fut = psgd.powerSGD_hook(st, bucket)
        ev["returned"] = time.perf_counter()

        def done(f):
            ev["done"] = time.perf_counter()
            return f.value()
        return fut.then(done)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    rows = []
    for s in range(steps):
        ev.clear()
        ev["ar"] = []
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        ev["step"] = time.perf_counter() - t0
        if s >= skip and len(ev["ar"]) >= 3 and all(d is not None for _, d in ev["ar"]):
            rows.append(phases(ev))
    dist.barrier()
    queue.put((rank, [statistics.median(r[i] for r in rows) for i in range(len(PHASES))]))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--skip", type=int, default=10, help="steps left out first (DDP's rebuild, the hook's warm-up)")
    args = ap.parse_args()
    results = sorted(run_ranks(worker, args.workers, args.steps, args.skip).items())
    print(f"powerSGD_hook at {args.workers} ranks, loopback, cnn (medians of ms per step over steps "
          f"{args.skip}..{args.steps - 1}):")
    print("| phase | " + " | ".join(f"rank {r}" for r, _ in results) + " |")
    print("|---|" + "---:|" * len(results))
    for i, name in enumerate(PHASES):
        print(f"| {name} | " + " | ".join(f"{1e3 * med[i]:.2f}" for _, med in results) + " |")


if __name__ == "__main__":
    main()
