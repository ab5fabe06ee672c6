"""CP-DiLoCo: DiLoCo's inner/outer structure with CP-SGD's compression, pipeline and correction
at the outer step.

Per rank: the model's weights theta (local), and four flat fp32 vectors over all trainable
parameters in registration order: the anchor A and the outer momentum m (identical on every
rank: both only change by the same outer steps on the same all-gathered values), the round's
starting point ``base`` and, inside the reducer, the error-feedback residual e (this rank's own).

Schedule (t: engine steps taken, 0-based; H = ``sync_every``): steps ``t < warmup_steps`` are
synchronous fp32 gradient averaging; then every step runs the user's optimizer on the local
gradient (no communication; at ``inner_lr_scale`` times its learning rate, sqrt(N) for Adam
at N ranks: the class's knobs), and the step with ``(t - warmup_steps + 1) % H == 0`` also ends
round ``r = (t - warmup_steps) // H``. At the end of round r, after its inner step::

    d      = base - theta                 (this round's outer gradient; base = A when not pipelined)
    D_r    = mean over ranks of Q(d + e)  (2-bit with error feedback: e <- d + e - Q(d + e)),
             or of (d + e) in fp32 with e <- 0 on a correction (all of it, or share r % k)

    pipelined=False (DiLoCo):   A, m <- outer(A, m, D_r);  theta <- A;  base <- A
    pipelined=True:             D_r is launched on the reducer's background queue; base <- theta.
                                After the a-th inner step of round r + 1 (a = apply_after,
                                1), with p = base - theta (this rank's progress since then):
                                    A, m <- outer(A, m, D_r)
                                    theta <- A - w p;  base <- theta + p   (w = local_weight, 1)
                                apply_after=None (or a round of at most a steps) applies it at
                                the end of round r + 1 instead, before that round's own
                                message: theta <- A - w d;  base <- theta

With ``sync_every="auto"`` H is a per-round value: round r + 1 starts at the step after round
r's end, and its H is decided at that end by :class:`SyncFitController` from measurements
every rank holds alike: each round's message carries, in two fp32 values beside the outer
gradient (an exact segment of the same message, averaged in rank order on every rank), this
rank's time for the messages it waited for (the reducer's job on the background thread:
codec and network) and the compute time of its inner steps, each the median of a short
window of this rank's last samples (``MESSAGE_WINDOW`` messages, ``STEP_WINDOW`` steps). The
rule reads the means in the newest average applied: pipelined, round r's end applies round
r - 1's message, so round r + 1's H rests on the messages up to round r - 2 and the steps up
to round r - 1.
With a fixed ``sync_every`` the schedule is the formula above and nothing is appended.

``outer`` is SGD with (Nesterov) momentum on the outer gradient, torch's formula:
``m <- mu m + D`` (``m = D`` at the first step), ``A <- A - lr (D + mu m)`` (Nesterov) or
``A <- A - lr m``.

The pipelined local update is CP-SGD's (``w = W_{t-1} - alpha g_t``) with a round for a step:
when the average of round r is applied, each rank rebases onto the new anchor and keeps only
its own progress since round r ended (at full weight), which stands in for the average of the
round in progress until that is applied in turn. No progress is counted twice: a rank's
round-r progress leaves its model when the average that contains it enters A. The average is
applied at a fixed step (``apply_after`` steps into the next round, or at its end), not "when
it arrives": the trajectory is then a function of the data alone (bit-reproducible, and a
checkpoint needs only the average, not when it came). Nothing waits unless the round's message
has not arrived by then: the link must carry one round's message in ``apply_after`` compute
steps (under ``sync_every="auto"`` the apply step moves later when it cannot).

Corrections (``correction_every`` = k; None: never):

* ``"spread"``: in every round, share ``r % k`` of k contiguous near-equal shares of the flat
  outer gradient travels exactly in fp32 in the same message (with that share's residual
  flushed into it and zeroed), the rest in 2 bits: the same bytes every round, so no round's
  message is larger than the others and the pipeline never stalls behind a burst.
* ``"burst"``: every k-th round (``(r + 1) % k == 0``) the whole outer gradient plus the whole
  residual travels in fp32, and every residual becomes 0: after it is applied the anchor is
  exactly what fp32 averaging of the same local progress would give.
* ``blocking_correction`` (burst only): a correction round also applies the round in flight,
  waits for its own exact average at once and sets every replica to the anchor, so after it
  every replica holds bit-identical weights and the pipeline restarts empty (a round-end
  barrier every k rounds: its fp32 bytes are exposed).

The anchor is bit-identical on every rank at every step whatever the knobs (allgather decodes
every rank's payload in rank order on every rank, two-stage every owner's re-encoded average;
the fp32 average is one all-reduce), which
is what ``replicated_state`` reports. The replicas differ by at most their own un-averaged
round of progress: each arriving average rebases every replica onto the common anchor, so
per-rank residuals and compression error never accumulate between replicas; what the
correction bounds is the difference between the anchor and the uncompressed trajectory.

Lazy layers (``lazy_layers``; off by default): the parameters of the named input-side layers
(embedding tables first, as the lazy update's) leave the round's message and travel in a
message of their own, under their own residual, only every ``tau`` rounds (``lazy_every``):
their outer gradient ``d`` is then their progress over those ``tau`` rounds, and between
their syncs they train on locally, untouched by the rebases. Per element the formulas above
hold with "sent" and "applied" read per message: with ``u = base - theta`` (the progress not
yet sent, which a rebase leaves unchanged), an applied average rebases only the elements it
carries (``theta <- A - w u``, ``base <- theta + u``), and a sent element's ``base`` moves to
``theta``. Under ``lazy_every="auto"`` tau follows the lazy update's rule
(:func:`lowband.algorithms.lazy.interval_update`: tau + 1 when the group's latest round of
progress g keeps the direction and size of the accumulated progress a, tau - 1 when neither
holds), decided on the ranks' means of ``|g|^2``, ``|a|^2`` and ``|g - a|^2``, which ride in
fp32 in the group's message: every rank decides the same tau when the message is applied.
The spread correction cycles through each message's own shares (the lazy message's by its
syncs). The burst correction is refused with lazy layers. With ``lazy_per_layer`` every layer
of the selection is a group of its own (its own message, residual, statistics and tau), and
each formula above holds per group.

``drain()`` (``engine.synchronize()``, the end of training) settles everything pending: it
applies the round in flight, then subtracts the ranks' exact fp32 mean of (progress since
``base`` + residual) from the anchor (a plain mean, no outer step: the model average localsgd's
drain gives), zeroes the residuals and sets every replica to the result. Evaluation
(:meth:`global_parameters`) is that same model computed on copies, training state untouched;
like localsgd's it costs one fp32 all-reduce of the model (counted apart from training).
Checkpoints work at any step with a round in flight: its average is waited for (waiting
changes no value) and saved with A, m, ``base`` and the residuals, so a resumed run continues
bit for bit.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch
import torch.distributed as dist

from ..codecs import build_compressor
from ..comm.plans import resolve_collective
from ..comm.reducer import make_reducer
from ..optim.lr_scale import resolve_scale, step_scaled
from ..runtime.device import to_device
from .base import Algorithm, BoundAlgorithm, EngineContext, Finiteness
from .compressed import bucket_segments, check_compression_knobs, exact_vector_segments
from .lazy import EMBEDDING_LAYERS, holders, interval_rule
from .sparse_rows import RowCounter, row_tables
from .warmup import Warmup, share_bounds

CORRECTIONS = ("spread", "burst")
#: the reducer's bucket of the outer gradient, and of a warm-up step's gradients
DELTA, WARMUP = "cp-diloco-delta", "cp-diloco-warmup"
#: ``sync_every="auto"``: the fp32 segment of two values (this rank's message and step time)
#: appended to every round's message, and what a rank sends where it has no sample (any mean
#: over ranks that includes it is negative, which the rule skips)
MEASURE, MISSING = "cp-diloco-measure", -1e30
#: what a rank's two values are medians of: its last message times (one per round) and its
#: last inner steps' compute times (across rounds: a short round has few steps), so that one
#: slow message or step (an evaluation, a checkpoint, another process) moves neither
MESSAGE_WINDOW, STEP_WINDOW = 3, 16
#: ``collective="auto"``: allgather at 2 ranks (the same bytes as two-stage, one quantization),
#: two-stage above (O(1) bytes per rank in N: at 4 ranks 17-18% fewer bytes per step than
#: allgather, the same time to target and a higher final accuracy on cnn over 20 Mbit/s,
#: docs/cp-diloco.md)
OUTER_ALLGATHER_MAX_WORLD = 2
#: ``lazy_layers``: the lazy group's bucket, and its three fp32 statistics for the rule
LAZY, LAZY_STATS = "cp-diloco-lazy", "cp-diloco-lazy-stats"
#: ``sparse_rows``: the segment of a message's packed trained-row flags (exact fp32)
ROWS = "cp-diloco-rows"


def fit_share(pipelined: bool, apply_after: Optional[int]) -> float:
    """The part of a round a round's message may take under ``sync_every="auto"``
    (:class:`SyncFitController`): 1/2 when the average is applied ``apply_after`` steps into
    the next round, else 1."""
    return 0.5 if pipelined and apply_after is not None else 1.0


def lazy_names(spec: str) -> list[str]:
    """The module names of ``lazy_layers=spec``, separated by commas or ``+``."""
    return [x.strip() for x in re.split(r"[,+]", spec) if x.strip()]


def lazy_parameters(model: torch.nn.Module, params: list, spec: str) -> list[int]:
    """The indices into ``params`` of ``lazy_layers=spec`` (:class:`CPDiLoCo`): a parameter is
    lazy when every module that holds it directly is selected (an embedding table, or a
    named module or one of its children), so a weight tied to an unselected layer is not."""
    named = dict(model.named_modules())
    if spec.strip().lower() == "embeddings":
        selected = {id(m) for m in named.values() if isinstance(m, EMBEDDING_LAYERS)}
    else:
        selected = set()
        for name in lazy_names(spec):
            if name not in named:
                raise ValueError(f"cp-diloco: lazy_layers names {name!r}, which is no module of the model")
            selected.update(id(m) for m in named[name].modules())
    held = holders(model)
    return [i for i, q in enumerate(params) if held.get(id(q)) and all(id(m) in selected for _, m in held[id(q)])]


def lazy_groups(model: torch.nn.Module, params: list, spec: str, per_layer: bool) -> list[tuple[str, list[int]]]:
    """The lazy messages of ``lazy_layers=spec`` as (label, indices into ``params``): one group
    of every selected parameter (label ``""``), or with ``per_layer`` one per layer, the
    module that holds its parameters directly (labelled by its name), in the order of
    ``params``."""
    lazy = lazy_parameters(model, params, spec)
    if not per_layer:
        return [("", lazy)] if lazy else []
    held = holders(model)
    groups: dict[str, list[int]] = {}
    for i in lazy:
        groups.setdefault(held[id(params[i])][0][0], []).append(i)
    return list(groups.items())


@dataclass
class SyncFitController:
    """``sync_every="auto"``: the smallest H whose round's message fits behind ``share`` of H
    compute steps.

    From two numbers every rank holds alike (the ranks' means of ``message_s``, the time the
    reducer's job for one round's message took on the background thread, and ``step_s``, the
    compute time of one inner step; each rank's the median of its last few samples), at a
    round end::

        fit = ceil(message_s / (target * share * step_s))   within [min_sync_every, max_sync_every]
        fit > H                                  ->  H = fit   (the link falls behind: grow at once)
        message_s < low * share * H * step_s     ->  H = fit   (much room: shrink to the fit)
        otherwise                                     H stays

    ``share`` is the part of a round the message may take: 1 when the average is applied at the
    next round end; 1/2 when it is applied as soon as it can have arrived (``apply_after``), so
    that a replica rebases onto an anchor at most half a round old (an average applied a whole
    round late costs accuracy: docs/cp-diloco.md). ``target`` leaves room for jitter (the
    message fits in 80% of its share); the band between ``low`` and ``target`` keeps H from
    flapping between neighbours. A round's message is the same size whatever H (the whole
    outer gradient), so one measurement prices every H.
    """

    min_sync_every: int
    max_sync_every: int
    share: float = 1.0
    target: float = 0.8
    low: float = 0.6

    def steps_needed(self, message_s: float, step_s: float) -> Optional[int]:
        """The compute steps a round's message needs to travel behind (``ceil(message_s /
        (target * step_s))``, at least 1); None for measurements that say nothing."""
        if not (math.isfinite(message_s) and math.isfinite(step_s)) or message_s < 0 or step_s <= 0:
            return None
        return max(1, math.ceil(message_s / (self.target * step_s)))

    def decide(self, H: int, message_s: float, step_s: float) -> int:
        steps = self.steps_needed(message_s, self.share * step_s)    # within the round's share
        if steps is None:
            return H
        fit = max(self.min_sync_every, min(self.max_sync_every, steps))
        if fit > H or message_s < self.low * self.share * H * step_s:
            return fit
        return H


def _auto_or(value: Any, kind: type) -> Any:
    """A knob that takes ``"auto"`` or a number: a string read as ``"auto"`` (any case) or as
    ``kind``; anything else, or a string that is neither, as it is (for the caller's check)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() == "auto":
        return "auto"
    try:
        return kind(text)
    except ValueError:
        return value


@dataclass
class CPDiLoCo(Algorithm):
    """Knobs (the algorithm: module docstring; measurements behind the defaults: docs/cp-diloco.md):

        sync_every: H, inner steps per round: an integer, or ``"auto"`` (the default): H
            follows the link (:class:`SyncFitController`): the smallest H whose round's
            message, as measured in the run, fits behind H compute steps (behind H / 2 with
            ``apply_after``, so that each average is applied at most half a round late: a
            whole round late lost gpt-ngram its target at 20 Mbit/s), re-decided at every
            round end from the ranks' means of the measurements, which ride in fp32 in the round's own message
            (8 bytes more per round, no collective of their own). H starts at
            ``min_sync_every`` and changes only at round boundaries; each step's H is in the
            step metrics (``sync_every``). The decision depends on measured time, so two runs
            may choose different H (a checkpoint saves the H reached and the pending
            measurements). With the average applied ``apply_after`` steps into the next round,
            rounds of 4 train as well as shorter ones at equal steps (docs/cp-diloco.md), so H
            starts at 4 and grows only when the link cannot carry a message per round.
        min_sync_every, max_sync_every: the range of H under ``"auto"`` (ignored otherwise). 4:
            with each average applied 1 step into the next round (``apply_after``), 4-step
            rounds matched ``ssgd`` at equal steps on cnn and came within 0.35 pp on ResNet-20
            at 4 workers, where 8-step rounds lost 1.5 pp (docs/cp-diloco.md); 64: a cap on the
            drift a round may accumulate between replicas when the link is very slow (not
            measured).
        outer_lr: the outer optimizer's learning rate. 1.0: with short rounds the outer step
            applies the average as it is (DiLoCo's 0.7 with momentum suits rounds of
            hundreds of steps).
        outer_momentum: its momentum (0: plain SGD on the outer gradient). 0: the pipelined
            outer step applies every average late, and a late gradient under momentum
            overshoots (the delayed-momentum instability; docs/cp-diloco.md); with
            ``pipelined=False`` and long rounds DiLoCo's 0.9 is the usual choice.
        nesterov: Nesterov momentum, as DiLoCo's outer optimizer (False: heavy ball).
        compressor, compressor_options, collective: the outer gradient's codec and collective,
            as for ``compressed``: lowband's 2-bit codec in its scale-aware mode (fire at the
            RMS of each 256-element block, decode to the fired mean) on the ``auto``
            collective: allgather at 2 ranks (one quantization), two-stage above (its bytes per
            rank do not grow with the ranks; at 4 ranks 17-18% fewer bytes per step than allgather
            for the same time to target on cnn); the decoded average is identical on every
            rank either way. ``none`` sends fp32 through the same path.
        error_feedback: keep a per-rank residual of what compression dropped and add it to the
            next round's outer gradient. Without it the biased 2-bit code loses mass.
        pipelined: round r's message travels during round r + 1 and is applied at its end
            (module docstring); False: every round waits for its own average (DiLoCo).
        apply_after: pipelined only: when a round's average is applied. An integer a >= 1
            (1, the default): after the a-th inner step of the next round (Streaming DiLoCo's
            overlap tau), each replica rebased onto the new anchor with its own progress since
            the round end kept, ``theta <- A - (base - theta)``; a round of at most a steps
            applies it at its end. None: at the end of the next round, H steps after it was
            sent (CP-SGD's one-step delay, one round late). The message must travel within a
            steps, so under ``sync_every="auto"`` a is raised to the steps the measured message
            needs (the same rule and measurements as H). 1: the freshest anchor; at equal steps
            on cnn H = 4 with a = 1 matched ``ssgd`` where H = 4 applied a round late lost
            0.45 pp, and H = 8 applied a round late 3 pp (docs/cp-diloco.md).
        local_weight: pipelined only: the weight of a rank's own progress of the round just
            ended in its rebased model, ``theta <- A - local_weight * d``. 1 (CP-SGD's local
            update: the own progress stands in for the average until it arrives); 0 drops it
            (torchft's Streaming DiLoCo with its default ``fragment_update_alpha=0``: every
            replica restarts from the anchor); in between mixes the two.
        correction: ``"spread"`` (share r % k exact in every round, constant bytes) or
            ``"burst"`` (everything exact every k-th round). Spread by default: on a slow
            link a burst round's fp32 message (16x a 2-bit one) may not fit behind one round of
            compute and would stall the next round.
        correction_every: k; None never corrects; 1 sends every round in fp32 (with
            ``pipelined=False`` and ``correction="burst"`` that is DiLoCo). 32: a 1/32 fp32
            share plus the 2-bit codes and scales is ~3.1 bits per element per round, a tenth
            of fp32 DiLoCo's 32, and every element's residual is flushed once in 32 rounds.
            A smaller k spends bytes on a compression error that error feedback already
            carries forward (docs/cp-diloco.md).
        blocking_correction: with ``"burst"``, a correction round waits for its own exact
            average and leaves every replica bit-identical (module docstring). Off: nothing
            blocks unless the link falls behind.
        compress_vectors: also compress 1-D parameters (biases, norms' scales). Off, as in
            ``compressed``/``cpsgd``: they are <1% of the elements and travel in fp32 in the same
            message.
        warmup_steps: synchronous fp32 gradient-averaging steps before the first round. 0, as
            DiLoCo: an fp32 step costs a whole-model all-reduce, which on a 20 Mbit/s link is
            worth many rounds of 2-bit outer gradients.
        lazy_layers: input-side layers whose outer gradient is sent only every ``lazy_every``
            rounds, in a message of its own (module docstring). None (the default): every
            parameter in every round. ``"embeddings"``: the weights of the model's
            ``nn.Embedding``/``nn.EmbeddingBag`` tables that no other layer shares (a table
            tied to an output head syncs every round); or comma-separated module names
            (``"ngrams"``, ``"tok,pos"``, or ``"tok+pos"`` inside a ``--algorithms`` list): the
            parameters owned only by those modules and their children. Refused where it
            selects nothing or everything.
        lazy_every: tau, the rounds between the lazy group's syncs: an integer, or ``"auto"``
            (the default): the lazy update's rule on the group's outer gradients (module
            docstring), from 1 up to ``max_lazy_every``.
        max_lazy_every: the largest tau ``"auto"`` may reach (16).
        lazy_per_layer: one lazy message per layer (the module that holds the parameters
            directly: each embedding table, or each layer of a named block), each with its own
            residual and its own tau under ``"auto"``, so a layer whose progress keeps its
            direction syncs less often than one whose rounds cancel. False (the default): one
            message and one tau for every selected parameter, one collective per sync instead
            of one per layer (docs/cp-diloco.md).
        inner_lr_scale: the inner steps' learning rate as a multiple of the optimizer's own
            (warm-up steps keep the optimizer's rate): a number > 0, or ``"auto"`` (the
            default): ``sqrt(N)`` at N ranks for Adam and AdamW, 1 for any other optimizer.
            The outer step averages the ranks' Adam steps, each divided by the second moment
            of its own batch's gradients, which holds N times the noise variance of the
            averaged batch that ``ssgd`` divides by: where noise dominates that moment, the
            mean of N such steps moves like ``ssgd`` at ``lr / sqrt(N)``. AdamW's decoupled
            weight decay keeps its rate per step (:func:`lowband.optim.lr_scale.step_scaled`).
            ``sqrt(2)`` took gpt at 2 workers from 2.7% above ``ssgd``'s validation loss at
            equal steps to 0.1-0.3% (two seeds, docs/cp-diloco.md); SGD's averaged steps are
            already its averaged gradients' step.
        sparse_rows: average each row of the model's embedding tables (the weights of
            ``nn.Embedding``/``nn.EmbeddingBag`` tables no other layer shares) over the ranks
            that trained it since its message was last sent (a non-zero gradient of the row in
            some inner step), not over all ranks (:mod:`lowband.algorithms.sparse_rows`): a
            row one rank in N reached otherwise moves by 1/N of that rank's step. The flags
            travel packed in the same message (gpt-ngram's 8192 rows: 3.3 KB per rank at 2
            ranks, 5.5 KB at 4). True: on gpt-ngram over loopback it lowered the final loss at
            equal steps at 2 and 4 workers (docs/cp-diloco.md). Nothing changes for a model
            without such tables.
    """

    sync_every: Union[int, str] = "auto"
    min_sync_every: int = 4
    max_sync_every: int = 64
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = True
    compressor: str = "2bit"
    compressor_options: dict[str, Any] = field(default_factory=dict)
    collective: str = "auto"
    error_feedback: bool = True
    pipelined: bool = True
    apply_after: Optional[int] = 1
    local_weight: float = 1.0
    correction: str = "spread"
    correction_every: Optional[int] = 32
    blocking_correction: bool = False
    compress_vectors: bool = False
    warmup_steps: int = 0
    lazy_layers: Optional[str] = None
    lazy_every: Union[int, str] = "auto"
    max_lazy_every: int = 16
    lazy_per_layer: bool = False
    sparse_rows: bool = True
    inner_lr_scale: Union[float, str] = "auto"

    name: ClassVar[str] = "cp-diloco"
    #: checkpoints written before these knobs ran with their steps at the optimizer's own rate,
    #: one lazy group and every row averaged over all ranks
    added_knobs: ClassVar[dict[str, Any]] = {"inner_lr_scale": 1.0, "lazy_per_layer": False, "sparse_rows": False}

    def __post_init__(self) -> None:
        check_compression_knobs(self.name, self.compressor, self.compressor_options, self.collective, 1.0)
        self.sync_every = H = _auto_or(self.sync_every, int)
        if H != "auto" and (isinstance(H, bool) or not isinstance(H, int) or H < 1):
            raise ValueError(f"{self.name}: sync_every must be an integer >= 1 or 'auto', got {H!r}")
        for knob, low in (("min_sync_every", 1), ("max_sync_every", 1), ("warmup_steps", 0)):
            v = getattr(self, knob)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{self.name}: {knob} must be an integer >= {low}, got {v!r}")
        if self.max_sync_every < self.min_sync_every:
            raise ValueError(f"{self.name}: max_sync_every must be >= min_sync_every, got "
                             f"max_sync_every={self.max_sync_every}, min_sync_every={self.min_sync_every}")
        k = self.correction_every
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"{self.name}: correction_every must be an integer >= 1 or None, got {k!r}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"{self.name}: correction must be one of {CORRECTIONS}, got {self.correction!r}")
        for knob in ("nesterov", "error_feedback", "pipelined", "blocking_correction", "compress_vectors",
                     "sparse_rows", "lazy_per_layer"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"{self.name}: {knob} must be True or False, got {getattr(self, knob)!r}")
        if isinstance(self.outer_lr, bool) or not isinstance(self.outer_lr, (int, float)) or not self.outer_lr > 0:
            raise ValueError(f"{self.name}: outer_lr must be a number > 0, got {self.outer_lr!r}")
        a = self.apply_after
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a < 1):
            raise ValueError(f"{self.name}: apply_after must be an integer >= 1 or None, got {a!r}")
        w = self.local_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
            raise ValueError(f"{self.name}: local_weight must be in [0, 1], got {w!r}")
        mu = self.outer_momentum
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0.0 <= mu < 1.0:
            raise ValueError(f"{self.name}: outer_momentum must be in [0, 1), got {mu!r}")
        self.lazy_every = tau = _auto_or(self.lazy_every, int)
        if tau != "auto" and (isinstance(tau, bool) or not isinstance(tau, int) or tau < 1):
            raise ValueError(f"{self.name}: lazy_every must be an integer >= 1 or 'auto', got {tau!r}")
        m = self.max_lazy_every
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{self.name}: max_lazy_every must be an integer >= 1, got {m!r}")
        lazy = self.lazy_layers
        if lazy is not None:
            if not isinstance(lazy, str) or not lazy_names(lazy):
                raise ValueError(f"{self.name}: lazy_layers must be 'embeddings' or comma-separated module names, "
                                 f"got {lazy!r}")
            if lazy.strip().lower() in ("none", ""):
                self.lazy_layers = None
            elif self.correction == "burst" and k is not None:
                raise ValueError(f"{self.name}: lazy_layers works with correction='spread' or correction_every=None, "
                                 f"not with the burst correction")
        self.inner_lr_scale = scale = _auto_or(self.inner_lr_scale, float)
        if scale != "auto" and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                or not math.isfinite(scale) or not scale > 0):
            raise ValueError(f"{self.name}: inner_lr_scale must be a number > 0 or 'auto', got {scale!r}")
        if self.blocking_correction and (self.correction != "burst" or k is None):
            raise ValueError(f"{self.name}: blocking_correction needs correction='burst' and a correction_every, "
                             f"got correction={self.correction!r}, correction_every={k}")

    def bind(self, ctx: EngineContext) -> "BoundCPDiLoCo":
        return BoundCPDiLoCo(self, ctx)


class _Flight:
    """One round's outer-gradient message: the reducer's handle (or, restored from a
    checkpoint, its result). ``result()`` waits once and returns the flat fp32 average of the
    ``numel`` outer-gradient elements (those of ``index``); the message may carry more fp32
    values after them (``sparse_rows``' packed flags, then ``sync_every="auto"``'s two
    measurements or the lazy group's three statistics: the ranks' means, ``measured``), and
    ``seconds`` is how long the reducer's job took on the background thread (None: not timed)."""

    def __init__(self, handle, round_index: int, exact: bool, value: Optional[torch.Tensor] = None,
                 numel: Optional[int] = None, measured: Optional[list[float]] = None,
                 seconds: Optional[float] = None, index: Optional[torch.Tensor] = None,
                 rows: Optional[RowCounter] = None):
        self.handle, self.round, self.exact = handle, round_index, exact
        self._value, self.numel = value, numel
        #: the message's embedding tables (``sparse_rows``): their packed flags follow the
        #: outer gradient, and the average's rows are scaled by them on arrival
        self.rows = rows
        self.measured, self.seconds = measured, seconds
        #: the flat elements the message carries (None: all of them)
        self.index = index
        #: the lazy group's message: the rounds of progress it carries
        self.rounds: Optional[int] = None

    def result(self) -> torch.Tensor:
        """The average (with ``rows``, its table rows averaged over the ranks that trained them)."""
        if self._value is None:
            value = self.handle.wait()
            span = self.handle.span
            self.seconds = None if span is None else span[1] - span[0]
            if self.numel is not None and value.numel() > self.numel:
                tail = value[self.numel:]
                value = value[:self.numel]
                if self.rows is not None:
                    value = self.rows.scale_(value, tail[:self.rows.width])
                    tail = tail[self.rows.width:]
                if tail.numel():
                    self.measured = [float(x) for x in tail.tolist()]
            self._value = value
            self.handle = None
        return self._value


class _LazyGroup:
    """One lazy message (``lazy_layers``: every selected parameter, or with ``lazy_per_layer``
    one layer's): its elements, its bucket in the reducer (its own residual), its period tau
    and the state between its syncs."""

    def __init__(self, label: str, params: list[int], bucket: str, index: torch.Tensor,
                 segments: list[tuple[str, int]], exact: list[bool], rows: Optional[RowCounter], tau: int):
        self.label, self.params, self.bucket = label, params, bucket
        self.index, self.numel = index, int(index.numel())     # flat element indices
        self.segments, self.exact, self.rows = segments, exact, rows
        self.tau = tau
        self.next = 0                                # the round whose end next sends the group
        self.syncs = 0                               # its messages sent
        self.rounds = 0                              # rounds of progress in its unsent u (before this one)
        self.prev: Optional[torch.Tensor] = None     # its u at the last round end that did not send it
        self.flight: Optional[_Flight] = None        # its message, sent at the same round end as in_flight
        #: (round, tau) where tau took a new value
        self.history: list[list[int]] = [[0, tau]]


class BoundCPDiLoCo(BoundAlgorithm):
    """CP-DiLoCo bound to one engine: the reducer (residuals), anchor, outer momentum, the
    round's starting point, the round in flight and the counters."""

    cfg: CPDiLoCo
    uses_gradient_hooks: ClassVar[bool] = False
    clips: ClassVar[bool] = True

    def __init__(self, cfg: CPDiLoCo, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        self.device = ctx.params[0].device if ctx.params else torch.device("cpu")
        self.inner_lr_scale = resolve_scale(cfg.inner_lr_scale, ctx.optimizer, ctx.comm.world_size)
        codec = build_compressor(cfg.compressor, cfg.compressor_options)
        collective = resolve_collective(cfg.collective, ctx.comm.world_size, OUTER_ALLGATHER_MAX_WORLD)
        self.reducer = make_reducer(collective, ctx.comm, codec, cfg.error_feedback)
        everything = range(len(ctx.params))
        self.segments = bucket_segments(ctx.names, ctx.params, everything)
        self.numel = sum(p.numel() for p in ctx.params)
        # the lazy groups (lazy_layers) and the rest, the round's own message
        groups = ([] if cfg.lazy_layers is None else
                  lazy_groups(ctx.model, ctx.params, cfg.lazy_layers, cfg.lazy_per_layer))
        lazy = sorted(i for _, group in groups for i in group)
        if cfg.lazy_layers is not None and not 0 < len(lazy) < len(ctx.params):
            raise ValueError(f"{self.name}: lazy_layers={cfg.lazy_layers!r} selects "
                             f"{'no' if not lazy else 'every'} parameter; it must leave some parameters to "
                             f"sync every round and name at least one that no unselected layer shares")
        eager = [i for i in everything if i not in set(lazy)]
        self.lazy_params = [ctx.names[i] for i in lazy]
        # sparse_rows: each message's embedding tables, their offsets in its flat vector
        self.rows = self._row_counter(eager) if cfg.sparse_rows else None
        self.exact_segments = exact_vector_segments(ctx.params, eager, cfg.compress_vectors)
        self.n_eager = sum(ctx.params[i].numel() for i in eager)
        self.eager_index: Optional[torch.Tensor] = None     # flat element indices (None: no lazy group)
        self.lazy: list[_LazyGroup] = []
        if lazy:
            starts = [0]
            for q in ctx.params:
                starts.append(starts[-1] + q.numel())
            def elements(indices: list[int]) -> torch.Tensor:
                return torch.cat([torch.arange(starts[i], starts[i + 1], device=self.device) for i in indices])
            self.eager_index = elements(eager)
            for label, group in groups:
                rows = self._row_counter(group) if cfg.sparse_rows else None
                own = bucket_segments(ctx.names, ctx.params, group)
                segments = own + self._tail(rows) + [(LAZY_STATS, 3)]
                exact = ((exact_vector_segments(ctx.params, group, cfg.compress_vectors) or [False] * len(own))
                         + [True] * (len(segments) - len(own)))
                self.lazy.append(_LazyGroup(label, group, f"{LAZY}:{label}" if label else LAZY, elements(group),
                                            segments, exact, rows, 1 if cfg.lazy_every == "auto" else cfg.lazy_every))
        #: written weights read back equal what was written (no rounding to a lower precision)
        self.all_fp32 = all(p.dtype == torch.float32 for p in ctx.params)
        self.warmup = Warmup(cfg.warmup_steps)
        self.t = 0                                        # steps completed (agreed on every rank)
        self.anchor: Optional[torch.Tensor] = None        # A (None until the first round starts)
        self.momentum: Optional[torch.Tensor] = None      # m (None until the first outer step)
        self.base: Optional[torch.Tensor] = None          # where this round's progress started
        self.in_flight: Optional[_Flight] = None
        #: every replica holds the anchor and nothing is in flight (drain has nothing to do
        #: unless a residual is left: ``residual_clean``)
        self.in_sync = True
        self.residual_clean = True
        self.outer_steps = 0
        self.corrections = 0                              # rounds that sent anything exact
        self.rounds_sent = 0
        self.residual_norm: Optional[float] = None        # after the last applied round's encode
        self._metrics: dict[str, Any] = {}
        # the round schedule (agreed on every rank): the current round, its first step, its H
        self.auto = cfg.sync_every == "auto"
        self.H = cfg.min_sync_every if self.auto else cfg.sync_every
        #: the inner step of a round after which the previous round's average is applied
        #: (``apply_after``; under ``"auto"`` raised to the steps the message needs)
        self.apply_at = cfg.apply_after
        self.round, self.round_start = 0, cfg.warmup_steps
        #: (round, its first step, H) where H took a new value
        self.H_history: list[list[int]] = [[0, cfg.warmup_steps, self.H]]
        # sync_every="auto": the rule (SyncFitController) and its measurements
        self.fit = (SyncFitController(cfg.min_sync_every, cfg.max_sync_every, share=fit_share(cfg.pipelined, cfg.apply_after))
                    if self.auto else None)
        eager_segments = bucket_segments(ctx.names, ctx.params, eager)
        self.delta_segments, self.delta_exact = eager_segments, self.exact_segments
        tail = self._tail(self.rows) + ([(MEASURE, 2)] if self.auto else [])
        if tail:
            self.delta_segments = eager_segments + tail
            self.delta_exact = (self.exact_segments or [False] * len(eager_segments)) + [True] * len(tail)
        self._step_times: list[float] = []                # this rank's last STEP_WINDOW compute times
        self._message_times: list[float] = []             # and its last MESSAGE_WINDOW message times
        self._agreed: Optional[list[float]] = None        # the ranks' means, newest applied round
        self._last_exit: Optional[float] = None           # when the last inner step() returned
        self._waited_at_exit = 0.0                        # the exposed wait counted by then

    def _row_counter(self, group: list[int]) -> Optional[RowCounter]:
        """``sparse_rows``: the counter of the message of ``group``'s parameters (None: it
        carries no embedding table)."""
        tables = set(row_tables(self.ctx.model, self.ctx.params, group))
        offsets, offset = [], 0
        for i in group:
            if i in tables:
                offsets.append((i, offset))
            offset += self.ctx.params[i].numel()
        return RowCounter(self.ctx.params, offsets, self.ctx.comm.world_size) if offsets else None

    @staticmethod
    def _tail(rows: Optional[RowCounter]) -> list[tuple[str, int]]:
        """The segment of a message's packed row flags (none without tables)."""
        return [] if rows is None else [(ROWS, rows.width)]

    # -- schedule (functions of the agreed step counter and round state) -----------------
    def round_of(self, t: int) -> Optional[int]:
        """The round of the current step ``t`` (None in the warm-up)."""
        return None if self.warmup.active(t) else self.round

    def ends_round(self, t: int) -> bool:
        """Whether the current step ``t`` ends its round."""
        return not self.warmup.active(t) and t - self.round_start + 1 >= self.H

    def message_of(self, r: int, numel: Optional[int] = None) -> tuple[bool, Optional[tuple[int, int]]]:
        """Round r's message of ``numel`` elements (default: the round's own message; the lazy
        group's passes its own count of syncs for r): (all exact, the exact share of a
        compressed one or None)."""
        k = self.cfg.correction_every
        if k is None:
            return False, None
        if k == 1 or (self.cfg.correction == "burst" and (r + 1) % k == 0):
            return True, None
        if self.cfg.correction == "spread":
            lo, hi = share_bounds(self.n_eager if numel is None else numel, k, r % k)
            return False, ((lo, hi) if hi > lo else None)
        return False, None

    def lazy_due(self, r: int) -> list[_LazyGroup]:
        """The lazy groups round r's end sends (``lazy_layers``)."""
        return [g for g in self.lazy if r >= g.next]

    def finiteness(self) -> Finiteness:
        """A step whose gradients reach the anchor only at a later ``step()`` lets the engine
        decide its finiteness at the next ``step()``: an inner step (it moves this rank's
        replica only) and a pipelined round end (its message is applied at a later step,
        ``apply_after`` steps into the next round or at its end, as CP-SGD's pipelined step is
        applied at the next step). Warm-up steps and the
        round ends that apply their own average at once (``pipelined=False``, a blocking
        correction) decide at once, before anything of them is sent. A deferred round end has
        no barrier of its own: the ranks' exchange runs behind the next inner step, where a
        decision at once would wait for the slowest rank at every round end."""
        t = self.t
        if self.warmup.active(t):
            return Finiteness.NOW
        if self.ends_round(t) and not self._pipelines(self.round):
            return Finiteness.NOW
        return Finiteness.LATE

    def _pipelines(self, r: int) -> bool:
        """Whether round r's average is applied at a later step (not at its own end)."""
        return self.cfg.pipelined and not (self.cfg.blocking_correction and self.message_of(r)[0])

    # -- flat views ----------------------------------------------------------------------
    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.ctx.params])

    @torch.no_grad()
    def _write_params(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.ctx.params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n

    def _views(self, flat: torch.Tensor, cast: bool = True) -> list[torch.Tensor]:
        """Per parameter, its part of ``flat`` in its shape (and, with ``cast``, its dtype)."""
        out, offset = [], 0
        for p in self.ctx.params:
            n = p.numel()
            v = flat[offset:offset + n].view(p.shape)
            out.append(v.to(p.dtype) if cast else v)
            offset += n
        return out

    def _by_name(self, flat: Optional[torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        """``flat`` keyed by parameter name, in fp32 (a checkpoint keeps every bit)."""
        if flat is None:
            return None
        return {n: v.detach().clone() for n, v in zip(self.ctx.names, self._views(flat, cast=False))}

    def _from_names(self, saved: Optional[dict[str, torch.Tensor]]) -> Optional[torch.Tensor]:
        if saved is None:
            return None
        saved = to_device(saved, self.device)
        missing = [n for n in self.ctx.names if n not in saved]
        if missing:
            raise ValueError(f"{self.name}: checkpoint has no state for parameter {missing[0]!r}")
        return torch.cat([saved[n].reshape(-1).to(torch.float32) for n in self.ctx.names])

    # -- the outer optimizer -------------------------------------------------------------
    def _outer(self, anchor: torch.Tensor, momentum: Optional[torch.Tensor], D: torch.Tensor
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``A, m <- outer(A, m, D)`` in place where given (torch.optim.SGD's formula)."""
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        if mu == 0:
            anchor.add_(D, alpha=-lr)
            return anchor, momentum
        if momentum is None:
            momentum = D.clone()
        else:
            momentum.mul_(mu).add_(D)
        anchor.add_(D.add(momentum, alpha=mu) if self.cfg.nesterov else momentum, alpha=-lr)
        return anchor, momentum

    def _outer_at(self, anchor: torch.Tensor, momentum: Optional[torch.Tensor], index: Optional[torch.Tensor],
                  D: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`_outer` on the elements ``index`` (None: all) only: the others' anchor and
        momentum are left as they are (a message without them is no step of theirs)."""
        if index is None:
            return self._outer(anchor, momentum, D)
        if momentum is None and self.cfg.outer_momentum != 0:
            momentum = torch.zeros_like(anchor)        # mu * 0 + D = D: an element's first step
        A, m = self._outer(anchor[index], None if momentum is None else momentum[index], D)
        anchor[index] = A
        if m is not None:
            momentum[index] = m
        return anchor, momentum

    def _apply(self) -> Optional[torch.Tensor]:
        """The outer step of the round in flight (waits for it): its own message and the lazy
        groups' it sent. Returns the elements it moved (None: all)."""
        flight, lazy = self.in_flight, [g for g in self.lazy if g.flight is not None]
        self.in_flight = None
        self.anchor, self.momentum = self._outer_at(self.anchor, self.momentum, flight.index, flight.result())
        seconds = self._message_seconds(flight)
        for g in lazy:
            f, g.flight = g.flight, None
            self.anchor, self.momentum = self._outer_at(self.anchor, self.momentum, f.index, f.result())
            self._decide_tau(g, f)
            seconds = None if seconds is None or f.seconds is None else seconds + f.seconds
        self.outer_steps += 1
        self._read_residual()
        if self.auto:
            if seconds is not None:
                self._message_times = (self._message_times + [seconds])[-MESSAGE_WINDOW:]
            if flight.measured is not None:
                self._agreed = flight.measured
        if not lazy:
            return flight.index
        if len(lazy) == len(self.lazy):
            return None
        return torch.cat([flight.index] + [g.index for g in lazy])

    def _decide_tau(self, g: _LazyGroup, f: _Flight) -> None:
        """``lazy_every="auto"``: the lazy update's rule on the ranks' mean statistics of group
        g's message f (:func:`lowband.algorithms.lazy.interval_rule`), which sets the round of
        its next sync."""
        if self.cfg.lazy_every != "auto":
            return
        g2, a2, d2 = f.measured
        # n = 1: a is g, both tests hold with equality (decided without the rounded values)
        tau = g.tau + 1 if f.rounds == 1 else interval_rule(g2, a2, d2, f.rounds, g.tau)[0]
        tau = min(tau, self.cfg.max_lazy_every)
        if tau != g.tau:
            g.tau = tau
            g.history.append([f.round + 1, tau])
        g.next = f.round + tau

    def _read_residual(self) -> None:
        """The norm of this rank's residuals (nothing of the reducer is queued at the callers)."""
        e = self.reducer.worker_residual(DELTA)
        if e is None:
            self.residual_norm = None
            return
        self.residual_norm = float(e[:self.n_eager].norm())
        for g in self.lazy:
            lazy = self.reducer.worker_residual(g.bucket)
            if lazy is not None:
                self.residual_norm = math.hypot(self.residual_norm, float(lazy[:g.numel].norm()))

    # -- iteration -----------------------------------------------------------------------
    def step(self) -> None:
        t = self.t
        self._metrics = {"round": self.round_of(t), "sync_every": self.H, "apply_after": self.apply_at,
                         "warmup": self.warmup.active(t), "round_end": False, "message": None}
        if self.lazy:
            self._metrics.update(lazy_every=self._taus(), lazy=False)
        if self.warmup.active(t):
            self._average_gradients()
        elif self.anchor is None:                     # the first round starts from these weights
            self.anchor = self._flat_params()
            self.base = self.anchor.clone()
        # clipping (engine.clip_grad_norm_), as localsgd: the averaged gradient in a warm-up
        # step, the local one in an inner step
        if self.ctx.clip is not None:
            self.ctx.clip_gradients([p.grad for p in self.ctx.params])
        if not self.warmup.active(t):
            for rows in self._row_counters():
                rows.observe()
        if self.warmup.active(t):
            self.ctx.optimizer.step()
        else:
            step_scaled(self.ctx.optimizer, self.inner_lr_scale)
            self.in_sync = False
            if self.auto:
                seconds = self._step_seconds()
                if seconds is not None:
                    self._step_times = (self._step_times + [seconds])[-STEP_WINDOW:]
            if self.ends_round(t):
                self._end_round(self.round)
                self._next_round(t)
            elif self._apply_due(t):
                self._apply_early()
            if self.auto:
                self._last_exit, self._waited_at_exit = time.perf_counter(), self.ctx.exposed_wait_s
        self.t += 1
        self._metrics["residual_norm"] = self.residual_norm

    # -- sync_every="auto" ---------------------------------------------------------------
    def _step_seconds(self) -> Optional[float]:
        """This inner step's compute time: since the last inner ``step()`` returned, less the
        exposed communication wait charged meanwhile (None for a round's first step after a
        warm-up, a drain or a restore)."""
        if self._last_exit is None:
            return None
        waited = self.ctx.exposed_wait_s - self._waited_at_exit
        return max(0.0, time.perf_counter() - self._last_exit - waited)

    def _message_seconds(self, flight: _Flight) -> Optional[float]:
        """The time the reducer's job for ``flight`` took (codec and network), or None where it
        is no sample of an ordinary round: a burst correction's fp32 message (16x the bytes)
        unless every round is exact."""
        if flight.exact and self.cfg.correction_every != 1:
            return None
        return flight.seconds

    def _measurements(self) -> torch.Tensor:
        """This rank's two values for the round's message: the median of its last message times
        and of its last steps' compute times (MISSING where it has none)."""
        values = [statistics.median(w) if w else MISSING for w in (self._message_times, self._step_times)]
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _next_round(self, t: int) -> None:
        """After the round ending at step ``t``: under ``"auto"`` the rule decides the next
        round's H from the newest agreed measurements (the same numbers on every rank)."""
        if self.fit is not None and self._agreed is not None:
            message_s, step_s = self._agreed
            self._agreed = None
            if message_s >= 0 and step_s > 0:
                need = self.fit.steps_needed(message_s, step_s)
                if self.cfg.apply_after is not None and need is not None:
                    self.apply_at = max(self.cfg.apply_after, need)
                H = self.fit.decide(self.H, message_s, step_s)
                if H != self.H:
                    self.H = H
                    self.H_history.append([self.round + 1, t + 1, H])
        self.round += 1
        self.round_start = t + 1

    def _average_gradients(self) -> None:
        """A warm-up step: the gradients averaged in fp32 (with had-a-gradient flags: a
        parameter no rank used keeps ``grad = None``) through the reducer's queue."""
        params = self.ctx.params
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.bool)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32)
                          for p in params])
        handle = self.reducer.start_full_precision(flat, WARMUP, self.segments, present=present, inline=True)
        avg = handle.wait()
        anyone = handle.present.tolist()
        offset = 0
        for p, used in zip(params, anyone):
            n = p.numel()
            if used:
                value = avg[offset:offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
            else:
                p.grad = None
            offset += n

    def _send(self, d: torch.Tensor, r: int, due: list[_LazyGroup]) -> None:
        """Round r's messages onto the reducer's queue (``in_flight``, and the ``due`` lazy
        groups' ``flight``): ``d`` is every element's unsent progress."""
        exact, share = self.message_of(r)
        own = d if self.eager_index is None else d[self.eager_index]
        tail = ([] if self.rows is None else [self.rows.take()]) + ([self._measurements()] if self.auto else [])
        payload = torch.cat([own] + tail) if tail else own
        if exact:
            handle = self.reducer.start_full_precision(payload, DELTA, self.delta_segments, flush_residuals=True)
            self.corrections += 1
        else:
            handle = self.reducer.start(payload, DELTA, self.delta_segments, exact=share, flush_exact=True,
                                        exact_segments=self.delta_exact, copy=False)
            self.corrections += share is not None
        self.rounds_sent += 1
        self._metrics["message"] = "exact" if exact else ("spread" if share is not None else "compressed")
        self.residual_clean = exact or not self.cfg.error_feedback
        self.in_flight = _Flight(handle, r, exact, numel=self.n_eager if tail else None, index=self.eager_index,
                                 rows=self.rows)
        for g in due:
            g.flight = self._send_lazy(g, d[g.index], r)
            self._metrics["lazy"] = True

    def _send_lazy(self, g: _LazyGroup, u: torch.Tensor, r: int) -> _Flight:
        """Lazy group g's message: its progress ``u`` over the rounds since its last sync, and
        the three statistics of ``lazy_every="auto"``'s rule (this rank's ``|l|^2``,
        ``|u|^2``, ``|l - u|^2``, l the last round's progress)."""
        last = u if g.prev is None else u - g.prev
        l64, u64 = last.double(), u.double()
        stats = torch.stack([l64.dot(l64), u64.dot(u64), (l64 - u64).dot(l64 - u64)]).to(torch.float32)
        exact, share = self.message_of(g.syncs, g.numel)
        rows = [] if g.rows is None else [g.rows.take()]
        payload = torch.cat([u] + rows + [stats.to(u.device)])
        if exact:
            handle = self.reducer.start_full_precision(payload, g.bucket, g.segments, flush_residuals=True)
        else:
            handle = self.reducer.start(payload, g.bucket, g.segments, exact=share, flush_exact=True,
                                        exact_segments=g.exact, copy=False)
        flight = _Flight(handle, r, exact, numel=g.numel, index=g.index, rows=g.rows)
        flight.rounds = g.rounds + 1
        g.syncs += 1
        g.rounds, g.prev = 0, None
        g.next = r + g.tau                             # under "auto" the rule moves it when applied
        self.residual_clean = self.residual_clean and (exact or not self.cfg.error_feedback)
        return flight

    def _lazy_round_passed(self, u: torch.Tensor, due: list[_LazyGroup]) -> None:
        """A round end: the lazy groups it did not send keep ``u``, their unsent progress."""
        for g in self.lazy:
            if g not in due:
                g.prev = u[g.index].clone()
                g.rounds += 1

    def _apply_due(self, t: int) -> bool:
        """Whether step ``t`` (not a round end) applies the round in flight (``apply_after``)."""
        a = self.apply_at
        return a is not None and self.in_flight is not None and t - self.round_start + 1 == a

    @torch.no_grad()
    def _apply_early(self) -> None:
        """``apply_after``: the round in flight's outer step, then this replica rebased onto the
        new anchor with its progress since the round end (``p = base - theta``) kept at
        ``local_weight``; ``base`` moves with it, so the round's message still carries all
        of this round's progress. Elements the round did not carry (the lazy group between
        its syncs) are left as they are."""
        theta = self._flat_params()
        p = self.base - theta
        index = self._apply()
        w = self.cfg.local_weight
        if index is None:
            local = self.anchor - p if w == 1 else self.anchor - w * p
            self._write_params(local)
            self.base = (local if self.all_fp32 else self._flat_params()).add_(p)     # the written weights + p
            return
        theta[index] = self.anchor[index] - p[index] if w == 1 else self.anchor[index] - w * p[index]
        self._write_params(theta)
        written = theta if self.all_fp32 else self._flat_params()
        self.base[index] = written[index] + p[index]

    @torch.no_grad()
    def _end_round(self, r: int) -> None:
        self._metrics["round_end"] = True
        theta = self._flat_params()
        d = self.base - theta
        if not self._pipelines(r):
            if self.in_flight is not None:            # (blocking correction) the previous round first
                self._apply()
            due = self.lazy_due(r)
            self._send(d, r, due)
            index = self._apply()
            self._lazy_round_passed(d, due)
            if index is None:
                self._write_params(self.anchor)
                self.base = self.anchor.clone()
                self.in_sync = True
            else:
                theta[index] = self.anchor[index]
                self._write_params(theta)
                self.base[index] = self.anchor[index]
            return
        moved = self.in_flight is not None
        # waited for before the new message is queued, so that the residual it left can be read
        # (the new job would change it); it normally arrived long ago. ``previous``: the
        # elements it moved (None: all)
        previous = self._apply() if moved else None
        due = self.lazy_due(r)                        # after the apply: the rule may have moved them
        self._send(d, r, due)
        self._lazy_round_passed(d, due)
        written = theta
        if moved:                                     # rebased, the round's own progress at weight w
            w = self.cfg.local_weight
            if previous is None:
                written = self.anchor - d if w == 1 else self.anchor - w * d
            else:
                written[previous] = self.anchor[previous] - d[previous] if w == 1 else \
                    self.anchor[previous] - w * d[previous]
            self._write_params(written)
            if not self.all_fp32:
                written = self._flat_params()
        if len(due) == len(self.lazy):                # every element's progress is in flight
            self.base = written
            return
        # a sent element starts anew; an unsent one keeps its progress (rebased or not)
        self.base[self.eager_index] = written[self.eager_index]
        for g in self.lazy:
            self.base[g.index] = written[g.index] if g in due else written[g.index] + d[g.index]

    # -- global model --------------------------------------------------------------------
    def _settled(self, anchor: torch.Tensor, momentum: Optional[torch.Tensor], zero: bool
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """What ``drain()`` makes of ``anchor`` and ``momentum`` (in place): the round in flight
        applied by its outer step, then the ranks' mean of (progress since ``base`` + residual)
        subtracted, averaged by one fp32 all-reduce on the engine's communicator (the caller's
        counter: :meth:`Engine.global_model` counts it apart). ``zero``: the residuals are
        flushed (drain) or left as they are (an evaluation)."""
        for f in [self.in_flight] + [g.flight for g in self.lazy]:
            if f is not None:
                anchor, momentum = self._outer_at(anchor, momentum, f.index, f.result())
        pending = self.base - self._flat_params()
        # nothing is queued (waited above); the buckets' tails (row flags, measurements,
        # statistics) get 0
        groups = [(DELTA, self.eager_index, self.rows, 2 if self.auto else 0)]
        groups += [(g.bucket, g.index, g.rows, 3) for g in self.lazy]
        for bucket, index, rows, extra in groups:
            extra += 0 if rows is None else rows.width
            if index is None and extra == 0:
                self.reducer.add_residuals(bucket, pending, zero=zero)
                continue
            part = pending if index is None else pending[index]
            padded = torch.cat([part, part.new_zeros(extra)])
            self.reducer.add_residuals(bucket, padded, zero=zero)
            if index is None:
                pending = padded[:self.numel]
            else:
                pending[index] = padded[:index.numel()]
        # sparse_rows: the flags since each message was last sent ride behind, and the mean's
        # table rows are taken over the ranks that trained them, as in a round's message
        counted = [(index, rows) for _, index, rows, _ in groups if rows is not None]
        message = torch.cat([pending] + [rows.take(reset=zero) for _, rows in counted]) if counted else pending
        self.ctx.comm.all_reduce(message, op=dist.ReduceOp.AVG)
        pending, offset = message[:self.numel], self.numel
        for index, rows in counted:
            flags = message[offset:offset + rows.width]
            offset += rows.width
            if index is None:
                rows.scale_(pending, flags)
            else:
                pending[index] = rows.scale_(pending[index], flags)
        anchor.sub_(pending)
        return anchor, momentum

    def _nothing_pending(self) -> bool:
        return self.anchor is None or (self.in_sync and self.residual_clean)

    @torch.no_grad()
    def global_parameters(self) -> Optional[list[torch.Tensor]]:
        """What ``drain()`` would install, computed on copies (training state untouched: the
        round in flight stays in flight, the residuals stay): None while nothing is pending."""
        if self._nothing_pending():
            return None
        anchor = self.anchor.clone()
        momentum = None if self.momentum is None else self.momentum.clone()
        return self._views(self._settled(anchor, momentum, zero=False)[0])

    def replicated_state(self) -> tuple[Optional[list[torch.Tensor]], bool]:
        """The anchor (the parameters while every replica holds it); the optimizer's state only
        while every step so far was a warm-up step."""
        values = list(self.ctx.params) if self.anchor is None or self.in_sync else self._views(self.anchor)
        return values, self.anchor is None

    @torch.no_grad()
    def drain(self) -> None:
        """Apply the round in flight, then average each rank's progress since ``base`` plus its
        residual exactly into the anchor and set every replica to it (module docstring)."""
        if self._nothing_pending():
            return
        if self.in_flight is not None:
            self.outer_steps += 1
        self.anchor, self.momentum = self._settled(self.anchor, self.momentum, zero=True)
        self.in_flight = None
        for g in self.lazy:
            g.flight, g.prev, g.rounds = None, None, 0
        self._write_params(self.anchor)
        self.base = self.anchor.clone()
        self.in_sync = self.residual_clean = True
        self.residual_norm = 0.0 if self.cfg.error_feedback else None
        self._last_exit = None                         # the drain's time is no step's

    # -- reporting -----------------------------------------------------------------------
    def step_metrics(self) -> dict[str, Any]:
        """``round`` (None in the warm-up), ``sync_every`` (the H of the step's round: under
        ``"auto"`` the value the rule chose), ``warmup``, ``round_end``,
        ``message`` (at a round end: ``compressed``, ``spread`` (with an exact share) or
        ``exact``), with ``lazy_layers`` ``lazy_every`` (tau; with ``lazy_per_layer`` each
        layer's by name) and ``lazy`` (the round end sent a lazy group), and ``residual_norm`` (this rank's residual after the last applied round;
        None before). The training loop logs each step's counted bytes beside them (a round's
        message is counted when the background queue sends it)."""
        return dict(self._metrics)

    def summary(self) -> dict[str, Any]:
        return {"rounds_sent": self.rounds_sent, "outer_steps": self.outer_steps, "corrections": self.corrections,
                "sync_every": self.H, "sync_every_auto": self.auto,
                "sync_every_history": [list(h) for h in self.H_history], "pipelined": self.cfg.pipelined,
                "collective": self.reducer.name, "residual_norm": self.residual_norm,
                "inner_lr_scale": self.inner_lr_scale,
                **({"sparse_rows": self._row_table_names()} if self._row_counters() else {}),
                **({} if not self.lazy else
                   {"lazy_params": list(self.lazy_params), "lazy_syncs": sum(g.syncs for g in self.lazy),
                    "lazy_every": self._taus(),
                    "lazy_every_history": self._lazy_histories()})}

    def _taus(self) -> Union[int, dict[str, int]]:
        """tau: the lazy group's, or with ``lazy_per_layer`` each layer's by its name."""
        if not self.cfg.lazy_per_layer:
            return self.lazy[0].tau
        return {g.label: g.tau for g in self.lazy}

    def _lazy_histories(self) -> Union[list[list[int]], dict[str, list[list[int]]]]:
        if not self.cfg.lazy_per_layer:
            return [list(h) for h in self.lazy[0].history]
        return {g.label: [list(h) for h in g.history] for g in self.lazy}

    def _row_counters(self) -> list[RowCounter]:
        """``sparse_rows``: the counters of the messages that carry embedding tables."""
        return [c for c in [self.rows] + [g.rows for g in self.lazy] if c is not None]

    def _row_table_names(self) -> list[str]:
        """The embedding tables ``sparse_rows`` averages by rows (the round's, then the lazy groups')."""
        return [self.ctx.names[i] for c in self._row_counters() for i, *_ in c.tables]

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Works with a round in flight: its average is waited for and saved."""
        state: dict[str, Any] = {
            "t": self.t, "in_sync": self.in_sync, "residual_clean": self.residual_clean,
            "outer_steps": self.outer_steps, "corrections": self.corrections, "rounds_sent": self.rounds_sent,
            "residual_norm": self.residual_norm,
            "anchor": self._by_name(self.anchor), "momentum": self._by_name(self.momentum),
            "base": self._by_name(self.base), "in_flight": None,
            "round": self.round, "round_start": self.round_start, "sync_every": self.H, "apply_at": self.apply_at,
            "sync_every_history": [list(h) for h in self.H_history],
        }
        if self.auto:
            state["fit"] = {"step_times": list(self._step_times), "message_times": list(self._message_times),
                            "agreed": None if self._agreed is None else list(self._agreed)}
        if self.in_flight is not None:
            state["in_flight"] = self._flight_state(self.in_flight)
        if self.lazy:
            state["lazy"] = [{"layer": g.label, "tau": g.tau, "next": g.next, "syncs": g.syncs, "rounds": g.rounds,
                              "history": [list(h) for h in g.history],
                              "prev": None if g.prev is None else self._by_name(self._full(g.prev, g.index)),
                              "in_flight": None if g.flight is None else self._flight_state(g.flight)}
                             for g in self.lazy]
        state["rows"] = {name: rows.state_dict() for name, rows in self._named_row_counters() if rows is not None}
        state["collective"] = self.reducer.state_dict()      # after the wait: residuals settled
        return state

    def _named_row_counters(self) -> list[tuple[str, Optional[RowCounter]]]:
        """Each message's ``sparse_rows`` counter (None: none) by its name in checkpoints."""
        return [("delta", self.rows)] + [("lazy" + (f":{g.label}" if g.label else ""), g.rows) for g in self.lazy]

    def _full(self, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``values`` of the elements ``index`` in a flat vector of every element, zeros
        elsewhere (checkpoints save per parameter name)."""
        out = values.new_zeros(self.numel)
        out[index] = values
        return out

    def _flight_state(self, f: _Flight) -> dict[str, Any]:
        average = f.result()
        return {"round": f.round, "exact": f.exact, "measured": f.measured, "seconds": f.seconds,
                "rounds": f.rounds,
                "average": self._by_name(average if f.index is None else self._full(average, f.index))}

    def _restored_flight(self, f: Optional[dict[str, Any]], index: Optional[torch.Tensor]) -> Optional[_Flight]:
        if f is None:
            return None
        average = self._from_names(f["average"])
        flight = _Flight(None, int(f["round"]), bool(f["exact"]), average if index is None else average[index],
                         measured=f.get("measured"), seconds=f.get("seconds"), index=index)
        flight.rounds = f.get("rounds")
        return flight

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = int(state["t"])
        self.in_sync, self.residual_clean = bool(state["in_sync"]), bool(state["residual_clean"])
        self.outer_steps, self.corrections = int(state["outer_steps"]), int(state["corrections"])
        self.rounds_sent = int(state["rounds_sent"])
        self.residual_norm = state.get("residual_norm")
        self.anchor = self._from_names(state["anchor"])
        self.momentum = self._from_names(state["momentum"])
        self.base = self._from_names(state["base"])
        self.in_flight = self._restored_flight(state.get("in_flight"), self.eager_index)
        lazy = state.get("lazy")
        if isinstance(lazy, dict):                     # one group, saved before lazy_per_layer
            lazy = [{"layer": "", **lazy}]
        saved = None if lazy is None else [str(g.get("layer", "")) for g in lazy]
        if saved != ([g.label for g in self.lazy] if self.lazy else None):
            raise ValueError(f"{self.name}: the checkpoint was saved with lazy groups {saved}, this run has "
                             f"{[g.label for g in self.lazy] if self.lazy else None} (lazy_layers="
                             f"{self.cfg.lazy_layers!r}, lazy_per_layer={self.cfg.lazy_per_layer})")
        for g, item in zip(self.lazy, lazy or []):
            g.tau, g.next = int(item["tau"]), int(item["next"])
            g.syncs, g.rounds = int(item["syncs"]), int(item["rounds"])
            g.history = [[int(x) for x in h] for h in item["history"]]
            prev = self._from_names(item["prev"])
            g.prev = None if prev is None else prev[g.index]
            g.flight = self._restored_flight(item["in_flight"], g.index)
        if "round" in state:
            self.round, self.round_start = int(state["round"]), int(state["round_start"])
            self.H_history = [[int(x) for x in h] for h in state["sync_every_history"]]
            if self.auto:
                self.H = int(state["sync_every"])
            self.apply_at = state.get("apply_at", self.cfg.apply_after)
        else:                                          # a checkpoint from before the round state
            done = max(0, self.t - self.cfg.warmup_steps)
            self.round = done // self.H
            self.round_start = self.cfg.warmup_steps + self.round * self.H
        saved_rows = state.get("rows") or {}
        for name, rows in self._named_row_counters():
            if rows is not None:
                rows.load_state_dict(saved_rows.get(name), self.name)
            elif name in saved_rows:
                raise ValueError(f"{self.name}: the checkpoint was saved with sparse_rows on embedding tables "
                                 f"this run does not average by rows (sparse_rows={self.cfg.sparse_rows})")
        fit = state.get("fit") or {}
        self._step_times = [float(x) for x in fit.get("step_times", [])]
        self._message_times = [float(x) for x in fit.get("message_times", [])]
        self._agreed = fit.get("agreed")
        self._last_exit = None
        self.reducer.load_state_dict(state["collective"])

    def close(self) -> None:
        self.reducer.close()
