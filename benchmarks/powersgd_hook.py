"""What PyTorch's PowerSGD hook costs one process, without peers: DDP on a 1-rank gloo group,
with and without ``powerSGD_hook``, interleaved round by round (median step ms of each run).

The difference is the hook's own work (its matmuls, orthogonalisation, copies and futures);
what a multi-rank run pays beyond it is waiting at its three sequential collectives (see
docs/results.md, "Performance model", miss 2).

    PYTHONPATH=src python benchmarks/powersgd_hook.py --model cnn --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel


def run(model_name: str, hook: bool, rank: int, steps: int, batch: int) -> float:
    from lowband.models import make_model
    torch.manual_seed(0)
    ddp = DistributedDataParallel(make_model(model_name), bucket_cap_mb=64)
    if hook:
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                       min_compression_rate=2.0, warm_start=True)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(steps + 10):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[10:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--rank", type=int, default=2, help="matrix_approximation_rank (ddp-powersgd's default: 2)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    plain, hooked = [], []
    for _ in range(args.rounds):
        plain.append(run(args.model, False, args.rank, args.steps, args.batch_size))
        hooked.append(run(args.model, True, args.rank, args.steps, args.batch_size))
    print(f"# {args.model}, batch {args.batch_size}, one process, rank {args.rank}: median step ms per round")
    print(f"DDP:                {', '.join(f'{t:.1f}' for t in plain)}")
    print(f"DDP + powerSGD_hook: {', '.join(f'{t:.1f}' for t in hooked)}")
    print(f"difference:         {', '.join(f'{h - p:+.1f}' for p, h in zip(plain, hooked))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
