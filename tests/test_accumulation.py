"""Gradient accumulation over micro-batches (``Engine.no_sync``), for every algorithm at 2 ranks.

The reference is the same micro-batches' losses summed into one backward: two forwards, one
backward. With two micro-batches each parameter's accumulated gradient is ``g1 + g2`` either
way (one float add, which commutes), so every algorithm's trajectory must be bit for bit the
same, well past its warm-up. A parameter used only by the first micro-batch reaches the
algorithm at ``step()`` (its hook fired inside the block); without that hand-over its gradient
would be dropped and the parameter would not move.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowband
from lowband import NonFiniteGradientError
from lowband.app import checkpoint, cli
from lowband.algorithms.peers.diloco import torchft_unavailable
from lowband.app.config import TrainConfig
from lowband.app.train import forward_backward

from . import cli_runs
from .distributed import run_distributed
from .test_lazy import TiedLM, VOCAB, SEQ
from .training import SHORT_SCHEDULES, SmallNet, batches, make_optimizer, max_rel_err, params_of

STEPS = 10          # past every short warm-up (2) and several of cpsgd's correction periods (3)
MICRO = 2


class FirstMicroOnly(SmallNet):
    """SmallNet with a head that only the first micro-batch of a step uses."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(10, 10)
        self.use_extra = True

    def forward(self, x):
        out = super().forward(x)
        return out + self.extra(out) if self.use_extra else out


def _lm_batches(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    while True:
        tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def _train(rank: int, world: int, algorithm: str, options: dict, how: str, model_kind: str = "small",
           nonfinite: str = "raise", poison_at: int = 0, zeroing: str = "none") -> dict:
    """``STEPS`` steps of ``MICRO`` micro-batches: ``how="no_sync"`` accumulates them through
    ``engine.no_sync()``, ``"summed"`` sums their losses into one backward. ``poison_at``: at
    that step rank 0's first micro-batch (inside the block) gets a NaN. ``zeroing``: "none"
    sets the gradients to None before each step, "zeros" zeroes them in place (where the last
    step left them: the bucket's views, or the gradients the average was decoded into)."""
    torch.manual_seed(0)
    model = {"small": SmallNet, "first-only": FirstMicroOnly, "lm": TiedLM}[model_kind]()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, algorithm, nonfinite=nonfinite, **options)
    it = _lm_batches(rank) if model_kind == "lm" else batches(rank, world).epoch(0)
    for step in range(1, STEPS + 1):
        x, y = next(it)
        xs, ys = x.chunk(MICRO), y.chunk(MICRO)
        opt.zero_grad(set_to_none=zeroing == "none")

        def micro(m: int) -> torch.Tensor:
            if model_kind == "first-only":
                model.use_extra = m == 0
            loss = _loss(engine.module(xs[m]), ys[m]) / MICRO
            if step == poison_at and m == 0 and rank == 0:
                loss = loss + float("nan") * model.fc1.weight.sum()
            return loss

        if how == "no_sync":
            with engine.no_sync():
                for m in range(MICRO - 1):
                    micro(m).backward()
            micro(MICRO - 1).backward()
        else:
            sum(micro(m) for m in range(MICRO)).backward()
        engine.step()
    engine.synchronize()
    engine.close()
    return params_of(model)


#: (case, algorithm, options, model); every algorithm, the late hand-over for those that
#: launch from gradient hooks, the lazy update's tied weight split (its aliases accumulate)
CASES = [
    ("ssgd", "ssgd", {}, "small"),
    ("ssgd-unguarded", "ssgd", {"nonfinite": "off"}, "small"),
    ("ssgd-skip", "ssgd", {"nonfinite": "skip"}, "small"),            # the guard defers the hooks
    ("compressed", "compressed", SHORT_SCHEDULES["compressed"], "small"),
    ("ssgd-views-zeros", "ssgd", {"gradient_as_bucket_view": True, "zeroing": "zeros"}, "small"),
    ("compressed-zeros", "compressed", {**SHORT_SCHEDULES["compressed"], "zeroing": "zeros"}, "small"),
    ("compressed-two-stage", "compressed", {**SHORT_SCHEDULES["compressed"], "collective": "two-stage"}, "small"),
    ("cpsgd", "cpsgd", SHORT_SCHEDULES["cpsgd"], "small"),
    ("lazy", "lazy", {"lazy_layers": 1}, "small"),
    ("localsgd", "localsgd", SHORT_SCHEDULES["localsgd"], "small"),
    ("cp-diloco", "cp-diloco", {**SHORT_SCHEDULES["cp-diloco"], "warmup_steps": 1}, "small"),
    ("cp-diloco-late", "cp-diloco", {**SHORT_SCHEDULES["cp-diloco"], "warmup_steps": 2}, "first-only"),
    ("noop", "noop", {}, "small"),
    ("ddp", "ddp", {}, "small"),
    ("ddp-fp16", "ddp-fp16", {}, "small"),
    ("ddp-powersgd", "ddp-powersgd", SHORT_SCHEDULES["ddp-powersgd"], "small"),
    ("ssgd-late", "ssgd", {}, "first-only"),
    ("compressed-late", "compressed", SHORT_SCHEDULES["compressed"], "first-only"),
    ("cpsgd-late", "cpsgd", SHORT_SCHEDULES["cpsgd"], "first-only"),
    ("compressed-skip-late", "compressed", {**SHORT_SCHEDULES["compressed"], "nonfinite": "skip"}, "first-only"),
    ("lazy-late", "lazy", {"lazy_layers": 1}, "first-only"),
    ("lazy-tied-split", "lazy", {"lazy_layers": 2, "tied": "split"}, "lm"),
]
if torchft_unavailable() is None:      # the torchft peers: inner steps on the accumulated gradient
    CASES += [("diloco", "diloco", {"sync_every": 4, "timeout_s": 30.0}, "small"),
              ("streaming-diloco", "streaming-diloco",
               {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "timeout_s": 30.0}, "small")]


def _errors(rank: int, world: int) -> dict:
    """The refusals: step() inside the block; two backwards without it; a NaN inside it."""
    out = {}
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, "ssgd")
    x, y = next(batches(rank, world).epoch(0))
    with engine.no_sync():
        _loss(engine.module(x), y).backward()
        try:
            engine.step()
        except RuntimeError as e:
            out["step_inside"] = str(e)
    _loss(engine.module(x), y).backward()
    engine.step()                      # the block's gradient and this one, as one step
    opt.zero_grad()
    _loss(engine.module(x), y).backward()
    try:
        _loss(engine.module(x), y).backward()
    except RuntimeError as e:
        out["twice"] = str(e)
    engine.close()
    # micro-batches given up (zero_grad before any step): nothing of them reaches the step
    torch.manual_seed(0)
    model = FirstMicroOnly()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, "compressed", warmup_steps=0)
    before = model.extra.weight.detach().clone()
    with engine.no_sync():
        _loss(engine.module(x), y).backward()           # the head is used here only
    opt.zero_grad()
    model.use_extra = False
    _loss(engine.module(x), y).backward()
    engine.step()
    out["given_up"] = torch.equal(model.extra.weight, before), model.extra.weight.grad is None
    engine.close()
    for algorithm in ("ssgd", "compressed", "cpsgd"):
        try:
            _train(rank, world, algorithm, SHORT_SCHEDULES.get(algorithm, {}), "no_sync", poison_at=5)
            out[f"nan-{algorithm}"] = None
        except NonFiniteGradientError as e:
            out[f"nan-{algorithm}"] = (e.step, str(e))
    return out


def _suite(rank: int, world: int) -> dict:
    out = {}
    for case, algorithm, options, model_kind in CASES:
        options = dict(options)
        nonfinite, zeroing = options.pop("nonfinite", "raise"), options.pop("zeroing", "none")
        out[case] = tuple(_train(rank, world, algorithm, options, how, model_kind, nonfinite, zeroing=zeroing)
                          for how in ("no_sync", "summed"))
    torch.manual_seed(0)
    out["initial"] = {k: params_of(m()) for k, m in (("small", SmallNet), ("first-only", FirstMicroOnly),
                                                       ("lm", TiedLM))}
    out["errors"] = _errors(rank, world)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_suite, 2, timeout_s=240)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_no_sync_equals_one_backward_of_the_summed_losses(two_ranks, case):
    model_kind = next(m for c, _, _, m in CASES if c == case)
    initial = two_ranks[0]["initial"][model_kind]
    for rank, out in enumerate(two_ranks):
        accumulated, summed = out[case]
        for name in summed:
            if model_kind == "lm":
                # the tied weight takes two contributions per micro-batch (lookup and head), so
                # the summed backward adds four in another order: equal up to rounding. A lost
                # micro-batch (a fresh alias per forward) is off by far more.
                assert max_rel_err({name: accumulated[name]}, {name: summed[name]}) < 1e-5, (rank, name)
            else:
                assert torch.equal(accumulated[name], summed[name]), (rank, name)
            assert not torch.equal(summed[name], initial[name]), (rank, name)
    if model_kind == "first-only":
        # the head used only by the first micro-batch trained: its hook fired inside the block
        assert not torch.equal(two_ranks[0][case][0]["extra.weight"], initial["extra.weight"])


def test_step_inside_no_sync_and_two_backwards_are_refused(two_ranks):
    for out in two_ranks:
        errors = out["errors"]
        assert "inside engine.no_sync()" in errors["step_inside"]
        assert "became ready twice" in errors["twice"] and "engine.no_sync()" in errors["twice"]


def test_micro_batches_given_up_with_zero_grad_reach_nothing(two_ranks):
    for out in two_ranks:
        assert out["errors"]["given_up"] == (True, True)


@pytest.mark.parametrize("algorithm", ["ssgd", "compressed", "cpsgd"])
def test_a_nan_inside_no_sync_is_caught_at_that_step(two_ranks, algorithm):
    for out in two_ranks:
        step, message = out["errors"][f"nan-{algorithm}"]
        assert step == 5 and "rank 0" in message, message


def _forward_backward(rank: int, world: int) -> dict:
    """``lowband train``'s step body with 1, 3 and 8 micro-batches of an 8-sample batch, then a
    step: how many forward passes ran, the loss it returns, the averaged gradients."""
    out = {}
    for micro in (1, 3, 8):
        torch.manual_seed(0)
        model = SmallNet()
        calls = []
        model.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[0]))
        opt = make_optimizer("sgd", model)
        engine = lowband.distribute(model, opt, "ssgd")
        x, y = next(batches(rank, world).epoch(0))
        opt.zero_grad()
        loss = forward_backward(engine, x, y, micro)
        engine.step()                                   # leaves the averaged gradients in .grad
        out[micro] = calls, float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}, loss.requires_grad
        engine.close()
    return out


def test_forward_backward_splits_the_batch_into_micro_batches():
    for out in run_distributed(_forward_backward, 2):
        calls1, loss1, grads1, _ = out[1]
        assert calls1 == [8]
        for micro, sizes in ((3, [3, 3, 2]), (8, [1] * 8)):
            calls, loss, grads, needs_grad = out[micro]
            assert calls == sizes and not needs_grad
            assert loss == pytest.approx(loss1, rel=1e-6)     # the batch's mean loss
            assert max_rel_err(grads, grads1) < 1e-5         # and its averaged gradient


def test_micro_batches_flag(tmp_path, capsys):
    run_dir = tmp_path / "run"
    done = cli_runs.train([*cli_runs.SMALL, "--algorithm", "compressed", *cli_runs.PAST_WARMUP["compressed"],
                           "--max-steps", "6", "--micro-batches", "4", "--run-dir", str(run_dir)])
    assert done.returncode == 0, done.stderr
    assert json.loads((run_dir / "config.json").read_text())["micro_batches"] == 4
    assert json.loads((run_dir / "summary.json").read_text())["micro_batches"] == 4
    for flags, message in ((["--micro-batches", "0"], "--micro-batches must be an integer >= 1, got 0"),
                           (["--micro-batches", "9", "--batch-size", "8"],
                            "--micro-batches 9 is more than the --batch-size 8 samples")):
        assert cli.main(["train", "--dataset", "synthetic", "--model", "mlp", "--max-steps", "1",
                         "--run-dir", str(tmp_path / "bad"), *flags]) == cli.EXIT_USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_micro_batches_must_match_on_resume():
    config = {**TrainConfig().__dict__, "micro_batches": 2}
    checkpoint.check_resumable({"world_size": 2, "config": dict(config)}, config, 2)
    with pytest.raises(checkpoint.CheckpointError, match="micro_batches: checkpoint 2, now 1"):
        checkpoint.check_resumable({"world_size": 2, "config": dict(config)}, {**config, "micro_batches": 1}, 2)
    # a checkpoint from before the flag held one micro-batch per step
    old = {k: v for k, v in config.items() if k != "micro_batches"}
    checkpoint.check_resumable({"world_size": 2, "config": old}, {**config, "micro_batches": 1}, 2)
    with pytest.raises(checkpoint.CheckpointError, match="micro_batches"):
        checkpoint.check_resumable({"world_size": 2, "config": old}, config, 2)
