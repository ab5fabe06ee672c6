"""CP-SGD: compressed, pipelined SGD with full-precision correction.

Per worker: global weights W (identical on every rank; the user's optimizer acts on them),
compute weights w (the model's parameters), a worker residual e, one communication in flight.
For iteration t after the warm-up::

    backward at w             -> local mean gradient g_t; its buckets are handed, during
                                 backward, to the reducer's background queue, which compresses
                                 (with error feedback) and averages them; the correction's share
                                 goes in full precision
    engine.step():  wait for step t-1's average G_{t-1} (it ran while t was computed)
                    W <- optimizer(W, G_{t-1})                        (= W_{t-1})
                    w <- local_update(W_{t-1}, g_t)                   (e.g. W_{t-1} - alpha g_t)
    go to t+1 with w: compression and communication of g_t overlap with iteration t+1

Corrections (``correction``):

* ``"spread"``: every step, share ``j = phase`` of ``k`` contiguous near-equal shares of each
  bucket is averaged exactly in fp32 and the rest compressed; over each cycle of k steps every
  element gets exactly one exact step, and the bytes per step are constant, so no step stalls
  the depth-1 pipeline behind a full-precision burst.
* ``"burst"``: the paper's correction — every k-th step the whole gradient goes in fp32.
* ``adapt_period``: k changes at each cycle boundary by a rule every rank evaluates on the same
  all-reduced numbers (see :class:`PeriodController`).
* ``fit_period``: k grows until the pipeline's measured work per step fits behind the training
  thread's compute (see :class:`LinkFitController`), on the same all-reduced footing.

Degenerate cases (tested against a slow single-process simulation): warm-up forever is S-SGD;
``correction_period=1`` is one-step-delayed full-precision SGD with local compensation (spread
and burst alike); ``local_update="none"`` with no correction is one-step-stale compressed SGD
with error feedback.

Checkpoints: ``state_dict()`` works with a step in flight. It waits for the in-flight average
(waiting changes no value, only when it is read) and saves W, that average, the residuals and
the schedule state; ``load_state_dict`` puts the same pipeline back, so a resumed run continues
bit for bit. Evaluation: :meth:`global_parameters` returns W with the in-flight average applied
(by a tentative optimizer step into separate buffers), without draining.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from ..comm.wire import MIB
from ..codecs import build_compressor
from ..runtime.device import to_device
from ..comm.reducer import make_reducer
from .base import Algorithm, BoundAlgorithm, EngineContext, Finiteness, GradientClip
from .buckets import Bucket, BucketSet
from .compressed import bucket_segments, check_compression_knobs, exact_vector_segments, first_nonfinite
from ..optim.tentative import (FusedAdamStep, FusedSGDStep, TentativeStep, closed_form_kind, hyperparameters,
                               param_group_of, using_hyperparameters)
from .warmup import DEFAULT_COMPRESSION_WARMUP_STEPS, Warmup, share_bounds

LOCAL_UPDATES = ("optimizer", "sgd", "none")
CORRECTIONS = ("spread", "burst")


@dataclass
class PeriodController:
    """The adaptive correction period: a lazy-update-style rule with no threshold.

    After applying a step's average, every rank compares it with its own gradient of that
    step: ``d_p = ||G_hat - g_p||^2`` over the compressed elements and ``v_p = ||G - g_p||^2``
    over the exact ones (where the average G is exact). Their means over ranks ride on a later
    step's fp32 all-reduce, so every rank holds the same sums. Since
    ``mean_p ||G_hat - g_p||^2 = ||G_hat - G||^2 + mean_p ||g_p - G||^2``, per element

        err   = mean d / n_compressed - mean v / n_exact     (compression error of the average)
        noise = mean v / n_exact / (P - 1)                    (sampling noise of the average)

    At each cycle boundary, from the sums since the last one: err <= noise (compression adds
    less error than the gradient's own noise) -> k + 1; err > 2 noise -> k - 1; else k stays,
    within ``[min_period, max_period]``. Like the lazy update's interval test it compares
    norms only, so it has no scale-dependent threshold.
    """

    min_period: int = 2
    max_period: int = 256

    def decide(self, k: int, d: float, n_compressed: float, v: float, n_exact: float, world: int) -> int:
        if n_compressed <= 0 or n_exact <= 0:
            return k
        spread = v / n_exact
        err = d / n_compressed - spread
        noise = spread / max(1, world - 1)
        if not (math.isfinite(err) and math.isfinite(noise)):
            return k
        if err <= noise:
            return min(self.max_period, k + 1)
        if err > 2 * noise:
            return max(self.min_period, k - 1)
        return k


@dataclass
class LinkFitController:
    """The link-fitting correction period: the spread correction's fp32 share costs bytes every
    step, and on a slow link they no longer hide behind one compute step (docs/cpsgd.md). This
    rule makes k as small as the link allows.

    Measured on every rank over the last k steps: ``busy``, the median of the time the
    background thread spends running one step's jobs (codec and network), and ``compute``, the
    median of the training thread's time per step outside the exposed wait. Their means over
    ranks ride on a later step's fp32 all-reduce, so at the cycle boundary every rank decides
    from the same two numbers:

        busy > high * compute   ->  k = ceil(k * min(2, busy / (target * compute)))
        busy < low * compute    ->  k = floor(k * 3 / 4)
        otherwise                   k stays

    within ``[base, max_period]`` (``base``: the configured ``correction_period``, the most
    frequent correction the user asked for). The band between ``low`` and ``high`` keeps k from
    flapping. The decision depends on measured time, so two runs may choose different k (each
    step's k is in steps.jsonl, ``correction_period``); a checkpoint saves the k reached.
    """

    base: int
    max_period: int
    high: float = 0.9
    low: float = 0.6
    target: float = 0.8

    def decide(self, k: int, busy: float, compute: float) -> int:
        if not (math.isfinite(busy) and math.isfinite(compute)) or compute <= 0:
            return k
        if busy > self.high * compute:
            k = math.ceil(k * min(2.0, busy / (self.target * compute)))
        elif busy < self.low * compute:
            k = (3 * k) // 4
        return max(self.base, min(self.max_period, k))


def _fit_window(saved: Optional[dict] = None) -> dict[str, list[float]]:
    """The link-fitting rule's samples of one window (``saved``: as a checkpoint holds them)."""
    saved = saved or {}
    return {key: [float(x) for x in saved.get(key, [])] for key in ("busy", "compute")}


@dataclass
class CPSGD(Algorithm):
    """Knobs (defaults chosen by the measurements in docs/cpsgd.md):

        compressor, compressor_options, collective: as for ``compressed``; the default is
            the 2-bit codec on the ``auto`` collective (allgather up to 4 ranks: one
            quantization, more accurate than two-stage's two; two-stage above; docs/cpsgd.md).
        bucket_mb: bucket size. 64 (one bucket for most models), not ``compressed``'s 1:
            the pipeline hides communication behind the next iteration, not behind
            backward, so small buckets buy no overlap and each costs a fixed amount of CPU
            per step (two gloo collectives, a codec call, the glue) that a 1-core worker
            cannot hide (docs/cpsgd.md). (The fp32 warm-up then overlaps nothing
            with backward either.)
        warmup_steps: plain synchronous full-precision SGD for this many steps first (the
            paper's code: 1000 iterations). Early gradients are large and change fast, which
            is where both staleness and quantization hurt most.
        correction: ``"spread"`` (a rotating 1/k share of every bucket exact each step) or
            ``"burst"`` (the whole gradient exact every k-th step, the paper's).
        correction_period: k; ``None`` never corrects; 1 never compresses. 80, not the
            paper's 5: the spread sends 1/k of the elements in fp32 every step, 0.05 bytes per
            element at k = 80 against 0.8 at k = 5 (2-bit alone: 0.27), and on a slow link
            those bytes decide whether the message fits behind one step; at equal steps k = 20,
            80 and none end within seed noise of each other and of ``compressed``
            (docs/cpsgd.md).
        adapt_period: let k follow :class:`PeriodController` (starting at
            ``correction_period``, within ``[min_period, max_period]``).
        min_period, max_period: bounds of the adaptive k (2 and 256: ``correction_period`` must
            lie within them, and 256 is ``fit_max_period``'s bound too).
        fit_period: let k follow :class:`LinkFitController` instead: k grows (up to
            ``fit_max_period``) while the pipeline's measured codec and network time per step
            exceeds 0.9 of the compute step, and shrinks back toward ``correction_period``
            when it is under 0.6. For slow links where the fp32 share's bytes do not hide;
            timing-driven, so not reproducible run to run (docs/cpsgd.md). Spread only.
        fit_max_period: the largest k ``fit_period`` may choose.
        flush_residual_on_correction: True (the default) adds the residual of an element
            that is sent exact to its exact contribution and zeroes it; False (the paper's
            code) leaves the residual untouched there. True is the closer to ssgd's accuracy
            on the ResNet-20 protocol (docs/cpsgd.md).
        compress_vectors: also compress 1-D parameters (biases, BatchNorm scales). Off by
            default, as in ``compressed``: they are <1% of the elements of typical convnets, and
            their gradients matter more per element; they then always travel in fp32.
        local_update: how w is formed from W_{t-1} and the worker's own gradient g_t:
            ``"optimizer"``: a tentative step of the user's optimizer from W with g_t (momentum
            and weight decay included; closed form for SGD and Adam/AdamW, no state change).
            For plain ``torch.optim.SGD`` on CPU the global step and this one run fused in one
            native pass per tensor (:class:`FusedSGDStep`), for ``Adam`` (no weight decay) and
            ``AdamW`` in two (:class:`FusedAdamStep`), both bit-identical to the torch steps;
            ``fused_step_unavailable`` says why not when neither is used;
            ``"sgd"``: w = W - local_lr * g_t (the paper's plain-SGD local optimizer);
            ``"none"``: w = W_{t-1} (no local compensation).
        local_lr: alpha for ``"sgd"``; ``None`` uses each parameter group's learning rate.

    As ``compressed``'s, a warm-up step's last bucket runs on the training thread when
    ``step()`` waits for it on the CPU; pipelined steps keep every job on the pipeline's thread
    (their jobs are waited for a step later, behind the next compute step).
    """

    compressor: str = "2bit"
    compressor_options: dict[str, Any] = field(default_factory=dict)
    collective: str = "auto"
    bucket_mb: float = 64.0
    warmup_steps: int = DEFAULT_COMPRESSION_WARMUP_STEPS
    correction: str = "spread"
    correction_period: Optional[int] = 80
    adapt_period: bool = False
    min_period: int = 2
    max_period: int = 256
    fit_period: bool = False
    fit_max_period: int = 256
    flush_residual_on_correction: bool = True
    compress_vectors: bool = False
    local_update: str = "optimizer"
    local_lr: Optional[float] = None

    name: ClassVar[str] = "cpsgd"
    #: a knob of earlier versions, with the value of the path the code now always takes (above)
    removed_knobs: ClassVar[dict[str, Any]] = {"inline_last_bucket": True}

    def __post_init__(self) -> None:
        check_compression_knobs(self.name, self.compressor, self.compressor_options, self.collective,
                                self.bucket_mb)
        for knob, low in (("warmup_steps", 0), ("min_period", 1), ("max_period", 1), ("fit_max_period", 1)):
            v = getattr(self, knob)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"cpsgd: {knob} must be an integer >= {low}, got {v!r}")
        k = self.correction_period
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"cpsgd: correction_period must be an integer >= 1 or None, got {k!r}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"cpsgd: correction must be one of {CORRECTIONS}, got {self.correction!r}")
        for knob in ("adapt_period", "fit_period", "flush_residual_on_correction", "compress_vectors"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"cpsgd: {knob} must be True or False, got {getattr(self, knob)!r}")
        if self.adapt_period and (k is None or not self.min_period <= k <= self.max_period):
            raise ValueError("cpsgd: adapt_period needs min_period <= correction_period <= max_period, "
                             f"got correction_period={k}, min_period={self.min_period}, max_period={self.max_period}")
        if self.fit_period:
            if self.adapt_period:
                raise ValueError("cpsgd: adapt_period and fit_period are two rules for k; choose one")
            if k is None or self.correction != "spread" or self.fit_max_period < k:
                raise ValueError("cpsgd: fit_period needs the spread correction and correction_period <= "
                                 f"fit_max_period, got correction={self.correction!r}, correction_period={k}, "
                                 f"fit_max_period={self.fit_max_period}")
        if self.local_update not in LOCAL_UPDATES:
            raise ValueError(f"cpsgd: local_update must be one of {LOCAL_UPDATES}, got {self.local_update!r}")
        if self.local_lr is not None and not (isinstance(self.local_lr, (int, float)) and self.local_lr >= 0):
            raise ValueError(f"cpsgd: local_lr must be a number >= 0 or None, got {self.local_lr!r}")

    def bind(self, ctx: EngineContext) -> "BoundCPSGD":
        return BoundCPSGD(self, ctx)


class BoundCPSGD(BoundAlgorithm):
    """CP-SGD bound to one engine: the reducer (residuals), the global and compute weights,
    the step in flight, the correction cycle and the adaptive period's statistics."""

    cfg: CPSGD
    captures_gradients: ClassVar[bool] = True
    clips: ClassVar[bool] = True

    # -- setup ---------------------------------------------------------------------------
    def __init__(self, cfg: CPSGD, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        codec = build_compressor(self.cfg.compressor, self.cfg.compressor_options)
        self.reducer = make_reducer(self.cfg.collective, ctx.comm, codec, error_feedback=True)
        # double buffered: a pipelined bucket goes to the reducer uncopied (``copy=False``);
        # step t's job is waited for in step t + 1, before step t + 2 refills its buffer
        self.buckets = BucketSet(ctx.params, range(len(ctx.params)), int(self.cfg.bucket_mb * MIB), self._launch,
                                 double_buffered=True)
        self.segments = [bucket_segments(ctx.names, ctx.params, b.param_indices) for b in self.buckets.buckets]
        # 1-D parameters are always averaged exactly (unless compress_vectors), in the bucket's own
        # message (the reducer's exact_segments=); their ranges are recorded with the exact shares
        self.exact_segments = [exact_vector_segments(ctx.params, b.param_indices, self.cfg.compress_vectors)
                               for b in self.buckets.buckets]
        self.vector_ranges = [[] if ex is None else
                              [(o, o + ctx.params[i].numel()) for i, o, x in zip(b.param_indices, b.offsets, ex) if x]
                              for b, ex in zip(self.buckets.buckets, self.exact_segments)]
        # the NaN/Inf check rides on the buckets' flag bytes when the engine's policy asks for it
        self.checks_finite = ctx.decide_finiteness is not None
        self.warmup = Warmup(self.cfg.warmup_steps)
        self.controller = PeriodController(self.cfg.min_period, self.cfg.max_period)
        self.fit = (LinkFitController(self.cfg.correction_period, self.cfg.fit_max_period)
                    if self.cfg.fit_period else None)
        self._fit_times = _fit_window()                    # this rank's samples since the last send
        self._fit_agreed: Optional[torch.Tensor] = None   # the ranks' means, for the next boundary
        self._last_exit: Optional[float] = None           # when the last pipelined step() returned
        self._waited_at_exit = 0.0                         # the exposed wait counted by then
        self.tentative = TentativeStep(ctx.optimizer, ctx.params)
        # the global step and the look-ahead local update in one native pass, where possible
        fused = FusedAdamStep if closed_form_kind(ctx.optimizer) == "adam" else FusedSGDStep
        self.fused_step_unavailable = ("local_update is not 'optimizer'" if self.cfg.local_update != "optimizer"
                                       else fused.unavailable(ctx.optimizer, ctx.params))
        # the fused step's work space is the tentative step's (they never run at the same time)
        self.fused_step = None if self.fused_step_unavailable else fused(ctx.optimizer, ctx.params,
                                                                         scratch=self.tentative.scratch)
        self.group_of = param_group_of(ctx.optimizer, ctx.params)
        self.w = [p.data for p in ctx.params]                    # compute weights (the model's storage)
        self.W = [torch.empty_like(p) for p in ctx.params]       # global weights, while pipelining
        self._eval: Optional[list[torch.Tensor]] = None
        self.t = 0                          # steps completed (the agreed step counter)
        self.period = self.cfg.correction_period
        self.cycle_start = self.cfg.warmup_steps
        self.pipelining = False             # W holds the global weights, w the compute weights
        self.in_flight: Optional[_InFlight] = None
        self.corrections = 0                # steps that sent anything exact after the warm-up
        self._launching: Optional[_InFlight] = None
        # adaptive: mean d, n_compressed, mean v, n_exact (agreed), summed on the parameters'
        # device in float64 and read on the host only when the rule decides (a cycle boundary)
        self._stats = self._stats_tensor([0.0, 0.0, 0.0, 0.0])
        self._measure: Optional[torch.Tensor] = None   # this rank's measurement, riding on the next step
        self._last_phase: Optional[int] = None
        self._last_period: Optional[int] = self.period
        self._prev_local: Optional[list[Optional[torch.Tensor]]] = None

    def _stats_tensor(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=self.ctx.params[0].device)

    # -- schedule (pure functions of the agreed step counter and period state) ------------
    def in_warmup(self, t: int) -> bool:
        return self.warmup.active(t)

    def phase(self, t: int) -> Optional[int]:
        """Position of step t in its correction cycle (None: warm-up or no correction)."""
        if self.in_warmup(t) or self.period is None:
            return None
        return (t - self.cycle_start) % self.period

    def is_burst(self, t: int) -> bool:
        return self.cfg.correction == "burst" and self.phase(t) == 0

    def exact_range(self, b: Bucket, t: int) -> Optional[tuple[int, int]]:
        """The elements of bucket ``b`` averaged exactly at step ``t`` under the spread
        correction (None: none)."""
        j = self.phase(t)
        if self.cfg.correction != "spread" or j is None:
            return None
        lo, hi = share_bounds(b.numel, self.period, j)
        return (lo, hi) if hi > lo else None

    def finiteness(self) -> Finiteness:
        """After the warm-up, step t's average reaches W only at step t + 1: pipelined
        compressed steps carry the check (they mark each parameter's NaN/Inf in their buckets'
        flag bytes, the reducer's ``check_finite``, which every rank receives from every rank;
        the verdict is settled before that average reaches W), burst steps (fp32 all-reduces)
        leave it to the engine's exchange, decided late. Warm-up steps are decided before
        ``step()``."""
        if self.in_warmup(self.t):
            return Finiteness.NOW
        return Finiteness.CARRIED if self._carries_finiteness() else Finiteness.LATE

    def _carries_finiteness(self) -> bool:
        return self.checks_finite and not self.in_warmup(self.t) and not self.is_burst(self.t)

    # -- iteration ----------------------------------------------------------------------
    def _launch(self, b: Bucket):
        key, segs, t = f"bucket{b.index}", self.segments[b.index], self.t
        if self.in_warmup(t):
            # step() waits for the last bucket as soon as it is launched (backward has ended):
            # on the CPU it runs on the training thread then, sparing two thread hand-offs
            inline = b.index == len(self.buckets.buckets) - 1
            return self.reducer.start_full_precision(b.buffer, key, inline=inline)   # gradients and flags
        flight = self._launching
        if self.is_burst(t):
            flight.ranges.append((b.index, 0, b.numel))
            return self.reducer.start_full_precision(b.grads, key, segs,
                                                     flush_residuals=self.cfg.flush_residual_on_correction,
                                                     present=b.flags > 0)
        exact = self.exact_range(b, t)
        for r in self.vector_ranges[b.index]:
            flight.add_exact(b, r)
        if exact is not None:
            flight.add_exact(b, exact)
        return self.reducer.start(b.grads, key, segs, exact=exact, present=b.present(),
                                  flush_exact=self.cfg.flush_residual_on_correction,
                                  exact_segments=self.exact_segments[b.index], check_finite=self.checks_finite,
                                  copy=False)

    def on_gradient_ready(self, index: int) -> None:
        if self._launching is None and not self.in_warmup(self.t):
            self._launching = _InFlight(self)
        self.buckets.mark_ready(index)

    def step(self) -> None:
        t = self.t
        if not self.in_warmup(t) and self._launching is None:
            self._launching = _InFlight(self)
        self.buckets.launch_remaining()
        if self.in_warmup(t):
            for b in self.buckets.buckets:
                b.buffer.copy_(b.handle.wait())
                self.buckets.write_gradients(b)
            if self.ctx.clip is not None:                 # the averaged gradient, as under ssgd
                self.ctx.clip_gradients([p.grad for p in self.ctx.params])
            self.ctx.optimizer.step()
        else:
            flight = self._launching
            flight.seal([b.handle for b in self.buckets.buckets], self._measure)
            if self._carries_finiteness():   # decided before this average reaches W, at step t + 1
                self.ctx.decide_finiteness(flight.nonfinite_first)
            # the average is clipped and applied with the request and settings of this step
            # when it reaches W (a step later, or at drain())
            flight.clip, flight.hyper = self.ctx.clip, hyperparameters(self.ctx.optimizer)
            self._measure = None
            local_grads = [p.grad for p in self.ctx.params]
            if self.cfg.adapt_period:
                self._prev_local = [None if g is None else g.detach().clone() for g in local_grads]
            averaged = None
            if not self.pipelining:                       # pipeline (re)start: W = current weights
                torch._foreach_copy_(self.W, self.w)
                self.pipelining = True
            elif self.in_flight is not None:
                averaged = self._global_gradients(self.in_flight)
            if self.ctx.clip is not None:                 # the look-ahead's own gradient, on its own
                self.ctx.clip_gradients(local_grads, record=averaged is None)
            if self.fused_step is not None:               # W <- opt(W, G); w <- local_update(W, g)
                none = [None] * len(local_grads)
                self.fused_step.step(self.W, none if averaged is None else averaged, local_grads, self.w)
            else:
                if averaged is not None:
                    self._step_global(averaged)
                self._local_update(local_grads)
            self.in_flight = flight
            if self.phase(t) is not None and (self.cfg.correction == "spread" or self.is_burst(t)):
                self.corrections += 1
            if self.fit is not None:
                self._time_for_fit(t)
        self._launching = None
        self._last_phase, self._last_period = self.phase(t), self.period
        self.t += 1
        self._advance_cycle()
        self.buckets.reset()

    def _time_for_fit(self, t: int) -> None:
        """Record this step's compute time (the interval since the last pipelined step()
        returned, less the exposed wait charged meanwhile: the guard's and the handles') and,
        three steps before a cycle ends, queue this rank's medians to ride on the next step's
        side channel, so the agreed means arrive (one step later) in time for the cycle's
        boundary (k < 3: the boundary after). Every rank sends at the same steps; NaN where it
        measured nothing, which the rule skips."""
        now = time.perf_counter()
        waited = self.ctx.exposed_wait_s     # every exposed wait: the engine's, the handles'
        if self._last_exit is not None:
            self._fit_times["compute"].append(now - self._last_exit - (waited - self._waited_at_exit))
        self._last_exit, self._waited_at_exit = now, waited
        if self.phase(t) == max(self.period - 3, 0):
            medians = [statistics.median(v) if v else math.nan for v in self._fit_times.values()]
            self._measure = torch.tensor(medians, dtype=torch.float32, device=self.ctx.params[0].device)
            self._fit_times = _fit_window()

    def _advance_cycle(self) -> None:
        """At a cycle boundary (the next step starts a new cycle), the adaptive rule may
        change k; it reads only the agreed sums, so every rank decides the same."""
        t = self.t
        if self.period is None or self.in_warmup(t) or t - self.cycle_start < self.period:
            return
        self.cycle_start = t
        if self.cfg.adapt_period:   # the rule decides on the host: one read-back per cycle
            self.period = self.controller.decide(self.period, *self._stats.tolist(), world=self.ctx.world_size)
            self._stats = self._stats_tensor([0.0, 0.0, 0.0, 0.0])
        elif self.fit is not None and self._fit_agreed is not None:
            self.period = self.fit.decide(self.period, *self._fit_agreed.tolist())
            self._fit_agreed = None

    def _step_global(self, grads: list[Optional[torch.Tensor]]) -> None:
        """W <- optimizer(W, grads): the parameters hold W's storage during the step."""
        params = self.ctx.params
        for p, W, g in zip(params, self.W, grads):
            p.data = W
            p.grad = g
        self.ctx.optimizer.step()
        for p, w in zip(params, self.w):
            p.data = w

    def _global_gradients(self, flight: "_InFlight") -> list[Optional[torch.Tensor]]:
        """The step's averaged gradients (waited for), with the adaptive rule's bookkeeping."""
        grads = flight.result()
        if self.fit is not None:
            busy = flight.busy_s()
            if busy is not None:
                self._fit_times["busy"].append(busy)
        if self.cfg.adapt_period and self._prev_local is not None:
            self._measure = _measurement(flight, grads, self._prev_local, self.ctx.params)
        if flight.measure is not None:                  # agreed (averaged) values
            if self.fit is not None:
                self._fit_agreed = flight.measure
            else:
                self._stats += flight.measure
        return flight.clipped()

    def _apply_to_global(self, flight: "_InFlight") -> None:
        self._step_global(self._global_gradients(flight))

    def _local_update(self, local_grads: list[Optional[torch.Tensor]]) -> None:
        """w <- local_update(W, g_t); the model then holds w."""
        if self.cfg.local_update == "optimizer":
            self.tentative.step(self.W, local_grads, self.w)
            return
        torch._foreach_copy_(self.w, self.W)
        if self.cfg.local_update == "sgd":
            groups = self.ctx.optimizer.param_groups
            with torch.no_grad():
                for w, g, k in zip(self.w, local_grads, self.group_of):
                    if g is not None and k is not None:
                        w.add_(g, alpha=-(groups[k]["lr"] if self.cfg.local_lr is None else self.cfg.local_lr))

    def drain(self) -> None:
        """Finish the in-flight step; the model then holds W and the pipeline restarts empty.
        The in-flight average is applied with the settings (learning rate) and the clipping
        of the step that computed it, not with what a scheduler has set since: at the end of
        a cosine schedule that would be 0."""
        if self.in_flight is not None:
            with using_hyperparameters(self.ctx.optimizer, self.in_flight.hyper):
                self._apply_to_global(self.in_flight)
            self.in_flight = None
        if self.pipelining:
            torch._foreach_copy_(self.w, self.W)
            self.pipelining = False
        self._last_exit = None

    def global_parameters(self) -> Optional[list[torch.Tensor]]:
        """While pipelining: W with the in-flight average applied by a tentative optimizer
        step (what ``drain()`` would produce), in buffers of their own; training state is not
        touched. None otherwise (the model holds the global weights)."""
        if not self.pipelining:
            return None
        if self.in_flight is None:
            return self.W
        if self._eval is None:
            self._eval = [torch.empty_like(W) for W in self.W]
        flight = self.in_flight
        with using_hyperparameters(self.ctx.optimizer, flight.hyper):
            self.tentative.step(self.W, flight.clipped(copy=True), self._eval)
        return self._eval

    def step_metrics(self) -> dict[str, Any]:
        """``warmup``; ``correction_phase``: the step's place in its correction cycle (spread:
        the share that went exact; burst: 0 = the fp32 step; None: no correction);
        ``correction_period``: k of that step."""
        return {"warmup": self.in_warmup(self.t - 1), "correction_phase": self._last_phase,
                "correction_period": self._last_period}

    def summary(self) -> dict[str, Any]:
        """``fused_step``: the native kernel that ran the global step and the local update
        (``FusedSGDStep``, ``FusedAdamStep``), or None with ``fused_step_unavailable`` saying why;
        ``corrections``: steps that sent anything exact after the warm-up."""
        return {"fused_step": None if self.fused_step is None else type(self.fused_step).__name__,
                "fused_step_unavailable": self.fused_step_unavailable, "corrections": self.corrections}

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Works with a step in flight: its average is waited for and saved with W."""
        names = self.ctx.names
        state: dict[str, Any] = {
            "t": self.t, "corrections": self.corrections, "period": self.period,
            "cycle_start": self.cycle_start, "stats": self._stats.tolist(), "pipelining": self.pipelining,
        }
        if self.pipelining:
            state["global_weights"] = {n: W.clone() for n, W in zip(names, self.W)}
        if self.in_flight is not None:
            grads = self.in_flight.result()
            state["in_flight"] = {n: g.clone() for n, g in zip(names, grads) if g is not None}
            state["in_flight_exact"] = [list(r) for r in self.in_flight.ranges]
            clip = self.in_flight.pending_clip()
            state["in_flight_clip"] = None if clip is None else [clip.max_norm, clip.norm_type]
            state["in_flight_hyper"] = self.in_flight.hyper
            if self.in_flight.measure is not None:
                state["in_flight_measure"] = self.in_flight.measure.clone()
        if self._measure is not None:
            state["measure"] = self._measure.clone()
        if self._prev_local is not None:
            state["prev_local"] = {n: g.clone() for n, g in zip(names, self._prev_local) if g is not None}
        if self.fit is not None:
            state["fit"] = {"agreed": None if self._fit_agreed is None else self._fit_agreed.tolist(),
                            "times": {k: list(v) for k, v in self._fit_times.items()}}
        state["collective"] = self.reducer.state_dict()    # after the wait: residuals settled
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = self.ctx.names
        self.t = int(state["t"])
        self.corrections = int(state["corrections"])
        self.period = state["period"]
        self.cycle_start = int(state["cycle_start"])
        self._stats = self._stats_tensor([float(x) for x in state["stats"]])
        self.pipelining = bool(state["pipelining"])
        if self.pipelining:
            with torch.no_grad():
                for n, W in zip(names, self.W):
                    W.copy_(state["global_weights"][n])
        self.in_flight = None
        # the tensors kept as they are land on the parameters' device, wherever they were loaded
        device = self.ctx.params[0].device
        if "in_flight" in state:
            pending = to_device(state["in_flight"], device)
            self.in_flight = _InFlight.resolved(self, [pending.get(n) for n in names],
                                                to_device(state.get("in_flight_measure"), device),
                                                [tuple(r) for r in state.get("in_flight_exact", [])])
            clip = state.get("in_flight_clip")
            self.in_flight.clip = None if clip is None else GradientClip(*clip)
            self.in_flight.hyper = state.get("in_flight_hyper")
        self._measure = to_device(state.get("measure"), device)
        prev = to_device(state.get("prev_local"), device)
        self._prev_local = None if prev is None else [prev.get(n) for n in names]
        fit = state.get("fit") or {}
        agreed = fit.get("agreed")
        self._fit_agreed = None if agreed is None else torch.tensor(agreed, dtype=torch.float32, device=device)
        self._fit_times = _fit_window(fit.get("times", {}))
        self._last_exit = None
        self.reducer.load_state_dict(state["collective"])

    def close(self) -> None:
        self.reducer.close()


class _InFlight:
    """One pipelined step's communication: a handle per bucket plus, at the steps that send
    them, the adaptive rules' measurements (one fp32 all-reduce on the same queue, behind the
    buckets). ``result()`` waits once and returns the averaged gradient per parameter (None
    where no rank had one)."""

    def __init__(self, algo: "BoundCPSGD"):
        self.algo = algo
        self.handles: list = []
        self.ranges: list[tuple[int, int, int]] = []          # (bucket, lo, hi) averaged exactly
        self.side = None                                       # the measurements' all-reduce
        self.measure: Optional[torch.Tensor] = None            # agreed means of the measurements
        self._result: Optional[list[Optional[torch.Tensor]]] = None
        #: the clipping requested at the step that launched it (engine.clip_grad_norm_), applied
        #: once to the average (:meth:`clipped`), and that step's optimizer settings
        self.clip: Optional[GradientClip] = None
        self._clipped = False
        self.hyper: Optional[list[dict]] = None

    @classmethod
    def resolved(cls, algo: "BoundCPSGD", grads, measure, ranges) -> "_InFlight":
        f = cls(algo)
        f._result, f.measure, f.ranges = grads, measure, list(ranges)
        return f

    def add_exact(self, b: Bucket, exact: tuple[int, int]) -> None:
        """Record a range of bucket ``b`` the reducer averages exactly."""
        lo, hi = exact
        self.ranges.append((b.index, lo, hi))

    def seal(self, handles: list, measure: Optional[torch.Tensor]) -> None:
        """All buckets are launched: send the measurements (if any) behind them."""
        self.handles = handles
        if measure is not None:
            self.side = self.algo.reducer.start_full_precision(measure, "cpsgd-side")

    def pending_clip(self) -> Optional[GradientClip]:
        """The clipping still to apply to :meth:`result` (None: none, or done)."""
        return None if self._clipped else self.clip

    def clipped(self, copy: bool = False) -> list[Optional[torch.Tensor]]:
        """:meth:`result` clipped by :attr:`clip` (in place, once); ``copy``: on copies,
        leaving the result as it is (evaluation before the step that applies it)."""
        grads = self.result()
        clip = self.pending_clip()
        if clip is None:
            return grads
        if copy:
            grads = [None if g is None else g.clone() for g in grads]
            self.algo.ctx.clip_gradients(grads, clip, record=False)
            return grads
        self.algo.ctx.clip_gradients(grads, clip)
        self._clipped = True
        return grads

    def busy_s(self) -> Optional[float]:
        """The pipeline thread's time running this step's jobs (codec and network; None for a
        step restored from a checkpoint, or handles that do not time their job)."""
        spans = [getattr(h, "span", None) for h in self.handles + ([self.side] if self.side is not None else [])]
        spans = [s for s in spans if s is not None]
        if not spans:
            return None
        return sum(end - start for start, end in spans)

    def nonfinite_first(self) -> list[int]:
        """Per rank, its first parameter marked non-finite in the buckets' flag bytes (-1:
        none); waits for the buckets."""
        self.result()
        return first_nonfinite(self.algo.buckets.buckets, self.handles, self.algo.ctx.world_size)

    def result(self) -> list[Optional[torch.Tensor]]:
        if self._result is not None:
            return self._result
        algo = self.algo
        buckets = algo.buckets.buckets
        outs = [h.wait() for h in self.handles]
        present = [h.present for h in self.handles]
        if self.side is not None:
            self.measure = self.side.wait().to(torch.float64)
        grads: list[Optional[torch.Tensor]] = [None] * len(algo.ctx.params)
        for b, out, pres in zip(buckets, outs, present):
            flags = None if pres is None else pres.tolist()
            for k, i in enumerate(b.param_indices):
                if flags is not None and not flags[k]:
                    continue
                p = algo.ctx.params[i]      # the reducer's fp32, in the parameter's dtype
                grads[i] = out[b.offsets[k]:b.offsets[k] + p.numel()].view_as(p).to(p.dtype)
        self._result = grads
        return grads


def _exact_spans(ranges, bucket: int) -> list[tuple[int, int]]:
    """The union of the ``(bucket, lo, hi)`` ranges of ``bucket``: sorted, disjoint spans."""
    spans: list[list[int]] = []
    for lo, hi in sorted((lo, hi) for bi, lo, hi in ranges if bi == bucket and hi > lo):
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return [(lo, hi) for lo, hi in spans]


def _measurement(flight: _InFlight, grads, local, params) -> torch.Tensor:
    """This rank's (d, n_compressed, v, n_exact) of :class:`PeriodController` for the step
    ``flight`` carried; ``local`` are this rank's gradients of that step.

    No host sync: the sums stay on the gradients' device (float64 0-dim tensors, added in the
    order and precision of Python floats: the same bits), and which elements went exact is
    known on the host (``flight.ranges``), so the counts and the exact elements (contiguous
    slices, in index order) need no read-back."""
    buckets = flight.algo.buckets.buckets
    device = params[0].device     # the gradients' device: the result rides with them
    zero = torch.zeros((), dtype=torch.float64, device=device)
    d = v = zero
    n_e = n_c = 0
    with torch.no_grad():
        for b in buckets:
            spans = _exact_spans(flight.ranges, b.index)
            for k, i in enumerate(b.param_indices):
                G, g = grads[i], local[i]
                if G is None:
                    continue
                sq = ((G - g) if g is not None else G).reshape(-1).square()
                total = sq.sum().double()
                o, n = b.offsets[k], params[i].numel()
                parts = [sq[max(lo, o) - o:min(hi, o + n) - o] for lo, hi in spans if lo < o + n and hi > o]
                ex_n = sum(x.numel() for x in parts)
                ex_sum = zero
                if ex_n:
                    ex_sum = (parts[0] if len(parts) == 1 else torch.cat(parts)).sum().double()
                d = d + (total - ex_sum)
                n_c += sq.numel() - ex_n
                v = v + ex_sum
                n_e += ex_n
        counts = torch.tensor([float(n_c), float(n_e)], dtype=torch.float64, device=device)
        return torch.stack([d, counts[0], v, counts[1]]).to(torch.float32)
