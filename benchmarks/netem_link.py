"""Measure achieved gloo all_reduce bandwidth over lowband's emulated links.

Why: the emulation is only useful if a shaped link really behaves like its nominal
rate; this prints measured/configured ratios for the docs (docs/netem.md).

    PYTHONPATH=src python benchmarks/netem_link.py --rates 1gbit,200mbit --world 2 --mib 16 --iters 5

"Algorithmic" bandwidth = ring all_reduce payload per rank, 2(N-1)/N * size, over the
time of one all_reduce; "wire" = bytes the kernel counted on the rank's veth (payload
+ TCP/IP headers + acks) over the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lowband.collectives.wire import allreduce_bytes

MASTER_PORT = "29518"  # free in rank 0's fresh namespace


def worker(size: int, iters: int) -> None:
    """One rank: warm up connections, then time `iters` all_reduces."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(torch.ones(16))
    times = []
    ok = True
    for _ in range(iters):
        t = torch.full((size // 4,), float(rank + 1))
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
        ok = ok and bool(torch.all(t == world * (world + 1) / 2))
    print(json.dumps({"rank": rank, "ok": ok, "times": times}), flush=True)
    dist.destroy_process_group()


def measure(rate_text: str, world: int, size: int, iters: int, burst: str | None, latency: str) -> dict[str, float | str | None]:
    from lowband.netem import EmulatedCluster, parse_rate

    rate = parse_rate(rate_text)
    env_base = dict(os.environ)
    env_base["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent / "src")
    with EmulatedCluster(world, rate, burst=burst, latency=latency) as c:
        before = c.link_counters()
        procs = [
            subprocess.Popen(
                c.worker_prefix(r) + [sys.executable, __file__, "--worker", "--bytes", str(size), "--iters", str(iters)],
                env={**env_base, **c.worker_env(r), "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_PORT": MASTER_PORT},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"worker failed:\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        after = c.link_counters()
    assert all(r["ok"] for r in results), "wrong all_reduce result"
    per_iter = [max(r["times"][i] for r in results) for i in range(iters)]
    t = statistics.median(per_iter)
    payload = allreduce_bytes(size, world)
    wire_tx = statistics.mean(after[r][0] - before[r][0] for r in range(world)) / iters  # incl. warm-up, tiny
    algbw = payload * 8 / t
    return {
        "rate": rate_text, "world": world, "MiB": size / 2**20, "median_s": t,
        "algbw_mbit": algbw / 1e6,
        "ratio": (algbw / rate) if rate else None,
        "wire_overhead": wire_tx / payload,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="1gbit,200mbit", help="comma-separated tc rates, 'none' = unshaped")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=float, default=16.0, help="all_reduce size in MiB (float32)")
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--burst", default=None, help="tbf burst, e.g. 64kb (default: EmulatedCluster's automatic burst)")
    ap.add_argument("--latency", default="50ms", help="tbf latency (EmulatedCluster default 50ms)")
    args = ap.parse_args()
    if args.worker:
        worker(args.bytes, args.iters)
        return
    size = int(args.mib * 2**20) // 4 * 4
    print(f"tbf burst {args.burst or 'auto'} latency {args.latency}")
    print(f"{'rate':>8} {'world':>5} {'MiB':>6} {'median s':>9} {'algbw Mbit/s':>13} {'measured/configured':>20} {'wire/payload':>13}")
    for rate_text in args.rates.split(","):
        r = measure(rate_text.strip(), args.world, size, args.iters, args.burst, args.latency)
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"{r['rate']:>8} {r['world']:>5} {r['MiB']:>6.1f} {r['median_s']:>9.3f} {r['algbw_mbit']:>13.1f} {ratio:>20} {r['wire_overhead']:>13.3f}", flush=True)


if __name__ == "__main__":
    main()
