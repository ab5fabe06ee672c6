"""The papers' settings projected by lowband's performance model, beside the papers' figures.

    python benchmarks/paper_projection.py > runs/paper_projection.md
    python benchmarks/paper_projection.py --plots docs/img/perfmodel   # also the speedup plots
    python benchmarks/paper_projection.py --doc docs/results.md        # regenerate its section there

Two projections (docs/perfmodel.md explains every assumption):

1. CP-SGD against synchronous 2-bit compression, ResNet-50 on V100 GPUs (profile
   ``resnet50-v100``), 8/16/32 workers over 56 Gbit/s (paper: 30% less end-to-end time at 32,
   "approximately linear" scaling). Two topologies: the paper's (MXNet parameter server: 2-bit
   push, fp32 pull, host-CPU codec, per-key pipelining) and lowband's (two-stage compressed
   all-reduce on one background thread). Sensitivity: batch, codec speed, latency, k.
2. The lazy update against S-SGD, ResNet-50 on Cori KNL nodes (profile ``resnet50-knl``,
   Aries ~64 Gbit/s, 2 us), 8 to 2048 nodes (paper: speedup 739.6 against 276.6 at 2048).
   Two communication patterns: lowband's (bucketed all-reduce overlapped with backward) and
   PCNN's (per-layer all-to-all + all-gather overlapped with the next forward). Sensitivity:
   tau, batch, latency.

Pure computation (no timing): run it anywhere, any time.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from lowband.perf.model import Cluster, estimate  # noqa: E402
from lowband.perf.network import Network  # noqa: E402
from lowband.perf.plan import plot_speedup, run_plan  # noqa: E402
from lowband.perf.profile import load_profile  # noqa: E402

GBIT = 1e9
PAPER_CPSGD = "30% less end-to-end time than synchronous 2-bit at 32 GPUs, 56 Gbit/s; scaling 8/16/32 \"approximately linear\""
PAPER_LAZY = {2048: (276.6, 739.6)}
#: the generated section of the doc (``--doc``): lowband.app.report's markers
SECTION = "paper-projection"


def pct_less(a: float, b: float) -> str:
    return f"{1 - b / a:+.0%}".replace("+", "")


def with_codec_speed(prof, factor: float):
    codecs = {k: dataclasses.replace(v, encode_gbps=v.encode_gbps * factor, decode_gbps=v.decode_gbps * factor)
              for k, v in prof.codecs.items()}
    return dataclasses.replace(prof, codecs=codecs)


def cpsgd_table(batch: int = 64, latency: float = 5e-6, codec_factor: float = 1.0, k=5, correction="burst",
                topologies=("ps", "two-stage"), workers=(8, 16, 32)) -> list[str]:
    prof = with_codec_speed(load_profile("resnet50-v100").scaled(batch), codec_factor)
    net = Network(56 * GBIT, latency)
    lines = []
    for topo in topologies:
        base = {"collective": topo}
        row_sync, row_cp, row_ssgd = [], [], []
        for n in workers:
            cl = Cluster(n, net)
            sync = estimate(prof, "compressed", {**base, "compress_vectors": topo == "ps"}, cl)
            cp = estimate(prof, "cpsgd", {**base, "correction_period": k, "correction": correction}, cl)
            ss = estimate(prof, "ssgd", {}, cl)
            row_sync.append(sync.step_s)
            row_cp.append(cp.step_s)
            row_ssgd.append(ss.step_s)
        t1 = prof.compute_s
        cells = " | ".join(f"{1e3 * s:.0f} / {1e3 * c:.0f} ({pct_less(s, c)})" for s, c in zip(row_sync, row_cp))
        speedups = ", ".join(f"{n * t1 / c:.1f}" for n, c in zip(workers, row_cp))
        lines.append(f"| {topo} | {batch} | {codec_factor:g}x | {1e6 * latency:g} | {k} {correction} | {cells} | "
                     f"{speedups} | {1e3 * row_ssgd[-1]:.0f} |")
    return lines


def cpsgd_section() -> str:
    head = ("| collective | batch/GPU | codec speed | latency us | k | 8 GPUs: sync 2-bit / CP-SGD ms (less) | 16 GPUs | "
            "32 GPUs | CP-SGD speedup at 8, 16, 32 | S-SGD ms at 32 |")
    out = [head, "|" + "---|" * 10]
    out += cpsgd_table()                                  # the reference setting
    for batch in (32, 112):
        out += cpsgd_table(batch=batch)
    for f in (0.25, 0.5, 2.0):
        out += cpsgd_table(codec_factor=f)
    out += cpsgd_table(latency=50e-6)
    out += cpsgd_table(k=5, correction="spread")
    out += cpsgd_table(k=20)
    return "\n".join(out)


def lazy_rows(pattern: str, batch: int = 16, latency: float = 2e-6, tau: float = 4.0,
              workers=(8, 64, 256, 512, 1024, 2048), lazy_layers=None) -> tuple[list[str], dict]:
    prof = load_profile("resnet50-knl").scaled(batch)
    net = Network(64 * GBIT, latency)
    t1 = prof.compute_s
    res = {}
    for n in workers:
        cl = Cluster(n, net)
        s = estimate(prof, "ssgd", {"pattern": pattern}, cl).step_s
        z = estimate(prof, "lazy", {"pattern": pattern, "tau": tau, "lazy_layers": lazy_layers}, cl).step_s
        res[n] = (n * t1 / s, n * t1 / z)
    cells = " | ".join(f"{res[n][0]:.0f} / {res[n][1]:.0f}" for n in workers)
    layers = "8 (default)" if lazy_layers is None else str(lazy_layers)
    return [f"| {pattern} | {batch} | {1e6 * latency:g} | {tau:g} | {layers} | {cells} | {res[workers[-1]][1] / res[workers[-1]][0]:.2f} |"], res


def lazy_section() -> str:
    ws = (8, 64, 256, 512, 1024, 2048)
    head = ("| pattern | batch/node | latency us | tau | lazy layers | " + " | ".join(f"{n} nodes: S-SGD / lazy" for n in ws)
            + " | lazy / S-SGD at 2048 |")
    out = [head, "|" + "---|" * (6 + len(ws))]
    out.append("| **paper** (Lee et al. 2022) | ? | ? | adaptive | ? | " + " | ".join("" for _ in ws[:-1])
               + " | **276.6 / 739.6** | **2.67** |")
    for pattern in ("bucketed", "pcnn"):
        out += lazy_rows(pattern)[0]
    for batch in (4, 64):
        out += lazy_rows("pcnn", batch=batch)[0]
    for lat in (10e-6, 50e-6):
        out += lazy_rows("pcnn", latency=lat)[0]
    for tau in (2.0, 16.0):
        out += lazy_rows("pcnn", tau=tau)[0]
    out += lazy_rows("pcnn", batch=4, latency=10e-6)[0]
    for layers in (16, 32):
        out += lazy_rows("pcnn", latency=10e-6, lazy_layers=layers)[0]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plots", default=None, help="directory for speedup-vs-workers plots")
    ap.add_argument("--doc", default=None,
                    help="also write both tables into this markdown file, between its "
                         f"{SECTION!r} markers (an error when it has none: a section is never appended)")
    args = ap.parse_args(argv)
    body = "\n".join([
        "#### CP-SGD against synchronous 2-bit (ResNet-50, V100 profile, 56 Gbit/s)", "",
        f"Paper: {PAPER_CPSGD}.", "", cpsgd_section(), "",
        "#### Lazy update against S-SGD (ResNet-50, KNL profile, 64 Gbit/s Aries)", "",
        "Speedup over one node, weak scaling at the stated per-node batch.", "", lazy_section()])
    print(body)
    if args.doc:
        from lowband.app.report import update_doc
        update_doc(args.doc, f"Regenerate: `python benchmarks/paper_projection.py --doc {args.doc}`.\n\n{body}",
                   SECTION)
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
        v100 = load_profile("resnet50-v100").scaled(64)
        rows = run_plan(v100, ["ssgd", "compressed:collective=ps:compress_vectors=True", "cpsgd:collective=ps",
                               "compressed", "cpsgd"], [8, 16, 32], Network(56 * GBIT, 5e-6))
        plot_speedup(rows, os.path.join(args.plots, "cpsgd-v100-56gbit.png"),
                     "ResNet-50, V100 profile (batch 64), 56 Gbit/s, 5 us")
        v32 = load_profile("resnet50-v100").scaled(32)
        rows = run_plan(v32, ["ssgd", "compressed:collective=ps:compress_vectors=True", "cpsgd:collective=ps",
                              "compressed", "cpsgd"], [8, 16, 32], Network(56 * GBIT, 5e-6))
        plot_speedup(rows, os.path.join(args.plots, "cpsgd-v100-56gbit-batch32.png"),
                     "ResNet-50, V100 profile (batch 32), 56 Gbit/s, 5 us")
        knl = load_profile("resnet50-knl")
        rows = run_plan(knl, ["ssgd", "lazy:tau=4", "ssgd:pattern=pcnn", "lazy:tau=4:pattern=pcnn",
                              "lazy:tau=4:pattern=pcnn:lazy_layers=32"],
                        [8, 64, 256, 512, 1024, 2048], Network(64 * GBIT, 10e-6))
        plot_speedup(rows, os.path.join(args.plots, "lazy-knl-aries.png"),
                     "ResNet-50, KNL profile (batch 16), 64 Gbit/s, 10 us",
                     marks=[(2048, 276.6, "paper S-SGD 276.6"), (2048, 739.6, "paper lazy 739.6")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
