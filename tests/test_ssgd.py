"""S-SGD equals single-process large-batch SGD and PyTorch DDP (multi-process, gloo)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lowband

from .distributed import run_distributed
from .training import LOCAL_BATCH, SmallNet, batches, make_optimizer, max_rel_err, run_algorithm, train

STEPS = 20


def _reference(world: int, kind: str):
    torch.manual_seed(0)
    model = SmallNet(bn=False)
    opt = make_optimizer(kind, model)
    return train(model, opt, batches(0, 1, LOCAL_BATCH * world), opt.step, STEPS)


def _lowband(rank: int, world: int, kind: str, bucket_mb: float, bn: bool):
    params, engine = run_algorithm(rank, world, "ssgd", {"bucket_mb": bucket_mb}, STEPS, kind, bn)
    assert engine.stats.steps == STEPS and engine.stats.bytes_sent > 0
    return params


def _ddp(rank: int, world: int, kind: str, bn: bool):
    torch.manual_seed(0)
    model = SmallNet(bn)
    opt = make_optimizer(kind, model)
    ddp = nn.parallel.DistributedDataParallel(model)
    return train(model, opt, batches(rank, world), opt.step, STEPS, forward=ddp)


def _lowband_and_ddp(rank: int, world: int, kind: str, bucket_mb: float):
    return (_lowband(rank, world, kind, bucket_mb, bn=False), _lowband(rank, world, kind, bucket_mb, bn=True),
            _ddp(rank, world, kind, bn=True))


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
