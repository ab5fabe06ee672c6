"""Triton bucket-codec kernels (``kernels/triton_codecs.py``) against the C kernel and the torch
path, bit for bit: packed bytes, residuals, decoded sums.

Without a GPU the kernels run under Triton's interpreter on CPU tensors: this module sets
``TRITON_INTERPRET=1`` while it imports triton (the interpreter must be chosen before triton's
own library functions are decorated), and hands the module to ``BucketCodec._triton_on_cpu``.
With a GPU the ``cuda`` tests below run the same comparisons on CUDA tensors with the compiled
kernels (``pytest -m cuda``), and the interpreter tests skip (unless ``TRITON_INTERPRET=1`` is
set for the whole run). Skipped entirely when triton is not installed."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# (left set for the process: triton reads it again on launches; nothing else here uses triton)
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
from lowband._native import triton_codecs  # noqa: E402  (decorated under the interpreter)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from lowband import _native as kernels  # noqa: E402
from lowband.codecs.bitpack import words_for  # noqa: E402

from .test_bucket_codec import CODECS, _bits, _bucket, _data, _lib, _native_encode, _same_bits, _skip  # noqa: E402

# numpy's warning when the interpreter divides NaN sums (the C kernel divides them too)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
INTERPRETED = isinstance(triton_codecs._encode_kernel, InterpretedFunction)
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
interpreter = pytest.mark.skipif(not INTERPRETED, reason="triton was imported without TRITON_INTERPRET=1 "
                                 "(a GPU is present: the kernels are tested compiled, pytest -m cuda)")


def interpreted():
    """The kernels' module, loaded under the interpreter (they run on CPU tensors)."""
    return triton_codecs


def _triton_encode(bc, g, e, skip, device="cpu"):
    """Encode through BucketCodec.encode on the Triton path (interpreted on CPU tensors)."""
    out = torch.zeros(bc.layout.chunks * bc.layout.section, dtype=torch.uint8, device=device)
    res = None if e is None else e.clone().to(device)
    bc._triton_on_cpu = interpreted() if device == "cpu" else None
    try:
        assert bc.uses_triton(g.to(device))
        bc.encode(g.to(device), res, out, skip)
    finally:
        bc._triton_on_cpu = None
    return out.cpu(), None if res is None else res.cpu()


def _torch_encode(bc, g, e, skip):
    out = torch.zeros(bc.layout.chunks * bc.layout.section, dtype=torch.uint8)
    res = None if e is None else e.clone()
    bc._encode_torch(g, res, out, skip)
    return out, res


def _same_payload(bc, a, b):
    """Equal packed sections: code words bit for bit; the fp32 scale words after each chunk's
    codes as :func:`_same_bits` (NaN where the other is NaN: a GPU's arithmetic returns the
    canonical NaN 0x7FFFFFFF, x86 the NaN operand's payload, so a NaN scale's bits differ)."""
    lay = bc.layout
    scale = np.zeros(a.numel() // 4, dtype=bool)
    width = 1 if bc.kind == triton_codecs.KIND_ONEBIT else 2
    for i in range(lay.chunks):
        for s in range(lay.segments):
            base = (i * lay.section + int(lay.pay_off[s])) // 4
            codes = words_for(int(lay.chunk[s]), width)
            scale[base + codes:base + int(lay.pay_bytes[s]) // 4] = True
    wa, wb = a.view(torch.int32), b.view(torch.int32)
    mask = torch.from_numpy(scale)
    return torch.equal(wa[~mask], wb[~mask]) and _same_bits(wa[mask].view(torch.float32), wb[mask].view(torch.float32))


def _check_encode(case, sizes, chunks, seed, ef, skip, special, device="cpu"):
    bc = _bucket(case, sizes, chunks)
    g, e = _data(bc.layout.total, seed)
    n = bc.layout.total
    at = seed % n
    t = float(getattr(bc.codec, "threshold", None) or 0.5)
    if special == "nan":
        g[at] = float("nan")
    elif special == "inf":
        g[at], g[(at * 7 + 3) % n] = float("inf"), float("-inf")
    elif special == "ties":   # values exactly on +-t (and their fp32 neighbours), zeros, -0.0
        t32 = np.float32(t)
        inside, outside = float(np.nextafter(t32, np.float32(0))), float(np.nextafter(t32, np.float32(np.inf)))
        vals = torch.tensor([t, -t, inside, -inside, outside, -outside, 0.0, -0.0])
        g[:] = vals[torch.arange(n) % len(vals)]
        e[:] = 0.0
    elif special == "zeros":
        g[at:at + 300], e[at:at + 300] = 0.0, 0.0
    e = e if ef else None
    sk = _skip(bc, *skip) if skip is not None else None
    native = _native_encode(bc, g, e, sk, True)
    tri = _triton_encode(bc, g, e, sk, device)
    assert _same_payload(bc, native[0], tri[0]), "packed bytes differ from the C kernel"
    assert _same_bits(native[1], tri[1]), "residuals differ from the C kernel"
    if device == "cpu":
        ref = _torch_encode(bc, g, e, sk)
        assert torch.equal(ref[0], tri[0]) and _same_bits(ref[1], tri[1])
    if ef and sk is not None:   # skipped elements keep their residual
        runs = bc.enc
        for k in range(runs.count):
            a, b = int(sk[k, 0]), int(min(sk[k, 1], runs.length[k]))
            src = int(runs.src[k])
            assert torch.equal(_bits(tri[1][src + a:src + b]), _bits(e[src + a:src + b]))


def _payloads(bc, sources, seed):
    """`sources` payload sections (chunk 0 of every segment of different inputs), with gaps of
    8 bytes between them (a stride longer than the section)."""
    lay = bc.layout
    stride = lay.section + 8
    payload = torch.zeros(sources * stride, dtype=torch.uint8)
    for q in range(sources):
        g, e = _data(lay.total, seed + q, nan=(q == 1))
        out = torch.zeros(lay.chunks * lay.section, dtype=torch.uint8)
        bc._encode_torch(g, e, out, None)
        payload[q * stride:q * stride + lay.section] = out[:lay.section]
    return payload, stride


def _check_decode(case, sizes, chunks, sources, seed, from_zero, divisor, device="cpu"):
    bc = _bucket(case, sizes, chunks)
    lay = bc.layout
    payload, stride = _payloads(bc, sources, seed)
    S = lay.segments
    zeros = np.zeros(S, dtype=np.int64)
    runs = bc.runs(np.arange(S), zeros, zeros, np.concatenate([[0], np.cumsum(lay.chunk)[:-1]]), lay.chunk,
                   stride=stride)
    table = runs.decode_table()
    total = int(lay.chunk.sum())
    native = torch.full((total,), 5.0)
    bc.decode(payload, sources, runs, table, native, from_zero, divisor, stride=stride)
    assert bc.uses_native(native), "the C kernel is the reference"
    got = torch.full((total,), 5.0, device=device)
    bc._triton_on_cpu = interpreted() if device == "cpu" else None
    try:
        assert bc.uses_triton(got)
        bc.decode(payload.to(device), sources, runs, table, got, from_zero, divisor, stride=stride)
    finally:
        bc._triton_on_cpu = None
    assert _same_bits(native, got.cpu()), "decoded sums differ from the C kernel"
    if device == "cpu":
        mode = kernels.mode
        try:
            kernels.mode = lambda: "torch"
            ref = torch.full((total,), 5.0)
            bc.decode(payload, sources, runs, table, ref, from_zero, divisor, stride=stride)
        finally:
            kernels.mode = mode
        assert _same_bits(ref, got)


sizes_st = st.lists(st.integers(1, 700), min_size=1, max_size=4)
skip_st = st.one_of(st.none(), st.tuples(st.integers(0, 2000), st.integers(0, 2000), st.booleans()).map(
    lambda s: (min(s[:2]), max(s[:2]), s[2])))
special_st = st.sampled_from([None, "nan", "inf", "ties", "zeros"])


@pytest.fixture(autouse=True)
def _c_kernel():
    _lib()


@interpreter
@SETTINGS
@given(case=st.sampled_from(CODECS), sizes=sizes_st, chunks=st.integers(1, 5), seed=st.integers(0, 2**20),
       ef=st.booleans(), skip=skip_st, special=special_st)
def test_triton_encode_equals_c_kernel(case, sizes, chunks, seed, ef, skip, special):
    _check_encode(case, sizes, chunks, seed, ef, skip, special)


@interpreter
@pytest.mark.parametrize("case", [("2bit", {"threshold": 0.5}), ("1bit", {}), ("2bit", {"relative": 1.0}),
                                  ("2bit", {"relative": 0.9, "scale_block": 70_000})])
def test_triton_encode_of_a_long_chunk_equals_c_kernel(case):
    """A chunk of more than 256*256 elements: three levels of canonical folds (1-bit's scale,
    whole-chunk and long scale blocks), next to a short segment and a skipped range."""
    _check_encode(case, [140_001, 37], 2, 5, True, (1000, 5000, False), "nan")


@interpreter
@SETTINGS
@given(case=st.sampled_from(CODECS), sizes=sizes_st, chunks=st.integers(1, 5), sources=st.integers(1, 5),
       seed=st.integers(0, 2**20), from_zero=st.booleans(), divisor=st.sampled_from([1.0, 3.0, 7.0]))
def test_triton_decode_equals_c_kernel(case, sizes, chunks, sources, seed, from_zero, divisor):
    _check_decode(case, sizes, chunks, sources, seed, from_zero, divisor)


@interpreter
def test_triton_decode_of_no_sources_writes_zeros():
    for case in (CODECS[0], CODECS[-1]):
        _check_decode(case, [33, 70], 2, 0, 1, False, 3.0)


def test_schedule_of_canonical_sums():
    """The fold schedule of groups of 0, 1, 256, 257 and 70,000 terms: level-1 rows cover each
    group in 256-rows, later levels reduce until one value per group is left."""
    rows, levels, fin, size = triton_codecs._levels(np.array([0, 1, 256, 257, 70_000]))
    assert rows[:, 0].tolist()[:5] == [0, 1, 2, 3, 3] and rows[:, 2].tolist()[:5] == [0, 1, 256, 256, 1]
    assert len(rows) == 1 + 1 + 1 + 2 + 274
    assert [len(lv) for lv in levels] == [3, 1]     # 2 -> 1 and 274 -> 2 -> 1
    assert fin[:3].tolist() == [0, 1, 2] and size == len(rows) + 3 + 1


@interpreter
def test_kernel_mode_torch_keeps_the_torch_path(monkeypatch):
    bc = _bucket(CODECS[0], [33], 2)
    bc._triton_on_cpu = interpreted()
    assert bc.uses_triton(torch.zeros(1))
    monkeypatch.setenv(kernels.ENV, "torch")
    assert not bc.uses_triton(torch.zeros(1))


# ------------------------------------------------------------------------------ real CUDA
@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", CODECS)
@pytest.mark.parametrize("special", [None, "nan", "ties"])
def test_cuda_triton_encode_equals_c_kernel(case, special):
    for ef in (True, False):
        for skip in (None, (40, 900, True)):
            _check_encode(case, [37, 700, 5, 4099, 300], 3, 7, ef, skip, special, device="cuda")
    _check_encode(case, [140_001, 37], 2, 5, True, (1000, 5000, False), special, device="cuda")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", CODECS)
def test_cuda_triton_decode_equals_c_kernel(case):
    _check_decode(case, [5000, 4099, 300, 7], 2, 3, 5, True, 3.0, device="cuda")
    _check_decode(case, [4500, 33], 1, 2, 6, False, 1.0, device="cuda")
    _check_decode(case, [4500, 33], 1, 0, 6, False, 3.0, device="cuda")


@pytest.mark.cuda
@cuda
def test_cuda_triton_path_is_taken_on_a_cuda_bucket():
    bc = _bucket(CODECS[0], [33], 2)
    assert bc.uses_triton(torch.zeros(1, device="cuda")) and not bc.uses_native(torch.zeros(1, device="cuda"))


def test_tables_used_on_another_stream_are_recorded_there(monkeypatch):
    """A cached table read on a stream other than the one that made it: that stream waits for
    the table's copy (device-side) and the table is ``record_stream``-ed on it, so evicting it
    from the cache cannot free memory a kernel there may still read; on its own stream, only
    the wait. (Stand-ins for the CUDA stream, event and tensor: this runs without a GPU.)"""
    class Stream:
        def __init__(self):
            self.waited = []

        def wait_event(self, event):
            self.waited.append(event)

    class Table:
        def __init__(self):
            self.recorded = []

        def record_stream(self, stream):
            self.recorded.append(stream)

    made_on, other, event = Stream(), Stream(), object()
    table = Table()
    current = [made_on]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    triton_codecs._use((event, made_on), [table], torch.device("cuda", 0))
    assert made_on.waited == [event] and table.recorded == []
    current[0] = other
    triton_codecs._use((event, made_on), [table], torch.device("cuda", 0))
    assert other.waited == [event] and table.recorded == [other]
    triton_codecs._use(None, [table], torch.device("cpu"))     # CPU tensors: nothing to order
    assert table.recorded == [other]
