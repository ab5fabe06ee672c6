"""Train lowband's byte-level transformer on the Python standard library's own sources.

    python examples/train_lm.py --algorithm cpsgd             # spawns --nproc local gloo ranks
    torchrun --nproc-per-node 2 examples/train_lm.py --algorithm lazy --bf16
    python examples/train_lm.py --ckpt-dir ckpt --resume      # continue from the last checkpoint

AdamW, linear warm-up and cosine decay, clipping of the averaged gradient (engine.clip_grad_norm_),
optional bf16 autocast, evaluation of engine.global_model() every --eval-every steps, and per-rank
checkpoints (model, optimizer, scheduler, engine state, step): a resumed run continues bit for bit.
"""
import argparse
import hashlib
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowband
from lowband.app.data import ShardedBatches, load_python_stdlib
from lowband.app.lr_schedule import warmup_cosine
from lowband.app.models import GPT
from lowband.app.tasks import evaluate


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="ssgd", help="one of: " + ", ".join(sorted(lowband.ALGORITHMS)))
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an algorithm option, e.g. warmup_steps=20 (repeatable)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun")
    # --batch-size: windows per rank and step; --context: bytes per window; --clip: the max norm
    # of the averaged gradient; --eval-windows: validation windows per evaluation
    for flag, default in (("--max-steps", 300), ("--warmup-steps", 20), ("--batch-size", 8), ("--context", 128),
                          ("--d-model", 128), ("--layers", 6), ("--heads", 4), ("--eval-every", 100),
                          ("--eval-windows", 128), ("--ckpt-every", 100), ("--seed", 0)):
        p.add_argument(flag, type=int, default=default)
    for flag, default in (("--lr", 1e-3), ("--weight-decay", 0.1), ("--clip", 1.0)):
        p.add_argument(flag, type=float, default=default)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast around the forward")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--resume", action="store_true", help="start from the last checkpoint in --ckpt-dir")
    args = p.parse_args()
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    return args


def ckpt_path(args, step: int, rank: int) -> str:
    return os.path.join(args.ckpt_dir, f"step{step:08d}-rank{rank}.pt")


def last_checkpoint(args, rank: int, device: torch.device) -> int:   # the last step all ranks saved; 0: none
    names = os.listdir(args.ckpt_dir) if os.path.isdir(args.ckpt_dir) else []
    steps = [int(m[1]) for n in names if (m := re.fullmatch(rf"step(\d+)-rank{rank}\.pt", n))]
    found = torch.tensor([max(steps, default=0)], device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    return int(found)


def train(args, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)        # distribute() broadcasts rank 0's initial weights anyway
    model = GPT(context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, args.warmup_steps, args.max_steps))
    engine = lowband.distribute(model, optimizer, args.algorithm, **dict(o.split("=", 1) for o in args.option))
    train_data = load_python_stdlib("train", window=args.context)
    val_data = load_python_stdlib("test", window=args.context, validation_windows=args.eval_windows)
    batches = ShardedBatches(train_data, args.batch_size, rank, world, seed=args.seed)

    step, mean_loss = 0, torch.full((1,), float("nan"))
    if args.resume and (step := last_checkpoint(args, rank, device)):
        state = torch.load(ckpt_path(args, step, rank), map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        engine.load_state_dict(state["engine"])
        if rank == 0:
            print(f"resumed from step {step}", flush=True)

    for step in range(step + 1, args.max_steps + 1):
        epoch, i = divmod(step - 1, batches.steps_per_epoch)
        x, y = (t.to(device) for t in train_data.batch(batches.indices(epoch, i)))
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = engine.module(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        engine.clip_grad_norm_(args.clip)     # not torch.nn.utils.clip_grad_norm_: step() clips the average
        if engine.step():                     # False only for a step skipped under nonfinite="skip"
            scheduler.step()
        if step % 10 == 0 or step == args.max_steps:
            mean_loss = loss.detach().reshape(1) / world
            dist.all_reduce(mean_loss)            # the average over the ranks' batches
            if rank == 0:
                print(f"step {step} loss {float(mean_loss):.6f} lr {scheduler.get_last_lr()[0]:.3g}", flush=True)
        if step % args.eval_every == 0 or step == args.max_steps:
            metrics = evaluate(engine.global_model(), val_data, rank, world)   # collective: every rank
            if rank == 0:
                print(f"step {step} val_loss {metrics['test_loss']:.6f}", flush=True)
        if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.max_steps):
            os.makedirs(args.ckpt_dir, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                     "scheduler": scheduler.state_dict(), "engine": engine.state_dict()}
            torch.save(state, ckpt_path(args, step, rank) + ".tmp")
            os.replace(ckpt_path(args, step, rank) + ".tmp", ckpt_path(args, step, rank))   # never half-written

    engine.synchronize()                      # apply everything pending: the model is the global one
    flat = torch.cat([p.detach().float().cpu().flatten() for p in model.parameters()])
    if rank == 0:
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        print(f"final step {step} loss {float(mean_loss):.6f} weights {digest}", flush=True)


def main() -> None:
    args = parse_args()
    lowband.launch(train, args, nproc=args.nproc)   # --nproc local ranks, or join torchrun's world


if __name__ == "__main__":
    main()
