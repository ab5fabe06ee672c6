"""QSGD (Alistarh et al., 2017): stochastic rounding to ``levels`` uniform levels of ``|x|/||x||_2``.

Encoding: ``l_i = floor(levels * |x_i| / ||x||_2 + u_i)``, ``u_i ~ U[0, 1)``, clamped to
``levels``. Decoding: ``||x||_2 * sign(x_i) * l_i / levels``, which is unbiased. Each element
travels as ``ceil(log2(levels+1))`` level bits plus one sign bit, really bit-packed
(MSB-first stream, see :mod:`.bitpack`). The payload is
``[ceil(n*width/32) int32 words, 1 fp32 norm]``.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .base import Ctx, Payload, SteppedCompressor, as_shape, check_positive, flat_fp32
from .bitpack import bits_for_levels, pack_bits, unpack_bits, words_for

_TINY = torch.finfo(torch.float32).tiny  # avoids 0/0 for an all-zero tensor (decodes to 0)


class QSGD(SteppedCompressor):
    """QSGD with ``levels`` quantization levels (default 7: 3 level bits + 1 sign = 4 bits)."""

    name = "qsgd"

    def __init__(self, levels: int = 7, seed: int = 0) -> None:
        check_positive("levels", levels, int)
        self.levels = int(levels)
        self.level_bits = bits_for_levels(self.levels)
        self.width = self.level_bits + 1
        if self.width > 16:
            raise ValueError(f"levels={levels} needs {self.width} bits; at most 16 are supported")
        super().__init__(seed)

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, seed={self.seed})"

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        x = flat_fp32(tensor)
        step = self._next_step(name)
        gen = self._generator(name, step, x.device)
        norm = torch.linalg.vector_norm(x).reshape(1)
        level = x.abs().mul_(self.levels / norm.clamp_min(_TINY))
        level.add_(torch.rand(x.numel(), generator=gen, device=x.device)).floor_().clamp_(max=self.levels)
        code = level.to(torch.int32) | (torch.signbit(x).to(torch.int32) << self.level_bits)
        return [pack_bits(code, self.width), norm], Ctx(tensor.shape, tensor.dtype, name, step)

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        words, norm = tensors
        code = unpack_bits(words, ctx.numel, self.width)
        level = (code & ((1 << self.level_bits) - 1)).to(torch.float32)
        sign = 1.0 - 2.0 * (code >> self.level_bits).to(torch.float32)
        out = level.mul_(sign).mul_(norm / self.levels)
        return out.reshape(ctx.shape).to(ctx.dtype)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        return 4 * words_for(as_shape(shape).numel(), self.width) + 4
