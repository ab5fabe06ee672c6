"""Compressed averaging collectives: how one bucket's bytes move (no threads, no state).

Ternary 2-bit codes cannot be summed in 2 bits, so the collective that moves compressed
payloads is an explicit choice:

* :class:`AllgatherPlan` — every rank all-gathers every rank's packed payload, decodes each and
  sums them in rank order. The result is exactly the sum of the individually decoded payloads
  (what MXNet's parameter server computes), identical on every rank. O(N) bytes per rank.
* :class:`TwoStagePlan` — DeepSpeed-style compressed all-reduce. Every segment is cut into N
  equal chunks (zero-padded); an ``all_to_all`` sends chunk i of every segment to rank i, which
  decodes the N versions, averages them, re-compresses the average with its *server-side*
  error feedback and ``all_gather``s it. O(1) bytes per rank in N.

A plan is built once per bucket (its layouts and decode tables, :mod:`lowband.codecs.bucket`)
and ``run`` is one synchronous exchange with O(1) Python calls whatever the number of segments
and ranks: one codec call encodes the bucket, one decodes and averages the N versions, one
re-compresses, one decodes the result. Residuals are owned by the caller (the reducer in
:mod:`lowband.comm.reducer`, which also owns the exact ranges and flushes, on the ordered queue of
:mod:`lowband.comm.pipeline`).

Present flags (one byte per segment: did this rank produce that gradient) travel in every
section, so each rank learns after the first exchange which segments any rank produced;
segments absent on this rank are encoded as zeros with their residual untouched, and globally
absent ones are not re-compressed by the server either. The same byte carries a second bit,
``NONFINITE_FLAG``: this rank's gradient of that segment held a NaN or Inf. Since every rank
receives every rank's flag bytes in the first exchange (all-gather rows, all_to_all rows: one
per source rank), every rank learns who sent a bad segment at no extra bytes and no collective
of its own (the engine's finiteness decision rides on the message: :mod:`lowband.engine.guard`).
"""
from __future__ import annotations

import copy
import functools
from typing import Optional

import numpy as np
import torch

from .. import _native as kernels
from ..codecs import Compressor
from ..codecs.bucket import (BucketCodec, ChunkedLayout, ExactSpans, Segments, Sources, Targets, _ChunkFormat,
                             mean_rows, skip_ranges)
from .communicator import Communicator
from .finite import all_finite

COLLECTIVES = ("allgather", "two-stage")
#: what an algorithm's ``collective`` knob accepts: a collective, or ``auto``
COLLECTIVE_CHOICES = ("auto", *COLLECTIVES)
#: ``auto`` takes ``allgather`` up to this many ranks (see :func:`resolve_collective`)
AUTO_ALLGATHER_MAX_WORLD = 4
#: bit of a segment's flag byte: present (this rank produced the gradient)
PRESENT_FLAG = 1
#: bit of a segment's flag byte: this rank's gradient of the segment was not finite
NONFINITE_FLAG = 2
#: skip tables and exact-span tables a plan keeps (``Plan.worker_skip``, ``Plan.exact_spans``);
#: more distinct ones empty the cache
SKIP_CACHE = 64


def _cached(cache: dict, key, build):
    """``cache[key]``, built by ``build()`` on a miss; a full cache (``SKIP_CACHE``) is emptied first."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= SKIP_CACHE:
            cache.clear()
        found = cache[key] = build()
    return found


def resolve_collective(kind: str, world_size: int, allgather_max_world: int = AUTO_ALLGATHER_MAX_WORLD) -> str:
    """``auto`` -> ``allgather`` for world sizes up to ``allgather_max_world`` (default
    ``AUTO_ALLGATHER_MAX_WORLD``), else ``two-stage``; a named collective is returned as is.

    Why: allgather's result is the exact sum of the decoded payloads (one quantization, what
    MXNet's parameter server computes), two-stage re-quantizes the owners' averages (two).
    Its compressed bytes per rank are (N-1) payloads against two-stage's 2(N-1)/N, i.e.
    N/2 times as many: equal at 2 ranks, twice at 4, and growing with N beyond. Up to 4 ranks
    allgather is the more accurate and takes less CPU per step (one codec pass and one
    collective fewer; docs/cpsgd.md)."""
    if kind == "auto":
        return "allgather" if world_size <= allgather_max_world else "two-stage"
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; choose one of: {', '.join(COLLECTIVE_CHOICES)}")
    return kind


def _flag_library(buf: torch.Tensor):
    """The native library when it has the flag functions and ``buf`` is a contiguous CPU byte
    buffer: one call instead of numpy views, which are slow on the pipeline's cold thread."""
    if buf.device.type != "cpu" or not buf.is_contiguous():
        return None
    return kernels.library_having("has_flags")


@functools.lru_cache(maxsize=64)
def _clean_flags(segments: int) -> np.ndarray:
    """The flag bytes of a rank that produced every segment, all finite (read-only)."""
    byte = np.full(segments, PRESENT_FLAG, dtype=np.uint8)
    byte.flags.writeable = False
    return byte


def _write_flags(buf: torch.Tensor, layout: ChunkedLayout, flags: Optional[np.ndarray],
                 nonfinite: Optional[np.ndarray] = None) -> None:
    """Put this rank's present flags (and ``nonfinite``: bool per segment, its bad segments)
    into the flag bytes of every section of ``buf`` (sections back to back,
    ``layout.section`` bytes each; the bytes after the segments' are zeroed)."""
    S = layout.segments
    if flags is None and nonfinite is None:
        byte = _clean_flags(S)
    else:
        byte = np.full(S, PRESENT_FLAG, dtype=np.uint8) if flags is None else flags.astype(np.uint8)
        if nonfinite is not None:
            byte |= nonfinite.astype(np.uint8) * np.uint8(NONFINITE_FLAG)
    lib = _flag_library(buf)
    if lib is not None:
        lib.lb_write_flags(buf.data_ptr(), buf.numel() // layout.section, layout.section, layout.flag_off, S,
                           byte.ctypes.data)
        return
    cpu = buf.device.type == "cpu"        # numpy views: a few microseconds against torch's tens
    view = (buf.numpy() if cpu else buf).reshape(-1, layout.section)[:, layout.flag_off:layout.section]
    view[:] = 0
    if S:
        view[:, :S] = byte if cpu else torch.tensor(byte, device=buf.device)


def _read_flags(buf: torch.Tensor, layout: ChunkedLayout, stride: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """From the sections of ``buf`` (``stride`` bytes apart; row r came from rank r), in one
    transfer of their flag bytes: the OR of their present flags (bool per segment) and each
    row's non-finite bits (``[rows, segments]`` bool, None when no row has one)."""
    S = layout.segments
    if not S:
        return np.zeros(0, dtype=bool), None
    off = layout.flag_off
    lib = _flag_library(buf)
    if lib is not None:
        rows = buf.numel() // stride
        present, bad = np.empty(S, dtype=np.uint8), np.empty((rows, S), dtype=np.uint8)
        if not lib.lb_read_flags(buf.data_ptr(), rows, stride, off, S, PRESENT_FLAG, NONFINITE_FLAG,
                                 present.ctypes.data, bad.ctypes.data):
            return np.ones(S, dtype=bool), None
        bad = bad.view(bool)
        return present.view(bool), (bad if bad.any() else None)
    flags = (buf.numpy().reshape(-1, stride)[:, off:off + S] if buf.device.type == "cpu"
             else buf.view(-1, stride)[:, off:off + S].cpu().numpy())
    # the usual case, every row all present and finite, in byte compares (a few microseconds
    # less than the numpy path below, more on the pipeline's thread, whose caches are cold)
    clean = bytes([PRESENT_FLAG]) * S
    if all(row.tobytes() == clean for row in flags):
        return np.ones(S, dtype=bool), None
    bad = (flags & NONFINITE_FLAG) > 0
    return flags.max(0) > 0, (bad if bad.any() else None)


def nonfinite_segments(g: torch.Tensor, layout: ChunkedLayout, sources: Optional[Sources] = None
                       ) -> Optional[np.ndarray]:
    """Bool per segment of flat ``g``: it holds a NaN or Inf; None when all are finite (one
    sum of the whole bucket proves it; only a non-finite sum pays for the per-segment test).
    ``sources``: segments whose values are in tensors of their own (:meth:`BucketCodec.encode`'s),
    tested there, one test per segment. On CUDA the test is read back on the pipeline's thread
    (the marks are host bytes of the message), which stalls that thread until the bucket's
    gradient is computed, not the compute stream."""
    spans = zip(layout.seg_off.tolist(), layout.numel.tolist())
    if sources is None:
        if bool(all_finite(g)):
            return None
        return np.array([not bool(all_finite(g[o:o + n])) for o, n in spans], dtype=bool)
    bad = np.array([not bool(all_finite(g[o:o + n] if t is None else t)) for (o, n), t in zip(spans, sources)],
                   dtype=bool)
    return bad if bad.any() else None


def _skipped_segments(flags: Optional[np.ndarray], fixed: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Segments whose chunks are skipped whole: absent on this rank (``~flags``) or exact
    (``fixed``: they travel in fp32 beside the codes). Read-only: with every segment present
    it is ``fixed`` itself."""
    if flags is None:
        return fixed
    return ~flags if fixed is None else (~flags | fixed)


def _raw_rows(buf: torch.Tensor, rows: int, stride: int, offset: int) -> torch.Tensor:
    """The fp32 values after byte ``offset`` of each of the ``rows`` records of ``stride`` bytes
    in ``buf``: a ``[rows, (stride - offset) / 4]`` float view."""
    return buf[:rows * stride].view(rows, stride)[:, offset:].view(torch.float32)


class Plan:
    """Common part: the worker-side codec over the bucket's layout.

    ``run`` may carry fp32 values beside the codes, in the same message (``exact``, an
    :class:`ExactSpans`): the reducer's exact elements (segments that are never compressed,
    CP-SGD's correction share). They are averaged exactly (the sum in rank order, divided by N)
    and written into the decoded bucket, so an exact share costs no collective of its own. ``inline_exact`` says
    whether a plan carries them at no more bytes than an fp32 ring all-reduce would."""

    name = ""

    def __init__(self, world: int, rank: int, segments: Segments, codec: Compressor, chunks: int, name_of) -> None:
        self.world, self.rank = world, rank
        self.fmt = _ChunkFormat(codec)
        self.worker = BucketCodec(codec, self.fmt, ChunkedLayout.build(segments, chunks, self.fmt), name_of)
        self.layout = self.worker.layout
        self.numel = self.layout.total
        self._buffers: dict[str, torch.Tensor] = {}
        self._skips: dict[tuple, Optional[np.ndarray]] = {}
        self._spans: dict[tuple, ExactSpans] = {}

    def _buffer(self, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """A reused per-plan byte buffer of at least ``nbytes``, sliced to ``nbytes`` (one job runs
        at a time per plan: the pipeline's thread)."""
        buf = self._buffers.get(key)
        if buf is None or buf.device != device or buf.numel() < nbytes:
            buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            self._buffers[key] = buf
        return buf[:nbytes]

    def worker_skip(self, lo: int, hi: int, absent: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """The encode's skip table (:func:`skip_ranges`) for the exact range ``[lo, hi)`` and the
        ``absent`` segments, cached: a bucket repeats the same few from step to step (its fixed
        1-D segments; CP-SGD's k spread shares), and building one is a noticeable part of the
        pipeline thread's work per step. The kernels only read it."""
        enc = self.worker.enc
        return _cached(self._skips, (lo, hi, None if absent is None else absent.tobytes()),
                       lambda: skip_ranges(enc.src, enc.length, enc.c, enc.seg, lo, hi, absent))

    def exact_spans(self, lo: int, hi: int, flush: bool, fixed: Optional[np.ndarray]) -> ExactSpans:
        """The exact elements of one exchange (:class:`ExactSpans`): the ``fixed`` segments and
        the share ``[lo, hi)``, cached as :meth:`worker_skip` (CP-SGD's k spread shares)."""
        lay = self.layout
        return _cached(self._spans, (lo, hi, flush, None if fixed is None else fixed.tobytes()),
                       lambda: ExactSpans(lay.seg_off, lay.numel, fixed, lo, hi, flush))

    def encode(self, g: torch.Tensor, e_worker: Optional[torch.Tensor], out: torch.Tensor, lo: int, hi: int,
               skipped: Optional[np.ndarray], check_finite: bool, sources: Optional[Sources] = None
               ) -> Optional[np.ndarray]:
        """The worker encode of ``g`` into ``out`` skipping ``[lo, hi)`` and the ``skipped``
        segments; with ``check_finite``, this rank's non-finite segments of ``g`` (bool per
        segment; None: all finite). Where the encode proves every element finite
        (:meth:`BucketCodec.encode`) that is the whole test, with no pass of its own over the
        bucket. Anything else goes to the exact
        test, :func:`nonfinite_segments`. ``sources``: :meth:`BucketCodec.encode`'s, tested
        where they are."""
        proof = self.worker.encode(g, e_worker, out, self.worker_skip(lo, hi, skipped), sources)
        return None if not check_finite or proof else nonfinite_segments(g, self.layout, sources)

    def _targets(self, targets: Optional[Sources]) -> Optional[Targets]:
        """``run``'s ``targets`` for the decode into the bucket's coordinates."""
        return None if targets is None else Targets(self.layout.seg_off, targets)

    @property
    def server_numel(self) -> int:
        return 0

    @property
    def inline_exact(self) -> bool:
        return True

    def run(self, comm: Communicator, g: torch.Tensor, e_worker: Optional[torch.Tensor],
            e_server: Optional[torch.Tensor], flags: Optional[np.ndarray], lo: int = 0, hi: int = 0,
            exact: Optional[ExactSpans] = None, fixed: Optional[np.ndarray] = None,
            check_finite: bool = False, out: Optional[torch.Tensor] = None, sources: Optional[Sources] = None,
            targets: Optional[Sources] = None) -> tuple[torch.Tensor, np.ndarray, Optional[np.ndarray]]:
        """One exchange of bucket ``g``: ``(decoded average, present per segment, non-finite
        segments per rank)``. ``[lo, hi)`` and the segments flagged in ``fixed`` are not coded
        (codes 0, residuals untouched): their values go exactly where ``exact`` says (its
        spans' values of ``g``, flushing ``e_worker`` where it asks, averaged into the output;
        the caller sends a share that is not in ``exact`` itself). ``check_finite``: test this
        rank's ``g`` for NaN/Inf (:meth:`encode`) and mark its bad segments in its flag bytes;
        the last item is every rank's marks, ``[world, segments]`` bool, or None when no rank
        marked any. ``out``: where the average goes (fp32, ``g``'s size; it may be ``g``
        itself: ``g`` is read only before the first decode); default a new tensor. ``sources``:
        segments whose values are in tensors of their own, not in ``g`` (:meth:`encode`; the
        segments ``exact`` reads must be in ``g``). ``targets`` (per segment, a contiguous fp32
        tensor of its size or None): the average of those segments goes there instead of into
        the output (their part of the output is left as it was; exact segments have none)."""
        raise NotImplementedError


class AllgatherPlan(Plan):
    """One section per rank (chunks = 1); all_gather; decode and average all N. Exact values
    ride after the section; each rank gets all N copies, (N - 1) x their bytes against an fp32
    ring all-reduce's 2 (N - 1) / N: equal at 2 ranks, so they go inline only there."""

    name = "allgather"

    def __init__(self, world: int, rank: int, segments: Segments, codec: Compressor,
                 server_codec: Optional[Compressor] = None) -> None:
        super().__init__(world, rank, segments, codec, 1, lambda s, i: s)
        lay, S = self.layout, self.layout.segments
        zeros = np.zeros(S, dtype=np.int64)
        self.dec = self.worker.runs(np.arange(S), zeros, zeros, lay.seg_off, lay.numel)
        self.dec_table = self.dec.decode_table()

    @property
    def inline_exact(self) -> bool:
        return self.world <= 2

    def run(self, comm, g, e_worker, e_server, flags, lo=0, hi=0, exact=None, fixed=None, check_finite=False,
            out=None, sources=None, targets=None):
        lay, p, dev = self.layout, self.world, g.device
        R = 0 if exact is None else exact.count
        stride = lay.section + 4 * R
        send = self._buffer("send", stride, dev)
        nonfinite = self.encode(g, e_worker, send, lo, hi, _skipped_segments(flags, fixed), check_finite, sources)
        _write_flags(send[:lay.section], lay, flags, nonfinite)
        if R:
            exact.gather_into(g, e_worker, send[lay.section:].view(torch.float32))
        gathered = self._buffer("gathered", p * stride, dev)
        comm.all_gather(gathered, send)
        out = _output(out, self.numel, dev)
        self.worker.decode(gathered, p, self.dec, self.dec_table, out, True, float(p), stride,
                           self._targets(targets))
        if R:
            exact.scatter_mean(_raw_rows(gathered, p, stride, lay.section), p, out)
        present, bad = _read_flags(gathered, lay, stride)
        return out, present, bad


class TwoStagePlan(Plan):
    """Compressed all_to_all of chunks, owner-side average and re-compression (server
    residual), all_gather of the owners' chunks. Exact values are cut into N chunks that ride
    after the sections: owner i averages chunk i in fp32 and all-gathers it with its codes,
    an fp32 ring all-reduce's bytes in the same two messages.

    Args:
        server_codec: the codec each chunk's owner re-compresses the average with (with its
            own residual); default a fresh copy of ``codec``, as DeepSpeed's compressed
            all-reduce.
    """

    name = "two-stage"

    def __init__(self, world: int, rank: int, segments: Segments, codec: Compressor,
                 server_codec: Optional[Compressor] = None) -> None:
        super().__init__(world, rank, segments, codec, world, lambda s, i: f"{s}/chunk{i}")
        lay, S = self.layout, self.layout.segments
        server_codec = copy.deepcopy(codec) if server_codec is None else server_codec
        self.sfmt = _ChunkFormat(server_codec)
        slay = ChunkedLayout.build([(n, int(c)) for n, c in zip(lay.names, lay.chunk)], 1, self.sfmt)
        self.server = BucketCodec(server_codec, self.sfmt, slay, lambda s, i: f"{s}/server")
        self.server_layout = slay
        # my chunk of every segment, in bucket coordinates
        self.mine_base = lay.seg_off + rank * lay.chunk
        self.mine_len = lay.chunk_len(rank)
        seg = np.arange(S, dtype=np.int64)
        self.dec1 = self.worker.runs(seg, np.zeros(S, dtype=np.int64), np.full(S, rank, dtype=np.int64),
                                     slay.seg_off, lay.chunk)
        self.dec1_table = self.dec1.decode_table()
        self._dec2: dict[int, tuple] = {}
        self._mine_index: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def server_numel(self) -> int:
        return self.server_layout.total

    def dec2(self, stride: int):
        """(runs, table) decoding every owner's chunks from a gathered buffer whose owners are
        ``stride`` bytes apart (one table per stride: exact values change it)."""
        if stride not in self._dec2:
            lay, N, S = self.layout, self.world, self.layout.segments
            seg2 = np.repeat(np.arange(S, dtype=np.int64), N)
            own = np.tile(np.arange(N, dtype=np.int64), S)
            c2 = lay.chunk[seg2]
            runs = self.server.runs(seg2, own, np.zeros_like(seg2), lay.seg_off[seg2] + own * c2,
                                    np.clip(lay.numel[seg2] - own * c2, 0, c2), stride)
            self._dec2[stride] = (runs, runs.decode_table())
        return self._dec2[stride]

    def mine_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(bucket indices, server-residual indices) of the real elements of my chunks."""
        if self._mine_index is None or self._mine_index[0].device != device:
            lens = self.mine_len
            within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            bucket = np.repeat(self.mine_base, lens) + within
            server = np.repeat(self.server_layout.seg_off, lens) + within
            self._mine_index = (torch.from_numpy(bucket).to(device), torch.from_numpy(server).to(device))
        return self._mine_index

    def run(self, comm, g, e_worker, e_server, flags, lo=0, hi=0, exact=None, fixed=None, check_finite=False,
            out=None, sources=None, targets=None):
        lay, slay, p, dev = self.layout, self.server_layout, self.world, g.device
        R = 0 if exact is None else exact.count
        rc = -(-R // p)                      # exact elements per owner (the last ones padded)
        # stage 1: chunk i of every segment (and of the exact values) to rank i
        stride1 = lay.section + 4 * rc
        codes = self._buffer("codes", p * lay.section, dev)
        nonfinite = self.encode(g, e_worker, codes, lo, hi, _skipped_segments(flags, fixed), check_finite, sources)
        _write_flags(codes, lay, flags, nonfinite)
        send = codes
        if rc:
            send = self._buffer("send", p * stride1, dev)
            send.view(p, stride1)[:, :lay.section].copy_(codes.view(p, lay.section))
            padded = torch.zeros(p * rc, dtype=torch.float32, device=dev)
            exact.gather_into(g, e_worker, padded[:R])
            _raw_rows(send, p, stride1, lay.section).copy_(padded.view(p, rc))
        recv = self._buffer("recv", p * stride1, dev)
        comm.all_to_all(recv, send)
        present, bad = _read_flags(recv, lay, stride1)     # row r came from rank r
        # the owner averages the N versions of its chunks, re-compresses with its residual
        avg = torch.empty(slay.total, dtype=torch.float32, device=dev)
        self.worker.decode(recv, p, self.dec1, self.dec1_table, avg, True, float(p), stride1)
        stride2 = slay.section + 4 * rc
        sbuf = self._buffer("server", stride2, dev)
        enc = self.server.enc
        absent = _skipped_segments(None if present.all() else present, fixed)
        skip = skip_ranges(self.mine_base, self.mine_len, enc.c, enc.seg, lo, hi, absent)
        self.server.encode(avg, e_server, sbuf, skip)
        if rc:
            sbuf[slay.section:].view(torch.float32).copy_(mean_rows(_raw_rows(recv, p, stride1, lay.section), p))
        # stage 2: every rank gets every owner's re-compressed chunks (and exact averages)
        gathered = self._buffer("gathered", p * stride2, dev)
        comm.all_gather(gathered, sbuf)
        out = _output(out, self.numel, dev)
        runs, table = self.dec2(stride2)
        self.server.decode(gathered, 1, runs, table, out, False, 1.0, stride2, self._targets(targets))
        if R:   # the owners' averages, in order: one row, no division
            exact.scatter_mean(_raw_rows(gathered, p, stride2, slay.section).reshape(1, -1)[:, :R], 1.0, out)
        return out, present, bad


PLANS = {"allgather": AllgatherPlan, "two-stage": TwoStagePlan}


def _output(out: Optional[torch.Tensor], numel: int, device: torch.device) -> torch.Tensor:
    """A plan's output: ``out`` (checked) or a new fp32 tensor."""
    if out is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of {numel} elements, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out.view(-1)


def make_plan(kind: str, world: int, rank: int, segments: Segments, codec: Compressor,
              server_codec: Optional[Compressor] = None) -> Plan:
    """The plan of collective ``kind`` for one bucket of ``segments``."""
    if kind not in PLANS:
        raise ValueError(f"unknown collective {kind!r}; choose one of: {', '.join(COLLECTIVES)}")
    return PLANS[kind](world, rank, segments, codec, server_codec)
