"""The step of each algorithm as a task graph, simulated over a few consecutive steps.

For one representative worker (all workers are symmetric) the model builds, per step:

* ``forward`` and one ``backward`` task per parameter in the profile's gradient-ready order on
  the ``compute`` resource, then ``optimizer``;
* buckets from :func:`lowband.algorithms.buckets.plan_buckets` (the rule lowband's BucketSet
  uses), each *launched* when its last gradient is ready and every earlier bucket has been
  launched;
* collectives on the ``net`` resource (one link per worker, collectives in launch order), with
  times from :class:`~lowband.perf.network.Network`;
* codec work (encode with error feedback, decode) from the profile's codec throughputs, on the
  ``compute`` resource when the profile says the codec shares the processor with compute (CPU
  workers), on a ``codec`` resource of its own otherwise;
* lowband's compressed collectives run their whole pipeline on one background thread, so the
  codec and network tasks of successive buckets form one serial chain; that thread's CPU
  beyond the codec (flags, buffers, the collective's call, Python), which the profile measures per
  step at one rank (``pipeline_cpu_s``), rides with each compressed bucket's encode.

Each algorithm's dependency rules say which of these the next step waits for (module
docstrings of the builders below; ``docs/perfmodel.md`` lists every approximation). The result
is the mean step time in steady state (after the algorithm's warm-up phase), averaged over
whole cycles of its periodic steps (CP-SGD's correction period, the lazy update's sync
interval, local SGD's averaging period).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional

from ..algorithms.buckets import plan_buckets
from ..algorithms.cp_diloco import OUTER_ALLGATHER_MAX_WORLD, SyncFitController, fit_share, lazy_names
from ..algorithms.sparse_rows import MAX_WORLD as ROWS_MAX_WORLD, packed_width
from ..comm.plans import resolve_collective
from ..comm.wire import MIB
from .network import Network
from .profile import Profile
from .simulate import Graph, TokenBucket

#: options the model understands beyond the algorithms' own knobs (what-if inputs)
MODEL_OPTIONS = {
    "ssgd": {"pattern": "bucketed (lowband) or pcnn (per-layer all-to-all + all-gather overlapped with the next "
                        "forward, the lazy paper's code)"},
    "lazy": {"tau": "mean sync interval of the lazy layers (steps); default DEFAULT_TAU",
             "pattern": "as for ssgd"},
    "compressed": {"collective=ps": "MXNet-style parameter server (push compressed, pull fp32 weights)",
                   "ps_servers": "server count for collective=ps (default: one per worker)"},
    "cpsgd": {"collective=ps": "as for compressed", "ps_servers": "as for compressed"},
    "cp-diloco": {"tau": "with lazy_layers and lazy_every='auto': the mean rounds between the lazy group's "
                         "syncs; default min(DEFAULT_TAU, max_lazy_every)"},
}
#: the lazy update's sync interval when none is given: a placeholder, not a measurement (tau
#: adapts at run time and grows roughly like sqrt(2 t) when gradients agree; see docs/perfmodel.md)
DEFAULT_TAU = 4.0
#: local-update cost of CP-SGD in units of one optimizer step: "optimizer" the closed-form
#: tentative step (about two steps on CPU with SGD and momentum; docs/cpsgd.md); "sgd" one axpy
#: per parameter; "none" a copy. On CPU with plain SGD lowband fuses the global step and the
#: tentative step into one native pass: where the profile measured it (``fused_update_s``),
#: the model charges that pass instead of the global step plus this cost.
LOCAL_UPDATE_COST = {"optimizer": 2.0, "sgd": 1.0, "none": 0.3}
#: steps :func:`estimate` simulates before it starts measuring (at least one whole cycle): a
#: depth-1 pipeline on a link slower than its compute fills its backlog in a few steps (cpsgd
#: without a correction, cnn at 50 Mbit/s), and the links' token bucket
#: starts empty in the simulation (steady state), so 8 steps reach the steady state of every
#: modelled algorithm on the benchmark's links (tests/test_perfmodel.py checks it against 60
#: steps). Not always behind a deep bucket on a link only just slower than the compute: there
#: cpsgd drains the bucket by a few KB per step and turns slower after tens of steps.
LEAD_IN_STEPS = 8


@dataclass(frozen=True)
class Cluster:
    """Knobs:
        workers: N.
        network: per-worker link (bandwidth, latency, efficiency).
        compute_scale: multiplies every compute and codec time of the profile (CPU contention:
            more workers than cores run each step slower; measure it with a compute-only run).
        codec_shares_compute: override the profile's ``codec_shares_compute``.
        comm_cpu_s_per_byte: CPU seconds the communication library spends per byte a worker
            sends (copies, reductions, TCP). When > 0, every collective also puts that much
            work (times ``compute_scale``) on the ``compute`` resource while it runs: on a
            machine with no spare core it competes with forward and backward. 0 (default):
            communication costs no compute (a NIC/GPU with its own engine).
        sync_s: seconds every collective adds beyond its bytes and per-message latency because
            the ranks must meet: the slower rank's lag, waking a waiting thread on a busy
            processor. It lengthens each collective on the link (so it is exposed only where
            the collective is). 0 (default): ranks meet instantly.
        step_sync_s: the least time, from this rank's launch, in which the collective that ends
            a step (launched as backward ends; the optimizer waits for it) completes: the later
            rank's arrival after a whole training step, plus a small all-reduce. A step's
            compute varies from rank to rank and from step to step (by a few ms on a shared
            2-core machine), and a synchronous step ends when the slowest rank's gradients
            arrive. A bandwidth-bound collective absorbs it (the early rank's bytes move
            meanwhile), a latency-bound one shows it. 0 (default): ranks finish their steps
            together.
        exchange_s: what the engine's finiteness exchange costs (a tiny all-reduce each step of
            a synchronous algorithm under ``nonfinite="raise"`` or ``"skip"``, right behind the
            step's collectives, when the ranks have just met). None (default): a ring
            all-reduce of its bytes on ``network``.
        chained_s: the least time, from its launch, of the k-th small all-reduce of a chain in
            which each is launched and waited for inside the previous one's future callback
            (``fut.then(cb)``, ``cb`` calling ``all_reduce(...).get_future().wait()``): how
            PyTorch's communication hooks chain theirs (PowerSGD's P and Q all-reduces, behind
            the uncompressed tensors'). Entry k is the k-th link after the first (positions past
            the end take the last entry). The validation's step probe measures it (several times
            the cost of the same all-reduce launched from the caller's thread; docs/perfmodel.md).
            Empty (default): such a collective costs what any all-reduce of its bytes costs.
    """

    workers: int
    network: Network
    compute_scale: float = 1.0
    codec_shares_compute: Optional[bool] = None
    comm_cpu_s_per_byte: float = 0.0
    sync_s: float = 0.0
    step_sync_s: float = 0.0
    exchange_s: Optional[float] = None
    chained_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not self.compute_scale > 0:
            raise ValueError(f"compute_scale must be > 0, got {self.compute_scale}")
        if self.comm_cpu_s_per_byte < 0:
            raise ValueError(f"comm_cpu_s_per_byte must be >= 0, got {self.comm_cpu_s_per_byte}")
        if self.sync_s < 0:
            raise ValueError(f"sync_s must be >= 0, got {self.sync_s}")
        if self.step_sync_s < 0:
            raise ValueError(f"step_sync_s must be >= 0, got {self.step_sync_s}")
        if self.exchange_s is not None and self.exchange_s < 0:
            raise ValueError(f"exchange_s must be >= 0, got {self.exchange_s}")
        object.__setattr__(self, "chained_s", tuple(float(x) for x in self.chained_s))   # frozen
        if any(not x >= 0 for x in self.chained_s):
            raise ValueError(f"chained_s must be >= 0 each, got {self.chained_s}")


@dataclass
class StepEstimate:
    """Steady-state mean over the simulated steps."""

    algorithm: str
    workers: int
    step_s: float                 # mean wall time of one step
    compute_s: float              # forward + backward + optimizer (+ local update) per step
    codec_s: float                # codec work per step
    net_s: float                  # time the link is busy per step
    bytes_sent: float             # bytes per step sent by one worker (wire model)
    notes: list[str] = field(default_factory=list)

    @property
    def exposed_s(self) -> float:
        """Step time beyond pure compute: exposed communication and codec time."""
        return max(0.0, self.step_s - self.compute_s)


class _Step:
    """Builds the tasks of consecutive steps of one algorithm on one graph."""

    def __init__(self, prof: Profile, cluster: Cluster):
        self.p = prof
        self.c = cluster
        self.N = cluster.workers
        self.net = cluster.network
        self.g = Graph()
        if self.net.burst_bytes > 0:    # the link's token bucket (tc tbf), carried across collectives;
            # empty at the start: :func:`estimate` wants the steady state, which its lead-in
            # reaches from an empty bucket and not always from a full one (LEAD_IN_STEPS)
            self.g.shapers["net"] = TokenBucket(self.net.burst_bytes, self.net.bandwidth_bps / 8.0,
                                                self.net.transfer_s(1.0), start_full=False)
        shares = prof.codec_shares_compute if cluster.codec_shares_compute is None else cluster.codec_shares_compute
        self.codec_res = "compute" if shares else "codec"
        self.wire: dict[int, float] = {}          # task -> bytes this worker sends
        self.codec_tasks: set[int] = set()
        self.comm_cpu_tasks: set[int] = set()
        self.sized = prof.sized_params()

    # -- primitives -----------------------------------------------------------------------
    def compute(self, name: str, seconds: float, deps, priority: int = 1) -> int:
        return self.g.add(name, "compute", seconds * self.c.compute_scale, deps, priority)

    def codec(self, name: str, seconds: float, deps) -> int:
        t = self.g.add(name, self.codec_res, seconds * self.c.compute_scale, deps, priority=0)
        self.codec_tasks.add(t)
        return t

    def comm(self, name: str, seconds: float, wire_bytes: float, deps, shaped_bytes: Optional[float] = None,
             meet: bool = True) -> int:
        """A collective on the link: ``seconds`` at the shaped rate, ``wire_bytes`` sent by this
        worker; ``shaped_bytes`` (default ``wire_bytes``) is what ``seconds`` charged at the
        link's rate, which a token bucket may let through early. ``meet=False``: a call queued
        right behind another one of the same ranks, which pays no meeting cost of its own."""
        deps = list(deps)
        t = self.g.add(name, "net", seconds + (self.c.sync_s if self.N > 1 and meet else 0.0), deps)
        self.g.tasks[t].shaped_bytes = wire_bytes if shaped_bytes is None else shaped_bytes
        self.wire[t] = wire_bytes
        if self.c.comm_cpu_s_per_byte > 0 and wire_bytes > 0:
            self.comm_cpu_tasks.add(self.g.add(name + "/cpu", "compute",
                                               wire_bytes * self.c.comm_cpu_s_per_byte * self.c.compute_scale,
                                               deps, priority=0))
        return t

    def ends_step(self, name: str, collective: int, launch: int) -> int:
        """What the optimizer waits for when ``collective``, launched at ``launch``, ends the
        step: it completes no earlier than ``Cluster.step_sync_s`` after the launch (the
        later rank's arrival; a pure delay, on no resource, so a collective that is still
        moving bytes by then absorbs it)."""
        return self._at_least(f"{name}/later rank", collective, [launch], self.c.step_sync_s)

    def _at_least(self, name: str, task: int, deps, seconds: float) -> int:
        """``task``, completed no earlier than ``seconds`` after ``deps`` (a pure delay on no
        resource beside it; nothing to wait for with one worker or no delay)."""
        if self.N <= 1 or seconds <= 0:
            return task
        lag = self.g.add(name, None, seconds, deps)
        return self.g.marker(f"{name}/met", [task, lag])

    def chained(self, name: str, nbytes: float, deps, link: int) -> int:
        """An all-reduce of ``nbytes`` launched when ``deps`` are done from inside the previous
        collective's future callback, as link ``link`` (1, 2, ...) of a hook's chain: it
        completes no earlier than ``Cluster.chained_s[link - 1]`` after its launch (a pure
        delay, on no resource, like :meth:`ends_step`'s), nor before its bytes have moved."""
        collective = self.allreduce(name, nbytes, deps)
        floors = self.c.chained_s
        floor = floors[min(link, len(floors)) - 1] if floors else 0.0
        return self._at_least(f"{name}/in a callback", collective, deps, floor)

    def finiteness_exchange(self, s: int, o: dict, deps) -> Optional[int]:
        """The engine's non-finite gradient check (:mod:`lowband.engine.guard`) for an algorithm that
        neither defers it nor carries it in its own messages: one all-reduce of an int64 per
        rank at ``engine.step()``, before the optimizer. A pure delay (``Cluster.exchange_s``,
        or a ring all-reduce of its bytes), on no resource: it runs on a process group of its
        own, and its few bytes do not wait behind a bucket's on the model's FIFO link (S-SGD's
        buckets are still in flight when it starts). None with ``nonfinite="off"`` or one
        worker."""
        if self.N <= 1 or o.get("nonfinite", "raise") == "off":
            return None
        seconds = self.net.allreduce_s(8.0 * self.N, self.N) if self.c.exchange_s is None else self.c.exchange_s
        return self.g.add(f"s{s}/finiteness exchange", None, seconds, deps)

    def allreduce(self, name: str, nbytes: float, deps, meet: bool = True) -> int:
        from ..comm.wire import allreduce_bytes
        return self.comm(name, self.net.allreduce_s(nbytes, self.N), allreduce_bytes(nbytes, self.N), deps,
                         meet=meet)

    def allgather(self, name: str, nbytes: float, deps) -> int:
        from ..comm.wire import allgather_bytes
        return self.comm(name, self.net.allgather_s(nbytes, self.N), allgather_bytes(nbytes, self.N), deps)

    def alltoall(self, name: str, nbytes: float, deps) -> int:
        from ..comm.wire import alltoall_bytes
        return self.comm(name, self.net.alltoall_s(nbytes, self.N), alltoall_bytes(nbytes, self.N), deps)

    def broadcast(self, name: str, nbytes: float, deps) -> int:
        from ..comm.wire import broadcast_bytes
        return self.comm(name, self.net.broadcast_s(nbytes, self.N), broadcast_bytes(nbytes, self.N), deps)

    def pushpull(self, name: str, push: float, pull: float, servers: int, deps) -> int:
        from ..comm.wire import ps_link_bytes
        worker, server = ps_link_bytes(push, pull, self.N, servers)
        return self.comm(name, self.net.ps_pushpull_s(push, pull, self.N, servers), worker, deps,
                         shaped_bytes=max(worker, server))

    # -- one forward/backward ------------------------------------------------------------
    def forward_backward(self, s: int, after) -> tuple[int, dict[int, int], int]:
        """Returns (forward task, {parameter index: its backward task}, backward end)."""
        f = self.compute(f"s{s}/forward", self.p.forward_s, after)
        ready, prev = {}, f
        for i, dt in zip(self.p.ready_order, self.p.backward_s):
            prev = self.compute(f"s{s}/backward/{self.p.params[i].name}", dt, [prev])
            ready[i] = prev
        end = self.compute(f"s{s}/backward/tail", self.p.backward_tail_s, [prev])
        return f, ready, end

    def buckets(self, indices, bucket_mb: float) -> list[list[int]]:
        return plan_buckets(self.sized, list(indices), int(bucket_mb * MIB))

    def launches(self, s: int, groups: list[list[int]], ready: dict[int, int], extra=(), last_extra=()) -> list[int]:
        """Launch markers: bucket j launches once its gradients are ready and bucket j-1 launched
        (and ``extra``; the last bucket also after ``last_extra``)."""
        out, prev = [], None
        for j, group in enumerate(groups):
            more = list(last_extra) if j == len(groups) - 1 else []
            prev = self.g.marker(f"s{s}/launch{j}", [ready[i] for i in group] + [prev, *extra, *more])
            out.append(prev)
        return out

    def engine_overhead(self, s: int, kind: str, modelled_s: float, after: int) -> Optional[int]:
        """The per-step CPU the profile measured for ``kind``'s engine in one process
        (``engine_overhead_s``) beyond the ``modelled_s`` of it the model charges as tasks of
        their own, as one compute task after ``after`` (the end of backward); None if none."""
        extra = self.p.engine_overhead_s.get(kind, 0.0) - modelled_s
        return self.compute(f"s{s}/{kind} engine overhead", extra, [after]) if extra > 0 else None

    def nbytes(self, group) -> float:
        return float(sum(self.p.params[i].nbytes for i in group))

    def pipeline_glue(self, kind: str, groups: list[list[int]], codec_name: str, compress_vectors: bool) -> float:
        """Seconds per compressed bucket of ``kind``'s pipeline CPU beyond its codec work: the
        profile's ``pipeline_cpu_s[kind]`` (its thread's CPU inside jobs per step, one rank)
        less what the model charges the codec at one rank for the same buckets (encode, decode
        of one payload), shared among the compressed buckets; 0 without a measurement. The
        flags, buffers, the collective's call and Python between them:
        a fixed cost per step that the codec's throughputs do not hold."""
        measured = self.p.pipeline_cpu_s.get(kind, 0.0)
        coded = [g for g in groups if _exact_bytes(self, g, compress_vectors) < self.nbytes(g)]
        if measured <= 0 or not coded:
            return 0.0
        cd = self.p.codec(codec_name)
        at_one = sum(cd.encode_s(self.nbytes(g), calls=len(g)) + cd.decode_s(self.nbytes(g), calls=len(g))
                     for g in coded)
        return max(0.0, measured - at_one) / len(coded)


# -- compressed collectives ------------------------------------------------------------------

def inline_exact(collective: str, world: int) -> bool:
    """Whether the collective carries a bucket's exact fp32 values in its own message
    (:attr:`lowband.comm.plans.Plan.inline_exact`)."""
    return collective == "two-stage" or (collective == "allgather" and world <= 2)


def _compressed_chain(st: _Step, tag: str, nbytes: float, segments: int, collective: str, codec_name: str,
                      launch: int, prev_bg: Optional[int], ps_servers: Optional[int], exact_bytes: float = 0.0,
                      share_bytes: float = 0.0, ends_step: bool = False, glue_s: float = 0.0) -> int:
    """One bucket through a compressed collective; returns its last task. ``nbytes``: fp32
    bytes of the bucket (every element has its code in the message, exact ones code 0);
    ``exact_bytes``: fp32 bytes of its exact segments (always in the message as well);
    ``share_bytes``: of an exact share (in the message where :func:`inline_exact`, else an fp32
    all-reduce beside it).

    two-stage (lowband): encode N chunks per segment -> all_to_all -> decode N versions of own
    chunk + re-encode it -> all_gather -> decode N chunks; exact values cut into N chunks ride
    in both messages. allgather (lowband): encode -> all_gather -> decode N payloads. Both on
    lowband's single background thread (``prev_bg`` chains them). ps (MXNet): encode -> push
    compressed / pull fp32 -> (server decodes N pushes of its shard); per-key pipelining, not
    chained; exact values as an fp32 push/pull beside it. ``ends_step``: the bucket launched as
    backward ends, whose first collective is where the ranks meet (:meth:`_Step.ends_step`).
    ``glue_s``: the pipeline's CPU beyond the codec (:meth:`_Step.pipeline_glue`), charged with
    the encode on lowband's collectives."""
    N, cd = st.N, st.p.codec(codec_name)

    def meet(tag_: str, task: int) -> int:
        return st.ends_step(tag_, task, launch) if ends_step else task

    inline = inline_exact(collective, N)
    raw = exact_bytes + (share_bytes if inline else 0.0)
    aside = [] if inline or share_bytes <= 0 else [share_bytes]
    if collective == "two-stage":
        e1 = st.codec(f"{tag}/encode", cd.encode_s(nbytes, calls=N * segments) + glue_s, [launch, prev_bg])
        a = meet(f"{tag}/all_to_all",
                 st.alltoall(f"{tag}/all_to_all", cd.payload(nbytes, calls=N * segments) + raw, [e1]))
        d1 = st.codec(f"{tag}/decode+reencode",
                      cd.decode_s(nbytes, calls=N * segments) + cd.encode_s(nbytes / N, calls=segments), [a])
        g = st.allgather(f"{tag}/all_gather", cd.payload(nbytes / N, calls=segments) + raw / N, [d1])
        return st.codec(f"{tag}/decode", cd.decode_s(nbytes, calls=N * segments), [g])
    if collective == "allgather":
        e = st.codec(f"{tag}/encode", cd.encode_s(nbytes, calls=segments) + glue_s, [launch, prev_bg])
        g = meet(f"{tag}/all_gather", st.allgather(f"{tag}/all_gather", cd.payload(nbytes, calls=segments) + raw, [e]))
        beside = [st.allreduce(f"{tag}/all_reduce exact", b, [e]) for b in aside]
        return st.codec(f"{tag}/decode", cd.decode_s(N * nbytes, calls=N * segments), [g, *beside])
    if collective == "ps":
        servers = ps_servers or N
        e = st.codec(f"{tag}/encode", cd.encode_s(nbytes, calls=segments), [launch])
        pp = meet(f"{tag}/push+pull", st.pushpull(f"{tag}/push+pull", cd.payload(nbytes, calls=segments), nbytes,
                                                  servers, [e]))
        beside = [st.pushpull(f"{tag}/push+pull exact", b, b, servers, [launch])
                  for b in [exact_bytes + share_bytes] if b > 0]
        return st.codec(f"{tag}/server-decode", cd.decode_s(nbytes * N / servers, calls=segments * N), [pp, *beside])
    raise ValueError(f"unknown collective {collective!r} (model: two-stage, allgather, ps)")


def _fp32_chain(st: _Step, tag: str, nbytes: float, collective: str, launch: int, prev_bg: Optional[int],
                ps_servers: Optional[int], ends_step: bool = False) -> int:
    """A full-precision average of one bucket on the same path (CP-SGD's correction step)."""
    if collective == "ps":
        t = st.pushpull(f"{tag}/push+pull fp32", nbytes, nbytes, ps_servers or st.N, [launch])
    else:
        t = st.allreduce(f"{tag}/all_reduce fp32", nbytes, [launch, prev_bg])
    return st.ends_step(tag, t, launch) if ends_step else t


# -- per-algorithm builders: each adds steps s = 0..S-1 and returns the step-end tasks --------

Builder = Callable[[_Step, dict[str, Any], int], list[int]]


def _noop(st: _Step, o: dict, steps: int) -> list[int]:
    ends, prev = [], None
    for s in range(steps):
        _, _, b = st.forward_backward(s, [prev])
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [b])
        ends.append(prev)
    return ends


def _flagged_buckets(st: _Step, s: int, groups: list[list[int]], launches: list[int]) -> list[int]:
    """lowband's bucketed all-reduce (gradients plus one had-a-gradient flag per parameter),
    each bucket at its launch; the last one ends the step (:meth:`_Step.ends_step`)."""
    done = [st.allreduce(f"s{s}/bucket{j}", st.nbytes(gr) + 4 * len(gr), [launches[j]]) for j, gr in enumerate(groups)]
    if done:
        done[-1] = st.ends_step(f"s{s}/bucket{len(groups) - 1}", done[-1], launches[-1])
    return done


def _ssgd(st: _Step, o: dict, steps: int) -> list[int]:
    """Bucketed all-reduce (gradients + one flag per parameter) launched during backward
    (``overlap=False``: after backward); the optimizer waits for every bucket."""
    if o.get("pattern", "bucketed") == "pcnn":
        return _pcnn(st, o, steps, lazy_mode=False)
    groups = st.buckets(range(len(st.p.params)), o.get("bucket_mb", 1.0))
    overlap = o.get("overlap", True)
    ends, prev = [], None
    for s in range(steps):
        _, ready, b = st.forward_backward(s, [prev])
        launches = st.launches(s, groups, ready, extra=() if overlap else (b,))
        done = _flagged_buckets(st, s, groups, launches)
        check = st.finiteness_exchange(s, o, [b])
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [b, check, *done])
        ends.append(prev)
    return ends


def _ddp(st: _Step, o: dict, steps: int, kind: str = "ddp") -> list[int]:
    """DDP's Reducer: buckets of ``bucket_cap_mb`` in reverse registration order, all-reduced
    (fp16: half the bytes, cast on the compute thread) as they fill; backward ends when the last
    bucket is reduced; a pre-forward broadcast of the buffers (BatchNorm statistics)."""
    cap = o.get("bucket_cap_mb", 25.0)
    groups = st.buckets(range(len(st.p.params)), cap)
    ends, prev = [], None
    for s in range(steps):
        pre = prev
        if o.get("broadcast_buffers", True) and st.p.buffer_bytes:
            pre = st.broadcast(f"s{s}/buffers", st.p.buffer_bytes, [prev])
        _, ready, b = st.forward_backward(s, [pre])
        casts = 0.0
        if kind == "ddp-fp16":        # what the model charges of the hook's work as the casts below
            fp = st.p.codec("fp16")
            casts = sum(fp.encode_s(st.nbytes(gr)) / 2 + fp.decode_s(st.nbytes(gr) / 2) for gr in groups)
        # DDP's own work in the step (bucket copies, hooks, futures) delays the last bucket's launch
        overhead = st.engine_overhead(s, kind, casts, b)
        launches = st.launches(s, groups, ready, last_extra=[overhead])
        done = []
        for j, gr in enumerate(groups):
            nb, tag, start = st.nbytes(gr), f"s{s}/bucket{j}", launches[j]
            if kind == "ddp-fp16":
                fp = st.p.codec("fp16")
                start = st.compute(f"{tag}/to fp16", fp.encode_s(nb) / 2, [start], priority=0)
                nb /= 2
            red = st.allreduce(tag, nb, [start])
            if j == len(groups) - 1:
                red = st.ends_step(tag, red, launches[j])
            if kind == "ddp-fp16":
                red = st.compute(f"{tag}/to fp32", st.p.codec("fp16").decode_s(nb), [red], priority=0)
            done.append(red)
        check = st.finiteness_exchange(s, o, [b, overhead, *done])   # DDP reduces inside backward
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [b, overhead, check, *done])
        ends.append(prev)
    return ends


def _powersgd_sizes(st: _Step, rank: int, min_rate: float) -> tuple[float, float, float, float]:
    """(uncompressed bytes, P bytes, Q bytes, bytes of the compressed matrices) by the rule of
    PyTorch's powerSGD_hook (``_should_compress``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    unc = ps = qs = comp = 0.0
    for prm in st.p.params:
        shape = prm.shape or [1]
        n = shape[0]
        m = prm.numel // n if n else 0
        r = min(n, m, rank)
        if len(shape) > 1 and psgd._should_compress(n, m, r, min_rate)[0]:
            ps += n * r * prm.element_size
            qs += m * r * prm.element_size
            comp += prm.nbytes
        else:
            unc += prm.nbytes
    return unc, ps, qs, comp


def _ddp_powersgd(st: _Step, o: dict, steps: int) -> list[int]:
    """PyTorch's layer-wise powerSGD_hook on one bucket (lowband requires one on gloo): at the
    end of backward, the uncompressed tensors' all-reduce, then P = MQ, all-reduce P,
    orthogonalise and Q = M^T P, all-reduce Q, M = P Q^T, all on the compute thread. The three
    compute phases are the profile's ``powersgd_hook_s`` at this rank where it measured them
    (the hook's own ops on the model's matrices); otherwise they are approximated by lowband's
    own ``powersgd`` codec (rank 4, per-parameter segments), scaled by rank / 4. Steady state
    (after start_powerSGD_iter)."""
    rank = o.get("matrix_approximation_rank", 2)
    unc, pbytes, qbytes, comp = _powersgd_sizes(st, rank, o.get("min_compression_rate", 2.0))
    measured = st.p.powersgd_hook_s.get(str(rank))
    if measured is not None:
        p_s, q_s, m_s = measured
    else:
        cd = st.p.codec("powersgd")
        scale = rank / 4.0
        p_s = q_s = cd.encode_s(comp) * scale / 2
        m_s = cd.decode_s(comp) * scale
    ends, prev = [], None
    for s in range(steps):
        _, _, b = st.forward_backward(s, [prev])
        # DDP's and the hook's work beyond the three phases (bucket copies, futures, Python)
        b = st.engine_overhead(s, "ddp-powersgd", p_s + q_s + m_s, b) or b
        u = st.ends_step(f"s{s}/uncompressed", st.allreduce(f"s{s}/uncompressed", unc, [b]), b)
        p = st.compute(f"s{s}/P=MQ", p_s, [b], priority=0)
        # launched and waited for inside the uncompressed all-reduce's callback, Q's inside P's
        # (PyTorch's hook chains them): the first and second links of a callback chain
        rp = st.chained(f"s{s}/all_reduce P", pbytes, [p, u], 1)
        q = st.compute(f"s{s}/Q=M^T P", q_s, [rp], priority=0)
        rq = st.chained(f"s{s}/all_reduce Q", qbytes, [q], 2)
        d = st.compute(f"s{s}/M=PQ^T", m_s, [rq], priority=0)
        check = st.finiteness_exchange(s, o, [d])     # DDP's hook chain ends inside backward
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [u, d, check])
        ends.append(prev)
    return ends


def _collective(o: dict, world: int) -> str:
    """The algorithm's collective as it runs (``auto`` resolved by the world size); ``ps``
    is the model's own what-if."""
    kind = o.get("collective", "auto")
    return kind if kind == "ps" else resolve_collective(kind, world)


def _exact_bytes(st: _Step, group: list[int], compress_vectors: bool) -> float:
    """fp32 bytes of a bucket's exact segments: its 1-D parameters unless ``compress_vectors``
    (:func:`lowband.algorithms.compressed.exact_vector_segments`)."""
    params = st.p.params
    return 0.0 if compress_vectors else st.nbytes([i for i in group if len(params[i].shape) <= 1])


def _compressed(st: _Step, o: dict, steps: int) -> list[int]:
    """Synchronous compressed SGD after its warm-up: buckets of all parameters through the
    collective on the background thread, launched during backward, their 1-D parameters
    (unless ``compress_vectors``) in fp32 in the same message; a bucket of only 1-D
    parameters is an fp32 all-reduce. The optimizer waits for every bucket."""
    groups = st.buckets(range(len(st.p.params)), o.get("bucket_mb", 1.0))
    overlap = o.get("overlap", True)
    collective, codec_name = _collective(o, st.N), o.get("compressor", "2bit")
    glue = st.pipeline_glue("compressed", groups, codec_name, o.get("compress_vectors", False))
    ends, prev, bg = [], None, None
    for s in range(steps):
        _, ready, b = st.forward_backward(s, [prev])
        extra = () if overlap else (b,)
        done = []
        for j, launch in enumerate(st.launches(s, groups, ready, extra)):
            nb, exact = st.nbytes(groups[j]), _exact_bytes(st, groups[j], o.get("compress_vectors", False))
            chained = bg if collective != "ps" else None
            last = j == len(groups) - 1
            if exact >= nb:
                bg = _fp32_chain(st, f"s{s}/bucket{j}", nb + 4 * len(groups[j]), collective, launch, chained,
                                 o.get("ps_servers"), ends_step=last)
            else:
                bg = _compressed_chain(st, f"s{s}/bucket{j}", nb, len(groups[j]), collective, codec_name,
                                       launch, chained, o.get("ps_servers"), exact_bytes=exact, ends_step=last,
                                       glue_s=glue)
            done.append(bg)
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [b, *done])
        ends.append(prev)
    return ends


def _cpsgd(st: _Step, o: dict, steps: int) -> list[int]:
    """CP-SGD's depth-1 pipeline after its warm-up. Step t's buckets go to the background
    thread during backward (compressed, or fp32 on a correction step); ``step()`` waits for
    step t-1's averages, applies them (one optimizer step on W) and forms w by the local
    update; step t+1's forward waits only for that. Correction ``burst``: every k-th step all
    buckets fp32; ``spread`` (the default): every step 1/k of each bucket's elements fp32 and
    the rest compressed. ``compress_vectors=False`` (the default) sends 1-D parameters exact,
    in the bucket's own message (as the share, where the collective carries it inline). The knobs come from :class:`lowband.CPSGD`'s defaults
    (:func:`estimate`)."""
    groups = st.buckets(range(len(st.p.params)), o.get("bucket_mb", 1.0))
    collective, codec_name = _collective(o, st.N), o.get("compressor", "2bit")
    k = o.get("correction_period", 80)
    mode = o.get("correction", "spread")
    if mode not in ("burst", "spread"):
        raise ValueError(f"cpsgd: correction must be burst or spread, got {mode!r}")
    serial = collective != "ps"
    glue = st.pipeline_glue("cpsgd", groups, codec_name, o.get("compress_vectors", False))
    local_cost = LOCAL_UPDATE_COST.get(o.get("local_update", "optimizer"), 1.0) * st.p.optimizer_s
    # the native fused pass (FusedSGDStep) where the profile measured it: it is what runs
    fused = o.get("local_update", "optimizer") == "optimizer" and st.p.fused_update_s is not None
    ends, prev, bg, in_flight = [], None, None, []
    for s in range(steps):
        _, ready, b = st.forward_backward(s, [prev])
        done = []
        correcting = mode == "burst" and k is not None and s % k == 0
        for j, launch in enumerate(st.launches(s, groups, ready)):
            nb, tag = st.nbytes(groups[j]), f"s{s}/bucket{j}"
            exact = _exact_bytes(st, groups[j], o.get("compress_vectors", False))
            snap = st.compute(f"{tag}/snapshot", 0.0, [launch], priority=0)
            chained = bg if serial else None
            last = j == len(groups) - 1
            if correcting:
                bg = _fp32_chain(st, tag, nb, collective, snap, chained, o.get("ps_servers"), ends_step=last)
            elif mode == "spread" and k is not None:     # 1/k of the bucket's elements exact
                bg = _compressed_chain(st, tag, nb, len(groups[j]), collective, codec_name, snap, chained,
                                       o.get("ps_servers"), exact_bytes=exact, share_bytes=nb / k, ends_step=last,
                                       glue_s=glue)
            else:
                bg = _compressed_chain(st, tag, nb, len(groups[j]), collective, codec_name, snap, chained,
                                       o.get("ps_servers"), exact_bytes=exact, ends_step=last, glue_s=glue)
            done.append(bg)
        if fused:
            prev = st.compute(f"s{s}/global optimizer + local update (fused)", st.p.fused_update_s, [b, *in_flight])
        else:
            apply = st.compute(f"s{s}/global optimizer", st.p.optimizer_s, [b, *in_flight])
            prev = st.compute(f"s{s}/local update", local_cost, [apply])
        in_flight = done
        ends.append(prev)
    return ends


def lazy_split(prof: Profile, lazy_layers: Optional[int]) -> tuple[list[int], list[int]]:
    """(lazy parameter indices, probe parameter indices) of the lazy update. With
    ``lazy_layers=None`` and a measured profile: the default set that
    :class:`lowband.algorithms.lazy.LazyPlan` chose from the model's forward order when it was
    profiled (``Profile.lazy_default``: a language model's leading embedding tables, else
    PCNN's 8 layers). Otherwise (an explicit count, or a hand-written profile) the rule of
    :class:`lowband.algorithms.lazy.LazyUpdate` in registration order: parameterised non-norm
    modules, the first ``lazy_layers`` (default min(8, half of them)) lazy, the last lazy one
    the probe (registration order can differ from forward order: ResNet's projections)."""
    from ..algorithms.lazy import DEFAULT_LAZY_LAYERS
    if lazy_layers is None and prof.lazy_default is not None:
        index = {p.name: i for i, p in enumerate(prof.params)}
        return ([index[n] for n in prof.lazy_default["parameters"]],
                [index[n] for n in prof.lazy_default["probe"]])
    modules: list[str] = []
    for p in prof.params:
        if not p.norm and p.module not in modules:
            modules.append(p.module)
    wanted = min(DEFAULT_LAZY_LAYERS, len(modules) // 2) if lazy_layers is None else lazy_layers
    chosen = modules[:min(wanted, max(0, len(modules) - 1))]
    lazy = [i for i, p in enumerate(prof.params) if not p.norm and p.module in chosen]
    probe = [i for i, p in enumerate(prof.params) if chosen and p.module == chosen[-1] and not p.norm]
    return lazy, probe


def _pcnn(st: _Step, o: dict, steps: int, lazy_mode: bool) -> list[int]:
    """PCNN's pattern (the lazy update paper's code, ALGORITHMS.md B.2.3): per layer, an
    all-to-all (reduce-scatter) of its gradient launched when ready, overlapped with the rest
    of backward; each rank updates its 1/N shard; an all-gather of the updated shards overlapped
    with the next forward, which waits for it layer by layer. Normalisation parameters are not
    communicated (PCNN trains them locally). With ``lazy_mode`` the lazy layers skip both and,
    every ``tau`` steps, join one fused all-reduce after backward; their next forward waits for
    it and their update. Forward time is shared out over the layers like backward time (the
    fully connected layer's activation exchange of PCNN is not modelled)."""
    prof = st.p
    params = prof.params
    modules: list[str] = []
    for prm in params:
        if prm.module not in modules:
            modules.append(prm.module)
    members = {m: [i for i, prm in enumerate(params) if prm.module == m] for m in modules}
    bwd_of = dict(zip(prof.ready_order, prof.backward_s))
    total_bwd = sum(prof.backward_s) or 1.0
    fwd = {m: prof.forward_s * sum(bwd_of[i] for i in members[m]) / total_bwd for m in modules}
    lazy, probe = lazy_split(prof, o.get("lazy_layers")) if lazy_mode else ([], [])
    lazy_set = set(lazy)
    comm_mods = [m for m in modules if any(not params[i].norm and i not in lazy_set for i in members[m])]
    lazy_mods = [m for m in modules if any(i in lazy_set for i in members[m])]
    tau = float(o.get("tau", DEFAULT_TAU))
    fused = st.nbytes(lazy) + st.nbytes(probe)
    grad_bytes = float(prof.gradient_bytes) or 1.0
    gathered: dict[str, int] = {}       # module -> all-gather (or lazy update) the next forward waits for
    ends, prev_end = [], None
    for s in range(steps):
        prev = prev_end
        for m in modules:
            prev = st.compute(f"s{s}/forward/{m}", fwd[m], [prev, gathered.get(m)])
        ready = {}
        for i, dt in zip(prof.ready_order, prof.backward_s):
            prev = st.compute(f"s{s}/backward/{params[i].name}", dt, [prev])
            ready[i] = prev
        b = st.compute(f"s{s}/backward/tail", prof.backward_tail_s, [prev])
        gathered = {}
        launch_order = sorted(comm_mods, key=lambda m: max(prof.ready_order.index(i) for i in members[m]))
        for m in launch_order:
            idx = [i for i in members[m] if not params[i].norm]
            nb = st.nbytes(idx)
            a2a = st.alltoall(f"s{s}/{m}/all_to_all", nb, [ready[i] for i in idx])
            upd = st.compute(f"s{s}/{m}/shard update", prof.optimizer_s * nb / grad_bytes / st.N, [a2a], priority=0)
            gathered[m] = st.allgather(f"s{s}/{m}/all_gather", nb / st.N, [upd])
        if lazy_mods and math.floor((s + 1) / tau) > math.floor(s / tau):
            sync = st.allreduce(f"s{s}/lazy sync", fused, [b])
            upd = st.compute(f"s{s}/lazy update", prof.optimizer_s * st.nbytes(lazy) / grad_bytes, [sync], priority=0)
            for m in lazy_mods:
                gathered[m] = upd
        prev_end = b
        ends.append(b)
    return ends


def _lazy(st: _Step, o: dict, steps: int) -> list[int]:
    """Regular parameters: S-SGD's bucketed all-reduce overlapped with backward. Lazy
    parameters: no communication except on sync steps (every ``tau`` steps), where one fused
    all-reduce of their accumulators plus the probe layer's latest gradient is launched in
    ``step()`` after backward, behind the regular buckets; the optimizer waits for it. Sync
    steps are spread evenly at the mean interval ``tau``."""
    if o.get("pattern", "bucketed") == "pcnn":
        return _pcnn(st, o, steps, lazy_mode=True)
    lazy, probe = lazy_split(st.p, o.get("lazy_layers"))
    regular = [i for i in range(len(st.p.params)) if i not in set(lazy)]
    groups = st.buckets(regular, o.get("bucket_mb", 1.0))
    tau = float(o.get("tau", DEFAULT_TAU))
    if not tau >= 1:
        raise ValueError(f"lazy: tau must be >= 1, got {tau}")
    fused = st.nbytes(lazy) + (st.nbytes(probe) if o.get("variant", "probe") == "probe" else st.nbytes(lazy))
    ends, prev = [], None
    for s in range(steps):
        _, ready, b = st.forward_backward(s, [prev])
        launches = st.launches(s, groups, ready)
        done = _flagged_buckets(st, s, groups, launches)
        if lazy and math.floor((s + 1) / tau) > math.floor(s / tau):
            done.append(st.allreduce(f"s{s}/lazy sync", fused, [b, launches[-1] if launches else None]))
        check = st.finiteness_exchange(s, o, [b])
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [b, check, *done])
        ends.append(prev)
    return ends


def _periodic_average(st: _Step, o: dict, steps: int, period_key: str, outer_step: bool,
                      kind: str) -> list[int]:
    """Local steps; every ``period`` steps one fp32 all-reduce of all parameters (one call per
    dtype) after the optimizer step, on the critical path (DiLoCo: of the pseudo-gradients, then
    an outer optimizer step). Every step also pays ``kind``'s measured engine overhead (for
    DiLoCo, torchft's manager and optimizer wrapper)."""
    period = max(1, int(o[period_key]))     # the code's default when not given (estimate)
    ends, prev = [], None
    for s in range(steps):
        _, _, b = st.forward_backward(s, [prev])
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [b])
        prev = st.engine_overhead(s, kind, 0.0, prev) or prev
        if s % period == 0:
            prev = st.allreduce(f"s{s}/average parameters", st.p.gradient_bytes, [prev])
            if outer_step:
                prev = st.compute(f"s{s}/outer optimizer", st.p.optimizer_s, [prev])
        ends.append(prev)
    return ends


def _coerced(name: str, o: dict) -> dict:
    """``o`` with the registry algorithm's own knobs coerced to their types as the command
    line's options are (``correction_every=none`` -> None, ``"16"`` -> 16); others as given."""
    import dataclasses
    from ..algorithms import ALGORITHMS
    from ..algorithms.base import check_options
    cls = ALGORITHMS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    return {**o, **check_options(cls, {k: v for k, v in o.items() if k in known})}


def lazy_selection(prof: Profile, spec: Optional[str]) -> list[int]:
    """The profile's parameters (indices) that ``cp-diloco``'s ``lazy_layers=spec`` selects, by
    the rule of :func:`lowband.algorithms.cp_diloco.lazy_parameters` on what the profile
    records of the model: ``"embeddings"``, the embedding tables no other layer shares (the
    profile's ``table``, taken from the algorithm's own rule when it was measured); module
    names (``lazy_names``), the parameters whose every holder (``ParamInfo.holders``) is one of
    the named modules or inside one. Empty for None or ``"none"``; a name that holds no
    parameter of the profile is refused, as the run refuses a name that is no module."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return []
    if spec.strip().lower() == "embeddings":
        return [i for i, p in enumerate(prof.params) if p.table]
    names = lazy_names(spec)
    modules = set()
    for p in prof.params:
        for h in p.holders:
            parts = h.split(".")
            modules.update(".".join(parts[:j]) for j in range(1, len(parts) + 1))
    for n in names:
        if n not in modules:
            raise ValueError(f"cp-diloco: lazy_layers names {n!r}, which holds no parameter of the profile")

    def inside(h: str) -> bool:
        return any(h == n or h.startswith(n + ".") for n in names)
    return [i for i, p in enumerate(prof.params) if all(inside(h) for h in p.holders)]


#: fp32 values each lazy message carries beside its outer gradient: the three statistics of
#: ``lazy_every="auto"``'s rule (``LAZY_STATS`` in :mod:`lowband.algorithms.cp_diloco`, sent
#: whatever ``lazy_every``)
LAZY_STATS_VALUES = 3


@dataclass(frozen=True)
class _Message:
    """One of cp-diloco's messages per round: ``nbytes`` fp32 bytes of elements with a code in
    the message (its parameters and the exact values appended behind them), in ``segments``
    segments, ``exact_bytes`` of them exact (1-D parameters, packed row flags, statistics);
    ``params_bytes``: its parameters' own (what the spread correction's share is 1/k of)."""

    nbytes: float
    segments: int
    exact_bytes: float
    params_bytes: float


def row_flag_bytes(prof: Profile, group: list[int], world: int) -> float:
    """``sparse_rows``: the bytes of the packed trained-row flags of ``group``'s embedding
    tables in the message that carries them, among ``world`` ranks: one exact fp32 segment
    of :func:`lowband.algorithms.sparse_rows.packed_width` values over all their rows (0
    without tables)."""
    rows = sum(prof.params[i].shape[0] for i in group if prof.params[i].table)
    return 4.0 * packed_width(rows, world) if rows else 0.0


def _lazy_spec(o: dict) -> Optional[str]:
    spec = o.get("lazy_layers")
    return None if spec is None or str(spec).strip().lower() in ("", "none") else str(spec)


def cp_diloco_tau(o: dict) -> Fraction:
    """The rounds between the lazy group's syncs the model charges: an integer ``lazy_every``
    as given; under ``"auto"`` (tau adapts in a run, from 1 up to ``max_lazy_every``) the model
    option ``tau``, a mean (default :data:`DEFAULT_TAU` rounds: the lazy model's placeholder),
    at most ``max_lazy_every``, to the nearest fraction of denominator at most 4 (so that its
    syncs repeat after ``tau.numerator`` rounds: the model's cycle)."""
    every = o.get("lazy_every", "auto")
    if isinstance(every, str) and every.strip().lower() == "auto":
        tau = float(o.get("tau", DEFAULT_TAU))
        if not tau >= 1:
            raise ValueError(f"cp-diloco: tau must be >= 1, got {tau}")
        return Fraction(min(tau, float(o.get("max_lazy_every", 16)))).limit_denominator(4)
    tau = int(every)
    if tau < 1:
        raise ValueError(f"cp-diloco: lazy_every must be an integer >= 1 or 'auto', got {every!r}")
    return Fraction(tau)


def lazy_sync_due(r: int, tau: Fraction) -> bool:
    """Whether round r's end sends the lazy group at (mean) interval tau: where
    ``floor((r + 1) / tau)`` steps up, i.e. every tau-th round, spread evenly for a fractional
    tau (as the lazy model's sync steps)."""
    return (r + 1) * tau.denominator // tau.numerator > r * tau.denominator // tau.numerator


def cp_diloco_messages(prof: Profile, o: dict, world: int) -> tuple[_Message, list[_Message], list[list[int]]]:
    """(the round's own message, the lazy messages, their parameter groups) of cp-diloco on
    ``prof`` among ``world`` ranks. The round's message carries every parameter except the
    lazy group's (``lazy_layers``: :func:`lazy_selection`; one group, or one per holding module
    with ``lazy_per_layer``); each message carries its 1-D parameters exact unless
    ``compress_vectors`` and, with ``sparse_rows``, its tables' packed row flags as one exact
    segment (:func:`row_flag_bytes`); a lazy message also its three statistics. Not charged:
    ``sync_every="auto"``'s two measurement values (8 bytes a round)."""
    n = len(prof.params)
    spec = _lazy_spec(o)
    lazy = lazy_selection(prof, spec) if spec is not None else []
    if spec is not None and not 0 < len(lazy) < n:
        raise ValueError(f"cp-diloco: lazy_layers={spec!r} selects {'no' if not lazy else 'every'} parameter "
                         f"of the profile; it must leave some parameters to sync every round")
    if lazy and o.get("lazy_per_layer", False):
        by_layer: dict[str, list[int]] = {}
        for i in lazy:
            by_layer.setdefault(prof.params[i].holders[0], []).append(i)
        groups = list(by_layer.values())
    else:
        groups = [lazy] if lazy else []
    chosen = set(lazy)
    eager = [i for i in range(n) if i not in chosen]
    sparse = bool(o.get("sparse_rows", True))
    if sparse and world > ROWS_MAX_WORLD and any(prof.params[i].table for i in range(n)):
        raise ValueError(f"cp-diloco: sparse_rows counts trainers exactly up to {ROWS_MAX_WORLD} ranks, not "
                         f"{world}; set sparse_rows=False")
    cv = bool(o.get("compress_vectors", False))

    def message(group: list[int], stats: int) -> _Message:
        own = float(sum(prof.params[i].nbytes for i in group))
        vectors = 0.0 if cv else float(sum(prof.params[i].nbytes for i in group if len(prof.params[i].shape) <= 1))
        flags = row_flag_bytes(prof, group, world) if sparse else 0.0
        tail = flags + 4.0 * stats
        return _Message(own + tail, len(group) + (flags > 0) + (stats > 0), vectors + tail, own)
    return message(eager, 0), [message(g, LAZY_STATS_VALUES) for g in groups], groups


def _cp_diloco(st: _Step, o: dict, steps: int) -> list[int]:
    """Local steps; at the end of every round (``sync_every`` steps) the flat outer gradient
    of all parameters goes to the background thread as one message: compressed (the 1-D
    parameters, and the spread correction's 1/k share, in fp32 in the same message) or, on a
    burst correction round, one fp32 all-reduce. With ``sparse_rows`` (the default) a message
    that carries embedding tables also carries their packed trained-row flags, an exact fp32
    segment (:func:`cp_diloco_messages`). With ``lazy_layers`` the round's message leaves out
    the lazy group, whose own message (compressed, its share and its exact values inside)
    follows it on the same thread at the rounds where ``floor((r + 1) / tau)`` steps up
    (every tau-th round, spread evenly at a mean tau: :func:`cp_diloco_tau`); the round end
    that applies a round waits for both. Pipelined (the default), the round end waits
    only for the previous round's messages, then takes the outer step and the rebase; with
    ``apply_after`` a < H that wait, outer step and rebase come after the a-th step of the next
    round instead; with ``pipelined=False`` (or a blocking burst correction) the round end waits
    for its own. The outer step and the rebase are charged one optimizer step each. Warm-up
    steps are not modelled."""
    o = _coerced("cp-diloco", o)
    H = _cp_diloco_h(o)
    kind = o.get("collective", "auto")
    collective = kind if kind == "ps" else resolve_collective(kind, st.N, OUTER_ALLGATHER_MAX_WORLD)
    codec_name = o.get("compressor", "2bit")
    k, mode = o.get("correction_every", 32), o.get("correction", "spread")
    own, lazy, groups = cp_diloco_messages(st.p, o, st.N)
    tau = cp_diloco_tau(o) if lazy else Fraction(1)
    chosen = {i for g in groups for i in g}
    eager = [i for i in range(len(st.p.params)) if i not in chosen]
    glue = st.pipeline_glue("cp-diloco", [eager, *groups], codec_name, o.get("compress_vectors", False))
    ps_servers = o.get("ps_servers")

    def send(tag: str, msg: _Message, launch: int, bg: Optional[int], exact: bool) -> int:
        if exact:
            return _fp32_chain(st, tag, msg.nbytes, collective, launch, bg, ps_servers)
        share = msg.params_bytes / k if k is not None and mode == "spread" else 0.0
        return _compressed_chain(st, tag, msg.nbytes, msg.segments, collective, codec_name, launch, bg, ps_servers,
                                 exact_bytes=msg.exact_bytes, share_bytes=share, glue_s=glue)

    a = o.get("apply_after")
    ends, prev, bg, in_flight, r, apply_at = [], None, None, [], 0, None
    for s in range(steps):
        _, _, b = st.forward_backward(s, [prev])
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [b])
        if (s + 1) % H and s == apply_at and in_flight:
            # apply_after: the round in flight applied a steps into the next round
            prev = st.compute(f"s{s}/outer step + rebase", 2 * st.p.optimizer_s, [prev, *in_flight])
            in_flight, apply_at = [], None
        if (s + 1) % H == 0:
            tag = f"s{s}/round{r}"
            burst = k is not None and (k == 1 or (mode == "burst" and (r + 1) % k == 0))
            bg = send(tag, own, prev, bg, burst)
            sent = [bg]
            if lazy and lazy_sync_due(r, tau):
                for j, msg in enumerate(lazy):      # behind the round's own, on the same thread
                    bg = send(f"{tag}/lazy{j}", msg, prev, bg, k == 1)
                    sent.append(bg)
            waits_own = not o.get("pipelined", True) or (burst and o.get("blocking_correction", False))
            wait = sent if waits_own else in_flight
            if wait or waits_own:
                prev = st.compute(f"s{s}/outer step + rebase", 2 * st.p.optimizer_s, [prev, *wait])
            in_flight = [] if waits_own else sent
            apply_at = s + a if a is not None and not waits_own and a < H else None
            r += 1
        ends.append(prev)
    return ends


def _cp_diloco_h(o: dict) -> int:
    """cp-diloco's H (``"auto"`` is resolved by :func:`_cp_diloco_fit` before this is asked)."""
    H = o.get("sync_every", 16)
    if H == "auto":
        raise ValueError("cp-diloco: sync_every='auto' must be resolved against a cluster first")
    return max(1, int(H))


def _cp_diloco_fit(prof: Profile, cluster: Cluster, o: dict) -> dict:
    """``sync_every="auto"`` as the algorithm's rule decides it in a run
    (:class:`lowband.algorithms.cp_diloco.SyncFitController`), from the model's own times: C, one
    local step alone, and M, one round's message alone (an unpipelined one-step round less that
    step and the outer step); H = ceil(M / (0.8 share C)) within [min_sync_every,
    max_sync_every] (share: :func:`lowband.algorithms.cp_diloco.fit_share`), and ``apply_after``
    raised to ceil(M / (0.8 C)). With ``lazy_layers`` M is the round's own message plus the
    lazy messages' time over tau (:func:`cp_diloco_tau`): the link's mean load per round. (A
    run's rule reads the median of its last ``MESSAGE_WINDOW`` = 3 message times, a lazy
    round's counted with its lazy messages, which for tau >= 3 is the round's own message alone:
    there its H can be smaller than the model's.)"""
    o = _coerced("cp-diloco", o)
    if o.get("sync_every", 16) != "auto":
        return o
    lo, hi = int(o.get("min_sync_every", 1)), int(o.get("max_sync_every", 64))

    def one_step(opts: dict) -> float:
        st = _Step(prof, cluster)
        end = _cp_diloco(st, {**o, **opts}, 1)[-1]
        st.g.run()
        return st.g.tasks[end].end

    step = one_step({"sync_every": 1 << 30})
    outer = 2 * prof.optimizer_s * cluster.compute_scale
    if _lazy_spec(o) is None:
        message = max(0.0, one_step({"sync_every": 1, "pipelined": False}) - step - outer)
    else:
        # lazy_layers: the round's own message, plus the lazy group's amortised over its tau rounds
        tau = cp_diloco_tau(o)
        message = max(0.0, one_step({"sync_every": 1, "pipelined": False, "lazy_every": 1 << 30}) - step - outer)
        both = max(0.0, one_step({"sync_every": 1, "pipelined": False, "lazy_every": 1}) - step - outer)
        message += max(0.0, both - message) / float(tau)
    rule = SyncFitController(lo, hi, share=fit_share(bool(o.get("pipelined", True)), o.get("apply_after")))
    need = rule.steps_needed(message, step) or 1
    out = {**o, "sync_every": rule.decide(lo, message, step)}
    if o.get("apply_after") is not None:         # raised to the steps the message needs, as in a run
        out["apply_after"] = max(int(o["apply_after"]), need)
    return out


def _cp_diloco_cycle(o: dict) -> float:
    """cp-diloco's pattern: one round, k rounds with the burst correction, or with
    ``lazy_layers`` the rounds in which the lazy group's syncs repeat (tau's numerator: tau
    rounds for an integer tau, 5 for a mean tau of 2.5)."""
    H, k = float(_cp_diloco_h(_coerced("cp-diloco", o))), o["correction_every"]
    if o["correction"] == "burst" and k is not None:
        return H * k
    return H * cp_diloco_tau(o).numerator if _lazy_spec(o) is not None else H


def _cp_diloco_lead(o: dict) -> float:
    """cp-diloco's lead-in: six of its cycles without the lazy group (its pipeline fills over
    rounds), and with ``lazy_layers`` one whole cycle of the lazy group's tau rounds beyond them
    (not six: at H = 64 and tau = 16 that would be 6144 steps)."""
    cycle = _cp_diloco_cycle(o)
    base = _cp_diloco_cycle({**o, "lazy_layers": None})
    return 6 * base + (cycle if cycle != base else 0.0)


def fragment_groups(prof: Profile, count: int) -> list[list[int]]:
    """Parameter indices of Streaming DiLoCo's ``count`` fragments, by the rule of
    :func:`lowband.algorithms.peers.diloco.split_fragments` (contiguous runs in registration order of
    about equal elements: one large layer makes its fragment large)."""
    from ..algorithms.peers.diloco import split_fragments
    return split_fragments(prof.sized_params(), count)


def _barrier(st: _Step, name: str, deps) -> int:
    """A synchronous round trip every replica must join (torchft's quorum and commit vote):
    no payload, one request and one reply at the link's per-message latency, plus the cost of
    the ranks meeting (``Cluster.sync_s``); nothing with a single replica."""
    return st.comm(name, 2 * st.net.latency_s if st.N > 1 else 0.0, 0.0, deps)


def _streaming_diloco(st: _Step, o: dict, steps: int) -> list[int]:
    """Local steps; fragment j (in turn) is all-reduced every ``sync_every / fragments`` steps:
    launched after the optimizer of the step ``fragment_sync_delay`` steps before the one that
    merges it, whose end waits for it and for an outer optimizer step on the fragment (its
    share of ``optimizer_s``). As torchft 0.2.0 runs it: the launch waits for a synchronous
    quorum of every replica, the fragment goes as one all-reduce per parameter
    (``use_bucketization=False``, each call paying its own messages' latency), and the merge
    waits for a commit vote of every replica (:func:`_barrier`)."""
    from ..algorithms.peers.diloco import StreamingDiLoCo, fragment_count
    H, delay = max(1, int(o["sync_every"])), max(0, int(o["fragment_sync_delay"]))
    fragments = None if o["fragments"] is None else int(o["fragments"])
    count = fragment_count(fragments, StreamingDiLoCo.AUTO_FRAGMENTS, len(st.p.params), H, delay)
    period = max(1, H // count)
    groups = fragment_groups(st.p, count)
    total = float(st.p.gradient_bytes) or 1.0
    ends, prev, pending, launched = [], None, {}, 0
    for s in range(steps):
        _, _, b = st.forward_backward(s, [prev])
        prev = st.compute(f"s{s}/optimizer", st.p.optimizer_s, [b])
        prev = st.engine_overhead(s, "streaming-diloco", 0.0, prev) or prev
        if (s + 1 + delay) % period == 0:          # quorum, then the next fragment's all-reduces
            j = launched % count
            prev = _barrier(st, f"s{s}/fragment {j} quorum", [prev])
            # queued back to back behind the quorum, which the ranks have just met at
            calls = [st.allreduce(f"s{s}/fragment {j}/{st.p.params[i].name}", float(st.p.params[i].nbytes), [prev],
                                  meet=False) for i in groups[j]]
            pending[s + delay] = (calls, st.nbytes(groups[j]))
            launched += 1
        if s in pending:                           # merge: wait for it, vote, outer step on the fragment
            calls, nb = pending.pop(s)
            vote = _barrier(st, f"s{s}/commit vote", [prev, *calls])
            prev = st.compute(f"s{s}/outer optimizer", st.p.optimizer_s * nb / total, [vote])
        ends.append(prev)
    return ends


@dataclass(frozen=True)
class AlgorithmModel:
    build: Builder
    cycle: Callable[[dict], float]      # steps per period of the step pattern
    how: str                            # what is modelled, and how approximately
    #: whole cycles of the default lead-in (a pipeline one cycle deep fills its backlog over
    #: several of its cycles when its message only just fits behind one)
    lead_cycles: int = 1
    #: steps of the default lead-in where it is not whole cycles (None: ``lead_cycles`` cycles)
    lead: Optional[Callable[[dict], float]] = None


def _one(_o: dict) -> float:
    return 1.0


def _cpsgd_cycle(o: dict) -> float:
    """CP-SGD's pattern: the burst correction's k steps; the spread correction (the default)
    sends the same bytes every step, so its steps are all alike (as ``ssgd``'s). ``o`` holds
    every knob (:func:`pattern_steps`)."""
    if o["correction"] == "burst":
        return float(o["correction_period"] or 1)
    return 1.0


MODELS: dict[str, AlgorithmModel] = {
    "noop": AlgorithmModel(_noop, _one, "exact structure: forward, backward, optimizer"),
    "ssgd": AlgorithmModel(_ssgd, _one, "bucketed ring all-reduce overlapped with backward (BucketSet rule); the engine's "
                                       "finiteness exchange beside the last buckets"),
    "ddp": AlgorithmModel(_ddp, _one, "DDP Reducer buckets (bucket_cap_mb) overlapped with backward; buffer broadcast; "
                                     "the finiteness exchange after them"),
    "ddp-fp16": AlgorithmModel(lambda st, o, s: _ddp(st, o, s, "ddp-fp16"), _one,
                               "as ddp with fp16 bytes; the casts approximated from the fp16 codec's speed"),
    "ddp-powersgd": AlgorithmModel(_ddp_powersgd, _one,
                                   "3 chained all-reduces after backward, the finiteness exchange after "
                                   "them; matmul phases measured (else lowband's powersgd codec)"),
    "compressed": AlgorithmModel(_compressed, _one,
                                 "steady state after warm-up; codec chain on one background thread; fp32 1-D buckets"),
    "cpsgd": AlgorithmModel(_cpsgd, _cpsgd_cycle, "depth-1 pipeline, burst or spread "
                            "correction; local update cost as a multiple of the optimizer step"),
    "cp-diloco": AlgorithmModel(_cp_diloco, _cp_diloco_cycle,
                                "local steps; one message per round (compressed, spread share, 1-D "
                                "parameters and sparse_rows' packed row flags fp32 inside; burst rounds fp32) "
                                "on the background thread, waited for one round later (pipelined) or at once; "
                                "lazy_layers' own message behind it every tau rounds (tau given, or a mean for "
                                "'auto')", lead_cycles=6, lead=_cp_diloco_lead),
    "lazy": AlgorithmModel(_lazy, lambda o: float(o.get("tau", DEFAULT_TAU)),
                           "regular buckets overlapped; lazy fused all-reduce every tau steps (tau given)"),
    "localsgd": AlgorithmModel(lambda st, o, s: _periodic_average(st, o, s, "period", False, "localsgd"),
                               lambda o: float(o["period"]), "parameter all-reduce every period steps"),
    "diloco": AlgorithmModel(lambda st, o, s: _periodic_average(st, o, s, "sync_every", True, "diloco"),
                             lambda o: float(o["sync_every"]),
                             "as localsgd plus an outer optimizer step"),
    "streaming-diloco": AlgorithmModel(
        _streaming_diloco, lambda o: float(max(1, int(o["sync_every"]))),
        "the fragments of lowband's split (contiguous parameters, about equal elements), one every "
        "sync_every/fragments steps in turn, launched fragment_sync_delay steps before the step that "
        "merges it waits for it, plus an outer step on the fragment"),
}


def algorithm_defaults(name: str) -> dict[str, Any]:
    """The knobs' defaults of the registry's algorithm ``name`` (empty when it has none), so
    the model follows the code's defaults (bucket size, correction period, correction kind...)."""
    import dataclasses
    from ..algorithms import ALGORITHMS
    cls = ALGORITHMS.get(name)
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def pattern_steps(algorithm: str, options: Optional[dict[str, Any]] = None) -> int:
    """Steps per period of ``algorithm``'s step pattern (``AlgorithmModel.cycle``, knobs not in
    ``options`` at the registry's defaults): any that many consecutive steps hold each kind of
    step once (a burst correction, a local-SGD average, a lazy sync); 1 where every step is
    alike (``ssgd``, CP-SGD's spread correction). What :func:`estimate` simulates in whole
    periods and what the validation measures in blocks of."""
    return _period(algorithm, _knobs(algorithm, options))


def _knobs(algorithm: str, options: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Every knob of a modelled ``algorithm``: ``options`` over the registry's defaults."""
    if algorithm not in MODELS:
        raise ValueError(f"no performance model for algorithm {algorithm!r}; modelled: {', '.join(sorted(MODELS))}")
    return {**algorithm_defaults(algorithm), **(options or {})}


def _period(algorithm: str, knobs: dict[str, Any]) -> int:
    return max(1, int(math.ceil(MODELS[algorithm].cycle(knobs))))


def resolved_options(prof: Profile, algorithm: str, options: Optional[dict[str, Any]], cluster: Cluster
                     ) -> dict[str, Any]:
    """Every knob of ``algorithm`` as :func:`estimate` models it on ``cluster``: ``options``
    over the registry's defaults, with cp-diloco's ``sync_every="auto"`` (and ``apply_after``)
    resolved as its rule would decide them (:func:`_cp_diloco_fit`)."""
    o = _knobs(algorithm, options)
    return _cp_diloco_fit(prof, cluster, o) if algorithm == "cp-diloco" else o


def estimate(prof: Profile, algorithm: str, options: Optional[dict[str, Any]], cluster: Cluster,
             cycles: int = 2, max_steps: int = 400, lead_in: Optional[int] = None) -> StepEstimate:
    """Steady-state mean step time of ``algorithm`` on ``cluster``: simulate a lead-in of
    ``lead_in`` steps (default: :data:`LEAD_IN_STEPS`, at least ``lead_cycles`` whole cycles or
    the model's own ``lead``), then
    ``cycles`` whole cycles (at least 4 steps), and average the steps after the lead-in. Knobs
    not in ``options`` take the registry algorithm's defaults."""
    o = resolved_options(prof, algorithm, options, cluster)
    cycle = _period(algorithm, o)
    m = MODELS[algorithm]
    default = cycle * m.lead_cycles if m.lead is None else int(math.ceil(m.lead(o)))
    lead = max(LEAD_IN_STEPS, default) if lead_in is None else max(1, int(lead_in))
    measured = max(cycle * cycles, 4)
    if lead + measured > max_steps:          # a long period: fewer, but whole, cycles
        measured = max(cycle, (max_steps - lead) // cycle * cycle)
    st = _Step(prof, cluster)
    ends = m.build(st, o, lead + measured)
    st.g.run()
    t = [st.g.tasks[e].end for e in ends]
    step = (t[-1] - t[lead - 1]) / measured
    # work per step: totals over the tasks of the measured steps (task names start "s<step>/")
    compute = codec = net = sent = 0.0
    for i, task in enumerate(st.g.tasks):
        if lead <= int(task.name[1:task.name.index("/")]) < lead + measured:
            if i in st.codec_tasks:
                codec += task.duration
            elif i in st.comm_cpu_tasks:
                continue
            elif task.resource == "compute":
                compute += task.duration
            elif task.resource == "net":
                net += task.end - task.start     # a token bucket may have shortened it
                sent += st.wire.get(i, 0.0)
    return StepEstimate(algorithm, cluster.workers, step, compute / measured, codec / measured, net / measured,
                        sent / measured)
