"""A plain PyTorch DDP training script, with lowband's codecs as DDP's communication hook.

    python examples/ddp_hook.py --compressor 2bit          # spawns --nproc local gloo ranks
    torchrun --nproc-per-node 2 examples/ddp_hook.py --compressor qsgd --collective allgather
    python examples/ddp_hook.py --synthetic --max-steps 20 # no dataset needed

The script is an ordinary DDP loop (DistributedSampler, DataLoader, DistributedDataParallel,
torch.nn.utils.clip_grad_norm_, optimizer.step()); lowband adds two lines, marked "lowband":
build a CompressionHookState and register compression_hook. DDP then averages each gradient
bucket through lowband's compressed collective, with error feedback, after
--start-compress-iter iterations of plain fp32 all-reduce. There is no lowband algorithm here
(DDP is the algorithm): --compressor picks the codec, --collective how the compressed
payloads meet. The hook state pickles (residuals included) for checkpoints.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.data import TensorDataset as TorchTensorDataset

from lowband.app.data import DEFAULT_DATA_DIR, load_dataset
from lowband.app.models import LeNet
from lowband.app.tasks import evaluate
import lowband
from lowband.codecs import COMPRESSORS
from lowband.comm.plans import COLLECTIVE_CHOICES
from lowband.integrations.ddp_hook import CompressionHookState, compression_hook


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compressor", default="2bit", choices=sorted(COMPRESSORS), help="lowband codec")
    p.add_argument("--collective", default="two-stage", choices=COLLECTIVE_CHOICES)
    p.add_argument("--start-compress-iter", type=int, default=20, help="fp32 iterations first (>= 2)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--synthetic", action="store_true", help="generated images instead of Fashion-MNIST")
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=64, help="images per rank and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def train(args, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = "synthetic" if args.synthetic else "fashion-mnist"
    train_data = load_dataset(dataset, "train", args.data_dir, seed=args.seed)
    test_data = load_dataset(dataset, "test", args.data_dir, seed=args.seed)
    sampler = DistributedSampler(TorchTensorDataset(train_data.images, train_data.labels), seed=args.seed)
    loader = DataLoader(sampler.dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)          # DDP broadcasts rank 0's initial weights anyway
    model = DDP(LeNet().to(device), device_ids=[device] if device.type == "cuda" else None)
    hook_state = CompressionHookState(compressor=args.compressor, collective=args.collective,   # lowband
                                      start_compress_iter=args.start_compress_iter)
    model.register_comm_hook(hook_state, compression_hook)                                   # lowband
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    step, epoch = 0, 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()                   # DDP averages the gradients through the hook
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            step += 1
            if step % 20 == 0 or step == args.max_steps:
                mean_loss = loss.detach().reshape(1) / world
                dist.all_reduce(mean_loss)
                if rank == 0:
                    print(f"step {step} loss {float(mean_loss):.4f}", flush=True)
            if step == args.max_steps:
                break
        epoch += 1

    metrics = evaluate(model.module, test_data, rank, world)     # every replica holds the same weights
    stats = hook_state.compression_stats()
    hook_state.close()
    if rank == 0:
        print(f"final step {step} loss {float(mean_loss):.4f} test_accuracy {metrics['test_accuracy']:.4f} "
              f"bytes_sent/fp32 {stats['ratio']:.3f}", flush=True)


def main() -> None:
    args = parse_args()
    lowband.launch(train, args, nproc=args.nproc)   # --nproc local ranks, or join torchrun's world


if __name__ == "__main__":
    main()
