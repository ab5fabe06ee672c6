#!/usr/bin/env python3
"""How much communication does S-SGD hide behind backward?

Runs, in one invocation and interleaved per worker count, the same training job three ways:
compute-only (``noop``: no communication at all), S-SGD with communication after backward
(``--no-overlap``) and S-SGD with per-bucket all-reduce launched during backward, and prints
median step times and their ratios. Results go into docs/results.md by hand, with this
command line.

    python benchmarks/overlap.py --workers 2,4 --model cnn --max-steps 60
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from lowband.app.bench import run_config
from lowband.app.config import TrainConfig

MODES = [
    ("compute-only", "noop", {}),
    ("no overlap", "ssgd", {"overlap": False}),
    ("overlap", "ssgd", {"overlap": True}),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts (default: %(default)s)")
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--out", default=None, help="run directories go here (default: a temporary directory)")
    args = p.parse_args()
    print("command: python " + " ".join(sys.argv))
    out = args.out or tempfile.mkdtemp(prefix="lowband-overlap-")
    print("| workers | mode | median step ms | compute ms | exposed comm wait ms | step / compute-only |")
    print("|---|---|---|---|---|---|")
    for workers in [int(w) for w in args.workers.split(",")]:
        base = None
        for label, algorithm, opts in MODES:
            if algorithm == "ssgd":
                opts = {**opts, "bucket_mb": args.bucket_mb}
            cfg = TrainConfig(model=args.model, dataset=args.dataset, algorithm=algorithm, algorithm_options=opts,
                              workers=workers, batch_size=args.batch_size, max_steps=args.max_steps,
                              eval_every_epoch=False, progress=False,
                              run_dir=os.path.join(out, f"{workers}-{label.replace(' ', '-')}"))
            r = run_config(cfg)
            step = r.median("step_s")
            base = base or step
            print(f"| {workers} | {label} | {1e3 * step:.1f} | {1e3 * r.median('compute_s'):.1f} | "
                  f"{1e3 * r.median('comm_wait_s'):.1f} | {step / base:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
