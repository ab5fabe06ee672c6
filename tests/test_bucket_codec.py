"""Fused bucket codecs: native kernels against the torch path (bit for bit) and against a
per-element reference, for segment sizes that are not multiples of 16 or of N."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowband import _native as kernels
from lowband.codecs import make_compressor
from lowband.codecs.bucket import BucketCodec, ChunkedLayout, ExactSpans, _ChunkFormat, mean_rows, skip_ranges
from lowband.codecs.sums import canonical_sum

CODECS = [
    ("2bit", {"threshold": 0.5}),
    ("2bit", {"threshold": 1e-3}),
    ("2bit", {"relative": 1.0, "scale_block": 256}),
    ("2bit", {"relative": 0.7, "scale_block": 100}),
    ("2bit", {"relative": 1.3, "scale_block": 16}),
    ("2bit", {"relative": 1.0}),
    ("1bit", {}),
]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _lib():
    lib = kernels.library()
    if lib is None:
        pytest.fail(f"native kernels missing: {kernels.unavailable_reason()} (reinstall with a C compiler)")
    return lib


def _codec(case):
    fmt_codec = make_compressor(case[0], **case[1])
    fmt = _ChunkFormat(fmt_codec)
    return fmt_codec, fmt


def _bucket(case, sizes, chunks):
    codec, fmt = _codec(case)
    layout = ChunkedLayout.build([(f"p{k}", n) for k, n in enumerate(sizes)], chunks, fmt)
    return BucketCodec(codec, fmt, layout, lambda s, i: f"{s}/chunk{i}")


def _data(n, seed, nan=False):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * torch.rand(1, generator=gen)
    e = torch.randn(n, generator=gen) * 0.3
    if nan and n:
        g[seed % n] = float("nan")
    return g, e


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _skip(bc, lo, hi, absent_first):
    enc = bc.enc
    absent = None
    if absent_first:
        absent = np.zeros(bc.layout.segments, dtype=bool)
        absent[0] = True
    return skip_ranges(enc.src, enc.length, enc.c, enc.seg, lo, hi, absent)


def _same_bits(a, b):
    """Equal tensors, NaN where the other is NaN (payload bits of a NaN may differ)."""
    if a is None or b is None:
        return a is b
    if a.dtype != torch.float32:
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a[~nan]), _bits(b[~nan]))


def _native_encode(bc, g, e, skip, simd):
    """The native kernel's encode, with the CPU's SIMD path allowed (``simd``) or not."""
    lib = _lib()
    out = torch.zeros(bc.layout.chunks * bc.layout.section, dtype=torch.uint8)
    res = None if e is None else e.clone()
    lib.lb_set_simd(int(simd))
    try:
        bc._encode_native(lib, g, res, out, skip)
    finally:
        lib.lb_set_simd(1)
    return out, res


def _both_encodes(bc, g, e, skip):
    """[native, torch] encodes of one input; the native kernel's SIMD and portable paths are
    checked against each other on the way (bit for bit)."""
    simd = _native_encode(bc, g, e, skip, True)
    portable = _native_encode(bc, g, e, skip, False)
    assert torch.equal(simd[0], portable[0]) and _same_bits(simd[1], portable[1])
    out = torch.zeros(bc.layout.chunks * bc.layout.section, dtype=torch.uint8)
    res = None if e is None else e.clone()
    bc._encode_torch(g, res, out, skip)
    return [simd, (out, res)]


def test_simd_kernel_is_used_where_the_cpu_has_it():
    """On a CPU with AVX-512F the scale-aware encoder takes its vector path (so the tests that
    compare it with the portable path compare two different code paths)."""
    with open("/proc/cpuinfo") as f:
        avx512 = " avx512f" in f.read()
    lib = _lib()
    assert lib.lb_set_simd(1) == int(avx512)
    assert lib.lb_set_simd(0) == 0
    assert lib.lb_set_simd(1) == int(avx512)


def test_another_build_serves_the_codecs_inside_using(tmp_path):
    """``kernels.using`` (the A/B benchmark's switch) routes the codecs to another build of the
    library for the block only, and a copy of the same build gives the same bits."""
    import glob
    import os
    import shutil
    installed = _lib()
    here = os.path.dirname(os.path.abspath(kernels.__file__))
    copy = tmp_path / "copy.so"
    shutil.copy(sorted(glob.glob(os.path.join(here, "_lowband_codecs*.so")))[0], copy)
    other = kernels.open_library(str(copy))
    bc = _bucket(("2bit", {"relative": 1.0, "scale_block": 256}), [3000, 700], 2)
    g, e = _data(bc.layout.total, 4)
    outs = []
    for lib in (installed, other):
        with kernels.using(lib):
            assert kernels.library() is lib
            out, res = torch.zeros(2 * bc.layout.section, dtype=torch.uint8), e.clone()
            bc.encode(g, res, out)
            outs.append((out, res))
    assert kernels.library() is installed
    assert torch.equal(outs[0][0], outs[1][0]) and _same_bits(outs[0][1], outs[1][1])


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(200, 2600), min_size=1, max_size=3), chunks=st.integers(1, 3),
       seed=st.integers(0, 2**20), ef=st.booleans(), skip=st.tuples(st.integers(0, 3000), st.integers(0, 3000)),
       special=st.sampled_from([None, "nan", "inf", "zeros"]))
def test_scale_aware_kernel_paths_agree_on_long_chunks(sizes, chunks, seed, ef, skip, special):
    """Chunks of several 256-element blocks (the vector kernel's two-block and short-block
    paths, next to skipped ranges, NaN, Inf and all-zero blocks): SIMD = portable = torch."""
    bc = _bucket(("2bit", {"relative": 1.0, "scale_block": 256}), sizes, chunks)
    g, e = _data(bc.layout.total, seed)
    at = seed % bc.layout.total
    if special == "nan":
        g[at] = float("nan")
    elif special == "inf":
        g[at] = float("-inf")
    elif special == "zeros":
        g[at:at + 300], e[at:at + 300] = 0.0, 0.0
    lo, hi = sorted(skip)
    (o1, e1), (o2, e2) = _both_encodes(bc, g, e if ef else None, _skip(bc, lo, hi, False))
    assert torch.equal(o1, o2) and _same_bits(e1, e2)


@pytest.mark.parametrize("chunks, ef", [(1, True), (2, False), (3, True)])
def test_scale_aware_kernel_of_a_large_call_equals_torch_path(chunks, ef):
    """A call of more than 2**20 elements takes the one-block vector path for every block (the
    two-block kernel only below that size): SIMD = portable = torch there too."""
    bc = _bucket(("2bit", {"relative": 1.0, "scale_block": 256}), [600_000, 500_001, 1000], chunks)
    assert bc.layout.total > 1 << 20
    g, e = _data(bc.layout.total, 11 + chunks)
    g[123_457] = float("nan")
    (o1, e1), (o2, e2) = _both_encodes(bc, g, e if ef else None, _skip(bc, 70_000, 90_000, False))
    assert torch.equal(o1, o2) and _same_bits(e1, e2)


sizes_st = st.lists(st.integers(1, 700), min_size=1, max_size=5)


@SETTINGS
@given(case=st.sampled_from(CODECS), sizes=sizes_st, chunks=st.integers(1, 7), seed=st.integers(0, 2**20),
       ef=st.booleans(), skip=st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.booleans()),
       nan=st.booleans())
def test_native_encode_equals_torch_path(case, sizes, chunks, seed, ef, skip, nan):
    bc = _bucket(case, sizes, chunks)
    g, e = _data(bc.layout.total, seed, nan)
    lo, hi = sorted(skip[:2])
    sk = _skip(bc, lo, hi, skip[2])
    (o1, e1), (o2, e2) = _both_encodes(bc, g, e if ef else None, sk)
    assert torch.equal(o1, o2)
    if ef:
        assert torch.equal(torch.isnan(e1), torch.isnan(e2))
        fin = ~torch.isnan(e1)
        assert torch.equal(_bits(e1[fin]), _bits(e2[fin]))
        if sk is not None:   # skipped elements keep their residual
            runs = bc.enc
            for k in range(runs.count):
                a, b = int(sk[k, 0]), int(min(sk[k, 1], runs.length[k]))
                src = int(runs.src[k])
                assert torch.equal(_bits(e1[src + a:src + b]), _bits(e[src + a:src + b]))


def _apart(bc, g, moved):
    """``g``'s segments listed in ``moved`` copied out into tensors of their own (the sources),
    and a bucket whose places for them hold garbage: an encode that read the bucket there
    would differ."""
    lay = bc.layout
    sources, bucket = [], g.clone()
    for s, (o, n) in enumerate(zip(lay.seg_off.tolist(), lay.numel.tolist())):
        if s in moved:
            sources.append(g[o:o + n].clone().view(1, -1) if s % 2 else g[o:o + n].clone())
            bucket[o:o + n] = float("nan") if s % 3 else 1e30
        else:
            sources.append(None)
    return sources, bucket


@SETTINGS
@given(case=st.sampled_from(CODECS), sizes=sizes_st, chunks=st.integers(1, 5), seed=st.integers(0, 2**20),
       ef=st.booleans(), skip=st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.booleans()),
       nan=st.booleans(), moved=st.sets(st.integers(0, 4)), simd=st.booleans(), mode=st.sampled_from(["auto", "torch"]))
def test_encoding_segments_where_they_are_equals_the_flat_bucket(case, sizes, chunks, seed, ef, skip, nan, moved,
                                                                 simd, mode):
    """``encode(..., sources=)`` (each run's input address, the ``*_encode_at`` kernels; or, off
    the native path, the sources copied into the bucket first) gives the codes, residuals and
    finiteness proof of the flat bucket, bit for bit, whichever segments are elsewhere."""
    bc = _bucket(case, sizes, chunks)
    g, e = _data(bc.layout.total, seed, nan)
    lo, hi = sorted(skip[:2])
    sk = _skip(bc, lo, hi, skip[2])
    sources, bucket = _apart(bc, g, moved)
    outs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.ENV, mode)
        lib = kernels.library()
        for src, values in ((None, g), (sources, bucket)):
            out = torch.zeros(bc.layout.chunks * bc.layout.section, dtype=torch.uint8)
            res = e.clone() if ef else None
            if lib is not None:
                lib.lb_set_simd(int(simd))
            try:
                proof = bc.encode(values, res, out, sk, sources=src)
            finally:
                if lib is not None:
                    lib.lb_set_simd(1)
            outs.append((out, res, proof))
        reads = bc.reads_sources(bucket, e, outs[1][0], sources)
    (o1, e1, p1), (o2, e2, p2) = outs
    assert reads == (mode == "auto" and bc.kind is not None)
    assert torch.equal(o1, o2) and _same_bits(e1, e2) and p1 == p2


def test_sources_that_do_not_fit_the_native_encoder_are_copied_into_the_bucket():
    bc = _bucket(("2bit", {"relative": 1.0, "scale_block": 256}), [300, 40], 2)
    g, e = _data(bc.layout.total, 3)
    out = torch.zeros(bc.layout.chunks * bc.layout.section, dtype=torch.uint8)
    strided = torch.zeros(600)[::2]
    strided.copy_(g[:300])
    for sources in ([strided, None], [g[:300].double(), None]):
        assert not bc.reads_sources(g, e, out, sources)
    ref = out.clone()
    bc.encode(g, e.clone(), ref)
    bucket = g.clone()
    bucket[:300] = 0.0
    bc.encode(bucket, e.clone(), out, sources=[strided, None])
    assert torch.equal(out, ref) and torch.equal(bucket, g)      # copied in, then encoded


@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_native_scale_aware_full_blocks_equal_torch_path(ef, chunks):
    """Segments of many whole 256-element scale blocks (the kernel's fused full-block path)
    next to partial and skipped blocks, with a NaN, an Inf, ties on the threshold and an
    all-zero block: bit for bit as the torch path."""
    bc = _bucket(("2bit", {"relative": 1.0, "scale_block": 256}), [256 * 7 + 3, 1024, 300], chunks)
    g, e = _data(bc.layout.total, 11)
    g[5], g[700], g[1300:1556] = float("nan"), float("inf"), 0.0
    if not ef:
        e = None
    else:
        e[1300:1556] = 0.0
    sk = _skip(bc, 260, 270, False)
    for skip in (None, sk):
        (o1, e1), (o2, e2) = _both_encodes(bc, g, e, skip)
        assert torch.equal(o1, o2)
        if ef:
            assert torch.equal(torch.isnan(e1), torch.isnan(e2))
            fin = ~torch.isnan(e1)
            assert torch.equal(_bits(e1[fin]), _bits(e2[fin]))


def _reference_mxnet(g, e, t, layout):
    """Per-element MXNet 2-bit with error feedback on the two-stage layout (numpy)."""
    t = np.float32(t)
    e = e.numpy().copy()
    g = g.numpy()
    out = np.zeros(layout.chunks * layout.section, dtype=np.uint8)
    for s in range(layout.segments):
        n, c, off = int(layout.numel[s]), int(layout.chunk[s]), int(layout.seg_off[s])
        for i in range(layout.chunks):
            base = i * layout.section + int(layout.pay_off[s])
            for j in range(c):
                k = i * c + j
                r = np.float32(e[off + k] + g[off + k]) if k < n else np.float32(0)
                code = 3 if r >= t else (2 if r <= -t else 0)
                if k < n:
                    e[off + k] = r - t if code == 3 else (r + t if code == 2 else r)
                out[base + j // 4] |= code << (6 - 2 * (j % 4))
    return out, torch.from_numpy(e)


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 90), min_size=1, max_size=4), chunks=st.integers(1, 5), seed=st.integers(0, 2**20))
def test_fused_mxnet_equals_per_element_reference(sizes, chunks, seed):
    bc = _bucket(("2bit", {"threshold": 0.4}), sizes, chunks)
    g, e = _data(bc.layout.total, seed)
    (o1, e1), _ = _both_encodes(bc, g, e, None)
    ref_out, ref_e = _reference_mxnet(g, e, 0.4, bc.layout)
    flag_mask = np.ones(len(ref_out), dtype=bool)
    for i in range(chunks):   # flags are written by the collective, not by encode
        flag_mask[i * bc.layout.section + bc.layout.flag_off:(i + 1) * bc.layout.section] = False
    assert np.array_equal(o1.numpy()[flag_mask], ref_out[flag_mask])
    assert torch.equal(_bits(e1), _bits(ref_e))


@SETTINGS
@given(case=st.sampled_from(CODECS), sizes=sizes_st, chunks=st.integers(1, 6), sources=st.integers(1, 5),
       seed=st.integers(0, 2**20), from_zero=st.booleans(), divisor=st.sampled_from([1.0, 3.0, 7.0]),
       simd=st.booleans())
def test_native_decode_accumulate_equals_torch_path(case, sizes, chunks, sources, seed, from_zero, divisor, simd):
    _check_decode(case, sizes, chunks, sources, seed, from_zero, divisor, simd)


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("case", CODECS)
def test_native_decode_of_long_chunks_equals_torch_path(case, simd):
    """Chunks of several 2048-element decode tiles (and a tail), averaged over 3 sources."""
    _check_decode(case, [5000, 4099, 300], 2, 3, 5, True, 3.0, simd)
    _check_decode(case, [4500], 1, 2, 6, False, 1.0, simd)


def _check_decode(case, sizes, chunks, sources, seed, from_zero, divisor, simd):
    bc = _bucket(case, sizes, chunks)
    lay = bc.layout
    # payload sections of `sources` different inputs: chunk 0 of every segment in each
    payload = torch.zeros(sources * lay.section, dtype=torch.uint8)
    for q in range(sources):
        g, e = _data(lay.total, seed + q)
        out = torch.zeros(chunks * lay.section, dtype=torch.uint8)
        bc._encode_torch(g, e, out, None)
        payload[q * lay.section:(q + 1) * lay.section] = out[:lay.section]
    S = lay.segments
    zeros = np.zeros(S, dtype=np.int64)
    runs = bc.runs(np.arange(S), zeros, zeros, np.concatenate([[0], np.cumsum(lay.chunk)[:-1]]), lay.chunk)
    table = runs.decode_table()
    total = int(lay.chunk.sum())
    got, ref = torch.full((total,), 5.0), torch.full((total,), 5.0)
    lib = _lib()
    lib.lb_set_simd(int(simd))   # the AVX-512F decoder (where the CPU has it) or the portable C
    try:
        lib.lb_decode(bc.kind, payload.data_ptr(), lay.section // 4, sources, table.ctypes.data, runs.count,
                      float(bc.codec.threshold or 0.0) if bc.kind == 0 else 0.0,
                      int(getattr(bc.codec, "scale_block", None) or 0) if bc.kind == 1 else 0,
                      int(from_zero), divisor, got.data_ptr())
    finally:
        lib.lb_set_simd(1)
    kernels_mode = kernels.mode
    try:
        kernels.mode = lambda: "torch"
        bc.decode(payload, sources, runs, table, ref, from_zero, divisor)
    finally:
        kernels.mode = kernels_mode
    assert torch.equal(_bits(got), _bits(ref))


@settings(max_examples=30, deadline=None)
@given(n=st.one_of(st.integers(0, 1000), st.integers(60000, 70000)), seed=st.integers(0, 2**20))
def test_canonical_sum_native_equals_torch(n, seed):
    x = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 10
    native = _lib().lb_canon_sum(ctypes.c_void_p(x.data_ptr()), n)
    assert np.float32(native).view(np.int32) == canonical_sum(x).view(torch.int32).item()
    assert abs(float(native) - float(x.double().sum())) <= 1e-4 * max(1.0, float(x.double().sum()))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(0, 5000), pad=st.integers(0, 9), seed=st.integers(0, 2**20),
       divisor=st.sampled_from([1.0, 2.0, 3.0, 7.0]))
def test_mean_rows_native_equals_rank_order_loop(rows, n, pad, seed, divisor):
    """Exact values are averaged in rank order, to the same bits natively and in torch, for
    strided rows (as they sit in a gathered message) and row counts where torch.sum reorders."""
    _lib()
    x = torch.randn(rows, n + pad, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-4, 4, n + pad)
    view = x[:, pad:]
    ref = view[0].clone()
    for q in range(1, rows):
        ref = ref + view[q]
    ref = ref / divisor if divisor != 1.0 else ref
    native = mean_rows(view, divisor)
    kernels_mode = kernels.mode
    try:
        kernels.mode = lambda: "torch"
        fallback = mean_rows(view, divisor)
    finally:
        kernels.mode = kernels_mode
    assert torch.equal(_bits(native), _bits(ref)) and torch.equal(_bits(fallback), _bits(ref))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8), data=st.data(), rows=st.integers(1, 5),
       pad=st.integers(0, 3), flush=st.booleans(), with_residual=st.booleans(), seed=st.integers(0, 2**20))
def test_exact_spans_native_and_torch_equal_an_element_loop(sizes, data, rows, pad, flush, with_residual, seed):
    """The exact elements of an exchange: gathered into a message (the share flushing the
    residual) and their rank-order mean scattered back (the share after the segments, winning
    where they overlap), natively and through torch, equal to a per-element loop."""
    _lib()
    n = sum(sizes)
    seg_off = np.cumsum([0] + sizes[:-1]).astype(np.int64)
    fixed = np.array(data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes))))
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * 100
    e0 = torch.randn(n, generator=gen) if with_residual else None
    order = [k for o, c, f in zip(seg_off, sizes, fixed) if f for k in range(int(o), int(o) + c)] + list(range(lo, hi))
    ref_msg = [float(np.float32(g[k]) + np.float32(e0[k])) if (with_residual and flush and j >= len(order) - (hi - lo))
               else float(g[k]) for j, k in enumerate(order)]
    received = torch.randn(rows, len(order) + pad, generator=gen)[:, pad:]
    ref_out = torch.full((n,), 7.0)
    for j, k in enumerate(order):                 # later wins
        acc = received[0, j].clone()
        for q in range(1, rows):
            acc = acc + received[q, j]
        ref_out[k] = acc / rows if rows != 1 else acc
    ref_e = None if e0 is None else e0.clone()
    if ref_e is not None and flush:
        ref_e[lo:hi] = 0.0
    for mode in ("native", "torch"):
        spans = ExactSpans(seg_off, np.array(sizes, dtype=np.int64), fixed if fixed.any() else None, lo, hi, flush)
        assert spans.count == len(order)
        e = None if e0 is None else e0.clone()
        out = torch.full((n,), 7.0)
        kernels_mode = kernels.mode
        try:
            if mode == "torch":
                kernels.mode = lambda: "torch"
            msg = spans.gather(g, e)
            spans.scatter_mean(received, float(rows), out)
        finally:
            kernels.mode = kernels_mode
        assert torch.equal(_bits(msg), _bits(torch.tensor(ref_msg, dtype=torch.float32))), mode
        assert torch.equal(_bits(out), _bits(ref_out)), mode
        if e is not None:
            assert torch.equal(_bits(e), _bits(ref_e)), mode


def test_kernel_mode_variable(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "torch")
    assert kernels.library() is None
    monkeypatch.setenv(kernels.ENV, "bogus")
    with pytest.raises(ValueError, match="LOWBAND_CODEC_KERNELS"):
        kernels.library()
    monkeypatch.setenv(kernels.ENV, "auto")
    bc = _bucket(CODECS[0], [33], 2)
    assert bc.uses_native(torch.zeros(1)) == (kernels.library() is not None)


class _CudaLike:
    """What BucketCodec's dispatch reads of a tensor, for a CUDA device this machine may lack."""
    device = torch.device("cuda", 0)
    dtype = torch.float32

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return 4096


def test_cuda_buckets_without_triton_warn_once_and_take_the_torch_path(monkeypatch):
    import warnings

    from lowband.codecs import bucket as bucket_module
    from lowband._native import triton_codecs
    bc = _bucket(CODECS[0], [33, 7], 2)
    monkeypatch.setattr(triton_codecs, "triton", None)
    monkeypatch.setattr(bucket_module, "_warned_torch_path", False)
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        assert bc._triton(_CudaLike()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bc._triton(_CudaLike()) is None                  # once per process
        monkeypatch.setattr(bucket_module, "_warned_torch_path", False)
        monkeypatch.setenv(kernels.ENV, "torch")                  # chosen knowingly: no warning
        assert bc._triton(_CudaLike()) is None


def test_a_plans_skip_tables_are_cached_and_equal_to_skip_ranges(monkeypatch):
    """``Plan.worker_skip`` returns what ``skip_ranges`` computes for every exact range and
    absent set, builds each distinct table once, and keeps at most ``SKIP_CACHE`` of them."""
    from lowband.comm import plans as cc
    from lowband.codecs import build_compressor
    segments = [("a", 1000), ("b", 37), ("c", 4097)]
    for kind in ("allgather", "two-stage"):
        plan = cc.make_plan(kind, 3, 1, segments, build_compressor("2bit", {}))
        enc = plan.worker.enc
        cases = [(0, 0, None), (0, 0, np.array([False, True, False])), (100, 900, None),
                 (100, 900, np.array([True, False, False])), (0, 5134, None)]
        first = [plan.worker_skip(lo, hi, absent) for lo, hi, absent in cases]
        for (lo, hi, absent), got in zip(cases, first):
            want = skip_ranges(enc.src, enc.length, enc.c, enc.seg, lo, hi, absent)
            assert (got is None and want is None) or np.array_equal(got, want)
        # the same key (an equal absent array, not the same object) gives the cached table
        again = [plan.worker_skip(lo, hi, None if absent is None else absent.copy()) for lo, hi, absent in cases]
        assert all(a is b for a, b in zip(first, again))
    monkeypatch.setattr(cc, "SKIP_CACHE", 3)
    plan = cc.make_plan("allgather", 3, 1, segments, build_compressor("2bit", {}))
    for lo in range(10):
        plan.worker_skip(lo, lo + 5, None)
    assert len(plan._skips) <= 3


def test_run_tables_are_built_once_and_remember_their_addresses():
    """The kernels' calls read a run table's address from ``_Runs.address`` (cached for the
    tables it made; numpy's ``ctypes.data`` costs ~1 us a read): it must be the table's own
    address, for its tables and for a copy of one. Each table is built once and read-only, so
    neither a caller asking per step nor one writing into it can make the cache wrong."""
    bc = _bucket(CODECS[2], [37, 300, 5], 3)
    enc = bc.enc
    assert enc.encode_table() is bc._enc_table and enc.decode_table() is enc.decode_table()
    for table in (bc._enc_table, enc.decode_table()):
        assert enc.address(table) == table.ctypes.data
        assert not table.flags.writeable
        other = table.copy()
        assert enc.address(other) == other.ctypes.data != table.ctypes.data


def test_bytes_to_payload_copies_a_tensor_whose_offset_breaks_its_alignment():
    """A codec may put an odd-length int8 tensor before an fp32 one; splitting the wire bytes
    back must still give the fp32 values (a view at an odd offset would raise)."""
    from lowband.codecs.bucket import bytes_to_payload, payload_to_bytes
    payload = [torch.tensor([1, -2, 3], dtype=torch.int8), torch.tensor([0.5, -1.25], dtype=torch.float32)]
    back = bytes_to_payload(payload_to_bytes(payload), payload)
    assert torch.equal(back[0], payload[0]) and torch.equal(back[1], payload[1])
