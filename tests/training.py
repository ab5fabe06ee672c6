"""Shared pieces of the multi-process training tests: a small model, its data and loop."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import lowband
from lowband.app import tasks
from lowband.app.data import ShardedBatches, make_synthetic

LOCAL_BATCH = 8
DATA_SIZE = 1024
#: short warm-ups and periods, so that every algorithm's own machinery (pipeline,
#: compression, local steps, PowerSGD, lazy intervals, outer syncs) runs within ~8 steps
SHORT_SCHEDULES: dict[str, dict[str, Any]] = {
    "compressed": {"warmup_steps": 2},
    "cpsgd": {"warmup_steps": 2, "correction_period": 3},
    "ddp-powersgd": {"start_powerSGD_iter": 2},
    "localsgd": {"warmup_steps": 1, "period": 3},
    "cp-diloco": {"sync_every": 3, "correction_every": 2},
    "diloco": {"sync_every": 4},
    "streaming-diloco": {"sync_every": 4, "fragments": 2},
}


class SmallNet(nn.Module):
    """Conv (+ BatchNorm) + linear. BatchNorm normalises with per-worker batch statistics, so
    only the model without it can equal single-process large-batch training; with it, lowband
    must still equal DDP."""

    def __init__(self, bn: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 5, stride=2)
        self.bn = nn.BatchNorm2d(4) if bn else nn.Identity()
        self.fc1 = nn.Linear(4 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class EmbedNet(SmallNet):
    """SmallNet plus an embedding table added to its logits, whose row for a sample is the
    sign pattern of six of its pixels (64 rows): a step's batch reaches some rows only, as
    gpt-ngram's hashed n-gram tables (cp-diloco's ``sparse_rows``)."""

    PIXELS = (30, 200, 350, 420, 555, 700)

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(64, 10)

    def forward(self, x):
        bits = (x.flatten(1)[:, list(self.PIXELS)] > 0).long()
        index = (bits << torch.arange(len(self.PIXELS))).sum(dim=1)
        return super().forward(x) + self.table(index)


class PartlyUsed(SmallNet):
    """SmallNet with a head that only rank 0 uses, on odd steps: its bucket completes during
    backward on rank 0 and only in ``step()`` on rank 1."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.calls = rank, 0
        self.extra = nn.Linear(10, 10)

    def forward(self, x):
        out = super().forward(x)
        self.calls += 1
        return out + self.extra(out) if self.rank == 0 and self.calls % 2 else out


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    if kind == "sgd-hot":            # large steps: layers whose progress disagrees between rounds
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-3)


def batches(rank: int, world: int, local_batch: int = LOCAL_BATCH) -> ShardedBatches:
    return ShardedBatches(make_synthetic(DATA_SIZE, seed=1), local_batch, rank, world, seed=3)


def train(model: nn.Module, optimizer, batches: ShardedBatches, step_fn: Callable[[], None], steps: int,
          forward: Optional[Callable] = None) -> dict[str, torch.Tensor]:
    """``steps`` iterations of cross-entropy training (``lowband.app.tasks.loss``: classes or a
    language model's bytes); returns the parameters."""
    forward = forward or model
    it = batches.epoch(0)
    for _ in range(steps):
        x, y = next(it)
        optimizer.zero_grad()
        tasks.loss(forward(x), y).backward()
        step_fn()
    return params_of(model)


def poisoned_steps(engine: "lowband.Engine", optimizer, it, steps: int, bad_step: int,
                   poison: Callable[[], torch.Tensor], after: Callable[[], None] = lambda: None) -> None:
    """``steps`` iterations (1-based) of cross-entropy training through ``engine``, batches from
    ``it``; at ``bad_step`` (0: never; a rank passes it only where it poisons) the loss gets
    ``poison()`` added, e.g. ``nan * p.sum()`` for a NaN in one parameter's gradient;
    ``after()`` runs after every ``engine.step()``. A NonFiniteGradientError propagates."""
    for step in range(1, steps + 1):
        x, y = next(it)
        optimizer.zero_grad()
        loss = F.cross_entropy(engine.module(x), y)
        if step == bad_step:
            loss = loss + poison()
        loss.backward()
        engine.step()
        after()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


#: how a loop treats gradients between steps: set them to None, zero them in place, or never
#: zero them (each backward accumulates into what the last step left)
ZEROING = ("none", "zeros", "never")


def zeroing_steps(engine: "lowband.Engine", model: nn.Module, optimizer, it, steps: int, zeroing: str,
                  after: Callable[[], None] = lambda: None) -> tuple[dict, dict]:
    """``steps`` iterations of training through ``engine`` (batches from ``it``), zeroing the
    gradients as ``zeroing`` says (:data:`ZEROING`); ``after()`` runs after every
    ``engine.step()``. Returns ``model``'s parameters and last gradients (None where a
    parameter has none)."""
    for _ in range(steps):
        x, y = next(it)
        if zeroing != "never":
            optimizer.zero_grad(set_to_none=zeroing == "none")
        tasks.loss(engine.module(x), y).backward()
        engine.step()
        after()
    return params_of(model), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_same_params_and_grads(got: tuple[dict, dict], want: tuple[dict, dict], rank: int) -> None:
    """:func:`zeroing_steps`' results equal bit for bit (a gradient None in both or in neither)."""
    (params, grads), (ref_params, ref_grads) = got, want
    for name in ref_params:
        assert torch.equal(params[name], ref_params[name]), (rank, name)
        assert (grads[name] is None) == (ref_grads[name] is None), (rank, name)
        if grads[name] is not None:
            assert torch.equal(grads[name], ref_grads[name]), (rank, name)


def run_algorithm(rank: int, world: int, algorithm: str, options: dict[str, Any], steps: int,
                  kind: str = "sgd", bn: bool = False) -> tuple[dict[str, torch.Tensor], "lowband.Engine"]:
    """Train a seeded SmallNet with a lowband algorithm on this rank; synchronize at the end."""
    torch.manual_seed(0)
    model = SmallNet(bn)
    opt = make_optimizer(kind, model)
    engine = lowband.distribute(model, opt, algorithm, **options)
    train(model, opt, batches(rank, world), engine.step, steps, forward=engine.module)
    engine.synchronize()
    return params_of(model), engine


def max_rel_err(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)
