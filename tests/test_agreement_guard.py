"""Engine-level reliability: rank agreement at distribute() and the non-finite gradient policy
(multi-process, gloo)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowband
from lowband.algorithms import Finiteness
from lowband.comm.agreement import describe_difference
from lowband.app.data import ShardedBatches, make_synthetic

from .distributed import run_distributed
from .training import poisoned_steps

#: a mismatch must be reported well before any collective timeout (run_distributed uses 90 s)
MISMATCH_DEADLINE_S = 10.0


def _mismatch(rank: int, world: int, kind: str):
    torch.manual_seed(0)
    width = 8 + rank if kind == "model" and rank == world - 1 else 8
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bucket_mb = 1.0 + rank if kind == "algorithm" and rank == 1 else 1.0
    t0 = time.monotonic()
    try:
        lowband.distribute(model, opt, "ssgd", bucket_mb=bucket_mb, nonfinite="ignore" if kind == "policy" else "raise")
    except (lowband.ConfigMismatchError, ValueError) as e:
        return str(e), getattr(e, "field", None), time.monotonic() - t0
    return None, None, time.monotonic() - t0


def _mismatches(rank: int, world: int) -> dict:
    # one spawn for all cases: a failed agreement leaves every rank at the same collective count
    return {kind: _mismatch(rank, world, kind) for kind in ("algorithm", "model", "policy")}


@pytest.fixture(scope="module")
def mismatch_results() -> list[dict]:
    return run_distributed(_mismatches, 3)


@pytest.mark.parametrize("kind, field, needle", [
    ("algorithm", "algorithm", "ranks disagree on 'algorithm': ['bucket_mb'] is 1.0 on ranks 0,2; 2.0 on rank 1"),
    ("model", "parameters", "ranks disagree on 'parameters': ['0.weight'] is [[8, 4], \"torch.float32\"] on ranks 0,1; "
                            "[[10, 4], \"torch.float32\"] on rank 2"),
    ("policy", None, "nonfinite must be one of raise, skip, off, got 'ignore'"),
])
def test_mismatched_ranks_all_raise_the_same_clear_error(mismatch_results, kind, field, needle):
    results = [r[kind] for r in mismatch_results]
    messages = {r[0] for r in results}
    assert len(messages) == 1, messages                      # every rank, the same message
    assert messages.pop() == needle
    assert all(r[1] == field for r in results)
    assert max(r[2] for r in results) < MISMATCH_DEADLINE_S


def test_describe_difference_names_the_first_differing_entry():
    assert describe_difference([[1, 2, 3], [1, 5, 3]]) == "entry #1 is 2 on rank 0; 5 on rank 1"
    assert describe_difference([{"a": 1}, {"a": 1, "b": 2}]) == "['b'] is \"<absent>\" on rank 0; 2 on rank 1"


STEPS = 6
BAD_STEP = 3          # 1-based engine step at which one rank's gradient goes NaN
BAD_RANK = 1
BATCH = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))


def _nan_run(rank: int, world: int, policy: str, inject: bool, algorithm=None):
    """STEPS steps with SGD+momentum; with ``inject``, rank BAD_RANK's loss is NaN at BAD_STEP.
    Without it, the batch of BAD_STEP is left out altogether (the "never happened" reference)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    engine = lowband.distribute(model, opt, algorithm or lowband.SSGD(bucket_mb=0.01), nonfinite=policy)
    it = ShardedBatches(make_synthetic(512, seed=1), BATCH, rank, world, seed=3).epoch(0)
    applied = []
    for step in range(1, STEPS + 1):
        x, y = next(it)
        if step == BAD_STEP and not inject:
            continue
        opt.zero_grad()
        loss = F.cross_entropy(engine.module(x), y)
        if step == BAD_STEP and rank == BAD_RANK:
            loss = loss + float("nan") * model[3].bias.sum()    # NaN in that one gradient only
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            applied.append(engine.step())
        except lowband.NonFiniteGradientError as e:
            unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
            return {"error": str(e), "step": e.step, "bad": e.bad, "unchanged": unchanged,
                    "guard_calls": engine.guard.comm.stats.calls}
    engine.synchronize()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "applied": applied, "skipped": engine.stats.skipped_steps}


def _nan_runs(rank: int, world: int) -> dict:
    compressed = {c: lowband.CompressedSGD(warmup_steps=1, bucket_mb=0.01, collective=c)
                  for c in ("allgather", "two-stage")}
    return {"raise": _nan_run(rank, world, "raise", True), "skip": _nan_run(rank, world, "skip", True),
            "reference": _nan_run(rank, world, "skip", False),
            **{f"raise, compressed {c}": _nan_run(rank, world, "raise", True, a) for c, a in compressed.items()},
            "skip, compressed": _nan_run(rank, world, "skip", True, compressed["allgather"]),
            "off, compressed": _nan_run(rank, world, "off", False, compressed["allgather"]),
            "skip, cpsgd": _nan_run(rank, world, "skip", True, lowband.CPSGD(warmup_steps=1, bucket_mb=0.01)),
            "off, cpsgd": _nan_run(rank, world, "off", False, lowband.CPSGD(warmup_steps=1, bucket_mb=0.01))}


@pytest.fixture(scope="module")
def nan_results() -> list[dict]:
    return run_distributed(_nan_runs, 3)


def test_nonfinite_raise_stops_every_rank_naming_step_rank_parameter(nan_results):
    for r in (n["raise"] for n in nan_results):
        assert r["step"] == BAD_STEP and r["bad"] == {BAD_RANK: "3.bias"}
        assert r["error"].startswith(f"non-finite gradient at step {BAD_STEP} on rank {BAD_RANK} "
                                     "(first parameter '3.bias')"), r["error"]
        assert r["unchanged"]        # the optimizer never applied the poisoned step


def test_compressed_carries_the_check_in_its_buckets(nan_results):
    """Past its warm-up `compressed` marks bad segments in its buckets' flag bytes: the same
    error at the same step, parameters unchanged, and the guard exchanged only in the warm-up."""
    for n in nan_results:
        for c in ("allgather", "two-stage"):
            r = n[f"raise, compressed {c}"]
            assert r["step"] == BAD_STEP and r["bad"] == {BAD_RANK: "3.bias"}, (c, r)
            assert r["error"].startswith(f"non-finite gradient at step {BAD_STEP} on rank {BAD_RANK} "), r["error"]
            assert r["unchanged"]
            assert r["guard_calls"] == 1, (c, r["guard_calls"])     # the warm-up step's exchange only


def test_the_carried_check_stays_out_of_the_other_policies(nan_results):
    """Under "skip" and "off" the compressing algorithms carry nothing: past their warm-up
    "skip" drops the bad step through the guard's own exchange, and "off" just trains."""
    for n in nan_results:
        for alg in ("compressed", "cpsgd"):
            skip, off = n[f"skip, {alg}"], n[f"off, {alg}"]
            assert "error" not in skip and skip["skipped"] == 1, (alg, skip.get("error"))
            assert skip["applied"] == [True, True, False, True, True, True]
            assert "error" not in off and off["skipped"] == 0, (alg, off.get("error"))


def test_nonfinite_skip_equals_a_run_without_that_step(nan_results):
    first = nan_results[0]["skip"]["params"]
    for n in nan_results:
        r, ref = n["skip"], n["reference"]
        assert r["skipped"] == 1 and r["applied"] == [True, True, False, True, True, True]
        assert ref["skipped"] == 0
        for name, p in ref["params"].items():
            assert torch.equal(r["params"][name], p), name           # bit-exact
            assert torch.equal(r["params"][name], first[name]), name  # ranks identical


PIPE_WARMUP = 2       # cpsgd's warm-up: steps 1-2 synchronous, then pipelined (deferred check)


def _pipelined_nan_run(rank: int, world: int, bad_step: int, steps: int, collective: str = "auto",
                       bad_param: str = "3.bias"):
    """cpsgd past its warm-up with rank BAD_RANK's gradient NaN at ``bad_step``: the deferred
    finiteness decision must still stop every rank, naming that step, before its average
    touches the global weights W. Past the warm-up the check rides on the buckets' flag
    bytes: the guard's own exchange must not run there."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = lowband.distribute(model, opt, "cpsgd", warmup_steps=PIPE_WARMUP, bucket_mb=0.01, collective=collective)
    bad = dict(model.named_parameters())[bad_param]
    it = ShardedBatches(make_synthetic(512, seed=1), BATCH, rank, world, seed=3).epoch(0)
    deferred, guard_calls = [], []

    def after():
        deferred.append(engine.guard.pending)
        guard_calls.append(engine.guard.comm.stats.calls)
    try:
        poisoned_steps(engine, opt, it, steps, bad_step if rank == BAD_RANK else 0, lambda: float("nan") * bad.sum(), after)
        engine.synchronize()
    except lowband.NonFiniteGradientError as e:
        W = engine.bound.W
        return {"step": e.step, "bad": e.bad, "raised_at": len(deferred) + 1, "deferred": deferred,
                "global_finite": all(bool(torch.isfinite(w).all()) for w in W),
                "carried": engine.bound.checks_finite, "guard_calls": guard_calls}
    return {"no error": True}


def _pipelined_nan_runs(rank: int, world: int) -> dict:
    return {"middle": _pipelined_nan_run(rank, world, bad_step=5, steps=8),
            "last": _pipelined_nan_run(rank, world, bad_step=8, steps=8),
            "weight, two-stage": _pipelined_nan_run(rank, world, bad_step=5, steps=8, collective="two-stage",
                                                    bad_param="1.weight")}


def test_nonfinite_raise_under_a_pipeline_is_decided_one_step_late_on_every_rank():
    for n in run_distributed(_pipelined_nan_runs, 2):
        middle, last = n["middle"], n["last"]
        assert middle["step"] == 5 and middle["bad"] == {BAD_RANK: "3.bias"}
        assert middle["raised_at"] == 6                   # at the next engine.step()
        assert middle["deferred"] == [False, False, True, True, True]   # warm-up steps decide at once
        assert middle["global_finite"]                     # W never received the NaN average
        assert last["step"] == 8 and last["raised_at"] == 9   # the last step: at synchronize()
        assert last["global_finite"]
        weight = n["weight, two-stage"]
        assert weight["step"] == 5 and weight["bad"] == {BAD_RANK: "1.weight"} and weight["raised_at"] == 6
        assert weight["global_finite"]
        for run in (middle, last, weight):   # carried by the buckets: the guard exchanged only in the warm-up
            assert run["carried"] and run["guard_calls"][PIPE_WARMUP - 1:] == [PIPE_WARMUP] * len(run["guard_calls"][PIPE_WARMUP - 1:])


class _ForgetfulCarrier(lowband.SSGD):
    """Claims to carry the finiteness check in a synchronous step but never reports it."""

    def bind(self, ctx):
        bound = super().bind(ctx)
        bound.finiteness = lambda: Finiteness.CARRIED
        return bound


def _forgetful_run(rank: int, world: int) -> str:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = lowband.distribute(model, opt, _ForgetfulCarrier(bucket_mb=0.01))
    x, y = next(ShardedBatches(make_synthetic(64, seed=1), BATCH, rank, world, seed=3).epoch(0))
    F.cross_entropy(engine.module(x), y).backward()
    try:
        engine.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_carried_check_that_is_never_reported_is_an_error_not_a_silent_pass():
    for message in run_distributed(_forgetful_run, 2):
        assert "never called ctx.decide_finiteness" in message, message


def _local_nan_run(rank: int, world: int, bad_step: int, steps: int = 8):
    """localsgd (warm-up 2, an average after steps 3, 5 and 7) with rank BAD_RANK's
    gradient NaN at ``bad_step``: local steps defer the finiteness decision to the next
    ``engine.step()`` (no per-step barrier), steps that average or all-reduce decide at once;
    either way every rank stops naming that step before the NaN reaches another rank."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = lowband.distribute(model, opt, "localsgd", warmup_steps=2, period=2)
    bad = dict(model.named_parameters())["3.bias"]
    it = ShardedBatches(make_synthetic(512, seed=1), BATCH, rank, world, seed=3).epoch(0)
    deferred = []
    try:
        poisoned_steps(engine, opt, it, steps, bad_step if rank == BAD_RANK else 0, lambda: float("nan") * bad.sum(),
                       lambda: deferred.append(engine.guard.pending))
        engine.synchronize()
    except lowband.NonFiniteGradientError as e:
        return {"step": e.step, "bad": e.bad, "raised_at": len(deferred) + 1, "deferred": deferred,
                "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
    return {"no error": True, "deferred": deferred}


def _local_nan_runs(rank: int, world: int) -> dict:
    return {"local": _local_nan_run(rank, world, bad_step=4), "averaging": _local_nan_run(rank, world, bad_step=3),
            "last": _local_nan_run(rank, world, bad_step=8), "clean": _local_nan_run(rank, world, bad_step=0)}


def test_local_sgd_defers_the_check_on_local_steps_only():
    for rank, n in enumerate(run_distributed(_local_nan_runs, 2)):
        # steps 1-2 warm-up, 3, 5, 7 end with an average: only 4, 6, 8 are local
        assert n["clean"] == {"no error": True,
                              "deferred": [False, False, False, True, False, True, False, True]}
        local, averaging, last = n["local"], n["averaging"], n["last"]
        assert local["step"] == 4 and local["bad"] == {BAD_RANK: "3.bias"} and local["raised_at"] == 5
        # the step-5 average never ran: only the bad rank's own replica took the NaN step
        assert local["finite"] == (rank != BAD_RANK)
        assert averaging["step"] == 3 and averaging["raised_at"] == 3 and averaging["finite"]   # decided at once
        assert last["step"] == 8 and last["raised_at"] == 9                 # the last step: at synchronize()
