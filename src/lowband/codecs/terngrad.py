"""TernGrad (Wen et al., 2017): unbiased stochastic ternarisation with scale ``max|x|``.

``b_i ~ Bernoulli(|x_i| / max|x|)``; decoded value ``max|x| * sign(x_i) * b_i`` (unbiased).
Ternary codes reuse the MXNet 2-bit layout (16 per int32 word), unlike GRACE's int8 per
element. The payload is ``[ceil(n/16) int32 words, 1 fp32 scale]``. Randomness comes from a
local generator seeded by ``(seed, name, step)``.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .base import Ctx, Payload, SteppedCompressor, as_shape, flat_fp32
from .bitpack import pack_ternary, unpack_ternary, words_for

_TINY = torch.finfo(torch.float32).tiny  # avoids 0/0 for an all-zero tensor (decodes to 0)


class TernGrad(SteppedCompressor):
    """Stochastic ternary {-s, 0, +s} with ``s = max|x|``."""

    name = "terngrad"

    def __repr__(self) -> str:
        return f"TernGrad(seed={self.seed})"

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        x = flat_fp32(tensor)
        n = x.numel()
        step = self._next_step(name)
        gen = self._generator(name, step, x.device)
        scale = x.abs().max().reshape(1) if n else torch.zeros(1, device=x.device)
        prob = x.abs().div_(scale.clamp_min(_TINY))
        keep = torch.rand(n, generator=gen, device=x.device).lt(prob)
        signs = torch.zeros(words_for(n, 2) * 16, dtype=torch.int8, device=x.device)
        signs[:n] = torch.sign(x).to(torch.int8).mul_(keep)
        return [pack_ternary(signs), scale], Ctx(tensor.shape, tensor.dtype, name, step)

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        words, scale = tensors
        out = unpack_ternary(words, ctx.numel).to(torch.float32).mul_(scale)
        return out.reshape(ctx.shape).to(ctx.dtype)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        return 4 * words_for(as_shape(shape).numel(), 2) + 4
