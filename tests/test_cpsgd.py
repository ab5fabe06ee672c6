"""CP-SGD against a slow single-process simulation of N workers (and its degenerate cases)."""
from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowband
from lowband.comm.reducer import CompressedReducer
from lowband.algorithms.buckets import plan_buckets
from lowband.algorithms.warmup import share_bounds
from lowband.comm.wire import MIB
from lowband.codecs import ErrorFeedback, make_compressor

from .distributed import run_distributed
from .training import SmallNet, batches, make_optimizer, max_rel_err, params_of, run_algorithm

STEPS = 12
BUCKET_MB = 0.01
LR = 0.05   # make_optimizer's SGD learning rate


def sgd(model):
    return make_optimizer("sgd", model)


def _run_lowband(rank: int, world: int, options: dict, steps: int = STEPS):
    params, engine = run_algorithm(rank, world, "cpsgd", options, steps)
    engine.close()
    return params


def _run_ssgd(rank: int, world: int):
    return run_algorithm(rank, world, "ssgd", {"bucket_mb": BUCKET_MB}, STEPS)[0]


def slow_share_masks(numel: int, k: int) -> list[torch.Tensor]:
    """Element by element: element e of a bucket belongs to the last share j whose start
    j*numel//k is <= e (the shares of the spread correction), as k boolean masks."""
    owner = []
    for e in range(numel):
        j = 0
        while j + 1 < k and (j + 1) * numel // k <= e:
            j += 1
        owner.append(j)
    owner = torch.tensor(owner)
    return [owner == j for j in range(k)]


def spread_masks(params, k: int) -> list[list[torch.Tensor]]:
    """Per phase, per parameter: which of its elements go exact (buckets as lowband plans them)."""
    masks = [[torch.zeros(p.numel(), dtype=torch.bool) for p in params] for _ in range(k)]
    for group in plan_buckets(params, range(len(params)), int(BUCKET_MB * MIB)):
        numel = sum(params[i].numel() for i in group)
        for j, share in enumerate(slow_share_masks(numel, k)):
            offset = 0
            for i in group:
                masks[j][i] = share[offset:offset + params[i].numel()]
                offset += params[i].numel()
    return masks


def simulate(world: int, warmup: int, k: Optional[int], alpha: float, codec: Optional[dict],
             spread: bool = False, flush: bool = False):
    """CP-SGD written out literally for N simulated workers in one process: global W and the
    optimizer on it, per-worker compute weights, per-worker per-bucket error feedback, and an
    all-gather-style exact average of the decoded payloads.

    ``spread``: at phase j of each cycle, share j of every bucket is averaged exactly (an exact
    element is coded 0 and its residual is neither used nor changed) and the rest compressed.
    ``flush``: an element sent exact carries its worker's residual (g + e averaged in fp32) and
    the residual there becomes 0 (``flush_residual_on_correction``)."""
    torch.manual_seed(0)
    global_model = SmallNet()
    opt = sgd(global_model)
    params = list(global_model.parameters())
    names = [n for n, _ in global_model.named_parameters()]
    masks = spread_masks(params, k) if spread else None
    workers = [copy.deepcopy(global_model) for _ in range(world)]
    efs = [ErrorFeedback(make_compressor(codec["name"], **codec["options"])) if codec else None for _ in range(world)]
    iters = [batches(r, world).epoch(0) for r in range(world)]
    pending = None

    def apply(avg):
        for p, g in zip(params, avg):
            p.grad = g.clone()
        opt.step()

    for t in range(STEPS):
        grads = []
        for r in range(world):
            x, y = next(iters[r])
            workers[r].zero_grad()
            F.cross_entropy(workers[r](x), y).backward()
            grads.append([p.grad.detach().clone() for p in workers[r].parameters()])
        if t < warmup:
            apply([sum(g[i] for g in grads) / world for i in range(len(params))])
            for w in workers:
                w.load_state_dict(global_model.state_dict())
            continue
        correction = k is not None and (t - warmup) % k == 0 and not spread
        exact = [sum(g[i] for g in grads) / world for i in range(len(params))]
        if correction and flush and codec is not None:      # every element exact, residuals flushed
            for i in range(len(params)):
                for r in range(world):
                    if efs[r].has_residual(names[i]):
                        e = efs[r].residual(names[i])
                        exact[i] = exact[i] + e.view_as(params[i]) / world
                        e.zero_()
        if correction or codec is None:
            c = exact
        else:
            mask = masks[(t - warmup) % k] if spread else [torch.zeros(p.numel(), dtype=torch.bool) for p in params]
            c = [None] * len(params)
            for i in range(len(params)):      # layer-wise codec, residual keyed by parameter name
                total, flushed = torch.zeros(params[i].numel()), torch.zeros(params[i].numel())
                m = mask[i]
                for r in range(world):
                    x = grads[r][i].reshape(-1).clone()
                    x[m] = 0
                    saved = None
                    if efs[r].has_residual(names[i]):
                        e = efs[r].residual(names[i]).reshape(-1)
                        saved = e[m].clone()
                        e[m] = 0
                    payload, ctx = efs[r].compress(x, names[i])
                    if saved is not None and flush:
                        flushed[m] += saved / world
                    elif saved is not None:
                        efs[r].residual(names[i]).reshape(-1)[m] = saved
                    total += efs[r].decompress(payload, ctx).reshape(-1)
                total = total / world
                total[m] = exact[i].reshape(-1)[m] + flushed[m]
                c[i] = total.view_as(params[i])
        if pending is not None:
            apply(pending)
        for r, w in enumerate(workers):
            with torch.no_grad():
                for wp, gp, g in zip(w.parameters(), params, grads[r]):
                    wp.copy_(gp - alpha * g)
        pending = c
    if pending is not None:
        apply(pending)
    return {n: p.detach().clone() for n, p in global_model.named_parameters()}


def _both(rank, world, options):
    return _run_lowband(rank, world, options), _run_ssgd(rank, world)


def test_warmup_forever_is_ssgd():
    results = run_distributed(_both, 2, {"warmup_steps": STEPS + 5, "bucket_mb": BUCKET_MB})
    for ours, ssgd in results:
        assert max_rel_err(ours, ssgd) == 0.0


@pytest.mark.parametrize("world", [2, 3])
def test_k1_is_delayed_full_precision_sgd_with_local_compensation(world):
    options = {"warmup_steps": 3, "correction_period": 1, "local_update": "sgd", "local_lr": 0.1,
               "bucket_mb": BUCKET_MB}
    results = run_distributed(_run_lowband, world, options)
    reference = simulate(world, warmup=3, k=1, alpha=0.1, codec=None)
    for ours in results:
        assert max_rel_err(ours, reference) <= 1e-5
    # the pipeline really is delayed: plain S-SGD ends elsewhere
    assert max_rel_err(results[0], simulate(world, warmup=STEPS, k=1, alpha=0.1, codec=None)) > 1e-3


def test_alpha0_no_correction_is_stale_compressed_sgd_with_error_feedback():
    codec = {"name": "2bit", "options": {"threshold": 0.01}}
    options = {"warmup_steps": 2, "correction_period": None, "local_update": "none", "collective": "allgather",
               "compressor": "2bit", "compressor_options": codec["options"], "bucket_mb": BUCKET_MB,
               "compress_vectors": True}
    results = run_distributed(_run_lowband, 2, options)
    reference = simulate(2, warmup=2, k=None, alpha=0.0, codec=codec)
    for ours in results:
        assert max_rel_err(ours, reference) <= 1e-5


@pytest.mark.parametrize("flush", [True, False])
def test_compressed_with_corrections_matches_simulation(flush):
    codec = {"name": "2bit", "options": {"threshold": 0.01}}
    options = {"warmup_steps": 2, "correction_period": 3, "correction": "burst", "local_update": "sgd",
               "local_lr": LR, "collective": "allgather", "compressor_options": codec["options"],
               "bucket_mb": BUCKET_MB, "compress_vectors": True, "flush_residual_on_correction": flush}
    results = run_distributed(_run_lowband, 2, options)
    reference = simulate(2, warmup=2, k=3, alpha=LR, codec=codec, flush=flush)
    for ours in results:
        assert max_rel_err(ours, reference) <= 1e-5
    assert max_rel_err(results[0], results[1]) == 0.0


def _run_lowband_slow_pipeline(rank: int, world: int, options: dict):
    """As :func:`_run_lowband`, with every compressed job of the pipeline held back 40 ms, so
    step t's job still reads its bucket while step t + 1's backward fills the buckets."""
    import time
    run = CompressedReducer._run

    def slow(self, *args):
        time.sleep(0.04)
        return run(self, *args)
    CompressedReducer._run = slow
    try:
        return _run_lowband(rank, world, options)
    finally:
        CompressedReducer._run = run


def test_buckets_handed_over_uncopied_survive_a_slow_pipeline():
    """cpsgd gives the reducer its bucket without a copy (double-buffered buckets): a job that
    runs late must still see its own step's gradients, bit for bit."""
    options = {"warmup_steps": 2, "correction_period": 3, "bucket_mb": BUCKET_MB}
    fast = run_distributed(_run_lowband, 2, options)
    slow = run_distributed(_run_lowband_slow_pipeline, 2, options)
    for a, b in zip(fast, slow):
        assert max_rel_err(a, b) == 0.0


@pytest.mark.parametrize("numel, k", [(1, 1), (7, 3), (2621, 5), (10, 16), (18432, 7)])
def test_spread_shares_cover_every_element_once_per_cycle(numel, k):
    masks = slow_share_masks(numel, k)
    bounds = [share_bounds(numel, k, j) for j in range(k)]
    counts = torch.zeros(numel, dtype=torch.long)
    for j, (lo, hi) in enumerate(bounds):
        assert torch.equal(masks[j].nonzero().flatten(), torch.arange(lo, hi))
        counts[lo:hi] += 1
    assert torch.equal(counts, torch.ones(numel, dtype=torch.long))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1               # equal bytes per step, to one element


def _run_recording(rank: int, world: int, options: dict, steps: int = STEPS):
    """Final weights, plus per step: bytes sent and the step's schedule metrics. After each
    step, ``global_parameters()`` waits for the step's communication (so its bytes are counted
    by then); it must not change the trajectory."""
    torch.manual_seed(0)
    model = SmallNet()
    opt = sgd(model)
    engine = lowband.distribute(model, opt, "cpsgd", **options)
    it, log = batches(rank, world).epoch(0), []
    before = engine.stats.bytes_sent
    for _ in range(steps):
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(engine.module(x), y).backward()
        engine.step()
        engine.bound.global_parameters()
        log.append((engine.stats.bytes_sent - before, engine.bound.step_metrics()))
        before = engine.stats.bytes_sent
    engine.synchronize()
    engine.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, log


@pytest.mark.parametrize("flush", [True, False])
def test_spread_correction_matches_simulation_and_sends_constant_bytes(flush):
    codec = {"name": "2bit", "options": {"threshold": 0.01}}
    base = {"warmup_steps": 2, "correction_period": 3, "local_update": "sgd", "local_lr": LR,
            "collective": "allgather", "compressor_options": codec["options"], "bucket_mb": BUCKET_MB,
            "compress_vectors": True, "flush_residual_on_correction": flush}
    results = run_distributed(_run_recording, 2, {**base, "correction": "spread"})
    reference = simulate(2, warmup=2, k=3, alpha=LR, codec=codec, spread=True, flush=flush)
    for ours, log in results:
        assert max_rel_err(ours, reference) <= 1e-5
        phases = [m["correction_phase"] for _, m in log]
        assert phases == [None, None] + [(t - 2) % 3 for t in range(2, STEPS)]
        sent = [b for b, _ in log[3:]]                 # after the warm-up (and its hand-over step)
        assert max(sent) - min(sent) <= 64, sent        # constant bytes per step (shares differ by <= 1 element)
    assert max_rel_err(results[0][0], results[1][0]) == 0.0
    # it is not the burst correction (whose fp32 steps send ~10x the bytes): that ends elsewhere
    assert max_rel_err(results[0][0], simulate(2, warmup=2, k=3, alpha=LR, codec=codec, flush=flush)) > 1e-4


def test_bad_options():
    with pytest.raises(ValueError, match="correction_period"):
        lowband.CPSGD(correction_period=0)
    with pytest.raises(ValueError, match="local_update"):
        lowband.CPSGD(local_update="magic")
    with pytest.raises(ValueError, match="unknown compressor"):
        lowband.CPSGD(compressor="9bit")


class PartlyUsed(nn.Module):
    """SmallNet plus a layer no rank uses and a layer (2-D weight and 1-D bias) only rank 0 uses."""

    def __init__(self):
        super().__init__()
        self.net = SmallNet()
        self.unused = nn.Linear(3, 3)
        self.partial = nn.Linear(10, 10)

    def forward(self, x, use_partial: bool):
        out = self.net(x)
        return self.partial(out) if use_partial else out


def _unused(rank: int, world: int, options: dict):
    torch.manual_seed(0)
    model = PartlyUsed()
    opt = sgd(model)
    engine = lowband.distribute(model, opt, "cpsgd", **options)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    it, seen = batches(rank, world).epoch(0), []
    for _ in range(STEPS):
        x, y = next(it)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, use_partial=rank == 0), y).backward()
        engine.step()
        W = engine.bound.global_parameters() or list(model.parameters())
        names = [n for n, _ in model.named_parameters()]
        for n, p, g in zip(names, model.parameters(), W):
            if n.startswith("unused."):
                assert p.grad is None, (n, engine.bound.t)
                assert torch.equal(p.detach(), start[n]) and torch.equal(g, start[n]), (n, engine.bound.t)
        seen.append({n: g.detach().clone() for n, g in zip(names, W) if n.startswith("partial.")})
    engine.synchronize()
    engine.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, start, seen


@pytest.mark.parametrize("correction", ["spread", "burst"])
def test_parameters_no_rank_used_stay_put_and_partly_used_ones_agree(correction):
    options = {"warmup_steps": 3, "correction": correction, "correction_period": 2, "bucket_mb": BUCKET_MB}
    (final0, start, seen0), (final1, _, seen1) = run_distributed(_unused, 2, options)
    for n in final0:
        assert torch.equal(final0[n], final1[n]), n           # replicas agree, warm-up and pipeline alike
    for step0, step1 in zip(seen0, seen1):                     # the global model agrees at every step
        for n in step0:
            assert torch.equal(step0[n], step1[n]), n
    assert not torch.equal(final0["partial.weight"], start["partial.weight"])   # used on rank 0: trained
    assert not torch.equal(final0["partial.bias"], start["partial.bias"])
    for n in ("unused.weight", "unused.bias"):
        assert torch.equal(final0[n], start[n])


def _native_or_torch(rank: int, world: int, mode: str, optimizer: str = "sgd", clip: bool = False):
    import os
    from lowband import _native as kernels
    os.environ[kernels.ENV] = mode
    torch.manual_seed(0)
    model = SmallNet()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, nesterov=True, weight_decay=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    engine = lowband.distribute(model, opt, "cpsgd", warmup_steps=2, correction_period=3, bucket_mb=BUCKET_MB)
    fused = engine.bound.fused_step is not None
    summary = engine.bound.summary()
    assert summary["fused_step"] == ({"sgd": "FusedSGDStep", "adamw": "FusedAdamStep"}[optimizer] if fused else None)
    assert (summary["fused_step_unavailable"] is None) == fused
    it = batches(rank, world).epoch(0)
    for _ in range(STEPS):
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:
            engine.clip_grad_norm_(0.3)
        engine.step()
    engine.synchronize()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    bufs = [v.clone() for p in model.parameters() for k, v in sorted(opt.state[p].items())]
    engine.close()
    return out, bufs, fused


@pytest.mark.parametrize("optimizer, clip", [("sgd", False), ("adamw", False), ("sgd", True)])
def test_native_kernels_and_fused_step_equal_the_torch_path_end_to_end(optimizer, clip):
    """Default CP-SGD (look-ahead local update; SGD with Nesterov momentum and weight decay, or
    AdamW) with the native codecs and the fused global+local step equals the pure-torch path
    (torch codecs, optimizer.step() then the tentative step) bit for bit, 10 steps past
    the warm-up, on 2 gloo ranks; also with engine.clip_grad_norm_ (the average and the local
    gradient clipped before either path)."""
    from lowband import _native as kernels
    if kernels.library() is None:
        pytest.skip("native kernels not built")
    native = run_distributed(_native_or_torch, 2, "native", optimizer, clip)
    torch_path = run_distributed(_native_or_torch, 2, "torch", optimizer, clip)
    from lowband.optim.tentative import FusedAdamStep
    # where no rounding of the Adam kernel matches this torch build, CP-SGD takes torch's ops
    expect_fused = optimizer == "sgd" or FusedAdamStep.rounding() is not None
    for (p_n, b_n, fused_n), (p_t, b_t, fused_t) in zip(native, torch_path):
        assert fused_n == expect_fused and not fused_t
        for n in p_n:
            assert torch.equal(p_n[n], p_t[n]), n
        assert all(torch.equal(a, b) for a, b in zip(b_n, b_t))


# -- the link-fitting correction period ------------------------------------------------------
def test_link_fit_rule_grows_shrinks_and_holds_inside_its_band():
    from lowband.algorithms.cpsgd import LinkFitController
    rule = LinkFitController(base=4, max_period=64)
    assert rule.decide(4, busy=1.0, compute=1.0) == 5          # 1.0 / 0.8 = 1.25x
    assert rule.decide(4, busy=3.0, compute=1.0) == 8          # at most doubled per cycle
    assert rule.decide(40, busy=3.0, compute=1.0) == 64        # capped at max_period
    assert rule.decide(16, busy=0.7, compute=1.0) == 16        # inside [0.6, 0.9]: holds
    assert rule.decide(16, busy=0.5, compute=1.0) == 12        # fits with room: 3/4
    assert rule.decide(5, busy=0.0, compute=1.0) == 4          # never below the configured k
    for busy, compute in ((float("nan"), 1.0), (1.0, float("nan")), (1.0, 0.0)):
        assert rule.decide(7, busy, compute) == 7                # nothing measured: unchanged


def _run_fit(rank: int, world: int, options: dict, busy_until: int, steps: int):
    """cpsgd with ``fit_period``, the pipeline's measured time per step replaced by a rank-
    dependent figure until step ``busy_until`` (rank 0: 0 s, which alone would keep k; rank 1:
    60 s, far beyond any compute step), then 0: every rank must still choose the same k, from
    the agreed mean (30 s: grow). Returns the final
    weights, each step's k, and the fit state a fresh engine reads back from a checkpoint."""
    from lowband.algorithms import cpsgd
    real = cpsgd._InFlight.busy_s
    cpsgd._InFlight.busy_s = lambda self: 60.0 * rank if self.algo.t < busy_until else 0.0
    try:
        torch.manual_seed(0)
        model = SmallNet()
        opt = sgd(model)
        engine = lowband.distribute(model, opt, "cpsgd", **options)
        it, periods = batches(rank, world).epoch(0), []
        for _ in range(steps):
            x, y = next(it)
            opt.zero_grad()
            F.cross_entropy(engine.module(x), y).backward()
            engine.step()
            periods.append(engine.bound.step_metrics()["correction_period"])
        state = engine.state_dict()
        fresh = SmallNet()
        twin = lowband.distribute(fresh, sgd(fresh), "cpsgd", **options)
        twin.load_state_dict(state)
        restored = (twin.bound.period, twin.bound._fit_agreed is None, copy.deepcopy(twin.bound._fit_times))
        saved = (engine.bound.period, engine.bound._fit_agreed is None, copy.deepcopy(engine.bound._fit_times))
        twin.close()
        engine.synchronize()
        engine.close()
        return params_of(model), periods, restored, saved
    finally:
        cpsgd._InFlight.busy_s = real


def test_fit_period_grows_k_while_the_pipeline_does_not_fit_then_shrinks_back_and_ranks_agree():
    options = {"warmup_steps": 2, "correction_period": 2, "fit_period": True, "fit_max_period": 16,
               "bucket_mb": BUCKET_MB}
    steps = 60
    results = run_distributed(_run_fit, 2, options, 26, steps)
    (w0, k0, restored0, saved0), (w1, k1, _, _) = results
    assert k0 == k1                                      # decided from agreed numbers only
    assert max_rel_err(w0, w1) == 0.0
    pipelined = k0[2:]
    assert pipelined[0] == 2 and max(pipelined) == 16    # doubled to the cap while "busy"
    top = pipelined.index(16)
    assert pipelined[:top] == sorted(pipelined[:top])    # grew monotonically
    assert pipelined[-1] < 16                            # fits again (busy 0): shrinks toward 2
    assert restored0 == saved0                           # the rule's state survives a checkpoint


def test_fit_period_options_are_checked():
    with pytest.raises(ValueError, match="choose one"):
        lowband.CPSGD(fit_period=True, adapt_period=True)
    with pytest.raises(ValueError, match="spread"):
        lowband.CPSGD(fit_period=True, correction="burst")
    with pytest.raises(ValueError, match="fit_max_period"):
        lowband.CPSGD(fit_period=True, correction_period=20, fit_max_period=10)
    with pytest.raises(ValueError, match="fit_period"):
        lowband.CPSGD(fit_period=1)


def test_adapt_period_refuses_a_start_outside_its_range():
    assert lowband.CPSGD(adapt_period=True).correction_period == 80      # the default k is in range
    with pytest.raises(ValueError, match="min_period <= correction_period <= max_period"):
        lowband.CPSGD(adapt_period=True, correction_period=80, max_period=32)
    with pytest.raises(ValueError, match="min_period <= correction_period <= max_period"):
        lowband.CPSGD(adapt_period=True, correction_period=1, min_period=2)
