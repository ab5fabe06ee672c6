"""Parameters used on some ranks only (every algorithm but the torchft peers, whose
lighthouse makes a run too slow for this), and the compressed algorithms on a sub-group (gloo).

A parameter that only rank 0 uses makes the ranks' gradient sets differ: every collective
must still be issued in the same order with the same sizes on every rank (warm-up included),
the parameter must receive rank 0's share, and a parameter no rank uses must keep
``grad = None`` and not move."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lowband

from .distributed import run_distributed
from .training import SmallNet, batches, make_optimizer

STEPS = 6          # warm-up (2) plus compressed steps
CASES = [("compressed", {"warmup_steps": 2, "collective": "two-stage"}),
         ("compressed", {"warmup_steps": 2, "collective": "allgather", "compressor": "1bit"}),
         ("compressed", {"warmup_steps": 2, "compress_vectors": True}),
         ("ssgd", {}),
         # every other algorithm, each past its own warm-up within STEPS
         ("cpsgd", {"warmup_steps": 2}),
         ("cpsgd", {"warmup_steps": 2, "correction": "burst", "correction_period": 2, "bucket_mb": 0.01}),
         ("lazy", {}),
         ("localsgd", {"warmup_steps": 2, "period": 2}),
         ("ddp", {"find_unused_parameters": True}),      # PyTorch's requirement for such models
         ("ddp-fp16", {"find_unused_parameters": True}),   # ddp-powersgd refuses it (test below)
         ("noop", {})]


class UnevenNet(SmallNet):
    """SmallNet plus a head (weight and bias) only rank 0 uses and a layer nobody uses."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.rank0_head = nn.Linear(32, 10)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        h = F.relu(self.fc1(F.relu(self.conv(x)).flatten(1)))
        out = self.fc2(h)
        return out + self.rank0_head(h) if self.rank == 0 else out


def _train(rank: int, world: int, algorithm: str, options: dict, group=None):
    torch.manual_seed(0)
    model = UnevenNet(rank)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, algorithm, process_group=group, **options)
    it = batches(rank, world).epoch(0)
    for _ in range(STEPS):
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(engine.module(x), y).backward()
        engine.step()
    engine.synchronize()
    grads_none = [n for n, p in model.named_parameters() if p.grad is None]
    moved = {n: not torch.equal(p.detach(), start[n]) for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return params, grads_none, moved


def _uneven(rank: int, world: int):
    return [_train(rank, world, name, opts) for name, opts in CASES]


def _subgroup(rank: int, world: int):
    members = [0, 2]
    sub = dist.new_group(members)
    if rank not in members:
        return None
    sub_rank, sub_world = dist.get_rank(sub), dist.get_world_size(sub)
    return [_train(sub_rank, sub_world, name, opts, group=sub) for name, opts in CASES[:2]]


@functools.lru_cache(maxsize=None)
def _uneven_results():
    return run_distributed(_uneven, 2, timeout_s=420)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parameter_used_on_some_ranks_only(case):
    results = [r[case] for r in _uneven_results()]
    (p0, none0, moved0), (p1, none1, moved1) = results
    for n in p0:   # every rank holds the same model
        assert torch.equal(p0[n], p1[n]), n
    assert moved0["rank0_head.weight"] and moved0["rank0_head.bias"]     # rank 0's share arrived
    assert not moved0["unused.weight"] and not moved0["unused.bias"]     # nobody's gradient: no move
    assert {"unused.weight", "unused.bias"} <= set(none0) and {"unused.weight", "unused.bias"} <= set(none1)


def test_compressed_algorithms_on_a_subgroup():
    results = run_distributed(_subgroup, 3, timeout_s=420)
    assert results[1] is None
    for (pa, _, moved), (pb, _, _) in zip(results[0], results[2]):
        for n in pa:
            assert torch.equal(pa[n], pb[n]), n
        assert moved["fc1.weight"]


def test_ddp_powersgd_refuses_find_unused_parameters():
    """PyTorch's powerSGD_hook with find_unused_parameters=True aborts gloo at its first
    compressed step (plain DDP too, docs/peers.md): refused up front with one line."""
    with pytest.raises(ValueError, match="find_unused_parameters=True is not supported"):
        lowband.algorithms.make_algorithm("ddp-powersgd", find_unused_parameters=True)
