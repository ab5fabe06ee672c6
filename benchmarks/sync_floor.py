"""What does synchronizing once per step cost on this machine, before any bytes move?

`noop` (each rank steps on its own gradient) never waits for its peer, so it is a floor that
no synchronous method can reach: every synchronous method waits at least once per step for the
slowest rank (its compute jitter, its scheduling on shared cores) and pays one collective's
latency. This measures, in one run and interleaved round by round, per-step wall time of one
rank (median over steps, max over ranks of each rank's median) for:

* ``noop``: lowband's compute-only reference;
* ``noop+barrier``: the same plus one 4-byte all-reduce per step after ``engine.step()``,
  the cheapest possible synchronous step;
* ``ssgd`` and ``compressed`` (2-bit, ``warmup_steps=0``): lowband's algorithms;
* any ``--variants`` entry written as ``lowband bench`` writes algorithms
  (``compressed:warmup_steps=0:compress_vectors=true``), with ``+barrier`` to add the barrier
  and ``@spread`` (last) to bind each rank to its own cores (``--cpu-binding spread``,
  :mod:`lowband.cpus`).

Every rank trains ``cnn`` on synthetic Fashion-MNIST-shaped data with one intra-op thread,
gloo over loopback (no emulated link), as ``lowband bench --bandwidth none`` does.

    PYTHONPATH=src python benchmarks/sync_floor.py --workers 2 --steps 60 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ranks import run_ranks

VARIANTS = {
    "noop": ("noop", {}, False),
    "noop+barrier": ("noop", {}, True),
    "ssgd": ("ssgd", {}, False),
    "compressed": ("compressed", {"warmup_steps": 0}, False),
}


def _worker(rank: int, world: int, port: int, variant: str, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import lowband
    from lowband import cpus
    variant, _, binding = variant.partition("@")
    cpus.bind(binding or "none", {"LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lowband import tasks
    from lowband.data import ShardedBatches, make_synthetic
    from lowband.models import make_model
    name, options, barrier = _variant(variant)
    torch.manual_seed(0)
    model = make_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    engine = lowband.distribute(model, opt, name, **options)
    data = ShardedBatches(make_synthetic(64 * world * (steps + 10), seed=1), 64, rank, world, seed=3)
    flag = torch.zeros(1)
    times = []
    for x, y in data.epoch(0):
        t0 = time.perf_counter()
        opt.zero_grad()
        tasks.loss(engine.module(x), y).backward()
        engine.step()
        if barrier:
            dist.all_reduce(flag)
        times.append(time.perf_counter() - t0)
        if len(times) == steps + 10:
            break
    engine.close()
    queue.put((rank, statistics.median(times[10:])))
    dist.destroy_process_group()


def _variant(spec: str) -> tuple[str, dict, bool]:
    if spec in VARIANTS:
        return VARIANTS[spec]
    from lowband.perf.plan import parse_algorithm
    barrier = spec.endswith("+barrier")
    name, options = parse_algorithm(spec[:-len("+barrier")] if barrier else spec)
    return name, options, barrier


def run(variant: str, world: int, steps: int) -> float:
    return max(run_ranks(_worker, world, variant, steps).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    ms: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            ms[v].append(1e3 * run(v, args.workers, args.steps))
    print(f"# cnn, {args.workers} gloo ranks on loopback, {args.steps} timed steps, {args.rounds} rounds "
          f"(median step ms per run; ratio to unbound noop per round, then the median ratio)")
    print("| variant | step ms per round | / noop per round | median / noop |")
    print("|---|---|---|---:|")
    for v in variants:
        ratios = [a / b for a, b in zip(ms[v], ms["noop"])] if "noop" in ms else []
        med = f"{statistics.median(ratios):.2f}" if ratios else "-"
        print(f"| {v} | {', '.join(f'{x:.1f}' for x in ms[v])} | {', '.join(f'{r:.2f}' for r in ratios)} | {med} |")


if __name__ == "__main__":
    main()
