"""Where one training step's host and device time goes, per algorithm: torch.profiler over a
few steady steps of a one-process run (world size 1), so the algorithms' own per-step work
(pipeline hand-offs, codec kernels, the local update, events and streams) stands alone, with no
peer to wait for. Meant for a GPU, where a small model's step is a few milliseconds and the
host's per-step work decides it (benchmarks/gpu_check.sh runs it); it runs on the CPU too.

Usage (repository root)::

    PYTHONPATH=src python benchmarks/step_profile.py --device cuda --algorithms noop,compressed,cpsgd
    PYTHONPATH=src python benchmarks/step_profile.py --device cpu --model mlp --steps 20

For each algorithm: the median step time (host wall clock, synchronised on CUDA), then the
profiler's top operators by self CPU time and, on CUDA, by self device time, per step.
Compressing algorithms get ``warmup_steps=0`` so the profiled steps are compressed ones.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowband
from lowband.runtime.launcher import free_port
from lowband.app.models import make_model

#: per-algorithm options: no fp32 warm-up, so the profiled steps are the algorithm's own
STEADY = {"compressed": {"warmup_steps": 0}, "cpsgd": {"warmup_steps": 0},
          "localsgd": {"warmup_steps": 0}, "ddp-powersgd": {"start_powerSGD_iter": 1}}
INPUTS = {"cnn": (1, 28, 28), "resnet20": (3, 32, 32), "mlp": (1, 28, 28)}


def profile_one(name: str, model_name: str, device: torch.device, steps: int, profiled: int,
                batch: int, top: int) -> str:
    torch.manual_seed(0)
    model = make_model(model_name).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = lowband.distribute(model, optimizer, name, **STEADY.get(name, {}))
    x = torch.randn(batch, *INPUTS.get(model_name, (1, 28, 28)), device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(engine.module(x), y).backward()
        engine.step()

    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(profiled):
            step()
        sync()
    engine.synchronize()
    engine.close()
    steady = times[len(times) // 2:]
    lines = [f"## {name} on {device} ({model_name}, batch {batch}): median step "
             f"{statistics.median(steady) * 1e3:.2f} ms over the last {len(steady)} of {steps} steps; "
             f"profiler over {profiled} more steps"]
    table = prof.key_averages()
    lines.append(table.table(sort_by="self_cpu_time_total", row_limit=top))
    if device.type == "cuda":
        lines.append(table.table(sort_by="self_device_time_total", row_limit=top))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--algorithms", default="noop,ssgd,compressed,cpsgd")
    p.add_argument("--model", default="cnn", choices=sorted(INPUTS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="timed steps before the profiled ones")
    p.add_argument("--profiled", type=int, default=10)
    p.add_argument("--top", type=int, default=15, help="operators listed per table")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    failed = 0
    try:
        for name in [a.strip() for a in args.algorithms.split(",") if a.strip()]:
            try:
                print(profile_one(name, args.model, device, args.steps, args.profiled, args.batch, args.top),
                      flush=True)
            except Exception as e:     # one algorithm's failure must not hide the others' profiles
                failed += 1
                print(f"## {name}: failed: {type(e).__name__}: {e}", flush=True)
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
