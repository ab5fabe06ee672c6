"""Mixed precision with every registered algorithm (issue 53, item 5): a ``torch.amp.GradScaler``
handed to ``lowband.distribute`` and bf16 autocast around the forward, at 2 ranks on gloo.

For each algorithm, one run with the scaler (its scale grows every ``GROWTH_INTERVAL`` steps and
backs off once, after an inf in rank 1's gradient at step ``INF_AT``) against the same run in
fp32 units without a scaler, where the same step is skipped by the engine's own guard
(``nonfinite="skip"``):

(a) the inf step is skipped on every rank (no parameter or optimizer state changes, also on
    the rank whose gradient was finite) and the scale halves on every rank; ``ddp-powersgd``,
    whose comm hook has already folded the inf into its error feedback and factors during
    backward (checked), holds the state it had before the step again (no trace);
(b) the scaled run ends where the unscaled one does, within the algorithm's tolerance
    (:data:`TOLERANCE`);
(c) the replicas hold what the algorithm promises bit for bit (``engine.check_replicas()``), and
    after ``synchronize()`` every rank holds the same model.

The model is a tiny language model whose input embedding is the output head's weight, so that
``lazy`` with ``tied="split"`` holds a gradient outside ``.grad`` (captured by the engine and
unscaled with the others).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import lowband
from lowband.algorithms import ALGORITHMS
from lowband.comm.agreement import ReplicaMismatchError

from .distributed import run_distributed
from .training import SHORT_SCHEDULES, max_rel_err, params_of

VOCAB, DIM, SEQ, BATCH = 32, 16, 8, 4
STEPS, INF_AT = 10, 5
INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 10, 2

#: options that make every algorithm's own machinery (compression, pipeline, windows, local
#: steps, rounds, syncs) run within STEPS steps, with the inf step inside it
OPTIONS: dict[str, dict] = {
    **SHORT_SCHEDULES,
    "lazy": {"lazy_layers": 1, "tied": "split"},
    "diloco": {"sync_every": 4, "timeout_s": 30.0},
    "streaming-diloco": {"sync_every": 4, "fragments": 2, "timeout_s": 30.0},
}
#: ranks whose gradient holds the inf. ``noop`` shares nothing, so each rank's scaler decides on
#: its own gradient alone; every rank gets the inf there, so its reference (the guard, which
#: skips on every rank) skips the same step
INF_RANKS = {"noop": (0, 1)}
#: (b): largest relative error of any parameter between the scaled and the unscaled run, after
#: the scale changed six times (doubled five times, halved once). The scale is a power of two,
#: and multiplying by one is exact in fp32 and bf16 alike (no value here comes near their
#: range's ends), so the unscaled gradient is the fp32 run's bit for bit, and so is everything
#: an algorithm computes from it: codes, residuals, windows, local and outer steps, PowerSGD's
#: factors and error feedback (its hook compresses the unscaled bucket). 0 then.
#: ``ddp-fp16`` sends the *scaled* average in fp16 (the scaler unscales after the all-reduce, as
#: with torch's DDP): an element under fp16's normal range (6e-5) loses mantissa bits in the
#: unscaled run and keeps them in the scaled one, so the few such elements round differently
#: (3e-8 of the parameters' norm here); 1e-5 leaves room for other data and stays far below
#: what a gradient left scaled or a step not skipped does (relative errors of 1e2 and more)
TOLERANCE: dict[str, float] = {"ddp-fp16": 1e-5}


class TiedLM(nn.Module):
    """Embedding -> linear -> head tied to the embedding: a tiny byte-level language model."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters and every tensor of the optimizer's state, copied."""
    out = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if torch.is_tensor(v)]
    return out


def _powersgd_state(engine: "lowband.Engine") -> dict:
    """``ddp-powersgd``'s state as it checkpoints it (a skipped step's changes put back first)."""
    return engine.state_dict()["algorithm"]


def _same(a, b) -> bool:
    """Nested dicts, lists, tensors and numbers equal bit for bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def _run(rank: int, world: int, algorithm: str, scaled: bool, poisoned: bool = True) -> dict:
    """STEPS steps of a bf16-autocast loop; with ``scaled``, through a GradScaler (else the
    guard skips the inf step). With ``poisoned``, an inf goes into ``mid``'s gradients at
    INF_AT (its weight is a matrix ``ddp-powersgd`` compresses, its bias one it does not).
    ``ddp-powersgd``'s state is read around the inf step in the scaled run only: the unscaled
    one puts the skipped step back at the next backward, untouched by the test."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    options = OPTIONS.get(algorithm, {})
    if scaled:
        engine = lowband.distribute(model, opt, algorithm, nonfinite="off", scaler=scaler, **options)
    else:
        engine = lowband.distribute(model, opt, algorithm, nonfinite="skip", **options)
    out: dict = {"returned": [], "scales": []}
    for t in range(STEPS):
        x, y = _batch(rank, t)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = engine.module(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        watch = t == INF_AT and scaled and algorithm == "ddp-powersgd"
        if t == INF_AT:
            before = _state(model, opt)
            if watch:
                algorithm_before = _powersgd_state(engine)
            if poisoned and rank in INF_RANKS.get(algorithm, (1,)):
                loss = loss + math.inf * (model.mid.weight.sum() + model.mid.bias.sum())
        (scaler.scale(loss) if scaled else loss).backward()
        out["returned"].append(engine.step())
        if scaled:
            scaler.update()
            out["scales"].append(scaler.get_scale())
        if t == INF_AT:
            out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
        if watch:
            s = engine.bound.state   # what the hook left: the inf reached every rank's memories
            out["poisoned"] = {kind: not all(bool(v.isfinite().all()) for v in memory.values())
                               for kind, memory in (("error", s.error_dict), ("p", s.p_memory_dict),
                                                    ("q", s.q_memory_dict))}
            out["no trace"] = _same(_powersgd_state(engine), algorithm_before)
    try:
        engine.check_replicas()
        out["replicas"] = "identical"
    except ReplicaMismatchError as e:
        out["replicas"] = str(e)
    out["trained"] = params_of(model)
    engine.synchronize()
    out["final"] = params_of(model)
    engine.close()
    return out


def _refusals(rank: int, world: int) -> dict[str, str]:
    """One line for each scaler lowband cannot take."""
    def attempt(algorithm: str, at_step: bool, **kwargs) -> str:
        torch.manual_seed(0)
        model = TiedLM()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        try:
            if not at_step:
                lowband.distribute(model, opt, algorithm, scaler=scaler, **kwargs).close()
                return "accepted"
            engine = lowband.distribute(model, opt, algorithm, **kwargs)
            x, y = _batch(rank, 0)
            scaler.scale(F.cross_entropy(engine.module(x).flatten(0, 1), y.flatten())).backward()
            try:
                engine.step(scaler=scaler)
            finally:
                engine.close()
            return "accepted"
        except ValueError as e:
            return str(e)

    return {"powersgd at step": attempt("ddp-powersgd", True, nonfinite="off", **OPTIONS["ddp-powersgd"]),
            "guarded": attempt("compressed", False),
            "compressed at step": attempt("compressed", True, nonfinite="off"),
            "ssgd at step": attempt("ssgd", True, nonfinite="off")}


def _all_runs(rank: int, world: int) -> dict:
    out = {}
    for name in ALGORITHMS:
        out[name] = {"scaled": _run(rank, world, name, True), "reference": _run(rank, world, name, False)}
    out["refused"] = _refusals(rank, world)
    return out


def expected_scales() -> list[float]:
    """GradScaler's scale after each step's ``update()``: doubled after GROWTH_INTERVAL finite
    steps in a row, halved after the inf step."""
    scale, finite, out = INIT_SCALE, 0, []
    for t in range(STEPS):
        if t == INF_AT:
            scale, finite = scale / 2, 0
        else:
            finite += 1
            if finite == GROWTH_INTERVAL:
                scale, finite = scale * 2, 0
        out.append(scale)
    return out


def test_gradscaler_with_every_algorithm():
    results = run_distributed(_all_runs, 2, timeout_s=150)
    for name in ALGORITHMS:
        for rank, r in enumerate(results):
            scaled, reference = r[name]["scaled"], r[name]["reference"]
            where = (name, rank)
            # (a) skipped on every rank, nothing changed, the scale halved; the engine reports the
            # skip where it decided it (the algorithms that take the scaler in their own step
            # call scaler.step, which skips the optimizer step without telling)
            assert scaled["unchanged"], where
            assert scaled["scales"] == expected_scales(), (where, scaled["scales"])
            assert scaled["returned"][INF_AT] is (name in ("ssgd", "noop", "ddp", "ddp-fp16")), where
            assert reference["returned"][INF_AT] is False and reference["unchanged"], where
            if name == "ddp-powersgd":
                assert scaled["poisoned"] == {"error": True, "p": True, "q": True}, where
                assert scaled["no trace"], where
            # (b) the scaled run ends where the fp32 run ends, within the algorithm's tolerance
            tolerance = TOLERANCE.get(name, 0.0)
            for key in ("trained", "final"):
                assert all(bool(v.isfinite().all()) for v in scaled[key].values()), (where, key)
                err = max_rel_err(scaled[key], reference[key])
                assert err <= tolerance, (where, key, err)
            # (c) what the algorithm replicates is identical on every rank
            assert scaled["replicas"] == "identical", (where, scaled["replicas"])
        assert max_rel_err(results[0][name]["scaled"]["final"], results[1][name]["scaled"]["final"]) == 0.0, name
    for r in results:
        refused = r["refused"]
        assert refused["powersgd at step"].startswith(
            "ddp-powersgd takes a GradScaler through lowband.distribute(..., scaler=scaler"), refused
        assert refused["guarded"].startswith("lowband.distribute(..., scaler=...) needs nonfinite='off'"), refused
        assert refused["compressed at step"].startswith(
            "compressed takes a GradScaler through lowband.distribute(..., scaler=scaler"), refused
        assert refused["ssgd at step"] == "accepted", refused
        assert all("\n" not in line for line in refused.values()), refused
