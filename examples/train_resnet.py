"""Train ResNet-20 on Fashion-MNIST with SGD and momentum, data-parallel through lowband.

    python examples/train_resnet.py --algorithm cpsgd          # spawns --nproc local gloo ranks
    torchrun --nproc-per-node 2 examples/train_resnet.py --algorithm lazy
    python examples/train_resnet.py --synthetic --max-steps 20 # no dataset needed

Fashion-MNIST is read from --data-dir (Debian's dataset-fashion-mnist package puts it in
/usr/share/datasets/fashion-mnist); --synthetic trains on generated images of the same shape.

Mixed precision: on a GPU the forward runs under fp16 autocast with a torch.amp.GradScaler,
handed to lowband.distribute(scaler=...); engine.step() then does what a DDP script's
scaler.step(optimizer) does, and a step with inf/NaN is skipped on every rank alike, with
every algorithm. On the CPU there is no GradScaler and no autocast: fp32.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowband
from lowband.app.data import DEFAULT_DATA_DIR, ShardedBatches, TensorDataset, load_dataset
from lowband.app.models import ResNet20
from lowband.app.tasks import evaluate


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="ssgd", help="one of: " + ", ".join(sorted(lowband.ALGORITHMS)))
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an algorithm option, e.g. warmup_steps=20 (repeatable)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--synthetic", action="store_true", help="generated images instead of Fashion-MNIST")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64, help="images per rank and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--test-samples", type=int, default=None, help="score only the first N test images")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def train(args, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = "synthetic" if args.synthetic else "fashion-mnist"
    train_data = load_dataset(dataset, "train", args.data_dir, seed=args.seed)
    test_data = load_dataset(dataset, "test", args.data_dir, seed=args.seed)
    if args.test_samples is not None:
        test_data = TensorDataset(test_data.images[:args.test_samples], test_data.labels[:args.test_samples])
    batches = ShardedBatches(train_data, args.batch_size, rank, world, seed=args.seed)

    torch.manual_seed(args.seed)        # distribute() broadcasts rank 0's initial weights anyway
    model = ResNet20().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.max_steps)
    cuda = device.type == "cuda"
    # with a GradScaler the scaler decides about non-finite steps (skipped on every rank alike),
    # so lowband's own check is off there; on the CPU it stays at its default ("raise")
    options = dict(o.split("=", 1) for o in args.option)
    scaler = torch.amp.GradScaler("cuda", enabled=cuda)
    engine = lowband.distribute(model, optimizer, args.algorithm, nonfinite="off" if cuda else "raise",
                                scaler=scaler if cuda else None, **options)
    if rank == 0:
        print(f"{args.algorithm} on {world} ranks, {device.type}, GradScaler {'on' if cuda else 'off'}", flush=True)

    for step in range(1, args.max_steps + 1):
        epoch, i = divmod(step - 1, batches.steps_per_epoch)
        x, y = (t.to(device) for t in train_data.batch(batches.indices(epoch, i)))
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
            loss = F.cross_entropy(engine.module(x), y)
        scaler.scale(loss).backward()        # a disabled scaler returns the loss as it is
        engine.step()                        # where DDP calls scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        if step % 20 == 0 or step == args.max_steps:
            mean_loss = loss.detach().float().reshape(1) / world
            dist.all_reduce(mean_loss)       # the average over the ranks' batches
            if rank == 0:
                print(f"step {step} loss {float(mean_loss):.4f}", flush=True)
        if step % args.eval_every == 0 or step == args.max_steps:
            metrics = evaluate(engine.global_model(), test_data, rank, world)   # collective: every rank
            if rank == 0:
                print(f"step {step} test_accuracy {metrics['test_accuracy']:.4f} "
                      f"test_loss {metrics['test_loss']:.4f}", flush=True)

    engine.synchronize()                     # apply everything pending and average BatchNorm statistics
    if rank == 0:
        print(f"final step {args.max_steps} loss {float(mean_loss):.4f} "
              f"test_accuracy {metrics['test_accuracy']:.4f}", flush=True)


def main() -> None:
    args = parse_args()
    lowband.launch(train, args, nproc=args.nproc)   # --nproc local ranks, or join torchrun's world


if __name__ == "__main__":
    main()
