"""cp-diloco against a slow single-process simulation of its workers (DiLoCo, then each
mechanism added: 2-bit with error feedback, the pipelined outer step, the corrections), plus
its invariants, checkpoint/resume and training."""
from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Optional

import pytest
import torch

import lowband
from lowband.algorithms import make_algorithm
from lowband.algorithms.warmup import share_bounds
from lowband.app import tasks
from lowband.codecs import ErrorFeedback, build_compressor

from .distributed import run_distributed
from .training import EmbedNet, SmallNet, batches, make_optimizer, params_of, poisoned_steps

WORLD = 2
MODELS = {"small": SmallNet, "embed": EmbedNet}


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _write(model, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def simulate(steps: int, opts: dict, kind: str = "sgd", world: int = WORLD,
             clip: Optional[float] = None, model: str = "small") -> tuple[list[dict], list[dict]]:
    """cp-diloco written out for ``world`` workers in one process, parameter by parameter:
    each worker's model and inner optimizer, the anchor of each message (the round's own and,
    with ``lazy_layers``, the lazy group's: the parameters of the named modules; with
    ``lazy_per_layer`` one group per module, each with its own tau) as a
    parameter of torch's own SGD (Nesterov) outer optimizer, per-worker error feedback through
    the codec's public compress/decompress, and the average as the mean of the decoded
    payloads, each inner step at ``inner_lr_scale`` times the rate (sqrt(world) for Adam and
    AdamW under ``"auto"``; AdamW's weight decay at its unscaled rate). ``clip``: each step's
    gradient clipped to that total norm by torch (the average in a warm-up step, each worker's
    own in an inner step). ``model="embed"``: with
    ``sparse_rows`` each row of its embedding table is averaged over the workers whose
    gradient of the row was non-zero in an inner step since the table's message was last
    sent. Returns each worker's parameters and residuals (by parameter name)."""
    cfg = make_algorithm("cp-diloco", **opts)
    H, warmup, k = cfg.sync_every, cfg.warmup_steps, cfg.correction_every
    scale = cfg.inner_lr_scale
    if scale == "auto":
        scale = math.sqrt(world) if kind in ("adam", "adamw") else 1.0
    torch.manual_seed(0)
    init = MODELS[model]()
    workers = [copy.deepcopy(init) for _ in range(world)]
    inner = [make_optimizer(kind, m) for m in workers]
    its = [batches(r, world).epoch(0) for r in range(world)]
    names = [n for n, _ in init.named_parameters()]
    shapes = [p.shape for p in init.parameters()]
    sizes = [p.numel() for p in init.parameters()]
    modules = [] if cfg.lazy_layers is None else [m.strip() for m in cfg.lazy_layers.split(",")]
    is_lazy = [any(n.startswith(m + ".") for m in modules) for n in names]
    owner = [n.rsplit(".", 1)[0] if cfg.lazy_per_layer else "lazy" for n in names]
    lazy_groups = list(dict.fromkeys(owner[i] for i in range(len(names)) if is_lazy[i]))
    groups = ["own"] + lazy_groups
    member = {g: [i for i in range(len(names)) if (owner[i] == g if is_lazy[i] else g == "own")] for g in groups}
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    index = {g: torch.cat([torch.arange(starts[i], starts[i] + sizes[i]) for i in member[g]]) for g in groups}
    codecs = [ErrorFeedback(build_compressor(cfg.compressor, cfg.compressor_options)) for _ in range(world)]
    anchor: dict = {}
    outer: dict = {}
    base: list[Optional[torch.Tensor]] = [None] * world
    pending: dict = {}                            # group -> the average in flight
    sends = {g: 0 for g in groups}
    # each lazy group's tau, the round of its next sync, the rounds since its last, the
    # statistics of its last message, each worker's unsent progress at the last round end
    tau = {g: 1 if cfg.lazy_every == "auto" else cfg.lazy_every for g in lazy_groups}
    lazy_next, lazy_rounds = {g: 0 for g in lazy_groups}, {g: 0 for g in lazy_groups}
    lazy_stats: dict = {}
    u_prev: dict = {g: [None] * world for g in lazy_groups}
    table = names.index("table.weight") if cfg.sparse_rows and "table.weight" in names else None
    trained = [torch.zeros(shapes[table][0], dtype=torch.bool) for _ in range(world)] if table is not None else None

    def rows_averaged(D: torch.Tensor, g: str) -> torch.Tensor:
        """Group g's average with the table's rows over the workers that trained them."""
        if table is None or table not in member[g]:
            return D
        count = sum(f.long() for f in trained)
        for f in trained:
            f.zero_()
        start = sum(sizes[j] for j in member[g] if j < table)
        rows = D[start:start + sizes[table]].view(shapes[table])
        for row in range(rows.shape[0]):
            if count[row] > 0:
                rows[row] *= world / float(count[row])
        return D

    def residual(i: int, name: str) -> torch.Tensor:
        return codecs[i].residual(name) if codecs[i].has_residual(name) else None

    def average(d: list[torch.Tensor], g: str, r: int) -> torch.Tensor:
        """The mean over workers of group g's message (d: each worker's group elements)."""
        exact = k is not None and (k == 1 or (cfg.correction == "burst" and (r + 1) % k == 0))
        share = (0, 0)
        if k is not None and not exact and cfg.correction == "spread":
            share = share_bounds(sum(sizes[j] for j in member[g]), k, r % k)
        out, offset = [], 0
        for j in member[g]:
            name, shape, n = names[j], shapes[j], sizes[j]
            # this parameter's elements in the exact share (spread): averaged exactly with the
            # residual flushed into them; in the codes they are 0 with a residual of 0
            m = torch.zeros(n, dtype=torch.bool)
            m[max(share[0] - offset, 0):max(min(share[1] - offset, n), 0)] = True
            parts, exact_parts = [], []
            for i in range(world):
                x = d[i][offset:offset + n].clone()
                e = residual(i, name)
                if exact or len(shape) <= 1:
                    if exact and e is not None:
                        x += e.reshape(-1)
                        e.zero_()
                    parts.append(x)
                    continue
                flat_e = None if e is None else e.view(-1)
                exact_parts.append(x[m] + (0 if flat_e is None else flat_e[m]))
                x[m] = 0
                if flat_e is not None:
                    flat_e[m] = 0
                payload, ctx = codecs[i].compress(x.view(shape), name)
                parts.append(codecs[i].decompress(payload, ctx).reshape(-1))
            total = parts[0]
            for x in parts[1:]:
                total = total + x
            total = total / world
            if exact_parts and bool(m.any()):
                ex = exact_parts[0]
                for x in exact_parts[1:]:
                    ex = ex + x
                total[m] = ex / world
            out.append(total)
            offset += n
        return torch.cat(out)

    def apply(flights: dict, p: list[torch.Tensor]) -> None:
        """Each group's outer step, then every worker rebased onto its anchor where the
        message carried it, keeping its unsent progress p at local_weight."""
        for g, (D, r) in flights.items():
            anchor[g].grad = D.clone()
            outer[g].step()
            if g != "own" and cfg.lazy_every == "auto":
                g2, a2, d2, n = lazy_stats[g]
                if n == 1 or (d2 + g2 <= a2 and n * g2 <= a2):
                    tau[g] += 1
                elif not (d2 + g2 <= a2 or n * g2 <= a2):
                    tau[g] = max(1, tau[g] - 1)
                tau[g] = min(tau[g], cfg.max_lazy_every)
                lazy_next[g] = r + tau[g]
            for i, m in enumerate(workers):
                theta = _flat(m)
                theta[index[g]] = anchor[g].detach() - cfg.local_weight * p[i][index[g]]
                _write(m, theta)
                base[i][index[g]] = theta[index[g]] + p[i][index[g]]

    for t in range(steps):
        for m, opt, it in zip(workers, inner, its):
            x, y = next(it)
            opt.zero_grad()
            tasks.loss(m(x), y).backward()
        if t < warmup:
            for ps in zip(*[m.parameters() for m in workers]):
                g = sum(p.grad for p in ps) / world
                for p in ps:
                    p.grad = g.clone()
            for m, opt in zip(workers, inner):
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                opt.step()
            continue
        if not anchor:
            for g in groups:
                anchor[g] = torch.nn.Parameter(_flat(workers[0])[index[g]].clone())
                outer[g] = torch.optim.SGD([anchor[g]], lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                           nesterov=cfg.nesterov and cfg.outer_momentum > 0)
            base = [_flat(m).clone() for m in workers]
        for i, (m, opt) in enumerate(zip(workers, inner)):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            if table is not None:
                grad = list(m.parameters())[table].grad
                trained[i] |= grad.ne(0).any(dim=1)
            # the inner step at scale times the rate; AdamW's decay at its own rate per step
            saved = [dict(g) for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * scale
                if isinstance(opt, torch.optim.AdamW):
                    g["weight_decay"] = g["weight_decay"] / scale
            opt.step()
            for g, own in zip(opt.param_groups, saved):
                g.update(lr=own["lr"], weight_decay=own["weight_decay"])
        if (t - warmup + 1) % H:
            a = cfg.apply_after
            if cfg.pipelined and pending and a is not None and (t - warmup) % H + 1 == a:
                # the round in flight applied a steps into the next round: each worker rebased
                # onto the new anchor with its progress since the round end kept
                with torch.no_grad():
                    apply(pending, [base[i] - _flat(m) for i, m in enumerate(workers)])
                pending = {}
            continue
        r = (t - warmup) // H
        with torch.no_grad():
            d = [base[i] - _flat(workers[i]) for i in range(world)]
            if cfg.pipelined and pending:
                apply(pending, d)
                pending = {}
            sent = {}
            for g in groups:
                if g != "own" and r < lazy_next[g]:
                    continue
                sent[g] = (rows_averaged(average([x[index[g]] for x in d], g, r if g == "own" else sends[g]), g), r)
                sends[g] += 1
            for g in lazy_groups:
                if g in sent:
                    stats = []
                    for i in range(world):
                        u = d[i][index[g]].double()
                        gl = u if u_prev[g][i] is None else u - u_prev[g][i].double()
                        stats.append(torch.stack([gl.dot(gl), u.dot(u), (gl - u).dot(gl - u)]).float())
                    lazy_stats[g] = [float(v) for v in sum(stats) / world] + [lazy_rounds[g] + 1]
                    lazy_next[g], lazy_rounds[g], u_prev[g] = r + tau[g], 0, [None] * world
                else:
                    u_prev[g] = [x[index[g]].clone() for x in d]
                    lazy_rounds[g] += 1
            if not cfg.pipelined:
                apply(sent, [torch.zeros_like(x) for x in d])
                for i in range(world):
                    for g in sent:
                        base[i][index[g]] = anchor[g].detach().clone()
                continue
            for i, m in enumerate(workers):
                theta = _flat(m)
                for g in sent:
                    base[i][index[g]] = theta[index[g]]
            pending = sent
    params = [params_of(m) for m in workers]
    residuals = [{n: codecs[i].residual(n).reshape(-1).clone() for n in names if codecs[i].has_residual(n)}
                 for i in range(world)]
    return params, residuals


def _train(rank: int, world: int, opts: dict, steps: int, kind: str = "sgd", after=None,
           clip: Optional[float] = None, model: str = "small"):
    torch.manual_seed(0)
    model = MODELS[model]()
    opt = make_optimizer(kind, model)
    engine = lowband.distribute(model, opt, "cp-diloco", **opts)
    it = batches(rank, world).epoch(0)
    out = []
    for t in range(steps):
        x, y = next(it)
        opt.zero_grad()
        tasks.loss(engine.module(x), y).backward()
        if clip is not None:
            engine.clip_grad_norm_(clip)
        engine.step()
        if after is not None:
            out.append(after(t, model, engine))
    return model, opt, engine, out


def _run_plain(rank: int, world: int, opts: dict, steps: int, kind: str, clip: Optional[float] = None,
               model: str = "small"):
    model, _, engine, _ = _train(rank, world, opts, steps, kind, clip=clip, model=model)
    params = params_of(model)
    residuals = engine.bound.reducer.state_dict()["worker"]
    engine.close()
    return params, {n: v.reshape(-1) for n, v in residuals.items()}


def _max_err(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_uncompressed_unpipelined_equals_diloco(kind):
    """No compression, an exact round every round, no pipeline, after a 2-step synchronous
    warm-up: DiLoCo (mean of the outer gradients, Nesterov outer step) over 3 rounds, its
    Adam and AdamW inner steps at sqrt(2) times the rate (``inner_lr_scale="auto"``)."""
    opts = dict(sync_every=4, compressor="none", correction="burst", correction_every=1, pipelined=False,
                warmup_steps=2, outer_lr=0.7, outer_momentum=0.9)
    steps = 2 + 3 * 4
    got = run_distributed(_run_plain, WORLD, opts, steps, kind)
    want, _ = simulate(steps, opts, kind)
    for rank in range(WORLD):
        assert _max_err(got[rank][0], want[rank]) < 1e-6, rank
    # the outer optimizer matters: plain model averaging ends elsewhere
    averaged, _ = simulate(steps, {**opts, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}, kind)
    assert _max_err(want[0], averaged[0]) > 1e-4
    # and so does the inner rate's scale, for Adam and AdamW only
    unscaled, _ = simulate(steps, {**opts, "inner_lr_scale": 1.0}, kind)
    assert (_max_err(want[0], unscaled[0]) > 1e-4) == (kind != "sgd")


@pytest.mark.parametrize("opts", [
    # 2-bit + error feedback, pipelined, a burst correction in round 2 of 5
    dict(sync_every=3, correction="burst", correction_every=3),
    # pipelined, the spread correction (the default): share r % 3 exact in every round
    dict(sync_every=3, correction_every=3),
    # pipelined, no correction, half of the own progress kept at the rebase
    dict(sync_every=3, correction_every=None, local_weight=0.5),
    # unpipelined, no correction, heavy-ball outer momentum
    dict(sync_every=3, correction_every=None, pipelined=False, nesterov=False),
    # pipelined, each average applied after the first inner step of the next round, with
    # Nesterov outer momentum and the spread correction
    dict(sync_every=4, correction_every=3, apply_after=1, outer_lr=0.7, outer_momentum=0.5),
    # applied after two inner steps, half of the own progress kept
    dict(sync_every=3, correction_every=None, apply_after=2, local_weight=0.5),
    # the input side (conv, fc1) synced every 2nd round in its own message, applied after one
    # inner step, Nesterov outer momentum (a group's momentum moves only with its messages),
    # the spread correction cycling through each message's own shares
    dict(sync_every=3, correction_every=3, apply_after=1, outer_lr=0.7, outer_momentum=0.5,
         lazy_layers="conv,fc1", lazy_every=2),
    # the lazy group's period from the lazy update's rule, applied at the next round end
    dict(sync_every=3, correction_every=None, apply_after=None, lazy_layers="conv,fc1", lazy_every="auto"),
    # unpipelined: the rest averaged every round, conv every 3rd round
    dict(sync_every=3, correction_every=None, pipelined=False, outer_momentum=0.9, lazy_layers="conv",
         lazy_every=3),
], ids=["pipelined-burst", "pipelined-spread", "pipelined-mixed", "unpipelined-nocorrection", "apply-after-1",
        "apply-after-2-mixed", "lazy-2", "lazy-auto", "lazy-unpipelined"])
def test_compressed_equals_simulation(opts):
    """Each mechanism added to the DiLoCo reference: per-parameter 2-bit codes with error
    feedback (the codec's public compress/decompress), the one-round-late outer step with the
    local rebase, the burst and spread corrections flushing the residuals, the lazy group's
    own message every tau rounds. Parameters and residuals."""
    steps = 24 if "lazy_layers" in opts else 15
    got = run_distributed(_run_plain, WORLD, opts, steps, "sgd")
    want, want_e = simulate(steps, opts)
    for rank in range(WORLD):
        params, residuals = got[rank]
        assert _max_err(params, want[rank]) < 1e-5, rank
        assert set(residuals) == set(want_e[rank])
        assert _max_err(residuals, want_e[rank]) < 1e-5, rank


@pytest.mark.parametrize("opts,world", [
    # pipelined, applied one step into the next round, the spread correction, Adam inside
    (dict(sync_every=3, correction_every=3, apply_after=1), WORLD),
    # the table lazy, in its own message every 2nd round, applied at the next round end
    (dict(sync_every=3, correction_every=None, apply_after=None, lazy_layers="table", lazy_every=2), WORLD),
    # 4 ranks (counts 0..4 in 3-bit fields), allgather as the reference averages
    (dict(sync_every=3, correction_every=3, apply_after=1, collective="allgather"), 4),
], ids=["rows", "rows-lazy", "rows-4-ranks"])
def test_sparse_rows_equal_simulation(opts, world):
    """``sparse_rows`` (the default) on a model with an embedding table whose rows a step's
    batch reaches only in part: each row of the table's average is the mean over the ranks
    whose gradient of it was non-zero since its message was last sent; the rest as before."""
    steps = 18
    got = run_distributed(_run_plain, world, opts, steps, "adam", None, "embed")
    want, want_e = simulate(steps, opts, "adam", world=world, model="embed")
    for rank in range(world):
        params, residuals = got[rank]
        assert _max_err(params, want[rank]) < 1e-5, rank
        assert _max_err(residuals, want_e[rank]) < 1e-5, rank
    plain, _ = simulate(steps, {**opts, "sparse_rows": False}, "adam", world=world, model="embed")
    assert _max_err(want[0], plain[0]) > 1e-3          # the rows' averaging changes the result


def _run_with_summary(rank: int, world: int, opts: dict, steps: int, kind: str, model: str):
    model, _, engine, _ = _train(rank, world, opts, steps, kind, model=model)
    params, summary = params_of(model), engine.bound.summary()
    residuals = engine.bound.reducer.state_dict()["worker"]
    engine.close()
    return params, {n: v.reshape(-1) for n, v in residuals.items()}, summary


@pytest.mark.parametrize("opts,kind,model,steps", [
    # the table and fc2, each layer with its own tau from the rule (a hot SGD makes fc2's
    # rounds disagree early: its tau falls behind the table's from round 3), the spread
    # correction through each group's own shares, the table's rows averaged over the ranks that
    # trained them. 6 steps: the hot SGD soon brings some element within float rounding of a
    # 2-bit threshold, where the reference and the run quantize it to different levels (on an
    # AVX-512 EPYC host in step 7's message: its residuals 0.05 apart, the weights 0.025 at step 8,
    # after 6e-7; with compressor="none" the two stay within 5e-6 to step 10)
    (dict(sync_every=1, correction_every=3, apply_after=None, lazy_layers="table,fc2", lazy_every="auto"),
     "sgd-hot", "embed", 6),
    # conv and fc1 every 2nd round, each in its own message, pipelined with apply_after=1 and
    # Nesterov outer momentum: the same rounds as one group, other exact shares and residuals
    (dict(sync_every=3, correction_every=3, apply_after=1, outer_lr=0.7, outer_momentum=0.5,
          lazy_layers="conv,fc1", lazy_every=2), "adam", "small", 16),
], ids=["per-layer-auto", "per-layer-pipelined"])
def test_lazy_per_layer_equals_simulation(opts, kind, model, steps):
    """``lazy_per_layer``: every lazy layer is a message of its own, with its own residual,
    shares and tau; against the reference with one group per layer, and unlike one group."""
    opts = {**opts, "lazy_per_layer": True}
    got = run_distributed(_run_with_summary, WORLD, opts, steps, kind, model)
    want, want_e = simulate(steps, opts, kind, model=model)
    for rank in range(WORLD):
        params, residuals, summary = got[rank]
        assert _max_err(params, want[rank]) < 1e-5, rank
        assert set(residuals) == set(want_e[rank])
        assert _max_err(residuals, want_e[rank]) < 1e-5, rank
    layers = opts["lazy_layers"].split(",")
    summary = got[0][2]
    assert sorted(summary["lazy_every"]) == sorted(layers)
    if opts["lazy_every"] == "auto":                    # the layers' periods really differ
        history = summary["lazy_every_history"]
        assert history[layers[0]] != history[layers[1]], history
    one, _ = simulate(steps, {**opts, "lazy_per_layer": False}, kind, model=model)
    assert _max_err(want[0], one[0]) > 1e-4


def _summaries(rank: int, world: int, options: list[dict]) -> list[dict]:
    out = []
    for opts in options:
        model = EmbedNet()
        engine = lowband.distribute(model, make_optimizer("sgd", model), "cp-diloco", **opts)
        out.append(engine.bound.summary())
        engine.close()
    return out


def test_summary_names_the_tables_averaged_by_rows():
    plain, lazy, off = run_distributed(_summaries, WORLD, [{}, {"lazy_layers": "table"}, {"sparse_rows": False}])[0]
    assert plain["sparse_rows"] == lazy["sparse_rows"] == ["table.weight"] and "sparse_rows" not in off


CLIP = 0.5


def test_clip_grad_norm_clips_the_average_in_warmup_and_the_local_gradient_after():
    """``engine.clip_grad_norm_`` as localsgd applies it: the averaged gradient in a warm-up
    step, each worker's own gradient in an inner step (the outer step is not clipped)."""
    opts = dict(sync_every=3, correction_every=3, warmup_steps=2)
    got = run_distributed(_run_plain, WORLD, opts, 11, "sgd", CLIP)
    want, _ = simulate(11, opts, clip=CLIP)
    unclipped, _ = simulate(11, opts)
    assert _max_err(want[0], unclipped[0]) > 1e-3          # the clip binds
    for rank in range(WORLD):
        assert _max_err(got[rank][0], want[rank]) < 1e-5, rank


def _invariants(rank: int, world: int, opts: dict, steps: int):
    def after(t, model, engine):
        b = engine.bound
        b.reducer.pipeline.call(lambda: None)    # every queued message sent (timing only)
        e = b.reducer.worker_residual("cp-diloco-delta")
        return {"t": t, "anchor": None if b.anchor is None else b.anchor.clone(), "params": params_of(model),
                "bytes": engine.stats.bytes_sent, "metrics": b.step_metrics(),
                "residual": None if e is None else e.clone()}
    model, _, engine, out = _train(rank, world, opts, steps, after=after)
    engine.synchronize()
    final = params_of(model)
    numel = sum(p.numel() for p in model.parameters())
    vectors = sum(p.numel() for p in model.parameters() if p.dim() <= 1)
    codec = build_compressor("2bit", {})
    payload = sum(codec.payload_nbytes(p.numel()) for p in model.parameters() if p.dim() > 1)
    summary = engine.bound.summary()
    engine.close()
    return out, final, numel, vectors, payload, summary


def test_invariants_blocking_burst_correction():
    """Pipelined 2-bit rounds with a blocking burst correction every 3rd round: the anchor is
    bit-identical on every rank at every step; after each correction round every replica holds
    the same weights (and the residuals are 0); between them they differ; a compressed round
    sends about 2 bits per coded element (the codec's payload, the 1-D parameters in fp32);
    after synchronize() the replicas are identical."""
    H, steps = 2, 2 * 7
    opts = dict(sync_every=H, correction="burst", correction_every=3, blocking_correction=True)
    results = run_distributed(_invariants, WORLD, opts, steps)
    (out0, final0, numel, vectors, payload, summary), (out1, final1, *_) = results
    for a, b in zip(out0, out1):
        if a["anchor"] is not None:
            assert torch.equal(a["anchor"], b["anchor"]), a["t"]
    corrections = [a["t"] for a in out0 if a["metrics"]["message"] == "exact"]
    assert corrections == [5, 11]
    for a, b in zip(out0, out1):
        same = all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        assert same == (a["t"] in corrections), a["t"]
        if a["t"] in corrections:
            assert float(a["residual"].abs().max()) == 0.0
    assert all(torch.equal(final0[n], final1[n]) for n in final0)
    # bytes of a compressed round's message (the round ending at t=7, the only message sent
    # after t=5's): at 2 ranks allgather sends one section: codes + scales + flag bytes + the
    # fp32 1-D parameters
    sent = out0[7]["bytes"] - out0[5]["bytes"]
    expected = payload + 4 * vectors
    assert expected <= sent <= expected + 64, (sent, expected)
    # 2 bits per code plus one fp32 scale per 256-element block
    assert 2.0 < (sent - 4 * vectors) * 8 / (numel - vectors) < 2.0 + 32 / 256 + 0.05
    assert summary["outer_steps"] == summary["rounds_sent"] == 7 and summary["corrections"] == 2


def test_spread_invariants():
    """Spread correction (default knobs but H=2, k=3): constant message sizes, identical anchors,
    the exact share rotates."""
    opts = dict(sync_every=2, correction_every=3)
    results = run_distributed(_invariants, WORLD, opts, 12)
    out0, out1 = results[0][0], results[1][0]
    for a, b in zip(out0, out1):
        assert torch.equal(a["anchor"], b["anchor"]), a["t"]
    messages = [a["metrics"]["message"] for a in out0 if a["metrics"]["round_end"]]
    assert messages == ["spread"] * 6
    sizes = [out0[t + 2]["bytes"] - out0[t]["bytes"] for t in (1, 3, 5, 7, 9)]   # one message each
    assert max(sizes) - min(sizes) <= 8, sizes
    assert results[0][5]["collective"] == "allgather"          # "auto" at 2 ranks


def test_four_ranks_two_stage_by_default():
    """At 4 ranks ``collective="auto"`` is two-stage, with the lazy group beside the rest:
    identical anchors on every rank at every step, identical replicas after synchronize()."""
    opts = dict(sync_every=2, correction_every=3, lazy_layers="conv", lazy_every=2)
    results = run_distributed(_invariants, 4, opts, 10)
    outs = [r[0] for r in results]
    for steps in zip(*outs):
        assert all(torch.equal(steps[0]["anchor"], a["anchor"]) for a in steps[1:]), steps[0]["t"]
    assert results[0][5]["collective"] == "two-stage" and results[0][5]["lazy_syncs"] == 3
    finals = [r[1] for r in results]
    assert all(torch.equal(finals[0][n], f[n]) for f in finals[1:] for n in f)


def test_lazy_invariants():
    """The input side (conv, fc1) every 2nd round: identical anchors on every rank, a round
    end that sends the lazy group sends its message beside the round's own (the rest's
    message alone is the same size every round), the replicas identical after
    synchronize()."""
    opts = dict(sync_every=2, correction_every=3, lazy_layers="conv,fc1", lazy_every=2)
    results = run_distributed(_invariants, WORLD, opts, 16)
    (out0, final0, *_, summary), (out1, final1, *_) = results
    for a, b in zip(out0, out1):
        assert torch.equal(a["anchor"], b["anchor"]), a["t"]
    ends = [a["t"] for a in out0 if a["metrics"]["round_end"]]
    lazy = [a["t"] for a in out0 if a["metrics"].get("lazy")]
    assert ends == [1, 3, 5, 7, 9, 11, 13, 15] and lazy == [1, 5, 9, 13]
    sizes = {t: out0[t]["bytes"] - out0[t - 2]["bytes"] for t in ends[1:]}
    own = [sizes[t] for t in ends[1:] if t not in lazy]
    both = [sizes[t] for t in ends[1:] if t in lazy]
    assert max(own) - min(own) <= 8 and min(both) > 5 * max(own), sizes
    assert summary["lazy_syncs"] == 4 and summary["lazy_params"] == ["conv.weight", "conv.bias", "fc1.weight",
                                                                     "fc1.bias"]
    assert all(torch.equal(final0[n], final1[n]) for n in final0)


def _loss_run(rank: int, world: int, opts: dict, steps: int):
    torch.manual_seed(0)
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = lowband.distribute(model, opt, "cp-diloco", **opts)
    probe = batches(0, 1, 256).epoch(0)
    x0, y0 = next(probe)

    def evaluate() -> float:
        with torch.no_grad():
            return float(tasks.loss(engine.global_model()(x0), y0))
    first = evaluate()
    it = batches(rank, world).epoch(0)
    for _ in range(steps):
        x, y = next(it)
        opt.zero_grad()
        tasks.loss(engine.module(x), y).backward()
        engine.step()
    mid = evaluate()
    engine.synchronize()
    last = evaluate()
    engine.close()
    return first, mid, last


def test_training_reduces_loss():
    """4 warm-up steps, then 10 rounds of H=4 with the defaults (pipelined 2-bit, spread
    correction, outer momentum 0.5): the global model's loss on a fixed batch falls to less
    than half of its start, evaluated mid-pipeline and after synchronize()."""
    first, mid, last = run_distributed(_loss_run, WORLD, dict(sync_every=4, warmup_steps=4), 44)[0]
    assert mid < 0.5 * first and last < 0.5 * first, (first, mid, last)


def _rebuilt(model, opt, engine, build):
    """Save model, optimizer and engine state, close the engine, build new ones from another
    seed with ``build()`` and load the saved state into them (a resume in one process)."""
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()})
    engine.close()
    torch.manual_seed(123)
    model, opt, engine = build()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    engine.load_state_dict(state["engine"])
    return model, opt, engine


def _checkpointed(rank: int, world: int, opts: dict, steps: int, cut: Optional[int], model: str = "small"):
    """Train ``steps`` steps; with ``cut``, save everything after step ``cut``, build a new
    model/optimizer/engine from a different seed, load, and go on with the same batches."""
    net = MODELS[model]

    def build():
        model = net()
        opt = make_optimizer("sgd", model)
        return model, opt, lowband.distribute(model, opt, "cp-diloco", **opts)

    torch.manual_seed(0)
    model, opt, engine = build()
    it = batches(rank, world).epoch(0)
    for t in range(steps):
        if t == cut:
            model, opt, engine = _rebuilt(model, opt, engine, build)
            engine.check_replicas()
        x, y = next(it)
        opt.zero_grad()
        tasks.loss(engine.module(x), y).backward()
        engine.step()
    before = params_of(model)
    evaluated = params_of(engine.global_model())
    engine.synchronize()
    after = params_of(model)
    engine.close()
    return before, evaluated, after


def _assert_resume_bit_exact(opts: dict, steps: int, cut: int, model: str = "small") -> None:
    """The run cut after step ``cut`` and resumed ends where the uninterrupted one does, bit for
    bit: local weights, the evaluated global model and the synchronized one."""
    plain = run_distributed(_checkpointed, WORLD, opts, steps, None, model)
    resumed = run_distributed(_checkpointed, WORLD, opts, steps, cut, model)
    for rank in range(WORLD):
        for a, b in zip(plain[rank], resumed[rank]):
            assert all(torch.equal(a[n], b[n]) for n in a), rank


@pytest.mark.parametrize("cut", [9, 12], ids=["mid-round-in-flight", "round-boundary"])
def test_resume_is_bit_exact(cut):
    """A checkpoint mid-round with the previous round's message in flight (after step 9 of
    H=4: round 1 ended at step 7, its average is not applied yet), or just after a round end,
    resumes bit for bit: local weights, the evaluated global model and the synchronized one."""
    opts = dict(sync_every=4, correction_every=3)
    _assert_resume_bit_exact(opts, 22, cut)


@pytest.mark.parametrize("cut", [4, 13], ids=["lazy-in-flight", "per-layer-accumulating"])
def test_resume_is_bit_exact_with_lazy_layers(cut):
    """With the lazy group's period from the rule (applied at the next round end): a checkpoint
    with the group's message in flight (sent at step 2, applied at step 5), or, one group per
    layer, between their syncs with their progress accumulating, resumes bit for bit."""
    opts = dict(sync_every=3, correction_every=3, apply_after=None, lazy_layers="conv,fc1", lazy_per_layer=cut == 13)
    _assert_resume_bit_exact(opts, 24, cut)


@pytest.mark.parametrize("cut", [7, 10], ids=["rows-flagged-mid-round", "lazy-table-in-flight"])
def test_resume_is_bit_exact_with_sparse_rows(cut):
    """With an embedding table averaged over the ranks that trained its rows: a checkpoint
    mid-round (its rows' flags set by two inner steps, the previous round in flight), or with
    the table in its own lazy message, resumes bit for bit."""
    opts = dict(sync_every=3, correction_every=3, apply_after=None, lazy_layers="table" if cut == 10 else None,
                lazy_every=2)
    _assert_resume_bit_exact(opts, 18, cut, "embed")


def _nan_run(rank: int, world: int, bad_step: int, steps: int = 6, pipelined: bool = True):
    """H=2 (rounds end at steps 2, 4, 6, 1-based) with rank 1's gradient NaN at ``bad_step``."""
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, "cp-diloco", sync_every=2, pipelined=pipelined)
    bad = dict(model.named_parameters())["fc2.bias"]
    deferred: list = []
    try:
        poisoned_steps(engine, opt, batches(rank, world).epoch(0), steps, bad_step if rank == 1 else 0,
                       lambda: float("nan") * bad.sum(), lambda: deferred.append(engine.guard.pending))
        engine.synchronize()
    except lowband.NonFiniteGradientError as e:
        return {"step": e.step, "bad": e.bad, "raised_at": len(deferred) + 1,
                "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                "anchor_finite": bool(torch.isfinite(engine.bound.anchor).all())}
    return {"no error": True, "deferred": deferred}


def _nan_runs(rank: int, world: int) -> dict:
    return {"local": _nan_run(rank, world, 3), "round_end": _nan_run(rank, world, 4), "clean": _nan_run(rank, world, 0),
            "unpipelined_end": _nan_run(rank, world, 4, pipelined=False)}


def test_nan_guard_as_localsgd():
    """Inner steps and pipelined round ends defer the finiteness decision to the next step
    (their gradients reach the anchor a round later at the earliest); a round end that
    applies its own average at once (``pipelined=False``) decides at once, before its message
    leaves. Either way the anchor never takes a NaN."""
    for rank, n in enumerate(run_distributed(_nan_runs, WORLD)):
        assert n["clean"] == {"no error": True, "deferred": [True] * 6}
        for case, step in (("local", 3), ("round_end", 4)):
            got = n[case]
            assert got["step"] == step and got["bad"] == {1: "fc2.bias"} and got["raised_at"] == step + 1, (case, got)
            assert got["finite"] == (rank != 1) and got["anchor_finite"], (case, got)
        end = n["unpipelined_end"]
        assert end["step"] == 4 and end["raised_at"] == 4 and end["finite"] and end["anchor_finite"]


def test_options_and_registry():
    assert "cp-diloco" in lowband.ALGORITHMS
    algo = make_algorithm("cp-diloco", sync_every="8", correction_every="none", pipelined="false")
    assert (algo.sync_every, algo.correction_every, algo.pipelined) == (8, None, False)
    assert make_algorithm("cp-diloco", sync_every="auto", max_sync_every="32").sync_every == "auto"
    for bad, words in [({"sync_every": 0}, "sync_every"), ({"sync_every": "fast"}, "sync_every must be an integer >= 1 or 'auto'"),
                       ({"sync_every": "auto", "min_sync_every": 8, "max_sync_every": 4}, "max_sync_every must be >= min"),
                       ({"min_sync_every": 0}, "min_sync_every"), ({"outer_momentum": 1.0}, "outer_momentum"),
                       ({"correction": "rolling"}, "correction"), ({"local_weight": 1.5}, "local_weight"),
                       ({"blocking_correction": True}, "blocking_correction"),
                       ({"compressor": "3bit"}, "compressor"),
                       ({"lazy_layers": "tok", "lazy_every": 0}, "lazy_every must be an integer >= 1 or 'auto'"),
                       ({"lazy_layers": "tok", "max_lazy_every": 0}, "max_lazy_every"),
                       ({"lazy_layers": " , "}, "lazy_layers must be"),
                       ({"lazy_layers": "tok", "correction": "burst"}, "not with the burst correction"),
                       ({"lazy_per_layer": 2}, "lazy_per_layer. must be true or false"),
                       ({"inner_lr_scale": 0}, "inner_lr_scale must be a number > 0 or 'auto'"),
                       ({"inner_lr_scale": "fast"}, "inner_lr_scale must be"),
                       ({"inner_lr_scale": float("nan")}, "inner_lr_scale")]:
        with pytest.raises(ValueError, match=words):
            make_algorithm("cp-diloco", **bad)
    assert make_algorithm("cp-diloco", lazy_layers="none").lazy_layers is None
    assert make_algorithm("cp-diloco", lazy_layers="ngrams", lazy_every="4").lazy_every == 4
    assert make_algorithm("cp-diloco", inner_lr_scale="1.5").inner_lr_scale == 1.5
    assert make_algorithm("cp-diloco", inner_lr_scale=" AUTO").inner_lr_scale == "auto"


def test_lazy_parameters_select_untied_tables_and_named_modules():
    """``lazy_layers="embeddings"``: gpt-ngram's n-gram tables and position table, not gpt's
    token table (tied to the output head); named modules take their children; a selection of
    nothing, of everything or of a module that does not exist is refused at bind."""
    from lowband.algorithms.cp_diloco import lazy_groups, lazy_parameters
    from lowband.app.models import make_model

    def chosen(model, spec):
        names = [n for n, _ in model.named_parameters()]
        return [names[i] for i in lazy_parameters(model, list(model.parameters()), spec)]

    assert chosen(make_model("gpt-ngram"), "embeddings") == ["pos.weight", "ngrams.0.weight", "ngrams.1.weight"]
    assert chosen(make_model("gpt"), "embeddings") == ["pos.weight"]
    assert chosen(make_model("gpt-ngram"), "ngrams") == ["ngrams.0.weight", "ngrams.1.weight"]
    assert chosen(make_model("gpt"), "tok") == []                 # tied to the head
    assert chosen(SmallNet(), "conv, fc1") == ["conv.weight", "conv.bias", "fc1.weight", "fc1.bias"]
    # lazy_per_layer: one group per module holding the parameters, in the parameters' order
    net = make_model("gpt-ngram")
    names = [n for n, _ in net.named_parameters()]
    per_layer = lazy_groups(net, list(net.parameters()), "embeddings", True)
    assert [(label, [names[i] for i in group]) for label, group in per_layer] == [
        ("pos", ["pos.weight"]), ("ngrams.0", ["ngrams.0.weight"]), ("ngrams.1", ["ngrams.1.weight"])]
    small = SmallNet()
    assert [label for label, _ in lazy_groups(small, list(small.parameters()), "conv,fc1", True)] == ["conv", "fc1"]
    assert len(lazy_groups(net, list(net.parameters()), "embeddings", False)) == 1
    with pytest.raises(ValueError, match="no module of the model"):
        chosen(SmallNet(), "fc9")
    errors = run_distributed(_bind_errors, 1, ["embeddings", "conv,fc1,fc2"])[0]
    assert "selects no parameter" in errors[0] and "selects every parameter" in errors[1], errors


def _lazy_checkpoint_error(rank: int, world: int) -> str:
    engines = []
    for per_layer in (True, False):
        model = SmallNet()
        engines.append(lowband.distribute(model, make_optimizer("sgd", model), "cp-diloco", lazy_layers="conv,fc1",
                                          lazy_per_layer=per_layer))
    try:
        engines[1].bound.load_state_dict(engines[0].bound.state_dict())
        return ""
    except ValueError as e:
        return str(e)
    finally:
        for engine in engines:
            engine.close()


def test_checkpoint_with_other_lazy_groups_is_refused():
    """A checkpoint saved one lazy message per layer does not load into one group (nor back)."""
    error = run_distributed(_lazy_checkpoint_error, 1)[0]
    assert "saved with lazy groups ['conv', 'fc1'], this run has ['']" in error, error


def _bind_errors(rank: int, world: int, specs: list[str]) -> list[str]:
    out = []
    for spec in specs:
        model = SmallNet()
        try:
            lowband.distribute(model, make_optimizer("sgd", model), "cp-diloco", lazy_layers=spec)
            out.append("")
        except ValueError as e:
            out.append(str(e))
    return out


# -- sync_every="auto" ----------------------------------------------------------------------

def test_sync_fit_controller_rule():
    """The smallest H whose message fits in 80% of H compute steps (of half of them with
    ``apply_after``), within [min, max]; grows at once, shrinks only when the message uses less
    than 60% of the current round (of its half); skips measurements it cannot use."""
    from lowband.algorithms.cp_diloco import SyncFitController, fit_share
    c = SyncFitController(1, 64)
    assert c.decide(1, 0.05, 0.01) == 7                  # 0.05 / (0.8 * 0.01) = 6.25
    assert c.decide(7, 0.05, 0.01) == 7                  # fits: stays
    assert c.decide(8, 0.05, 0.01) == 8                  # 62.5% of the round: in the band, stays
    assert c.decide(9, 0.05, 0.01) == 7                  # 55.6% < 60%: shrinks to the fit
    assert c.decide(32, 0.05, 0.01) == 7
    assert c.decide(6, 0.05, 0.01) == 7                  # 83% > 80%: grows
    assert c.decide(3, 10.0, 0.01) == 64                 # the cap
    assert SyncFitController(4, 64).decide(8, 0.0, 0.01) == 4     # the floor
    for H, m, s in [(5, float("nan"), 0.01), (5, 0.05, 0.0), (5, -1.0, 0.01), (5, 0.05, float("inf"))]:
        assert c.decide(H, m, s) == H
    # with the average applied as soon as it can have arrived, the message may take half a round
    half = SyncFitController(1, 64, share=fit_share(True, 1))
    assert half.share == 0.5 and fit_share(True, None) == fit_share(False, 1) == 1.0
    assert half.decide(1, 0.05, 0.01) == 13              # 0.05 / (0.8 * 0.5 * 0.01) = 12.5
    assert half.steps_needed(0.05, 0.01) == 7             # applied 7 steps into a round of 13
    assert half.decide(16, 0.05, 0.01) == 16             # 62.5% of half the round: in the band
    assert half.decide(17, 0.05, 0.01) == 13             # 58.8% < 60%: shrinks
    # against the definition, from any H: the result fits (or is the cap) and H - 1 does not
    # (or is below the floor); a move down only from a round the message uses < 60% of
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        lo = int(torch.randint(1, 5, (1,), generator=g))
        hi = lo + int(torch.randint(0, 40, (1,), generator=g))
        m, s = float(torch.rand(1, generator=g)) * 0.5, 0.001 + float(torch.rand(1, generator=g)) * 0.02
        H = int(torch.randint(lo, hi + 1, (1,), generator=g))
        share = (0.5, 1.0)[int(torch.randint(0, 2, (1,), generator=g))]
        new = SyncFitController(lo, hi, share=share).decide(H, m, s)
        smallest = next((h for h in range(lo, hi + 1) if m <= 0.8 * share * h * s), hi)
        if new != H:
            assert new == smallest, (lo, hi, H, m, s, share, new)
            assert new > H or m < 0.6 * share * H * s
        else:
            assert H >= smallest or H == hi


def _fake_step_seconds(self):
    return 0.01 * (1 + self.ctx.rank)                    # the ranks' mean: 0.015 s


#: per round, the message time of rank 0 (rank 1 measures twice as much: mean 1.5x); under
#: the default ``apply_after`` a message may take half a round (``fit_share``)
FAKE_MESSAGES = [0.01, 0.05, 0.05, 0.015, 0.1, 0.005, 0.025, 0.025, 0.15, 0.01, 0.01, 0.01, 0.01]


def _fake_message_seconds(self, flight):
    return FAKE_MESSAGES[flight.round % len(FAKE_MESSAGES)] * (1 + self.ctx.rank)


def expected_auto_schedule(steps: int, lo: int, hi: int, share: float = 0.5) -> list[list[int]]:
    """The ``(round, first step, H)`` changes the fake measurements give, replayed on the
    pipelined protocol: round r's end applies round r - 1's message, which carries each rank's
    median of its last 3 message times (rounds r - 2, r - 3, r - 4) and of its step times;
    the rule takes the ranks' means (rank 1 measures twice rank 0: 1.5x rank 0's); ``share``:
    1/2 with the average applied ``apply_after`` steps in (the default), 1 at the round end."""
    from lowband.algorithms.cp_diloco import SyncFitController
    rule, H, start, r = SyncFitController(lo, hi, share=share), lo, 0, 0
    history = [[0, 0, H]]
    while start < steps:
        end = start + H - 1
        if r >= 2:
            window = [FAKE_MESSAGES[j % len(FAKE_MESSAGES)] for j in range(max(0, r - 4), r - 1)]
            message = statistics.median(window) * 1.5
            new = rule.decide(H, message, 0.015)
            if new != H:
                H = new
                history.append([r + 1, end + 1, H])
        start, r = end + 1, r + 1
    return history


def _auto_run(rank: int, world: int, opts: dict, steps: int, cut: Optional[int], fake: bool,
              delay: float = 0.0):
    """``steps`` steps of cp-diloco under ``opts`` with each step's metrics; ``fake``: the
    measurements replaced by the fixed ones above; ``delay``: every round's message job sleeps
    that long on the background thread (a slow link, measured for real); ``cut``: checkpoint
    after step ``cut`` and resume into a fresh engine (as ``_checkpointed``)."""
    from lowband.algorithms.cp_diloco import BoundCPDiLoCo
    if fake:
        BoundCPDiLoCo._step_seconds = _fake_step_seconds
        BoundCPDiLoCo._message_seconds = _fake_message_seconds

    def build():
        model = SmallNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        engine = lowband.distribute(model, opt, "cp-diloco", **opts)
        if delay:
            reducer, run = engine.bound.reducer, engine.bound.reducer._run

            def slow(name, *args, **kw):
                if name == "cp-diloco-delta":
                    time.sleep(delay)
                return run(name, *args, **kw)
            reducer._run = slow
        return model, opt, engine

    torch.manual_seed(0)
    model, opt, engine = build()
    x0, y0 = next(batches(0, 1, 256).epoch(0))

    def evaluate() -> float:
        with torch.no_grad():
            return float(tasks.loss(engine.global_model()(x0), y0))
    first = evaluate()
    data = batches(rank, world)
    it = (xy for epoch in range(1000) for xy in data.epoch(epoch))
    metrics = []
    for t in range(steps):
        if t == cut:
            model, opt, engine = _rebuilt(model, opt, engine, build)
        x, y = next(it)
        opt.zero_grad()
        tasks.loss(engine.module(x), y).backward()
        engine.step()
        metrics.append(engine.bound.step_metrics())
    before = params_of(model)
    summary = engine.bound.summary()
    engine.synchronize()
    last = evaluate()
    after = params_of(model)
    engine.close()
    return {"metrics": metrics, "summary": summary, "before": before, "after": after, "first": first, "last": last}


def _rounds(metrics: list[dict]) -> list[tuple[int, int, int]]:
    """``(round, first step, length)`` of each whole round, from the step metrics; checks that
    every step of a round reports the same round and H and that the round is H steps long."""
    rounds, start = [], 0
    for t, m in enumerate(metrics):
        assert m["round"] == len(rounds) and m["sync_every"] == metrics[start]["sync_every"], t
        if m["round_end"]:
            assert t - start + 1 == m["sync_every"], t
            rounds.append((len(rounds), start, m["sync_every"]))
            start = t + 1
    return rounds


def test_auto_sync_every_measured_agreed_and_trains():
    """``sync_every="auto"`` over a slow link (each round's message job takes 60 ms more on the
    background thread, timed for real): both ranks run the same rounds with the same H at every
    step, H grows from 1 once the measurements arrive, changes only at round ends, stays in
    [min, max], and the global model's loss falls."""
    opts = dict(sync_every="auto", min_sync_every=1, max_sync_every=12, correction_every=4)
    a, b = run_distributed(_auto_run, WORLD, opts, 72, None, False, 0.06)
    assert [m["sync_every"] for m in a["metrics"]] == [m["sync_every"] for m in b["metrics"]]
    assert [m["round_end"] for m in a["metrics"]] == [m["round_end"] for m in b["metrics"]]
    rounds = _rounds(a["metrics"])
    assert len(rounds) >= 6
    sizes = [H for _, _, H in rounds]
    assert sizes[:3] == [1, 1, 1] and max(sizes) > 1 and all(1 <= H <= 12 for H in sizes), sizes
    history = a["summary"]["sync_every_history"]
    assert history == b["summary"]["sync_every_history"]
    changes = [[r, s, H] for i, (r, s, H) in enumerate(rounds) if i == 0 or H != rounds[i - 1][2]]
    assert changes == [h for h in history if h[0] < len(rounds)]
    assert a["last"] < 0.7 * a["first"], (a["first"], a["last"])
    assert all(torch.equal(a["after"][n], b["after"][n]) for n in a["after"])


@pytest.mark.parametrize("cut", [23, 53], ids=["mid-round-in-flight", "round-boundary-new-H"])
def test_auto_sync_every_follows_the_rule_and_resumes_bit_exact(cut):
    """With the measurements fixed (rank-dependent, so the ranks' mean decides): the rounds
    follow the rule replayed on the pipelined protocol (two rounds of lag, medians of windows),
    and a resume before step ``cut`` (mid-round with a round in flight, or at the round end
    where H changes) continues bit for bit: the H schedule, the local weights and the
    synchronized model."""
    opts = dict(sync_every="auto", min_sync_every=1, max_sync_every=20, correction_every=3)
    steps = 60
    plain = run_distributed(_auto_run, WORLD, opts, steps, None, True)
    resumed = run_distributed(_auto_run, WORLD, opts, steps, cut, True)
    want = expected_auto_schedule(steps, 1, 20)
    assert len(want) >= 4
    for rank in range(WORLD):
        p, q = plain[rank], resumed[rank]
        assert p["summary"]["sync_every_history"] == want
        rounds = _rounds(p["metrics"])
        assert len(rounds) >= 8
        last = p["metrics"][cut - 1]                  # the step before the checkpoint
        assert last["round"] >= 1                      # a round in flight
        assert last["round_end"] == (cut == 53)
        assert ([last["round"] + 1, cut] in [h[:2] for h in want]) == (cut == 53)   # H changes there
        assert [m["sync_every"] for m in p["metrics"]] == [m["sync_every"] for m in q["metrics"]]
        assert q["summary"]["sync_every_history"] == want
        for key in ("before", "after"):
            assert all(torch.equal(p[key][n], q[key][n]) for n in p[key]), (rank, key)
