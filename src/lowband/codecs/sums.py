"""lowband's canonical summation order (shared by the torch codecs and the native kernels).

A float sum depends on its order, and torch's own ``sum`` picks one by SIMD width and
threading, so a C kernel cannot reproduce it. Every sum a codec's output depends on (2-bit
scale-aware mode's RMS and fired mean, 1-bit's scale) therefore uses one fixed order that
both implementations follow exactly: cut the terms into rows of 256 (zero-padded), fold each
row in halves (``y[j] = x[j] + x[j + w]`` for ``w = 128, 64, ..., 1``), then sum the row sums
the same way until one value is left. Each step is an element-wise IEEE addition, so torch
(``x[..., :w] + x[..., w:]``) and C give the same bits. All summed terms are >= 0 (squares,
magnitudes), so zero padding of any length never changes a result.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW = 256


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Canonical sum of each row of a 2-D tensor of non-negative terms: shape ``[m]``."""
    m, length = x.shape
    if length == 0:
        return torch.zeros(m, dtype=x.dtype, device=x.device)
    while True:
        rows = -(-length // ROW)
        if rows * ROW != length:
            x = F.pad(x, (0, rows * ROW - length))
        x = x.reshape(m, rows, ROW)
        w = ROW // 2
        while w >= 1:
            x = x[..., :w] + x[..., w:2 * w]
            w //= 2
        x = x.reshape(m, rows)
        if rows == 1:
            return x[:, 0]
        length = rows


def canonical_sum(x: torch.Tensor) -> torch.Tensor:
    """Canonical sum of all elements (non-negative terms), as a 0-dim tensor."""
    return row_sums(x.reshape(1, -1))[0]
