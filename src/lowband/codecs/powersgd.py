"""PowerSGD-style low-rank codec (Vogels et al., 2019), one warm-started power iteration.

The tensor is viewed as a matrix ``M``: for ``dim >= 2`` as ``(shape[0], -1)``; for 1-D (and
scalars) as a near-square ``ceil(sqrt(n)) x ceil(n/rows)`` matrix zero-padded at the end.
With ``Q`` from the previous step of the same name (warm start; a seeded random start the first
time): ``P = orth(M Q)``, ``Q' = M^T P``, decode ``P Q'^T``. The payload is ``[P, Q']`` in fp32,
``4 * r * (rows + cols)`` bytes with ``r = min(rank, rows, cols)``.

This is a **per-worker** codec: each rank's ``(P, Q')`` decodes on its own, so it works with
all-gather and with error feedback like any other codec. PyTorch's DDP ``powerSGD_hook`` is a
different peer. It all-reduces ``P`` and ``Q`` across ranks inside the algorithm, which needs
linearity and two communication rounds per step, and is best reached through that hook.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from .base import Ctx, Payload, SteppedCompressor, as_shape, check_positive, flat_fp32


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The (rows, cols) matrix view used for a tensor of ``shape``."""
    n = shape.numel()
    if len(shape) >= 2:
        return shape[0], (n // shape[0] if shape[0] else 0)
    rows = max(1, math.ceil(math.sqrt(n)))
    return rows, max(1, math.ceil(n / rows))


class PowerSGD(SteppedCompressor):
    """Rank-``rank`` approximation with a per-name warm-started ``Q`` (kept in ``state_dict``)."""

    name = "powersgd"

    def __init__(self, rank: int = 4, seed: int = 0) -> None:
        check_positive("rank", rank, int)
        self.rank = int(rank)
        super().__init__(seed)
        self._q: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, seed={self.seed})"

    def _rank_for(self, rows: int, cols: int) -> int:
        return min(self.rank, rows, cols)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        x = flat_fp32(tensor)
        shape = tensor.shape
        rows, cols = matrix_shape(shape)
        r = self._rank_for(rows, cols)
        if rows * cols != x.numel():
            x = torch.cat([x, x.new_zeros(rows * cols - x.numel())])
        m = x.reshape(rows, cols)
        q = self._q.get(name)
        if q is None or q.shape != (cols, r) or q.device != x.device:
            gen = self._generator(name, 0, x.device)
            q = torch.randn(cols, r, generator=gen, device=x.device)
        step = self._next_step(name)
        p = torch.linalg.qr(m @ q).Q  # orthonormal basis of the column space estimate
        q_new = m.T @ p
        self._q[name] = q_new.clone()
        return [p.contiguous(), q_new.contiguous()], Ctx(shape, tensor.dtype, name, step)

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        p, q = tensors
        out = (p @ q.T).reshape(-1)[: ctx.numel]
        return out.reshape(ctx.shape).to(ctx.dtype)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        rows, cols = matrix_shape(as_shape(shape))
        return 4 * self._rank_for(rows, cols) * (rows + cols)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "q": {k: v.clone() for k, v in self._q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self._q = {k: v.clone() for k, v in state.pop("q", {}).items()}
        super().load_state_dict(state)
