"""What one all-gather per step costs a training step on a machine with no spare core.

N gloo ranks over loopback; each rank's main thread computes a fixed piece of ``cnn``-like work
per step (two convolutions and a pooling of a 64-image batch, one intra-op thread) while a
background thread, handed the job at the step's start as lowband's pipeline is, all-gathers
``--bytes`` bytes per rank; the step ends when both are done, and a barrier keeps the ranks in
lockstep. Variants, interleaved round by round:

* ``none``: the compute alone;
* ``gloo``: ``torch.distributed.all_gather_into_tensor`` (what lowband's allgather plan calls);
* ``p2p``: the same bytes by one ``isend``/``irecv`` pair per peer (every rank's payload once
  to every other rank, as gloo's ring schedule sends it).

Prints per variant the median over rounds of the median step time and of the process CPU time
per step (every thread: gloo's worker and loop threads too), rank 0's. The difference to
``none`` is what the exchange costs the step. A back-to-back loop of calls with nothing else
running measures a different thing (and there ``p2p`` has a 90th percentile of ~4 ms with a
core busy: gloo's loop thread spins on epoll while the pair's lock is held); this is the
setting of a pipeline.

    PYTHONPATH=src python benchmarks/exchange_cost.py --bytes 200000
"""
from __future__ import annotations

import argparse
import os
import queue
import resource
import statistics
import threading
import time

import torch
import torch.distributed as dist

from ranks import run_ranks

VARIANTS = ("none", "gloo", "p2p")


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _exchange(kind: str, out: torch.Tensor, send: torch.Tensor, group) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if kind == "gloo":
        dist.all_gather_into_tensor(out, send, group=group)
        return
    rows = out.view(world, -1)
    rows[rank].copy_(send)
    peers = [r for r in range(world) if r != rank]
    works = [dist.isend(send, dist.get_global_rank(group, r), group=group) for r in peers]
    works += [dist.irecv(rows[r], dist.get_global_rank(group, r), group=group) for r in peers]
    for w in works:
        w.wait()


def _worker(rank: int, world: int, port: int, args, out_queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))       # the background thread's own, as the pipeline's
    n = args.bytes - args.bytes % world
    send = torch.randint(0, 255, (n,), dtype=torch.uint8)
    out = torch.empty(world * n, dtype=torch.uint8)
    jobs, done = queue.SimpleQueue(), queue.SimpleQueue()

    def background() -> None:
        while (kind := jobs.get()) is not None:
            _exchange(kind, out, send, group)
            done.put(kind)
    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 1, 28, 28, generator=g)
    w1, w2 = torch.randn(20, 1, 5, 5, generator=g), torch.randn(50, 20, 5, 5, generator=g)

    def compute() -> None:
        for _ in range(args.work):
            y = torch.nn.functional.max_pool2d(torch.nn.functional.conv2d(x, w1), 2)
            torch.nn.functional.conv2d(y, w2).sum()
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for kind in VARIANTS:
            dist.barrier()
            steps, cpu0 = [], _process_cpu()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                if kind != "none":
                    jobs.put(kind)
                compute()
                if kind != "none":
                    done.get()
                steps.append(time.perf_counter() - t0)
                dist.barrier()
            rows.setdefault(kind, []).append((1e3 * statistics.median(steps),
                                              1e3 * (_process_cpu() - cpu0) / args.steps))
    jobs.put(None)
    out_queue.put((rank, rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=200_000, help="bytes per rank and step (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--work", type=int, default=3, help="compute pieces per step (default: %(default)s)")
    args = ap.parse_args()
    rows = run_ranks(_worker, args.workers, args)[0]
    print(f"# {args.bytes} bytes per rank and step, {args.workers} gloo ranks on loopback, rank 0, "
          f"{args.rounds} interleaved rounds of {args.steps} steps; medians over rounds")
    print("| exchange | step ms | process CPU ms per step | step ms per round |")
    print("|---|---|---|---|")
    for kind, v in rows.items():
        print(f"| {kind} | {statistics.median(a for a, _ in v):.2f} | {statistics.median(b for _, b in v):.2f} | "
              f"{', '.join(f'{a:.2f}' for a, _ in v)} |")


if __name__ == "__main__":
    main()
