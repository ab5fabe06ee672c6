"""What the first collective after a compute span costs when the ranks must meet (2+ ranks, loopback).

The performance model charges every collective a meeting cost (``Cluster.sync_s``) that the
validation's contention probe measures after ~15 ms compute blocks. PowerSGD's hook meets once
after a whole forward and backward (~40 ms on cnn here), and the model under-predicts it
(docs/results.md, the validation section). This benchmark asks whether the meeting cost grows
with the compute span: ``--workers`` processes (one thread each) run matmul blocks of
``--blocks`` milliseconds (calibrated on each rank), each followed by a 4-byte all-reduce,
and report the all-reduce's wall time per rank (the faster rank waits for the slower one), and
the same all-reduce back to back with no compute (latency only). Blocks run in turn, ``--rounds``
times; about ``--seconds`` of compute per block size and round.

    PYTHONPATH=src python benchmarks/meeting_cost.py --workers 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ranks import run_ranks


def worker(rank: int, world: int, port: int, blocks: list[float], rounds: int, seconds: float, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    a, flag = torch.randn(160, 160), torch.zeros(1)

    def compute(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    compute(100)
    t0 = time.perf_counter()
    compute(400)
    per_mm = (time.perf_counter() - t0) / 400
    waits: dict[float, list[float]] = {ms: [] for ms in blocks}
    for _ in range(rounds):
        for ms in blocks:
            n = max(1, int(ms / 1e3 / per_mm))
            dist.barrier()
            for _ in range(max(10, int(seconds * 1e3 / ms))):
                compute(n)
                w0 = time.perf_counter()
                dist.all_reduce(flag)
                waits[ms].append(time.perf_counter() - w0)
    dist.barrier()
    idle = []
    for _ in range(50):
        w0 = time.perf_counter()
        dist.all_reduce(flag)
        idle.append(time.perf_counter() - w0)
    queue.put((rank, ({ms: (statistics.mean(w), statistics.median(w)) for ms, w in waits.items()},
                      statistics.median(idle))))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--blocks", default="5,15,40,80", help="compute span before each all-reduce, ms (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.6, help="compute per block size and round")
    args = ap.parse_args()
    blocks = [float(x) for x in args.blocks.split(",") if x.strip()]
    results = [(r, w, i) for r, (w, i) in sorted(run_ranks(worker, args.workers, blocks, args.rounds,
                                                               args.seconds).items())]
    print(f"4-byte all_reduce after a compute block, {args.workers} ranks, loopback, {args.rounds} rounds "
          "(ms per all_reduce: mean / median per rank; sum of the ranks' means):")
    print("| block ms | " + " | ".join(f"rank {r}" for r, *_ in results) + " | sum of means |")
    print("|---:|" + "---:|" * (len(results) + 1))
    for ms in blocks:
        cells = [f"{1e3 * w[ms][0]:.2f} / {1e3 * w[ms][1]:.2f}" for _, w, _ in results]
        total = sum(1e3 * w[ms][0] for _, w, _ in results)
        print(f"| {ms:g} | " + " | ".join(cells) + f" | {total:.2f} |")
    print("| back to back (no compute) | " + " | ".join(f"{1e3 * i:.2f}" for *_, i in results) + " | |")


if __name__ == "__main__":
    main()
