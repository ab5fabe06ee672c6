"""Top-k sparsification: the ``k`` largest-magnitude entries travel as (fp32 values, int32 indices).

``k`` is fixed for a given numel (``k`` or ``ceil(ratio * n)``, at least 1, at most n), so
payloads have fixed sizes and can be all-gathered directly. Ties are broken by
``torch.topk``. The payload is ``[k fp32 values, k int32 indices]``, i.e. ``8k`` bytes.
Selection is per tensor (layer-wise), not global; see GRACE issue #9.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from .base import Compressor, Ctx, Payload, as_shape, check_positive, flat_fp32


def resolve_k(n: int, k: int | None, ratio: float | None) -> int:
    """Number of kept entries for ``n`` elements: ``min(n, k)`` or ``max(1, ceil(ratio*n))``."""
    if n == 0:
        return 0
    if k is not None:
        return min(n, k)
    assert ratio is not None
    return min(n, max(1, math.ceil(ratio * n)))


def check_k_ratio(k: int | None, ratio: float | None) -> None:
    """Exactly one of ``k`` (positive int) or ``ratio`` (in (0, 1]) must be given."""
    if (k is None) == (ratio is None):
        raise ValueError(f"give exactly one of k or ratio (got k={k!r}, ratio={ratio!r})")
    if k is not None:
        check_positive("k", k, int)
    elif isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")


class TopK(Compressor):
    """Keep the ``k`` (or ``ratio * n``) largest-magnitude entries."""

    name = "topk"

    def __init__(self, k: int | None = None, ratio: float | None = None) -> None:
        check_k_ratio(k, ratio)
        self.k = None if k is None else int(k)
        self.ratio = None if ratio is None else float(ratio)

    def __repr__(self) -> str:
        return f"TopK(k={self.k}, ratio={self.ratio})"

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        x = flat_fp32(tensor)
        k = resolve_k(x.numel(), self.k, self.ratio)
        idx = torch.topk(x.abs(), k, sorted=False).indices
        return [x[idx], idx.to(torch.int32)], Ctx(tensor.shape, tensor.dtype, name)

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        values, idx = tensors
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=values.device)
        out[idx.long()] = values
        return out.reshape(ctx.shape).to(ctx.dtype)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        return 8 * resolve_k(as_shape(shape).numel(), self.k, self.ratio)
