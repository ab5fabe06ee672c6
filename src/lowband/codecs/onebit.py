"""1-bit sign compression with one fp32 scale, 32 signs per int32 word.

Decoded value: ``scale * sign(x_i)``, with ``scale = mean(|x|) = ||x||_1 / n``.
Why this scale: for fixed signs ``s_i = sign(x_i)``, the L2 error ``||x - a*s||^2`` is minimised
at ``a = <x, s> / <s, s> = sum|x_i| / n``. DeepSpeed's ``||x||_2 / sqrt(n)`` is never smaller
(Cauchy-Schwarz), so it overshoots. Unlike GRACE, which sends one uint8 per sign, the signs
are really bit-packed. The payload is ``[ceil(n/32) int32 words, 1 fp32 scale]``.

The sign is the IEEE sign bit: ``+0.0`` decodes to ``+scale`` and ``-0.0`` to ``-scale``. We
read it straight from the top byte of each float, which is cheaper than ``torch.signbit``.
The scale is non-negative, so decoding ORs the packed sign bit into the scale's bit pattern.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .._native import KIND_ONEBIT
from .base import Compressor, Ctx, Payload, as_shape, exact_divisor, flat_fp32, scratch
from .bitpack import pack_1bit, unpack_1bit, words_for
from .sums import canonical_sum

SIGN_BYTE = 3  #: index of the byte holding the sign bit in a little-endian fp32
SIGN_SHIFT = 7  #: position of the sign bit inside that byte
SIGN_BIT = 31  #: position of the sign bit inside an fp32 word


class OneBitSign(Compressor):
    """Sign with L2-optimal scale ``mean|x|`` (stateless, deterministic)."""

    name = "1bit"

    @property
    def kernel_kind(self) -> int:
        return KIND_ONEBIT

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        x = flat_fp32(tensor).contiguous()
        n = x.numel()
        npad = words_for(n, 1) * 32
        bits = scratch.get("1bit.bits", npad, torch.uint8, x.device)
        bits[n:].zero_()
        torch.bitwise_right_shift(x.view(torch.uint8)[SIGN_BYTE::4], SIGN_SHIFT, out=bits[:n])
        magnitude = torch.abs(x, out=scratch.get("1bit.abs", n, torch.float32, x.device))
        total = canonical_sum(magnitude)                            # canonical order (sums.py)
        scale = (total / exact_divisor(float(max(n, 1)), total)).reshape(1)
        return [pack_1bit(bits), scale], Ctx(tensor.shape, tensor.dtype, name)

    def compress_residual_(
        self, buf: torch.Tensor, name: str, add: torch.Tensor | None = None
    ) -> tuple[Payload, Ctx]:
        if add is not None:
            buf.add_(add.reshape(buf.shape))
        payload, ctx = self.compress(buf, name)
        # decode(payload) == copysign(scale, buf) exactly (same sign bit), without unpacking
        flat = buf.view(-1)
        flat.sub_(torch.copysign(payload[1], flat))
        return payload, ctx

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        words, scale = tensors
        # Build the floats directly: sign bit from the packed bit, magnitude bits from scale.
        out = unpack_1bit(words, ctx.numel).to(torch.int32)
        out.bitwise_left_shift_(SIGN_BIT).bitwise_or_(scale.view(torch.int32))
        return out.view(torch.float32).reshape(ctx.shape).to(ctx.dtype)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        return 4 * words_for(as_shape(shape).numel(), 1) + 4
