"""S-SGD equals single-process large-batch SGD and PyTorch DDP (multi-process, gloo)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lowband
from lowband.data import ShardedBatches, make_synthetic

from .distributed import run_distributed

STEPS = 20
LOCAL_BATCH = 8


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


def make_optimizer(kind: str, model: nn.Module):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-3)


def train(model, optimizer, batches, step_fn, steps=STEPS, forward=None):
    forward = forward or model
    it = batches.epoch(0)
    for _ in range(steps):
        x, y = next(it)
        optimizer.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        step_fn()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(world: int, kind: str):
    torch.manual_seed(0)
    model = SmallNet(bn=False)
    opt = make_optimizer(kind, model)
    data = make_synthetic(1024, seed=1)
    return train(model, opt, ShardedBatches(data, LOCAL_BATCH * world, 0, 1, seed=3), opt.step)


def _lowband(rank: int, world: int, kind: str, bucket_mb: float, bn: bool):
    data = make_synthetic(1024, seed=1)
    torch.manual_seed(0)
    model = SmallNet(bn)
    opt = make_optimizer(kind, model)
    engine = lowband.distribute(model, opt, lowband.SSGD(bucket_mb=bucket_mb))
    params = train(model, opt, ShardedBatches(data, LOCAL_BATCH, rank, world, seed=3), engine.step, forward=engine.module)
    assert engine.stats.steps == STEPS and engine.stats.bytes_sent > 0
    return params


def _ddp(rank: int, world: int, kind: str, bn: bool):
    data = make_synthetic(1024, seed=1)
    torch.manual_seed(0)
    model = SmallNet(bn)
    opt = make_optimizer(kind, model)
    ddp = nn.parallel.DistributedDataParallel(model)
    return train(model, opt, ShardedBatches(data, LOCAL_BATCH, rank, world, seed=3), opt.step, forward=ddp)


def _lowband_and_ddp(rank: int, world: int, kind: str, bucket_mb: float):
    return (_lowband(rank, world, kind, bucket_mb, bn=False), _lowband(rank, world, kind, bucket_mb, bn=True),
            _ddp(rank, world, kind, bn=True))


def max_rel_err(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_ssgd_equals_large_batch_and_ddp(world, kind):
    # a small bucket cap forces several buckets, so the in-order launch is exercised too
    results = run_distributed(_lowband_and_ddp, world, kind, 0.01)
    reference = _reference(world, kind)
    for plain, with_bn, ddp_with_bn in results:
        assert max_rel_err(plain, reference) <= 1e-5
        assert max_rel_err(with_bn, ddp_with_bn) <= 1e-5
    # all ranks identical
    for plain, with_bn, _ in results[1:]:
        assert max_rel_err(plain, results[0][0]) == 0.0
        assert max_rel_err(with_bn, results[0][1]) == 0.0


class Awkward(nn.Module):
    """An unused parameter, a frozen parameter and a tied weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 16, bias=False)
        self.hidden = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.embed.weight      # tied

    def forward(self, x):
        return self.head(torch.relu(self.hidden(self.frozen(self.embed(x)))))


def _awkward(rank: int, world: int, rank_specific_unused: bool):
    torch.manual_seed(rank)   # different init per rank: distribute must broadcast rank 0's
    model = Awkward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    engine = lowband.distribute(model, opt, "ssgd", bucket_mb=0.0005)
    frozen_before = model.frozen.weight.detach().clone()
    unused_before = model.unused.weight.detach().clone()
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(5):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if rank_specific_unused and rank == 1:
            loss = loss + model.unused(x).sum() * 0.01   # only rank 1 uses it
        loss.backward()
        engine.step()
    engine.synchronize()
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.frozen.weight, frozen_before)
    if not rank_specific_unused:
        # no rank ever produced a gradient: the optimizer must skip it (no weight decay)
        assert torch.equal(model.unused.weight, unused_before)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("rank_specific_unused", [False, True])
def test_unused_frozen_tied_parameters(rank_specific_unused):
    results = run_distributed(_awkward, 3, rank_specific_unused)
    for r in results[1:]:
        for k in results[0]:
            assert torch.equal(r[k], results[0][k]), k
