"""Cross-rank agreement: ranks that disagree stop with one clear error, never a deadlock.

Two ranks that were started with different algorithm knobs or different models do not fail
by themselves: their collectives have different sizes or counts, and gloo either hangs until
the timeout or, worse, silently reduces mismatched buffers. So before any other collective
the engine has every rank publish a small digest per *field* (algorithm configuration,
parameter layout, world layout, ...) with one ``all_gather_object``. Every rank then compares
the same gathered table and therefore raises the same :class:`ConfigMismatchError`, naming
the first differing field and which ranks hold which variant.

:func:`check_replicas` does the same for *state* that must be identical on every rank (the
global weights and, where the algorithm replicates it, the optimizer state), checked after a
checkpoint is loaded: a cheap all-reduced digest per tensor, never the tensors themselves.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional

import torch
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


# -- replicated state -------------------------------------------------------------------------
#: digest of "nothing here" (a slot a rank does not check); real digests are in [1, 2**63)
ABSENT = 0


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different values of state that must be replicated (raised on every rank)."""

    def __init__(self, what: str, detail: str):
        self.what = what
        super().__init__(f"ranks hold different {what}: {detail}")


def state_digest(*values: Any) -> int:
    """A 63-bit digest of tensors (dtype, shape and bytes) and plain values, >= 1."""
    h = hashlib.sha256()
    for v in values:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{t.dtype}{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        else:
            h.update(canonical(v).encode())
    return int.from_bytes(h.digest()[:8], "big") % (2 ** 63 - 1) + 1


def check_replicas(slots: list[tuple[str, int]], comm: Any) -> None:
    """Raise :class:`ReplicaMismatchError` on every rank unless all ranks hold the same digest
    in every slot. ``slots`` is (what, digest) per slot, the same number of slots on every rank
    (a rank that does not check a slot passes :data:`ABSENT`). Collective over ``comm`` (a
    :class:`~lowband.comm.communicator.Communicator`): one MAX all-reduce of 2 int64 per
    slot (max and -min); only on a mismatch, one all-gather of the first differing slot to say
    which ranks hold which digest."""
    if comm.world_size == 1 or not slots:
        return
    d = torch.tensor([s for _, s in slots], dtype=torch.int64, device=comm.device)
    both = torch.cat([d, -d])
    comm.all_reduce(both, op=dist.ReduceOp.MAX)
    n = len(slots)
    differ = (both[:n] != -both[n:]).nonzero().flatten().tolist()
    if not differ:
        return
    first = differ[0]
    per_rank: list[Any] = [None] * comm.world_size
    dist.all_gather_object(per_rank, int(d[first]), group=comm.group)
    groups: dict[str, list[int]] = {}
    for rank, v in enumerate(per_rank):
        groups.setdefault("not checked" if v == ABSENT else f"digest {v:016x}", []).append(rank)
    more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
    raise ReplicaMismatchError(slots[first][0] + more,
                               "; ".join(f"{label} on {_ranks(ranks)}" for label, ranks in groups.items()))
