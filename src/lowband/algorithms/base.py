"""The interface through which an algorithm sees a training iteration.

One iteration, as the engine drives it::

    model(x) ... loss.backward()        # on_gradient_ready(i) fires per parameter as its
                                        # gradient is accumulated (overlap communication here)
    engine.step()                       # -> algorithm.step(): finish/launch communication,
                                        #    write gradients, run the user's optimizer
    engine.synchronize()                # -> algorithm.drain(): no work in flight, the model
                                        #    holds the global weights (before eval / save)

The hooks are deliberately few but enough for the two lowband methods:

* CP-SGD keeps one communication in flight *across* ``step()`` calls and keeps global weights
  apart from the model's compute weights — ``step()`` owns the optimizer call, and ``drain()``
  settles the pipeline.
* The lazy update defers some parameters' communication for several steps — an algorithm
  decides per parameter what ``on_gradient_ready`` does and which gradients reach the
  optimizer (``p.grad = None`` makes torch optimizers skip a parameter).

Configuration and bound state are two objects (as Bagua's ``Algorithm`` / ``AlgorithmImpl``):
an :class:`Algorithm` is a dataclass of documented knobs and nothing else (``config()`` is what
ranks must agree on); :meth:`Algorithm.bind` attaches it to a model, optimizer and process
group and returns a new :class:`BoundAlgorithm` that holds every buffer, thread, counter and
residual and is what the engine drives. Binding never changes the configuration, so one
configuration can bind several engines, one after the other or side by side.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..comm.communicator import Communicator


@dataclass(frozen=True)
class GradientClip:
    """A request to clip gradients to a total ``norm_type``-norm of at most ``max_norm``
    (:meth:`lowband.Engine.clip_grad_norm_`), applied by the algorithm where its table in
    docs/architecture.md says: for the synchronous ones to the averaged gradient, right before
    the optimizer step, as a DDP script's ``clip_grad_norm_`` does."""

    max_norm: float
    norm_type: float = 2.0

    def apply(self, grads: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        """Clip ``grads`` (None entries skipped) in place and return their total norm before
        clipping: the operations of ``torch.nn.utils.clip_grad_norm_`` in the same order, so
        the result equals it bit for bit for the same tensors in the same order."""
        present = [g for g in grads if g is not None]
        if not present:
            return torch.tensor(0.0)
        total = torch.nn.utils.get_total_norm(present, self.norm_type)
        coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        by_device: dict[tuple, list[torch.Tensor]] = {}
        for g in present:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device.items():
            torch._foreach_mul_(group, coef.to(device))
        return total


@dataclass(frozen=True)
class Finiteness:
    """What an algorithm declares about one iteration to the engine's non-finite gradient
    check (:mod:`lowband.engine.guard`), through :meth:`BoundAlgorithm.finiteness`: when its
    gradients can first reach another rank or the global model, and where it holds gradients
    outside ``.grad``. The guard takes every other part of the protocol."""

    #: ``"now"`` (:attr:`NOW`): this ``step()`` may send the gradients to another rank or
    #: apply them to the global model, so every rank decides before the algorithm's ``step()``.
    #: ``"late"`` (:attr:`LATE`): they reach another rank or the global model only at a later
    #: ``step()`` (a depth-1 pipeline, a local step between averages): under the policy
    #: "raise" the ranks' exchange runs behind the next iteration and is decided at the next
    #: ``step()`` (or ``synchronize``, ``state_dict``, ``global_model``, ``check_replicas``),
    #: with no per-step barrier.
    #: ``"carried"`` (:attr:`CARRIED`): the algorithm's own messages, which reach every rank
    #: from every rank, test every gradient of the iteration. Under the policy "raise" (the
    #: only one an algorithm may carry; ``ctx.decide_finiteness`` is set then) the engine
    #: neither tests nor exchanges anything, and ``step()`` must report the verdict through
    #: ``ctx.decide_finiteness`` before it applies anything (the engine raises if it does not).
    #: Under the other policies the check is the engine's, and ``"late"`` and ``"carried"``
    #: are decided as ``"now"``.
    mode: str = "now"
    #: gradient contributions of the iteration that the algorithm holds outside ``.grad`` (the
    #: lazy update's tied-weight split): a callable that returns ``(parameter index, tensor)``
    #: pairs, which the engine reads at ``step()`` and checks with the rest (under a GradScaler:
    #: unscales in place) before its decision; not with ``"carried"``. None: none
    captured: Optional[Callable[[], Sequence[tuple[int, torch.Tensor]]]] = None

    MODES: ClassVar[tuple[str, ...]] = ("now", "late", "carried")
    NOW: ClassVar["Finiteness"]
    LATE: ClassVar["Finiteness"]
    CARRIED: ClassVar["Finiteness"]

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise ValueError(f"Finiteness mode must be one of {', '.join(self.MODES)}, got {self.mode!r}")


Finiteness.NOW, Finiteness.LATE, Finiteness.CARRIED = (Finiteness(m) for m in Finiteness.MODES)


@dataclass
class EngineContext:
    """What an algorithm is bound to. ``params`` holds the trainable parameters in
    registration order with their qualified names (tied parameters appear once)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    names: list[str]
    params: list[nn.Parameter]
    comm: Communicator
    #: set when the engine's finiteness policy is "raise", the only one an algorithm may carry
    #: (:attr:`Finiteness.CARRIED`; None: do not check, the guard does or no one does). A step
    #: that carries it reports its verdict here before it applies anything: per
    #: rank, the index of its first parameter with a non-finite gradient (-1: none; the same on
    #: every rank). Called with that list (after the step's communication, before the
    #: optimizer) it raises :class:`lowband.NonFiniteGradientError` on every rank for a bad
    #: step; called with a callable that returns it, the decision waits until the next
    #: ``step()`` (or ``synchronize``, ``state_dict``, ``global_model``), for a step whose
    #: average reaches the global model only then (a pipeline)
    decide_finiteness: Optional[Callable[[Union[Sequence[int], Callable[[], Sequence[int]]]], None]] = None
    #: the clipping requested for the coming step (:meth:`lowband.Engine.clip_grad_norm_`;
    #: None: none). Set by the engine before ``step()`` and cleared after it; the algorithm
    #: applies it with :meth:`clip_gradients`
    clip: Optional[GradientClip] = None
    #: the total norm that the last applied clipping measured (before clipping)
    grad_norm: Optional[torch.Tensor] = None
    #: the ``torch.amp.GradScaler`` of the coming step, for algorithms that take it in their
    #: own step (:attr:`BoundAlgorithm.scales`; None: none, or the engine unscaled the
    #: gradients already): :meth:`optimizer_step`
    scaler: Optional[Any] = None
    #: the engine's step counter, the algorithms' clock: ``Engine.step()`` calls completed so
    #: far, steps skipped on every rank for a non-finite gradient included. During a step (its
    #: forward, backward and ``step()``) it is that step's 0-based index. The engine advances
    #: it once per ``step()``, carries it across :meth:`lowband.Engine.rebuild` and saves and
    #: restores it with its state, so a resumed run continues the same clock
    steps: int = 0
    #: whether the engine may skip a step on every rank after its backward has run (the policy
    #: "skip", a GradScaler's inf step: :mod:`lowband.engine.guard`); ``step()`` is then not
    #: called for it. Set before the first backward. An algorithm whose own code runs inside
    #: backward and keeps state across steps (``ddp-powersgd``'s comm hook) keeps what that code
    #: changes until the step applies, and puts it back when the step was skipped
    skippable: bool = False

    def optimizer_step(self) -> None:
        """The optimizer step of ``.grad`` as it is now, for an algorithm whose ``.grad`` then
        holds the same average on every rank: under a GradScaler unscaled first
        (``scaler.unscale_``), then clipped (:attr:`clip`), then ``scaler.step``, which skips
        the step where the unscaled gradient is not finite, on every rank alike (the average
        carries one rank's inf to every rank); without one, clipped and ``optimizer.step()``."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip is not None:
            self.clip_gradients([p.grad for p in self.params])
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()

    def clip_gradients(self, grads: Sequence[Optional[torch.Tensor]], clip: Optional[GradientClip] = None,
                       record: bool = True) -> None:
        """Clip ``grads`` in place by ``clip`` (default: this step's request; nothing when
        there is none); ``record``: keep the measured norm in ``grad_norm``."""
        clip = self.clip if clip is None else clip
        if clip is not None:
            norm = clip.apply(grads)
            if record:
                self.grad_norm = norm

    @property
    def exposed_wait_s(self) -> float:
        """Exposed communication wait charged on this rank so far (seconds): the engine's
        waits and those of the handles the algorithm waited for (``comm_wait_s`` of the
        engine's statistics). The wait within an interval is the difference of two reads."""
        return self.comm.stats.comm_wait_s

    def charge_wait(self, seconds: float) -> None:
        """Charge ``seconds`` of exposed wait that lowband's handles did not time (a
        collective a peer library issued and waited for itself) to the engine's statistics."""
        self.comm.stats.comm_wait_s += seconds

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size


class Algorithm(ABC):
    """Base class for data-parallel algorithms' configuration. Subclasses are dataclasses
    whose fields are the documented knobs; ``name`` is the registry name used by the CLI.
    Validation of the knobs belongs in ``__post_init__``; state belongs in the bound object."""

    name: ClassVar[str] = "base"
    #: knobs that earlier versions of the algorithm had and this one no longer has, each with
    #: the value whose behaviour the code now always has. A configuration saved with that value
    #: (a checkpoint's) describes what this version runs, and is read without the knob; one
    #: saved with another value describes a run this version does not continue
    #: (:meth:`current_config`)
    removed_knobs: ClassVar[Mapping[str, Any]] = {}
    #: knobs added after checkpoints of the algorithm were first written, each with the value
    #: whose behaviour every earlier version had: a saved configuration without one ran with
    #: that value (:meth:`with_added_knobs`)
    added_knobs: ClassVar[Mapping[str, Any]] = {}

    def config(self) -> dict[str, Any]:
        """The knobs, as plain data (logged, and compared across ranks)."""
        cfg = dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}
        return {"algorithm": self.name, **{k: v for k, v in cfg.items() if not k.startswith("_")}}

    @classmethod
    def with_added_knobs(cls, saved: Mapping[str, Any]) -> dict[str, Any]:
        """``saved`` (this algorithm's whole ``config()`` as an earlier version wrote it) with
        each of the :attr:`added_knobs` it lacks at the value that version ran with. Only for
        a whole configuration: in a run's own options a missing knob meant that version's
        default, not the value before the knob existed."""
        return {**cls.added_knobs, **saved}

    @classmethod
    def options_from_before(cls, saved: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
        """A run's own options as an earlier version saved them (``saved``), with each of the
        :attr:`added_knobs` that ``now`` (the options of the run that continues it) gives at
        the value the versions before the knob ran with: the same run if the checkpoint
        predates the knob (its engine state, which holds the whole configuration, decides)."""
        options = dict(saved)
        for knob, then in cls.added_knobs.items():
            if knob in now and knob not in options:
                try:
                    same = _coerce(type(then), now[knob], f"option {knob!r}") == then
                except OptionError:
                    same = False
                if same:
                    options[knob] = now[knob]
        return options

    @classmethod
    def current_config(cls, saved: Mapping[str, Any]) -> dict[str, Any]:
        """``saved`` (this algorithm's knobs as an earlier version wrote them: a checkpoint's
        ``config()``, a run's options) without the :attr:`removed_knobs` that hold the value
        this version always runs with (strings such as the CLI's ``"false"`` are read as the
        knob's type). ValueError, one line naming the knob, for one that holds another value:
        the run it describes took the path this version no longer has, so this version does
        not continue it."""
        current = dict(saved)
        for knob, now in cls.removed_knobs.items():
            if knob not in current:
                continue
            value = current.pop(knob)
            try:
                same = _coerce(type(now), value, f"option {knob!r}") == now
            except OptionError:
                same = False
            if not same:
                raise ValueError(f"the checkpoint was written with {cls.name}'s {knob}={value!r}, a knob this "
                                 f"version of lowband no longer has: it always runs as {knob}={now!r}, so it cannot "
                                 "continue that run; resume with the lowband version that wrote it")
        return current

    @abstractmethod
    def bind(self, ctx: EngineContext) -> "BoundAlgorithm":
        """This configuration attached to a model, optimizer and process group: a new object
        that allocates the buffers and state (the configuration is not changed)."""


class BoundAlgorithm(ABC):
    """An algorithm bound to one engine: ``cfg`` (its :class:`Algorithm`, read only) and
    ``ctx``, plus whatever state the algorithm keeps. The engine calls these methods."""

    #: whether the engine should call :meth:`on_gradient_ready` during backward
    uses_gradient_hooks: ClassVar[bool] = True
    #: whether :meth:`on_gradient_ready` takes the gradient's values (copies them into a
    #: bucket, hands them to a reducer) and ``step()`` writes the average back over ``.grad``:
    #: a change the user makes to ``.grad`` between backward() and step() (their own
    #: ``clip_grad_norm_``) would then be lost, so the engine refuses it with one line
    captures_gradients: ClassVar[bool] = False
    #: whether ``step()`` applies ``ctx.clip`` (:meth:`lowband.Engine.clip_grad_norm_`); an
    #: algorithm that does not is refused the request with one line
    clips: ClassVar[bool] = False
    #: whether :meth:`lowband.Engine.rebuild` may close this binding and bind the algorithm
    #: anew to another parameter set (False: state outside lowband is tied to the old one)
    rebuildable: ClassVar[bool] = True
    #: whether ``step()`` takes the GradScaler itself (``ctx.scaler``, through
    #: ``ctx.optimizer_step``): its ``.grad`` then holds the same average of the *scaled*
    #: gradients on every rank (or, with no communication, the rank's own), which the scaler
    #: unscales and steps. False: the engine unscales every gradient before the algorithm takes
    #: it and decides about a non-finite step with every rank (:mod:`lowband.engine.guard`), so
    #: the algorithm only sees unscaled gradients and keeps nothing in units of the scale
    scales: ClassVar[bool] = False

    def __init__(self, cfg: Algorithm, ctx: EngineContext) -> None:
        self.cfg = cfg
        self.ctx = ctx

    @property
    def name(self) -> str:
        return self.cfg.name

    def wrap_module(self, model: nn.Module) -> nn.Module:
        """The module the user should call for forward (peers such as DDP wrap it)."""
        return model

    def on_gradient_ready(self, index: int) -> None:
        """``ctx.params[index].grad`` has just been accumulated during backward."""

    def no_sync(self) -> ContextManager[None]:
        """Entered by :meth:`lowband.Engine.no_sync` around micro-batches whose gradients only
        accumulate (the engine holds back the gradient hooks itself). Peers that wrap the
        module in something with its own hooks (DDP) return that wrapper's ``no_sync()``."""
        return contextlib.nullcontext()

    @abstractmethod
    def step(self) -> None:
        """Called once per iteration after backward; must advance the optimizer."""

    def drain(self) -> None:
        """Finish all in-flight work so the model holds the global weights."""

    def finiteness(self) -> Finiteness:
        """This iteration's declaration to the engine's non-finite gradient check
        (:class:`Finiteness`): when its gradients can first reach another rank or the global
        model, whether the algorithm's messages carry the check, and gradients it holds outside
        ``.grad``. Asked during backward (in the gradient hook) and before ``step()``; the
        answer must not change within one iteration. Default: :attr:`Finiteness.NOW`."""
        return Finiteness.NOW

    def global_parameters(self) -> "Optional[list[torch.Tensor]]":
        """The global model's parameter values, aligned with ``ctx.params``, for evaluating or
        checking the global model without changing training state (callers must not modify
        them). ``None``: the model's own parameters are the global model. An algorithm whose
        replicas differ between syncs (local SGD) may compute an average here, on copies."""
        return None

    def replicated_state(self) -> "tuple[Optional[list[torch.Tensor]], bool]":
        """What every rank must hold bit-identically between steps, checked after a checkpoint
        is loaded (:meth:`lowband.Engine.check_replicas`): the parameter values that are
        replicated, aligned with ``ctx.params`` (``None``: none are), and whether the
        optimizer's per-parameter state is. Default: the global parameters and the optimizer
        state (every rank applies the same averaged gradient). Algorithms whose replicas
        legitimately differ (local SGD between averages, no communication at all) override it;
        it must not communicate."""
        values = self.global_parameters()
        return (list(self.ctx.params) if values is None else list(values)), True

    def step_metrics(self) -> dict[str, Any]:
        """Plain-data values of the step just taken that the training loop logs in
        ``steps.jsonl`` (the lazy update's tau and sync flag, CP-SGD's correction flag, ...).
        Must not communicate and must not change state."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Plain-data facts about the run that the training loop writes into ``summary.json``
        under ``algorithm_summary`` at the end (the lazy update's lazy layers, ...). Must not
        communicate and must not change state."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Trajectory-relevant state (residuals, counters, pipeline), keyed by parameter name."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no state but was given {sorted(state)}")

    def close(self) -> None:
        """Release hooks and buffers."""


# -- option checking ----------------------------------------------------------------------------
#: strings accepted for a bool option (the CLI passes ``--option overlap=false`` as a string)
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
NONE_WORDS = ("none", "null")


class OptionError(ValueError):
    """An algorithm option of the wrong type or out of range (names the option)."""


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            dict: "a KEY=VALUE mapping"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """``value`` as the annotated type ``tp`` (strings are parsed), or OptionError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in NONE_WORDS):
            return None
        if len(inner) == 1:
            try:
                return _coerce(inner[0], value, where)
            except OptionError as e:
                raise OptionError(str(e).replace(", got ", " or none, got ", 1)) from None
        for member in inner:          # the first member the value is (or parses as) wins
            try:
                return _coerce(member, value, where)
            except OptionError:
                continue
        names = " or ".join(_type_name(typing.get_origin(m) or m) for m in inner)
        raise OptionError(f"{where} must be {names}, got {value!r}")
    if tp is Any:
        return value
    base = origin or tp
    text = value.strip() if isinstance(value, str) else None
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if text is not None and text.lower() in TRUE_WORDS + FALSE_WORDS:
            return text.lower() in TRUE_WORDS
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if text is not None:
            try:
                return int(text)
            except ValueError:
                pass
    elif base is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif text is not None:
            try:
                number = float(text)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise OptionError(f"{where} must be a finite number, got {value!r}")
            return number
    elif base is str:
        if isinstance(value, str):
            return value
    elif base is dict:
        if isinstance(value, dict):
            return value
    else:
        return value
    raise OptionError(f"{where} must be {_type_name(base)}, got {value!r}")


def _check_range(spec: dataclasses.Field, value: Any, where: str) -> None:
    """Numbers must be >= ``metadata["min"]`` (default 0: every lowband knob that is a count,
    a size, a rate or a period is non-negative) and <= ``metadata["max"]`` if given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high = spec.metadata.get("min", 0), spec.metadata.get("max")
    if value < low:
        raise OptionError(f"{where} must be >= {low}, got {value!r}")
    if high is not None and value > high:
        raise OptionError(f"{where} must be <= {high}, got {value!r}")


def check_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """Options for the dataclass algorithm ``cls``, each coerced to its field's annotated type
    and range-checked; OptionError names the first bad option (or the unknown one). One
    generic check for every algorithm, so none hand-writes type checks; an algorithm's
    ``__post_init__`` adds the checks that need more than a type and a lower bound."""
    if not dataclasses.is_dataclass(cls):
        return dict(options)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in options.items():
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise OptionError(f"unknown option {key!r}; its options are: {known}")
        where = f"option {key!r}"
        coerced = _coerce(hints.get(key, Any), value, where)
        _check_range(fields[key], coerced, where)
        out[key] = coerced
    return out


def check_fields(algorithm: Algorithm) -> None:
    """The checks of :func:`check_options` on an algorithm object's current field values."""
    if dataclasses.is_dataclass(algorithm):
        values = {f.name: getattr(algorithm, f.name) for f in dataclasses.fields(algorithm)
                  if f.init and not f.name.startswith("_")}
        check_options(type(algorithm), values)
