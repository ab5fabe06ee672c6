"""Codec throughput on a GPU (or any device): compress + decompress of one fp32 tensor, in GB/s
of fp32 input, beside ``torch.clone`` of the same tensor on the same device, measured in the
same run. Times are CUDA-synchronised wall times, the minimum over ``--reps`` after a warm-up.

``--bucket`` adds the fused bucket codecs (``BucketCodec``: one encode with error feedback and
one decode-and-average call per bucket, as the collectives make them) over ResNet-50's 161
parameter tensors (25.6M elements) cut into ``--chunks`` chunks, on the device and on the CPU
(the native kernels there), each against ``torch.clone`` of the bucket on the same device.

Usage::

    PYTHONPATH=src python benchmarks/gpu_codecs.py --device cuda            # every codec, 25M
    PYTHONPATH=src python benchmarks/gpu_codecs.py --device cpu --numel 1000000
    PYTHONPATH=src python benchmarks/gpu_codecs.py --device cuda --bucket --chunks 2

Exits 0 with "skipped: no CUDA" when ``--device cuda`` and torch sees no GPU.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable

import numpy as np
import torch

from lowband.codecs import COMPRESSORS, build_compressor, make_compressor
from lowband.codecs.bucket import BucketCodec, ChunkedLayout, _ChunkFormat
from lowband.perf.resnet50 import resnet50_layers

GB = 1e9
#: options for codecs that have no default (the rest take lowband's: 2bit relative, per block)
OPTIONS = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}}


def best_time(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--codecs", default=",".join(COMPRESSORS))
    p.add_argument("--bucket", action="store_true", help="also time the fused bucket codecs (ResNet-50's tensors)")
    p.add_argument("--chunks", type=int, default=2, help="chunks per segment of the bucket layout (the worker count)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(args.numel, device=dev)
    nbytes = x.numel() * x.element_size()
    clone_s = best_time(lambda: x.clone(), args.reps, sync)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device {dev} ({name}), {args.numel} fp32 elements; torch.clone {nbytes / clone_s / GB:.1f} GB/s")
    print("| codec | encode+decode GB/s | x torch.clone time |")
    print("|---|---|---|")
    failed = 0
    for codec_name in [c.strip() for c in args.codecs.split(",") if c.strip()]:
        try:
            codec = build_compressor(codec_name, OPTIONS.get(codec_name, {}))
            def roundtrip():
                payload, ctx = codec.compress(x, "bench")
                return codec.decompress(payload, ctx)
            s = best_time(roundtrip, args.reps, sync)
            print(f"| {codec_name} | {nbytes / s / GB:.3g} | {s / clone_s:.3g} |")
        except Exception as e:     # one broken codec must not hide the others' numbers
            failed += 1
            print(f"| {codec_name} | failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} | - |")
    if args.bucket:
        devices = [dev] + ([torch.device("cpu")] if dev.type != "cpu" else [])
        for d in devices:
            failed += bucket_rows(d, args.chunks, args.reps)
    return 1 if failed else 0


#: the fused codecs' configurations: exact MXNet 2-bit, lowband's scale-aware 2-bit, 1-bit
BUCKET_CODECS = [("2bit", {"threshold": 0.01}), ("2bit", {"relative": 1.0, "scale_block": 256}), ("1bit", {})]


def bucket_rows(dev: torch.device, chunks: int, reps: int) -> int:
    """Print one table of the fused bucket codecs on ``dev``; the number of configurations that
    failed."""
    segments = [(name, math.prod(shape)) for name, _, shape, _ in resnet50_layers()]
    total = sum(n for _, n in segments)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(total, generator=gen).mul_(0.01).to(dev)
    clone_s = best_time(lambda: g.clone(), reps, sync)
    print(f"\nbucket codecs on {dev}: ResNet-50, {len(segments)} tensors, {total} elements, {chunks} chunks; "
          f"torch.clone {4 * total / clone_s / GB:.1f} GB/s")
    print("| codec | path | encode ms | decode ms | encode x clone | decode x clone |")
    print("|---|---|---|---|---|---|")
    failed = 0
    for name, options in BUCKET_CODECS:
        label = name + "".join(f" {k}={v}" for k, v in options.items())
        try:
            codec = make_compressor(name, **options)
            fmt = _ChunkFormat(codec)
            bc = BucketCodec(codec, fmt, ChunkedLayout.build(segments, chunks, fmt), lambda s, i: f"{s}/{i}")
            lay = bc.layout
            e = torch.zeros(total, device=dev)
            out = torch.zeros(chunks * lay.section, dtype=torch.uint8, device=dev)
            S = lay.segments
            zeros = np.zeros(S, dtype=np.int64)
            # the two-stage owner of chunk 0: chunk 0 of every segment, from all ``chunks`` sections
            runs = bc.runs(np.arange(S), zeros, zeros, lay.seg_off, lay.chunk_len(0))
            table = runs.decode_table()
            dec = torch.empty(total, device=dev)
            enc_s = best_time(lambda: bc.encode(g, e, out), reps, sync)
            dec_s = best_time(lambda: bc.decode(out, chunks, runs, table, dec, True, float(chunks), lay.section), reps, sync)
            path = "native" if bc.uses_native(g) else "triton" if bc.uses_triton(g) else "torch"
            print(f"| {label} | {path} | {enc_s * 1e3:.2f} | {dec_s * 1e3:.2f} | {enc_s / clone_s:.3g} | {dec_s / clone_s:.3g} |")
        except Exception as exc:     # one broken codec must not hide the others' numbers
            failed += 1
            print(f"| {label} | failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} | | | | |")
    return failed


if __name__ == "__main__":
    sys.exit(main())
