"""Random-k sparsification: only the values travel; indices come from shared randomness.

Indices are ``k`` distinct positions drawn by ``randperm`` from a local generator seeded by
``(seed, name, step)`` on the tensor's device. Every rank compresses the same name at the same
step, so every rank draws the same indices and a receiver regenerates them from
``ctx = (shape, dtype, name, step)``. GRACE reseeds the *global* RNG for this, which disturbs
dropout, data order and so on. The payload is ``[k fp32 values]`` (``4k`` bytes). Values are
not rescaled by ``n/k``, which makes the codec biased; use it with error feedback.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .base import Ctx, Payload, SteppedCompressor, as_shape, flat_fp32
from .topk import check_k_ratio, resolve_k


class RandomK(SteppedCompressor):
    """Keep ``k`` (or ``ratio * n``) uniformly random entries, shared across ranks."""

    name = "randomk"

    def __init__(self, k: int | None = None, ratio: float | None = None, seed: int = 0) -> None:
        check_k_ratio(k, ratio)
        self.k = None if k is None else int(k)
        self.ratio = None if ratio is None else float(ratio)
        super().__init__(seed)
        self._cache: tuple[tuple, torch.Tensor] | None = None  # last indices, reused by decode

    def __repr__(self) -> str:
        return f"RandomK(k={self.k}, ratio={self.ratio}, seed={self.seed})"

    def indices(self, n: int, name: str, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The sorted int64 indices used for ``(name, step)`` on a tensor of ``n`` elements."""
        device = torch.device(device)
        key = (n, name, step, device)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        k = resolve_k(n, self.k, self.ratio)
        gen = self._generator(name, step, device)
        idx = torch.randperm(n, generator=gen, device=device)[:k].sort().values
        self._cache = (key, idx)
        return idx

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        x = flat_fp32(tensor)
        step = self._next_step(name)
        idx = self.indices(x.numel(), name, step, x.device)
        return [x[idx]], Ctx(tensor.shape, tensor.dtype, name, step)

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        (values,) = tensors
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=values.device)
        out[self.indices(ctx.numel, ctx.name, ctx.step, values.device)] = values
        return out.reshape(ctx.shape).to(ctx.dtype)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        return 4 * resolve_k(as_shape(shape).numel(), self.k, self.ratio)
