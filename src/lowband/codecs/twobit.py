"""MXNet's 2-bit threshold quantizer (CP-SGD's codec), bit-exact and bit-packed.

Semantics (MXNet ``gradient_compression-inl.h``), per element with threshold t:
``q = +t if r >= t``, ``q = -t if r <= -t``, else ``0``; with error feedback ``e <- r - q``.
Codes travel in MXNet's wire layout, 16 per int32 word (``0b11`` = +t, ``0b10`` = -t,
``0b00`` = 0). The payload is ``ceil(n/16)`` words and nothing else, because ``t`` is
configuration known to every rank.

Threshold units: lowband gradients are local **means**, whereas MXNet thresholds **summed**
local gradients. Use ``theta_mean ~= theta_sum / local_batch``. For example, MXNet's default 0.5
at a local batch of 32 corresponds to about 0.0156 here. ``t`` is rounded to fp32 once (as
MXNet stores it), so comparisons, codes and decoded values all use the same fp32 number.

Hot path (why it looks like this): one core must encode with error feedback at >= 1 GB/s of
fp32 input. Two boolean comparisons are too slow for that, because torch writes bool outputs
slowly. So the code is derived with fast fp32 ops instead:
``y = clamp(r / t, -1, 1)`` followed by truncation toward zero. This is exactly the comparison:
``r >= t`` iff ``fl(r/t) >= 1``, because IEEE division is correctly rounded and monotone,
``t/t == 1``, and for ``r < t`` we have ``r/t <= 1 - 2**-24``. Truncation happens for free in
the fp32->int8 conversion, which produces the bytes for packing. One ``trunc_`` plus one
``add_(alpha=-t)`` then give the MXNet residual ``r - q``. The products ``t*(+-1)`` are exact,
so the result is bit-identical except that an exact ``-0.0`` residual may become ``+0.0``.
NaN inputs give code 0 (as in MXNet) and keep a NaN residual.

Scale-aware mode (lowband addition, *not* MXNet): ``relative=a`` instead of ``threshold`` fires
element i when ``|r_i| >= t = a * rms(r)`` (per compressed tensor: a bucket, or a two-stage
chunk, after the residual is added) and decodes it as ``+-v`` with ``v = mean(|r_i|)`` over the
fired elements (as ternary weight networks do), shipped as one extra fp32 like 1-bit's scale.
``v`` is the L2-optimal value for the fired set, so fired elements leave no systematic residual.
Why: a fixed ``t`` has one right value per layer and per phase of training. When ``|g| > t`` an element can send at most
``t`` per step, so its residual grows without bound and is later replayed as a stale burst (the
run diverges); when ``t >> |g|`` elements fire rarely, in large delayed bursts. Tying ``t`` to the
tensor's own RMS keeps every bucket in the regime between the two. Codes, packing and the
residual update are otherwise identical; ``threshold=`` keeps the exact MXNet semantics.
``scale_block=B`` gives every B consecutive elements their own ``t`` and ``v`` (one fp32 each):
a bucket concatenates layers whose gradient scales differ by >10x, and one scale for all of them
lets the small layers rarely fire (stale residuals) while the large ones saturate.
The RMS and the fired mean are summed in lowband's canonical order (:mod:`.sums`), so the
native bucket kernels reproduce them bit for bit; a NaN in a block makes its ``t`` and ``v``
NaN, nothing fires, and the block's residual and decoded values are NaN (caught by the guard).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from .._native import KIND_TWOBIT, KIND_TWOBIT_REL
from .base import Compressor, Ctx, Payload, as_shape, check_positive, exact_divisor, flat_fp32, scratch
from .bitpack import pack_ternary, unpack_ternary, words_for
from .sums import row_sums

CODES_PER_WORD = 16


class TwoBitQuantizer(Compressor):
    """2-bit threshold quantizer.

    Args:
        threshold: fixed ``t`` (> 0), in mean-gradient units (see module docstring): exact MXNet.
        relative: instead of ``threshold``, fire at ``t = relative * rms(r)`` and decode to the
            fired elements' mean magnitude, sent as fp32 with the codes (scale-aware mode, see
            module docstring). Give exactly one.
        scale_block: relative mode only: elements sharing one scale (None: the whole tensor).
        block_size: elements processed per cache block on CPU (rounded up to a multiple of 16).
            The default keeps the ~0.9 MiB of scratch (fp32, int8 and two int32/4 buffers) in
            L2: faster than whole-tensor passes through DRAM, and large enough that the ~15 op
            dispatches per block stay a small cost. CUDA always uses one
            block, because there kernel launches dominate.
    """

    name = "2bit"

    def __init__(
        self, threshold: float | None = None, block_size: int = 1 << 17, relative: float | None = None,
        scale_block: int | None = None,
    ) -> None:
        if (threshold is None) == (relative is None):
            raise ValueError("2bit needs exactly one of threshold=T (fixed, MXNet) or relative=A (t = A*rms)")
        check_positive("block_size", block_size, int)
        self.block_size = -(-int(block_size) // CODES_PER_WORD) * CODES_PER_WORD
        self.relative: float | None = None
        self.threshold: float | None = None
        self.scale_block: int | None = None
        if scale_block is not None:
            if relative is None:
                raise ValueError("scale_block applies to relative mode only")
            check_positive("scale_block", scale_block, int)
            self.scale_block = int(scale_block)
        if relative is not None:
            check_positive("relative", relative)
            self.relative = float(relative)
            return
        check_positive("threshold", threshold)
        self.threshold = float(np.float32(threshold))
        if not np.isfinite(self.threshold) or self.threshold == 0.0:
            raise ValueError(f"threshold {threshold!r} is not a positive finite fp32 number")

    @property
    def kernel_kind(self) -> int:
        return KIND_TWOBIT if self.relative is None else KIND_TWOBIT_REL

    def __repr__(self) -> str:
        knob = (f"relative={self.relative!r}, scale_block={self.scale_block!r}" if self.relative is not None
                else f"threshold={self.threshold!r}")
        return f"TwoBitQuantizer({knob}, block_size={self.block_size})"

    def _block(self, n: int, device: torch.device) -> int:
        return max(n, 1) if device.type != "cpu" else self.block_size

    def _blocks(self, n: int) -> int:
        """Elements per scale in relative mode."""
        return max(1, n) if self.scale_block is None else self.scale_block

    def _encode_relative(self, r: torch.Tensor, residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Relative mode on flat fp32 ``r``: (packed words, fp32 value per scale block); with
        ``residual``, ``r -= decoded`` in place. Per block: ``t = relative * rms``, floored at
        the smallest normal fp32 so an all-zero block fires nothing; ``v`` = mean fired
        magnitude (``t`` when nothing fires; then it decodes nothing anyway)."""
        n = r.numel()
        bs = self._blocks(n)
        nb = -(-n // bs)
        padded = torch.zeros(nb * bs, dtype=torch.float32, device=r.device)
        padded[:n] = r
        rows = padded.view(nb, bs)
        counts = torch.full((nb,), float(bs), device=r.device)
        counts[-1] = n - (nb - 1) * bs if n else 1.0
        signs = torch.zeros(words_for(nb * bs, 2) * CODES_PER_WORD, dtype=torch.int8, device=r.device)
        v = torch.empty(nb, dtype=torch.float32, device=r.device)
        # blocks are independent: process them a cache-sized group at a time (CPU) so the
        # intermediates stay in L2 instead of making ~10 passes over DRAM
        group = nb if r.device.type != "cpu" else max(1, self.block_size // bs)
        # sums follow lowband's canonical order (codecs/sums.py), as the native kernel does
        tiny = float(np.finfo(np.float32).tiny)
        for b0 in range(0, nb, group):
            b1 = min(nb, b0 + group)
            rr = rows[b0:b1]
            mag = rr.abs()
            # torch's vectorized fp32 sqrt is not correctly rounded (~17% of inputs off by an ulp); the
            # fp64 sqrt rounded to fp32 is, and is what the native kernel computes
            t = (row_sums(rr * rr) / counts[b0:b1]).double().sqrt_().float().mul_(self.relative)
            t.clamp_(min=tiny)                   # NaN stays NaN: then nothing fires
            tc = t[:, None]
            fired = mag >= tc
            nfired = fired.sum(1)
            vg = torch.where(nfired > 0, row_sums(torch.where(fired, mag, 0.0)) / nfired.clamp(min=1), t)
            v[b0:b1] = vg
            code = (rr >= tc).to(torch.float32).sub_((rr <= -tc).to(torch.float32))
            e0, e1 = b0 * bs, min(n, b1 * bs)
            signs[e0:e1] = code.reshape(-1)[: e1 - e0].to(torch.int8)
            if residual:
                r[e0:e1].sub_((code * vg[:, None]).reshape(-1)[: e1 - e0])
        words = pack_ternary(signs).reshape(-1)[: words_for(n, 2)]
        return words, v

    # -- core ----------------------------------------------------------------------------------
    def _encode(self, r: torch.Tensor, residual: bool, add: torch.Tensor | None = None) -> torch.Tensor:
        """Packed words of flat fp32 ``r`` (fixed threshold). If ``residual``: first ``r += add``
        (when given), then ``r -= q`` in place, block by block so the intermediates stay in cache."""
        n, t = r.numel(), self.threshold
        words = torch.empty(words_for(n, 2), dtype=torch.int32, device=r.device)
        packed = words.view(torch.uint8)
        block = self._block(n, r.device)
        y_buf = scratch.get("2bit.y", min(block, n), torch.float32, r.device)
        # one block's codes, padded to whole words (the block is the whole tensor off the CPU)
        s_buf = scratch.get("2bit.signs", words_for(min(block, n), 2) * CODES_PER_WORD, torch.int8, r.device)
        divisor = exact_divisor(t, r)
        for start in range(0, n, block):
            rb = r[start : start + block]
            k = rb.numel()
            kpad = words_for(k, 2) * CODES_PER_WORD
            if add is not None:
                rb.add_(add[start : start + k])
            y = y_buf[:k]
            torch.div(rb, divisor, out=y)
            y.clamp_(-1.0, 1.0)
            signs = s_buf[:kpad]
            if kpad > k:  # only the last block has padding; skip the dispatch otherwise
                signs[k:].zero_()
            signs[:k].copy_(y)  # fp32 -> int8 truncates toward zero: {-1, 0, +1}
            if residual:
                y.trunc_()
                rb.add_(y, alpha=-t)  # r - t*code; t*code is exact, so this is MXNet's r - q
            pack_ternary(signs, out=packed[start // 4 : (start + kpad) // 4])
        return words

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        r = flat_fp32(tensor)
        ctx = Ctx(tensor.shape, tensor.dtype, name)
        if self.relative is None:
            return [self._encode(r, residual=False)], ctx
        return list(self._encode_relative(r, residual=False)), ctx

    def compress_residual_(
        self, buf: torch.Tensor, name: str, add: torch.Tensor | None = None
    ) -> tuple[Payload, Ctx]:
        if buf.dtype != torch.float32 or not buf.is_contiguous():
            return super().compress_residual_(buf, name, add)
        flat_add = None if add is None else flat_fp32(add)
        if self.relative is None:
            words = self._encode(buf.view(-1), residual=True, add=flat_add)
            return [words], Ctx(buf.shape, buf.dtype, name)
        r = buf.view(-1)
        if flat_add is not None:   # the threshold depends on the corrected buffer: add first
            r.add_(flat_add)
        return list(self._encode_relative(r, residual=True)), Ctx(buf.shape, buf.dtype, name)

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        n = ctx.numel
        packed = tensors[0].reshape(-1).view(torch.uint8)
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
        if self.relative is not None:
            bs = self._blocks(n)
            nb = -(-n // bs)
            codes = torch.zeros(nb * bs, dtype=torch.float32, device=packed.device)
            codes[:n] = unpack_ternary(packed, n)
            out = (codes.view(nb, bs) * tensors[1].reshape(-1)[:, None]).reshape(-1)[:n]
            return out.reshape(ctx.shape).to(ctx.dtype)
        t = self.threshold
        block = self._block(n, packed.device)
        s_buf = scratch.get("2bit.dsigns", words_for(min(block, n), 2) * CODES_PER_WORD, torch.int8, packed.device)
        for start in range(0, n, block):
            ob = out[start : start + block]
            k = ob.numel()
            kpad = words_for(k, 2) * CODES_PER_WORD
            signs = unpack_ternary(packed[start // 4 : (start + kpad) // 4], k, out=s_buf[:kpad])
            ob.copy_(signs).mul_(t)
        return out.reshape(ctx.shape).to(ctx.dtype)

    def codes(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        """The int8 codes in {-1, 0, +1} of a payload (for exact integer aggregation)."""
        return unpack_ternary(tensors[0], ctx.numel).reshape(ctx.shape)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        n = as_shape(shape).numel()
        scales = 0 if self.relative is None else -(-n // self._blocks(n))   # one fp32 v per block
        return 4 * words_for(n, 2) + 4 * scales
