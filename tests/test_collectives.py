"""Compressed reducers (gloo) against plain all-reduce and against a slow per-chunk reference.

The reference (``_reference``) follows the collectives' definition literally: every rank's
segments zero-padded to N chunks, each chunk compressed on its own by the per-tensor codec with
its residual, the owner decoding and averaging the N versions, re-compressing with its server
residual, every rank decoding the owners' chunks. Each rank can compute it for all ranks
(inputs are seeded), so a rank checks the real collective bit for bit against it.

Spawning a process group costs seconds, so each world size is spawned once per kernel mode
(``_all_checks``) and the tests assert on its cached results."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lowband.comm.communicator import Communicator
from lowband import _native as kernels
from lowband.codecs import make_compressor
from lowband.comm.reducer import make_reducer

from .distributed import run_distributed

SIZES = [1, 7, 16, 33, 1000, 4099]
SEGMENTS = [("w1", 1), ("w2", 37), ("w3", 1000), ("w4", 16), ("w5", 4099), ("w6", 5)]
CODECS = [("2bit", {"threshold": 0.5}), ("2bit", {"relative": 1.0, "scale_block": 256}),
          ("2bit", {"relative": 0.8, "scale_block": 100}), ("1bit", {})]
ALLGATHER_EXTRA = [("randomk", {"ratio": 0.25})]
BYTES_CASES = [("2bit", {"threshold": 0.01}, 1 / 12), ("2bit", {"relative": 1.0, "scale_block": 256}, 1 / 12),
               ("1bit", {}, 1 / 24)]
BYTES_N, BYTES_WORLD = 1_000_003, 4
STEPS = 3


def _inputs(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(97 * rank + 13 * step + n))


def _chunk_encode(codec, e_seg, g_seg, lo, c, name):
    """Per-chunk error-feedback encode of real elements [lo, lo+c) of one segment (zero-padded)."""
    n = max(0, min(c, g_seg.numel() - lo))
    buf, add = torch.zeros(c), torch.zeros(c)
    buf[:n], add[:n] = e_seg[lo:lo + n], g_seg[lo:lo + n]
    payload, ctx = codec.compress_residual_(buf, name, add=add)
    e_seg[lo:lo + n] = buf[:n]
    return payload, ctx


def _reference(kind: str, world: int, codec_name: str, options: dict, segments, steps):
    """Every rank's output of every step, by the definition (see the module docstring)."""
    workers = [make_compressor(codec_name, **options) for _ in range(world)]
    servers = [make_compressor(codec_name, **options) for _ in range(world)]
    e_w = [{s: torch.zeros(n) for s, n in segments} for _ in range(world)]
    e_s = [{s: torch.zeros(-(-n // world)) for s, n in segments} for _ in range(world)]
    outs = []
    for step in range(steps):
        xs = [_inputs(r, step, sum(n for _, n in segments)) for r in range(world)]
        out, offset = [], 0
        for s, n in segments:
            gs = [x[offset:offset + n] for x in xs]
            offset += n
            if kind == "allgather":
                pls = [_chunk_encode(workers[r], e_w[r][s], gs[r], 0, n, s) for r in range(world)]
                total = torch.zeros(n)
                for pl, ctx in pls:
                    total += workers[0].decompress(pl, ctx).reshape(-1)
                out.append(total / world)
                continue
            c = -(-n // world)
            pls = [[_chunk_encode(workers[r], e_w[r][s], gs[r], i * c, c, f"{s}/chunk{i}") for i in range(world)]
                   for r in range(world)]
            full = torch.zeros(world * c)
            for i in range(world):   # owner i
                avg = torch.zeros(c)
                for r in range(world):
                    pl, ctx = pls[r][i]
                    avg += workers[i].decompress(pl, ctx).reshape(-1)
                avg /= world
                buf = e_s[i][s]
                spl, sctx = servers[i].compress_residual_(buf, f"{s}/server", add=avg)
                full[i * c:(i + 1) * c] = servers[i].decompress(spl, sctx).reshape(-1)
            out.append(full[:n])
        outs.append(torch.cat(out))
    return outs


def _identity(rank: int, world: int):
    out = []
    for kind in ("allgather", "two-stage"):
        red = make_reducer(kind, Communicator(), make_compressor("none"), error_feedback=False)
        for n in SIZES:
            x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n))
            ref = x.clone()
            dist.all_reduce(ref)
            ref /= world
            out.append((kind, n, float((red.start(x, f"t{n}").wait() - ref).abs().max())))
        red.close()
    return out


def _matches_reference(rank: int, world: int, kind: str, codec: str, options: dict):
    comm = Communicator()
    red = make_reducer(kind, comm, make_compressor(codec, **options))
    total = sum(n for _, n in SEGMENTS)
    got = [red.start(_inputs(rank, step, total), "b", SEGMENTS).wait() for step in range(STEPS)]
    ref = _reference(kind, world, codec, options, SEGMENTS, STEPS)
    state = red.state_dict()
    red.close()
    same = [torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, ref)]
    return same, comm.stats.snapshot()["by_op"], sorted(state["worker"])


def _present_and_exact(rank: int, world: int, kind: str):
    """present flags travel with the payload; absent segments keep their residual; exact ranges
    are the fp32 average and leave their residual alone."""
    red = make_reducer(kind, Communicator(), make_compressor("2bit", threshold=0.3))
    segs = [("a", 40), ("b", 33), ("c", 50)]
    red.start(_inputs(rank, 0, 123), "b", segs).wait()
    e0 = red.state_dict()["worker"]
    x = _inputs(rank, 1, 123)
    x[40:73] *= float(rank == 0)
    x[73:] = 0
    h = red.start(x, "b", segs, present=torch.tensor([True, rank == 0, False]))
    h.wait()
    e1 = red.state_dict()["worker"]
    kept = torch.equal(e1["c"], e0["c"]) and (rank == 0 or torch.equal(e1["b"], e0["b"]))
    y = _inputs(rank, 2, 123)
    lo, hi = 10, 60
    out = red.start(y, "b", segs, exact=(lo, hi)).wait()
    if red._buckets["b"].plan.inline_exact:    # in the bucket's message: summed in rank order
        exact_ref = _rank_order_mean([_inputs(r, 2, 123)[lo:hi] for r in range(world)])
    else:                                      # an fp32 all-reduce beside it
        exact_ref = y[lo:hi].clone()
        dist.all_reduce(exact_ref)
        exact_ref /= world
    e2 = red.state_dict()["worker"]
    red.close()
    flat1, flat2 = torch.cat([e1[s] for s, _ in segs]), torch.cat([e2[s] for s, _ in segs])
    return (h.present.tolist(), torch.equal(out[lo:hi], exact_ref), kept,
            torch.equal(flat1[lo:hi], flat2[lo:hi]), not torch.equal(flat1[hi:], flat2[hi:]))


def _rank_order_mean(xs: list) -> torch.Tensor:
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = acc + x
    return acc / len(xs)


EXACT_SEGMENTS = [("w1", 300), ("b1", 7), ("w2", 1001), ("b2", 1)]
FIXED = [False, True, False, True]


def _exact_segments(rank: int, world: int, kind: str):
    """A bucket with exact (never compressed) segments against a bucket of only its compressed
    segments: the codes, residuals and exact share agree bit for bit, the exact segments are
    the rank-order fp32 mean, and the whole bucket is one collective per step where the plan
    carries exact values inline."""
    def codec():
        return make_compressor("2bit", relative=1.0, scale_block=64)
    comm_a, comm_b = Communicator(), Communicator()
    mixed, plain = make_reducer(kind, comm_a, codec()), make_reducer(kind, comm_b, codec())
    coded = [s for s, f in zip(EXACT_SEGMENTS, FIXED) if not f]
    n = sum(k for _, k in EXACT_SEGMENTS)
    w_idx = torch.cat([torch.arange(o, o + k) for (_, k), o, f in
                       zip(EXACT_SEGMENTS, [0, 300, 307, 1308], FIXED) if not f])
    b_idx = torch.tensor([300, 301, 302, 303, 304, 305, 306, 1308])
    checks = []
    for step in range(3):
        xs = [_inputs(r, step, n) for r in range(world)]
        # step 2 also sends an exact share across w1's tail, b1 and w2's head
        ea, eb = ((250, 320), (250, 313)) if step == 2 else (None, None)
        a = mixed.start(xs[rank], "b", EXACT_SEGMENTS, exact_segments=FIXED, exact=ea, flush_exact=True).wait()
        b = plain.start(xs[rank][w_idx], "b", coded, exact=eb, flush_exact=True).wait()
        inline = mixed._buckets["b"].plan.inline_exact
        # an exact share outside the message is a gloo all-reduce, whose summation order
        # depends on its length: equal to rounding only
        same = (lambda u, v: torch.equal(u, v)) if inline or step < 2 else (
            lambda u, v: torch.allclose(u, v, rtol=1e-6, atol=1e-6))
        checks.append(same(a[w_idx], b))
        checks.append(same(a[b_idx], _rank_order_mean([x[b_idx] for x in xs])))
    sa, sb = mixed.state_dict()["worker"], plain.state_dict()["worker"]
    sa = {k: v for k, v in sa.items() if k in ("w1", "w2", "b1", "b2")}
    mixed.close()
    plain.close()
    same_residuals = sorted(sa) == sorted(sb) == ["w1", "w2"] and all(torch.equal(sa[k], sb[k]) for k in sa)
    return checks, same_residuals, inline, comm_a.stats.snapshot()["by_op"]


NONFINITE_SEGMENTS = [("w1", 300), ("b1", 7), ("w2", 1001), ("b2", 1), ("w3", 517)]
NONFINITE_FIXED = [False, True, False, True, False]
OFFSETS = [0, 300, 307, 1308, 1309]
# (step, rank, element, value): a coded element, the exact share, a fixed segment, a segment the
# rank has no gradient for (present False), two ranks at once; step 6 holds huge finite values
# whose sums overflow (no mark); steps 0 and 7 are clean
BAD = [(1, 0, 5, float("nan")), (2, 1, 1400, float("inf")), (3, 0, 260, float("-inf")),
       (4, 1, 303, float("nan")), (5, 0, 1500, float("nan")), (5, 1, 20, float("inf"))]
ABSENT_STEP, ABSENT_RANK = 5, 0          # w3 absent on rank 0 at step 5, where its NaN sits
HUGE_STEP = 6


def _nonfinite_marks(rank: int, world: int, kind: str, codec: str, options: dict):
    """The reducer's ``check_finite`` marks (every rank's bad segments, from the message) against
    the slow reference: per rank and segment, ``torch.isfinite(x[segment]).all()``. Covers
    the scale proof (scale-aware 2-bit, 1-bit), the sum (MXNet 2-bit), the exact share, fixed
    and absent segments, and overflowing finite sums."""
    import lowband.comm.plans as collective
    red = make_reducer(kind, Communicator(), make_compressor(codec, **options))
    n = sum(k for _, k in NONFINITE_SEGMENTS)
    got, want, exact_tests = [], [], []
    exact_test = collective.nonfinite_segments
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return exact_test(*args)
    collective.nonfinite_segments = counted
    clean = None
    for step in range(8):
        if clean is not None:     # a NaN leaves NaN residuals: every step starts from step 0's
            red.load_state_dict(clean)
        xs = [_inputs(r, step, n) for r in range(world)]
        for s, r, i, v in BAD:
            if s == step and r < world:
                xs[r][i] = v
        if step == HUGE_STEP:
            for x in xs:
                x[310:1300] *= 3e37         # |x| < 1.3e38: finite; sums of 256 overflow
        present = torch.ones(len(NONFINITE_SEGMENTS), dtype=torch.bool)
        if step == ABSENT_STEP and rank == ABSENT_RANK:
            present[4] = False
        h = red.start(xs[rank], "b", NONFINITE_SEGMENTS, exact=(250, 320) if step in (2, 3) else None,
                      present=present, exact_segments=NONFINITE_FIXED, check_finite=True)
        h.wait()
        clean = red.state_dict() if step == 0 else clean
        exact_tests.append(calls[0])
        calls[0] = 0
        ref = np.array([[not bool(torch.isfinite(x[o:o + k]).all()) for o, (_, k) in zip(OFFSETS, NONFINITE_SEGMENTS)]
                        for x in xs])
        got.append(None if h.nonfinite is None else h.nonfinite.tolist())
        want.append(ref.tolist() if ref.any() else None)
    red.close()
    collective.nonfinite_segments = exact_test
    return got, want, exact_tests


def _in_place(rank: int, world: int, kind: str):
    """``start(..., copy=False, in_place=True)`` writes the average into the input tensor itself
    and returns it, with the same bits (outputs, flags, residuals) as a new output; with an
    exact share (inline or in an all-reduce beside the message), exact segments and a segment
    absent on some ranks."""
    def codec():
        return make_compressor("2bit", relative=1.0, scale_block=64)
    fresh, in_place = make_reducer(kind, Communicator(), codec()), make_reducer(kind, Communicator(), codec())
    n = sum(k for _, k in EXACT_SEGMENTS)
    checks = []
    for step in range(4):
        x = _inputs(rank, step, n)
        kw = dict(exact_segments=FIXED, exact=(250, 320) if step == 2 else None, flush_exact=True,
                  present=torch.tensor([True, True, rank == 0 or step != 1, True]), check_finite=True)
        a = fresh.start(x.clone(), "b", EXACT_SEGMENTS, **kw)
        buffer = x.clone()
        b = in_place.start(buffer, "b", EXACT_SEGMENTS, copy=False, in_place=True, **kw)
        want, got = a.wait(), b.wait()
        checks.append((got.data_ptr() == buffer.data_ptr(), torch.equal(buffer, want),
                       torch.equal(b.present, a.present)))
    sa, sb = fresh.state_dict()["worker"], in_place.state_dict()["worker"]
    fresh.close()
    in_place.close()
    refused = []
    for bad in (dict(copy=True), dict(copy=False, tensor=torch.zeros(n, dtype=torch.float64))):
        try:
            in_place.start(bad.pop("tensor", torch.zeros(n)), "b", EXACT_SEGMENTS, in_place=True, **bad)
        except ValueError:
            refused.append(True)
    return checks, sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), refused


def _sources(rank: int, world: int, kind: str, codec_name: str, options: dict):
    """``start(..., copy=False, sources=...)``: segments whose values are in tensors of their own
    (the bucket holds garbage there) give the outputs, flags and residuals of the flat bucket,
    bit for bit; with ``in_place`` the average of those segments is written into their tensors
    and the rest into the bucket. Covers an exact segment given a source (copied in), a segment
    absent on some ranks, an exact share (step 2: every source copied in) and a NaN (step 3)."""
    def codec():
        return make_compressor(codec_name, **options)
    flat, by_ref, by_ref_in_place = (make_reducer(kind, Communicator(), codec()) for _ in range(3))
    n = sum(k for _, k in EXACT_SEGMENTS)
    offsets = np.concatenate([[0], np.cumsum([k for _, k in EXACT_SEGMENTS])[:-1]]).tolist()
    checks = []
    for step in range(4):
        x = _inputs(rank, step, n)
        if step == 3 and rank == world - 1:
            x[offsets[2] + 5] = float("nan")
        kw = dict(exact_segments=FIXED, exact=(250, 320) if step == 2 else None, flush_exact=True,
                  present=torch.tensor([True, True, rank == 0 or step != 1, True]), check_finite=True)
        want = flat.start(x.clone(), "b", EXACT_SEGMENTS, **kw)
        got = []
        for red, in_place in ((by_ref, False), (by_ref_in_place, True)):
            bucket, sources = x.clone(), []
            for (name, k), o in zip(EXACT_SEGMENTS, offsets):
                moved = name != "b2"          # b1 is exact: copied into the bucket by start()
                sources.append(x[o:o + k].clone() if moved else None)
                if moved:
                    bucket[o:o + k] = 1e30
            h = red.start(bucket, "b", EXACT_SEGMENTS, copy=False, in_place=in_place, sources=sources, **kw)
            got.append((h, bucket, sources))
        w = want.wait()
        for (h, bucket, sources), in_place in zip(got, (False, True)):
            out = h.wait()
            if in_place:
                out = bucket.clone()
                for t, o, fixed in zip(sources, offsets, FIXED):
                    if t is not None and not fixed and step != 2:   # (else copied in, averaged in the bucket)
                        out[o:o + t.numel()] = t
            checks.append((_same_values(out, w),
                           torch.equal(h.present, want.present),
                           _same_marks(getattr(h, "nonfinite", None), getattr(want, "nonfinite", None))))
    states = [r.state_dict()["worker"] for r in (flat, by_ref, by_ref_in_place)]
    refused = []
    whole = [None] * len(EXACT_SEGMENTS)
    for bad in (dict(copy=True, sources=whole), dict(copy=False, sources=whole[1:]),
                dict(copy=False, sources=[torch.zeros(299)] + whole[1:])):
        try:
            by_ref.start(torch.zeros(n), "b", EXACT_SEGMENTS, **bad)
        except ValueError as e:
            refused.append(str(e).split(" ")[0])
    for r in (flat, by_ref, by_ref_in_place):
        r.close()
    same_residuals = all(sorted(s) == sorted(states[0]) and all(_same_values(s[k], states[0][k]) for k in s)
                         for s in states[1:])
    return checks, same_residuals, refused


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _same_marks(a, b) -> bool:
    return (a is None) == (b is None) and (a is None or np.array_equal(a, b))


def _bytes(rank: int, world: int, codec: str, options: dict, n: int):
    comm = Communicator()
    red = make_reducer("two-stage", comm, make_compressor(codec, **options))
    red.start(torch.randn(n), "g").wait()
    red.close()
    return comm.stats.bytes_sent


def _all_checks(rank: int, world: int, mode: str) -> dict:
    os.environ[kernels.ENV] = mode
    out = {"identity": _identity(rank, world)}
    for kind in ("allgather", "two-stage"):
        for codec, options in CODECS + (ALLGATHER_EXTRA if kind == "allgather" else []):
            out[(kind, codec, repr(options))] = _matches_reference(rank, world, kind, codec, options)
        out[("present", kind)] = _present_and_exact(rank, world, kind)
        out[("exact_segments", kind)] = _exact_segments(rank, world, kind)
        out[("in_place", kind)] = _in_place(rank, world, kind)
        for codec, options in CODECS:
            out[("sources", kind, codec, repr(options))] = _sources(rank, world, kind, codec, options)
        for codec, options in CODECS:
            out[("nonfinite", kind, codec, repr(options))] = _nonfinite_marks(rank, world, kind, codec, options)
    if world == BYTES_WORLD and mode == "auto":
        for codec, options, _ in BYTES_CASES:
            out[("bytes", codec, repr(options))] = _bytes(rank, world, codec, options, BYTES_N)
    return out


@functools.lru_cache(maxsize=None)
def _results(world: int, mode: str) -> list[dict]:
    return run_distributed(_all_checks, world, mode)


WORLDS = [(2, "auto"), (3, "auto"), (4, "auto"), (3, "torch")]


@pytest.mark.parametrize("world, mode", WORLDS)
def test_identity_compressor_equals_allreduce(world, mode):
    for rank_result in (r["identity"] for r in _results(world, mode)):
        for name, n, err in rank_result:
            assert err < 1e-6, (name, n, err)


@pytest.mark.parametrize("world, mode", WORLDS)
@pytest.mark.parametrize("kind", ["allgather", "two-stage"])
def test_reducer_equals_per_chunk_reference_bit_for_bit(world, mode, kind):
    results = _results(world, mode)
    keys = [k for k in results[0] if isinstance(k, tuple) and k[0] == kind]
    assert keys
    for k in keys:
        for same, by_op, names in (r[k] for r in results):
            assert all(same), (k, same)
            assert names == [s for s, _ in SEGMENTS]        # residuals keyed by parameter name
            op = "all_gather" if kind == "allgather" else "all_to_all"
            assert by_op[op][0] == STEPS                     # one collective per call, not per segment


@pytest.mark.parametrize("world, mode", WORLDS)
@pytest.mark.parametrize("kind", ["allgather", "two-stage"])
def test_present_flags_and_exact_ranges(world, mode, kind):
    for flags, exact_ok, absent_kept, exact_kept, rest_moved in (r[("present", kind)] for r in _results(world, mode)):
        assert flags == [True, True, False]
        assert exact_ok
        assert absent_kept          # residuals of segments absent on this rank are untouched
        assert exact_kept           # ... and of the exact range
        assert rest_moved           # while the compressed elements' residuals evolve


@pytest.mark.parametrize("world, mode", WORLDS)
@pytest.mark.parametrize("kind", ["allgather", "two-stage"])
def test_exact_segments_ride_in_the_bucket_message(world, mode, kind):
    for checks, same_residuals, inline, by_op in (r[("exact_segments", kind)] for r in _results(world, mode)):
        assert all(checks), checks
        assert same_residuals       # exact segments keep no residual; the coded ones are unchanged
        assert inline == (kind == "two-stage" or world <= 2)
        ops = {"allgather": ["all_gather"], "two-stage": ["all_to_all", "all_gather"]}[kind]
        assert all(by_op[op][0] == 3 for op in ops), by_op
        # the exact share of step 2 needs an all-reduce of its own only where it is not inline
        assert by_op.get("all_reduce", [0])[0] == (0 if inline else 1), by_op


@pytest.mark.parametrize("world, mode", WORLDS)
@pytest.mark.parametrize("kind", ["allgather", "two-stage"])
def test_in_place_average_writes_the_same_bits_into_the_input(world, mode, kind):
    for checks, same_residuals, refused in (r[("in_place", kind)] for r in _results(world, mode)):
        assert all(all(c) for c in checks), checks
        assert same_residuals
        assert refused == [True, True]      # a copied or non-fp32 input cannot take the average


def _codec_keys(results: list[dict], check: str, kind: str) -> list[tuple]:
    """The result keys of one per-codec ``check`` of collective ``kind``: one per codec."""
    keys = [k for k in results[0] if isinstance(k, tuple) and k[:2] == (check, kind)]
    assert len(keys) == len(CODECS)
    return keys


@pytest.mark.parametrize("world, mode", WORLDS)
@pytest.mark.parametrize("kind", ["allgather", "two-stage"])
def test_segments_read_where_they_are_and_averaged_back_there_equal_the_flat_bucket(world, mode, kind):
    results = _results(world, mode)
    for k in _codec_keys(results, "sources", kind):
        for checks, same_residuals, refused in (r[k] for r in results):
            assert all(all(c) for c in checks), (k, checks)
            assert same_residuals, k
            # a copied input, a source list of the wrong length, a source of the wrong size
            assert refused == ["sources", "sources", "source"], refused


@pytest.mark.parametrize("codec, options, bound", BYTES_CASES)
def test_two_stage_bytes_per_rank_at_4_workers(codec, options, bound):
    sent = [r[("bytes", codec, repr(options))] for r in _results(BYTES_WORLD, "auto")]
    ring = 2 * (BYTES_WORLD - 1) / BYTES_WORLD * 4 * BYTES_N
    for s in sent:
        assert s <= bound * ring, (s / ring)


@pytest.mark.parametrize("world, mode", WORLDS)
@pytest.mark.parametrize("kind", ["allgather", "two-stage"])
def test_nonfinite_marks_equal_the_per_segment_reference(world, mode, kind):
    results = _results(world, mode)
    for k in _codec_keys(results, "nonfinite", kind):
        proved = mode == "auto" and "threshold" not in k[3]     # native kernels, a codec with scales
        for rank, (got, want, exact_tests) in enumerate(r[k] for r in results):
            assert got == want, k
            assert sum(w is not None for w in want) == 5     # steps 1-5 hold a bad value, 0, 6, 7 none
            # the scales prove clean steps finite; only a bad value on this rank (or an overflow)
            # pays for the exact test. Without a proof every step runs it.
            mine = [any(s == step and r == rank for s, r, _, _ in BAD) or step == HUGE_STEP for step in range(8)]
            assert exact_tests == ([int(m) for m in mine] if proved else [1] * 8), (k, exact_tests)


@pytest.mark.parametrize("seed", range(12))
def test_flag_bytes_native_equal_the_numpy_path(seed, monkeypatch):
    """The flag bytes written into every section and read back from every row (present OR,
    per-row non-finite marks, the all-clean shortcut), natively and through numpy views."""
    from lowband.comm import plans as cc
    from lowband.codecs.bucket import ChunkedLayout, _ChunkFormat
    if kernels.library() is None or not kernels.library().has_flags:
        pytest.fail("native kernels with the flag functions missing (reinstall with a C compiler)")
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 9))
    lay = ChunkedLayout.build([(f"s{i}", int(rng.integers(1, 300))) for i in range(S)], int(rng.integers(1, 4)),
                              _ChunkFormat(make_compressor("2bit", relative=1.0)))
    rows = int(rng.integers(1, 5))
    flags = None if seed % 3 == 0 else rng.random(S) < 0.7
    bad = None if seed % 2 == 0 else rng.random(S) < 0.3
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(kernels, "mode", lambda: "torch")
        send = torch.full((lay.chunks * lay.section,), 0xAB, dtype=torch.uint8)
        cc._write_flags(send, lay, flags, bad)
        # a message of `rows` sections (the first is this rank's), `stride` bytes apart
        stride = lay.section + 8
        msg = torch.zeros(rows * stride, dtype=torch.uint8)
        for r in range(rows):
            msg[r * stride:r * stride + lay.section] = send[:lay.section]
        if rows > 1 and seed % 4 == 1:      # another rank lacks a segment and marks one bad
            msg[stride + lay.flag_off] = 0
            msg[stride + lay.flag_off + S - 1] |= cc.NONFINITE_FLAG
        present, marks = cc._read_flags(msg, lay, stride)
        results.append((send.clone(), present, None if marks is None else marks.copy()))
    (s1, p1, m1), (s2, p2, m2) = results
    assert torch.equal(s1, s2)
    assert np.array_equal(p1, p2) and p1.dtype == p2.dtype == bool
    assert (m1 is None) == (m2 is None) and (m1 is None or np.array_equal(m1, m2))
    # against the obvious reading
    byte = np.full(S, cc.PRESENT_FLAG, np.uint8) if flags is None else flags.astype(np.uint8)
    if bad is not None:
        byte |= bad.astype(np.uint8) * cc.NONFINITE_FLAG
    assert np.array_equal(s1.numpy().reshape(-1, lay.section)[:, lay.flag_off:lay.flag_off + S],
                          np.tile(byte, (lay.chunks, 1)))
    assert not s1.numpy().reshape(-1, lay.section)[:, lay.flag_off + S:].any()


def _pair_gathers(rank: int, world: int) -> list:
    """Three all_gathers of different sizes in flight at once, waited in another order,
    then one more after them; with each rank's data on its own values."""
    comm = Communicator()
    sizes = (5, 117_000, 3)
    outs, works = [], []
    for k, n in enumerate(sizes):
        out = torch.empty(world * n)
        works.append(comm.all_gather(out, torch.full((n,), 10.0 * k + rank), async_op=True))
        outs.append(out)
    for w in (works[2], works[0], works[1]):
        w.wait()
    last = torch.empty(world * 4)
    comm.all_gather(last, torch.arange(4.0) + 100 * rank)
    return [comm._pair_gather, [o.view(world, -1).clone() for o in outs], last]


def test_two_gloo_ranks_gather_by_a_tagged_pair_of_messages():
    """At two gloo ranks all_gather is an isend/irecv pair (docs/netem.md): several in flight at
    once, waited in any order, each lands in its own output; at three ranks it is gloo's own."""
    for rank, (paired, outs, last) in enumerate(run_distributed(_pair_gathers, 2)):
        assert paired
        for k, out in enumerate(outs):
            assert torch.equal(out, torch.stack([torch.full((out.shape[1],), 10.0 * k + r) for r in range(2)])), (rank, k)
        assert torch.equal(last, torch.cat([torch.arange(4.0), torch.arange(4.0) + 100]))
    three = run_distributed(_pair_gathers, 3)
    assert not any(paired for paired, _, _ in three)
    assert torch.equal(three[2][2], torch.cat([torch.arange(4.0) + 100 * r for r in range(3)]))
