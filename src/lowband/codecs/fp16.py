"""Half-precision casts: fp16 and bf16 (2 bytes per element, 2x smaller than fp32).

fp16 saturates at +-65504. Values beyond that are clamped to the largest finite fp16 instead
of becoming inf, because an inf would turn the error-feedback residual into -inf/NaN forever.
bf16 has the fp32 exponent range, so it needs no clamp.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .base import Compressor, Ctx, Payload, as_shape, flat_fp32


class _Cast(Compressor):
    wire_dtype: torch.dtype

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        return [self._cast(flat_fp32(tensor))], Ctx(tensor.shape, tensor.dtype, name)

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.wire_dtype)

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        return tensors[0].reshape(ctx.shape).to(ctx.dtype)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        return as_shape(shape).numel() * torch.empty((), dtype=self.wire_dtype).element_size()


class FP16(_Cast):
    """IEEE half precision with saturation at the largest finite fp16."""

    name = "fp16"
    wire_dtype = torch.float16

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        limit = torch.finfo(torch.float16).max
        return x.clamp(-limit, limit).to(torch.float16)


class BF16(_Cast):
    """bfloat16 (fp32 range, 8 mantissa bits)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
