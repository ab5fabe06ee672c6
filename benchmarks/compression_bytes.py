"""Per-rank bytes sent per step, every codec x every compressed collective, vs fp32 ring allreduce.

Spawns ``--workers`` gloo processes on this host and averages gradients through lowband's real
collectives; the bytes are those the :class:`~lowband.comm.communicator.Communicator`
counts under its ring/pairwise wire models (what a link counter shows, less protocol headers).
Payload sizes depend only on shapes, so random data gives the same bytes as real gradients.

Two workloads: the cnn's gradients bucketed as the ``compressed`` algorithm does (``--bucket-mb``,
so per-chunk padding and per-payload scales are included), and one 1M-element tensor.

Usage::

    PYTHONPATH=src python benchmarks/compression_bytes.py               # 4 workers, markdown table
    PYTHONPATH=src python benchmarks/compression_bytes.py --workers 8
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowband.algorithms.buckets import plan_buckets
from lowband.comm.wire import allreduce_bytes
from lowband.codecs import build_compressor
from lowband.comm.communicator import Communicator
from lowband.comm.reducer import make_reducer
from lowband.comm.plans import COLLECTIVES
from lowband.codecs import COMPRESSORS
from lowband.app.models import make_model

MIB = 1 << 20
FP32_BYTES = 4
#: Options per codec (others use their defaults; 2bit uses the ``compressed`` algorithm default).
BENCH_OPTIONS: dict[str, dict[str, Any]] = {
    "topk": {"ratio": 0.01},
    "randomk": {"ratio": 0.01},
    "powersgd": {"rank": 4},
}
#: Rows: (label, codec, options); every codec with BENCH_OPTIONS, plus exact MXNet 2-bit.
VARIANTS: list[tuple[str, str, dict[str, Any]]] = (
    [(c, c, BENCH_OPTIONS.get(c, {})) for c in COMPRESSORS] + [("2bit threshold=0.01 (MXNet)", "2bit", {"threshold": 0.01})]
)
STEPS = 2   # bytes are identical every step; two steps show it (and include EF state)


def workloads(bucket_mb: float) -> dict[str, list[int]]:
    """Bucket sizes (elements) of each workload."""
    params = list(make_model("cnn").parameters())
    buckets = plan_buckets(params, range(len(params)), int(bucket_mb * MIB))
    return {
        f"cnn ({sum(p.numel() for p in params):,} el., {len(buckets)} buckets)":
            [sum(params[i].numel() for i in b) for b in buckets],
        "1M tensor": [1_000_000],
    }


def _worker(rank: int, world: int, port: int, bucket_mb: float, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    rows = []
    for wname, sizes in workloads(bucket_mb).items():
        ring = sum(allreduce_bytes(FP32_BYTES * n, world) for n in sizes)
        for label, codec, options in VARIANTS:
            for kind in COLLECTIVES:
                comm = Communicator()
                coll = make_reducer(kind, comm, build_compressor(codec, options))
                gen = torch.Generator().manual_seed(rank)
                for _ in range(STEPS):
                    for i, n in enumerate(sizes):
                        coll.start(torch.randn(n, generator=gen) * 1e-3, f"b{i}").wait()
                coll.close()
                rows.append((wname, label, kind, comm.stats.bytes_sent / STEPS, ring))
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, rows))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, bucket_mb: float) -> list[tuple[str, str, str, float, float]]:
    """Rows (workload, codec, collective, bytes sent per step by rank 0, fp32 ring bytes)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, bucket_mb, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=900) for _ in range(world))
    for p in procs:
        p.join()
    for r in range(1, world):   # every rank sends the same amount (the schedules are symmetric)
        assert [row[3] for row in results[r]] == [row[3] for row in results[0]], "ranks disagree"
    return results[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    args = ap.parse_args()
    rows = measure(args.workers, args.bucket_mb)
    print(f"`PYTHONPATH=src python benchmarks/compression_bytes.py --workers {args.workers} "
          f"--bucket-mb {args.bucket_mb}`; torch {torch.__version__}, gloo; options {BENCH_OPTIONS}, "
          "2bit = the `compressed` default (relative=1, scale_block=256)\n")
    for wname in dict.fromkeys(r[0] for r in rows):
        ring = next(r[4] for r in rows if r[0] == wname)
        print(f"**{wname}**, {args.workers} workers: fp32 ring allreduce sends {ring / 1e6:.3f} MB per rank per step\n")
        print("| codec | two-stage MB | two-stage / ring | allgather MB | allgather / ring |")
        print("|---|---:|---:|---:|---:|")
        for label, _, _ in VARIANTS:
            by = {r[2]: r[3] for r in rows if r[0] == wname and r[1] == label}
            print(f"| {label} | {by['two-stage'] / 1e6:.4f} | 1/{ring / by['two-stage']:.1f} | "
                  f"{by['allgather'] / 1e6:.4f} | 1/{ring / by['allgather']:.1f} |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
