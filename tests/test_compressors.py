"""Property tests for the compressor layer (codecs, bit packing, error feedback)."""

from __future__ import annotations

import copy
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.codecs import (
    COMPRESSORS,
    Compressor,
    ErrorFeedback,
    RandomK,
    TopK,
    TwoBitQuantizer,
    make_compressor,
)
from lowband.codecs.bitpack import (
    pack_1bit,
    pack_2bit,
    pack_bits,
    pack_ternary,
    unpack_1bit,
    unpack_2bit,
    unpack_bits,
    unpack_ternary,
)

# Options that make every registered codec constructible (and non-trivial) in tests.
OPTIONS: dict[str, dict] = {
    "2bit": {"threshold": 0.3},
    "topk": {"ratio": 0.1},
    "randomk": {"ratio": 0.2},
    "qsgd": {"levels": 5},
    "powersgd": {"rank": 2},
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [(), (0,), (3, 0), (1,), (15,), (16,), (17,), (33,), (5, 7), (4, 3, 5), (64, 9)]
FAST = settings(max_examples=60, deadline=None)


def build(name: str) -> Compressor:
    return make_compressor(name, **OPTIONS.get(name, {}))


def nbytes(payload: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


# ---------------------------------------------------------------------------------------------
# Slow per-element pure-Python reference of MXNet's quantize_2bit (gradient_compression-inl.h)
# ---------------------------------------------------------------------------------------------
POSBITS = (0xC0, 0x30, 0x0C, 0x03)
NEGBITS = (0x80, 0x20, 0x08, 0x02)


def f32(v: float) -> float:
    return float(np.float32(v))


def mxnet_2bit_reference(grad: list[float], residual: list[float], threshold: float):
    """Returns (packed int32 words, codes in {-1,0,1}, new residual), element by element."""
    t = f32(threshold)
    n = len(grad)
    out_bytes = bytearray(4 * ((n + 15) // 16))
    codes, new_res = [], []
    for i in range(n):
        r = f32(np.float32(residual[i]) + np.float32(grad[i]))  # residual[i] += grad[i]
        byte = i >> 2
        if r >= t:
            out_bytes[byte] |= POSBITS[i & 3]
            r = f32(np.float32(r) - np.float32(t))
            codes.append(1)
        elif r <= -t:
            out_bytes[byte] |= NEGBITS[i & 3]
            r = f32(np.float32(r) + np.float32(t))
            codes.append(-1)
        else:
            codes.append(0)
        new_res.append(r)
    words = list(struct.unpack(f"<{len(out_bytes) // 4}i", bytes(out_bytes)))
    return words, codes, new_res


# 7.0 and 0.03: r = nextafter(t, 0) times fl(1/t) rounds up to 1, so a reciprocal-multiply
# shortcut (instead of IEEE division) would be caught here.
THRESHOLDS = [0.5, 0.1, 3.0, 1e-3, 7.0, 0.03]


@st.composite
def twobit_case(draw):
    t = f32(draw(st.sampled_from(THRESHOLDS)))
    up, down = float(np.nextafter(np.float32(t), np.float32(np.inf))), float(
        np.nextafter(np.float32(t), np.float32(0))
    )
    special = st.sampled_from([t, -t, up, -up, down, -down, 0.0, -0.0, 2 * t, -2 * t, t / 2])
    finite = st.floats(-4 * t, 4 * t, width=32, allow_nan=False)
    n = draw(st.integers(0, 150))
    grad = draw(st.lists(st.one_of(special, finite), min_size=n, max_size=n))
    residual = draw(st.lists(st.one_of(st.just(0.0), finite), min_size=n, max_size=n))
    block = draw(st.sampled_from([16, 48, 1 << 16, None]))   # None: the whole tensor, as off the CPU
    return t, grad, residual, block


def _twobit(t, block):
    """A 2-bit quantizer with cache blocks of ``block`` elements, or (None) one block of the
    whole tensor, which is what it uses on a GPU: sizes that are not a multiple of 16 then
    end inside the block's last word."""
    q = TwoBitQuantizer(t, block_size=block or 16)
    if block is None:
        q._block = lambda n, device: max(n, 1)
    return q


@FAST
@given(twobit_case())
def test_twobit_matches_mxnet_reference_bit_for_bit(case):
    t, grad, residual, block = case
    words, codes, new_res = mxnet_2bit_reference(grad, residual, t)
    q = _twobit(t, block)
    g = torch.tensor(grad, dtype=torch.float32)
    e = torch.tensor(residual, dtype=torch.float32)
    # plain compress of r = e + g gives the same words
    payload, ctx = q.compress(e + g, "w")
    assert payload[0].dtype == torch.int32
    assert payload[0].tolist() == words
    assert q.codes(payload, ctx).tolist() == codes
    assert q.decompress(payload, ctx).tolist() == [f32(c * t) for c in codes]
    # fused EF path: same words, residual equals MXNet's e <- r - q (as values)
    ef = ErrorFeedback(_twobit(t, block))
    if grad:
        ef.compress(torch.zeros(len(grad)), "w")  # create the residual, then seed it
        ef.residual("w").copy_(e)
    payload_ef, _ = ef.compress(g, "w")
    assert payload_ef[0].tolist() == words
    if grad:
        assert ef.residual("w").tolist() == new_res


def test_twobit_nan_gives_code_zero_like_mxnet():
    q = TwoBitQuantizer(0.5)
    x = torch.tensor([float("nan"), 1.0, -1.0, float("inf"), -float("inf")])
    p, ctx = q.compress(x, "w")
    assert q.codes(p, ctx).tolist() == [0, 1, -1, 1, -1]


@pytest.mark.parametrize("device", DEVICES)
def test_twobit_fused_equals_generic_error_feedback(device):
    gen = torch.Generator().manual_seed(1)
    q = TwoBitQuantizer(0.25, block_size=64)
    e_fused = (torch.randn(1000, generator=gen) * 0.3).to(device)
    e_generic = e_fused.clone()
    for _ in range(5):
        g = torch.randn(1000, generator=gen).to(device)
        p1, _ = q.compress_residual_(e_fused, "w", add=g)
        p2, _ = Compressor.compress_residual_(q, e_generic, "w", add=g)
        assert torch.equal(p1[0], p2[0])
        assert torch.equal(e_fused, e_generic)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_every_fused_error_feedback_path_equals_generic(name):
    fused, generic = build(name), build(name)  # same seeds, so same random draws
    gen = torch.Generator().manual_seed(2)
    for shape in [(), (0,)]:  # degenerate shapes go through the fused paths too
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                fused.compress_residual_(torch.ones(shape), "s")[0],
                Compressor.compress_residual_(generic, torch.ones(shape), "s")[0],
            )
        )
    e_fused = torch.randn(7, 33, generator=gen)
    e_generic = e_fused.clone()
    for _ in range(3):
        g = torch.randn(7, 33, generator=gen)
        p1, _ = fused.compress_residual_(e_fused, "w", add=g)
        p2, _ = Compressor.compress_residual_(generic, e_generic, "w", add=g)
        assert all(torch.equal(a, b) for a, b in zip(p1, p2))
        assert torch.equal(e_fused, e_generic)


# ---------------------------------------------------------------------------------------------
# Bit packing
# ---------------------------------------------------------------------------------------------
def padded(values: list[int], multiple: int) -> torch.Tensor:
    values = values + [0] * (-len(values) % multiple)
    return torch.tensor(values, dtype=torch.uint8)


@FAST
@given(st.lists(st.integers(0, 3), max_size=200))
def test_pack_2bit_round_trip_and_layout(codes):
    buf = padded(codes, 16)
    words = pack_2bit(buf)
    assert words.numel() == math.ceil(len(codes) / 16)
    assert unpack_2bit(words, len(codes)).tolist() == codes
    # generic bit-plane packer uses the same MSB-first layout
    if codes:
        assert torch.equal(pack_bits(torch.tensor(codes), 2), words)


@FAST
@given(st.lists(st.integers(0, 1), max_size=300))
def test_pack_1bit_round_trip_and_numpy_layout(bits):
    buf = padded(bits, 32)
    words = pack_1bit(buf)
    assert words.numel() == math.ceil(len(bits) / 32)
    assert unpack_1bit(words, len(bits)).tolist() == bits
    expected = np.packbits(np.array(bits + [0] * (-len(bits) % 32), dtype=np.uint8), bitorder="big")
    assert words.view(torch.uint8).tolist() == expected.tolist()


def msb_first_stream_reference(codes: list[int], width: int) -> list[int]:
    """Slow reference of the wire layout: MSB-first bit stream, bytes in order, int32 words."""
    bits = [(c >> (width - 1 - j)) & 1 for c in codes for j in range(width)]
    bits += [0] * (-len(bits) % 32)
    data = bytes(sum(b << (7 - j) for j, b in enumerate(bits[i : i + 8])) for i in range(0, len(bits), 8))
    return list(struct.unpack(f"<{len(data) // 4}i", data))


@FAST
@given(st.integers(1, 16), st.data())
def test_pack_bits_any_width_layout_and_round_trip(width, data):
    codes = data.draw(st.lists(st.integers(0, (1 << width) - 1), max_size=100))
    words = pack_bits(torch.tensor(codes, dtype=torch.int32), width)
    assert words.tolist() == msb_first_stream_reference(codes, width)
    assert unpack_bits(words, len(codes), width).tolist() == codes


@FAST
@given(st.lists(st.integers(-1, 1), max_size=200))
def test_pack_ternary_is_mxnet_codes(signs):
    buf = torch.tensor(signs + [0] * (-len(signs) % 16), dtype=torch.int8)
    words = pack_ternary(buf)
    mx = padded([{1: 3, -1: 2, 0: 0}[s] for s in signs], 16)
    assert torch.equal(words, pack_2bit(mx))
    assert unpack_ternary(words, len(signs)).tolist() == signs


# ---------------------------------------------------------------------------------------------
# Payload sizes, contexts, aliasing, dtypes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 1000])
def test_bitpacked_payload_sizes(n):
    x = torch.randn(n)
    p2, _ = TwoBitQuantizer(0.1).compress(x, "w")
    assert nbytes(p2) == 4 * math.ceil(n / 16) == build("2bit").payload_nbytes((n,))
    p1, _ = build("1bit").compress(x, "w")
    assert nbytes(p1) == 4 * math.ceil(n / 32) + 4 == build("1bit").payload_nbytes(n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", COMPRESSORS)
def test_every_codec_payload_size_shape_dtype_and_receiver_ctx(name, device):
    sender, receiver = build(name), build(name)
    for shape in SHAPES:
        x = torch.randn(shape, device=device)
        payload, ctx = sender.compress(x, "layer.w")
        assert nbytes(payload) == sender.payload_nbytes(shape), shape
        out = sender.decompress(payload, ctx)
        assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
        # a receiver that never compressed rebuilds the ctx from metadata alone
        rctx = receiver.context_for(shape, x.dtype, "layer.w", ctx.step)
        assert torch.equal(receiver.decompress(payload, rctx), out)
        # payloads never alias the input
        before = [t.clone() for t in payload]
        x.add_(1.0)
        assert all(torch.equal(a, b) for a, b in zip(before, payload))


def test_non_fp32_inputs_decode_to_input_dtype():
    x = torch.randn(40).to(torch.float16)
    for name in COMPRESSORS:
        c = build(name)
        p, ctx = c.compress(x, "w")
        assert c.decompress(p, ctx).dtype == torch.float16, name


# ---------------------------------------------------------------------------------------------
# Error feedback
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", COMPRESSORS)
def test_error_feedback_conserves_mass(name):
    ef = ErrorFeedback(build(name))
    gen = torch.Generator().manual_seed(3)
    sent = torch.zeros(13, 7, dtype=torch.float64)
    total = torch.zeros(13, 7, dtype=torch.float64)
    for _ in range(30):
        g = torch.randn(13, 7, generator=gen) * 0.5
        payload, ctx = ef.compress(g, "w")
        sent += ef.decompress(payload, ctx).double()
        total += g.double()
    lhs = sent + ef.residual("w").double()
    tol = 2e-5  # fp32 rounding of ~30 additions of O(1) values
    assert torch.allclose(lhs, total, rtol=0, atol=tol), (lhs - total).abs().max()
    if name != "none":  # the codec really dropped more than the tolerance; the residual has it
        assert ef.residual("w").abs().max() > 5 * tol


def test_twobit_invariants():
    t = 0.5
    q = TwoBitQuantizer(t)
    gen = torch.Generator().manual_seed(4)
    e = torch.zeros(999)
    for step in range(40):
        # bounded gradients |g| <= t keep |e| < t forever (Sterbenz: r - t is exact)
        g = (torch.rand(999, generator=gen) * 2 - 1) * t
        r = e + g
        payload, ctx = q.compress_residual_(e, "w", add=g)
        code = q.codes(payload, ctx)
        assert set(code.unique().tolist()) <= {-1, 0, 1}
        assert torch.equal(e, r - t * code.float())  # e_new = e_old + g - t*code, exactly
        assert (e.abs() < t).all()
    # any gradient: |e_new| < t + |g| whenever |e_old| < t
    g = torch.randn(999, generator=gen) * 10
    q.compress_residual_(e, "w", add=g)
    assert (e.abs() < t + g.abs()).all()


def test_error_feedback_state_dict_round_trip_and_reset():
    for name in ["qsgd", "terngrad", "randomk", "powersgd", "2bit"]:
        ef = ErrorFeedback(build(name))
        gen = torch.Generator().manual_seed(5)
        grads = [torch.randn(6, 10, generator=gen) for _ in range(6)]
        for g in grads[:3]:
            ef.compress(g, "w")
        state = copy.deepcopy(ef.state_dict())
        a = [ef.compress(g, "w")[0] for g in grads[3:]]
        restored = ErrorFeedback(build(name))
        restored.load_state_dict(state)
        b = [restored.compress(g, "w")[0] for g in grads[3:]]
        for pa, pb in zip(a, b):
            assert all(torch.equal(x, y) for x, y in zip(pa, pb)), name
        assert torch.equal(ef.residual("w"), restored.residual("w"))
    ef.reset("w")
    with pytest.raises(KeyError):
        ef.residual("w")


def test_error_feedback_rejects_shape_change():
    ef = ErrorFeedback(build("2bit"))
    ef.compress(torch.randn(8), "w")
    with pytest.raises(ValueError):
        ef.compress(torch.randn(9), "w")


# ---------------------------------------------------------------------------------------------
# Codec-specific behaviour
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_stochastic_codecs_are_unbiased(name):
    c = build(name)
    x = torch.randn(64, generator=torch.Generator().manual_seed(6))
    draws = 3000
    acc = torch.zeros(64, dtype=torch.float64)
    for _ in range(draws):
        p, ctx = c.compress(x, "w")
        acc += c.decompress(p, ctx).double()
    mean = acc / draws
    # per-element decode std is at most max|x| (terngrad) or ||x||/levels (qsgd); 6 sigma
    sigma = x.abs().max() if name == "terngrad" else x.norm() / OPTIONS["qsgd"]["levels"]
    assert (mean - x.double()).abs().max() < 6 * sigma / math.sqrt(draws)
    # and a single decode is really random and not the input
    p1, c1 = c.compress(x, "w")
    p2, c2 = c.compress(x, "w")
    assert not torch.equal(c.decompress(p1, c1), c.decompress(p2, c2))


def test_onebit_scale_is_mean_abs_and_l2_optimal():
    x = torch.randn(100, generator=torch.Generator().manual_seed(7))
    c = build("1bit")
    p, ctx = c.compress(x, "w")
    assert torch.allclose(p[1], x.abs().mean())
    out = c.decompress(p, ctx)
    assert torch.equal(torch.sign(out), torch.sign(x))
    err = (out - x).norm()
    for factor in (0.9, 1.1):
        assert (out * factor - x).norm() > err


@given(st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=80, unique=True))
@FAST
def test_topk_picks_largest_magnitudes(values):
    x = torch.tensor(values)
    mags = x.abs().tolist()
    if len(set(mags)) != len(mags):  # ties make "the" top-k ambiguous
        return
    k = max(1, len(values) // 3)
    c = TopK(k=k)
    p, ctx = c.compress(x, "w")
    expected = set(torch.argsort(x.abs(), descending=True)[:k].tolist())
    assert set(p[1].tolist()) == expected
    out = c.decompress(p, ctx)
    assert torch.equal(out[list(expected)], x[list(expected)])
    assert int((out != 0).sum()) <= k


def test_randomk_shared_indices_and_global_rng_untouched():
    gen = torch.Generator().manual_seed(9)
    x, y = torch.randn(500, generator=gen), torch.randn(500, generator=gen)
    rng_before = torch.get_rng_state()
    a, b = RandomK(k=10, seed=11), RandomK(k=10, seed=11)
    pa, ca = a.compress(x, "w")
    pb, cb = b.compress(y, "w")  # another rank, other data, same (seed, name, step)
    assert ca.step == cb.step == 0
    idx0 = a.indices(500, "w", 0)
    assert torch.equal(idx0, b.indices(500, "w", 0))
    assert torch.equal(pa[0], x[idx0]) and torch.equal(pb[0], y[idx0])
    assert idx0.unique().numel() == 10
    assert not torch.equal(idx0, a.indices(500, "w", 1))
    assert not torch.equal(idx0, a.indices(500, "v", 0))
    assert not torch.equal(idx0, RandomK(k=10, seed=12).indices(500, "w", 0))
    _, c1 = a.compress(x, "w")
    assert c1.step == 1
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_powersgd_exact_on_low_rank_and_warm_start():
    gen = torch.Generator().manual_seed(8)
    m = torch.randn(30, 2, generator=gen) @ torch.randn(2, 20, generator=gen)
    c = make_compressor("powersgd", rank=2)
    p, ctx = c.compress(m, "w")
    assert [t.shape for t in p] == [torch.Size([30, 2]), torch.Size([20, 2])]
    assert torch.allclose(c.decompress(p, ctx), m, atol=1e-4)
    assert torch.equal(c.state_dict()["q"]["w"], p[1])  # warm start kept per name


def test_fp16_saturates_instead_of_inf():
    c = build("fp16")
    p, ctx = c.compress(torch.tensor([1e6, -1e6, 1.0]), "w")
    out = c.decompress(p, ctx)
    assert torch.isfinite(out).all() and out[0] == torch.finfo(torch.float16).max


# ---------------------------------------------------------------------------------------------
# Registry and validation
# ---------------------------------------------------------------------------------------------
def test_registry_lists_required_names():
    assert set(COMPRESSORS) == {
        "none", "2bit", "1bit", "qsgd", "terngrad", "topk", "randomk", "fp16", "bf16", "powersgd",
    }
    for name in COMPRESSORS:
        assert build(name).name == name


@pytest.mark.parametrize(
    "name, options",
    [
        ("3bit", {}),
        ("2bit", {}),
        ("2bit", {"threshold": 0.0}),
        ("2bit", {"threshold": -1.0}),
        ("2bit", {"threshold": float("nan")}),
        ("2bit", {"threshold": "0.5"}),
        ("2bit", {"threshold": 1e-50}),  # underflows to 0 in fp32
        ("2bit", {"threshold": 0.5, "thresold": 1}),
        ("topk", {}),
        ("topk", {"k": 3, "ratio": 0.1}),
        ("topk", {"ratio": 1.5}),
        ("topk", {"k": 0}),
        ("randomk", {"k": 2.5}),
        ("qsgd", {"levels": 0}),
        ("qsgd", {"levels": 1 << 20}),
        ("powersgd", {"rank": 0}),
        ("terngrad", {"seed": "x"}),
        ("1bit", {"scale": 2}),
    ],
)
def test_bad_options_raise_value_error(name, options):
    with pytest.raises(ValueError) as info:
        make_compressor(name, **options)
    if name == "3bit":
        assert "2bit" in str(info.value) and "powersgd" in str(info.value)


def test_numpy_scalars_are_valid_options():
    assert make_compressor("2bit", threshold=np.float32(0.25)).threshold == 0.25
    assert make_compressor("qsgd", levels=np.int64(3), seed=np.int64(1)).levels == 3


def test_error_feedback_needs_a_compressor():
    with pytest.raises(ValueError):
        ErrorFeedback("2bit")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ErrorFeedback(ErrorFeedback(build("2bit")))


def test_the_compressed_reducer_takes_the_codec_itself():
    """The reducer keeps one residual per bucket itself (``error_feedback=True``); a per-tensor
    ErrorFeedback in the codec's place would keep a second one, so it is refused (before the
    communicator is used)."""
    from lowband.comm.reducer import CompressedReducer
    with pytest.raises(ValueError, match="takes the codec itself"):
        CompressedReducer("allgather", None, ErrorFeedback(build("2bit")))  # type: ignore[arg-type]


def test_a_registered_codec_is_built_by_name_and_accepted_by_the_algorithms():
    import lowband
    from lowband.codecs import FP16, register
    from lowband.codecs import base as codec_base

    class Halve(FP16):
        name = "test-halve"

    try:
        assert register(Halve) is Halve
        assert "test-halve" in COMPRESSORS
        assert type(make_compressor("test-halve")) is Halve
        # the compressing algorithms check the name against the same registry
        lowband.CompressedSGD(compressor="test-halve")
        with pytest.raises(TypeError, match="Compressor subclass"):
            register(int)
    finally:
        codec_base._REGISTRY.pop("test-halve", None)
    assert "test-halve" not in COMPRESSORS


def test_the_bucket_kernel_is_an_attribute_of_the_codec():
    from lowband import _native

    assert make_compressor("2bit", threshold=0.5).kernel_kind == _native.KIND_TWOBIT
    assert make_compressor("2bit", relative=1.0).kernel_kind == _native.KIND_TWOBIT_REL
    assert make_compressor("1bit").kernel_kind == _native.KIND_ONEBIT
    assert make_compressor("fp16").kernel_kind is None
    assert ErrorFeedback(make_compressor("1bit")).kernel_kind is None      # per tensor: no bucket kernel
