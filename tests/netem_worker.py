"""One gloo rank for the netem tests and benchmark: all_reduce a float32 tensor.

Run inside a worker namespace with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
GLOO_SOCKET_IFNAME set.  Prints one JSON line: rank, ok, per-iteration seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, required=True, help="tensor size in bytes (float32)")
    p.add_argument("--iters", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// rendezvous via TCPStore at MASTER_ADDR
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = args.bytes // 4
    # Warm-up: establishes all gloo pair connections so the timed op is pure transfer.
    dist.all_reduce(torch.ones(16))
    expected = world * (world + 1) / 2
    times: list[float] = []
    ok = True
    for _ in range(args.iters):
        t = torch.full((numel,), float(rank + 1))
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
        ok = ok and bool(torch.all(t == expected))
    print(json.dumps({"rank": rank, "ok": ok, "times": times, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
