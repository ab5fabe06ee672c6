"""Embedding rows averaged over the ranks that trained them (``cp-diloco``'s ``sparse_rows``).

A row of an embedding table gets a gradient only in the steps whose batch holds its index.
When a round's outer gradient is the plain mean over N ranks, a row that k of them trained
moves by k/N of their progress: a row one rank in four reached moves a quarter of that
rank's step, where synchronous SGD under Adam (which normalises the averaged gradient per
element) moves it a whole step. So, per row, this module counts the ranks whose gradient of
the row was non-zero in some inner step since the row's message was last sent, and the
average of that message is scaled row by row by ``N / count``: the mean over the ranks that
trained the row. A row no rank trained keeps the plain mean (its progress, weight decay or
an optimizer's momentum, is no rank's training of it this round).

The flags travel in the same message as the outer gradient, in a segment averaged exactly in
fp32, packed: ``b`` bits per row with ``2**b > N`` (a sum of N flags fits), as many rows per
fp32 value as keep it below ``2**(22 - b)``. The ranks' mean of a packed value, times N and
rounded, is the packed sum of their flags: the sum is an integer below ``2**22 / N``, so
however the collective averages (a sum then a division, or a pre-scaled sum) the mean times
N is off by less than 1/4, and every rank reads the same counts. That holds up to
``MAX_WORLD`` ranks.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .lazy import EMBEDDING_LAYERS, holders

#: a packed value of b-bit fields stays below 2**(PACKED_BITS - b): its mean over N ranks
#: times N rounds back to the sum exactly
PACKED_BITS = 22
#: the most ranks whose flags one field per fp32 value carries under that bound (N < 2**b and
#: a sum of N flags below 2**(PACKED_BITS - b))
MAX_WORLD = 1024


def row_tables(model: torch.nn.Module, params: list, indices: list[int]) -> list[int]:
    """The entries of ``indices`` (into ``params``) that are an embedding table's 2-D weight
    (``nn.Embedding``/``nn.EmbeddingBag``) held by no other module: a table tied to an output
    head gets a gradient in every row at every step, so averaging over its trainers is the
    plain mean."""
    held = holders(model)
    return [i for i in indices if params[i].dim() == 2 and held.get(id(params[i]))
            and all(isinstance(m, EMBEDDING_LAYERS) for _, m in held[id(params[i])])]


def field_bits(world: int) -> int:
    """Bits per row in a packed value: the smallest b with ``2**b > world``."""
    return max(1, int(world).bit_length())


def rows_per_value(world: int) -> int:
    """The rows one packed fp32 value carries among ``world`` ranks."""
    b = field_bits(world)
    return max(1, (PACKED_BITS - b) // b)


def pack_flags(flags: torch.Tensor, world: int) -> torch.Tensor:
    """``flags`` (0/1 per row) packed into fp32 values of :func:`rows_per_value` rows, the
    first row in the lowest bits (:func:`unpack_counts` reads the ranks' mean back)."""
    b, per = field_bits(world), rows_per_value(world)
    n = flags.numel()
    width = -(-n // per)
    padded = torch.zeros(width * per, dtype=torch.int64, device=flags.device)
    padded[:n] = flags.reshape(-1).to(torch.int64)
    shifts = torch.arange(per, dtype=torch.int64, device=flags.device) * b
    return (padded.view(width, per) << shifts).sum(dim=1).to(torch.float32)


def unpack_counts(mean: torch.Tensor, world: int, rows: int) -> torch.Tensor:
    """The per-row sums of the ranks' flags from the ranks' mean of their packed values."""
    b, per = field_bits(world), rows_per_value(world)
    total = torch.round(mean.to(torch.float64) * world).to(torch.int64)
    shifts = torch.arange(per, dtype=torch.int64, device=mean.device) * b
    fields = (total.unsqueeze(1) >> shifts) & ((1 << b) - 1)
    return fields.reshape(-1)[:rows]


def packed_width(rows: int, world: int) -> int:
    """The fp32 values :func:`pack_flags` makes of ``rows`` flags."""
    return -(-rows // rows_per_value(world))


class RowCounter:
    """The trained-row flags of one message's embedding tables on this rank.

    ``tables``: (index into the engine's parameters, offset of its first element in the
    message's flat outer gradient) for each table the message carries."""

    def __init__(self, params: list, tables: list[tuple[int, int]], world: int):
        if world > MAX_WORLD:
            raise ValueError(f"sparse_rows counts trainers exactly up to {MAX_WORLD} ranks, not {world}; "
                             f"set sparse_rows=False")
        self.params, self.world = params, world
        self.tables = [(i, offset, params[i].shape[0], params[i].shape[1]) for i, offset in tables]
        self.rows = sum(rows for _, _, rows, _ in self.tables)
        self.width = packed_width(self.rows, world)
        device = params[tables[0][0]].device
        self.flags = torch.zeros(self.rows, dtype=torch.bool, device=device)

    def observe(self) -> None:
        """Flag the rows with a non-zero gradient in this step (dense or sparse gradients)."""
        start = 0
        for i, _, rows, _ in self.tables:
            g = self.params[i].grad
            if g is not None:
                part = self.flags[start:start + rows]
                if g.is_sparse:
                    g = g.coalesce()
                    hit = g.values().reshape(g.values().shape[0], -1).ne(0).any(dim=1)
                    part[g.indices()[0][hit]] = True
                else:
                    part |= g.ne(0).any(dim=1)
            start += rows

    def take(self, reset: bool = True) -> torch.Tensor:
        """This rank's flags packed for the message; with ``reset`` the flags start over."""
        packed = pack_flags(self.flags, self.world)
        if reset:
            self.flags.zero_()
        return packed

    def scale_(self, average: torch.Tensor, mean_flags: torch.Tensor) -> torch.Tensor:
        """``average`` (the message's flat mean over ranks) with each table row multiplied by
        ``N / count`` (rows no rank trained: unchanged), in place."""
        counts = unpack_counts(mean_flags, self.world, self.rows).to(average.device)
        factor = torch.where(counts > 0, self.world / counts.clamp(min=1).to(torch.float64), 1.0)
        start = 0
        for _, offset, rows, cols in self.tables:
            view = average[offset:offset + rows * cols].view(rows, cols)
            view.mul_(factor[start:start + rows].to(average.dtype).unsqueeze(1))
            start += rows
        return average

    def state_dict(self) -> dict[str, Any]:
        return {"flags": self.flags.clone().cpu()}

    def load_state_dict(self, state: Optional[dict[str, Any]], who: str) -> None:
        flags = None if state is None else state.get("flags")
        if flags is None or flags.numel() != self.rows:
            raise ValueError(f"{who}: the checkpoint's trained-row flags do not match this run's embedding "
                             f"tables ({self.rows} rows); it was saved with other sparse_rows settings")
        self.flags.copy_(flags.to(self.flags.device))
