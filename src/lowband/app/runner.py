"""Run one training configuration as N local worker processes: prepare its run directory,
launch, and turn a failed launch into one exception. `lowband train` and `lowband bench` both
go through here, so a run behaves the same whichever command (and whichever link) starts it."""
from __future__ import annotations

import os
import shutil
from typing import Callable, Optional, Sequence

from .checkpoint import DIRNAME as CHECKPOINT_DIRNAME
from .config import TrainConfig
from ..runtime.launcher import LaunchResult, launch_workers

#: seconds, on top of --timeout, that workers get to notice a dead peer and exit by themselves
TEARDOWN_S = 5.0
RUN_RECORDS = ("steps.jsonl", "epochs.jsonl")


class RunFailed(RuntimeError):
    """A worker failed; ``result`` says which and how."""

    def __init__(self, cfg: TrainConfig, result: LaunchResult):
        self.result = result
        super().__init__(f"{cfg.algorithm} x{cfg.workers}: {result.describe()}; see {cfg.run_dir}")


def prepare_run_dir(cfg: TrainConfig) -> str:
    """Clear what an earlier run left (keeping metrics and checkpoints when resuming) and write
    ``config.json``; returns its path."""
    os.makedirs(cfg.run_dir, exist_ok=True)
    for name in os.listdir(cfg.run_dir):
        if name == "summary.json" or name.endswith(".stats.json") or (name in RUN_RECORDS and not cfg.resume):
            os.remove(os.path.join(cfg.run_dir, name))
    if not cfg.resume:   # a fresh run must never be "resumed" from an older run's checkpoint
        shutil.rmtree(os.path.join(cfg.run_dir, CHECKPOINT_DIRNAME), ignore_errors=True)
    config_path = os.path.join(cfg.run_dir, "config.json")
    with open(config_path, "w") as f:
        f.write(cfg.to_json())
    return config_path


def launch(
    cfg: TrainConfig,
    *,
    prefix: Optional[Callable[[int], Sequence[str]]] = None,
    extra_env: Optional[Callable[[int], dict]] = None,
    master_addr: Optional[str] = None,
) -> None:
    """Run ``cfg`` to completion with ``cfg.workers`` local processes; raise RunFailed."""
    config_path = prepare_run_dir(cfg)
    # the workers notice a dead or silent peer within --timeout, and the grace period covers
    # it; after a worker died, the others are given TEARDOWN_S only (launch_workers)
    result = launch_workers(cfg.workers, config_path, threads=cfg.threads, prefix=prefix, extra_env=extra_env,
                            master_addr=master_addr or cfg.master_addr, grace_s=cfg.timeout_s + TEARDOWN_S,
                            dead_grace_s=TEARDOWN_S)
    if result.returncode != 0:
        raise RunFailed(cfg, result)
