"""Why a fixed 2-bit threshold fails: error-feedback residual dynamics on one worker.

Trains the cnn on Fashion-MNIST on one process with ``ErrorFeedback(2bit)`` applied to the whole
gradient (no collective: this isolates the codec), SGD momentum 0.9, and prints every
``--every`` steps: loss, ||e||/||g|| (residual relative to the gradient), the fraction of
elements fired, and the fraction of elements still holding |e| >= t after the send (a backlog:
one step sends at most one quantum per element, so they lag behind their gradient).

Usage::

    PYTHONPATH=src python benchmarks/twobit_dynamics.py --option threshold=0.01 --option relative=1
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lowband.compressors import ErrorFeedback, make_compressor
from lowband.data import DEFAULT_DATA_DIR, load_dataset
from lowband.models import make_model


def run(option: str, steps: int, lr: float, batch: int, every: int) -> None:
    key, value = option.split("=")
    torch.manual_seed(0)
    model = make_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    ef = ErrorFeedback(make_compressor("2bit", **{key: float(value)}))
    data = load_dataset("fashion-mnist", "train", DEFAULT_DATA_DIR, 0)
    print(f"\n2bit {option}, lr {lr}, batch {batch}")
    print("| step | loss | ‖e‖/‖g‖ | fired | backlog \\|e\\|≥t |")
    print("|---:|---:|---:|---:|---:|")
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(data), (batch,), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = F.cross_entropy(model(data.images[idx]), data.labels[idx])
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        e_before = ef.residual("g").clone() if step > 1 else torch.zeros_like(g)
        payload, ctx = ef.compress(g, "g")
        q = ef.decompress(payload, ctx)
        r = e_before + g
        t = ef.inner.threshold if ef.inner.threshold is not None else ef.inner.relative * float(r.pow(2).mean().sqrt())
        if step % every == 0 or step == 1:
            fired = float((q != 0).float().mean())
            over = float((ef.residual("g").abs() >= t).float().mean())
            ratio = float(ef.residual("g").norm() / g.norm())
            print(f"| {step} | {float(loss.detach()):.3f} | {ratio:.1f} | {fired:.3f} | {over:.4f} |")
        offset = 0
        for p in model.parameters():
            p.grad.copy_(q[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--option", action="append", required=True, help="2bit option, e.g. threshold=0.01")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=128, help="global batch (2 workers x 64)")
    ap.add_argument("--every", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for option in args.option:
        run(option, args.steps, args.lr, args.batch, args.every)


if __name__ == "__main__":
    main()
