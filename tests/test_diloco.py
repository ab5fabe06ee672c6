"""The torchft peers (DiLoCo, Streaming DiLoCo) at 2 workers: equal to a slow single-process
simulation of DiLoCo, identical models on both ranks after the run, exact byte counts, and a
failed commit stops the run (multi-process, gloo)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import lowband
from lowband.algorithms.peers.diloco import CommitFailed, fragment_count, split_fragments, torchft_unavailable
from lowband.comm.wire import allreduce_bytes

from .distributed import run_distributed
from .training import SmallNet, batches, make_optimizer, max_rel_err, params_of, poisoned_steps

pytestmark = pytest.mark.skipif(torchft_unavailable() is not None, reason=str(torchft_unavailable()))

H = 4
STEPS = 8          # two DiLoCo syncs; four fragment syncs for streaming with 2 fragments
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
STREAMING = {"sync_every": H, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5, "timeout_s": 30.0}


def _run(rank, world, algorithm, options, inject_error_at=None, drain_at=()):
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, algorithm, **options)
    it = batches(rank, world).epoch(0)
    commits = []
    try:
        for step in range(1, STEPS + 1):
            x, y = next(it)
            opt.zero_grad()
            F.cross_entropy(engine.module(x), y).backward()
            if step == inject_error_at:
                # the process group reports an error, as after a failed all-reduce: torchft
                # then votes against the commit and resets the parameters
                manager = engine.bound._manager
                manager._pg.errored = lambda: RuntimeError("injected")
                manager._max_retries = None   # so that lowband's own count of commits must catch it
            engine.step()
            if step in drain_at:          # what an evaluation does: drain, score, train on
                engine.synchronize()
                with torch.no_grad():
                    engine.module.eval()
                    engine.module(x)
                    engine.module.train()
            commits.append(engine.bound.step_metrics()["commits"])
    except CommitFailed as e:
        engine.close()
        return str(e)
    engine.synchronize()
    sent = engine.stats.by_op.get("torchft_allreduce", [0, 0])
    result = params_of(model), sent, commits, engine.stats.bytes_sent
    engine.close()
    return result


def _diloco_and_failure(rank, world):
    """One run of ranks for two cases (each run of ranks imports torchft anew)."""
    return (_run(rank, world, "diloco", {"sync_every": H, "timeout_s": 30.0}),
            _run(rank, world, "diloco", {"sync_every": H, "timeout_s": 30.0}, inject_error_at=H))


def _streaming(rank, world):
    return (_run(rank, world, "streaming-diloco", STREAMING),
            _run(rank, world, "streaming-diloco", STREAMING, drain_at=(3, 5)))


def _simulate_diloco(world):
    """DiLoCo by hand: every replica takes H inner steps on its own shard, then the global
    weights take one Nesterov step on the average of (global - local)."""
    torch.manual_seed(0)
    start = SmallNet()
    global_model = copy.deepcopy(start)
    outer = torch.optim.SGD(global_model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    replicas = [copy.deepcopy(start) for _ in range(world)]
    inner = [make_optimizer("sgd", m) for m in replicas]
    streams = [batches(r, world).epoch(0) for r in range(world)]
    for step in range(1, STEPS + 1):
        for m, opt, it in zip(replicas, inner, streams):
            x, y = next(it)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        if step % H == 0:
            with torch.no_grad():
                for name, g in global_model.named_parameters():
                    locals_ = [dict(m.named_parameters())[name] for m in replicas]
                    g.grad = sum(g - p for p in locals_) / world
            outer.step()
            outer.zero_grad()
            for m in replicas:
                m.load_state_dict(global_model.state_dict())
    return params_of(global_model)


def _sizes():
    n_bytes = sum(p.numel() * 4 for p in SmallNet().parameters())
    n_tensors = len(list(SmallNet().parameters()))   # torchft all-reduces one tensor at a time
    return n_bytes, n_tensors


def test_diloco_equals_reference_and_a_failed_commit_stops_it():
    (d0, f0), (d1, f1) = run_distributed(_diloco_and_failure, 2, timeout_s=300)
    n_bytes, n_tensors = _sizes()
    # both ranks end with the same model, which is the hand-written DiLoCo's
    for (params, sent, commits, _), other in ((d0, d1), (d1, d0)):
        assert max_rel_err(params, other[0]) == 0.0
        assert commits == [s // H for s in range(1, STEPS + 1)]
        assert sent == [STEPS // H * n_tensors, int(STEPS // H * allreduce_bytes(n_bytes, 2))]
    assert max_rel_err(d0[0], _simulate_diloco(2)) <= 1e-5
    assert max_rel_err(d0[0], params_of(SmallNet())) > 1e-3                     # it trained
    # a commit that torchft voted down (and so silently reset the parameters) stops the run
    for message in (f0, f1):
        assert isinstance(message, str) and "committed 0 of the 1 syncs due by step 4" in message


def test_streaming_diloco_identical_ranks_bytes_and_evaluation_invariance():
    (s0, e0), (s1, e1) = run_distributed(_streaming, 2, timeout_s=300)
    n_bytes, n_tensors = _sizes()
    # one fragment per H / 2 steps, every fragment synced twice in 8 steps
    for (params, sent, commits, _), other in ((s0, s1), (s1, s0)):
        assert max_rel_err(params, other[0]) == 0.0
        assert commits == [s // (H // 2) for s in range(1, STEPS + 1)]
        assert sent == [2 * n_tensors, int(2 * allreduce_bytes(n_bytes, 2))]
    assert max_rel_err(s0[0], _simulate_diloco(2)) > 1e-4                       # not DiLoCo
    # evaluations mid-run (a drain between syncs) leave the trajectory bit-identical
    assert max_rel_err(e0[0], s0[0]) == 0.0 and max_rel_err(e1[0], s1[0]) == 0.0


def test_split_fragments_contiguous_nonempty_balanced():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 10, 10, 1000, 5)]
    assert split_fragments(params, 1) == [[0, 1, 2, 3, 4, 5]]
    assert split_fragments(params, 2) == [[0, 1, 2, 3, 4], [5]]
    assert split_fragments(params, 6) == [[0], [1], [2], [3], [4], [5]]
    even = [torch.nn.Parameter(torch.zeros(4)) for _ in range(8)]
    assert split_fragments(even, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="more than the model's 6 parameter tensors"):
        split_fragments(params, 7)


def test_the_default_fragment_count_fits_the_model_and_an_explicit_one_is_kept():
    """streaming-diloco's default (fragments=None): 4 fragments of H = 32, fewer for a model
    with fewer parameter tensors (the largest count that divides H with room for the delay);
    an explicit count is kept, and split_fragments refuses it when the model is too small."""
    default = lowband.algorithms.make_algorithm("streaming-diloco")
    assert (default.sync_every, default.fragments, default.fragment_sync_delay) == (32, None, 1)
    assert [default.fragments_for(n) for n in (1, 2, 3, 4, 10)] == [1, 2, 2, 4, 4]
    assert fragment_count(None, 4, 10, 12, 1) == 4 and fragment_count(None, 4, 10, 12, 3) == 3   # 12 / 4 = 3: no room
    assert fragment_count(None, 4, 10, 9, 1) == 3 and fragment_count(None, 4, 10, 7, 1) == 1
    explicit = lowband.algorithms.make_algorithm("streaming-diloco", fragments=4)
    assert explicit.fragments_for(3) == 4
    with pytest.raises(ValueError, match="more than the model's 3 parameter tensors"):
        split_fragments([torch.nn.Parameter(torch.zeros(2)) for _ in range(3)], explicit.fragments_for(3))
    assert lowband.algorithms.make_algorithm("diloco").fragments_for(10) == 1


@pytest.mark.parametrize("options, message", [
    ({"sync_every": 6, "fragments": 4}, "must be a multiple of fragments"),
    ({"sync_every": 6, "fragments": None, "fragment_sync_delay": 6}, "must be less than sync_every / fragments"),
    ({"sync_every": 8, "fragments": 2, "fragment_sync_delay": 4}, "must be less than sync_every / fragments"),
    ({"fragment_update_alpha": 1.5}, "fragment_update_alpha must be in"),
    ({"outer_lr": 0}, "outer_lr must be > 0"),
    ({"sync_every": 0}, "sync_every must be an integer >= 1"),
])
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        lowband.algorithms.make_algorithm("diloco", **options)


def _nan_run(rank, world, algorithm, options, bad_step):
    """Rank 1's gradient NaN at ``bad_step``: every rank stops naming that step before the NaN
    reaches the global weights; inner steps decide it one step late (no per-step barrier)."""
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, algorithm, **options)
    deferred = []
    try:
        poisoned_steps(engine, opt, batches(rank, world).epoch(0), STEPS, bad_step if rank == 1 else 0,
                       lambda: float("nan") * next(model.parameters()).sum(), lambda: deferred.append(engine.guard.pending))
        engine.synchronize()
        result = {"no error": True, "deferred": deferred}
    except lowband.NonFiniteGradientError as e:
        result = {"step": e.step, "raised_at": len(deferred) + 1, "deferred": deferred,
                  "global_finite": all(bool(torch.isfinite(g).all()) for g in engine.bound.global_parameters())}
    engine.close()
    return result


def _nan_runs(rank, world):
    plain = {"sync_every": H, "timeout_s": 30.0}
    return {"clean": _nan_run(rank, world, "diloco", plain, 0),
            "inner": _nan_run(rank, world, "diloco", plain, 2),
            "sync": _nan_run(rank, world, "diloco", plain, H),
            "streaming clean": _nan_run(rank, world, "streaming-diloco", STREAMING, 0),
            "streaming prepare": _nan_run(rank, world, "streaming-diloco", STREAMING, 1)}


def test_inner_steps_defer_the_finiteness_check_and_syncs_decide_at_once():
    for n in run_distributed(_nan_runs, 2, timeout_s=300):
        # diloco: steps H and 2H sync; streaming (2 fragments, delay 1): every 2 steps a
        # fragment syncs, prepared one step before: every step communicates
        assert n["clean"] == {"no error": True, "deferred": [True, True, True, False] * 2}
        assert n["streaming clean"] == {"no error": True, "deferred": [False] * STEPS}
        inner, sync, prepare = n["inner"], n["sync"], n["streaming prepare"]
        assert inner["step"] == 2 and inner["raised_at"] == 3 and inner["global_finite"]
        assert sync["step"] == H and sync["raised_at"] == H and sync["global_finite"]
        assert prepare["step"] == 1 and prepare["raised_at"] == 1 and prepare["global_finite"]
