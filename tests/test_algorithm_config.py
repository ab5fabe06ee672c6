"""Configuration and bound state are two objects (``Algorithm`` / ``BoundAlgorithm``).

Binding never changes an algorithm's configuration, and one configuration object bound to two
engines, one after the other, trains both exactly like the first: a counter, residual or
buffer left on the configuration would make the second run differ (or fail).
"""
from __future__ import annotations

import copy

import pytest
import torch

import lowband
from lowband.algorithms import ALGORITHMS
from lowband.algorithms.base import BoundAlgorithm

from .distributed import run_distributed
from .training import SHORT_SCHEDULES as OPTIONS
from .training import SmallNet, batches, make_optimizer, params_of, run_algorithm, train

STEPS = 8


def _names() -> list[str]:
    from lowband.algorithms.peers.diloco import torchft_unavailable
    return [n for n in ALGORITHMS if not (n in ("diloco", "streaming-diloco") and torchft_unavailable())]


def _bind_twice(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        cfg = lowband.make_algorithm(name, **OPTIONS.get(name, {}))
        before = copy.deepcopy(vars(cfg))
        runs, bound = [], []
        for _ in range(2):
            torch.manual_seed(0)
            model = SmallNet()
            opt = make_optimizer("sgd", model)
            engine = lowband.distribute(model, opt, cfg)
            assert engine.algorithm is cfg and isinstance(engine.bound, BoundAlgorithm) and engine.bound.cfg is cfg
            train(model, opt, batches(rank, world), engine.step, STEPS, forward=engine.module)
            engine.synchronize()
            runs.append(params_of(model))
            bound.append(id(engine.bound))
            engine.close()
        same = all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
        out[name] = (vars(cfg) == before, same, bound[0] != bound[1])
    return out


def test_binding_leaves_the_configuration_alone_and_one_configuration_binds_twice():
    names = _names()
    assert {"ssgd", "compressed", "cpsgd", "lazy", "noop", "ddp", "localsgd"} <= set(names)
    results = run_distributed(_bind_twice, 2, names, timeout_s=240)
    for rank, per_rank in enumerate(results):
        for name in names:
            unchanged, same, distinct = per_rank[name]
            assert unchanged, f"rank {rank}: binding {name} changed its configuration"
            assert same, f"rank {rank}: {name} trained differently the second time one configuration was bound"
            assert distinct, f"rank {rank}: {name}'s two engines share one bound object"


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_configuration_holds_only_its_knobs(name):
    """Nothing but the dataclass fields lives on a configuration object, after validation
    (``__post_init__``) too."""
    import dataclasses
    if name not in _names():
        pytest.skip("torchft is not installed")
    cfg = lowband.make_algorithm(name, **OPTIONS.get(name, {}))
    assert set(vars(cfg)) == {f.name for f in dataclasses.fields(cfg)}


def _warmup_flags(rank: int, world: int):
    """Per warm-up algorithm, the ``warmup`` flag each of its first 6 steps logged."""
    out = {}
    for name, options in [("compressed", {"warmup_steps": 2}), ("cpsgd", {"warmup_steps": 2}),
                          ("localsgd", {"warmup_steps": 3, "period": 2}),
                          ("ddp-powersgd", {"start_powerSGD_iter": 2})]:
        torch.manual_seed(0)
        model = SmallNet()
        opt = make_optimizer("sgd", model)
        engine = lowband.distribute(model, opt, name, **options)
        flags: list = []

        def step(engine=engine, flags=flags):
            engine.step()
            flags.append(engine.bound.step_metrics())
        train(model, opt, batches(rank, world), step, 6, forward=engine.module)
        engine.synchronize()
        engine.close()
        out[name] = flags
    return out


def test_every_warm_up_algorithm_logs_which_steps_were_warm_up():
    """steps.jsonl must tell the warm-up (fp32 / synchronous) steps from the rest for every
    algorithm that has one, so that a reader can leave them out of a step-time median."""
    for flags in run_distributed(_warmup_flags, 2, timeout_s=180):
        assert [m["warmup"] for m in flags["compressed"]] == [True, True, False, False, False, False]
        assert [m["warmup"] for m in flags["cpsgd"]] == [True, True, False, False, False, False]
        assert [m["warmup"] for m in flags["localsgd"]] == [True, True, True, False, False, False]
        assert [m["warmup"] for m in flags["ddp-powersgd"]] == [True, True, False, False, False, False]
        # averages at steps 3 and 5 (period 2 from the end of the warm-up)
        assert [m["averaged"] for m in flags["localsgd"]] == [False, False, False, True, False, True]


def _with_and_without_guard(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        runs = []
        for policy in ("raise", "off"):
            params, engine = run_algorithm(rank, world, name, {**OPTIONS.get(name, {}), "nonfinite": policy}, STEPS)
            engine.close()
            runs.append(params)
        out[name] = all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    return out


def test_the_finiteness_check_never_changes_the_trajectory():
    """Whether the guard decides at once, one step late (pipelines, local steps) or from the
    algorithm's own messages, a finite run with the check equals the same run without it,
    bit for bit, for every algorithm (past warm-ups, local steps and syncs: SHORT_SCHEDULES)."""
    names = _names()
    for result in run_distributed(_with_and_without_guard, 2, names, timeout_s=300):
        assert set(result) == set(names)
        assert all(result.values()), {n: same for n, same in result.items() if not same}
