"""CP-SGD against a slow single-process simulation of N workers (spec A.2 degenerate cases)."""
from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import lowband
from lowband.compressors import ErrorFeedback, make_compressor

from .distributed import run_distributed
from .training import SmallNet, batches, make_optimizer, max_rel_err, run_algorithm

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


def simulate(world: int, warmup: int, k: Optional[int], alpha: float, codec: Optional[dict]):
    """Spec A.2 written out literally for N simulated workers in one process: global W and the
    optimizer on it, per-worker compute weights, per-worker per-bucket error feedback, and an
    all-gather-style exact average of the decoded payloads."""
    torch.manual_seed(0)
    global_model = SmallNet()
    opt = sgd(global_model)
    params = list(global_model.parameters())
    names = [n for n, _ in global_model.named_parameters()]
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
        correction = k is not None and (t - warmup) % k == 0
        if correction or codec is None:
            c = [sum(g[i] for g in grads) / world for i in range(len(params))]
        else:
            c = [None] * len(params)
            for i in range(len(params)):      # layer-wise codec, residual keyed by parameter name
                total = torch.zeros(params[i].numel())
                for r in range(world):
                    payload, ctx = efs[r].compress(grads[r][i].reshape(-1), names[i])
                    total += efs[r].decompress(payload, ctx).reshape(-1)
                c[i] = (total / world).view_as(params[i])
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
               "compressor": "2bit", "compressor_options": codec["options"], "bucket_mb": BUCKET_MB}
    results = run_distributed(_run_lowband, 2, options)
    reference = simulate(2, warmup=2, k=None, alpha=0.0, codec=codec)
    for ours in results:
        assert max_rel_err(ours, reference) <= 1e-5


def test_compressed_with_corrections_matches_simulation():
    codec = {"name": "2bit", "options": {"threshold": 0.01}}
    options = {"warmup_steps": 2, "correction_period": 3, "correction": "burst", "local_update": "sgd",
               "local_lr": LR, "collective": "allgather", "compressor_options": codec["options"],
               "bucket_mb": BUCKET_MB}
    results = run_distributed(_run_lowband, 2, options)
    reference = simulate(2, warmup=2, k=3, alpha=LR, codec=codec)
    for ours in results:
        assert max_rel_err(ours, reference) <= 1e-5
    assert max_rel_err(results[0], results[1]) == 0.0


def test_bad_options():
    with pytest.raises(ValueError, match="correction_period"):
        lowband.CPSGD(correction_period=0)
    with pytest.raises(ValueError, match="local_update"):
        lowband.CPSGD(local_update="magic")
    with pytest.raises(ValueError, match="unknown compressor"):
        lowband.CPSGD(compressor="9bit")
