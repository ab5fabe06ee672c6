"""Triton kernels of the fused bucket codecs (CUDA tensors), bit-identical to ``lowband_codecs.c``.

:class:`~lowband.codecs.bucket.BucketCodec` calls :func:`encode` / :func:`decode` when the
bucket's tensors are on a CUDA device, triton imports and the kind has a kernel here (MXNet
2-bit, 1-bit with scale, scale-aware 2-bit). Each call launches a fixed number of kernels,
whatever the number of segments and chunks (runs), on the tensors' own device, and never waits
for the device: the run tables are built once per layout (per call for decode tables and skip
ranges, cached by content) and copied from pinned memory without blocking.

How the bits match the C kernel:

* Elementwise parts do the C kernel's IEEE operations in its order; kernels are launched with
  ``enable_fp_fusion=False`` (no FMA contraction), divisions are ``div_rn`` and the square root
  ``sqrt_rn`` (the fp32 correctly rounded root equals C's fp64 root rounded to fp32).
* Sums use lowband's canonical order (:mod:`lowband.codecs.sums`): every *group* of terms
  (1-bit: a chunk; scale-aware 2-bit: a scale block) is cut into rows of 256 (zero-padded), each
  row is folded in halves (``y[j] = x[j] + x[j + w]``, ``w = 128 ... 1``, by reshape / permute /
  split), and the row sums of a group are folded the same way, level after level, until one value
  is left: one launch per level (at most 4 for 2**31 elements), all groups of the bucket at once.
* Packing: codes or sign bits are shifted to their MSB-first position in the little-endian int32
  word and summed (the bits are disjoint, so the sum is exact in any order).

``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (the tests do, with
``BucketCodec._triton_on_cpu``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

try:   # triton is optional: without it, CUDA tensors take the torch path
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None
    tl = None

KIND_TWOBIT, KIND_TWOBIT_REL, KIND_ONEBIT = 0, 1, 2
KINDS = (KIND_TWOBIT, KIND_TWOBIT_REL, KIND_ONEBIT)
ROW = 256
ENC_WORDS = 32        #: packed words per encode program
DEC_BLOCK = 1024      #: decoded elements per decode program
ROWS = 4              #: 256-element rows per reduction program
_FLT_MIN = float(np.finfo(np.float32).tiny)
_CACHE_MAX = 32       #: decode tables / skip tables kept per bucket codec


def available() -> bool:
    """Whether triton imported."""
    return triton is not None


def supports(kind: Optional[int]) -> bool:
    return triton is not None and kind in KINDS


if triton is not None:

    @triton.jit
    def _half(x, R: tl.constexpr, W: tl.constexpr):
        """[R, 2W] -> [R, W]: y[:, j] = x[:, j] + x[:, j + W] (one canonical fold level)."""
        a, b = tl.split(tl.permute(tl.reshape(x, (R, 2, W)), (0, 2, 1)))
        return a + b

    @triton.jit
    def _fold256(x, R: tl.constexpr):
        """Canonical sum of each 256-element row of ``x`` ([R, 256] -> [R])."""
        x = _half(x, R, 128)
        x = _half(x, R, 64)
        x = _half(x, R, 32)
        x = _half(x, R, 16)
        x = _half(x, R, 8)
        x = _half(x, R, 4)
        x = _half(x, R, 2)
        x = _half(x, R, 1)
        return tl.reshape(x, (R,))

    @triton.jit
    def _chunk_r(g_ptr, e_ptr, src, j, valid, HAS_E: tl.constexpr):
        """r = e + g of chunk elements j (0 where not valid: padding, skipped)."""
        x = tl.load(g_ptr + src + j, mask=valid, other=0.0)
        if HAS_E:
            r = tl.load(e_ptr + src + j, mask=valid, other=0.0) + x
        else:
            r = x
        return tl.where(valid, r, 0.0)

    @triton.jit
    def _rel_threshold(sq, L, a):
        t = tl.sqrt_rn(tl.math.div_rn(sq, L.to(tl.float32))) * a
        return tl.where(t < 1.1754943508222875e-38, 1.1754943508222875e-38, t)   # NaN stays NaN

    @triton.jit(do_not_specialize=["nrows"])   # fewer compiled variants per layout
    def _rows_kernel(g_ptr, e_ptr, runs_ptr, skip_ptr, rows_ptr, groups_ptr, fin_ptr, sq_ptr, part_ptr, cnt_ptr,
                     nrows, a,
                     MODE: tl.constexpr, HAS_E: tl.constexpr, HAS_SKIP: tl.constexpr, R: tl.constexpr):
        """Level 1 of the canonical sums: the canonical sum of each 256-row of terms.
        rows: (group, first element in the group, elements); groups: (run, block start, block length).
        MODE 0: |r|; 1: r*r; 2: |r| where |r| >= t of the group (t from the MODE 1 sums at
        sq[fin[group]]), fired counts added to cnt[group]."""
        row = tl.program_id(0) * R + tl.arange(0, R)
        live = row < nrows
        grp = tl.load(rows_ptr + 3 * row, mask=live, other=0)
        j0 = tl.load(rows_ptr + 3 * row + 1, mask=live, other=0)
        m = tl.load(rows_ptr + 3 * row + 2, mask=live, other=0)
        k = tl.load(groups_ptr + 3 * grp, mask=live, other=0)
        j0 = j0 + tl.load(groups_ptr + 3 * grp + 1, mask=live, other=0)
        src = tl.load(runs_ptr + 5 * k, mask=live, other=0)
        ln = tl.load(runs_ptr + 5 * k + 1, mask=live, other=0)
        col = tl.arange(0, 256)[None, :]
        j = j0[:, None] + col
        valid = (col < m[:, None]) & (j < ln[:, None]) & live[:, None]
        if HAS_SKIP:
            lo = tl.load(skip_ptr + 2 * k, mask=live, other=0)[:, None]
            hi = tl.load(skip_ptr + 2 * k + 1, mask=live, other=0)[:, None]
            valid = valid & ((j < lo) | (j >= hi))
        r = _chunk_r(g_ptr, e_ptr, src[:, None], j, valid, HAS_E)
        if MODE == 0:
            x = tl.abs(r)
        elif MODE == 1:
            x = r * r
        else:
            L = tl.load(groups_ptr + 3 * grp + 2, mask=live, other=1)
            fin = tl.load(fin_ptr + grp, mask=live, other=0)
            sq = tl.load(sq_ptr + fin, mask=live, other=0.0)
            t = _rel_threshold(sq, L, tl.cast(a, tl.float32))[:, None]
            mag = tl.abs(r)
            fired = (mag >= t) & valid
            x = tl.where(fired, mag, 0.0)
            tl.atomic_add(cnt_ptr + grp, tl.sum(fired.to(tl.int32), axis=1), mask=live)
        tl.store(part_ptr + row, _fold256(x, R), mask=live)

    @triton.jit(do_not_specialize=["nrows"])   # fewer compiled variants per layout
    def _fold_kernel(part_ptr, level_ptr, nrows, R: tl.constexpr):
        """One later level: rows (first input, count <= 256, output) of earlier sums."""
        row = tl.program_id(0) * R + tl.arange(0, R)
        live = row < nrows
        start = tl.load(level_ptr + 3 * row, mask=live, other=0)
        m = tl.load(level_ptr + 3 * row + 1, mask=live, other=0)
        dst = tl.load(level_ptr + 3 * row + 2, mask=live, other=0)
        col = tl.arange(0, 256)[None, :]
        valid = (col < m[:, None]) & live[:, None]
        x = tl.load(part_ptr + start[:, None] + col, mask=valid, other=0.0)
        x = tl.where(valid, x, 0.0)
        tl.store(part_ptr + dst, _fold256(x, R), mask=live)

    @triton.jit(do_not_specialize=["bs"])   # fewer compiled variants per layout
    def _encode_kernel(g_ptr, e_ptr, runs_ptr, tiles_ptr, skip_ptr, out_ptr, t, bs,
                       rg_ptr, sq_ptr, sa_ptr, fin_ptr, cnt_ptr, a,
                       KIND: tl.constexpr, HAS_E: tl.constexpr, HAS_SKIP: tl.constexpr, BW: tl.constexpr):
        """Codes (2-bit: 16 a word; 1-bit: 32), residual update and scales of BW words of one run.
        tiles: (run, first word). runs: (src, len, c, dst word, dst scale word). 1-bit: the
        chunk's |r| sum at sq[fin[rg[run]]]; scale-aware: block b of the run is group rg[run] + b,
        its sums at sq/sa[fin[group]] and its fired count at cnt[group]."""
        p = tl.program_id(0)
        k = tl.load(tiles_ptr + 2 * p)
        w0 = tl.load(tiles_ptr + 2 * p + 1)
        src = tl.load(runs_ptr + 5 * k)
        ln = tl.load(runs_ptr + 5 * k + 1)
        c = tl.load(runs_ptr + 5 * k + 2)
        dw = tl.load(runs_ptr + 5 * k + 3)
        dsc = tl.load(runs_ptr + 5 * k + 4)
        out32 = out_ptr.to(tl.pointer_type(tl.int32))
        PER: tl.constexpr = 32 if KIND == 2 else 16
        wi = tl.arange(0, BW)
        ji = tl.arange(0, PER)[None, :]
        j = (w0 + wi)[:, None] * PER + ji
        valid = j < ln
        if HAS_SKIP:
            lo = tl.load(skip_ptr + 2 * k)
            hi = tl.load(skip_ptr + 2 * k + 1)
            valid = valid & ((j < lo) | (j >= hi))
        r = _chunk_r(g_ptr, e_ptr, src, j, valid, HAS_E)
        if KIND == 2:
            g0 = tl.load(rg_ptr + k)
            total = tl.load(sq_ptr + tl.load(fin_ptr + g0))
            cf = tl.maximum(c, 1).to(tl.float32)
            scale = tl.math.div_rn(total, cf)
            rb = r.to(tl.uint32, bitcast=True)
            bit = rb >> 31
            shift = (8 * (ji // 8) + 7 - (ji % 8)).to(tl.uint32)
            word = tl.sum(bit << shift, axis=1)
            if HAS_E:
                sb = scale.to(tl.uint32, bitcast=True)
                cs = ((sb & 0x7FFFFFFF) | (bit << 31)).to(tl.float32, bitcast=True)
                tl.store(e_ptr + src + j, r - cs, mask=valid)
            tl.store(out32 + dsc, scale.to(tl.int32, bitcast=True), mask=w0 == 0)
        else:
            if KIND == 0:
                tt = tl.cast(t, tl.float32)
                pos = r >= tt
                neg = r <= -tt
                if HAS_E:
                    s = pos.to(tl.float32) - neg.to(tl.float32)
                    tl.store(e_ptr + src + j, r + (-tt) * s, mask=valid)
            else:
                B = tl.where(bs > 0, bs, tl.maximum(c, 1))
                inb = j < c
                b = j // B
                grp = tl.load(rg_ptr + k) + b
                fin = tl.load(fin_ptr + grp, mask=inb, other=0)
                sq = tl.load(sq_ptr + fin, mask=inb, other=0.0)
                sa = tl.load(sa_ptr + fin, mask=inb, other=0.0)
                nf = tl.load(cnt_ptr + grp, mask=inb, other=0)
                L = tl.minimum(B, c - b * B)
                tb = _rel_threshold(sq, L, tl.cast(a, tl.float32))
                v = tl.where(nf > 0, tl.math.div_rn(sa, tl.maximum(nf, 1).to(tl.float32)), tb)
                pos = r >= tb
                neg = r <= -tb
                if HAS_E:
                    s = pos.to(tl.float32) - neg.to(tl.float32)
                    tl.store(e_ptr + src + j, r - s * v, mask=valid)
                tl.store(out32 + dsc + b, v.to(tl.int32, bitcast=True), mask=inb & (j % B == 0))
            shift = (8 * (ji // 4) + 6 - 2 * (ji % 4)).to(tl.uint32)
            code = pos.to(tl.uint32) * 3 + neg.to(tl.uint32) * 2
            word = tl.sum(code << shift, axis=1)
        nw = (c + PER - 1) // PER
        tl.store(out32 + dw + w0 + wi, word.to(tl.int32, bitcast=True), mask=(w0 + wi) < nw)

    @triton.jit(do_not_specialize=["stride", "K", "bs"])   # fewer compiled variants per layout
    def _decode_kernel(src_ptr, stride, K, runs_ptr, tiles_ptr, out_ptr, t, bs, divisor,
                       KIND: tl.constexpr, FROM_ZERO: tl.constexpr, DIVIDE: tl.constexpr, BLOCK: tl.constexpr):
        """out[dst + j] = ((0 +) d_0 + d_1 + ... + d_{K-1}) (/ divisor) for BLOCK elements of one
        decode run. tiles: (run, first element); runs: (src word, src scale word, c, dst, len)."""
        p = tl.program_id(0)
        k = tl.load(tiles_ptr + 2 * p)
        j0 = tl.load(tiles_ptr + 2 * p + 1)
        sword = tl.load(runs_ptr + 5 * k)
        sscale = tl.load(runs_ptr + 5 * k + 1)
        c = tl.load(runs_ptr + 5 * k + 2)
        dst = tl.load(runs_ptr + 5 * k + 3)
        ln = tl.load(runs_ptr + 5 * k + 4)
        src32 = src_ptr.to(tl.pointer_type(tl.int32))
        j = j0 + tl.arange(0, BLOCK)
        m = j < ln
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        q = 0
        while q < K:   # (not range(K): triton 3.6's interpreter cannot index with a scalar arg under numpy 2)
            base = q * stride
            if KIND == 2:
                sb = tl.load(src32 + base + sscale).to(tl.uint32, bitcast=True)
                wd = tl.load(src32 + base + sword + (j >> 5), mask=m, other=0).to(tl.uint32, bitcast=True)
                jj = j & 31
                bit = (wd >> (8 * (jj >> 3) + 7 - (jj & 7)).to(tl.uint32)) & 1
                d = (sb | (bit << 31)).to(tl.float32, bitcast=True)
            else:
                wd = tl.load(src32 + base + sword + (j >> 4), mask=m, other=0).to(tl.uint32, bitcast=True)
                jj = j & 15
                code = (wd >> (8 * (jj >> 2) + 6 - 2 * (jj & 3)).to(tl.uint32)) & 3
                sgn = tl.where(code == 3, 1.0, tl.where(code == 2, -1.0, 0.0))
                if KIND == 0:
                    d = sgn * tl.cast(t, tl.float32)
                else:
                    B = tl.where(bs > 0, bs, tl.maximum(c, 1))
                    v = tl.load((src32 + base + sscale + j // B).to(tl.pointer_type(tl.float32)), mask=m, other=0.0)
                    d = sgn * v
            if FROM_ZERO:
                acc = acc + d
            else:
                acc = tl.where(q == 0, d, acc + d)
            q += 1
        if DIVIDE:
            acc = tl.math.div_rn(acc, tl.cast(divisor, tl.float32))
        tl.store(out_ptr + dst + j, acc, mask=m)


# ---------------------------------------------------------------------------- host side: tables
def _tiles(count: np.ndarray, per: int, at_least_one: bool) -> np.ndarray:
    """[n_tiles, 2] int64 rows (run, first unit) covering ``count[k]`` units of run k ``per``
    units a tile (one empty tile for an empty run when ``at_least_one``)."""
    count = np.asarray(count, dtype=np.int64)
    n = -(-count // per)
    if at_least_one:
        n = np.maximum(n, 1)
    run = np.repeat(np.arange(len(count), dtype=np.int64), n)
    first = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64) if len(n) else n
    idx = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(first, n)
    return np.ascontiguousarray(np.stack([run, idx * per], axis=1).astype(np.int64)).reshape(-1, 2)


def _groups(c: np.ndarray, block: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    """Sum groups of the encode runs: ([G, 3] rows (run, block start, block length), first
    group of each run). block None: one group per run (its whole chunk, 1-bit's scale)."""
    c = np.asarray(c, dtype=np.int64)
    if block is None:
        nb = np.ones(len(c), dtype=np.int64)
        B = np.maximum(c, 1)
    else:
        B = np.full(len(c), block, dtype=np.int64) if block > 0 else np.maximum(c, 1)
        nb = -(-c // B)
    first = np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(np.int64) if len(nb) else nb
    run = np.repeat(np.arange(len(c), dtype=np.int64), nb)
    b0 = (np.arange(int(nb.sum()), dtype=np.int64) - np.repeat(first, nb)) * np.repeat(B, nb)
    L = np.minimum(np.repeat(B, nb), c[run] - b0) if len(run) else b0
    return np.stack([run, b0, L], axis=1).astype(np.int64).reshape(-1, 3), first


def _levels(L: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, int]:
    """Canonical-sum schedule of groups of ``L`` terms: level-1 rows ([n, 3]: group, first
    element, count), later levels ([n, 3]: first input, count, output index into the scratch),
    the scratch index of each group's sum, and the scratch size."""
    L = np.asarray(L, dtype=np.int64)
    G = len(L)
    n = np.maximum(-(-L // ROW), 1)
    first = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64) if G else n
    grp = np.repeat(np.arange(G, dtype=np.int64), n)
    i = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(first, n)
    rows = np.stack([grp, i * ROW, np.clip(L[grp] - i * ROW, 0, ROW)], axis=1).astype(np.int64).reshape(-1, 3)
    off, size, levels = first.copy(), int(n.sum()), []
    while G and (n > 1).any():
        act = np.nonzero(n > 1)[0]
        m = -(-n[act] // ROW)
        new = size + np.concatenate([[0], np.cumsum(m)[:-1]]).astype(np.int64)
        g = np.repeat(np.arange(len(act), dtype=np.int64), m)
        i = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(new - size, m)
        a = act[g]
        levels.append(np.stack([off[a] + i * ROW, np.minimum(n[a] - i * ROW, ROW), new[g] + i],
                               axis=1).astype(np.int64))
        size += int(m.sum())
        off[act], n[act] = new, m
    return rows, levels, off, size


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.array(arr, order="C"))   # a writable copy: the run tables are read-only
    if device.type == "cuda":   # pinned + non_blocking: the host never waits for the device
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class _Plan:
    """Device tables of one bucket codec's encode (built once per device)."""

    def __init__(self, bc, device: torch.device) -> None:
        kind, enc = bc.kind, bc.enc
        per = 32 if kind == KIND_ONEBIT else 16
        dev = lambda a: _to_device(a, device)  # noqa: E731
        self.runs = dev(bc._enc_table)
        self.tiles = dev(_tiles(-(-enc.c // per), ENC_WORDS, True))
        self.ntiles = int(self.tiles.shape[0])
        self.reduce = kind != KIND_TWOBIT
        if not self.reduce:
            return
        block = None if kind == KIND_ONEBIT else bc.bs
        groups, rg = _groups(enc.c, block)
        rows, levels, fin, size = _levels(groups[:, 2])
        self.ngroups, self.nrows, self.size = len(groups), len(rows), max(size, 1)
        self.groups, self.rg, self.rows, self.fin = dev(groups), dev(rg), dev(rows), dev(fin)
        self.levels = [(dev(lv), len(lv)) for lv in levels]

    def tensors(self) -> list:
        out = [self.runs, self.tiles]
        if self.reduce:
            out += [self.groups, self.rg, self.rows, self.fin] + [lv for lv, _ in self.levels]
        return out


def _ready(device: torch.device):
    """(an event after the tables' copies, the stream that made them) on CUDA, for streams
    other than that one; None elsewhere."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event()
    event.record(stream)
    return event, stream


def _use(ready, tensors, device: torch.device) -> None:
    """Make the current stream ready to read tables made under ``ready``: a device-side wait
    for their copies (the host never blocks) and, on a stream other than theirs,
    ``record_stream``, so the caching allocator does not hand their memory out again (the
    tables are dropped when the cache evicts them) while a kernel here may still read them."""
    if ready is None:
        return
    event, made_on = ready
    stream = torch.cuda.current_stream(device)
    stream.wait_event(event)
    if stream != made_on:
        for t in tensors:
            t.record_stream(stream)


def _plan(bc, device: torch.device) -> _Plan:
    cache = bc.__dict__.setdefault("_triton_plans", {})
    entry = cache.get(device)
    if entry is None:
        plan = _Plan(bc, device)
        entry = cache[device] = (plan, _ready(device))
    _use(entry[1], entry[0].tensors(), device)
    return entry[0]


def _cached(bc, key, device: torch.device, build):
    """``build()``'s device tensor (or tuple holding tensors), cached under ``key``."""
    cache = bc.__dict__.setdefault("_triton_tables", OrderedDict())
    if key in cache:
        cache.move_to_end(key)
        value, ready = cache[key]
        _use(ready, [v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, torch.Tensor)],
             device)
        return value
    value = build()
    cache[key] = (value, _ready(device))
    if len(cache) > _CACHE_MAX:
        cache.popitem(last=False)
    return value


def _launch(kernel, grid, *args, **meta):
    if grid[0] > 0:
        kernel[grid](*args, enable_fp_fusion=False, **meta)


# ---------------------------------------------------------------------------- entry points
def encode(bc, g: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
           skip: Optional[np.ndarray]) -> None:
    """``bc.encode`` on the device of ``g`` (flat fp32), ``residual`` (same, or None) and ``out``
    (uint8, 4-byte aligned), bit for bit as ``lb_*_encode``."""
    device, kind = g.device, bc.kind
    plan = _plan(bc, device)
    sk = None if skip is None else _cached(bc, ("skip", device, skip.tobytes()), device,
                                           lambda: _to_device(skip.astype(np.int64), device))
    has_e, has_skip = residual is not None, sk is not None
    e = residual if has_e else g
    skp = sk if has_skip else plan.runs
    t, a, bs = bc.t, bc.a, bc.bs
    if not plan.reduce:
        _launch(_encode_kernel, (plan.ntiles,), g, e, plan.runs, plan.tiles, skp, out, t, bs,
                plan.runs, g, g, plan.runs, plan.runs, a,
                KIND=kind, HAS_E=has_e, HAS_SKIP=has_skip, BW=ENC_WORDS)
        return
    nprog = (-(-plan.nrows // ROWS),)
    sq = torch.empty(plan.size, dtype=torch.float32, device=device)
    cnt = torch.zeros(max(plan.ngroups, 1), dtype=torch.int32, device=device)
    sums = [sq]
    _launch(_rows_kernel, nprog, g, e, plan.runs, skp, plan.rows, plan.groups, plan.fin, sq, sq, cnt,
            plan.nrows, a, MODE=0 if kind == KIND_ONEBIT else 1, HAS_E=has_e, HAS_SKIP=has_skip, R=ROWS)
    for lv, n in plan.levels:
        _launch(_fold_kernel, (-(-n // ROWS),), sq, lv, n, R=ROWS)
    if kind == KIND_TWOBIT_REL:
        sa = torch.empty(plan.size, dtype=torch.float32, device=device)
        # MODE 2 reads t from the sums of squares and writes the fired magnitudes' sums
        _launch(_rows_kernel, nprog, g, e, plan.runs, skp, plan.rows, plan.groups, plan.fin, sq, sa, cnt,
                plan.nrows, a, MODE=2, HAS_E=has_e, HAS_SKIP=has_skip, R=ROWS)
        for lv, n in plan.levels:
            _launch(_fold_kernel, (-(-n // ROWS),), sa, lv, n, R=ROWS)
        sums.append(sa)
    sa = sums[-1]
    _launch(_encode_kernel, (plan.ntiles,), g, e, plan.runs, plan.tiles, skp, out, t, bs,
            plan.rg, sq, sa, plan.fin, cnt, a, KIND=kind, HAS_E=has_e, HAS_SKIP=has_skip, BW=ENC_WORDS)


def decode(bc, src: torch.Tensor, sources: int, table: np.ndarray, count: int, out: torch.Tensor,
           from_zero: bool, divisor: float, stride: int) -> None:
    """``lb_decode`` on the device of ``src`` (uint8, 4-byte aligned) and ``out`` (fp32):
    ``stride`` in bytes (a multiple of 4), ``table`` the decode runs' table."""
    device, kind = out.device, bc.kind
    table = np.ascontiguousarray(table[:count], dtype=np.int64)

    def build():
        tiles = _tiles(table[:, 4], DEC_BLOCK, False)
        return _to_device(table, device), _to_device(tiles, device), len(tiles)

    runs, tiles, ntiles = _cached(bc, ("dec", device, table.tobytes()), device, build)
    t, bs = bc.t, bc.bs
    _launch(_decode_kernel, (ntiles,), src, stride // 4, sources, runs, tiles, out, t, bs, float(divisor),
            KIND=kind, FROM_ZERO=bool(from_zero), DIVIDE=float(divisor) != 1.0, BLOCK=DEC_BLOCK)
