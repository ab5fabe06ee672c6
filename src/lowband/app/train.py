"""The training loop one worker runs (inside an initialized process group)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .config import TrainConfig
from .data import ShardedBatches, load_dataset
from . import checkpoint, tasks
from ..runtime import comm_threads, cpus, device, elastic, memory, rendezvous
from ..comm.agreement import ReplicaMismatchError
from ..engine.engine import Engine, distribute
from ..engine.guard import NonFiniteLossError
from .metrics import MetricsWriter, format_table, read_jsonl, write_json_atomic
from .models import make_model
from .lr_schedule import COSINE_FINAL_RATIO, CosineSchedule
from .runner import prepare_run_dir


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Optional[CosineSchedule]:
    if cfg.lr_schedule == "cosine":
        return CosineSchedule(optimizer, total_steps)
    if cfg.lr_schedule == "warmup-cosine":
        return CosineSchedule(optimizer, total_steps, warmup_steps=cfg.warmup_steps, final_ratio=COSINE_FINAL_RATIO)
    return None


def init_process_group(cfg: TrainConfig) -> None:
    """Join the world described by the standard torch.distributed environment variables,
    over NCCL when each local rank has a GPU of its own, else gloo (:mod:`lowband.runtime.device`)."""
    if dist.is_initialized():
        return
    local = device.local_world_size(int(os.environ.get("WORLD_SIZE", cfg.workers)))
    backend = device.backend_for(cfg.device, local)
    rendezvous.init_process_group(backend, timedelta(seconds=cfg.timeout_s))


def _rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout, augmentation), as tensors and plain
    containers so the checkpoint loads with ``weights_only=True``."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _trim_metrics(run_dir: str, step: int) -> None:
    """On resume, drop records of steps after the checkpoint (the crashed run got further
    than its last checkpoint); the resumed run appends from there."""
    for name in ("steps.jsonl", "epochs.jsonl"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
            checkpoint.atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept).encode())


def _all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (a collective, hence also a barrier)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def join_torchrun_job(cfg: TrainConfig, rank: int) -> TrainConfig:
    """Collective, for a worker started by torchrun: decide on every rank alike whether this
    start is a restart of the job, and prepare the run directory as ``lowband train``'s own
    launcher does.

    A restart (some rank's ``TORCHELASTIC_RESTART_COUNT`` > 0: torchrun's ``--max-restarts``
    started the workers again after one failed) continues from the run directory's latest
    checkpoint, as ``--resume`` would, or from step 0 when the job has written none yet. A
    fresh start removes an earlier run's checkpoints and records (rank 0), so a later restart
    never continues another run. Returns ``cfg``, with ``resume`` set on a restart that resumes."""
    manifest = checkpoint.manifest_path(cfg.run_dir)
    seen = _all_gather((elastic.restart_count(), os.path.exists(manifest)))
    restart = max(count for count, _ in seen)
    if restart > 0 and not cfg.resume:
        found = [has for _, has in seen]
        if all(found):
            cfg = dataclasses.replace(cfg, resume=True)
        elif any(found):
            raise checkpoint.CheckpointError(
                f"after torchrun's restart {restart}, rank {found.index(False)} finds no checkpoint at {manifest} "
                f"where rank {found.index(True)} finds one; checkpoints need a run directory that every rank shares")
    if cfg.resume:                # refused (one line, every rank) before the run directory is touched
        checkpoint.check_resumable(checkpoint.read_manifest(cfg.run_dir), dataclasses.asdict(cfg),
                                   dist.get_world_size(), torchrun=True)
    if rank == 0:
        prepare_run_dir(cfg)      # a fresh start clears old checkpoints; a resume keeps them
        hazard = elastic.restart_hazard()
        if hazard is not None and restart == 0:
            print(f"lowband: warning: {hazard}", file=sys.stderr, flush=True)
        if restart > 0:
            limit = elastic.max_restarts()
            what = f"torchrun restart {restart}" + (f" of at most {limit}" if limit is not None else "")
            where = (f"continuing from the checkpoint of step {checkpoint.read_manifest(cfg.run_dir)['step']}"
                     if cfg.resume else "no checkpoint yet: starting again from step 0")
            print(f"lowband: {what}: {where} ({cfg.run_dir})", file=sys.stderr, flush=True)
    dist.barrier()                # nobody reads or writes the run directory before it is ready
    return cfg


def forward_backward(engine: Engine, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1) -> torch.Tensor:
    """One step's forward and backward over the batch ``(x, y)``, as ``micro_batches`` passes over
    consecutive slices of it whose gradients add up (all but the last inside ``engine.no_sync()``),
    each loss weighted by its share of the samples: the batch's mean loss and its gradient, with
    one slice's activations in memory at a time. Returns the batch's loss (detached)."""
    if micro_batches == 1:
        loss = tasks.loss(engine.module(x), y)
        loss.backward()
        return loss.detach()
    xs, ys = x.tensor_split(micro_batches), y.tensor_split(micro_batches)
    total = torch.zeros((), device=x.device)
    for m, (xm, ym) in enumerate(zip(xs, ys)):
        with engine.no_sync() if m < micro_batches - 1 else contextlib.nullcontext():
            loss = tasks.loss(engine.module(xm), ym) * (xm.shape[0] / x.shape[0])
            loss.backward()
        total += loss.detach()
    return total


def run_worker(cfg: TrainConfig) -> Optional[dict[str, Any]]:
    """Train one worker's share; rank 0 returns (and writes) the run summary. With
    ``cfg.resume`` the run continues from the latest checkpoint in ``cfg.run_dir``, taking
    exactly the steps the uninterrupted run would have taken."""
    # first: every thread started from here on (torch's, gloo's, lowband's) inherits the cores
    cores = cpus.bind(cfg.cpu_binding)
    malloc = memory.configure(cfg.malloc)    # before the first tensor: every step reuses its pages
    # the rank's GPU becomes current before NCCL creates its communicator (RANK: the launcher's
    # and torchrun's environment, the rank the process group takes next)
    dev = device.bind(cfg.device, int(os.environ.get("RANK", 0)))
    init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    if elastic.under_agent():
        cfg = join_torchrun_job(cfg, rank)
    on_gpu = dev.type != "cpu"      # decided once: the CPU loop gains no per-step device check
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)          # a run is a function of its config, whichever RNG a step uses
    np.random.seed(cfg.seed)

    train = load_dataset(cfg.dataset, "train", cfg.data_dir, cfg.seed)
    test = load_dataset(cfg.dataset, "test", cfg.data_dir, cfg.seed)
    batches = ShardedBatches(train, cfg.batch_size, rank, world, cfg.seed)
    total_steps = cfg.epochs * batches.steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    model = make_model(cfg.model).to(dev)    # initialised on the CPU: the same weights on every device
    optimizer = make_optimizer(cfg, model)
    scheduler = make_scheduler(cfg, optimizer, total_steps)
    engine = distribute(model, optimizer, cfg.algorithm, nonfinite=cfg.nonfinite,
                        max_consecutive_skips=cfg.max_consecutive_skips, **cfg.algorithm_options)

    step, start_epoch, start_in_epoch = 0, 0, 0
    train_time = wait_total = 0.0
    if cfg.resume:
        manifest = checkpoint.read_manifest(cfg.run_dir)
        checkpoint.check_resumable(manifest, dataclasses.asdict(cfg), world, torchrun=elastic.under_agent())
        state = checkpoint.load(cfg.run_dir, rank, world, manifest, map_location=dev)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
            # a changed run length stretches (or shortens) the rest of the cosine from here
            scheduler.retarget(total_steps)
        try:
            engine.load_state_dict(state["engine"])
        except ValueError as e:     # the algorithm's configuration or state does not fit this run
            raise checkpoint.CheckpointError(f"the checkpoint of step {state['step']} does not fit this run: {e}") \
                from None
        try:   # the files' SHA-256 matched; this catches state that was wrong when it was saved
            engine.check_replicas()
        except ReplicaMismatchError as e:
            raise checkpoint.CheckpointError(f"after loading the checkpoint of step {state['step']}, {e}") from None
        _set_rng_state(state["rng"])
        step, start_epoch, start_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        train_time, wait_total = state["train_s"], state["comm_wait_s"]
        if rank == 0:
            _trim_metrics(cfg.run_dir, step)

    def save_checkpoint(epoch: int, next_in_epoch: int) -> None:
        if next_in_epoch == batches.steps_per_epoch:
            epoch, next_in_epoch = epoch + 1, 0
        state = {"epoch": epoch, "step_in_epoch": next_in_epoch, "model": model.state_dict(),
                 "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "engine": engine.state_dict(), "rng": _rng_state(),
                 "train_s": train_time, "comm_wait_s": wait_total}
        info = {"epoch": epoch, "step_in_epoch": next_in_epoch, "config": dataclasses.asdict(cfg)}
        checkpoint.save(cfg.run_dir, rank, world, step, state, info, _all_gather, cfg.keep_checkpoints)

    writer = MetricsWriter(cfg.run_dir, enabled=(rank == 0))
    progress = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm
        progress = tqdm(total=total_steps, initial=step, desc=f"{cfg.algorithm} x{world}", unit="step", leave=False)

    def evaluate_and_record(epoch: int) -> dict[str, float]:
        """Score a copy of the global model and log it (train_s excludes evaluation time).
        The copy leaves every piece of training state alone, so a run with evaluations
        follows the same trajectory as one without (tests/test_reliability_engine.py)."""
        scores = tasks.evaluate(engine.global_model(), test, rank, world)
        writer.epoch({"epoch": epoch, "step": step, **scores,
                      "wall_s": time.perf_counter() - wall0, "train_s": train_time})
        return scores

    metrics: dict[str, float] = {}
    resumed_at, comm_slices = step, 0
    wall0 = time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        if step >= total_steps:
            break
        first = start_in_epoch if epoch == start_epoch else 0
        for in_epoch, (x, y) in enumerate(batches.epoch(epoch, first), start=first):
            if on_gpu:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            before = engine.stats.snapshot()
            t0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward(engine, x, y, cfg.micro_batches)
            applied = engine.step()
            if applied and scheduler is not None:
                scheduler.step()
            t1, cpu1, thread1 = time.perf_counter(), time.process_time(), time.thread_time()
            after = engine.stats
            wait = after.comm_wait_s - before["comm_wait_s"]
            step_s = t1 - t0
            train_time += step_s
            wait_total += wait
            step += 1
            loss_value = loss.item()
            if not math.isfinite(loss_value) and cfg.nonfinite == "off":
                # with a guard the engine already decided, together with all ranks
                raise NonFiniteLossError(step, rank, loss_value)
            writer.step({
                "step": step, "epoch": epoch, "loss": loss_value, "step_s": step_s,
                "compute_s": step_s - wait, "comm_wait_s": wait,
                # CPU this process burnt during the step (all threads: codecs, gloo, kernel
                # time of its sockets) and the training thread's share of it
                "cpu_s": cpu1 - cpu0, "thread_cpu_s": thread1 - thread0,
                "bytes_sent": after.bytes_sent - before["bytes_sent"],
                "bytes_received": after.bytes_received - before["bytes_received"],
                "lr": optimizer.param_groups[0]["lr"], "skipped": not applied,
                **engine.bound.step_metrics(),
            })
            if step == resumed_at + 1:
                # after one step every communication thread exists (gloo's, the pipeline's)
                comm_slices = comm_threads.shorten(comm_threads.WORKER_SLICE_US)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss_value:.3f}", step_ms=f"{1e3 * step_s:.0f}")
            end_of_run = step >= total_steps
            if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and not end_of_run:
                metrics = evaluate_and_record(epoch)
            if (cfg.eval_every_epoch and in_epoch + 1 == batches.steps_per_epoch) or end_of_run:
                # evaluated before the checkpoint of this step, so a resume never repeats it
                metrics = evaluate_and_record(epoch)
            if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or end_of_run):
                save_checkpoint(epoch, in_epoch + 1)
            if end_of_run:
                break
    if not metrics:               # a resumed run that had no step left to take
        metrics = tasks.evaluate(engine.global_model(), test, rank, world)
    engine.synchronize()          # after the last checkpoint: the model this process ends with is global
    wall = time.perf_counter() - wall0
    if progress is not None:
        progress.close()

    stats = engine.stats
    # every rank's own byte counts, for checking them against the links' kernel counters
    own = stats.snapshot()
    guard = engine.guard.comm.stats.snapshot() if engine.guard.comm is not None else None
    own["guard_bytes_sent"] = guard["bytes_sent"] if guard else 0   # the non-finite agreement, kept apart
    own["aux_bytes_sent"] = engine.aux_stats.bytes_sent              # evaluation and checks, kept apart
    write_json_atomic(os.path.join(cfg.run_dir, f"rank{rank}.stats.json"), own)
    summary = None
    if rank == 0:
        summary = {
            "algorithm": cfg.algorithm, "algorithm_config": engine.algorithm.config(),
            "algorithm_summary": engine.bound.summary(),
            "workers": world, "device": str(dev), "backend": dist.get_backend(),
            "cpu_binding": cfg.cpu_binding, "rank0_cores": cores,
            # None: the kernel takes no custom slices (nothing changed)
            "comm_slice_us": comm_threads.WORKER_SLICE_US, "rank0_comm_threads_sliced": comm_slices,
            "malloc": cfg.malloc, "malloc_settings": malloc, "model": cfg.model, "task": tasks.task_of(cfg.model), "dataset": cfg.dataset,
            "batch_size": cfg.batch_size, "micro_batches": cfg.micro_batches, "steps": step,
            "skipped_steps": stats.skipped_steps,
            **metrics, **tasks.describe_data(train, test),
            "wall_s": wall, "train_s": train_time,
            "step_ms": 1e3 * train_time / max(1, step),
            "throughput": step * cfg.batch_size * world / train_time if train_time > 0 else None,
            "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
            "payload_bytes": stats.payload_bytes,
            "mb_sent_per_step": stats.bytes_sent / max(1, step) / 1e6,
            "comm_wait_s": wait_total,
            "comm_wait_share": wait_total / train_time if train_time > 0 else None,
        }
        writer.summary(summary)
    writer.close()
    engine.close()
    dist.barrier()
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print(format_table([summary]), flush=True)
