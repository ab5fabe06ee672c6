"""Lazy parameter update with an adaptive update interval (PCNN's lazy update).

Input-side layers get their gradients *last* in backprop, so their communication cannot hide
behind computation. This algorithm lets those layers ("lazy" layers) accumulate their local
gradients and synchronize only every ``tau`` steps, in one fused all-reduce, followed by one
optimizer step with the accumulated sum (momentum and weight decay applied once per sync). All
other layers are averaged every step by bucketed all-reduces overlapped with backward. Under an
adaptive optimizer (Adam: a step that does not grow with the gradient) the sync step of lazy
embedding tables is scaled by the window length (``window_step="auto"``); a language model's
input side is its leading embedding tables (``lazy_layers=None``).

``tau`` adapts at each sync from the probe layer (the deepest lazy layer), comparing its latest
global gradient g with the accumulated global sum A (which includes g) over the n steps:

    angle_ok     := |g - A|^2 + |g|^2 <= |A|^2        (equivalently <g, A - g> >= 0)
    magnitude_ok := n |g|^2 <= |A|^2
    both -> tau + 1;  neither -> max(1, tau - 1);  otherwise tau unchanged

Both tests compare norms of agreed (all-reduced) tensors, so every rank takes the same decision,
and neither has a tunable threshold (scaling g and A together does not change them). At n = 1,
A *is* g, both tests hold with equality and tau rises: that case is decided exactly, without
sending g (two reduced copies of one tensor can come back rounded differently on 3+ ranks).

*Input side* means data flow, not registration order: the parameterized modules are ordered
by when they first run in forward. That order is only known once a forward has run, so step 1
synchronizes every layer (as a tau = 1 window would anyway), then all ranks check that they
recorded the same order and fix the lazy set (:class:`LazyPlan`).

Parameters shared between modules (tied weights) are handled once each: a parameter is lazy
only when every module that owns it is lazy. One shared between a lazy layer and a regular one
(an input embedding tied to the output head) is regular by default; with ``tied="split"``
it is split by where its gradient comes from: while the lazy layer runs forward it reads a
detached alias of the weight (same storage), so backward delivers the lazy layer's
contribution to the alias and only the regular layers' contribution to ``.grad``. The
regular part is then complete as soon as the output head's backward is done and is averaged
every step with the other regular layers, overlapped with backward; the lazy part (the input
embedding's, which arrives last) is accumulated and synchronized with the lazy layers every
tau steps and added to the weight's gradient on sync steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.agreement import check_agreement
from ..comm.communicator import flatten
from ..comm.wire import MIB
from ..optim.tentative import hyperparameters, unhooked_step, using_hyperparameters
from .base import Algorithm, BoundAlgorithm, EngineContext, Finiteness, GradientClip
from .buckets import Bucket, BucketSet

VARIANTS = ("probe", "vote")
TIED = ("regular", "split")
WINDOW_STEPS = ("auto", "sum", "scaled", "replay")
#: lookup tables: in a model whose forward starts with them they are the input side, and under
#: an adaptive optimizer their window step is scaled (``window_step="auto"``)
EMBEDDING_LAYERS = (nn.Embedding, nn.EmbeddingBag)
#: optimizers whose step does not grow with the gradient's size (per-element normalised)
ADAPTIVE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                       torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta)
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
#: PCNN's NUM_LAZY_LAYERS: conv1 + stage 1 + the stage-2 projection of ResNet-20
DEFAULT_LAZY_LAYERS = 8
#: the agreement field under which ranks compare their recorded forward order
ORDER_FIELD = "lazy: forward order of parameterized modules"


def interval_update(g: torch.Tensor, acc: torch.Tensor, n: int, tau: int) -> tuple[int, bool, bool]:
    """The probe-layer rule of B.2.4: returns (new tau, angle_ok, magnitude_ok)."""
    d = g - acc
    return interval_rule(float(torch.dot(g, g)), float(torch.dot(acc, acc)), float(torch.dot(d, d)), n, tau)


def interval_rule(g2: float, a2: float, d2: float, n: int, tau: int) -> tuple[int, bool, bool]:
    """:func:`interval_update` from the squared norms ``|g|^2``, ``|A|^2`` and ``|g - A|^2``
    (what ``cp-diloco``'s lazy group averages over ranks)."""
    angle_ok = d2 + g2 <= a2
    magnitude_ok = n * g2 <= a2
    if angle_ok and magnitude_ok:
        return tau + 1, angle_ok, magnitude_ok
    if not angle_ok and not magnitude_ok:
        return max(1, tau - 1), angle_ok, magnitude_ok
    return tau, angle_ok, magnitude_ok


def vote_update(gs: list[torch.Tensor], accs: list[torch.Tensor], tau: int) -> tuple[int, int]:
    """The all-layer variant: the angle test on every lazy layer; tau + 1 when none violates it,
    tau - 1 when more than half do. Returns (new tau, violations)."""
    violations = 0
    for g, a in zip(gs, accs):
        d = g - a
        if float(torch.dot(d, d)) + float(torch.dot(g, g)) > float(torch.dot(a, a)):
            violations += 1
    if violations == 0:
        return tau + 1, 0
    if violations > len(gs) / 2:
        return max(1, tau - 1), violations
    return tau, violations


def holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """For each parameter of ``model`` (by ``id``), the modules that hold it directly, with
    their names, in the model's module order: more than one for a tied weight."""
    out: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            out.setdefault(id(p), []).append((name, m))
    return out


def input_side_layers(model: nn.Module, order: Optional[Sequence[str]] = None) -> list[tuple[str, nn.Module]]:
    """Modules that own trainable parameters, excluding normalisation layers (always
    synchronized). With ``order`` (module names in the order they first ran in forward), those
    come first in that order and modules that never ran follow in registration order;
    without it, registration order."""
    layers = [(name, m) for name, m in model.named_modules()
              if any(p.requires_grad for p in m.parameters(recurse=False)) and not isinstance(m, NORM_LAYERS)]
    if order is None:
        return layers
    rank = {name: i for i, name in enumerate(order)}
    return sorted(layers, key=lambda nm: rank.get(nm[0], len(rank)))   # stable: unseen keep registration order


class ForwardOrder:
    """Records the order in which ``modules`` first run in forward (forward pre-hooks)."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]]):
        self.order: list[str] = []
        self._seen: set[str] = set()
        self._hooks = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules]

    def _hook(self, name: str):
        def hook(_module, _args) -> None:
            if name not in self._seen:
                self._seen.add(name)
                self.order.append(name)
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def default_lazy_layers(layers: Sequence[tuple[str, nn.Module]]) -> int:
    """How many of ``layers`` (forward order) are lazy when the user does not say: a model whose
    forward starts with embedding lookups (a language model) has those tables as its input
    side, so the leading run of embedding layers; otherwise PCNN's 8, at most half the layers."""
    leading = 0
    while leading < len(layers) and isinstance(layers[leading][1], EMBEDDING_LAYERS):
        leading += 1
    return leading if leading else min(DEFAULT_LAZY_LAYERS, len(layers) // 2)


@dataclass
class LazyPlan:
    """Which parameters are lazy, fixed once the forward order is known.

    ``layers``: the lazy layers (module names, forward order) that keep at least one lazy
    parameter; ``slices``: their lazy parameter indices (a parameter tied between two lazy
    layers appears in both); ``indices``: every lazy parameter index once; ``shared_regular``:
    indices owned by a lazy layer but also by a regular module, hence regular; ``tied_uses``:
    ``(module name, attribute, index)`` for each lazy layer's own attribute holding such a
    parameter (where ``tied="split"`` routes the lazy layer's contribution)."""

    order: list[str]
    layers: list[str]
    slices: list[list[int]]
    indices: list[int]
    shared_regular: list[int]
    tied_uses: list[tuple[str, str, int]]

    @classmethod
    def build(cls, model: nn.Module, params: Sequence[nn.Parameter], order: Sequence[str],
              lazy_layers: Optional[int]) -> "LazyPlan":
        layers = input_side_layers(model, order)
        wanted = default_lazy_layers(layers) if lazy_layers is None else lazy_layers
        count = min(wanted, max(0, len(layers) - 1))        # the output-side layer is never lazy
        chosen = {name for name, _ in layers[:count]}
        index_of = {id(p): i for i, p in enumerate(params)}
        owners = {index_of[k]: {name for name, _ in held} for k, held in holders(model).items() if k in index_of}
        names, slices, indices, shared, uses = [], [], [], [], []
        for name, m in layers[:count]:
            own = list(dict.fromkeys(index_of[id(p)] for p in m.parameters(recurse=False) if id(p) in index_of))
            lazy = [i for i in own if owners[i] <= chosen]
            shared += [i for i in own if i not in lazy and i not in shared]
            uses += [(name, attr, index_of[id(p)]) for attr, p in m.named_parameters(recurse=False)
                     if id(p) in index_of and index_of[id(p)] not in lazy]
            if lazy:
                names.append(name)
                slices.append(lazy)
                indices += [i for i in lazy if i not in indices]
        return cls(list(order), names, slices, indices, shared, uses)


@dataclass
class LazyUpdate(Algorithm):
    """Knobs:
        lazy_layers: how many input-side parameterized layers (forward order, norm layers
            excluded) are lazy. ``None`` (default): when the model's forward starts with
            embedding lookups (a language model), the leading run of embedding layers, the
            tables being its input side (lazy transformer blocks cost validation loss under
            AdamW: docs/lazy.md); otherwise PCNN's
            8, but at most half of the model's layers: 8 is conv1, stage 1 and the stage-2
            projection of ResNet-20 (8 of 21 layers, 5% of the weights), whereas on a 4-layer
            LeNet it would make the large fc1 lazy too (which diverges at the cnn's default
            learning rate); the paper targets the input side, not most of the model. 0 = S-SGD.
        variant: ``"probe"`` (the released code: the deepest lazy layer decides) or ``"vote"``
            (the angle test on every lazy layer; its latest gradients are all reduced at syncs).
        tau_max: optional cap on the interval (not in the paper's code; None = no cap).
        bucket_mb: bucket cap for the regular layers' overlapped all-reduce.
        window_step: what a sync does with the window's summed gradient. ``"sum"`` (the
            paper's): one optimizer step with it; under SGD that moves a lazy layer about
            as far as the window's n ordinary steps. ``"scaled"``: the same step, then the
            lazy parameters' change is multiplied by n; for optimizers whose step does not grow
            with the gradient's size (Adam, AdamW: one step on the sum moves about one learning
            rate, 1/n of what ``ssgd`` moves them in the same n steps). ``"replay"``: n optimizer
            steps of the lazy parameters, each with the window's mean gradient (sum / n), the
            first together with the regular layers' step: momentum, weight decay and Adam's
            moments then evolve as over ``ssgd``'s n steps when the window's gradients agree,
            which is what the interval rule checks (not in the paper's code; n - 1 extra
            optimizer steps over the lazy parameters only). ``"auto"`` (default):
            ``"scaled"`` for the parameters of lazy embedding layers under an adaptive
            optimizer (``ADAPTIVE_OPTIMIZERS``), ``"sum"`` for everything else: under AdamW
            ``"scaled"`` keeps lazy embedding tables at ``ssgd``'s validation loss where
            ``"sum"`` falls behind, and on lazy transformer layers it is the other way round
            (docs/lazy.md): a table row's update follows from few, consistent gradients, a
            dense layer's from many noisy ones that ``ssgd``'s Adam steps partly cancel.
        tied: a weight tied between a lazy layer and a regular one (an input embedding tied to
            the output head). ``"regular"`` (default): the whole weight is regular, averaged
            every step. ``"split"``: the lazy layer's gradient contribution is lazy, the regular
            layers' is averaged every step (module docstring). ``split`` sends no fewer bytes
            (the head's part still goes every step), does not shorten the step and ends with a
            higher validation loss on ``gpt`` (docs/lazy.md), hence not the default.
    """

    lazy_layers: Optional[int] = None
    variant: str = "probe"
    tau_max: Optional[int] = None
    bucket_mb: float = 1.0
    window_step: str = "auto"
    tied: str = "regular"

    name: ClassVar[str] = "lazy"

    def __post_init__(self) -> None:
        if self.lazy_layers is not None and self.lazy_layers < 0:
            raise ValueError(f"lazy: lazy_layers must be >= 0, got {self.lazy_layers}")
        if self.variant not in VARIANTS:
            raise ValueError(f"lazy: variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.tau_max is not None and self.tau_max < 1:
            raise ValueError(f"lazy: tau_max must be >= 1 or None, got {self.tau_max}")
        if not self.bucket_mb > 0:
            raise ValueError(f"lazy: bucket_mb must be > 0, got {self.bucket_mb}")
        if self.window_step not in WINDOW_STEPS:
            raise ValueError(f"lazy: window_step must be one of {WINDOW_STEPS}, got {self.window_step!r}")
        if self.tied not in TIED:
            raise ValueError(f"lazy: tied must be one of {TIED}, got {self.tied!r}")

    def bind(self, ctx: EngineContext) -> "BoundLazyUpdate":
        return BoundLazyUpdate(self, ctx)


class BoundLazyUpdate(BoundAlgorithm):
    """The lazy update bound to one engine: the lazy plan (fixed after the first forward),
    the accumulators, the interval tau and the window counters."""

    cfg: LazyUpdate
    captures_gradients: ClassVar[bool] = True
    clips: ClassVar[bool] = True

    # -- binding: every layer is regular until the forward order is known ---------------------
    def __init__(self, cfg: LazyUpdate, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        self.plan: Optional[LazyPlan] = None
        self._recorder: Optional[ForwardOrder] = ForwardOrder(input_side_layers(ctx.model))
        self._route_hooks: list = []
        self._uses: list[tuple[str, str, int]] = []      # tied="split": (module, attribute, index)
        self._aliases: dict[int, torch.Tensor] = {}     # tied use -> this iteration's alias
        self._alias_step = -1    # the engine's step count when the aliases were made
        self._finiteness = Finiteness(captured=self._captured_gradients)
        self._set_plan(None)
        self.tau = 1
        self.n = 0
        self.syncs = 0
        self.t = 0
        self.synced = False          # whether the lazy layers synchronized on the last step
        #: the last step's optimizer settings and clipping: drain() applies the open window with them
        self._last_hyper: Optional[list[dict]] = None
        self._last_clip: Optional[GradientClip] = None

    def _set_plan(self, plan: Optional[LazyPlan]) -> None:
        params = self.ctx.params
        self.plan = plan
        lazy = plan.indices if plan is not None else []
        self.lazy_indices = list(lazy)
        self.is_lazy = [False] * len(params)
        for i in lazy:
            self.is_lazy[i] = True
        regular = [i for i in range(len(params)) if not self.is_lazy[i]]
        self.buckets = BucketSet(params, regular, int(self.cfg.bucket_mb * MIB), self._launch)
        uses = plan.tied_uses if plan is not None and self.cfg.tied == "split" else []
        #: tied="split": the weights whose lazy layer's contribution is accumulated apart
        self.split_indices = list(dict.fromkeys(i for _, _, i in uses))
        #: one accumulator per entry: the wholly lazy parameters, then the split weights' parts
        self.accumulated = self.lazy_indices + self.split_indices
        self.acc_of = {i: k for k, i in enumerate(self.accumulated)}   # parameter index -> accumulator
        self.acc = [torch.zeros_like(params[i]) for i in self.accumulated]
        self.had = torch.zeros(len(self.accumulated), dtype=params[0].dtype if params else torch.float32,
                               device=params[0].device if params else None)
        # the interval rule's inputs (accumulator positions): the probe is the deepest lazy
        # layer, or the split parts when no parameter is wholly lazy; the vote counts the split
        # parts as one more layer
        slices = plan.slices if plan is not None else []
        self.probe = [self.acc_of[i] for i in (slices[-1] if slices else self.split_indices)]
        self.vote_layers = [[self.acc_of[i] for i in layer] for layer in slices] + \
            ([[self.acc_of[i] for i in self.split_indices]] if self.split_indices else [])
        #: the lazy parameters whose window step is scaled by the window length (``window_step``)
        self.scaled_indices = self._scaled_parameters(plan)
        self._set_routes(uses)
        if plan is not None and self._recorder is not None:
            self._recorder.close()
            self._recorder = None

    def _set_routes(self, uses: list[tuple[str, str, int]]) -> None:
        """``tied="split"``: route each lazy layer's use of a tied weight through an alias."""
        self._remove_routes()
        self._uses = list(uses)
        modules = dict(self.ctx.model.named_modules())
        for use, (name, attr, i) in enumerate(uses):
            m = modules[name]
            self._route_hooks.append(m.register_forward_pre_hook(self._route(use, attr, i)))
            self._route_hooks.append(m.register_forward_hook(self._restore(attr, i)))

    def _route(self, use: int, attr: str, index: int):
        def hook(module: nn.Module, _args) -> None:
            # one alias per iteration: the micro-batches of an iteration (Engine.no_sync) add
            # into its .grad. Aliases of an earlier iteration still here are a skipped step's
            # (nonfinite="skip" drops the step before step() takes them): start afresh. (A use
            # that does not run in the step after a skipped one would carry that gradient
            # over: not handled.)
            steps = self.ctx.steps
            if steps != self._alias_step:
                self._aliases.clear()
                self._alias_step = steps
            alias = self._aliases.get(use)
            if alias is None:
                p = self.ctx.params[index]
                alias = p.detach().requires_grad_(p.requires_grad)   # same storage, own leaf
                self._aliases[use] = alias
            module._parameters[attr] = alias
        return hook

    def _restore(self, attr: str, index: int):
        def hook(module: nn.Module, _args, _output) -> None:
            module._parameters[attr] = self.ctx.params[index]
        return hook

    def _remove_routes(self) -> None:
        for h in self._route_hooks:
            h.remove()
        self._route_hooks.clear()
        modules = dict(self.ctx.model.named_modules())
        for name, attr, i in self._uses:   # a forward that raised left an alias
            modules[name]._parameters[attr] = self.ctx.params[i]
        self._aliases.clear()

    def finiteness(self) -> Finiteness:
        """Decided before ``step()``, with the tied weights' lookup parts (``tied="split"``),
        which backward leaves in the aliases' ``.grad``, checked with the rest."""
        return self._finiteness

    def _captured_gradients(self) -> list[tuple[int, torch.Tensor]]:
        return [(self._uses[use][2], a.grad) for use, a in self._aliases.items() if a.grad is not None]

    def _take_split(self) -> list[Optional[torch.Tensor]]:
        """This iteration's lazy-layer contribution to each split weight (None: no use ran)."""
        taken: dict[int, torch.Tensor] = {}
        for use, alias in self._aliases.items():
            if alias.grad is not None:
                i = self._uses[use][2]
                taken[i] = alias.grad if i not in taken else taken[i] + alias.grad
        self._aliases.clear()
        return [taken.get(i) for i in self.split_indices]

    def _fix_plan(self) -> None:
        """After step 1's forward: agree on the recorded order and fix the lazy set.

        A module that runs on some ranks only (a rank-specific head) is legitimate: it goes
        after every module all ranks ran (so it is on the output side, regular). The modules
        every rank ran must have run in the same order; otherwise every rank raises the same
        ConfigMismatchError (data-dependent control flow would give each rank another plan)."""
        order = self._recorder.order if self._recorder is not None else []
        group = self.ctx.comm.group
        orders = [order]
        if self.ctx.world_size > 1:
            orders = [None] * self.ctx.world_size
            dist.all_gather_object(orders, order, group=group)
        everywhere = set(orders[0]).intersection(*orders[1:])
        common = [n for n in order if n in everywhere]
        check_agreement({ORDER_FIELD: common}, group)
        somewhere = sorted({n for o in orders for n in o} - everywhere)
        self._set_plan(LazyPlan.build(self.ctx.model, self.ctx.params, common + somewhere, self.cfg.lazy_layers))

    # -- per iteration -------------------------------------------------------------------------
    def _launch(self, b: Bucket):
        return self.ctx.comm.all_reduce(b.buffer, op=dist.ReduceOp.AVG, async_op=True)

    def on_gradient_ready(self, index: int) -> None:
        if not self.is_lazy[index]:
            self.buckets.mark_ready(index)

    def _capped(self, tau: int) -> int:
        return tau if self.cfg.tau_max is None else min(tau, self.cfg.tau_max)

    def step(self) -> None:
        params = self.ctx.params
        self.buckets.launch_remaining()
        sync_handle = fused = latest = None
        if self.accumulated:
            latest = [params[i].grad for i in self.lazy_indices] + self._take_split()
            for i in self.lazy_indices:
                params[i].grad = None           # the optimizer skips lazy layers between syncs
            for k, g in enumerate(latest):
                if g is not None:
                    self.acc[k].add_(g)
                    self.had[k] = 1
            self.n += 1
            if self.n >= self.tau:
                sync_handle, fused = self._launch_sync(latest)
        for b in self.buckets.buckets:
            b.handle.wait()
            self.buckets.write_gradients(b)
        self.synced = sync_handle is not None
        window = self.n
        if sync_handle is not None:
            sync_handle.wait()
            self._finish_sync(fused)
        scaled = self._scaled_window(window) if self.synced else []
        if self.ctx.clip is not None:      # the gradient this step applies (lazy ones on sync steps)
            self.ctx.clip_gradients([p.grad for p in params])
        if self.accumulated:
            self._last_hyper, self._last_clip = hyperparameters(self.ctx.optimizer), self.ctx.clip
        self.ctx.optimizer.step()
        for p, before in scaled:       # before + n (after - before)
            p.data.sub_(before).mul_(window).add_(before)
        if self.synced and window > 1 and self.cfg.window_step == "replay":
            self._replay(window - 1)
        self.buckets.reset()
        self.t += 1
        if self.plan is None:
            # step 1 synchronized every layer: for the layers that now become lazy that was a
            # window of n = 1, where the interval rule holds exactly (A == g): tau 1 -> 2
            self._fix_plan()
            if self.accumulated:
                self.tau, self.syncs, self.synced = self._capped(self.tau + 1), self.syncs + 1, True

    def _scaled_parameters(self, plan: Optional[LazyPlan]) -> list[int]:
        """Which lazy parameters ``window_step`` scales: all (``"scaled"``), none (``"sum"``,
        ``"replay"``), or (``"auto"``) those of embedding layers when the optimizer is adaptive."""
        if plan is None or self.cfg.window_step in ("sum", "replay"):
            return []
        if self.cfg.window_step == "scaled":
            return list(self.lazy_indices)
        if not isinstance(self.ctx.optimizer, ADAPTIVE_OPTIMIZERS):
            return []
        modules = dict(self.ctx.model.named_modules())
        tables = {i for name, layer in zip(plan.layers, plan.slices)
                  if isinstance(modules[name], EMBEDDING_LAYERS) for i in layer}
        return [i for i in self.lazy_indices if i in tables]

    def _scaled_window(self, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The scaled lazy parameters (:meth:`_scaled_parameters`) about to step on a window of
        n > 1 gradients, each with a copy of its value before the step."""
        if window <= 1:
            return []
        params = self.ctx.params
        return [(params[i], params[i].detach().clone()) for i in self.scaled_indices if params[i].grad is not None]

    def _replay(self, steps: int, step: Optional[Callable[[], Any]] = None) -> None:
        """``window_step="replay"``: ``steps`` more optimizer steps of the wholly lazy parameters
        on the window's mean gradient (their ``.grad``); every other parameter's gradient is
        held aside meanwhile, so the optimizer skips it, and put back."""
        lazy = {id(self.ctx.params[i]) for i in self.lazy_indices}
        held = [(p, p.grad) for group in self.ctx.optimizer.param_groups for p in group["params"]
                if id(p) not in lazy and p.grad is not None]
        for p, _ in held:
            p.grad = None
        try:
            for _ in range(steps):
                (step or self.ctx.optimizer.step)()
        finally:
            for p, g in held:
                p.grad = g

    def _latest_needed(self) -> list[int]:
        """Accumulator positions whose latest gradient the interval rule needs at this sync;
        none at n = 1, where the latest gradient *is* the accumulated sum."""
        if self.n == 1:
            return []
        return list(range(len(self.accumulated))) if self.cfg.variant == "vote" else self.probe

    def _launch_sync(self, latest: list[Optional[torch.Tensor]]):
        """One fused all-reduce: every accumulator, one had-a-gradient flag per accumulator (none
        on any rank in the window: the optimizer skips it, as in ``ssgd``), and the latest
        gradients the interval rule needs (:meth:`_latest_needed`)."""
        extra = [latest[k] if latest[k] is not None else torch.zeros_like(self.acc[k]) for k in self._latest_needed()]
        fused = flatten(self.acc + [self.had] + extra)
        return self.ctx.comm.all_reduce(fused, op=dist.ReduceOp.AVG, async_op=True), fused

    def _finish_sync(self, fused: torch.Tensor) -> None:
        cursor = [0]

        def take(n: int) -> torch.Tensor:
            piece = fused[cursor[0]:cursor[0] + n]
            cursor[0] += n
            return piece

        accs = [take(a.numel()) for a in self.acc]          # the sums over the window of global means
        # host reads, on sync steps only: these flags and the interval rule's norms are decisions (docs/architecture.md)
        flags = take(len(self.acc)).tolist()
        self._window_gradients(accs, flags)
        latest = {k: take(self.acc[k].numel()) for k in self._latest_needed()}
        if self.n == 1:
            tau = self.tau + 1                       # A == g: both tests hold with equality
        elif self.cfg.variant == "probe":
            tau, _, _ = interval_update(torch.cat([latest[k] for k in self.probe]),
                                        torch.cat([accs[k] for k in self.probe]), self.n, self.tau)
        else:
            tau, _ = vote_update([torch.cat([latest[k] for k in layer]) for layer in self.vote_layers],
                                 [torch.cat([accs[k] for k in layer]) for layer in self.vote_layers], self.tau)
        self.tau = self._capped(tau)
        self._close_window()
        self.syncs += 1

    def _window_gradients(self, accs: list[torch.Tensor], flags: list[float]) -> None:
        """The window's averaged sums (and had-a-gradient flags) become the lazy parameters'
        ``.grad`` for the optimizer step that closes the window."""
        params = self.ctx.params
        wholly = len(self.lazy_indices)
        replay = self.cfg.window_step == "replay" and self.n > 1     # n steps of the window's mean
        for k, i in enumerate(self.accumulated):
            part = accs[k].view_as(params[i])
            if k < wholly:
                params[i].grad = (part / self.n if replay else part.clone()) if flags[k] > 0 else None
            elif flags[k] > 0:        # a split weight: this step's regular part + the window's lazy part
                params[i].grad = part.clone() if params[i].grad is None else params[i].grad.add_(part)

    def _close_window(self) -> None:
        for a in self.acc:
            a.zero_()
        self.had.zero_()
        self.n = 0

    def drain(self) -> None:
        """Apply the open window: its accumulated gradients are averaged (one all-reduce) and
        applied by one optimizer step of the lazy parameters, as a sync at the last step
        would have (``window_step``, the last step's optimizer settings and clipping); tau
        stays (the interval rule needs a sync's latest gradient) and ``syncs`` counts the
        scheduled syncs only. Every other gradient is
        held aside meanwhile, so only the lazy parameters move."""
        if self.accumulated and self.n:
            self._flush(self.ctx.optimizer.step)

    def _flush(self, step: Callable[[], Any]) -> None:
        """:meth:`drain`'s work, with ``step`` as the optimizer step."""
        params, window = self.ctx.params, self.n
        fused = flatten(self.acc + [self.had])
        self.ctx.comm.all_reduce(fused, op=dist.ReduceOp.AVG)
        sizes = [a.numel() for a in self.acc]
        accs = list(fused[:sum(sizes)].split(sizes))
        flags = fused[sum(sizes):].tolist()
        held = [(p, p.grad) for p in params]
        try:
            for p in params:
                p.grad = None
            self._window_gradients(accs, flags)
            scaled = self._scaled_window(window)
            with using_hyperparameters(self.ctx.optimizer, self._last_hyper):
                if self._last_clip is not None:
                    self.ctx.clip_gradients([p.grad for p in params], self._last_clip, record=False)
                step()
                for p, before in scaled:
                    p.data.sub_(before).mul_(window).add_(before)
                if window > 1 and self.cfg.window_step == "replay":
                    self._replay(window - 1, step)
        finally:
            for p, g in held:
                p.grad = g
        self._close_window()

    def replicated_state(self) -> tuple[Optional[list[torch.Tensor]], bool]:
        """The parameters and the optimizer state (every rank applies the same averages); not
        :meth:`global_parameters`, which communicates to apply the open window."""
        return list(self.ctx.params), True

    @torch.no_grad()
    def global_parameters(self) -> Optional[list[torch.Tensor]]:
        """With a window open: the parameters as :meth:`drain` would leave them (the same
        all-reduce and optimizer steps, without step hooks), on copies; the parameters, the
        optimizer's state and settings and the window are put back. None otherwise (the
        model's own parameters are the global model)."""
        if not self.accumulated or not self.n:
            return None
        params, opt = self.ctx.params, self.ctx.optimizer
        values = [p.detach().clone() for p in params]
        state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                 for p in params if p in opt.state}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        window = ([a.clone() for a in self.acc], self.had.clone(), self.n)
        try:
            self._flush(lambda: unhooked_step(opt))
            return [p.detach().clone() for p in params]
        finally:
            for p, v in zip(params, values):
                p.copy_(v)
                if p in state:
                    opt.state[p] = state[p]
                else:
                    opt.state.pop(p, None)
            for g, saved in zip(opt.param_groups, groups):
                g.update(saved)
            acc, had, self.n = window
            for a, b in zip(self.acc, acc):
                a.copy_(b)
            self.had.copy_(had)

    # -- what users see --------------------------------------------------------------------------
    def step_metrics(self) -> dict[str, Any]:
        """``tau``: the interval after this step (the length of the current window);
        ``lazy_synced``: whether the lazy layers synchronized on this step. Empty when the
        model has no lazy layers."""
        if not self.accumulated:
            return {}
        return {"tau": self.tau, "lazy_synced": self.synced}

    def summary(self) -> dict[str, Any]:
        if self.plan is None:
            return {"lazy_layers": None}
        names = self.ctx.names
        return {
            "lazy_layers": self.plan.layers,
            "probe_layer": self.plan.layers[-1] if self.plan.layers else None,
            "lazy_parameters": [names[i] for i in self.plan.indices],
            "lazy_parameter_share": (sum(self.ctx.params[i].numel() for i in self.plan.indices)
                                     / max(1, sum(p.numel() for p in self.ctx.params))),
            "shared_regular_parameters": [names[i] for i in self.plan.shared_regular],
            "tied_split_parameters": [names[i] for i in self.split_indices],
            "window_scaled_parameters": [names[i] for i in self.scaled_indices],
            "tau": self.tau, "lazy_syncs": self.syncs,
        }

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "tau": self.tau, "n": self.n, "syncs": self.syncs, "t": self.t,
            "forward_order": list(self.plan.order) if self.plan is not None else None,
            "accumulators": {self.ctx.names[i]: a.clone() for i, a in zip(self.accumulated, self.acc)},
            "had_gradient": self.had.clone(),
            # what drain() applies the open window with
            "last_settings": self._last_hyper,
            "last_clip": None if self._last_clip is None else [self._last_clip.max_norm, self._last_clip.norm_type],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        order = state.get("forward_order")
        if order is not None:
            plan = LazyPlan.build(self.ctx.model, self.ctx.params, order, self.cfg.lazy_layers)
            if self.plan is None:
                self._set_plan(plan)
            elif plan.indices != self.plan.indices:
                raise ValueError(f"lazy: checkpoint's lazy layers {plan.layers} differ from this run's {self.plan.layers}")
        self.tau, self.n, self.syncs, self.t = int(state["tau"]), int(state["n"]), int(state["syncs"]), int(state["t"])
        saved = state["accumulators"]
        names = [self.ctx.names[i] for i in self.accumulated]
        if sorted(saved) != sorted(names):
            raise ValueError(f"lazy: checkpoint has accumulators for {sorted(saved)}, this run accumulates {names} "
                             f"(lazy parameters, then tied weights split by use: tied={self.cfg.tied!r})")
        for name, a in zip(names, self.acc):
            a.copy_(saved[name])
        self.had.copy_(state["had_gradient"])
        self._last_hyper = state.get("last_settings")
        clip = state.get("last_clip")
        self._last_clip = None if clip is None else GradientClip(*clip)

    def close(self) -> None:
        self._remove_routes()
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
