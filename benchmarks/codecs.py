"""Codec throughput on one CPU core: encode (with error feedback) and decode, in GB/s of fp32 input.

Every number is compared with ``torch.clone`` of the same tensor, measured in the same run.
That is the memory-bound limit of a single pass that reads and writes the tensor, allocation
included. ``copy_`` into a preallocated buffer is shown as well, because the EF encoder writes
its residual in place and so pays no allocation; it is also the steadier yardstick (whether
``clone``'s allocation comes back cache-warm moved it 2x between two runs on one host).
Timings are the minimum over ``--reps``
repetitions after one warm-up call, which filters noise from other processes.

The default table is the fused bucket codecs the collectives use (``--table bucket``): 2-bit
with error feedback in both modes and 1-bit, encoding (a) one flat tensor of 1M and 25M
elements and (b) the real compressed buckets of ``cnn`` and ``resnet20`` (1 MiB buckets of the
weights, every parameter its own segment) in the two-stage layout of N simulated workers (every
segment cut into N chunks, each with its own scales), and decoding-and-averaging the N workers'
payloads of one rank's chunks (bandwidth = decoded fp32 bytes, N versions counted). Kernels:
native unless ``LOWBAND_CODEC_KERNELS=torch`` (their AVX-512F paths where the CPU has it,
unless ``--portable``). ``--table tensor`` is the per-tensor API of every
codec (``compress``/``decompress``).

Usage::

    PYTHONPATH=src python benchmarks/codecs.py                          # bucket codecs
    PYTHONPATH=src python benchmarks/codecs.py --table tensor --quick   # every codec, 1M
    PYTHONPATH=src python benchmarks/codecs.py --ab old.so new.so --sizes 1000000 --models cnn

``--ab`` times two builds of the codec library (copies of ``_lowband_codecs*.so``) in one
process, interleaved round by round: on a shared host the same kernel moves 30-40% between
runs a minute apart, which a run per build cannot tell from a change.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import Callable

import torch

from lowband.codecs import COMPRESSORS, ErrorFeedback, make_compressor

# Benchmark configuration of each codec (documented here, printed with the table).
BENCH_OPTIONS: dict[str, dict] = {
    "2bit": {"threshold": 0.5},  # on N(0,1) data: ~62% of codes non-zero (a busy case)
    "qsgd": {"levels": 7},
    "topk": {"ratio": 0.01},
    "randomk": {"ratio": 0.01},
    "powersgd": {"rank": 4},
}
# Extra rows: other configurations of a codec, benchmarked under a label of their own.
VARIANTS: dict[str, tuple[str, dict]] = {
    "2bit-relative": ("2bit", {"relative": 1.0, "scale_block": 256}),  # the algorithms' default mode
}
GB = 1e9
FP32_BYTES = 4


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Minimum wall time of ``fn`` over ``reps`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(sizes: list[int], reps: int, names: list[str]) -> str:
    lines = [
        "| n | codec | payload / fp32 | encode+EF GB/s | x clone | decode GB/s | x clone |",
        "|---|---|---|---|---|---|---|",
    ]
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        x = torch.randn(n, generator=gen)
        gbytes = n * FP32_BYTES / GB
        clone_bw = gbytes / best_time(lambda: x.clone(), reps)
        dst = torch.empty_like(x)
        copy_bw = gbytes / best_time(lambda: dst.copy_(x), reps)
        lines.append(f"| {n:,} | torch.clone | 1 | {clone_bw:.2f} | 1.00 | | |")
        lines.append(f"| {n:,} | copy_ (no alloc) | 1 | {copy_bw:.2f} | {copy_bw / clone_bw:.2f} | | |")
        for name in names:
            codec_name, options = VARIANTS.get(name, (name, BENCH_OPTIONS.get(name, {})))
            codec = make_compressor(codec_name, **options)
            ef = ErrorFeedback(codec)
            enc_bw = gbytes / best_time(lambda: ef.compress(x, "w"), reps)
            payload, ctx = ef.compress(x, "w")
            ratio = codec.payload_nbytes((n,)) / (n * FP32_BYTES)
            if codec.decompress(payload, ctx).data_ptr() == payload[0].data_ptr():
                dec = "view, no copy | -"  # identity: decoding returns the payload itself
            else:
                dec_bw = gbytes / best_time(lambda: codec.decompress(payload, ctx), reps)
                dec = f"{dec_bw:.2f} | {dec_bw / clone_bw:.2f}"
            lines.append(
                f"| {n:,} | {name} | {ratio:.4f} | {enc_bw:.2f} | {enc_bw / clone_bw:.2f} | {dec} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)  # progress
    return "\n".join(lines)


BUCKET_CODECS = [("2bit MXNet (threshold 0.5)", "2bit", {"threshold": 0.5}),
                 ("2bit scale-aware (relative 1, block 256)", "2bit", {"relative": 1.0, "scale_block": 256}),
                 ("1bit", "1bit", {})]


def model_buckets(name: str, bucket_mb: float = 1.0) -> list[list[tuple[str, int]]]:
    """The compressed buckets of a model as the ``compressed`` algorithm plans them."""
    from lowband.algorithms.buckets import plan_keyed_buckets
    from lowband.app.models import make_model
    named = list(make_model(name).named_parameters())
    params = [p for _, p in named]
    dense = {i for i, p in enumerate(params) if p.dim() > 1}
    groups = plan_keyed_buckets(params, range(len(params)), int(bucket_mb * (1 << 20)), key=lambda i: i in dense)
    return [[(named[i][0], params[i].numel()) for i in g] for k, g in groups if k]


def bucket_cases(sizes: list[int], models: list[str], workers: list[int], reps: int):
    """Every case of the bucket table: ``(label, layout, title, (clone_bw, copy_bw), encode,
    decode, encoded_bytes, decoded_bytes)`` with ``encode`` / ``decode`` callables (the inputs
    built once, ``clone`` of the same elements and a ``copy_`` of them into a kept buffer timed
    with them: ``clone`` is the issue's yardstick, but it allocates, and whether a run's
    allocation comes back cache-warm moves it up to 2x on one host; ``copy_`` shows that)."""
    from lowband.comm.plans import make_plan
    gen = torch.Generator().manual_seed(0)
    cases = [(f"{n:,} elements", [[("x", n)]], [1]) for n in sizes]
    cases += [(f"{m} buckets", model_buckets(m), workers) for m in models]
    for label, buckets, ns in cases:
        total = sum(n for b in buckets for _, n in b)
        x = torch.randn(total, generator=gen)
        clone_bw = total * FP32_BYTES / GB / best_time(lambda: x.clone(), reps)
        dst = torch.empty_like(x)
        copy_bw = total * FP32_BYTES / GB / best_time(lambda: dst.copy_(x), reps)
        for world in ns:
            for title, codec_name, options in BUCKET_CODECS:
                codec = make_compressor(codec_name, **options)
                plans = [make_plan("two-stage", world, 0, b, codec) for b in buckets]
                gs, es, sends, avgs = [], [], [], []
                offset = 0
                for p in plans:
                    gs.append(x[offset:offset + p.numel])
                    offset += p.numel
                    es.append(torch.zeros(p.numel))
                    sends.append(torch.zeros(world * p.layout.section, dtype=torch.uint8))
                    avgs.append(torch.empty(p.server_layout.total))

                def encode(plans=plans, gs=gs, es=es, sends=sends):
                    for p, g, e, out in zip(plans, gs, es, sends):
                        p.worker.encode(g, e, out)

                def decode(plans=plans, sends=sends, avgs=avgs, world=world):
                    for p, src, out in zip(plans, sends, avgs):
                        p.worker.decode(src, world, p.dec1, p.dec1_table, out, True, float(world))
                decoded = world * sum(int(p.server_layout.total) for p in plans)
                layout = "flat, N=1" if world == 1 else f"two-stage, N={world}"
                yield (f"{label} ({total:,})", layout, title, (clone_bw, copy_bw), encode, decode,
                       total * FP32_BYTES, decoded * FP32_BYTES)


def run_buckets(sizes: list[int], models: list[str], workers: list[int], reps: int) -> str:
    lines = ["| input | layout | codec | encode+EF GB/s | x clone | decode+average GB/s | x clone |",
             "|---|---|---|---|---|---|---|"]
    shown = set()
    for label, layout, title, (clone_bw, copy_bw), encode, decode, enc_bytes, dec_bytes in \
            bucket_cases(sizes, models, workers, reps):
        if label not in shown:
            shown.add(label)
            lines.append(f"| {label} | | torch.clone | {clone_bw:.2f} | 1.00 | | |")
            lines.append(f"| {label} | | copy_ (no alloc) | {copy_bw:.2f} | {copy_bw / clone_bw:.2f} | | |")
        label = label.rsplit(" (", 1)[0]
        enc_bw = enc_bytes / GB / best_time(encode, reps)
        dec_bw = dec_bytes / GB / best_time(decode, reps)
        lines.append(f"| {label} | {layout} | {title} | {enc_bw:.2f} | {enc_bw / clone_bw:.2f} | "
                     f"{dec_bw:.2f} | {dec_bw / clone_bw:.2f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def run_ab(paths: list[str], sizes: list[int], models: list[str], workers: list[int], reps: int,
           rounds: int) -> str:
    """Two builds of the codec library in one process, interleaved: each round times every
    case with build A, then with build B (best of ``reps`` calls each), so the host's drift
    lands on both alike. Reported: the median and the best round per build, and B / A."""
    from lowband import _native as kernels
    libs = [kernels.open_library(p) for p in paths]
    lines = [f"A = {paths[0]}, B = {paths[1]}; {rounds} interleaved rounds, best of {reps} calls each",
             "",
             "| input | layout | codec | encode GB/s A median (best) | B median (best) | B / A (median) | "
             "decode GB/s A median (best) | B median (best) | B / A (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, layout, title, _, encode, decode, enc_bytes, dec_bytes in bucket_cases(sizes, models, workers, reps):
        bw = {(k, which): [] for k in range(2) for which in ("enc", "dec")}
        for _ in range(rounds):
            for k, lib in enumerate(libs):
                with kernels.using(lib):
                    bw[(k, "enc")].append(enc_bytes / GB / best_time(encode, reps))
                    bw[(k, "dec")].append(dec_bytes / GB / best_time(decode, reps))
        cells = []
        for which in ("enc", "dec"):
            med = [sorted(bw[(k, which)])[rounds // 2] for k in range(2)]
            cells += [f"{med[k]:.2f} ({max(bw[(k, which)]):.2f})" for k in range(2)] + [f"{med[1] / med[0]:.2f}"]
        lines.append(f"| {label.rsplit(' (', 1)[0]} | {layout} | {title} | " + " | ".join(cells) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", choices=["bucket", "tensor"], default="bucket")
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet20"])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 32])
    parser.add_argument("--quick", action="store_true", help="1M elements only, 3 reps")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--portable", action="store_true",
                        help="native kernels without their SIMD (AVX-512F) paths, for an A/B of the vector code")
    parser.add_argument("--codecs", nargs="+", default=list(COMPRESSORS) + list(VARIANTS),
                        choices=list(COMPRESSORS) + list(VARIANTS))
    parser.add_argument("--ab", nargs=2, metavar=("LIB_A", "LIB_B"),
                        help="bucket table only: A/B of two builds of the codec library (.so files) in one "
                             "process, interleaved round by round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of --ab")
    args = parser.parse_args(argv)
    if args.ab:
        if args.table != "bucket":
            parser.error("--ab times the bucket table only")
        if args.portable:
            parser.error("--ab compares two builds; --portable applies to the installed one only")
        if args.rounds < 1:
            parser.error(f"--rounds must be >= 1, got {args.rounds}")
        from lowband import _native as kernels
        for path in args.ab:
            try:
                kernels.open_library(path)
            except (OSError, AttributeError) as exc:
                parser.error(f"--ab: {path} is not a build of the codec library: {exc}")
    if args.quick:
        args.sizes, args.reps = [1_000_000], 3
    torch.set_num_threads(args.threads)
    print("$ PYTHONPATH=src python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"torch {torch.__version__}, {args.threads} thread(s), reps={args.reps} (min), "
          f"input N(0,1) fp32; options: {BENCH_OPTIONS}")
    if hasattr(os, "getloadavg"):  # other processes on the host skew the numbers; say so
        print(f"host load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    from lowband import _native as kernels
    lib = kernels.library()
    if lib is None:
        print("codec kernels: torch")
    else:
        simd = lib.lb_set_simd(0 if args.portable else 1)
        print(f"codec kernels: native ({'AVX-512F' if simd else 'portable C'})")
    print()
    if args.ab:
        print(run_ab(args.ab, args.sizes, args.models, args.workers, args.reps, args.rounds))
    elif args.table == "bucket":
        print(run_buckets(args.sizes, args.models, args.workers, args.reps))
    else:
        print(run(args.sizes, args.reps, args.codecs))


if __name__ == "__main__":
    main()
