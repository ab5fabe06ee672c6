"""Gradient buckets that launch their communication during backward.

Gradients become ready roughly in reverse registration order, so parameters are grouped into
buckets of at most ``bucket_bytes`` in that order. A bucket is *launched* (handed to a
``launch`` callback that starts an asynchronous collective) as soon as its last gradient is
ready **and every earlier bucket has been launched**: collectives must be issued in the same
order on every rank, whatever order the local autograd happens to finish in.

Each bucket carries one extra element per parameter, a "had a gradient" flag: a parameter
that received no gradient on any rank keeps ``grad = None`` after the reduction, so the
optimizer skips it exactly as a single process would (instead of applying weight decay or
momentum to a zero gradient).

Buckets may be of several *kinds* (``key``, e.g. compressed weights vs. fp32 1-D parameters):
parameters of different kinds never share a bucket, but all buckets form ONE launch order
(the order in which they fill up during backward), so an algorithm that sends every bucket
through one ordered queue issues the same collectives in the same order on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    param_indices: list[int]
    offsets: list[int]
    numel: int                       # gradient elements (flags excluded)
    buffer: torch.Tensor             # numel gradient values followed by one flag per param
    pending: set = field(default_factory=set)
    launched: bool = False
    handle: object = None            # whatever the launch callback returned
    key: Any = None                  # the bucket's kind (see the module docstring)
    position: dict = field(default_factory=dict)   # parameter index -> position in the bucket
    spare: Optional[torch.Tensor] = None   # double buffering: the previous iteration's buffer
    complete: bool = False           # launched with every parameter's gradient of this rank
    shapes: list = field(default_factory=list, repr=False)   # each parameter's shape, in bucket order
    #: per parameter, in bucket order: the gradient tensor itself where it was not copied into
    #: the buffer (``BucketSet.by_reference``), else None (its values are in the buffer)
    sources: list = field(default_factory=list, repr=False)
    #: per buffer (by its data pointer): its views, made once (:meth:`views`)
    _views: dict = field(default_factory=dict, repr=False)

    def views(self) -> "BufferViews":
        """The current buffer's views (each made once per buffer: slicing a tensor costs
        microseconds of the training thread per parameter and step)."""
        found = self._views.get(self.buffer.data_ptr())
        if found is None:
            found = self._views[self.buffer.data_ptr()] = BufferViews.of(self.buffer, self.numel, self.offsets,
                                                                         self.shapes)
        return found

    def present(self) -> Optional[torch.Tensor]:
        """Per parameter, whether this rank produced its gradient (bool), for a reducer's
        ``present=``; None for a bucket launched complete, which a reducer reads as "every one"
        (no mask made on the training thread)."""
        return None if self.complete else self.flags > 0

    @property
    def grads(self) -> torch.Tensor:
        return self.views().grads

    @property
    def flags(self) -> torch.Tensor:
        return self.views().flags


@dataclass
class BufferViews:
    """Views of one bucket buffer: all gradients, the flags, each parameter's gradient in its
    shape, and on the CPU the flags as a numpy array (one store instead of a torch indexing
    call when a gradient arrives; None for a dtype numpy lacks, bfloat16)."""

    grads: torch.Tensor
    flags: torch.Tensor
    params: list
    host_flags: Optional[np.ndarray]

    @classmethod
    def of(cls, buffer: torch.Tensor, numel: int, offsets: list, shapes: list) -> "BufferViews":
        flags = buffer[numel:]
        host = flags.numpy() if flags.device.type == "cpu" and flags.dtype != torch.bfloat16 else None
        return cls(buffer[:numel], flags,
                   [buffer[o:o + math.prod(shape)].view(shape) for o, shape in zip(offsets, shapes)], host)

    def mark(self, k: int, value: int) -> None:
        """Set parameter ``k``'s flag."""
        if self.host_flags is not None:
            self.host_flags[k] = value
        else:
            self.flags[k] = value


def plan_buckets(params: Sequence[nn.Parameter], indices: Sequence[int], bucket_bytes: int,
                 key: Optional[Callable[[int], Any]] = None) -> list[list[int]]:
    """Group ``indices`` (in reverse order) into buckets of at most ``bucket_bytes``; a
    parameter larger than the cap gets a bucket of its own. Parameters of different dtypes or
    ``key`` values never share a bucket; buckets are returned in the order they fill up."""
    return [g for _, g in plan_keyed_buckets(params, indices, bucket_bytes, key)]


def plan_keyed_buckets(params: Sequence[nn.Parameter], indices: Sequence[int], bucket_bytes: int,
                       key: Optional[Callable[[int], Any]] = None) -> list[tuple[Any, list[int]]]:
    """:func:`plan_buckets` with each bucket's key: ``[(key, indices), ...]``."""
    groups: list[tuple[Any, list[int]]] = []
    open_: dict[Any, tuple[list[int], int]] = {}      # (key, dtype) -> (indices, bytes)
    for i in reversed(list(indices)):
        p = params[i]
        k = None if key is None else key(i)
        slot = (k, p.dtype)
        nbytes = p.numel() * p.element_size()
        current, size = open_.get(slot, ([], 0))
        if current and size + nbytes > bucket_bytes:
            groups.append((k, current))
            current, size = [], 0
        open_[slot] = (current + [i], size + nbytes)
        if key is None:   # a single kind: a dtype change closes the open bucket (as before)
            for other in [s for s in open_ if s != slot]:
                groups.append((other[0], open_.pop(other)[0]))
    # the rest fill up when backward ends: in the order their last parameter arrived
    arrival = {i: n for n, i in enumerate(reversed(list(indices)))}
    rest = sorted(open_.items(), key=lambda kv: arrival[kv[1][0][-1]] if kv[1][0] else -1)
    groups.extend((slot[0], g) for slot, (g, _) in rest if g)
    return groups


class BucketSet:
    """Buckets over a subset of parameters, with in-order asynchronous launching."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        indices: Sequence[int],
        bucket_bytes: int,
        launch: Callable[[Bucket], object],
        key: Optional[Callable[[int], Any]] = None,
        double_buffered: bool = False,
    ):
        """``double_buffered``: each bucket alternates between two buffers, one per iteration,
        so a launch may hand its buffer to an asynchronous job without copying it, as long as
        that job is finished before the iteration after next starts filling the buffer again
        (a depth-1 pipeline waits for step t's job during step t + 1).

        ``by_reference`` (an attribute, set per iteration before backward; default False): the
        gradients of the parameters in ``referable`` (a set of indices; set by the algorithm)
        are not copied into the buffer but kept where autograd left them, in each bucket's
        ``sources``, when they are contiguous and of the bucket's dtype and device; the launch
        callback hands them to a reducer that reads them there (``CompressedReducer.start``'s
        ``sources``). Only for an algorithm that waits for every bucket before anything
        touches the gradients again (a synchronous step)."""
        self.params = params
        self.launch_fn = launch
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, int] = {}
        for b, (kind, group) in enumerate(plan_keyed_buckets(params, indices, bucket_bytes, key)):
            offsets, n = [], 0
            for i in group:
                offsets.append(n)
                n += params[i].numel()
                self.bucket_of[i] = b
            dtype = params[group[0]].dtype
            device = params[group[0]].device
            buf = torch.zeros(n + len(group), dtype=dtype, device=device)
            spare = torch.zeros_like(buf) if double_buffered else None
            self.buckets.append(Bucket(b, list(group), offsets, n, buf, key=kind,
                                       position={i: k for k, i in enumerate(group)}, spare=spare,
                                       shapes=[tuple(params[i].shape) for i in group]))
        self._next = 0
        self.by_reference = False
        self.referable: frozenset = frozenset()
        self.reset()

    def reset(self) -> None:
        """Prepare for a new iteration (double buffered: switch to the other buffer)."""
        for b in self.buckets:
            if b.spare is not None:
                b.buffer, b.spare = b.spare, b.buffer
            b.pending = set(b.param_indices)
            b.launched = False
            b.complete = False
            b.handle = None
            b.sources = [None] * len(b.param_indices)     # a new list: a job may hold the last one
            b.flags.zero_()
        self._next = 0

    def mark_ready(self, index: int, overlap: bool = True) -> None:
        """Copy parameter ``index``'s gradient into its bucket; launch what became launchable."""
        b = self.buckets[self.bucket_of[index]]
        if index not in b.pending:
            raise RuntimeError(
                f"gradient of parameter #{index} became ready twice in one iteration; lowband "
                "expects one backward() per engine.step(): to accumulate gradients over micro-batches, "
                "run every backward but the last inside `with engine.no_sync():`")
        k = b.position[index]
        views = b.views()
        grad, place = self.params[index].grad, views.params[k]
        if self.by_reference and index in self.referable and grad.layout == torch.strided \
                and grad.is_contiguous() and grad.dtype == place.dtype and grad.device == place.device:
            b.sources[k] = grad
        else:
            place.copy_(grad)
        views.mark(k, 1)
        b.pending.discard(index)
        if overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket, complete: bool = True) -> None:
        b.launched = True
        b.complete = complete
        b.handle = self.launch_fn(b)

    def launch_remaining(self) -> None:
        """Launch every bucket not launched yet, in order. Parameters without a gradient this
        iteration contribute zeros and a cleared flag."""
        for b in self.buckets[self._next:]:
            complete = not b.pending
            views = b.views()
            for k, i in enumerate(b.param_indices):
                if i in b.pending:
                    views.params[k].zero_()
                    views.mark(k, 0)
            b.pending.clear()
            self._launch(b, complete)
        self._next = len(self.buckets)

    def write_gradients(self, b: Bucket, reduced: Optional[torch.Tensor] = None,
                        present: Optional[torch.Tensor] = None, as_views: bool = False,
                        written: Optional[list] = None) -> None:
        """Write a bucket's reduced values (default: its own buffer) back into ``.grad``, in the
        parameter's dtype; parameters whose flag is zero on every rank (or whose ``present``
        entry is False, when given) get ``grad = None``.

        ``as_views``: where the values are the bucket's own buffer (the reduction wrote into
        it) and the parameter has its dtype, ``.grad`` becomes the parameter's view of the
        buffer instead of a copy (DDP's ``gradient_as_bucket_view``): one pass over the
        gradients less per step (and an allocation, where ``.grad`` was None). Only for an
        algorithm that leaves the buffer alone from here until the next backward has produced
        every gradient of the bucket (a synchronous step): the next backward's copies overwrite these views, and a backward
        that accumulates into them (no ``zero_grad``) writes into the buffer, as it would into
        a separate ``.grad``.

        ``written`` (per parameter, in bucket order, or None): the tensor the reduction wrote the
        parameter's average into instead of ``reduced`` (a flat view of its ``.grad`` read where
        it was, ``by_reference``; the handle's ``targets``), or None: nothing to copy there.

        Which parameters get a gradient is decided on the host. A bucket this rank launched
        complete needs no look: its averaged flags are all > 0. Otherwise the averaged flags
        are read back, one host sync per such bucket on CUDA (``present``, from the pipeline,
        is already on the host)."""
        values = b.buffer if reduced is None else reduced
        if present is not None:
            flags = present.tolist()
        elif b.complete:
            flags = [True] * len(b.param_indices)
        else:
            flags = (values[b.numel:] > 0).tolist()
        views = b.views().params if as_views and values.dtype == b.buffer.dtype and \
            values.data_ptr() == b.buffer.data_ptr() else None
        for k, i in enumerate(b.param_indices):
            p = self.params[i]
            if not flags[k]:
                p.grad = None
                continue
            if written is not None and written[k] is not None:
                if p.grad is None or p.grad.data_ptr() != written[k].data_ptr():   # (replaced since backward)
                    p.grad = written[k].view(p.shape)
                continue
            if views is not None and p.dtype == values.dtype:
                p.grad = views[k]
                continue
            g = values[b.offsets[k]: b.offsets[k] + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = g.to(p.dtype, copy=True)
            else:
                p.grad.copy_(g)
