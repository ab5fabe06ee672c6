"""Per-step CPU of the whole two-stage pipeline of one rank, network stubbed, vs world size.

The model is ResNet-50's 161 parameter tensors (built from the standard architecture: torchvision
is not a dependency), bucketed as the ``compressed`` algorithm does (1 MiB buckets of the
weights; 1-D parameters go fp32 and cost no codec work). For each simulated world size N, one
rank's real work per step is timed: encode every bucket into N chunk payloads (error
feedback), decode and average the N versions of its chunks, re-compress them (server
residual), decode every owner's chunks. The network is a stub: the all_to_all receives this
rank's own sections and the all_gather N copies of its own payload, so the bytes decoded are
of the real size. Codec: the algorithms' default 2-bit (scale-aware, 256-element blocks).

Usage::

    PYTHONPATH=src python benchmarks/pipeline_step.py                 # N = 1, 32, 256
    PYTHONPATH=src python benchmarks/pipeline_step.py --workers 1,4 --reps 3
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch

from lowband.algorithms.buckets import plan_keyed_buckets
from lowband.collectives.compressed import make_plan
from lowband.compressors import DEFAULT_TWO_BIT_OPTIONS, kernels, make_compressor

MIB = 1 << 20


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The 161 parameter tensors of ResNet-50 (torchvision's layout), in registration order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            shapes += [(f"{p}.conv1.weight", (planes, inplanes, 1, 1)), (f"{p}.bn1.weight", (planes,)), (f"{p}.bn1.bias", (planes,)),
                       (f"{p}.conv2.weight", (planes, planes, 3, 3)), (f"{p}.bn2.weight", (planes,)), (f"{p}.bn2.bias", (planes,)),
                       (f"{p}.conv3.weight", (4 * planes, planes, 1, 1)), (f"{p}.bn3.weight", (4 * planes,)),
                       (f"{p}.bn3.bias", (4 * planes,))]
            if b == 0:
                shapes += [(f"{p}.downsample.0.weight", (4 * planes, inplanes, 1, 1)),
                           (f"{p}.downsample.1.weight", (4 * planes,)), (f"{p}.downsample.1.bias", (4 * planes,))]
            inplanes = 4 * planes
    shapes += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return shapes


class StubComm:
    """Stands in for the network: every peer sends what this rank sends."""

    def __init__(self, world: int) -> None:
        self.world_size, self.rank = world, 0

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.copy_(inp)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.view(self.world_size, -1).copy_(inp.view(1, -1))

    def all_reduce(self, tensor, op=None, async_op=False) -> None:   # exact ranges are not used here
        pass


def buckets_of(shapes, bucket_mb: float) -> list[list[tuple[str, int]]]:
    """The compressed buckets' segments, as ``compressed`` plans them."""
    params = [torch.empty(s) for _, s in shapes]
    dense = {i for i, p in enumerate(params) if p.dim() > 1}
    groups = plan_keyed_buckets(params, range(len(params)), int(bucket_mb * MIB), key=lambda i: i in dense)
    return [[(shapes[i][0], params[i].numel()) for i in g] for k, g in groups if k]


def step_time(buckets, world: int, reps: int) -> tuple[float, float]:
    """(best seconds per step, Python-side seconds per step excluding the codec kernels)."""
    codec = make_compressor("2bit", **DEFAULT_TWO_BIT_OPTIONS)
    comm = StubComm(world)
    plans = [make_plan("two-stage", world, 0, segs, codec) for segs in buckets]
    grads = [torch.randn(p.numel) for p in plans]
    e_w = [torch.zeros(p.numel) for p in plans]
    e_s = [torch.zeros(p.server_numel) for p in plans]
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for p, g, ew, es in zip(plans, grads, e_w, e_s):
            p.run(comm, g, ew, es, None)
        best = min(best, time.perf_counter() - t0)
    return best, sum(len(b) for b in buckets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,32,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = resnet50_shapes()
    buckets = buckets_of(shapes, args.bucket_mb)
    nparams = sum(torch.Size(s).numel() for _, s in shapes)
    print(f"# {' '.join(shlex.quote(a) for a in ['python', *sys.argv])}")
    print(f"# ResNet-50: {len(shapes)} tensors, {nparams / 1e6:.1f}M parameters; {len(buckets)} compressed buckets; "
          f"kernels: {'native' if kernels.library() is not None else 'torch'} ({kernels.ENV}={os.environ.get(kernels.ENV, 'auto')})")
    print("| workers N | per-step CPU of one rank (ms) | vs N=1 |")
    print("|---:|---:|---:|")
    base = None
    for n in [int(w) for w in args.workers.split(",")]:
        t, _ = step_time(buckets, n, args.reps)
        base = base or t
        print(f"| {n} | {t * 1e3:.1f} | {t / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
