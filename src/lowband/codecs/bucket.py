"""Bucket-level codecs: one call encodes (or decodes) a whole flat bucket of many segments.

A bucket is a flat fp32 tensor made of *segments* (one per parameter, named after it). A
:class:`ChunkedLayout` cuts every segment into ``chunks`` equal pieces of ``c = ceil(n/chunks)``
elements (the last ones zero-padded), the two-stage collective's layout (``chunks = N``; the
all-gather collective uses ``chunks = 1``). Chunk ``i`` of every segment goes into *section*
``i`` of one byte buffer, so a section is what travels to rank ``i``:

    section = [payload of chunk i of segment 0][... of segment 1] ... [present flags, S bytes]

Each chunk payload is exactly what the per-tensor codec's ``compress`` of that chunk returns
(MXNet 2-bit: ``ceil(c/16)`` int32 words; scale-aware 2-bit: the words then one fp32 per scale
block, blocks starting at the chunk's start, so the chunk's owner decodes it alone; 1-bit:
``ceil(c/32)`` words then the scale), at a 4-byte aligned offset. Everything about the layout
(offsets, chunk runs, section size) is computed once, when the layout is built.

:class:`BucketCodec` runs a codec over such a layout with error feedback: ``encode`` reads the
bucket and its residual and writes every section in one call; ``decode`` decodes K sections and
accumulates them into one fp32 output in one call. For 2-bit (both modes) and 1-bit on CPU
the calls go to the native kernels (:mod:`lowband._native`, GIL released), on CUDA to the Triton
kernels (:mod:`lowband._native.triton_codecs`, when triton imports); otherwise the same
layout is filled chunk by chunk through the codec's torch ``compress_residual_`` /
``decompress`` (the fallback, bit-identical for the native codecs; ``LOWBAND_CODEC_KERNELS``).

Skipping: chunk-local ranges ``[lo, hi)`` may be *skipped* per call: those elements are
encoded as zeros and their residual is neither used nor changed (CP-SGD's exact ranges,
segments a rank has no gradient for). Residuals cover the real elements only (padding is not
data), so the worker residual is one flat tensor per bucket, viewable per parameter name.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .. import _native as kernels
from .base import Compressor, Ctx, Payload, as_shape, exact_divisor
from .bitpack import words_for
from .error_feedback import ErrorFeedback

Segments = Sequence[tuple[str, int]]
#: per segment, a tensor holding its input (its numel, any shape) or None: the input is in the bucket
Sources = Sequence[Optional[torch.Tensor]]

KIND_TWOBIT, KIND_TWOBIT_REL, KIND_ONEBIT = kernels.KIND_TWOBIT, kernels.KIND_TWOBIT_REL, kernels.KIND_ONEBIT


def payload_to_bytes(payload: Payload) -> torch.Tensor:
    """Concatenate payload tensors into one flat uint8 buffer (their raw bytes)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])


def bytes_to_payload(buf: torch.Tensor, like: Payload) -> Payload:
    """Split a byte buffer back into tensors shaped and typed like ``like``: views where the
    offset suits the dtype's alignment, copies where it does not (a wide tensor after an
    odd-length narrow one)."""
    out, offset = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        piece = buf[offset:offset + n]
        if (buf.storage_offset() + offset) % t.element_size():
            piece = piece.clone()
        out.append(piece.view(t.dtype).reshape(t.shape))
        offset += n
    return out


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


class _ChunkFormat:
    """Payload structure of one chunk of ``c`` elements for a codec."""

    def __init__(self, codec: Compressor) -> None:
        self.codec = codec
        self.kind = codec.kernel_kind
        self._probe = None if self.kind is not None else copy.deepcopy(codec)
        self._like: dict[int, Payload] = {}

    def words(self, c: int) -> int:
        if self.kind == KIND_ONEBIT:
            return words_for(c, 1)
        return words_for(c, 2)

    def nbytes(self, c: int) -> int:
        return _align4(self.codec.payload_nbytes(c))

    def like(self, c: int) -> Payload:
        """Shapes and dtypes of a chunk's payload tensors (torch path)."""
        if c not in self._like:
            payload, _ = self._probe.compress(torch.zeros(c), "probe") if self._probe is not None else (
                self.codec.compress(torch.zeros(c), "probe"))
            self._like[c] = [torch.empty(t.shape, dtype=t.dtype) for t in payload]
        return self._like[c]


@dataclass
class ChunkedLayout:
    """Where every chunk of every segment lives (computed once per bucket and world size).

    Attributes (numpy int64 arrays, one entry per segment unless said otherwise):
        names, numel (n), seg_off (offset in the bucket), chunk (c = ceil(n / chunks)),
        pay_off (byte offset of a chunk's payload inside a section), pay_bytes,
        section (bytes per section, flags included), flag_off (byte offset of the flags).
    """

    names: list[str]
    chunks: int
    numel: np.ndarray
    seg_off: np.ndarray
    chunk: np.ndarray
    pay_off: np.ndarray
    pay_bytes: np.ndarray
    words: np.ndarray
    flag_off: int
    section: int
    total: int                      # elements of the bucket

    @classmethod
    def build(cls, segments: Segments, chunks: int, fmt: _ChunkFormat) -> "ChunkedLayout":
        names = [str(s) for s, _ in segments]
        numel = np.array([int(n) for _, n in segments], dtype=np.int64)
        seg_off = np.concatenate([[0], np.cumsum(numel)[:-1]]).astype(np.int64) if len(numel) else numel.copy()
        chunk = -(-numel // chunks)
        pay_bytes = np.array([fmt.nbytes(int(c)) for c in chunk], dtype=np.int64)
        words = np.array([fmt.words(int(c)) for c in chunk], dtype=np.int64)
        pay_off = np.concatenate([[0], np.cumsum(pay_bytes)[:-1]]).astype(np.int64) if len(numel) else numel.copy()
        flag_off = int(pay_bytes.sum())
        section = flag_off + _align4(len(names))
        return cls(names, chunks, numel, seg_off, chunk, pay_off, pay_bytes, words, flag_off, section,
                   int(numel.sum()))

    @property
    def segments(self) -> int:
        return len(self.names)

    def chunk_len(self, i: int) -> np.ndarray:
        """Real (unpadded) elements of chunk ``i`` of every segment."""
        return np.clip(self.numel - i * self.chunk, 0, self.chunk)


class _Runs:
    """Encode or decode runs as a numpy table (native kernels) and as rows (torch path)."""

    def __init__(self, src: np.ndarray, length: np.ndarray, c: np.ndarray, dst: np.ndarray,
                 seg: np.ndarray, chunk_index: np.ndarray, words: np.ndarray) -> None:
        self.src, self.length, self.c, self.dst, self.seg, self.chunk_index = src, length, c, dst, seg, chunk_index
        self.words = words
        self.count = len(src)
        self._tables: dict[str, tuple[np.ndarray, int]] = {}   # kind -> (read-only table, its address)

    def encode_table(self) -> np.ndarray:
        """rows: src element, len, c, dst int32 word, dst int32 scale (dst bytes / 4 + words).
        Built once (read-only): every call returns the same array."""
        return self._table("encode", lambda: [self.src, self.length, self.c, self.dst // 4,
                                              self.dst // 4 + self.words])

    def decode_table(self) -> np.ndarray:
        """rows: src int32 word, src int32 scale, c, dst element, len (src = payload bytes / 4).
        Built once (read-only): every call returns the same array."""
        return self._table("decode", lambda: [self.src // 4, self.src // 4 + self.words, self.c, self.dst,
                                              self.length])

    def _table(self, kind: str, columns) -> np.ndarray:
        if kind not in self._tables:
            table = np.ascontiguousarray(np.stack(columns(), axis=1).astype(np.int64))
            table.flags.writeable = False
            self._tables[kind] = (table, table.ctypes.data)
        return self._tables[kind][0]

    def address(self, table: np.ndarray) -> int:
        """``table.ctypes.data``, remembered for this object's own tables (numpy builds a ctypes
        object on every read of ``ctypes.data``, a cost comparable to a small bucket's encode call)."""
        for own, addr in self._tables.values():
            if own is table:
                return addr
        return table.ctypes.data


def skip_ranges(base: np.ndarray, length: np.ndarray, c: np.ndarray, seg: np.ndarray, lo: int, hi: int,
                absent: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Chunk-local skip table (``[n_runs, 2]``, or None when nothing is skipped) of runs whose
    real elements are bucket elements ``[base, base + length)`` of chunks of ``c``: the exact
    range ``[lo, hi)`` of the bucket, and whole chunks of the segments flagged in ``absent``."""
    if hi <= lo and (absent is None or not absent.any()):
        return None
    a = np.clip(lo - base, 0, length)
    b = np.maximum(a, np.clip(hi - base, 0, length))
    if absent is not None:
        gone = absent[seg]
        a = np.where(gone, 0, a)
        b = np.where(gone, c, b)
    return np.ascontiguousarray(np.stack([a, b], axis=1).astype(np.int64))


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


#: the element types the native kernels read and write (fp32 values, uint8 payloads)
_NATIVE_DTYPES = frozenset((torch.float32, torch.uint8))


def _native_fp32(t: torch.Tensor) -> bool:
    """A tensor the native kernels can read or write in place: contiguous fp32 on the CPU."""
    return t.is_cpu and t.dtype == torch.float32 and t.is_contiguous()


def _segment_addresses(base: torch.Tensor, seg_off: np.ndarray, tensors: Sources) -> np.ndarray:
    """Per segment, the address of its first element: in its own tensor, or at its offset in
    the flat ``base`` where it has none."""
    start = base.data_ptr()
    return np.fromiter((start + 4 * int(o) if t is None else t.data_ptr() for o, t in zip(seg_off, tensors)),
                       dtype=np.int64, count=len(tensors))


class Targets:
    """Where a decode writes the segments that have a tensor of their own (:meth:`BucketCodec.decode`'s
    ``targets``): ``tensors`` (per segment, a contiguous tensor of its size, or None: in the
    output), ``seg_off`` the segments' offsets in the output's coordinates (the bucket's)."""

    def __init__(self, seg_off: np.ndarray, tensors: Sources) -> None:
        self.seg_off, self.tensors = seg_off, tensors

    def native(self) -> bool:
        """Every tensor a contiguous fp32 CPU tensor (the native decoder can write into it)."""
        return all(t is None or _native_fp32(t) for t in self.tensors)

    def run_addresses(self, out: torch.Tensor, runs: "_Runs") -> np.ndarray:
        """Per decode run, the address of its first output element."""
        seg = _segment_addresses(out, self.seg_off, self.tensors)
        return np.ascontiguousarray(seg[runs.seg] + 4 * (runs.dst - self.seg_off[runs.seg]))

    def copy_runs(self, out: torch.Tensor, runs: "_Runs") -> None:
        """Copy the runs of segments with a tensor from ``out`` into it (decodes that wrote ``out``)."""
        for s, dst, n in zip(runs.seg.tolist(), runs.dst.tolist(), runs.length.tolist()):
            t = self.tensors[s]
            if t is not None and n:
                at = dst - int(self.seg_off[s])
                t.view(-1)[at:at + n].copy_(out[dst:dst + n])


def write_sources(g: torch.Tensor, layout: "ChunkedLayout", sources: Sources) -> None:
    """Copy every segment's source tensor (:meth:`BucketCodec.encode`'s ``sources``) into its
    place in the flat bucket ``g``."""
    for o, n, t in zip(layout.seg_off.tolist(), layout.numel.tolist(), sources):
        if t is not None:
            g[o:o + n].copy_(t.reshape(-1))


class BucketCodec:
    """A codec over one :class:`ChunkedLayout`: whole-bucket encode and decode calls.

    Args:
        codec: the per-tensor codec (not EF-wrapped; pass residuals to :meth:`encode`).
        layout: the bucket's layout.
        names: the torch path's codec name of each (segment, chunk) call, as
            ``name_of(segment_name, chunk_index)`` (shared-randomness codecs key on it).
    """

    def __init__(self, codec: Compressor, fmt: _ChunkFormat, layout: ChunkedLayout, name_of) -> None:
        if isinstance(codec, ErrorFeedback):
            raise ValueError("BucketCodec takes the inner codec; residuals are passed to encode()")
        self.codec, self.fmt, self.layout, self.name_of = codec, fmt, layout, name_of
        self.kind = fmt.kind
        # the kernels' scalar arguments (0 where the kind has none): fixed threshold t, relative
        # factor a, scale block (0 = one scale per chunk)
        self.t = float(codec.threshold) if self.kind == KIND_TWOBIT else 0.0
        self.a = float(codec.relative) if self.kind == KIND_TWOBIT_REL else 0.0
        self.bs = int(codec.scale_block or 0) if self.kind == KIND_TWOBIT_REL else 0
        # tests: a triton_codecs module (one loaded with TRITON_INTERPRET=1) to run on CPU tensors
        self._triton_on_cpu = None
        self._ctx: dict[tuple[int, int], Ctx] = {}
        lay = layout
        S, N = lay.segments, lay.chunks
        # encode runs ordered segment-major (source order): chunk i of segment s -> section i
        seg = np.repeat(np.arange(S, dtype=np.int64), N)
        idx = np.tile(np.arange(N, dtype=np.int64), S)
        c = lay.chunk[seg]
        self.enc = _Runs(lay.seg_off[seg] + idx * c, np.clip(lay.numel[seg] - idx * c, 0, c), c,
                         idx * lay.section + lay.pay_off[seg], seg, idx, lay.words[seg])
        self._enc_table = self.enc.encode_table()
        # byte offset of each encode run's first element inside its segment (run addresses
        # of inputs that live in their own tensors: :meth:`source_addresses`)
        self._enc_within = 4 * (self.enc.src - lay.seg_off[seg])

    # -- helpers -----------------------------------------------------------------------
    def _lib(self, *tensors: torch.Tensor):
        """The native library when every tensor is a contiguous fp32 / uint8 CPU tensor and the
        kind has a kernel (not while a test routes CPU tensors to the Triton interpreter)."""
        if self.kind is None or self._triton_on_cpu is not None:
            return None
        for t in tensors:   # a plain loop and ``is_cpu``: this runs on every encode and decode call
            if t is not None and not (t.is_cpu and t.dtype in _NATIVE_DTYPES and t.is_contiguous()):
                return None
        return kernels.library()

    def _triton(self, *tensors: torch.Tensor):
        """The Triton kernels (:mod:`lowband._native.triton_codecs`) when every tensor is on one CUDA
        device, contiguous, 4-byte aligned, and the kind has a kernel; else None."""
        if self.kind is None:
            return None
        ts = [t for t in tensors if t is not None]
        dev = ts[0].device
        if dev.type != "cuda" and not (dev.type == "cpu" and self._triton_on_cpu is not None):
            return None
        if any(t.device != dev or t.dtype not in (torch.float32, torch.uint8) or not t.is_contiguous()
               or t.data_ptr() % 4 for t in ts):
            return None
        if kernels.mode() == "torch":
            return None
        if dev.type == "cpu":
            return self._triton_on_cpu
        from .._native import triton_codecs
        if not triton_codecs.available():
            _warn_torch_path_on_gpu()
            return None
        return triton_codecs if triton_codecs.supports(self.kind) else None

    def uses_triton(self, like: torch.Tensor) -> bool:
        return self._triton(like) is not None

    def uses_native(self, like: torch.Tensor) -> bool:
        return self._lib(like) is not None

    # -- encode ------------------------------------------------------------------------
    def reads_sources(self, g: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                      sources: Sources) -> bool:
        """Whether :meth:`encode` reads ``sources`` where they are (the native kernels, with a
        build that has the ``*_encode_at`` entry points), rather than copying them into ``g``
        first: every source a contiguous fp32 CPU tensor of its segment's size."""
        lib = self._lib(g, residual, out)
        if lib is None or not lib.has_sources:
            return False
        numel = self.layout.numel
        return all(t is None or (_native_fp32(t) and t.numel() == numel[s]) for s, t in enumerate(sources))

    def source_addresses(self, g: torch.Tensor, sources: Sources) -> np.ndarray:
        """Per encode run, the address of its first input element: in its segment's source
        tensor, or in ``g`` for a segment whose source is None."""
        seg = _segment_addresses(g, self.layout.seg_off, sources)
        return np.ascontiguousarray(seg[self.enc.seg] + self._enc_within)

    def encode(self, g: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
               skip: Optional[np.ndarray] = None, sources: Optional[Sources] = None) -> Optional[bool]:
        """Encode the flat bucket ``g`` (with error feedback into ``residual`` when given) into
        the sections of ``out`` (uint8, ``chunks * section`` bytes; flags not written).

        ``sources`` (one entry per segment): segments whose input is not in ``g`` but in a
        tensor of their own (a gradient where autograd left it; None: in ``g``). The native
        kernels read them there (:meth:`reads_sources`); any other path first copies them into
        ``g`` (:func:`write_sources`). Same codes and residuals either way.

        Returns True when the encode proved every element of ``g`` finite, skipped ones
        included (the native scale-aware 2-bit and 1-bit kernels: finite scales prove the coded
        elements, the kernel tests the skipped ones); False when it could not (a NaN or Inf, or
        sums of huge finite values that overflowed: ask the exact test); None where no proof
        is made (MXNet's fixed threshold, the torch and Triton paths)."""
        if sources is not None and not self.reads_sources(g, residual, out, sources):
            write_sources(g, self.layout, sources)
            sources = None
        lib = self._lib(g, residual, out)
        tri = None if lib is not None else self._triton(g, residual, out)
        if lib is not None:
            return self._encode_native(lib, g, residual, out, skip, sources)
        if tri is not None:
            tri.encode(self, g, residual, out, skip)
        else:
            self._encode_torch(g, residual, out, skip)
        return None

    def _encode_native(self, lib, g, residual, out, skip, sources=None) -> Optional[bool]:
        sk = None if skip is None else skip.ctypes.data
        args, suffix = (g.data_ptr(), _ptr(residual), self.enc.address(self._enc_table), self.enc.count), ""
        if sources is not None:         # the *_at entry points: each run's input address
            addr = self.source_addresses(g, sources)
            args, suffix = (*args, addr.ctypes.data), "_at"
        if self.kind == KIND_TWOBIT:
            getattr(lib, "lb_twobit_encode" + suffix)(*args, sk, self.t, out.data_ptr())
            return None
        if self.kind == KIND_TWOBIT_REL:
            rc = getattr(lib, "lb_twobit_rel_encode" + suffix)(*args, sk, self.a, self.bs, out.data_ptr())
        else:
            rc = getattr(lib, "lb_onebit_encode" + suffix)(*args, sk, out.data_ptr())
        if rc < 0:
            raise MemoryError("native codec kernel could not allocate its scratch")
        return rc == 0 if lib.proves_finite else None

    def _encode_torch(self, g, residual, out, skip) -> None:
        runs, lay = self.enc, self.layout
        for k in range(runs.count):
            s, i = int(runs.seg[k]), int(runs.chunk_index[k])
            src, n, c, dst = int(runs.src[k]), int(runs.length[k]), int(runs.c[k]), int(runs.dst[k])
            keep = None
            if skip is not None and skip[k, 1] > skip[k, 0]:
                keep = torch.ones(n, dtype=torch.bool, device=g.device)
                keep[int(skip[k, 0]):int(min(skip[k, 1], n))] = False
            chunk = torch.zeros(c, dtype=torch.float32, device=g.device)
            chunk[:n] = g[src:src + n] if keep is None else torch.where(keep, g[src:src + n], 0.0)
            name = self.name_of(lay.names[s], i)
            if residual is None:
                payload, ctx = self.codec.compress(chunk, name)
            else:
                buf = torch.zeros(c, dtype=torch.float32, device=g.device)
                e = residual[src:src + n]
                buf[:n] = e if keep is None else torch.where(keep, e, 0.0)
                payload, ctx = self.codec.compress_residual_(buf, name, add=chunk)
                if keep is None:
                    e.copy_(buf[:n])
                else:
                    e.copy_(torch.where(keep, buf[:n], e))
            self._ctx[(s, i)] = ctx
            raw = payload_to_bytes(payload).to(out.device)
            out[dst:dst + raw.numel()] = raw

    # -- decode ------------------------------------------------------------------------
    def runs(self, seg, section_of, chunk_of, dst, length, stride: Optional[int] = None) -> _Runs:
        """Decode runs (numpy arrays, one entry per run): segment ``seg``'s payload in section
        ``section_of`` (relative to the source base; sections ``stride`` bytes apart, default
        one section), produced as chunk ``chunk_of`` (the torch path's ctx); ``length`` decoded
        elements go to ``out[dst:]``."""
        lay = self.layout
        seg = np.asarray(seg, dtype=np.int64)
        stride = lay.section if stride is None else int(stride)
        return _Runs(np.asarray(section_of, dtype=np.int64) * stride + lay.pay_off[seg],
                     np.asarray(length, dtype=np.int64), lay.chunk[seg], np.asarray(dst, dtype=np.int64), seg,
                     np.asarray(chunk_of, dtype=np.int64), lay.words[seg])

    def decode(self, src: torch.Tensor, sources: int, runs: _Runs, table: np.ndarray, out: torch.Tensor,
               from_zero: bool, divisor: float, stride: Optional[int] = None,
               targets: Optional["Targets"] = None) -> None:
        """``out[dst : dst+len] = (0 +)? sum over the ``sources`` sections of each run's decoded
        chunk, / divisor``. ``src``: uint8 bytes; source ``q``'s section starts at byte
        ``q * stride`` (default one section: a message may carry more after each section, a
        multiple of 4 bytes). ``targets``: the runs of segments that have a tensor of their own
        there are written into it instead of ``out`` (the native decoder writes there
        directly, any other path decodes into ``out`` and copies)."""
        stride = self.layout.section if stride is None else int(stride)
        if stride < self.layout.section or stride % 4:
            raise ValueError(f"decode stride {stride} must be a multiple of 4 and >= the section ({self.layout.section})")
        lib = self._lib(src, out)
        if lib is not None:
            if targets is not None and lib.has_sources and targets.native():
                addr = targets.run_addresses(out, runs)
                lib.lb_decode_at(self.kind, src.data_ptr(), stride // 4, sources, runs.address(table), runs.count,
                                 addr.ctypes.data, self.t, self.bs, int(from_zero), float(divisor), out.data_ptr())
                return
            lib.lb_decode(self.kind, src.data_ptr(), stride // 4, sources, runs.address(table), runs.count,
                          self.t, self.bs, int(from_zero), float(divisor), out.data_ptr())
        else:
            tri = self._triton(src, out)
            if tri is not None:
                tri.decode(self, src, sources, table, runs.count, out, from_zero, divisor, stride)
            else:
                self._decode_torch(src, sources, runs, out, from_zero, divisor, stride)
        if targets is not None:
            targets.copy_runs(out, runs)

    def _decode_torch(self, src, sources, runs, out, from_zero, divisor, stride) -> None:
        lay = self.layout
        for k in range(runs.count):
            s, c, n, dst = int(runs.seg[k]), int(runs.c[k]), int(runs.length[k]), int(runs.dst[k])
            ctx = self._ctx.get((s, int(runs.chunk_index[k])))
            if ctx is None:
                ctx = self.codec.context_for(c, torch.float32, self.name_of(lay.names[s], int(runs.chunk_index[k])))
            like = self.fmt.like(c)
            acc = None
            for q in range(sources):
                base = int(runs.src[k]) + q * stride
                raw = src[base:base + int(lay.pay_bytes[s])].to(out.device)
                d = self.codec.decompress(bytes_to_payload(raw, like), ctx).reshape(-1).to(torch.float32)[:n]
                acc = (torch.zeros(n, device=out.device) + d if from_zero else d.clone()) if acc is None else acc.add_(d)
            if acc is None:
                acc = torch.zeros(n, device=out.device)
            if divisor != 1.0:
                acc = acc.div_(exact_divisor(divisor, acc))
            out[dst:dst + n] = acc


_warned_torch_path = False


def _warn_torch_path_on_gpu() -> None:
    """Once per process: CUDA buckets of a codec with Triton kernels take the torch path
    because triton does not import (the CUDA builds of torch install it on Linux x86-64)."""
    global _warned_torch_path
    if not _warned_torch_path:
        _warned_torch_path = True
        warnings.warn("lowband: triton is not installed, so the 2-bit and 1-bit bucket codecs run on CUDA "
                      "through the torch path, hundreds of times slower than the Triton kernels "
                      "(docs/codecs.md); install triton, or set LOWBAND_CODEC_KERNELS=torch to choose "
                      "the torch path knowingly", RuntimeWarning, stacklevel=3)


def mean_rows(rows: torch.Tensor, divisor: float) -> torch.Tensor:
    """``(rows[0] + rows[1] + ... + rows[K-1]) / divisor`` of a ``[K, n]`` fp32 tensor (rows may
    be strided), added in row order: the exact average of K ranks' fp32 values with the same
    bits on every rank (``torch.sum`` changes its order with the row count). Native on CPU,
    else the bit-identical torch loop."""
    K, n = rows.shape
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    lib = kernels.library() if rows.device.type == "cpu" and rows.dtype == torch.float32 else None
    if lib is not None and (n == 0 or rows.stride(1) == 1) and K > 0:
        lib.lb_sum_rows(rows.data_ptr(), rows.stride(0), K, n, float(divisor), out.data_ptr())
        return out
    if K == 0:
        return out.zero_()
    out.copy_(rows[0])
    for q in range(1, K):
        out.add_(rows[q])
    if divisor != 1.0:
        out.div_(exact_divisor(divisor, out))
    return out


class ExactSpans:
    """The elements of a flat bucket one exchange sends exactly, in fp32 beside its codes, in
    message order: whole segments (``fixed``: bool per segment, e.g. 1-D parameters that are
    never coded), then a share ``[lo, hi)`` (CP-SGD's spread correction; it may overlap them).

    ``gather_into`` writes their values into a message (the share's plus the worker residual
    there, which is zeroed, when ``flush``); ``scatter_mean`` writes the rank-order mean of K
    messages' values back into the bucket's output, the share after the segments (where they
    overlap, the share wins). On the CPU each is one native call (``lb_gather_spans``,
    ``lb_scatter_mean``), in place of the clone, index_select, cat, mean and index_copy they
    replaced on the pipeline's thread; elsewhere (or with a library without them) torch index
    ops with the same bits.

    Args:
        seg_off, numel: the bucket's segment offsets and sizes (its layout).
        fixed: bool per segment, or None.
        lo, hi: the share (empty when ``hi <= lo``).
        flush: add the worker residual to the share's values and zero it there.
    """

    def __init__(self, seg_off: np.ndarray, numel: np.ndarray, fixed: Optional[np.ndarray], lo: int, hi: int,
                 flush: bool) -> None:
        whole = [] if fixed is None else [(int(o), int(n)) for o, n, f in zip(seg_off, numel, fixed) if f]
        self.fixed_count = sum(n for _, n in whole)
        self.lo, self.hi, self.flush = int(lo), max(int(lo), int(hi)), bool(flush)
        spans = [(o, n, 0) for o, n in whole]
        if self.hi > self.lo:
            spans.append((self.lo, self.hi - self.lo, int(self.flush)))
        self.table = np.ascontiguousarray(np.asarray(spans, dtype=np.int64).reshape(-1, 3))
        self.count = int(self.table[:, 1].sum())
        # the torch path's index of the whole segments' elements, per device
        self._index = {} if not whole else {torch.device("cpu"): torch.from_numpy(
            np.concatenate([np.arange(o, o + n, dtype=np.int64) for o, n in whole]))}

    def index(self, device: torch.device) -> torch.Tensor:
        """The whole segments' element indices on ``device`` (the torch path's)."""
        if device not in self._index:
            self._index[device] = self._index[torch.device("cpu")].to(device)
        return self._index[device]

    @staticmethod
    def _native(*tensors: Optional[torch.Tensor]):
        """The native library for fp32 CPU ``tensors`` (None entries allowed), else None."""
        if all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors):
            return kernels.library_having("has_spans")
        return None

    def gather_into(self, g: torch.Tensor, residual: Optional[torch.Tensor], dst: torch.Tensor) -> None:
        """``dst`` (fp32, ``count`` contiguous elements) = the spans' values of flat ``g``, in order."""
        if not self.count:
            return
        e = residual if self.flush else None
        lib = self._native(g, e, dst)
        if lib is not None and g.is_contiguous() and dst.is_contiguous() and (e is None or e.is_contiguous()):
            lib.lb_gather_spans(g.data_ptr(), _ptr(e), self.table.ctypes.data, len(self.table), dst.data_ptr())
            return
        nf = self.fixed_count
        if nf:
            torch.index_select(g, 0, self.index(g.device), out=dst[:nf])
        if self.hi > self.lo:
            share = dst[nf:]
            share.copy_(g[self.lo:self.hi])
            if e is not None:
                share.add_(e[self.lo:self.hi])
                e[self.lo:self.hi].zero_()

    def gather(self, g: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """The spans' values of ``g`` in a new tensor (:meth:`gather_into`)."""
        dst = torch.empty(self.count, dtype=torch.float32, device=g.device)
        self.gather_into(g, residual, dst)
        return dst

    def scatter_mean(self, rows: torch.Tensor, divisor: float, out: torch.Tensor) -> None:
        """Write the mean of ``rows`` (``[K, count]`` fp32, rows may be strided; summed in row
        order, then divided by ``divisor``, as :func:`mean_rows`) into the spans of flat ``out``."""
        if not self.count:
            return
        lib = self._native(rows, out)
        if lib is not None and out.is_contiguous() and rows.stride(1) == 1 and rows.shape[0] > 0:
            lib.lb_scatter_mean(rows.data_ptr(), rows.stride(0), rows.shape[0], self.table.ctypes.data,
                                len(self.table), float(divisor), out.data_ptr())
            return
        mean = mean_rows(rows, divisor)
        nf = self.fixed_count
        if nf:
            out.index_copy_(0, self.index(out.device), mean[:nf])
        if self.hi > self.lo:
            out[self.lo:self.hi] = mean[nf:]


def payload_nbytes(codec: Compressor, n: int) -> int:
    """Bytes of one compressed chunk of ``n`` elements (4-byte aligned)."""
    return _align4(codec.payload_nbytes(as_shape(n)))
