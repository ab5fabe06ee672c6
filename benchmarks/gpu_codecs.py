"""Codec throughput on a GPU (or any device): compress + decompress of one fp32 tensor, in GB/s
of fp32 input, beside ``torch.clone`` of the same tensor on the same device, measured in the
same run. Times are CUDA-synchronised wall times, the minimum over ``--reps`` after a warm-up.

Usage::

    PYTHONPATH=src python benchmarks/gpu_codecs.py --device cuda            # every codec, 25M
    PYTHONPATH=src python benchmarks/gpu_codecs.py --device cpu --numel 1000000

Exits 0 with "skipped: no CUDA" when ``--device cuda`` and torch sees no GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch

from lowband.compressors import COMPRESSORS, build_compressor

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
            codec = build_compressor(codec_name, OPTIONS.get(codec_name, {}), error_feedback=False)
            def roundtrip():
                payload, ctx = codec.compress(x, "bench")
                return codec.decompress(payload, ctx)
            s = best_time(roundtrip, args.reps, sync)
            print(f"| {codec_name} | {nbytes / s / GB:.3g} | {s / clone_s:.3g} |")
        except Exception as e:     # one broken codec must not hide the others' numbers
            failed += 1
            print(f"| {codec_name} | failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} | - |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
