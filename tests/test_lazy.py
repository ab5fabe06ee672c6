"""Lazy update: the interval rule, and the multi-process algorithm against a slow simulation."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import lowband
from lowband.algorithms.lazy import input_side_layers, interval_update, vote_update
from lowband.data import ShardedBatches, make_synthetic
from lowband.models import ResNet20

from .distributed import run_distributed
from .test_ssgd import SmallNet, max_rel_err

STEPS = 24
LOCAL_BATCH = 8


def test_interval_rule_cases():
    g = torch.tensor([1.0, 0.0])
    # tau = 1: A == g, both tests hold with equality -> grows
    assert interval_update(g, g.clone(), 1, 1)[0] == 2
    # aligned accumulation over 3 steps -> grows
    assert interval_update(g, 3 * g, 3, 2) == (3, True, True)
    # latest opposes the accumulation, which is small -> shrinks, never below 1
    assert interval_update(g, torch.tensor([-1.5, 0.0]), 3, 2)[0] == 1
    assert interval_update(g, torch.tensor([-1.0, 0.0]), 3, 1)[0] == 1
    # orthogonal history of equal norm: angle ok, magnitude ok iff |A|^2 >= n|g|^2
    acc = g + torch.tensor([0.0, 1.0])           # A_prev orthogonal to g, |A|^2 = 2
    assert interval_update(g, acc, 2, 4) == (5, True, True)
    assert interval_update(g, acc, 3, 4) == (4, True, False)   # mixed -> unchanged
    # invariant under common scaling
    for s in (1e-6, 1e6):
        assert interval_update(s * g, s * acc, 3, 4)[0] == 4


def test_vote_rule():
    g, bad = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])
    assert vote_update([g, g], [2 * g, 2 * g], 3)[0] == 4
    assert vote_update([g, g, g], [2 * g, bad, bad], 3)[0] == 2
    assert vote_update([g, g], [2 * g, bad], 3)[0] == 3


def test_input_side_layers_of_resnet20_skip_norms():
    names = [n for n, _ in input_side_layers(ResNet20())]
    assert names[:3] == ["conv1", "layers.0.conv1", "layers.0.conv2"]
    assert not any("bn" in n for n in names) and names[-1] == "fc"


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def batches(rank, world):
    return ShardedBatches(make_synthetic(1024, seed=1), LOCAL_BATCH, rank, world, seed=3)


def _run(rank: int, world: int, options: dict):
    torch.manual_seed(0)
    model = SmallNet()
    opt = sgd(model)
    engine = lowband.distribute(model, opt, "lazy", **options)
    it = batches(rank, world).epoch(0)
    for _ in range(STEPS):
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(engine.module(x), y).backward()
        engine.step()
    engine.synchronize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, list(engine.algorithm.history)


def _ssgd(rank: int, world: int):
    torch.manual_seed(0)
    model = SmallNet()
    opt = sgd(model)
    engine = lowband.distribute(model, opt, "ssgd")
    it = batches(rank, world).epoch(0)
    for _ in range(STEPS):
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(engine.module(x), y).backward()
        engine.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def simulate(world: int, lazy_names: list[str], variant: str):
    """B.2.3 written out for N simulated workers: lazy parameters accumulate per worker, every
    tau steps the global sums are applied in one optimizer step, tau adapts from the probe."""
    torch.manual_seed(0)
    model = SmallNet()
    opt = sgd(model)
    named = dict(model.named_parameters())
    workers = [copy.deepcopy(model) for _ in range(world)]
    iters = [batches(r, world).epoch(0) for r in range(world)]
    acc = {n: torch.zeros_like(p) for n, p in named.items() if n in lazy_names}
    tau, n_acc, history = 1, 0, []
    layers = sorted({n.rsplit(".", 1)[0] for n in lazy_names}, key=lambda l: list(named).index(l + ".weight"))
    for t in range(STEPS):
        for w in workers:
            w.load_state_dict(model.state_dict())
        grads = []
        for r, w in enumerate(workers):
            x, y = next(iters[r])
            w.zero_grad()
            F.cross_entropy(w(x), y).backward()
            grads.append({n: p.grad.clone() for n, p in w.named_parameters()})
        mean = {n: sum(g[n] for g in grads) / world for n in named}
        for n in acc:
            acc[n] += mean[n]
        n_acc += 1
        sync = n_acc >= tau
        for n, p in named.items():
            p.grad = None if n in acc else mean[n]
        if sync:
            for n in acc:
                named[n].grad = acc[n].clone()
            if variant == "probe":
                probe = layers[-1]
                keys = [k for k in lazy_names if k.startswith(probe + ".")]
                tau, _, _ = interval_update(torch.cat([mean[k].reshape(-1) for k in keys]),
                                            torch.cat([acc[k].reshape(-1) for k in keys]), n_acc, tau)
            else:
                gs = [torch.cat([mean[k].reshape(-1) for k in lazy_names if k.startswith(l + ".")]) for l in layers]
                accs = [torch.cat([acc[k].reshape(-1) for k in lazy_names if k.startswith(l + ".")]) for l in layers]
                tau, _ = vote_update(gs, accs, tau)
            for n in acc:
                acc[n].zero_()
            n_acc = 0
            history.append((t + 1, tau))
        opt.step()
    return {n: p.detach().clone() for n, p in named.items()}, history


@pytest.mark.parametrize("variant, lazy_layers, lazy_names", [
    ("probe", 1, ["conv.weight", "conv.bias"]),
    ("vote", 2, ["conv.weight", "conv.bias", "fc1.weight", "fc1.bias"]),
])
def test_lazy_matches_simulation(variant, lazy_layers, lazy_names):
    results = run_distributed(_run, 2, {"lazy_layers": lazy_layers, "variant": variant})
    reference, ref_history = simulate(2, lazy_names, variant)
    for params, history in results:
        assert history == ref_history
        assert max_rel_err(params, reference) <= 1e-5
    assert max(tau for _, tau in ref_history) >= 2        # the interval really adapted
    assert len(ref_history) < STEPS                        # and syncs were skipped
    assert max_rel_err(results[0][0], results[1][0]) == 0.0


def _zero_lazy_and_ssgd(rank, world):
    return _run(rank, world, {"lazy_layers": 0})[0], _ssgd(rank, world)


def test_no_lazy_layers_is_ssgd():
    for lazy, ssgd in run_distributed(_zero_lazy_and_ssgd, 2):
        assert max_rel_err(lazy, ssgd) == 0.0


def test_bad_options():
    with pytest.raises(ValueError, match="variant"):
        lowband.LazyUpdate(variant="majority")
    with pytest.raises(ValueError, match="lazy_layers"):
        lowband.LazyUpdate(lazy_layers=-1)
