"""A DDP training loop's semantics under every lowband algorithm (issue 53): gradient clipping
with DDP's meaning (``engine.clip_grad_norm_``) against slow references, the user's own
``clip_grad_norm_`` refused where ``step()`` would overwrite it, parameters unfrozen mid-run,
``synchronize()`` applying everything pending, and optimizers (closures refused, step hooks).
docs/architecture.md tabulates the semantics these tests pin down."""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F

import lowband

from .distributed import run_distributed
from .training import SmallNet, batches, max_rel_err, params_of

STEPS = 8
LR, MOMENTUM, WD = 0.05, 0.9, 1e-3
#: small enough that every step of these runs is clipped (SmallNet's gradient norm is ~1)
MAX_NORM = 0.3
UNFREEZE_AT = 5


def make_sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)


def cosine(opt, steps: int):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=0.0)


def _loop(rank: int, world: int, algorithm: str, options: dict, clip: str = "none", steps: int = STEPS,
          schedule: bool = False, unfreeze: str = "none", hook_counter: bool = False) -> dict[str, Any]:
    """``steps`` iterations of a DDP-style loop through lowband. ``clip``: "none", "engine"
    (``engine.clip_grad_norm_``) or "user" (``torch.nn.utils.clip_grad_norm_`` on the model);
    ``schedule``: cosine to 0 over the run; ``unfreeze``: "none", "rebuild" (conv frozen at
    distribute(), unfrozen after UNFREEZE_AT steps followed by ``engine.rebuild()``) or "bare"
    (the same without the rebuild)."""
    torch.manual_seed(0)
    model = SmallNet()
    if unfreeze != "none":
        model.conv.requires_grad_(False)
    opt = make_sgd(model)
    calls = [0]
    if hook_counter:
        opt.register_step_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    engine = lowband.distribute(model, opt, algorithm, **options)
    sched = cosine(opt, steps) if schedule else None
    it = batches(rank, world).epoch(0)
    norms = []
    for step in range(steps):
        if unfreeze != "none" and step == UNFREEZE_AT:
            model.conv.requires_grad_(True)
            if unfreeze == "rebuild":
                engine.rebuild()
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(engine.module(x), y).backward()
        if clip == "engine":
            engine.clip_grad_norm_(MAX_NORM)
        elif clip == "user":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        engine.step()
        if clip == "engine":
            norms.append(float(engine.grad_norm))
        if sched is not None:
            sched.step()
    engine.synchronize()
    out = {"params": params_of(model), "norms": norms, "hook_calls": calls[0]}
    engine.close()
    return out


def _raises(rank: int, world: int, algorithm: str, options: dict, **kwargs) -> str:
    try:
        _loop(rank, world, algorithm, options, **kwargs)
    except RuntimeError as e:
        return str(e)
    return "no error"


# -- slow references ------------------------------------------------------------------------------

def _clipped(grads: list[Optional[torch.Tensor]], params, clip: bool) -> None:
    """``grads`` become the parameters' ``.grad``, clipped as a DDP script clips them."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    if clip:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)


def _local_gradients(workers, iters) -> list[list[torch.Tensor]]:
    grads = []
    for w, it in zip(workers, iters):
        x, y = next(it)
        w.zero_grad()
        F.cross_entropy(w(x), y).backward()
        grads.append([p.grad.detach().clone() for p in w.parameters()])
    return grads


def _mean(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(g[i] for g in grads) / len(grads) for i in range(len(grads[0]))]


def reference_ssgd(world: int, clip: bool, steps: int = STEPS, schedule: bool = False) -> dict:
    """DDP + clip_grad_norm_ written out: average the workers' gradients by hand, clip the
    average, one SGD step."""
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_sgd(model)
    sched = cosine(opt, steps) if schedule else None
    params = list(model.parameters())
    iters = [batches(r, world).epoch(0) for r in range(world)]
    for _ in range(steps):
        _clipped(_mean(_local_gradients([model] * world, iters)), params, clip)
        opt.step()
        if sched is not None:
            sched.step()
    return params_of(model)


def reference_cpsgd(world: int, warmup: int, alpha: float, clip: bool, steps: int = STEPS,
                    schedule: bool = False) -> dict:
    """CP-SGD with full-precision averages (``correction_period=1``) and the plain-SGD local
    update, written out: the average of step t reaches the global weights W at step t + 1,
    clipped as the average of a DDP step, at the learning rate of step t + 1 (the last one,
    at ``synchronize()``, at the learning rate of the step that computed it); each worker's
    compute weights are W minus alpha times its own gradient, clipped on its own."""
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_sgd(model)
    sched = cosine(opt, steps) if schedule else None
    params = list(model.parameters())
    workers = [copy.deepcopy(model) for _ in range(world)]
    iters = [batches(r, world).epoch(0) for r in range(world)]
    pending, pending_lr = None, None
    for t in range(steps):
        grads = _local_gradients(workers, iters)
        if t < warmup:
            _clipped(_mean(grads), params, clip)
            opt.step()
            for w in workers:
                w.load_state_dict(model.state_dict())
        else:
            if pending is not None:
                _clipped(pending, params, clip)
                opt.step()
            for w, g in zip(workers, grads):
                local = [x.clone() for x in g]
                if clip:
                    lowband.algorithms.base.GradientClip(MAX_NORM).apply(local)
                with torch.no_grad():
                    for wp, gp, x in zip(w.parameters(), params, local):
                        wp.copy_(gp - alpha * x)
            pending, pending_lr = _mean(grads), opt.param_groups[0]["lr"]
        if sched is not None:
            sched.step()
    if pending is not None:
        opt.param_groups[0]["lr"] = pending_lr
        _clipped(pending, params, clip)
        opt.step()
    return params_of(model)


def reference_localsgd(world: int, warmup: int, period: int, clip: bool, steps: int = STEPS) -> dict:
    """Post-local SGD written out: warm-up steps average the gradients (clipped as DDP's
    average), local steps clip each worker's own gradient, and every ``period`` local steps
    the parameters are averaged; ``synchronize()`` averages what is left apart."""
    torch.manual_seed(0)
    model = SmallNet()
    workers = [copy.deepcopy(model) for _ in range(world)]
    opts = [make_sgd(w) for w in workers]
    iters = [batches(r, world).epoch(0) for r in range(world)]
    for t in range(steps):
        grads = _local_gradients(workers, iters)
        if t < warmup:
            grads = [_mean(grads)] * world
        for w, o, g in zip(workers, opts, grads):
            _clipped(g, list(w.parameters()), clip)
            o.step()
        if t >= warmup and (t - warmup) % period == 0 or t == steps - 1:
            with torch.no_grad():
                for ps in zip(*(w.parameters() for w in workers)):
                    avg = sum(p.detach() for p in ps) / world
                    for p in ps:
                        p.copy_(avg)
    return params_of(workers[0])


# -- 1. clipping ------------------------------------------------------------------------------------

def _ssgd_runs(rank: int, world: int) -> dict:
    return {"engine": _loop(rank, world, "ssgd", {"bucket_mb": 0.01}, clip="engine"),
            "user": _raises(rank, world, "ssgd", {"bucket_mb": 0.01}, clip="user")}


def test_ssgd_clipping_is_ddp_clipping_of_the_averaged_gradient():
    results = run_distributed(_ssgd_runs, 2)
    clipped, unclipped = reference_ssgd(2, clip=True), reference_ssgd(2, clip=False)
    assert max_rel_err(clipped, unclipped) > 1e-2          # the clipping bites
    for r in results:
        assert max_rel_err(r["engine"]["params"], clipped) <= 1e-5
        assert all(n > MAX_NORM for n in r["engine"]["norms"])
        assert r["user"] == ("gradients were changed between backward() and step() (e.g. clip_grad_norm_); "
                             "under ssgd call engine.clip_grad_norm_(max_norm) instead")
    assert max_rel_err(results[1]["engine"]["params"], results[0]["engine"]["params"]) == 0.0


def _prehook_clip(opt, model) -> None:
    """The reference for "clip what the optimizer step applies": torch's clip_grad_norm_ in
    an optimizer step pre-hook, on whatever ``.grad`` the algorithm handed the optimizer."""
    opt.register_step_pre_hook(lambda *_: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM) and None)


def _prehook_loop(rank: int, world: int, algorithm: str, options: dict, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_sgd(model)
    _prehook_clip(opt, model)
    engine = lowband.distribute(model, opt, algorithm, **options)
    it = batches(rank, world).epoch(0)
    for _ in range(steps):
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(engine.module(x), y).backward()
        engine.step()
    engine.synchronize()
    engine.close()
    return params_of(model)


COMPRESSED = {"warmup_steps": 2, "bucket_mb": 0.01}
LAZY = {"lazy_layers": 1, "window_step": "sum"}


def _compressed_and_lazy_runs(rank: int, world: int) -> dict:
    return {"compressed": (_loop(rank, world, "compressed", COMPRESSED, clip="engine")["params"],
                           _prehook_loop(rank, world, "compressed", COMPRESSED),
                           _raises(rank, world, "compressed", COMPRESSED, clip="user")),
            "lazy": (_loop(rank, world, "lazy", LAZY, clip="engine", steps=12)["params"],
                     _prehook_loop(rank, world, "lazy", LAZY, steps=12),
                     _raises(rank, world, "lazy", LAZY, clip="user")),
            "lazy_tau1": _loop(rank, world, "lazy", {"lazy_layers": 1, "tau_max": 1}, clip="engine")["params"]}


def test_compressed_and_lazy_clip_the_gradient_their_optimizer_step_applies():
    """compressed: the decoded average (DDP's meaning for its average); lazy: what the step
    applies (the regular layers' average, and the window's sum on sync steps and at
    synchronize()), which at tau = 1 is DDP's clipping of the average."""
    results = run_distributed(_compressed_and_lazy_runs, 2)
    for r in results:
        for name in ("compressed", "lazy"):
            ours, reference, user = r[name]
            assert max_rel_err(ours, reference) == 0.0, name
            assert user == ("gradients were changed between backward() and step() (e.g. clip_grad_norm_); "
                            f"under {name} call engine.clip_grad_norm_(max_norm) instead")
        assert max_rel_err(r["lazy_tau1"], reference_ssgd(2, clip=True)) <= 1e-5
    for name in ("compressed", "lazy"):
        assert max_rel_err(results[0][name][0], results[1][name][0]) == 0.0, name
    assert max_rel_err(results[0]["lazy_tau1"], results[1]["lazy_tau1"]) == 0.0


CPSGD = {"warmup_steps": 3, "correction_period": 1, "local_update": "sgd", "local_lr": 0.1, "bucket_mb": 0.01}


def _cpsgd_runs(rank: int, world: int) -> dict:
    return {"clip": _loop(rank, world, "cpsgd", CPSGD, clip="engine")["params"],
            "cosine": _loop(rank, world, "cpsgd", CPSGD, schedule=True)["params"],
            "clip_cosine": _loop(rank, world, "cpsgd", CPSGD, clip="engine", schedule=True)["params"],
            "user": _raises(rank, world, "cpsgd", CPSGD, clip="user")}


def test_cpsgd_clips_average_and_local_update_and_drains_at_the_lr_of_its_step():
    """The global step clips the average it applies (with the request of the step that
    computed it), the look-ahead clips the worker's own gradient; synchronize() applies the
    in-flight average at the learning rate of the step that computed it (cosine ends at 0)."""
    results = run_distributed(_cpsgd_runs, 2)
    clip, cosine_ref = reference_cpsgd(2, 3, 0.1, clip=True), reference_cpsgd(2, 3, 0.1, clip=False, schedule=True)
    assert max_rel_err(clip, reference_cpsgd(2, 3, 0.1, clip=False)) > 1e-2
    for r in results:
        assert max_rel_err(r["clip"], clip) <= 1e-5
        assert max_rel_err(r["cosine"], cosine_ref) <= 1e-5
        assert max_rel_err(r["clip_cosine"], reference_cpsgd(2, 3, 0.1, clip=True, schedule=True)) <= 1e-5
        assert r["user"].startswith("gradients were changed between backward() and step()")
        assert "under cpsgd call engine.clip_grad_norm_(max_norm)" in r["user"]
    for key in ("clip", "cosine", "clip_cosine"):
        assert max_rel_err(results[0][key], results[1][key]) == 0.0


LOCALSGD = {"warmup_steps": 2, "period": 3}


def _localsgd_runs(rank: int, world: int) -> dict:
    return {"engine": _loop(rank, world, "localsgd", LOCALSGD, clip="engine")["params"],
            "plain": _loop(rank, world, "localsgd", LOCALSGD)["params"]}


def test_localsgd_clips_the_average_in_warmup_and_the_local_gradient_after():
    results = run_distributed(_localsgd_runs, 2)
    clipped = reference_localsgd(2, 2, 3, clip=True)
    assert max_rel_err(clipped, reference_localsgd(2, 2, 3, clip=False)) > 1e-2
    for r in results:
        assert max_rel_err(r["engine"], clipped) <= 1e-5
        assert max_rel_err(r["plain"], reference_localsgd(2, 2, 3, clip=False)) <= 1e-5
    assert max_rel_err(results[0]["engine"], results[1]["engine"]) == 0.0


def _peer_runs(rank: int, world: int) -> dict:
    out = {}
    for name in ("ddp", "ddp-fp16", "ddp-powersgd"):
        options = {"start_powerSGD_iter": 2} if name == "ddp-powersgd" else {}
        out[name] = (_loop(rank, world, name, options, clip="engine")["params"],
                     _loop(rank, world, name, options, clip="user")["params"])
    return out


def test_ddp_peers_clip_as_ddp_and_take_the_users_own_clipping():
    """DDP averages during backward, so the user's clip_grad_norm_ already has DDP's meaning
    there: engine.clip_grad_norm_ gives the same bits."""
    results = run_distributed(_peer_runs, 2)
    clipped = reference_ssgd(2, clip=True)
    for r in results:
        for name, (engine_clip, user_clip) in r.items():
            assert max_rel_err(engine_clip, user_clip) == 0.0, name
        assert max_rel_err(r["ddp"][0], clipped) <= 1e-5


def _bad_requests(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    model = SmallNet()
    engine = lowband.distribute(model, make_sgd(model), "ssgd")
    out = []
    for args in ((-1.0,), (float("inf"),), ("x",), (1.0, 0.0)):
        try:
            engine.clip_grad_norm_(*args)
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    engine.close()
    return out


def test_bad_clip_requests_are_refused_with_one_line():
    for line in run_distributed(_bad_requests, 1)[0]:
        assert line.startswith("clip_grad_norm_: max_norm") and "\n" not in line


# -- 2. requires_grad changed mid-run ------------------------------------------------------------------

UNFREEZE = {"ssgd": {"bucket_mb": 0.01}, "compressed": COMPRESSED, "cpsgd": CPSGD, "lazy": LAZY,
            "localsgd": LOCALSGD}


def _unfreeze_runs(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    before = SmallNet().conv.weight.detach().clone()
    out = {"before": before}
    for name, options in UNFREEZE.items():
        out[name] = (_loop(rank, world, name, options, unfreeze="rebuild", steps=10)["params"],
                     _raises(rank, world, name, options, unfreeze="bare", steps=10))
    out["ddp"] = _raises(rank, world, "ddp", {}, unfreeze="bare", steps=10)
    return out


def reference_ssgd_unfrozen(world: int, steps: int) -> dict:
    """ssgd's reference with conv frozen for UNFREEZE_AT steps."""
    torch.manual_seed(0)
    model = SmallNet()
    model.conv.requires_grad_(False)
    opt = make_sgd(model)
    iters = [batches(r, world).epoch(0) for r in range(world)]
    for t in range(steps):
        if t == UNFREEZE_AT:
            model.conv.requires_grad_(True)
        grads = []
        for it in iters:
            x, y = next(it)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = None if grads[0][i] is None else sum(g[i] for g in grads) / world
        opt.step()
    return params_of(model)


def test_unfreezing_mid_run_rebuilds_or_refuses_and_replicas_never_diverge():
    results = run_distributed(_unfreeze_runs, 2)
    for name in UNFREEZE:
        for r in results:
            params, bare = r[name]
            assert not torch.equal(params["conv.weight"], r["before"]), name       # it trained after unfreezing
            assert bare == ("requires_grad of parameter 'conv.weight' changed to True after "
                            f"{name} was bound to the model; call engine.rebuild() on every rank after changing "
                            "requires_grad, before the next backward"), name
        assert max_rel_err(results[0][name][0], results[1][name][0]) == 0.0, name
    for r in results:
        assert max_rel_err(r["ssgd"][0], reference_ssgd_unfrozen(2, 10)) <= 1e-5
        assert r["ddp"].startswith("requires_grad of parameter 'conv.weight' changed to True after ddp")


def _rebuild_under_ddp(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = SmallNet()
    engine = lowband.distribute(model, make_sgd(model), "ddp")
    try:
        engine.rebuild()
        return "rebuilt"
    except RuntimeError as e:
        return str(e)
    finally:
        engine.close()


def test_rebuild_under_a_module_wrapper_is_refused():
    assert run_distributed(_rebuild_under_ddp, 1)[0] == (
        "engine.rebuild() is not available under ddp, whose module wrapper is built for the old parameters: "
        "call engine.close() and lowband.distribute() again")


# -- 4. optimizers ----------------------------------------------------------------------------------------

class TickingSGD(torch.optim.Optimizer):
    """SGD with momentum and weight decay (torch's single-tensor update) that counts its steps
    in its param group, as optimizers that keep a schedule there do; not a torch.optim.SGD,
    so CP-SGD's tentative step takes the generic path. (Subclassing SGD would make torch run
    the step hooks twice per step: both classes' step() are wrapped.)"""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            g["ticks"] = g.get("ticks", 0) + 1
            for p in g["params"]:
                if p.grad is None:
                    continue
                d = p.grad.add(p, alpha=g["weight_decay"]) if g["weight_decay"] else p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = d.clone()
                else:
                    state["momentum_buffer"].mul_(g["momentum"]).add_(d)
                p.add_(state["momentum_buffer"], alpha=-g["lr"])


def _generic_cpsgd(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = SmallNet()
    opt = TickingSGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    calls = {"pre": 0, "post": 0}
    opt.register_step_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    opt.register_step_post_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    engine = lowband.distribute(model, opt, "cpsgd", **CPSGD)
    assert engine.bound.tentative.kind is None          # the generic path
    it = batches(rank, world).epoch(0)
    seen = []
    for _ in range(STEPS):
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(engine.module(x), y).backward()
        engine.step()
        engine.global_model()                           # a tentative step for evaluation
        seen.append((calls["pre"], calls["post"], opt.param_groups[0]["ticks"]))
    engine.synchronize()
    seen.append((calls["pre"], calls["post"], opt.param_groups[0]["ticks"]))
    engine.close()
    return {"seen": seen, "params": params_of(model)}


def test_cpsgd_generic_path_fires_step_hooks_once_per_step_and_restores_param_groups():
    """Each global step is one optimizer step (hooks, the param group's counter); the
    look-ahead and the evaluation's tentative steps leave no trace. The pipeline's first
    step has no average to apply yet, and synchronize() applies the last one."""
    results = run_distributed(_generic_cpsgd, 2)
    warmup = CPSGD["warmup_steps"]
    expected = [(t + 1, t + 1, t + 1) if t < warmup else (t, t, t) for t in range(STEPS)] + [(STEPS,) * 3]
    for r in results:
        assert r["seen"] == expected
    assert max_rel_err(results[0]["params"], reference_cpsgd(2, 3, 0.1, clip=False)) <= 1e-5


def test_tentative_generic_step_leaves_optimizer_as_found():
    from lowband.optim.tentative import TentativeStep
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = TickingSGD(params, lr=0.1, momentum=0.9)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    for p in params:
        p.grad = torch.randn(5)
    opt.step()
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    out = [torch.empty(5) for _ in params]
    TentativeStep(opt, params).step([p.detach().clone() for p in params], [torch.randn(5) for _ in params], out)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    for p in params:
        assert all(torch.equal(opt.state[p][k], v) for k, v in state[id(p)].items())
    assert calls == [1]


def _lbfgs(rank: int, world: int) -> list[str]:
    out = []
    for make in (lambda ps: torch.optim.LBFGS(ps), lambda ps: torch.optim.SparseAdam(ps)):
        model = SmallNet()
        try:
            lowband.distribute(model, make(model.parameters()), "ssgd")
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    return out


def test_closure_and_sparse_optimizers_are_refused_at_distribute():
    lbfgs, sparse = run_distributed(_lbfgs, 1)[0]
    assert lbfgs.startswith("LBFGS needs a closure") and "\n" not in lbfgs
    assert sparse.startswith("SparseAdam needs sparse gradients") and "\n" not in sparse


#: every torch.optim optimizer that distribute() accepts (LBFGS and SparseAdam are refused)
OPTIMIZERS = sorted(n for n, c in vars(torch.optim).items() if isinstance(c, type) and
                    issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer and
                    n not in ("LBFGS", "SparseAdam"))
SHORT = {"ssgd": {}, "compressed": {"warmup_steps": 1}, "cpsgd": {"warmup_steps": 1, "correction_period": 2},
         "lazy": {"lazy_layers": 1}, "localsgd": {"warmup_steps": 1, "period": 2}}


def _every_optimizer(rank: int, world: int) -> dict:
    out = {}
    for name in OPTIMIZERS:
        for algorithm, options in SHORT.items():
            torch.manual_seed(0)
            model = SmallNet()
            # Muon takes 2-D matrices only (a script gives the rest to another optimizer)
            params = [p for p in model.parameters() if p.dim() == 2] if name == "Muon" else model.parameters()
            opt = getattr(torch.optim, name)(params, lr=1e-2)
            engine = lowband.distribute(model, opt, algorithm, **options)
            it = batches(rank, world).epoch(0)
            for _ in range(4):
                x, y = next(it)
                opt.zero_grad()
                F.cross_entropy(engine.module(x), y).backward()
                engine.clip_grad_norm_(1.0)
                engine.step()
            engine.synchronize()
            engine.close()
            out[name, algorithm] = params_of(model)
    return out


def test_every_torch_optimizer_trains_with_every_lowband_algorithm():
    results = run_distributed(_every_optimizer, 2, timeout_s=240.0)
    torch.manual_seed(0)
    start = params_of(SmallNet())
    for key, params in results[0].items():
        assert max_rel_err(params, results[1][key]) == 0.0, key
        assert max_rel_err(params, start) > 0.0, key


# -- 5. GradScaler through engine.step(scaler=...), as a DDP script (every algorithm: tests/test_amp.py) ----

def _scaled_loop(rank: int, world: int, algorithm: Optional[str], steps: int = STEPS, inf_at: int = 3) -> dict:
    """A DDP + GradScaler loop (``algorithm=None``: torch's DDP itself) with an inf in rank
    1's loss at step ``inf_at``; the scale starts high enough to back off once more."""
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    if algorithm is None:
        forward, step = torch.nn.parallel.DistributedDataParallel(model), lambda: scaler.step(opt)
    else:
        engine = lowband.distribute(model, opt, algorithm, nonfinite="off")
        forward, step = engine.module, lambda: engine.step(scaler=scaler)
    it = batches(rank, world).epoch(0)
    scales = []
    for t in range(steps):
        x, y = next(it)
        opt.zero_grad()
        loss = F.cross_entropy(forward(x), y)
        if t == inf_at and rank == 1:
            loss = loss + float("inf") * model.fc2.bias.sum()
        scaler.scale(loss).backward()
        step()
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": params_of(model), "scales": scales}


def _scaler_runs(rank: int, world: int) -> dict:
    out = {name: _scaled_loop(rank, world, name) for name in ("ssgd", "ddp")}
    out["torch"] = _scaled_loop(rank, world, None)
    out["no_inf"] = _scaled_loop(rank, world, "ssgd", inf_at=-1)
    refused = {}
    for name, kwargs in (("compressed", {"nonfinite": "off"}), ("ssgd", {})):
        torch.manual_seed(0)
        model = SmallNet()
        opt = make_sgd(model)
        engine = lowband.distribute(model, opt, name, **kwargs)
        x, y = next(batches(rank, world).epoch(0))
        F.cross_entropy(engine.module(x), y).backward()
        try:
            engine.step(scaler=torch.amp.GradScaler("cpu"))
            refused[name] = "accepted"
        except ValueError as e:
            refused[name] = str(e)
        engine.close()
    out["refused"] = refused
    return out


def test_gradscaler_skips_a_step_with_inf_on_every_rank_as_ddp_does():
    results = run_distributed(_scaler_runs, 2)
    for r in results:
        for name in ("ssgd", "ddp"):
            assert r[name]["scales"] == r["torch"]["scales"], name
            assert max_rel_err(r[name]["params"], r["torch"]["params"]) <= 1e-5, name
        # the inf step backed off (scale halved) and was skipped: the run without it differs
        assert r["torch"]["scales"][3] == r["torch"]["scales"][2] / 2
        assert max_rel_err(r["no_inf"]["params"], r["ssgd"]["params"]) > 1e-3
        # compressed takes the scaler through distribute(), before backward (tests/test_amp.py)
        assert r["refused"]["compressed"].startswith("compressed takes a GradScaler through lowband.distribute(")
        assert r["refused"]["ssgd"].startswith("engine.step(scaler=...) needs lowband.distribute(..., nonfinite='off')")
    assert max_rel_err(results[0]["ssgd"]["params"], results[1]["ssgd"]["params"]) == 0.0
