"""The engine's non-finite gradient guard: one agreed decision per step, before the algorithm
is allowed to apply anything.

A NaN on one rank is a *distributed* problem: averaged into the all-reduce it poisons every
rank's model, and a check on local data alone (``if not loss.isfinite(): raise``) stops one
rank while the others wait in their next collective until the timeout. The guard therefore
checks each gradient as it becomes ready (inside the engine's gradient hook, overlapping
with the rest of backward), and at ``engine.step()`` all ranks exchange their first bad
parameter index (one int64 per rank, in one tiny MAX all-reduce) and take the same decision:

* ``"raise"`` (default): every rank raises :class:`NonFiniteGradientError` naming the step,
  the bad ranks and each one's first bad parameter. Gradients keep streaming to the
  algorithm during backward (overlap is kept); the error is raised before
  ``algorithm.step()``, so the optimizer never applies the step, and the engine refuses any
  further use (the algorithm may already have folded the bad gradients into its state).
* ``"skip"``: the algorithm is not told about any gradient until the step is known to be
  finite (the hook only records the ready order and replays it at ``step()``), so a skipped
  step leaves the model, the optimizer and the algorithm state (residuals, lazy sums)
  untouched; gradients are dropped and ``stats.skipped_steps`` counts it. The price is the
  overlap of communication with backward (measured in docs/reliability.md). At most
  ``max_consecutive_skips`` steps in a row are skipped: the next consecutive non-finite step
  raises :class:`NonFiniteGradientError` on every rank (a run that skips every step has
  diverged; skipping on would end with exit 0 and a meaningless model).
* ``"off"``: no check, no extra collective.

What the guard needs from the algorithm is one declaration per iteration,
``BoundAlgorithm.finiteness()`` (a :class:`~lowband.algorithms.base.Finiteness`): when its
gradients can first reach another rank or the global model (``"now"``, ``"late"``), whether its
own messages carry the check (``"carried"``), and gradients it holds outside ``.grad``.

Under ``"raise"``, an algorithm whose step reaches the global model only at a later
``step()`` (CP-SGD's pipeline after its warm-up, ``noop``'s unshared replicas, the local steps
of ``localsgd`` and DiLoCo between their syncs: ``Finiteness.LATE``) gets a deferred
decision: the exchange starts at ``engine.step()`` and is finished at the next one (or at
``synchronize``, ``state_dict``, ``global_model``, ``check_replicas``), still before that
step's average touches the global weights. Waiting at once would queue the exchange
behind the step's gradient bytes on a slow link and make the pipeline synchronous again, and
put a barrier on every local step (measured: docs/reliability.md). The time spent waiting for
an exchange is exposed communication and counted as such in ``comm_wait_s``.

An algorithm whose messages already reach every rank from every rank can carry the check
itself (``Finiteness.CARRIED``: the compressed buckets of ``compressed`` and CP-SGD mark each
parameter's non-finite gradient in their flag bytes). For such a step the hook does not
test the gradients and no exchange runs; the algorithm's ``step()`` reports the per-rank
first bad index through ``EngineContext.decide_finiteness``: the verdict itself
after its buckets arrive and before the optimizer (``compressed``: decided at once), or a
callable that returns it (CP-SGD's pipeline: settled at the same points as a deferred
exchange, still before that step's average reaches the global weights). The message, the
error and the agreement are those of the exchange; the guard's all-reduce and its
per-parameter tests are gone from the step.

The guard is the engine's one carrier of this protocol: it makes what the engine's gradient
hooks do (:meth:`GradientGuard.delivery`), what the algorithm's context reports to
(:attr:`GradientGuard.carrier`), and runs each ``engine.step()`` around the algorithm's
``step()`` (:meth:`GradientGuard.run`).

With a ``torch.amp.GradScaler`` handed to ``lowband.distribute(..., scaler=...)`` (and
``nonfinite="off"``), an algorithm that does not take the scaler in its own ``step()``
(``BoundAlgorithm.scales`` False) gets the guard in its ``"scale"`` mode, GradScaler's
semantics agreed by every rank: each gradient is unscaled in the hook as backward produces it
(``torch._amp_foreach_non_finite_check_and_unscale_``, the operation of ``scaler.unscale_``),
so the algorithm only ever sees unscaled gradients and whatever it keeps across steps
(residuals, windows, local steps) is in the units of an fp32 run, whatever the scale does.
The algorithm is told about the gradients only at ``engine.step()``, as under ``"skip"``,
once the ranks have exchanged whether any found an inf or NaN; the agreed verdict is recorded
in the scaler (:class:`ScalerVerdict`), so ``scaler.update()`` backs off (or counts towards
growth) on every rank alike, and a non-finite step is skipped on every rank with nothing of
the model, the optimizer or the algorithm's state changed. There is no limit on consecutive
skips: the scaler keeps backing off, as GradScaler does.

The exchange runs on a dedicated process group: under ``"raise"`` the algorithm's own
collectives may still be in flight, and their number per rank can differ at this point
(a bucket with a rank-specific unused parameter launches only in ``algorithm.step()``), so
sharing their group would pair the check with a gradient bucket on some rank.
"""
from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist

from ..algorithms.base import Finiteness
from ..comm.communicator import Communicator
from ..comm.finite import all_finite

NONFINITE_POLICIES = ("raise", "skip", "off")
#: default of ``max_consecutive_skips``: a healthy fp32 run has no two non-finite steps in a
#: row (an outlier batch costs one skip); a diverged one has nothing but. 10 tolerates a burst
#: of bad batches and stops a diverged run after 11 steps (tested with --lr 1e30)
DEFAULT_MAX_CONSECUTIVE_SKIPS = 10
#: "no bad parameter" in the exchanged per-rank index
ALL_FINITE = -1


def group_timeout(group: Optional[dist.ProcessGroup]) -> timedelta:
    """The collective timeout ``group`` was created with. ``new_group`` does not inherit it
    (it defaults to 30 minutes), and a guard exchange that waits that long on a dead peer
    would defeat ``--timeout``. torch has no public getter, hence the fallback."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def first_false(indices: Sequence[int], oks: Sequence[torch.Tensor]) -> int:
    """The smallest of ``indices`` whose 0-dim bool in ``oks`` (all on one device) is False,
    ``ALL_FINITE`` if none: computed on that device and read back once."""
    index = torch.tensor(list(indices), dtype=torch.int64, device=oks[0].device)
    none = torch.iinfo(torch.int64).max
    first = int(torch.where(torch.stack(list(oks)), none, index).min())
    return ALL_FINITE if first == none else first


class NonFiniteGradientError(FloatingPointError):
    """Some rank produced a NaN/Inf gradient (raised identically on every rank). With
    ``skipped`` > 0 the policy was "skip" and that many steps in a row were already skipped."""

    def __init__(self, step: int, bad: dict[int, str], skipped: int = 0):
        self.step = step
        self.bad = bad   # rank -> name of its first parameter with a non-finite gradient
        self.skipped = skipped
        where = ", ".join(f"rank {r} (first parameter {name!r})" for r, name in bad.items())
        if skipped:
            advice = (f"the {skipped} steps before it were skipped for the same reason, the limit "
                      "(max_consecutive_skips, CLI: --max-skips): training has diverged; lower the learning rate")
        else:
            advice = ("lower the learning rate, or pass nonfinite='skip' (CLI: --nonfinite skip) "
                      "to drop such steps on all ranks")
        super().__init__(f"non-finite gradient at step {step} on {where}; {advice}")


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN/Inf while the gradient check is off (``nonfinite="off"``)."""

    def __init__(self, step: int, rank: int, value: float):
        self.step, self.rank, self.value = step, rank, value
        super().__init__(f"loss became {value} at step {step} on rank {rank} (--nonfinite off: gradients are "
                         "not checked, so the model may already be non-finite on every rank); lower the "
                         "learning rate, or use --nonfinite raise or skip")


def check_policy(policy: str, max_consecutive_skips: int) -> None:
    """ValueError for an unknown policy or a skip limit that is not an integer >= 1."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {policy!r}")
    if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) or \
            max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be an integer >= 1, got {max_consecutive_skips!r}")


class ScalerVerdict:
    """A step's agreed finiteness as ``GradScaler.unscale_`` reads an optimizer: one 0-dim
    "parameter" whose gradient is inf when some rank's gradient was not finite, else 0.
    Unscaling it records that verdict in the scaler through its public interface, so
    ``scaler.update()`` backs off or counts the step towards growth on every rank alike."""

    def __init__(self, device: torch.device):
        self.flag = torch.zeros((), dtype=torch.float32, device=device)
        self.param_groups = [{"params": [self.flag]}]

    def record(self, scaler: Any, nonfinite: bool) -> None:
        self.flag.grad = torch.full((), math.inf if nonfinite else 0.0, dtype=torch.float32, device=self.flag.device)
        scaler.unscale_(self)


class GradientGuard:
    """Checks gradients in the engine's hook and decides, with all ranks, whether a step applies.

    ``scaler``: a ``torch.amp.GradScaler`` whose scaled gradients this guard unscales and
    decides about (the ``"scale"`` mode, module docstring); ``policy`` must then be "off"."""

    def __init__(self, policy: str, names: Sequence[str], params: Sequence[torch.nn.Parameter],
                 group: Optional[dist.ProcessGroup], max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
                 scaler: Optional[Any] = None):
        check_policy(policy, max_consecutive_skips)
        if scaler is not None and policy != "off":
            raise ValueError(f"a GradScaler decides about non-finite steps itself: nonfinite must be 'off', "
                             f"got {policy!r}")
        self.policy = "scale" if scaler is not None else policy
        self.scaler = scaler
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.names = list(names)
        self.params = list(params)
        self.deferring = self.policy in ("skip", "scale")
        #: "scale" mode: this step's 1 / scale and found-inf flag per device (made at the step's
        #: first gradient), and the verdict recorded in the scaler
        self._inv_scale: dict[torch.device, torch.Tensor] = {}
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        self._verdict = None if scaler is None else ScalerVerdict(params[0].device if params else torch.device("cpu"))
        self.failed: Optional[NonFiniteGradientError] = None
        self._finite: list[tuple[int, torch.Tensor]] = []
        self._ready: list[int] = []
        self.comm: Optional[Communicator] = None
        self._pending = None   # (step, tensor, work, verdict) of a deferred decision (start/settle)
        #: the bound algorithm whose steps this guard decides about (:meth:`attach`)
        self.bound = None
        self._expected: Optional[int] = None   # the synchronous step whose carried verdict is due
        if self.policy != "off" and dist.get_world_size(group) > 1:
            # every rank creates it in the same order (inside distribute), as new_group requires
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            group_ = dist.new_group(ranks=ranks, backend="gloo", timeout=group_timeout(group))
            # own counters: the engine's stats measure the algorithm's traffic, which the
            # benchmarks compare byte for byte; the guard's few bytes are reported apart
            self.comm = Communicator(group_)

    @property
    def active(self) -> bool:
        return self.policy != "off"

    # -- the engine's side -------------------------------------------------------------------
    @property
    def carrier(self) -> Optional[Callable[[Any], None]]:
        """What the algorithm's context reports a carried verdict to
        (``EngineContext.decide_finiteness``): :meth:`decide_carried` under "raise", the only
        policy an algorithm may carry; None otherwise (the algorithm checks nothing)."""
        return self.decide_carried if self.policy == "raise" else None

    def attach(self, bound: Any) -> None:
        """Decide about the steps of ``bound`` (a ``BoundAlgorithm``, which declares each
        iteration's :class:`Finiteness`) from now on."""
        self.bound = bound

    def _carried(self, declared: Optional[Finiteness] = None) -> bool:
        """Whether the algorithm's messages carry the check of this iteration (as ``declared``;
        asked when not given). Only under "raise": under the other policies the check is the
        guard's."""
        if self.policy != "raise":
            return False
        return (declared if declared is not None else self.bound.finiteness()).mode == "carried"

    def delivery(self, index: int, forward: Optional[Callable[[int], None]]) -> Callable[[], None]:
        """What the engine's gradient hook of parameter ``index`` does outside ``no_sync()``:
        tell the algorithm (``forward``), through this guard when it is active."""
        if not self.active:
            return lambda: forward(index)
        return lambda: self.on_gradient(index, forward)

    def run(self, step: int, forward: Optional[Callable[[int], None]],
            waiting: Callable[[bool], ContextManager[None]]) -> bool:
        """One ``engine.step()`` (``step``: 1-based): decide about this step's gradients as the
        policy and the algorithm say and run the algorithm's ``step()``. Returns False when
        the step was skipped on every rank (then the algorithm was told nothing). ``forward``:
        what deferred gradients are handed to; ``waiting(charge)``: the engine's context that
        charges the time inside it to the exposed wait (not where a decision the algorithm
        carries is settled: its own handles charge that)."""
        bound = self.bound
        if not self.active:
            bound.step()
            return True
        declared = bound.finiteness()
        carried = self._carried(declared)
        if not carried and declared.captured is not None:
            for index, gradient in declared.captured():
                self.record(index, gradient)
        with waiting(not self.pending_carried):
            if carried:     # settles the previous step's deferred decision first
                self.expect_carried(step)
            elif self.policy == "raise" and declared.mode == "late":
                self.start(step)   # settles the previous step's deferred decision first
            elif not self.check(step):
                return False
        self.replay(forward)
        bound.step()        # a carrying step reports through ctx.decide_finiteness before applying anything
        if carried:
            self.ensure_carried_decided()
        return True

    # -- the hook's side ---------------------------------------------------------------------

    def on_gradient(self, index: int, forward: Optional[Callable[[int], None]]) -> None:
        """Hook body: record whether this gradient is finite (``"scale"``: unscale it, which
        records that); forward it now unless deferring."""
        grad = self.params[index].grad
        if self.scaler is not None:
            if grad is not None:
                self._unscale(grad)
        elif grad is not None and not self._carried():
            self._finite.append((index, all_finite(grad)))
        if self.deferring:
            self._ready.append(index)
        elif forward is not None:
            forward(index)

    def record(self, index: int, gradient: torch.Tensor) -> None:
        """Check one more gradient contribution of parameter ``index`` that an algorithm holds
        outside ``.grad`` (``Finiteness.captured``; ``"scale"``: unscale it in place); before
        the decision."""
        if self.scaler is not None:
            self._unscale(gradient)
        else:
            self._finite.append((index, all_finite(gradient)))

    def _unscale(self, grad: torch.Tensor) -> None:
        """``"scale"``: divide ``grad`` by the scaler's scale in place and note whether it held
        an inf or NaN, as ``scaler.unscale_`` does it (the scale is read once per step: it
        changes only in ``scaler.update()``, after the step)."""
        device = grad.device
        inv = self._inv_scale.get(device)
        if inv is None:
            scale = self.scaler.get_scale()
            # 1 / scale rounded to fp32 from a float64 quotient, as GradScaler computes it
            inv = self._inv_scale[device] = torch.full((), 1.0 / scale, dtype=torch.float32, device=device)
            self._found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        with torch.no_grad():
            torch._amp_foreach_non_finite_check_and_unscale_([grad], self._found_inf[device], inv)

    def end_step(self) -> None:
        """At the end of every ``engine.step()``: forget the scale the hooks read, also when
        the step raised before its decision, so the next backward reads it afresh."""
        self._inv_scale.clear()
        self._found_inf.clear()

    def _first_bad(self) -> int:
        """This rank's first parameter index (registration order) with a non-finite gradient.
        The decision is the host's (raise, skip), so the tests are read back: on the CPU one
        by one (they are host values already), on an accelerator all in one read-back.
        ``"scale"``: 0 when any gradient was not finite (the scaler needs no name)."""
        if self.scaler is not None:
            found = any(bool(f) for f in self._found_inf.values())
            self.end_step()
            return 0 if found else ALL_FINITE
        if self._finite and all(ok.device.type != "cpu" for _, ok in self._finite) and \
                len({ok.device for _, ok in self._finite}) == 1:
            return first_false([i for i, _ in self._finite], [ok for _, ok in self._finite])
        bad = [i for i, ok in self._finite if not bool(ok)]
        return min(bad) if bad else ALL_FINITE

    def check(self, step: int) -> bool:
        """Agree on this step; True if it may be applied. Raises or clears gradients otherwise.
        A deferred decision about an earlier step (:meth:`start`) is settled first."""
        self._refuse_if_failed()
        self.settle()
        everyone = self._exchange(step, async_op=False)[1]
        return self._decide(step, everyone)

    def start(self, step: int) -> None:
        """Begin this step's exchange without waiting for it (policy "raise" only): for an
        algorithm whose step applies its averaged gradient to the global model only at the
        next ``step()`` (a pipeline: ``Finiteness.LATE``), the decision
        can wait until then, and waiting now would queue this tiny all-reduce behind the
        step's gradient bytes on the link, turning the pipeline back into a synchronous
        step. :meth:`settle` finishes it, before anything depends on the step."""
        if self.policy != "raise":
            raise RuntimeError(f"a deferred finiteness decision needs policy 'raise', not {self.policy!r}")
        self._refuse_if_failed()
        self.settle()
        self._pending = self._exchange(step, async_op=True) + (None,)

    def expect_carried(self, step: int) -> None:
        """A step whose finiteness travels in the algorithm's messages: the algorithm's
        ``step()`` calls :meth:`decide_carried` before applying anything."""
        self._refuse_if_failed()
        self.settle()
        self._finite.clear()
        self._expected = step

    def decide_carried(self, verdict: "Sequence[int] | Callable[[], Sequence[int]]") -> None:
        """The expected step's agreed verdict: per rank, the index of its first parameter with
        a non-finite gradient (``ALL_FINITE`` if none; the same on every rank). A sequence is
        decided at once (raise on every rank if some rank's gradient was not finite); a
        callable that returns it is decided later, as a deferred exchange (:meth:`settle`), for
        a step whose gradients reach the global model only at a later ``step()``."""
        step, self._expected = self._expected, None
        if step is None:
            raise RuntimeError("decide_finiteness called outside a step that carries the finiteness check")
        if callable(verdict):
            self._pending = (step, None, None, verdict)
            return
        self._decide(step, torch.tensor(list(verdict), dtype=torch.int64))

    def ensure_carried_decided(self) -> None:
        """After the algorithm's step: RuntimeError if it did not report the verdict it carried."""
        if self._expected is not None:
            step, self._expected = self._expected, None
            raise RuntimeError(f"step {step}: the algorithm said it carries the finiteness check but its "
                               "step() never called ctx.decide_finiteness")

    def settle(self) -> None:
        """Finish the exchange :meth:`start` began (no-op if none): raise on every rank if
        some rank's gradient of that step was non-finite."""
        if self._pending is None:
            return
        step, everyone, work, verdict = self._pending
        self._pending = None
        if verdict is not None:
            everyone = torch.tensor(list(verdict()), dtype=torch.int64)
        if work is not None:
            work.wait()
        self._decide(step, everyone)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def pending_carried(self) -> bool:
        """The pending decision is one the algorithm carries (no exchange of the guard's own)."""
        return self._pending is not None and self._pending[3] is not None

    def _refuse_if_failed(self) -> None:
        if self.failed is not None:
            raise RuntimeError("the engine stopped after a non-finite gradient and cannot continue") from self.failed

    def _exchange(self, step: int, async_op: bool):
        """(step, tensor, work): slot r of the tensor holds rank r's first bad index; a MAX
        all-reduce of these few int64 fills every slot on every rank (cheaper to set up than
        an all-gather, same bytes)."""
        world = 1 if self.comm is None else self.comm.world_size
        rank = 0 if self.comm is None else self.comm.rank
        everyone = torch.full((world,), ALL_FINITE, dtype=torch.int64)
        everyone[rank] = self._first_bad()
        self._finite.clear()
        work = None
        if self.comm is not None:
            work = self.comm.all_reduce(everyone, op=dist.ReduceOp.MAX, async_op=async_op)
        return step, everyone, work

    def _decide(self, step: int, everyone: torch.Tensor) -> bool:
        bad = {r: self.names[int(i)] for r, i in enumerate(everyone.tolist()) if i != ALL_FINITE}
        if self._verdict is not None:
            self._verdict.record(self.scaler, bool(bad))
        if not bad:
            self.consecutive_skips = 0
            return True
        if self.policy == "raise" or (self.policy == "skip" and self.consecutive_skips >= self.max_consecutive_skips):
            self.failed = NonFiniteGradientError(step, bad, self.consecutive_skips if self.policy == "skip" else 0)
            raise self.failed
        self.consecutive_skips += 1
        self._ready.clear()
        for p in self.params:
            p.grad = None
        return False

    def replay(self, forward: Optional[Callable[[int], None]]) -> None:
        """Tell the algorithm, in the order backward produced them, about the deferred gradients."""
        ready, self._ready = self._ready, []
        if forward is not None:
            for index in ready:
                forward(index)
