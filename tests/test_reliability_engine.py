"""Engine-level reliability (multi-process gloo, one spawn for all cases):

* evaluating a copy of the global model (``engine.global_model()``) every few steps leaves the
  training trajectory — per-step losses, final parameters, buffers, optimizer state —
  bit-identical to a run without evaluation, for every algorithm in the registry;
* that copy holds the global model (what ``synchronize()`` would install, or CP-SGD's W);
* after a run every algorithm's replicated state is identical on all ranks, and a replica
  that differs is named by ``check_replicas``;
* ``nonfinite="skip"`` stops every rank after ``max_consecutive_skips`` skips in a row;
* sparse gradients are refused at ``distribute()``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowband
from lowband.comm.agreement import ReplicaMismatchError

from .distributed import run_distributed
from .training import SHORT_SCHEDULES as OPTIONS
from .training import SmallNet, batches, make_optimizer

STEPS = 8
EVAL_EVERY = 2
SKIP_LIMIT = 2


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"opt {i} {k}"] = v.clone()
    return out


def _run(rank: int, world: int, algorithm: str, evaluate: bool) -> dict:
    torch.manual_seed(0)
    model = SmallNet(bn=True)
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, algorithm, **OPTIONS.get(algorithm, {}))
    it = batches(rank, world).epoch(0)
    probe = next(iter(batches(rank, world).epoch(1)))[0]
    losses, evals = [], []
    for step in range(1, STEPS + 1):
        x, y = next(it)
        opt.zero_grad()
        loss = F.cross_entropy(engine.module(x), y)
        loss.backward()
        engine.step()
        losses.append(loss.item())
        if evaluate and step % EVAL_EVERY == 0:
            with torch.no_grad():
                evals.append(engine.global_model()(probe).sum().item())
    trajectory = _state(model, opt)
    try:
        engine.check_replicas()                    # identical replicated state on every rank
        mismatch = None
    except ReplicaMismatchError as e:
        mismatch = str(e)
    gm = engine.global_model()
    cp_global = getattr(engine.bound, "global_weights", None)
    cp_global = None if cp_global is None else [w.clone() for w in cp_global]
    engine.synchronize()
    # read after synchronize: with a pipelined step in flight the byte count depends on how far
    # the background queue got (an evaluation waits for it), not on the trajectory
    bytes_sent = engine.stats.bytes_sent
    synced = {n: p.detach().clone() for n, p in model.named_parameters()}
    synced.update({n: b.clone() for n, b in model.named_buffers()})
    global_copy = {n: p.detach().clone() for n, p in gm.named_parameters()}
    global_copy.update({n: b.clone() for n, b in gm.named_buffers()})
    engine.close()
    return {"losses": losses, "state": trajectory, "bytes": bytes_sent, "evals": evals,
            "global": global_copy, "synced": synced, "cpsgd_W": cp_global, "mismatch": mismatch}


def _replica_mismatch(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, "ssgd")
    if rank == 1:
        with torch.no_grad():
            model.fc1.bias[3] += 1e-6
    try:
        engine.check_replicas()
        return "no error"
    except ReplicaMismatchError as e:
        return str(e)
    finally:
        engine.close()


def _skip_limit(rank: int, world: int) -> dict:
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = lowband.distribute(model, opt, "ssgd", nonfinite="skip", max_consecutive_skips=SKIP_LIMIT)
    it = batches(rank, world).epoch(0)
    applied = []
    for step in range(1, 10):
        x, y = next(it)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if step == 2 or step >= 4:                        # one isolated bad step, then nothing but
            loss = loss * float("nan")
        loss.backward()
        try:
            applied.append(engine.step())
        except lowband.NonFiniteGradientError as e:
            return {"applied": applied, "step": e.step, "error": str(e)}
    return {"applied": applied}


def _sparse(rank: int, world: int) -> str:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    try:
        lowband.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "ssgd")
        return "accepted"
    except ValueError as e:
        return str(e)


def _everything(rank: int, world: int) -> dict:
    out = {a: {"eval": _run(rank, world, a, True), "plain": _run(rank, world, a, False)}
           for a in sorted(lowband.ALGORITHMS)}
    out["_mismatch"] = _replica_mismatch(rank, world)
    out["_skip"] = _skip_limit(rank, world)
    out["_sparse"] = _sparse(rank, world)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_everything, 2, timeout_s=240.0)


@pytest.mark.parametrize("algorithm", sorted(lowband.ALGORITHMS))
def test_evaluation_leaves_the_trajectory_bit_identical(results, algorithm):
    for rank, r in enumerate(results):
        with_eval, plain = r[algorithm]["eval"], r[algorithm]["plain"]
        assert len(with_eval["evals"]) == STEPS // EVAL_EVERY
        assert with_eval["losses"] == plain["losses"], f"rank {rank}: per-step losses differ"
        assert with_eval["state"].keys() == plain["state"].keys()
        for key, value in plain["state"].items():
            assert torch.equal(with_eval["state"][key], value), f"rank {rank}: {key} differs"
        # evaluation traffic is counted apart (engine.aux_stats), not as the algorithm's
        assert with_eval["bytes"] == plain["bytes"]


@pytest.mark.parametrize("algorithm", sorted(lowband.ALGORITHMS))
def test_global_model_holds_the_global_weights(results, algorithm):
    """Identical on every rank, and equal to what synchronize() then installs (for CP-SGD
    mid-pipeline: its global weights W, which synchronize() would first advance by the step
    in flight)."""
    first = results[0][algorithm]["plain"]["global"]
    for r in results:
        run = r[algorithm]["plain"]
        for name, value in run["global"].items():
            assert torch.equal(value, first[name]), f"{name} differs between ranks"
        if run["cpsgd_W"] is not None:
            params = [n for n, _ in SmallNet(bn=True).named_parameters()]
            for name, w in zip(params, run["cpsgd_W"]):
                assert torch.equal(run["global"][name], w), f"{name} is not CP-SGD's global weight W"
        else:
            for name, value in run["synced"].items():
                assert torch.equal(run["global"][name], value), f"{name} differs from the synchronized model"


@pytest.mark.parametrize("algorithm", sorted(lowband.ALGORITHMS))
def test_replicated_state_is_identical_on_every_rank(results, algorithm):
    """What ``check_replicas`` verifies after a resume holds after ordinary training (for
    CP-SGD mid-pipeline: the global weights W, via ``global_parameters()``)."""
    for r in results:
        assert r[algorithm]["plain"]["mismatch"] is None
        assert r[algorithm]["eval"]["mismatch"] is None


def test_a_differing_replica_is_named_on_every_rank(results):
    messages = {r["_mismatch"] for r in results}
    assert len(messages) == 1
    message = messages.pop()
    assert message.startswith("ranks hold different values of parameter 'fc1.bias': digest "), message
    assert "on rank 0; digest" in message and message.endswith("on rank 1")


def test_skip_limit_stops_every_rank(results):
    for r in results:
        s = r["_skip"]
        # step 2 alone is skipped and forgotten; from step 4 on, SKIP_LIMIT skips, then the error
        assert s["applied"] == [True, False, True] + [False] * SKIP_LIMIT
        assert s["step"] == 4 + SKIP_LIMIT
        assert f"the {SKIP_LIMIT} steps before it were skipped for the same reason" in s["error"]
        assert "--max-skips" in s["error"]


def test_sparse_gradients_are_refused_at_distribute(results):
    for r in results:
        assert r["_sparse"].startswith("module '0' (Embedding(sparse=True)) produces sparse gradients"), r["_sparse"]
