"""The resolved configuration of one training run (what `lowband train` writes to config.json)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..runtime import cpus, memory
from .data import DEFAULT_DATA_DIR
from ..runtime.device import DEVICES
from ..engine.guard import DEFAULT_MAX_CONSECUTIVE_SKIPS, NONFINITE_POLICIES
from .tasks import check_pairing

OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine", "warmup-cosine")
#: numpy's seed range (torch's and Python's are wider)
SEED_LIMIT = 2 ** 32
#: --timeout above this is a typo, not a timeout (and overflows torch's millisecond timers)
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class TrainConfig:
    """One run. Every field is a CLI flag of ``lowband train`` (``--field-name``). The defaults
    of dataset, batch size, optimizer, lr, weight decay and schedule here are the image
    classifiers'; the CLI takes a language model's from :data:`lowband.app.tasks.TASK_DEFAULTS`."""

    model: str = "cnn"
    algorithm: str = "ssgd"
    algorithm_options: dict[str, Any] = field(default_factory=dict)
    dataset: str = "fashion-mnist"
    data_dir: str = DEFAULT_DATA_DIR
    workers: int = 2
    epochs: int = 1
    max_steps: Optional[int] = None
    batch_size: int = 64          # per worker
    micro_batches: int = 1        # forward/backward passes per step, gradients accumulated (Engine.no_sync)
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    optimizer: str = "sgd"
    lr_schedule: str = "constant"  # "warmup-cosine": linear warm-up, then cosine to 10% (lowband.app.lr_schedule)
    warmup_steps: int = 0         # learning-rate warm-up steps of "warmup-cosine"
    seed: int = 0
    threads: int = 1              # intra-op threads per worker
    cpu_binding: str = "none"     # "none" | "spread": each local rank on its own cores (lowband.runtime.cpus)
    malloc: str = memory.DEFAULT_MODE   # "cached" | "system": the C heap keeps a step's pages (lowband.runtime.memory)
    eval_every_epoch: bool = True
    eval_every_steps: Optional[int] = None   # also evaluate every N steps (accuracy-vs-time curves)
    run_dir: str = "runs/latest"
    timeout_s: float = 120.0      # collective timeout: a dead peer is reported after this long
    progress: bool = True
    nonfinite: str = "raise"      # NaN/Inf gradient on any rank: "raise" | "skip" (all ranks) | "off"
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS   # "skip": then every rank stops
    checkpoint_every: int = 0     # steps between checkpoints (0: none); the end of a run also saves
    keep_checkpoints: int = 2     # complete checkpoints kept (the newest is what --resume uses)
    resume: bool = False          # continue from run_dir's latest checkpoint
    master_addr: str = "127.0.0.1"  # rendezvous address; loopback keeps every socket local
    device: str = "cpu"           # "cpu" | "cuda" | "auto" (lowband.runtime.device; the CLI resolves auto)

    def validate(self) -> None:
        """Raise ValueError with one clear sentence, naming the flag, for the first invalid field."""
        def at_least(flag: str, value: Any, low: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")

        def number(flag: str, value: Any, ok: bool, what: str) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok:
                raise ValueError(f"{flag} must be {what}, got {value!r}")

        at_least("--workers", self.workers, 1)
        at_least("--batch-size", self.batch_size, 1)
        at_least("--micro-batches", self.micro_batches, 1)
        if self.micro_batches > self.batch_size:
            raise ValueError(f"--micro-batches {self.micro_batches} is more than the --batch-size {self.batch_size} "
                             "samples each worker takes per step")
        at_least("--epochs", self.epochs, 1)
        if self.max_steps is not None:
            at_least("--max-steps", self.max_steps, 1)
        number("--lr", self.lr, self.lr > 0, "a finite number > 0")
        number("--momentum", self.momentum, 0 <= self.momentum < 1, "a number in [0, 1)")
        number("--weight-decay", self.weight_decay, self.weight_decay >= 0, "a finite number >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"--seed must be an integer in [0, 2**32), got {self.seed!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.lr_schedule!r}; choose one of: {', '.join(LR_SCHEDULES)}")
        at_least("--warmup-steps", self.warmup_steps, 0)
        check_pairing(self.model, self.dataset)
        if self.eval_every_steps is not None:
            at_least("--eval-every", self.eval_every_steps, 1)
        at_least("--threads", self.threads, 1)
        cpus.check_mode(self.cpu_binding)
        memory.check_mode(self.malloc)
        number("--timeout", self.timeout_s, 0 < self.timeout_s <= MAX_TIMEOUT_S,
               f"a number of seconds > 0 and <= {MAX_TIMEOUT_S:.0f} (a week)")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"--nonfinite must be one of: {', '.join(NONFINITE_POLICIES)}, got {self.nonfinite!r}")
        at_least("--max-skips", self.max_consecutive_skips, 1)
        at_least("--checkpoint-every", self.checkpoint_every, 0)
        at_least("--keep-checkpoints", self.keep_checkpoints, 1)
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of: {', '.join(DEVICES)}, got {self.device!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"--master-addr must be a host name or address, got {self.master_addr!r}")

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
