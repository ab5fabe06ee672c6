"""The resolved configuration of one training run (what `lowband train` writes to config.json)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from .data import DEFAULT_DATA_DIR
from .guard import NONFINITE_POLICIES
from .tasks import check_pairing

OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine", "warmup-cosine")


@dataclass
class TrainConfig:
    """One run. Every field is a CLI flag of ``lowband train`` (``--field-name``). The defaults
    of dataset, batch size, optimizer, lr, weight decay and schedule here are the image
    classifiers'; the CLI takes a language model's from :data:`lowband.tasks.TASK_DEFAULTS`."""

    model: str = "cnn"
    algorithm: str = "ssgd"
    algorithm_options: dict[str, Any] = field(default_factory=dict)
    dataset: str = "fashion-mnist"
    data_dir: str = DEFAULT_DATA_DIR
    workers: int = 2
    epochs: int = 1
    max_steps: Optional[int] = None
    batch_size: int = 64          # per worker
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    optimizer: str = "sgd"
    lr_schedule: str = "constant"  # "warmup-cosine": linear warm-up, then cosine to 10% (lowband.schedules)
    warmup_steps: int = 0         # learning-rate warm-up steps of "warmup-cosine"
    seed: int = 0
    threads: int = 1              # intra-op threads per worker
    eval_every_epoch: bool = True
    eval_every_steps: Optional[int] = None   # also evaluate every N steps (accuracy-vs-time curves)
    run_dir: str = "runs/latest"
    timeout_s: float = 120.0      # collective timeout: a dead peer is reported after this long
    progress: bool = True
    nonfinite: str = "raise"      # NaN/Inf gradient on any rank: "raise" | "skip" (all ranks) | "off"
    checkpoint_every: int = 0     # steps between checkpoints (0: none); the end of a run also saves
    keep_checkpoints: int = 2     # complete checkpoints kept (the newest is what --resume uses)
    resume: bool = False          # continue from run_dir's latest checkpoint
    master_addr: str = "127.0.0.1"  # rendezvous address; loopback keeps every socket local

    def validate(self) -> None:
        """Raise ValueError with one clear sentence for the first invalid field."""
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_steps}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.lr_schedule!r}; choose one of: {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        check_pairing(self.model, self.dataset)
        if self.eval_every_steps is not None and self.eval_every_steps < 1:
            raise ValueError(f"--eval-every must be >= 1, got {self.eval_every_steps}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"--nonfinite must be one of: {', '.join(NONFINITE_POLICIES)}, got {self.nonfinite!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown configuration fields: {sorted(unknown)}")
        return cls(**data)
