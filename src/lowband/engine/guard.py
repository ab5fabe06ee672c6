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

Under ``"raise"``, an algorithm whose step reaches the global model only at a later
``step()`` (CP-SGD's pipeline after its warm-up, ``noop``'s unshared replicas, the local steps
of ``localsgd`` and DiLoCo between their syncs; see ``Algorithm.gradients_applied_late``) gets
a deferred decision: the exchange starts at ``engine.step()`` and is finished at the next one
(or at ``synchronize``, ``state_dict``, ``global_model``, ``check_replicas``), still before
that step's average touches the global weights. Waiting at once would queue the exchange
behind the step's gradient bytes on a slow link and make the pipeline synchronous again, and
put a barrier on every local step (measured: docs/reliability.md). The time spent waiting for
an exchange is exposed communication and counted as such in ``comm_wait_s``.

An algorithm whose messages already reach every rank from every rank can carry the check
itself (``BoundAlgorithm.carries_finiteness``: CP-SGD's pipelined buckets mark each
parameter's non-finite gradient in their flag bytes). For such a step the hook does not test
the gradients and no exchange runs; the deferred decision is settled at the same points, from
the per-rank first bad index the algorithm reports (``finiteness_verdict``); a synchronous
algorithm (``compressed``) reports it inside its ``step()``, after its buckets arrive and
before the optimizer (``EngineContext.decide_finiteness``). The message, the error and the
agreement are those of the exchange; the guard's all-reduce and its per-parameter
tests are gone from the step.

The exchange runs on a dedicated process group: under ``"raise"`` the algorithm's own
collectives may still be in flight, and their number per rank can differ at this point
(a bucket with a rank-specific unused parameter launches only in ``algorithm.step()``), so
sharing their group would pair the check with a gradient bucket on some rank.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

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


class GradientGuard:
    """Checks gradients in the engine's hook and decides, with all ranks, whether a step applies."""

    def __init__(self, policy: str, names: Sequence[str], params: Sequence[torch.nn.Parameter],
                 group: Optional[dist.ProcessGroup], max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS):
        check_policy(policy, max_consecutive_skips)
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.names = list(names)
        self.params = list(params)
        self.deferring = policy == "skip"
        self.failed: Optional[NonFiniteGradientError] = None
        self._finite: list[tuple[int, torch.Tensor]] = []
        self._ready: list[int] = []
        self.comm: Optional[Communicator] = None
        self._pending = None   # (step, tensor, work, verdict) of a deferred decision (start/settle)
        #: whether the gradients now being produced are checked by the algorithm (set by the
        #: engine: a callable asked in the hook, ``carries_finiteness`` under "raise")
        self.carried_by: Optional[Callable[[], bool]] = None
        self._expected: Optional[int] = None   # the synchronous step whose carried verdict is due
        if policy != "off" and dist.get_world_size(group) > 1:
            # every rank creates it in the same order (inside distribute), as new_group requires
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            group_ = dist.new_group(ranks=ranks, backend="gloo", timeout=group_timeout(group))
            # own counters: the engine's stats measure the algorithm's traffic, which the
            # benchmarks compare byte for byte; the guard's few bytes are reported apart
            self.comm = Communicator(group_)

    @property
    def active(self) -> bool:
        return self.policy != "off"

    def on_gradient(self, index: int, forward: Optional[Callable[[int], None]]) -> None:
        """Hook body: record whether this gradient is finite; forward it now unless deferring."""
        grad = self.params[index].grad
        if grad is not None and not (self.carried_by is not None and self.carried_by()):
            self._finite.append((index, all_finite(grad)))
        if self.deferring:
            self._ready.append(index)
        elif forward is not None:
            forward(index)

    def record(self, index: int, gradient: torch.Tensor) -> None:
        """Check one more gradient contribution of parameter ``index`` that an algorithm holds
        outside ``.grad`` (:meth:`BoundAlgorithm.captured_gradients`); before the decision."""
        self._finite.append((index, all_finite(gradient)))

    def _first_bad(self) -> int:
        """This rank's first parameter index (registration order) with a non-finite gradient.
        The decision is the host's (raise, skip), so the tests are read back: on the CPU one
        by one (they are host values already), on an accelerator all in one read-back."""
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
        next ``step()`` (a pipeline, :meth:`Algorithm.gradients_applied_late`), the decision
        can wait until then, and waiting now would queue this tiny all-reduce behind the
        step's gradient bytes on the link, turning the pipeline back into a synchronous
        step. :meth:`settle` finishes it, before anything depends on the step."""
        if self.policy != "raise":
            raise RuntimeError(f"a deferred finiteness decision needs policy 'raise', not {self.policy!r}")
        self._refuse_if_failed()
        self.settle()
        self._pending = self._exchange(step, async_op=True) + (None,)

    def start_carried(self, step: int, verdict: Callable[[], Sequence[int]]) -> None:
        """:meth:`start` for a step whose finiteness travels in the algorithm's own messages:
        no exchange; :meth:`settle` calls ``verdict()`` (per rank, the index of its first
        parameter with a non-finite gradient, ``ALL_FINITE`` if none; the same on every rank)."""
        if self.policy != "raise":
            raise RuntimeError(f"a deferred finiteness decision needs policy 'raise', not {self.policy!r}")
        self._refuse_if_failed()
        self.settle()
        self._finite.clear()
        self._pending = (step, None, None, verdict)

    def expect_carried(self, step: int) -> None:
        """A synchronous step whose finiteness travels in the algorithm's messages: the
        algorithm's ``step()`` calls :meth:`decide_carried` before applying anything."""
        self._refuse_if_failed()
        self.settle()
        self._finite.clear()
        self._expected = step

    def decide_carried(self, verdict: Sequence[int]) -> None:
        """The agreed per-rank first bad index of the expected step: raise on every rank if
        some rank's gradient was not finite."""
        step, self._expected = self._expected, None
        if step is None:
            raise RuntimeError("decide_finiteness called outside a step that carries the finiteness check")
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
        if not bad:
            self.consecutive_skips = 0
            return True
        if self.policy == "raise" or self.consecutive_skips >= self.max_consecutive_skips:
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
