"""The compressed reducer: averaging of flat fp32 buckets through a codec, on an ordered pipeline.

:class:`CompressedReducer` is what the compressing algorithms hold (``self.reducer``): it
averages flat fp32 buckets through a codec with error feedback, on the pipeline (``start``,
``start_full_precision``, handles with ``wait``/``done``/``present``, ``state_dict`` keyed by
parameter name). It owns the residuals
(one flat tensor per bucket for the workers, one per bucket for this rank's server chunks),
the exact ranges and the residual flushes; the byte flow is the collective's plan
(:mod:`lowband.comm.plans`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .. import _native as kernels
from ..codecs import Compressor, ErrorFeedback
from ..codecs.bucket import Segments, Sources
from .communicator import Communicator
from .pipeline import Handle, Pipeline
from .plans import Plan, make_plan, resolve_collective


@dataclass
class _Bucket:
    """Per-bucket state of the reducer: its plan, residuals and exact segments (``fixed``: bool
    per segment, or None)."""

    segments: list[tuple[str, int]]
    plan: Plan
    e_worker: Optional[torch.Tensor]
    e_server: Optional[torch.Tensor]
    fixed: Optional[np.ndarray] = None


def _check_segments(tensor: torch.Tensor, name: str, segments: Optional[Segments]) -> list[tuple[str, int]]:
    segs = [(name, tensor.numel())] if segments is None else [(str(s), int(n)) for s, n in segments]
    if sum(n for _, n in segs) != tensor.numel():
        raise ValueError(f"segments of {name!r} cover {sum(n for _, n in segs)} elements, tensor has {tensor.numel()}")
    return segs


def _present(present: Optional[torch.Tensor], count: int) -> Optional[torch.Tensor]:
    """A flat bool copy of ``present`` on its own device (no host sync: on CUDA the flags are
    read back by the pipeline's thread, :func:`_host_flags`)."""
    if present is None:
        return None
    if present.numel() != count:
        raise ValueError(f"present has {present.numel()} entries for {count} segments")
    return present.detach().reshape(-1).to(torch.bool, copy=True)


def _present_for_job(present: Optional[torch.Tensor], count: int) -> "Optional[torch.Tensor | np.ndarray]":
    """:func:`_present` for a compressed job: on the CPU already the numpy array the job reads
    (made on the caller's thread, not on the pipeline's cold one); on CUDA the device copy."""
    flags = _present(present, count)
    return flags.numpy() if flags is not None and flags.device.type == "cpu" else flags


def _host_flags(present: "Optional[torch.Tensor | np.ndarray]") -> Optional[np.ndarray]:
    """``present`` as a numpy bool array (on CUDA, a read-back on the pipeline's thread: the
    flags decide on the host which chunks are coded)."""
    if present is None or isinstance(present, np.ndarray):
        return present
    return present.cpu().numpy()


def _sources_for_job(flat: torch.Tensor, segs: list[tuple[str, int]], sources: Sources,
                     fixed: Optional[np.ndarray], exact_range: bool) -> Optional[list]:
    """:meth:`CompressedReducer.start`'s ``sources`` as the job reads them: a new list (the
    caller may reuse its own), each entry a flat view of its tensor (checked against its
    segment's size) or None. The sources of ``fixed`` segments, and all of them when an exact
    range is sent (it may cross any segment), are copied into ``flat``: the exact values are
    read from there; so are sources that are not contiguous (no flat view of them). None when
    nothing is left outside ``flat``."""
    if len(sources) != len(segs):
        raise ValueError(f"sources has {len(sources)} entries for {len(segs)} segments")
    out, offset, outside = [], 0, False
    for s, ((seg, n), t) in enumerate(zip(segs, sources)):
        if t is not None:
            if t.numel() != n:
                raise ValueError(f"source of segment {seg!r} has {t.numel()} elements, expected {n}")
            t = t.detach()
            if exact_range or (fixed is not None and fixed[s]) or not t.is_contiguous():
                flat[offset:offset + n].copy_(t.reshape(-1))
                t = None
            else:
                t = t.view(-1)          # the job may write the average back into it (in_place)
        outside |= t is not None
        out.append(t)
        offset += n
    return out if outside else None


class CompressedReducer:
    """Compressed averaging of flat fp32 buckets on an ordered pipeline (module docstring).

    Args:
        kind: ``two-stage``, ``allgather`` or ``auto`` (:func:`resolve_collective` picks by
            the group's size; ``name`` is the one used).
        comm: the caller's counted communicator (its group's ranks take part, its stats get
            the bytes and the exposed wait time).
        codec: the worker codec (the codec itself: the reducer keeps the residuals).
        error_feedback: keep a worker residual per bucket (one flat fp32 tensor, saved and
            restored per parameter name) and add it to the next contribution; without it
            biased codecs lose what they drop. Two-stage's owner side always keeps one.
        server_codec: two-stage's owner-side codec (default: a fresh copy of the worker codec).
        pipeline: share an existing pipeline (default: a new one).
    """

    def __init__(self, kind: str, comm: Communicator, codec: Compressor, error_feedback: bool = True,
                 server_codec: Optional[Compressor] = None, pipeline: Optional[Pipeline] = None) -> None:
        for c in (codec, server_codec):
            if isinstance(c, ErrorFeedback):
                raise ValueError("the compressed reducer takes the codec itself and keeps the residuals: pass "
                                 f"{c.inner!r} and error_feedback=True, not {c!r}")
        self.name = resolve_collective(kind, comm.world_size)
        self.comm = comm
        self.error_feedback = bool(error_feedback)
        self.codec = codec
        self.server_codec = copy.deepcopy(self.codec) if server_codec is None else server_codec
        self.world_size, self.rank = comm.world_size, comm.rank
        self.pipeline = pipeline if pipeline is not None else Pipeline(comm, kind)
        self._owns_pipeline = pipeline is None
        self._buckets: dict[str, _Bucket] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {"worker": {}, "server": {}}

    # -- buckets -------------------------------------------------------------------------
    def _bucket(self, name: str, segments: list[tuple[str, int]], device: torch.device,
                fixed: Optional[np.ndarray] = None) -> _Bucket:
        b = self._buckets.get(name)
        if b is not None:
            if b.segments != segments:
                raise ValueError(f"bucket {name!r} was started with other segments before")
            if (b.fixed is None) != (fixed is None) or (fixed is not None and b.fixed.tobytes() != fixed.tobytes()):
                raise ValueError(f"bucket {name!r} was started with other exact_segments before")
            return b
        plan = make_plan(self.name, self.world_size, self.rank, segments, self.codec, self.server_codec)
        e_worker = torch.zeros(plan.numel, dtype=torch.float32, device=device) if self.error_feedback else None
        e_server = torch.zeros(plan.server_numel, dtype=torch.float32, device=device) if plan.server_numel else None
        b = _Bucket(segments, plan, e_worker, e_server, fixed)
        self._buckets[name] = b
        self._restore(b)
        return b

    def _views(self, b: _Bucket, which: str) -> dict[str, torch.Tensor]:
        """Per-parameter views of a bucket's worker or server residual (exact segments have none)."""
        e = b.e_worker if which == "worker" else b.e_server
        if e is None:
            return {}
        lay = b.plan.layout if which == "worker" else b.plan.server_layout
        fixed = b.fixed if b.fixed is not None else np.zeros(lay.segments, dtype=bool)
        return {n: e[int(o):int(o) + int(k)] for n, o, k, f in zip(lay.names, lay.seg_off, lay.numel, fixed) if not f}

    def _restore(self, b: _Bucket) -> None:
        for which in ("worker", "server"):
            for n, view in self._views(b, which).items():
                saved = self._pending[which].pop(n, None)
                if saved is None:
                    continue
                if saved.numel() != view.numel():
                    raise ValueError(f"saved {which} residual of {n!r} has {saved.numel()} elements, expected "
                                     f"{view.numel()} (a different model or, for the server, world size)")
                view.copy_(saved.reshape(-1))

    # -- what the algorithms call ----------------------------------------------------------
    def reads_sources(self, device: torch.device) -> bool:
        """Whether :meth:`start`'s ``sources`` on ``device`` are read where they are (native
        encoders that take run addresses, for this codec on the CPU) rather than copied into
        the bucket on the pipeline's thread (correct either way; the caller's copy, during
        backward, is then as good)."""
        return device.type == "cpu" and self.codec.kernel_kind is not None and \
            kernels.library_having("has_sources") is not None

    def start(self, tensor: torch.Tensor, name: str, segments: Optional[Segments] = None, *,
              exact: Optional[tuple[int, int]] = None, flush_exact: bool = False,
              present: Optional[torch.Tensor] = None, exact_segments: Optional[Sequence[bool]] = None,
              copy: bool = True, check_finite: bool = False, inline: bool = False,
              in_place: bool = False, sources: Optional[Sources] = None) -> Handle:
        """Average flat fp32 ``tensor`` through the codec with error feedback, on the queue.
        ``exact=(lo, hi)``: those elements are averaged exactly in fp32 instead (codes 0,
        residual untouched unless ``flush_exact``: then it is added and zeroed).
        ``exact_segments``: bool per segment, the same at every call for a bucket: those
        segments are always averaged exactly in fp32 and keep no residual (1-D parameters).
        Exact values travel in the bucket's own message where the collective carries them at
        fp32 all-reduce cost (``Plan.inline_exact``), else in an fp32 all-reduce beside it.
        ``present``: bool per segment, whether this rank produced it (absent segments: zeros,
        residual untouched). The tensor is copied before ``start`` returns unless ``copy`` is
        False: then the caller leaves it untouched until the handle is waited for.
        ``check_finite``: test each segment for NaN/Inf on the queue and mark the bad ones in
        the message (no extra bytes); the handle's ``nonfinite`` then says, per rank, which
        segments were bad (the engine's finiteness decision rides on the bucket).
        ``inline``: the caller waits for this bucket before starting anything else; run it on
        the waiting thread if nothing else is in flight then (:meth:`Pipeline.submit`).
        ``in_place`` (with ``copy=False``, a contiguous fp32 ``tensor``): the average is written
        where the values were read: into ``tensor`` itself, which the handle then returns
        flattened, and into the ``sources`` of the segments that have one (no new output and no
        copy for a caller whose gradients may alias its bucket or be the sources,
        ``BucketSet.write_gradients``).
        ``sources`` (with ``copy=False``; one entry per segment): segments whose values are not
        in ``tensor`` but in a tensor of their own (None: in ``tensor``), read where they are by
        the native encoders (a gradient is not copied into the bucket,
        ``BucketSet.by_reference``); the caller leaves them untouched until the handle is waited
        for. Exact segments, an ``exact`` range and sources that are not contiguous take their
        values from ``tensor``: those sources are copied into it here. The handle's ``targets``
        says which segments' averages went into their own tensors (``in_place``)."""
        segs = _check_segments(tensor, name, segments)
        if in_place and (copy or tensor.dtype != torch.float32 or not tensor.is_contiguous()):
            raise ValueError("in_place needs copy=False and a contiguous fp32 tensor, got "
                             f"copy={copy}, {tensor.dtype}, contiguous={tensor.is_contiguous()}")
        lo, hi = (0, 0) if exact is None else (int(exact[0]), int(exact[1]))
        if not (0 <= lo <= hi <= tensor.numel()):
            raise ValueError(f"exact range {exact} outside a tensor of {tensor.numel()} elements")
        fixed = None
        if exact_segments is not None:
            fixed = np.asarray([bool(x) for x in exact_segments], dtype=bool)
            if fixed.size != len(segs):
                raise ValueError(f"exact_segments has {fixed.size} entries for {len(segs)} segments")
            if not fixed.any():
                fixed = None          # nothing exact: the same bucket as without exact_segments
        flat = tensor.detach().reshape(-1)
        snapshot = flat.to(torch.float32, copy=True) if copy or flat.dtype != torch.float32 else flat
        if sources is not None:
            if copy:
                raise ValueError("sources need copy=False (the job reads them where they are)")
            sources = _sources_for_job(snapshot, segs, sources, fixed, hi > lo)
        handle = self.pipeline.submit(self._run, name, segs, snapshot, _present_for_job(present, len(segs)), lo, hi,
                                      flush_exact, fixed, check_finite, in_place, sources, inline=inline)
        handle.targets = sources if in_place else None
        return handle

    def _run(self, name, segs, g, present, lo, hi, flush_exact, fixed, check_finite=False, in_place=False,
             sources=None):
        flags = _host_flags(present)
        b = self._bucket(name, segs, g.device, fixed)
        comm = self.pipeline.comm
        # the exact values ride in the bucket's message where the plan carries them at fp32
        # all-reduce cost; else the share goes in an fp32 all-reduce beside it
        inline = b.plan.inline_exact
        exact_work, ex = None, None
        if hi > lo and not inline:
            ex = b.plan.exact_spans(lo, hi, flush_exact, None).gather(g, b.e_worker)
            exact_work = comm.all_reduce(ex, op=dist.ReduceOp.AVG, async_op=True)
        spans = b.plan.exact_spans(lo, hi if inline else lo, flush_exact, b.fixed)
        out, present, nonfinite = b.plan.run(comm, g, b.e_worker, b.e_server, flags, lo, hi,
                                             spans if spans.count else None, b.fixed, check_finite,
                                             out=g if in_place else None, sources=sources,
                                             targets=sources if in_place else None)
        if exact_work is not None:
            exact_work.wait()
            out[lo:hi] = ex
        return out, torch.from_numpy(present), nonfinite

    def start_full_precision(self, tensor: torch.Tensor, name: str, segments: Optional[Segments] = None, *,
                             flush_residuals: bool = False, present: Optional[torch.Tensor] = None,
                             inline: bool = False) -> Handle:
        """fp32 average of the whole tensor on the same queue. With ``flush_residuals`` every
        segment's worker residual (and this rank's server residual, times N because the
        all-reduce averages) is added to the contribution and zeroed. ``inline`` as for
        :meth:`start`."""
        segs = _check_segments(tensor, name, segments)
        flags = _present(present, len(segs))
        n = tensor.numel()
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if flags is None:
            buf = flat.clone()
        else:
            buf = torch.empty(n + len(segs), dtype=torch.float32, device=flat.device)
            buf[:n] = flat
            buf[n:] = flags.to(torch.float32)
        return self.pipeline.submit(self._run_full, name, segs, buf, n, flags is not None, flush_residuals,
                                    inline=inline)

    def _run_full(self, name, segs, buf, n, with_flags, flush):
        if flush:
            b = self._buckets.get(name)
            if b is not None:
                self._flush(b, buf[:n])
        self.pipeline.comm.all_reduce(buf, op=dist.ReduceOp.AVG)
        present = buf[n:] > 0 if with_flags else torch.ones(len(segs), dtype=torch.bool)
        return buf[:n], present.cpu()      # on CUDA a read-back on this thread: who gets a gradient

    def _flush(self, b: _Bucket, into: torch.Tensor, zero: bool = True) -> None:
        """``into += worker residual (+ N * server residual of my chunks)``; both zeroed
        unless ``zero`` is False."""
        if b.e_worker is None and b.e_server is None:
            return
        total = b.e_worker.clone() if b.e_worker is not None else torch.zeros_like(into)
        if b.e_server is not None:
            bucket_idx, server_idx = b.plan.mine_index(into.device)
            total.index_add_(0, bucket_idx, b.e_server[server_idx], alpha=self.world_size)
            if zero:
                b.e_server.zero_()
        into.add_(total)
        if b.e_worker is not None and zero:
            b.e_worker.zero_()

    def add_residuals(self, name: str, into: torch.Tensor, zero: bool) -> None:
        """On the calling thread, what ``start_full_precision(..., flush_residuals=True)`` adds
        to bucket ``name``'s contribution: ``into += worker residual (+ N * server residual of
        my chunks)``, zeroing them when ``zero``. Only while no job of that bucket is queued or
        running (nothing when the bucket was never started)."""
        b = self._buckets.get(name)
        if b is not None:
            self._flush(b, into, zero)

    def worker_residual(self, name: str) -> Optional[torch.Tensor]:
        """The live flat worker residual of bucket ``name`` (None: no such bucket yet, or no
        error feedback). Read it only while no job of that bucket is queued or running."""
        b = self._buckets.get(name)
        return None if b is None else b.e_worker

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals keyed by parameter name (taken after every queued job finished)."""
        return self.pipeline.call(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": self.world_size, "codec": self.codec.state_dict(),
                               "server_codec": self.server_codec.state_dict()}
        for which in ("worker", "server"):
            d = {n: v.detach().clone() for n, v in self._pending[which].items()}
            for b in self._buckets.values():
                d.update({n: v.detach().clone() for n, v in self._views(b, which).items()})
            out[which] = d
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipeline.call(self._load_state_dict, state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"world_size", "codec", "server_codec", "worker", "server"}
        if unknown:
            raise ValueError(f"compressed reducer: unknown state keys {sorted(unknown)}")
        self._pending = {w: {str(k): v.detach().to(torch.float32) for k, v in state.get(w, {}).items()}
                         for w in ("worker", "server")}
        if self._pending["server"] and int(state.get("world_size", self.world_size)) != self.world_size:
            raise ValueError(f"server residuals were saved at world size {state.get('world_size')}, "
                             f"this run has {self.world_size}")
        self.codec.load_state_dict(state.get("codec", {}))
        self.server_codec.load_state_dict(state.get("server_codec", {}))
        for b in self._buckets.values():
            for e in (b.e_worker, b.e_server):
                if e is not None:
                    e.zero_()
            self._restore(b)

    def close(self) -> None:
        if self._owns_pipeline:
            self.pipeline.close()


def make_reducer(kind: str, comm: Communicator, codec: Compressor, error_feedback: bool = True,
                 pipeline: Optional[Pipeline] = None) -> CompressedReducer:
    """The compressed reducer of collective ``kind`` (``two-stage``, ``allgather`` or ``auto``)
    through ``codec``, with a worker residual per bucket unless ``error_feedback`` is False."""
    return CompressedReducer(kind, comm, codec, error_feedback, pipeline=pipeline)
