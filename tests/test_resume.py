"""Every algorithm's state survives a weights-only checkpoint round trip: N steps, save,
fresh model/optimizer/engine, load, M more steps == N+M uninterrupted steps, bit for bit."""
from __future__ import annotations

import io

import torch

import lowband

from .distributed import run_distributed
from .training import SmallNet, batches, make_optimizer, params_of

FIRST, SECOND = 5, 4
#: options that make each algorithm's state matter within FIRST + SECOND steps
OPTIONS = {
    "cpsgd": {"warmup_steps": 2, "correction_period": 3},
    "ddp-powersgd": {"start_powerSGD_iter": 2},
    "localsgd": {"warmup_steps": 1, "period": 3},
}


def _roundtrip(rank: int, world: int, algorithm: str) -> bool:
    def fresh():
        torch.manual_seed(0)
        model = SmallNet()
        opt = make_optimizer("sgd", model)
        return model, opt, lowband.distribute(model, opt, algorithm, **OPTIONS.get(algorithm, {}))

    data = batches(rank, world)
    model, opt, engine = fresh()
    it = data.epoch(0)

    def steps(m, o, e, n):
        for _ in range(n):
            x, y = next(it)
            o.zero_grad()
            torch.nn.functional.cross_entropy(e.module(x), y).backward()
            e.step()

    steps(model, opt, engine, FIRST)
    engine.synchronize()                       # what a checkpoint does first
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()}, buf)
    steps(model, opt, engine, SECOND)
    engine.synchronize()
    straight = params_of(model)
    engine.close()

    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    model2, opt2, engine2 = fresh()
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    engine2.load_state_dict(state["engine"])
    it = data.epoch(0)
    for _ in range(FIRST):                      # the data position
        next(it)
    steps(model2, opt2, engine2, SECOND)
    engine2.synchronize()
    resumed = params_of(model2)
    engine2.close()
    return all(torch.equal(resumed[k], straight[k]) for k in straight)


def _all(rank: int, world: int) -> dict[str, bool]:
    return {a: _roundtrip(rank, world, a) for a in sorted(lowband.ALGORITHMS)}


def test_state_roundtrip_of_every_algorithm():
    results = run_distributed(_all, 2)
    for per_rank in results:
        assert sorted(per_rank) == sorted(lowband.ALGORITHMS)
        failed = [a for a, ok in per_rank.items() if not ok]
        assert not failed, f"resumed != uninterrupted for {failed}"
