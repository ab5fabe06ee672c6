"""The engine's step counter (``EngineContext.steps``), the algorithms' clock: during a step it
is that step's 0-based index; ``step()`` advances it once, a step skipped for a non-finite
gradient included; ``rebuild()`` carries it over and the engine's state saves and restores it;
it always equals the statistics' ``steps``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import lowband

from .distributed import run_distributed
from .training import SmallNet, batches, make_optimizer

STEPS = 5
SKIPPED = 2          # this step's loss is NaN on rank 1: skipped on every rank


def _clock(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, "lazy", nonfinite="skip", lazy_layers=1)
    data = batches(rank, world).epoch(0)
    during, applied = [], []
    for t in range(STEPS):
        x, y = next(data)
        opt.zero_grad()
        loss = F.cross_entropy(engine.module(x), y)
        if t == SKIPPED and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        during.append(engine.ctx.steps)
        applied.append(engine.step())
    out = {"during": during, "applied": applied, "after": engine.ctx.steps, "stats": engine.stats.steps}
    engine.rebuild()
    out["rebuilt"] = engine.ctx.steps
    state = engine.state_dict()
    engine.close()
    again = lowband.distribute(model, opt, "lazy", nonfinite="skip", lazy_layers=1)
    out["fresh"] = again.ctx.steps
    again.load_state_dict(state)
    out["restored"] = again.ctx.steps
    again.close()
    return out


def test_the_engine_clock_counts_steps_and_survives_rebuild_and_resume():
    for out in run_distributed(_clock, 2):
        assert out["during"] == list(range(STEPS)), out
        assert out["applied"] == [t != SKIPPED for t in range(STEPS)], out
        assert out["after"] == out["stats"] == STEPS and out["rebuilt"] == STEPS, out
        assert (out["fresh"], out["restored"]) == (0, STEPS), out
