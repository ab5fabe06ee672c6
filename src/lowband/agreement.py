"""Cross-rank agreement: ranks that disagree stop with one clear error, never a deadlock.

Two ranks that were started with different algorithm knobs or different models do not fail
by themselves: their collectives have different sizes or counts, and gloo either hangs until
the timeout or, worse, silently reduces mismatched buffers. So before any other collective
the engine has every rank publish a small digest per *field* (algorithm configuration,
parameter layout, world layout, ...) with one ``all_gather_object``. Every rank then compares
the same gathered table and therefore raises the same :class:`ConfigMismatchError`, naming
the first differing field and which ranks hold which variant.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional

import torch.distributed as dist

#: hex characters kept of each SHA-256 field digest (64 bits: collisions are not a concern
#: for a handful of ranks, and the gathered table stays a few hundred bytes)
DIGEST_CHARS = 16
#: how much of a field's value is quoted in the error message
PREVIEW_CHARS = 200


class ConfigMismatchError(RuntimeError):
    """Ranks were started with different configurations (raised identically on every rank)."""

    def __init__(self, field: str, detail: str):
        self.field = field
        super().__init__(f"ranks disagree on {field!r}: {detail}")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def canonical(value: Any) -> str:
    """A deterministic text form of ``value`` (JSON with sorted keys; ``repr`` for the rest),
    so equal configurations digest equally on every rank."""
    return json.dumps(value, sort_keys=True, default=repr)


def digest(value: Any) -> str:
    return hashlib.sha256(canonical(value).encode()).hexdigest()[:DIGEST_CHARS]


def _preview(value: Any) -> str:
    text = canonical(value)
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "..."


def _variants(values: list[Any]) -> str:
    """``'A' on ranks 0,2; 'B' on rank 1`` for one value per rank."""
    groups: dict[str, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(_preview(v), []).append(rank)
    return "; ".join(f"{text} on {_ranks(ranks)}" for text, ranks in groups.items())


def describe_difference(values: list[Any]) -> str:
    """The first place where the per-rank ``values`` differ: a dict key, a list position, or
    the whole value, so a 500-parameter model mismatch names the one differing parameter."""
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))   # rank 0's order first
        for k in keys:
            column = [v.get(k, "<absent>") for v in values]
            if len({canonical(c) for c in column}) > 1:
                return f"[{k!r}] is " + _variants(column)
    if all(isinstance(v, (list, tuple)) for v in values):
        for i in range(max(len(v) for v in values)):
            column = [v[i] if i < len(v) else "<absent>" for v in values]
            if len({canonical(c) for c in column}) > 1:
                return f"entry #{i} is " + _variants(column)
    return _variants(values)


def check_agreement(fields: Mapping[str, Any], group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise :class:`ConfigMismatchError` on every rank unless all ranks passed equal ``fields``.

    Collective: every rank of ``group`` must call it (a differing set of field *names* is
    itself reported, as a mismatch of ``'fields'``). The common case costs one small
    all-gather of digests; only on a mismatch is the differing field's full value gathered
    (every rank sees the same table, so all take that second step together)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = {"fields": digest(list(fields)), **{name: digest(v) for name, v in fields.items()}}
    table: list[Any] = [None] * world
    dist.all_gather_object(table, mine, group=group)
    for name in ["fields", *sorted({k for t in table for k in t} - {"fields"})]:
        if len({t.get(name) for t in table}) > 1:
            full: list[Any] = [None] * world
            dist.all_gather_object(full, list(fields) if name == "fields" else fields.get(name, "<absent>"),
                                   group=group)
            raise ConfigMismatchError(name, describe_difference(full))
