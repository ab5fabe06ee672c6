"""CPU per step of CP-SGD's two optimizer passes: torch (``optimizer.step()`` on W, then the
closed-form tentative step into w) against the fused native pass (``FusedSGDStep``).

Why: on a 1-core worker, CP-SGD's global step plus its look-ahead local update run on the
training thread every step and add to it one for one. One thread, SGD with momentum 0.9 and
weight decay 1e-4 (the accuracy protocol's optimizer), the model's real parameter shapes.

    PYTHONPATH=src python benchmarks/sgd_step.py --model cnn resnet20
"""
from __future__ import annotations

import argparse
import time

import torch

from lowband.algorithms.local_update import FusedSGDStep, TentativeStep
from lowband.models import make_model


def _time(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    c0 = time.process_time()
    for _ in range(iters):
        fn()
    return 1e3 * (time.process_time() - c0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["cnn", "resnet20"])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the two paths this many times")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | parameters | optimizer.step alone (ms) | torch: optimizer.step + tentative step (ms) "
          "| fused native pass (ms) | ratio | torch path / step | fused / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.model:
        torch.manual_seed(0)
        params = list(make_model(name).parameters())
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()                                   # momentum buffers exist, as mid-training
        W = [p.data for p in params]
        G = [p.grad for p in params]
        g = [torch.randn_like(p) * 1e-3 for p in params]
        w = [torch.empty_like(p) for p in params]
        tentative, fused = TentativeStep(opt, params), FusedSGDStep(opt, params)
        assert FusedSGDStep.unavailable(opt, params) is None

        def torch_path():
            opt.step()
            tentative.step(W, g, w)
        alone, slow, fast = [], [], []
        for _ in range(args.rounds):
            alone.append(_time(opt.step, args.iters))
            slow.append(_time(torch_path, args.iters))
            fast.append(_time(lambda: fused.step(W, G, g, w), args.iters))
        o, s, f = (sorted(x)[len(x) // 2] for x in (alone, slow, fast))
        print(f"| {name} | {sum(p.numel() for p in params):,} | {o:.2f} | {s:.2f} | {f:.2f} | {s / f:.1f}x "
              f"| {s / o:.2f} | {f / o:.2f} |")


if __name__ == "__main__":
    main()
