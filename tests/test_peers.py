"""The peers (ddp, ddp-fp16, ddp-powersgd, localsgd): same semantics as the PyTorch code they
stand for, and bytes counted exactly (multi-process, gloo, 2 ranks)."""
from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lowband
from lowband.algorithms import make_algorithm
from lowband.app.data import ShardedBatches, make_synthetic

from .distributed import run_distributed
from .training import SmallNet, max_rel_err

WORLD = 2
LOCAL_BATCH = 16
STEPS = 10


def _batches(rank: int, world: int) -> ShardedBatches:
    return ShardedBatches(make_synthetic(2048, seed=1), LOCAL_BATCH, rank, world, seed=3)


def _train(algorithm: "str | None", rank: int, world: int, steps: int = STEPS, *, bn: bool = False,
           momentum: float = 0.9, **opts):
    """Train SmallNet for ``steps`` with a lowband algorithm (or plain torch DDP when None).
    Returns (parameters, engine stats of the training steps alone — the initial broadcast at
    ``distribute`` excluded — or None, per-step losses, engine or None)."""
    torch.manual_seed(0)
    model = SmallNet(bn=bn)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    if algorithm is None:
        forward, engine, step = DistributedDataParallel(model), None, opt.step
    else:
        engine = lowband.distribute(model, opt, algorithm, **opts)
        forward, step = engine.module, engine.step
        setup = engine.stats.snapshot()
    losses = []
    it = _batches(rank, world).epoch(0)
    for _ in range(steps):
        x, y = next(it)
        opt.zero_grad()
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, (stats_since(engine.stats.snapshot(), setup) if engine else None), losses, engine


def stats_since(after: dict, before: dict) -> dict:
    """Counter differences (per-op entries too)."""
    out = {k: v - before[k] for k, v in after.items() if isinstance(v, (int, float))}
    out["by_op"] = {op: [c - before["by_op"].get(op, [0, 0])[0], b - before["by_op"].get(op, [0, 0])[1]]
                    for op, (c, b) in after["by_op"].items()}
    out["by_op"] = {op: v for op, v in out["by_op"].items() if v[0]}
    return out


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- ddp, ddp-fp16 ----------------------------------------------------------------------------
def _ddp_family(rank: int, world: int):
    out = {name: _train(name, rank, world)[:2] for name in ("ddp", "ddp-fp16", "ssgd")}
    out["torch"] = _train(None, rank, world)[:2]
    # with BatchNorm: DDP broadcasts rank 0's buffers before each forward (counted here)
    out["ddp-bn"] = _train("ddp", rank, world, bn=True)[:2]
    out["torch-bn"] = _train(None, rank, world, bn=True)[:2]
    return out


def test_ddp_and_fp16_equal_pytorch_and_count_exact_bytes():
    results = run_distributed(_ddp_family, WORLD)
    numel = _numel(SmallNet())
    ring = 2 * (WORLD - 1) / WORLD
    for r in results:
        assert max_rel_err(r["ddp"][0], r["torch"][0]) <= 1e-6
        assert max_rel_err(r["ddp"][0], r["ssgd"][0]) <= 1e-5
        assert max_rel_err(r["ddp-bn"][0], r["torch-bn"][0]) <= 1e-6
        # fp16 rounding of the gradient: close to fp32, but not identical
        err16 = max_rel_err(r["ddp-fp16"][0], r["ssgd"][0])
        assert 0 < err16 <= 1e-2
        ddp, fp16 = r["ddp"][1], r["ddp-fp16"][1]
        assert ddp["bytes_sent"] == round(STEPS * ring * 4 * numel)
        assert fp16["bytes_sent"] == round(STEPS * ring * 2 * numel)
        assert 2 * fp16["bytes_sent"] == ddp["bytes_sent"]
        assert ddp["payload_bytes"] == STEPS * 4 * numel
        # BatchNorm buffers: one broadcast per buffer dtype (float stats, int64 counter) per forward
        bn_stats = r["ddp-bn"][1]
        assert bn_stats["by_op"]["broadcast"][0] == 2 * STEPS
    for r in results[1:]:
        assert max_rel_err(r["ddp"][0], results[0]["ddp"][0]) == 0.0


# -- ddp-powersgd -----------------------------------------------------------------------------
def _powersgd(rank: int, world: int, start: int):
    # every all-reduce PyTorch's hook and lowband actually issue, to compare with the count
    issued = []
    real_all_reduce = dist.all_reduce

    def traced(tensor, *args, **kwargs):
        issued.append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = traced
    try:
        # the non-finite guard's own agreement all-reduce would be traced too: switch it off
        params, stats, losses, engine = _train("ddp-powersgd", rank, world, steps=40, momentum=0.0,
                                               start_powerSGD_iter=start, nonfinite="off")
    finally:
        dist.all_reduce = real_all_reduce
    _, ddp_stats, _, _ = _train("ddp", rank, world, steps=1)
    per_step = stats["by_op"]["all_reduce"]
    with pytest.raises(ValueError, match="one DDP bucket"):
        model = SmallNet()
        lowband.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp-powersgd", bucket_cap_mb=0.01)
    return dict(params=params, stats=stats, losses=losses, issued=sum(issued), calls=len(issued),
                ddp_bytes_per_step=ddp_stats["bytes_sent"], counted_calls=per_step[0])


def _powersgd_resume(rank: int, world: int, start: int, split: int, total: int):
    """``total`` steps straight, and ``split`` + checkpoint (weights_only) + ``total - split``
    with fresh model, optimizer, DDP and engine."""
    straight = _train("ddp-powersgd", rank, world, steps=total, start_powerSGD_iter=start)[0]
    torch.manual_seed(0)
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = lowband.distribute(model, opt, "ddp-powersgd", start_powerSGD_iter=start)
    it = _batches(rank, world).epoch(0)
    for step in range(total):
        if step == split:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()}, buf)
            engine.close()
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            model = SmallNet()
            model.load_state_dict(ckpt["model"])
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            opt.load_state_dict(ckpt["opt"])
            engine = lowband.distribute(model, opt, "ddp-powersgd", start_powerSGD_iter=start)
            engine.load_state_dict(ckpt["engine"])
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(engine.module(x), y).backward()
        engine.step()
    resumed = {n: p.detach().clone() for n, p in model.named_parameters()}
    return max_rel_err(resumed, straight)


def test_powersgd_trains_sends_little_and_counts_what_it_sends():
    start = 5
    results = run_distributed(_powersgd, WORLD, start)
    for r in results:
        losses = r["losses"]
        assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
        # counted payload == bytes handed to torch.distributed (the hook's own all-reduces included)
        assert r["stats"]["payload_bytes"] == r["issued"]
        assert r["counted_calls"] == r["calls"]
        # warm-up: one plain all-reduce per step; then uncompressed + P + Q per step
        assert r["counted_calls"] == start + 3 * (40 - start)
        compressed_per_step = (r["stats"]["bytes_sent"] - start * r["ddp_bytes_per_step"]) / (40 - start)
        assert compressed_per_step < r["ddp_bytes_per_step"] / 5
    assert max_rel_err(results[1]["params"], results[0]["params"]) == 0.0


def test_powersgd_resumes_from_a_weights_only_checkpoint():
    # the split falls after compression started, so error feedback, P/Q memories and the
    # iteration counter all matter
    errors = run_distributed(_powersgd_resume, WORLD, 3, 6, 10)
    assert max(errors) <= 1e-6


# -- localsgd ---------------------------------------------------------------------------------
def _localsgd(rank: int, world: int):
    numel = _numel(SmallNet())
    out = {}
    ssgd = _train("ssgd", rank, world, momentum=0.0)[0]
    # period 1, no warm-up, plain SGD: averaging the models after each local step is
    # averaging the gradients before it
    p1, s1, _, _ = _train("localsgd", rank, world, momentum=0.0, period=1, warmup_steps=0)
    out["period1_vs_ssgd"] = max_rel_err(p1, ssgd)
    out["period1_calls"] = s1["calls"]
    out["period1_bytes"] = s1["bytes_sent"]
    # period 4 after 2 warm-up steps: drift between averages, identical after drain
    steps, warmup, period = 14, 2, 4
    p4, s4, _, engine = _train("localsgd", rank, world, steps=steps, period=period, warmup_steps=warmup)
    out["before_drain"] = p4
    out["period4_calls"] = s4["calls"]
    calls_before_drain = engine.stats.calls
    engine.synchronize()
    out["after_drain"] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    out["drain_calls"] = engine.stats.calls - calls_before_drain
    engine.synchronize()   # already in sync: no further communication
    out["second_drain_calls"] = engine.stats.calls - calls_before_drain - out["drain_calls"]
    out["state"] = engine.state_dict()["algorithm"]
    out["numel"] = numel
    return out


def test_localsgd_period_schedule_and_drain():
    results = run_distributed(_localsgd, WORLD)
    ring = 2 * (WORLD - 1) / WORLD
    for r in results:
        assert r["period1_vs_ssgd"] <= 1e-5
        assert r["period1_calls"] == STEPS                       # one parameter average per step
        assert r["period1_bytes"] == round(STEPS * ring * 4 * r["numel"])
        # 2 gradient all-reduces, then averages after local steps 0, 4, 8 (of 12)
        assert r["period4_calls"] == 2 + 3
        assert r["drain_calls"] == 1 and r["second_drain_calls"] == 0
        assert r["state"] == {"step": 14, "in_sync": True}
    a, b = results
    assert max_rel_err(a["before_drain"], b["before_drain"]) > 0      # local steps really are local
    assert max_rel_err(a["after_drain"], b["after_drain"]) == 0.0


# -- knobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, options, message", [
    ("ddp", {"bucket_cap_mb": 0}, "bucket_cap_mb must be > 0"),
    ("ddp-fp16", {"broadcast_buffers": "maybe"}, "broadcast_buffers. must be true or false"),
    ("ddp-powersgd", {"matrix_approximation_rank": 0}, "matrix_approximation_rank must be an integer >= 1"),
    ("ddp-powersgd", {"start_powerSGD_iter": 1}, "start_powerSGD_iter must be > 1"),
    ("ddp-powersgd", {"min_compression_rate": -1}, "min_compression_rate. must be >= 0"),
    ("ddp-powersgd", {"min_compression_rate": 0}, "min_compression_rate must be > 0"),
    ("ddp-powersgd", {"use_error_feedback": 2}, "use_error_feedback. must be true or false"),
    ("localsgd", {"period": 0}, "period must be an integer >= 1"),
    ("localsgd", {"warmup_steps": -1}, "warmup_steps. must be >= 0"),
    ("localsgd", {"periods": 3}, "bad options for algorithm 'localsgd'"),
])
def test_bad_knobs_are_refused_with_a_sentence(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_algorithm(name, **options)


def test_registry_and_options():
    algo = make_algorithm("ddp-powersgd", matrix_approximation_rank=4, start_powerSGD_iter=0,
                          use_error_feedback=False, warm_start=False)
    assert algo.config()["matrix_approximation_rank"] == 4
    assert make_algorithm("localsgd", period=8).config() == {"algorithm": "localsgd", "period": 8, "warmup_steps": 10}
    assert {"ddp", "ddp-fp16", "ddp-powersgd", "localsgd"} <= set(lowband.ALGORITHMS)
