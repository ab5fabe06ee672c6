"""Every algorithm's state survives a weights-only checkpoint round trip: N steps, save,
fresh model/optimizer/engine, load, M more steps == N+M uninterrupted steps, bit for bit."""
from __future__ import annotations

import io
from typing import Optional

import pytest
import torch

import lowband
from lowband.app import tasks

from .distributed import run_distributed
from .training import SmallNet, batches, make_optimizer, params_of

FIRST, SECOND = 5, 4
#: options that make each algorithm's state matter within FIRST + SECOND steps (the compressing
#: and pipelined algorithms leave their warm-up well before the checkpoint)
OPTIONS = {
    "compressed": {"warmup_steps": 2},
    "cpsgd": {"warmup_steps": 2, "correction_period": 3},
    "ddp-powersgd": {"start_powerSGD_iter": 2},
    "localsgd": {"warmup_steps": 1, "period": 3},
    # rounds end at steps 2 and 4: saved mid-round with round 1's message in flight
    "cp-diloco": {"sync_every": 2, "correction_every": 3},
}
#: registry algorithms without checkpoint support (torchft keeps their outer state itself)
NO_CHECKPOINTS = {"diloco", "streaming-diloco"}
#: further configurations whose pipeline state differs (name -> algorithm, options)
VARIANTS = {
    "cpsgd/burst-flush": ("cpsgd", {"warmup_steps": 2, "correction": "burst", "correction_period": 2,
                                    "flush_residual_on_correction": True, "local_update": "sgd"}),
    # round 0 ends at step 4 with its average due after step 2 of round 1: saved in between
    "cp-diloco/apply-after": ("cp-diloco", {"sync_every": 4, "apply_after": 2, "correction_every": 2}),
    "cp-diloco/burst-blocking": ("cp-diloco", {"warmup_steps": 1, "sync_every": 2, "correction": "burst",
                                               "correction_every": 2, "blocking_correction": True}),
    "cpsgd/adaptive": ("cpsgd", {"warmup_steps": 1, "correction_period": 2, "adapt_period": True,
                                 "min_period": 1, "max_period": 3}),
    # the tied embedding's lookup part is accumulated apart (tied="split"); saved mid-window
    "lazy/tied-split": ("lazy", {"lazy_layers": 2, "tied": "split"}),
    # gpt-ngram under AdamW: its tables lazy by default, their window steps scaled; mid-window
    "lazy/ngram-adamw": ("lazy", {"bucket_mb": 0.01}),
}
#: variants trained on a language model (else SmallNet with SGD): the tied-embedding LM of
#: tests/test_lazy.py with SGD, or the small gpt-ngram of tests/test_gpt.py with AdamW. They
#: are saved inside a lazy window (checked).
LM_VARIANTS = {"lazy/tied-split": "tied", "lazy/ngram-adamw": "ngram"}


def _workload(kind: str, rank: int, world: int):
    """(model, optimizer) factory and an iterator of batches for SmallNet, ``tied`` or ``ngram``."""
    from .test_gpt import LOCAL, small_ngram_gpt, text_data
    from .test_lazy import TiedLM, _lm_batches
    from lowband.app.data import ShardedBatches

    def fresh():
        torch.manual_seed(0)
        if kind == "ngram":
            model = small_ngram_gpt()
            return model, make_optimizer("adamw", model)
        model = TiedLM() if kind == "tied" else SmallNet()
        return model, make_optimizer("sgd", model)

    def data():
        if kind == "ngram":
            return ShardedBatches(text_data(200), LOCAL, rank, world, seed=3).epoch(0)
        return _lm_batches(rank, FIRST + SECOND) if kind == "tied" else batches(rank, world).epoch(0)
    return fresh, data


def _roundtrip(rank: int, world: int, algorithm: str, options: dict, kind: str = "",
               saved_knobs: Optional[dict] = None) -> bool:
    """``saved_knobs``: knobs added to the saved algorithm configuration before it is loaded,
    as a checkpoint of an earlier version lists them."""
    make, data = _workload(kind, rank, world)

    def fresh():
        model, opt = make()
        return model, opt, lowband.distribute(model, opt, algorithm, **options)

    model, opt, engine = fresh()
    it = data()

    def steps(m, o, e, n):
        for _ in range(n):
            x, y = next(it)
            o.zero_grad()
            tasks.loss(e.module(x), y).backward()
            e.step()

    steps(model, opt, engine, FIRST)
    mid_window = not kind or engine.bound.n > 0
    buf = io.BytesIO()                         # as `lowband train` saves: no drain (cpsgd has a step in flight)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()}, buf)
    steps(model, opt, engine, SECOND)
    engine.synchronize()
    straight = params_of(model)
    engine.close()

    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    state["engine"]["algorithm_config"].update(saved_knobs or {})
    model2, opt2, engine2 = fresh()
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    engine2.load_state_dict(state["engine"])
    it = data()
    for _ in range(FIRST):                      # the data position
        next(it)
    steps(model2, opt2, engine2, SECOND)
    engine2.synchronize()
    resumed = params_of(model2)
    engine2.close()
    return mid_window and all(torch.equal(resumed[k], straight[k]) for k in straight)


def _all(rank: int, world: int) -> dict[str, bool]:
    # the torchft peers refuse checkpoints with one clear line by design (tests/test_diloco.py)
    results = {a: _roundtrip(rank, world, a, OPTIONS.get(a, {})) for a in sorted(lowband.ALGORITHMS)
               if a not in NO_CHECKPOINTS}
    results.update({v: _roundtrip(rank, world, a, o, LM_VARIANTS.get(v, "")) for v, (a, o) in VARIANTS.items()})
    return results


def test_state_roundtrip_of_every_algorithm():
    results = run_distributed(_all, 2)
    for per_rank in results:
        assert sorted(per_rank) == sorted([*(set(lowband.ALGORITHMS) - NO_CHECKPOINTS), *VARIANTS])
        failed = [a for a, ok in per_rank.items() if not ok]
        assert not failed, f"resumed != uninterrupted for {failed}"


#: knobs that checkpoints of earlier versions of ``compressed`` and ``cpsgd`` list, at the values
#: whose paths the code now always takes, and the other value of each
OLD_KNOBS = {
    "compressed": {"inline_last_bucket": (True, False), "encode_from_gradients": (True, False),
                   "gradient_as_bucket_view": (False, True)},
    "cpsgd": {"inline_last_bucket": (True, False)},
}


def _old_checkpoints(rank: int, world: int, algorithm: str) -> dict:
    knobs, options = OLD_KNOBS[algorithm], OPTIONS[algorithm]
    out = {"resumed": _roundtrip(rank, world, algorithm, options, saved_knobs={k: v for k, (v, _) in knobs.items()})}
    model, opt = _workload("", rank, world)[0]()
    engine = lowband.distribute(model, opt, algorithm, **options)
    state = engine.state_dict()
    try:
        for knob, (_, other) in knobs.items():
            saved = {**state, "algorithm_config": {**state["algorithm_config"], knob: other}}
            try:
                engine.load_state_dict(saved)
                out[knob] = "no error"
            except ValueError as e:
                out[knob] = str(e)
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("algorithm", sorted(OLD_KNOBS))
def test_a_checkpoint_listing_removed_knobs_resumes_at_the_behaviour_they_chose(algorithm):
    """An earlier version's checkpoint lists knobs this version no longer has: at the value of
    the path the code now always takes it continues the run bit for bit; at the other value
    it is refused with one line naming the knob."""
    for per_rank in run_distributed(_old_checkpoints, 2, algorithm):
        assert per_rank["resumed"] is True, "resumed != uninterrupted"
        for knob, (now, other) in OLD_KNOBS[algorithm].items():
            message = per_rank[knob]
            assert message.startswith(f"the checkpoint was written with {algorithm}'s {knob}={other!r}, a knob this "
                                      "version of lowband no longer has"), message
            assert f"it always runs as {knob}={now!r}" in message and "\n" not in message, message


def _without_added_knob(rank: int, world: int) -> dict:
    """A cp-diloco engine state as a version before ``inner_lr_scale`` wrote it (the knob
    absent from its configuration), loaded by engines at scale 1 and at the default."""
    out = {}
    for options in ({"inner_lr_scale": 1.0}, {}):
        model, opt = _workload("ngram", rank, world)[0]()
        engine = lowband.distribute(model, opt, "cp-diloco", **options)
        state = engine.state_dict()
        del state["algorithm_config"]["inner_lr_scale"]
        try:
            engine.load_state_dict(state)
            out[options.get("inner_lr_scale", "auto")] = "resumed"
        except ValueError as e:
            out[options.get("inner_lr_scale", "auto")] = str(e)
        finally:
            engine.close()
    return out


def test_a_checkpoint_from_before_an_added_knob_resumes_at_the_value_it_ran_with():
    """cp-diloco's checkpoints from before ``inner_lr_scale`` ran their Adam steps at the
    optimizer's own rate: an engine at ``inner_lr_scale=1`` continues them; one at the default
    (sqrt(2) for AdamW at 2 ranks) is refused with one line naming the knob."""
    for per_rank in run_distributed(_without_added_knob, 2):
        assert per_rank[1.0] == "resumed"
        assert per_rank["auto"] == ("the checkpoint was written by cp-diloco with inner_lr_scale=1.0 (this engine: "
                                    "'auto'); resume with the knobs that wrote it"), per_rank["auto"]
