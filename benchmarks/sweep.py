#!/usr/bin/env python3
"""Accuracy sweep over one algorithm's knobs, same seed and data for every point.

Each point is a real multi-worker `lowband train` run; the table reports final test accuracy,
wall time and bytes per step, plus any algorithm counters. Used to choose defaults (docs/).

    python benchmarks/sweep.py --algorithm cpsgd --grid local_update=none,sgd,optimizer \
        --set compressor=none --model cnn --epochs 1
"""
from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import sys
import tempfile

from lowband.app.bench import run_config
from lowband.app.runner import RunFailed
from lowband.app.config import TrainConfig


def parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", required=True)
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="knob values to sweep (repeatable; the cartesian product is run)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="fixed algorithm options")
    p.add_argument("--model", default="cnn")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-schedule", default="constant")
    p.add_argument("--out", default=None, help="directory for runs and sweep.json")
    args = p.parse_args()
    print("command: python " + " ".join(sys.argv), flush=True)
    fixed = {}
    for item in args.set:
        k, v = item.split("=", 1)
        fixed[k] = parse_value(v)
    axes = []
    for item in args.grid:
        k, vs = item.split("=", 1)
        axes.append([(k, parse_value(v)) for v in vs.split(",")])
    out = args.out or tempfile.mkdtemp(prefix="lowband-sweep-")
    rows = []
    print("| point | test acc | wall s | MB sent/step |")
    print("|---|---|---|---|")
    for point in itertools.product(*axes) if axes else [()]:
        opts = {**fixed, **dict(point)}
        label = ",".join(f"{k}={v}" for k, v in point) or "default"
        cfg = TrainConfig(model=args.model, algorithm=args.algorithm, algorithm_options=opts, workers=args.workers,
                          epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr,
                          lr_schedule=args.lr_schedule, eval_every_epoch=False, progress=False,
                          run_dir=os.path.join(out, label.replace("=", "-").replace(",", "_") or "default"))
        try:
            r = run_config(cfg)
        except RunFailed as e:             # e.g. the loss became NaN: a result, not a crash
            rows.append({"point": label, "options": opts, "failed": str(e)})
            print(f"| {label} | failed (see {cfg.run_dir}) | - | - |", flush=True)
            continue
        rows.append({"point": label, "options": opts, **{k: v for k, v in r.summary.items() if not isinstance(v, dict)}})
        print(f"| {label} | {r.summary['test_accuracy']:.2%} | {r.summary['wall_s']:.1f} | "
              f"{r.summary['mb_sent_per_step']:.3f} |", flush=True)
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
