"""``lowband.distribute``: attach a data-parallel algorithm to a model and optimizer.

The engine knows no specific algorithm. It owns what every algorithm needs and no algorithm
should repeat: the parameter list, identical starting weights on every rank, the
gradient-ready hooks, byte/time statistics, buffer consistency and checkpointable state.
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm.agreement import ABSENT, check_agreement, check_replicas, state_digest
from ..algorithms import Algorithm, EngineContext, make_algorithm
from ..algorithms.base import GradientClip
from ..comm.communicator import CommStats, Communicator, flatten, unflatten_into
from .guard import DEFAULT_MAX_CONSECUTIVE_SKIPS, GradientGuard, check_policy

STATE_VERSION = 2
#: optimizers whose step() needs a closure (refused: no algorithm can re-evaluate the loss)
CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)
#: modules whose ``sparse=True`` makes their weight's gradient a sparse tensor
SPARSE_GRADIENT_MODULES = (nn.Embedding, nn.EmbeddingBag)


def check_dense_gradients(model: nn.Module) -> None:
    """ValueError naming the first module that would produce sparse gradients: every lowband
    algorithm flattens gradients into dense buckets."""
    for name, module in model.named_modules():
        if isinstance(module, SPARSE_GRADIENT_MODULES) and getattr(module, "sparse", False):
            raise ValueError(f"module {name or type(module).__name__!r} ({type(module).__name__}(sparse=True)) "
                             "produces sparse gradients, which lowband's algorithms do not support; build it "
                             "with sparse=False")


class Engine:
    """Drives one algorithm for one model. Create it with :func:`distribute`.

    Usage per iteration: ``optimizer.zero_grad(); loss.backward(); engine.step()`` (several
    micro-batches per step: :meth:`no_sync`; gradient clipping: :meth:`clip_grad_norm_` before
    ``step()``; after changing a parameter's ``requires_grad``: :meth:`rebuild`). Evaluate
    ``engine.global_model()``, a copy of the global model that leaves training untouched;
    ``engine.synchronize()`` makes the training model itself global (at the end of training:
    for some algorithms it is a step outside their schedule).

    ``engine.algorithm`` is the configuration it was given (unchanged); ``engine.bound`` is
    that algorithm bound to this engine, with all its state (``Algorithm.bind``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        algorithm: Algorithm,
        group: Optional[dist.ProcessGroup] = None,
        nonfinite: str = "raise",
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        scaler: Optional[Any] = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "lowband.distribute needs an initialized torch.distributed process group: start the "
                "script with torchrun, or use `lowband train`, or call torch.distributed.init_process_group first")
        self.model = model
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.comm = Communicator(group)
        self._policy = (nonfinite, max_consecutive_skips)
        #: the GradScaler of every step (``distribute(..., scaler=...)``; None: none or disabled)
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._select_parameters()
        self._check_optimizer()
        check_dense_gradients(model)
        check_policy(nonfinite, max_consecutive_skips)
        if self.scaler is not None and nonfinite != "off":
            raise ValueError("lowband.distribute(..., scaler=...) needs nonfinite='off': the GradScaler decides "
                             "about non-finite steps itself (skipped on every rank alike, the scale backs off)")
        # before any collective whose shape depends on the configuration (the broadcast below)
        check_agreement(self.agreement_fields(nonfinite, max_consecutive_skips), self.comm.group)
        #: bytes of evaluation and checks (global_model, check_replicas), kept apart from the
        #: algorithm's traffic in ``stats`` as the guard's are
        self.aux_stats = CommStats()
        self._broadcast_initial_state()
        self._hooks: list = []
        self._bind()

    # -- setup ---------------------------------------------------------------------------
    def _select_parameters(self) -> None:
        """The trainable parameters (``requires_grad``), and every parameter's flag as the
        algorithm is bound with it: ``step()`` compares it (:meth:`_check_trainable`)."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._all_named = list(self.model.named_parameters())
        self._trainable = [p.requires_grad for _, p in self._all_named]

    def _bind(self) -> None:
        """Bind the algorithm to the selected parameters: the guard, the context, the bound
        algorithm, the module to call and the gradient hooks."""
        nonfinite, max_consecutive_skips = self._policy
        skips = self.guard.consecutive_skips if hasattr(self, "guard") else 0
        self.guard = GradientGuard(nonfinite, self.names, self.params, self.comm.group, max_consecutive_skips)
        self.guard.consecutive_skips = skips
        steps = self.ctx.steps if hasattr(self, "ctx") else 0
        self.ctx = EngineContext(model=self.model, optimizer=self.optimizer, names=self.names, params=self.params,
                                 comm=self.comm, decide_finiteness=self.guard.carrier, steps=steps)
        #: the algorithm bound to this engine (its state); ``algorithm`` stays configuration
        self.bound = self.algorithm.bind(self.ctx)
        bound = self.bound
        if self.scaler is not None:
            if not bound.scales:   # the guard unscales every gradient before the algorithm takes it
                self.guard = GradientGuard(nonfinite, self.names, self.params, self.comm.group,
                                           max_consecutive_skips, scaler=self.scaler)
                self.guard.consecutive_skips = skips
        self.guard.attach(bound)
        self.ctx.skippable = self.guard.deferring   # a step may be skipped after its backward
        self.module = bound.wrap_module(self.model)
        self._forward = bound.on_gradient_ready if bound.uses_gradient_hooks else None
        #: depth of :meth:`no_sync` blocks now open; parameters whose gradient grew inside one
        #: and that the algorithm has not been told about since (:meth:`_deliver_accumulated`)
        self._accumulating = 0
        self._accumulated: set[int] = set()
        #: per parameter index whose gradient the algorithm took in its hook this iteration:
        #: that ``.grad`` tensor and its version counter then (:meth:`_check_unchanged`)
        self._taken: dict[int, tuple[torch.Tensor, int]] = {}
        self._deliver: list = []    # per parameter, what its hook does outside no_sync()
        if bound.uses_gradient_hooks or self.guard.active:
            self._deliver = [self._make_delivery(i) for i in range(len(self.params))]
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _make_delivery(self, index: int):
        """What the gradient hook of parameter ``index`` does outside :meth:`no_sync`: tell the
        algorithm, through the finiteness guard when it is active
        (:meth:`~lowband.engine.guard.GradientGuard.delivery`). Only made when hooks are
        registered, i.e. when the algorithm uses them or the guard is active."""
        return self.guard.delivery(index, self._forward)

    def _make_hook(self, index: int):
        deliver, accumulated = self._deliver[index], self._accumulated
        taken = self._taken if self.bound.captures_gradients else None

        def hook(param: torch.Tensor) -> None:
            if self._accumulating:          # a micro-batch inside no_sync(): .grad only grows
                accumulated.add(index)
                return
            if accumulated:
                accumulated.discard(index)  # told now, with the whole sum
            deliver()
            if taken is not None:
                grad = param.grad
                # a view (a bucket's, under gradient_as_bucket_view) shares its version counter
                # with the whole buffer, which the algorithm itself writes: not checked
                if grad is not None and grad._base is None:
                    taken[index] = (grad, grad._version)
        return hook

    def agreement_fields(self, nonfinite: str,
                         max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS) -> dict[str, Any]:
        """What every rank must agree on before training (see :mod:`lowband.comm.agreement`)."""
        return {
            "algorithm": self.algorithm.config(),
            "parameters": {n: [list(p.shape), str(p.dtype)] for n, p in zip(self.names, self.params)},
            "buffers": {n: [list(b.shape), str(b.dtype)] for n, b in self.model.named_buffers()},
            "optimizer": {"type": type(self.optimizer).__name__,
                          "groups": [{k: v for k, v in g.items() if k != "params"} | {"size": len(g["params"])}
                                     for g in self.optimizer.param_groups]},
            "world": {"size": self.comm.world_size, "backend": str(dist.get_backend(self.comm.group))},
            "nonfinite": {"policy": nonfinite, "max_consecutive_skips": max_consecutive_skips,
                          "gradient_scaler": self.scaler is not None},
        }

    def _check_optimizer(self) -> None:
        if isinstance(self.optimizer, CLOSURE_OPTIMIZERS):
            raise ValueError(f"{type(self.optimizer).__name__} needs a closure that re-evaluates the loss in step(), "
                             "which lowband's algorithms cannot call; use a first-order optimizer (SGD, Adam, ...)")
        if isinstance(self.optimizer, torch.optim.SparseAdam):
            raise ValueError("SparseAdam needs sparse gradients, and lowband's algorithms average dense ones; "
                             "use Adam or AdamW")
        model_ids = {id(p) for p in self.model.parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in model_ids:
                    raise ValueError("the optimizer holds a tensor that is not a parameter of the model; "
                                     "build the optimizer from model.parameters()")

    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (one coalesced broadcast per dtype)."""
        tensors = [p.data for p in self.model.parameters()] + list(self.model.buffers())
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = flatten(group)
                self.comm.broadcast(flat, src=0)
                unflatten_into(flat, group)

    # -- per iteration -------------------------------------------------------------------
    @property
    def stats(self) -> CommStats:
        """Bytes sent/received (wire model), payload bytes, exposed communication wait, steps.
        On CUDA the waits timed by events that have completed are added now (no host sync);
        the rest follow at a later read or at :meth:`synchronize`."""
        self.comm.stats.collect_gpu_waits()
        return self.comm.stats

    def step(self, scaler: Optional[Any] = None) -> bool:
        """Finish this iteration's communication and advance the optimizer. Returns False when
        the step was skipped on every rank for a non-finite gradient (``nonfinite="skip"``, or
        a GradScaler's step under an algorithm the engine unscales for); callers then leave
        their LR scheduler alone, as if the step had not happened.

        Mixed precision with a ``torch.amp.GradScaler``: ``lowband.distribute(...,
        scaler=scaler, nonfinite="off")``, ``scaler.scale(loss).backward()``, ``engine.step()``,
        ``scaler.update()``; with every algorithm. Under ``ssgd``, ``noop``, ``ddp`` and
        ``ddp-fp16`` (``BoundAlgorithm.scales``) the average of the scaled gradients is
        unscaled, clipped (:meth:`clip_grad_norm_`) and stepped by ``scaler.step``, as in a DDP
        script; under the others (``ddp-powersgd``'s comm hook included) the engine unscales
        every gradient as backward produces it, before the algorithm takes it, and skips a step
        with an inf or NaN on any rank on every rank (:mod:`lowband.engine.guard`, "scale" mode).
        Do not call ``scaler.unscale_`` or ``scaler.step`` yourself.

        ``scaler``: the same scaler again (optional), or, without one given to ``distribute``,
        the scaler of this step for the algorithms that take it in their own step (``ssgd``,
        ``noop``, ``ddp``, ``ddp-fp16``: where a DDP script calls ``scaler.step(optimizer)``); they
        need ``distribute(..., nonfinite="off")``. The others need the scaler before backward
        and refuse it here with one line."""
        if self._accumulating:
            raise RuntimeError("engine.step() inside engine.no_sync(): run the last micro-batch's backward "
                               "after the block, then call step()")
        self.ctx.scaler = self._step_scaler(scaler)
        try:
            self._check_trainable()
            if self._taken:
                self._check_unchanged()
            return self._step()
        finally:
            self.ctx.clip = None
            self.ctx.scaler = None
            self.guard.end_step()

    def _step_scaler(self, scaler: Optional[Any]) -> Optional[Any]:
        """The GradScaler the algorithm's own ``step()`` takes this step (``ctx.scaler``), or
        None: none, or the guard unscales for the algorithm. ValueError for a scaler it cannot
        take here."""
        given = scaler if scaler is not None and scaler.is_enabled() else None
        if self.scaler is not None:
            if given is not None and given is not self.scaler:
                raise ValueError("engine.step(scaler=...) got another GradScaler than the one given to "
                                 "lowband.distribute(..., scaler=...)")
            return self.scaler if self.bound.scales else None
        if given is None:
            return None
        if not self.bound.scales:
            name = self.algorithm.name
            raise ValueError(f"{name} takes a GradScaler through lowband.distribute(..., scaler=scaler, "
                             f"nonfinite='off'), not engine.step(): the engine unscales every gradient before {name} "
                             "takes it, during backward")
        if self.guard.active:
            raise ValueError("engine.step(scaler=...) needs lowband.distribute(..., nonfinite='off'): the "
                             "GradScaler skips non-finite steps itself, on every rank alike")
        return given

    def _step(self) -> bool:
        if self._accumulated:
            self._deliver_accumulated()
        # the guard decides about the gradients (policy, scaler) and runs the algorithm's step
        applied = self.guard.run(self.ctx.steps + 1, self._forward, self._waiting)
        self._count_step(skipped=not applied)
        return applied

    def _count_step(self, skipped: bool = False) -> None:
        """Advance the step counter (``ctx.steps``, the algorithms' clock) and the statistics'
        copy of it, once per ``step()``."""
        self.ctx.steps += 1
        self.comm.stats.steps += 1
        if skipped:
            self.comm.stats.skipped_steps += 1

    def _check_trainable(self) -> None:
        """RuntimeError unless every parameter's ``requires_grad`` is what the algorithm was
        bound with: a parameter unfrozen since would train on each rank's own gradient (no
        hook, no bucket), one frozen since would keep state the algorithm no longer feeds."""
        if [p.requires_grad for _, p in self._all_named] != self._trainable:
            name, p = next((n, p) for (n, p), was in zip(self._all_named, self._trainable) if p.requires_grad != was)
            raise RuntimeError(f"requires_grad of parameter {name!r} changed to {p.requires_grad} after "
                               f"{self.algorithm.name} was bound to the model; call engine.rebuild() on every rank "
                               "after changing requires_grad, before the next backward")

    def _check_unchanged(self) -> None:
        """RuntimeError if a gradient the algorithm took during backward was changed or
        replaced since (the user's ``clip_grad_norm_``): ``step()`` would overwrite it with the
        average of what it took. Compares each ``.grad``'s identity and version counter (every
        in-place operation bumps it), no values."""
        taken, self._taken = self._taken, {}
        params = self.params
        for index, (grad, version) in taken.items():
            if params[index].grad is not grad or grad._version != version:
                raise RuntimeError(
                    "gradients were changed between backward() and step() (e.g. clip_grad_norm_); under "
                    f"{self.algorithm.name} call engine.clip_grad_norm_(max_norm) instead")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Clip this iteration's gradient with DDP's meaning: call it between ``backward()``
        and ``step()`` instead of ``torch.nn.utils.clip_grad_norm_``, and ``step()`` scales the
        *averaged* gradient to a total ``norm_type``-norm of at most ``max_norm`` before the
        optimizer applies it (``torch.nn.utils.clip_grad_norm_``'s operations, on every rank
        the same). Algorithms whose structure changes what that means (CP-SGD's pipelined
        global and local steps, the lazy update's windows, local SGD's local steps) apply the
        choice docs/architecture.md tabulates. Applies to the coming ``step()`` only; the norm
        it measured is ``engine.grad_norm`` after that step.

        ``torch.nn.utils.clip_grad_norm_`` itself cannot work under algorithms that take the
        gradients during backward (``ssgd``, ``compressed``, ``cpsgd``, ``lazy``): ``step()``
        writes the average over ``.grad``. Their ``step()`` raises when ``.grad`` was changed."""
        try:
            max_norm, norm_type = float(max_norm), float(norm_type)
        except (TypeError, ValueError):
            raise ValueError(f"clip_grad_norm_: max_norm and norm_type must be numbers, got {max_norm!r}, "
                             f"{norm_type!r}") from None
        if not (max_norm >= 0 and max_norm != float("inf")) or norm_type != norm_type or norm_type <= 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be a finite number >= 0 and norm_type > 0, "
                             f"got {max_norm!r}, {norm_type!r}")
        if not self.bound.clips:
            raise ValueError(f"{self.algorithm.name} does not apply engine.clip_grad_norm_")
        self.ctx.clip = GradientClip(max_norm, norm_type)

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """The total norm that the last step's clipping (:meth:`clip_grad_norm_`) measured
        before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it; None before any."""
        return self.ctx.grad_norm

    def rebuild(self) -> None:
        """Bind the algorithm anew to the parameters that now have ``requires_grad`` (a layer
        unfrozen or frozen after :func:`distribute`). Collective: every rank calls it at the
        same point, between ``step()`` and the next backward, and the ranks check that they
        agree on the new parameter layout (else each raises ConfigMismatchError). Everything
        pending is applied first (:meth:`synchronize`'s drain, with the old parameter set);
        then the algorithm starts with fresh state: counters, warm-ups, residuals, pipelines
        and windows begin again. The optimizer and its state are the user's and unchanged.
        Not for algorithms that wrap the module (the DDP peers): build a new engine."""
        if self.module is not self.model:
            raise RuntimeError(f"engine.rebuild() is not available under {self.algorithm.name}, whose module wrapper "
                               "is built for the old parameters: call engine.close() and lowband.distribute() again")
        if not self.bound.rebuildable:
            raise RuntimeError(f"engine.rebuild() is not available under {self.algorithm.name}, which keeps state "
                               "built for the old parameters outside lowband: call engine.close() and "
                               "lowband.distribute() again")
        if self._accumulating:
            raise RuntimeError("engine.rebuild() inside engine.no_sync()")
        self.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.bound.close()
        self._select_parameters()
        nonfinite, max_consecutive_skips = self._policy
        check_agreement(self.agreement_fields(nonfinite, max_consecutive_skips), self.comm.group)
        self._bind()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation over micro-batches, as ``DistributedDataParallel.no_sync``: a
        backward inside the block only adds into ``.grad`` (no communication, nothing launched);
        the next backward outside it (the last micro-batch's) hands each gradient, now the sum
        over the micro-batches, to the algorithm as usual, and ``step()`` then averages and
        applies it::

            optimizer.zero_grad()
            with engine.no_sync():
                for x, y in micro_batches[:-1]:
                    (loss_fn(engine.module(x), y) / n).backward()
            x, y = micro_batches[-1]
            (loss_fn(engine.module(x), y) / n).backward()
            engine.step()

        A parameter that got a gradient only inside the block (unused by the last micro-batch)
        is handed over at ``step()``. Same result as one backward of the summed losses, with one
        micro-batch's activations in memory at a time. ``step()`` inside the block raises."""
        with self.bound.no_sync():
            self._accumulating += 1
            try:
                yield
            finally:
                self._accumulating -= 1

    def _deliver_accumulated(self) -> None:
        """At ``step()``: tell the algorithm about the gradients that grew inside
        :meth:`no_sync` but were not produced again by the backward after it, in parameter
        order, as their hooks would have (not those cleared since: micro-batches given up with
        ``zero_grad()`` before a step)."""
        late = sorted(self._accumulated)
        self._accumulated.clear()
        for index in late:
            if self.params[index].grad is not None:
                self._deliver[index]()

    def synchronize(self) -> None:
        """Apply everything pending (CP-SGD's in-flight step, at the learning rate of the step
        that computed it; the lazy update's open window), so the model holds the global
        weights, and average the floating-point buffers (BatchNorm running statistics) so
        every rank holds the same model: for the end of training. It changes the trajectory of
        algorithms that keep work in flight or replicas apart (CP-SGD's pipeline, the lazy
        update's window, local SGD's period), so evaluation
        during training uses :meth:`global_model` instead, and checkpoints save each rank's
        exact state. Buffers are averaged here rather than every step: in training mode
        BatchNorm normalises with batch statistics, so the running averages only matter when
        the model is evaluated or saved."""
        self._settle_guard()
        self.bound.drain()
        floats = [b for b in self.model.buffers() if b.is_floating_point()]
        if floats and self.comm.world_size > 1:
            with torch.no_grad():
                flat = flatten(floats)
                self.comm.all_reduce(flat, op=dist.ReduceOp.AVG)
                unflatten_into(flat, floats)
        self.comm.stats.collect_gpu_waits(block=True)   # CUDA: every timed wait is in comm_wait_s

    # -- the global model, without touching training -------------------------------------
    @contextmanager
    def _counted_apart(self) -> Iterator[None]:
        """Charge what this thread sends through the engine's communicator to ``aux_stats``
        (an algorithm's background threads keep their own reference to ``stats``)."""
        saved, self.comm.stats = self.comm.stats, self.aux_stats
        try:
            yield
        finally:
            self.comm.stats = saved

    def global_model(self) -> nn.Module:
        """A copy of the global model, in eval mode, for evaluation: the algorithm's global
        parameter values (``Algorithm.global_parameters()``; the model's own when it returns
        None) and the floating-point buffers (BatchNorm running statistics) averaged over the
        ranks. Collective (every rank calls it together, between steps). Nothing of the
        training state changes: parameters, buffers, optimizer, algorithm state (a pipeline in
        flight stays in flight, local SGD's period is not reset) and ``stats``; its
        communication is counted in ``aux_stats``."""
        self._settle_guard()
        model = _copy_without_hooks(self.model)
        with torch.no_grad(), self._counted_apart():
            values = self.bound.global_parameters()
            if values is not None:
                own = dict(model.named_parameters())
                for name, v in zip(self.names, values):
                    own[name].copy_(v)
            floats = [b for b in model.buffers() if b.is_floating_point()]
            if floats and self.comm.world_size > 1:
                flat = flatten(floats)
                self.comm.all_reduce(flat, op=dist.ReduceOp.AVG)
                unflatten_into(flat, floats)
        return model.eval()

    def check_replicas(self) -> None:
        """Raise :class:`lowband.comm.agreement.ReplicaMismatchError` on every rank unless all ranks
        hold bit-identical replicated state (``Algorithm.replicated_state()``: the global
        weights and, where the algorithm replicates it, the optimizer state), naming the first
        differing parameter. Collective; costs one all-reduce of 4 int64 per parameter."""
        self._settle_guard()
        values, optimizer_replicated = self.bound.replicated_state()
        slots = []
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            slots.append((f"values of parameter {name!r}", ABSENT if values is None else state_digest(values[i])))
            state = self.optimizer.state.get(p, {}) if optimizer_replicated else None
            digest = ABSENT if state is None else state_digest(*[x for k in sorted(state) for x in (k, state[k])])
            slots.append((f"optimizer state of parameter {name!r}", digest))
        with self._counted_apart():
            check_replicas(slots, self.comm)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's engine state: algorithm state (residuals, pipeline, counters), the
        guard's run of skipped steps and statistics. The model, optimizer and scheduler are
        saved by their own state_dicts. A deferred finiteness decision is settled first, so a
        checkpoint never holds a step some rank found non-finite."""
        self._settle_guard()
        return {
            "version": STATE_VERSION,
            "algorithm_config": self.algorithm.config(),
            "algorithm": self.bound.state_dict(),
            "consecutive_skips": self.guard.consecutive_skips,
            "steps": self.ctx.steps,
            "stats": self.comm.stats.snapshot(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of an engine that ran the same algorithm configuration
        (ValueError otherwise). A checkpoint of an earlier version may still list knobs this
        version no longer has: those holding the value whose behaviour the code now always has
        are ignored, another value is refused naming the knob (:meth:`Algorithm.current_config`);
        one that lacks a knob added since is read at the value that version ran with
        (:attr:`Algorithm.added_knobs`)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"engine state version {state.get('version')!r} is not {STATE_VERSION}")
        saved, config = state["algorithm_config"], self.algorithm.config()
        name = config["algorithm"]
        if saved.get("algorithm") != name:
            raise ValueError(f"the checkpoint was written by algorithm {saved.get('algorithm')!r}, but this engine "
                             f"runs {name!r}")
        # knobs an earlier version had: dropped where they hold what this version always does;
        # knobs it did not have yet: the value it ran with
        saved = type(self.algorithm).with_added_knobs(type(self.algorithm).current_config(saved))
        if saved != config:
            differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
            detail = ", ".join(f"{k}={saved.get(k)!r} (this engine: {config.get(k)!r})" for k in differ)
            raise ValueError(f"the checkpoint was written by {name} with {detail}; resume with the knobs that "
                             f"wrote it")
        # the step counter (states saved without it hold the same count in their statistics)
        self.ctx.steps = int(state.get("steps", state["stats"]["steps"]))
        self.bound.load_state_dict(state["algorithm"])
        self.guard.consecutive_skips = int(state["consecutive_skips"])
        self.comm.stats.load(state["stats"])

    def _settle_guard(self) -> None:
        """Finish a deferred finiteness decision (raises on every rank for a bad step)."""
        if self.guard.pending:
            with self._waiting(not self.guard.pending_carried):
                self.guard.settle()

    @contextmanager
    def _waiting(self, charge: bool = True) -> Iterator[None]:
        """Charge the time spent inside to ``stats.comm_wait_s`` (exposed communication).
        ``charge=False`` where a decision carried by the algorithm is settled: the algorithm's
        own handles charge that wait, and it must not count twice."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if charge:
                self.comm.stats.comm_wait_s += time.perf_counter() - t0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.bound.close()


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    algorithm: "str | Algorithm" = "ssgd",
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    nonfinite: str = "raise",
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    scaler: Optional[Any] = None,
    **algorithm_options: Any,
) -> Engine:
    """Make ``model`` train data-parallel with ``algorithm`` (a registry name such as
    ``"ssgd"`` plus options, or an algorithm object such as ``lowband.SSGD(bucket_mb=4)``).

    Requires an initialized torch.distributed process group. Rank 0's parameters and
    buffers are broadcast so all ranks start identical. Call ``engine.module`` for forward
    (it is ``model`` itself unless the algorithm wraps it).

    Reliability (docs/reliability.md): all ranks first check that they agree on the
    algorithm configuration, parameter layout, optimizer and world (else every rank raises
    :class:`lowband.ConfigMismatchError`); ``nonfinite`` ("raise", "skip" or "off") is what
    every rank does, together, when some rank's gradient holds a NaN or Inf; under "skip", at
    most ``max_consecutive_skips`` steps in a row are skipped before every rank raises.
    Modules with sparse gradients (``nn.Embedding(sparse=True)``) are refused with a
    ValueError.

    ``scaler``: the ``torch.amp.GradScaler`` of fp16 mixed precision (with
    ``nonfinite="off"``: the scaler decides about non-finite steps); then
    ``scaler.scale(loss).backward()``, ``engine.step()``, ``scaler.update()``
    (:meth:`Engine.step`). bf16 autocast needs no scaler.
    """
    return Engine(model, optimizer, make_algorithm(algorithm, **algorithm_options), process_group, nonfinite,
                  max_consecutive_skips, scaler)


def _copy_without_hooks(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` with every module hook dropped: hooks are closures over the
    algorithm (threads, locks, process groups) that cannot and must not be copied; the copy
    only needs parameters and buffers."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for attr, value in vars(module).items():
            if attr.endswith("hooks") and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(model, memo)

