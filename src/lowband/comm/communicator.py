"""Byte-counted access to torch.distributed.

Every collective lowband issues goes through a :class:`Communicator`, so the bytes a rank
hands to torch.distributed are counted where they are sent, not estimated by an algorithm
after the fact. Two numbers are kept per operation:

* ``payload`` — the bytes of the tensors passed in (what the caller asked to move);
* ``wire`` — the bytes this rank sends (and receives) on its link under the collective's
  standard bandwidth-optimal schedule (ring all-reduce: 2(N-1)/N of the tensor; ring
  all-gather: (N-1) inputs; pairwise all-to-all: (N-1)/N of the input). The wire model is
  what a link's byte counter should show (plus protocol headers); the network-emulation
  benchmark checks it against the kernel's veth counters.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..runtime.device import collective_device
from .streams import GpuWaits, on_cuda
from .wire import allgather_bytes, allreduce_bytes, alltoall_bytes

#: CUDA-timed waits kept before the completed ones are collected on the next wait, so that a
#: loop that never reads its stats does not accumulate events
GPU_WAITS_COLLECT_AT = 256


@dataclass
class CommStats:
    """Running totals for one rank (``steps`` is advanced by the engine). All counters only
    grow; callers diff snapshots. ``comm_wait_s`` is exposed communication (:meth:`exposed`);
    on CUDA it is collected from timing events as they complete, so it may lag the steps
    that caused it until :meth:`collect_gpu_waits` with ``block=True`` (the engine's
    ``synchronize``)."""

    steps: int = 0
    skipped_steps: int = 0          # steps dropped on all ranks for a non-finite gradient
    calls: int = 0
    payload_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    comm_wait_s: float = 0.0
    by_op: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _gpu_waits: GpuWaits = field(default_factory=GpuWaits, repr=False, compare=False)

    def record(self, op: str, payload: int, sent: float, received: float) -> None:
        with self._lock:   # background collectives record from their own thread
            self._record(op, payload, sent, received)

    def _record(self, op: str, payload: int, sent: float, received: float) -> None:
        self.calls += 1
        self.payload_bytes += int(payload)
        self.bytes_sent += int(round(sent))
        self.bytes_received += int(round(received))
        entry = self.by_op.setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += int(round(sent))

    @contextmanager
    def exposed(self, device: Optional[torch.device] = None) -> Iterator[None]:
        """Charge the time spent inside to ``comm_wait_s``: wall time, or for a ``cuda`` device
        the time of that device's current stream between an event before the body and one
        after it (the body makes the stream wait for communication, without blocking the
        host under NCCL), collected later without a host sync (:class:`lowband.comm.streams.GpuWaits`)."""
        if not on_cuda(device):
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.comm_wait_s += time.perf_counter() - t0
            return
        start = GpuWaits.mark(device)
        try:
            yield
        finally:
            end = GpuWaits.mark(device)
            with self._lock:
                self._gpu_waits.add(start, end)
                if len(self._gpu_waits) >= GPU_WAITS_COLLECT_AT:
                    self.comm_wait_s += self._gpu_waits.collect()

    def collect_gpu_waits(self, block: bool = False) -> None:
        """Add the CUDA-timed waits that have completed to ``comm_wait_s`` (all of them, after
        a host sync, with ``block``). Nothing to do, and no CUDA call, on the CPU."""
        if not len(self._gpu_waits):
            return
        with self._lock:
            self.comm_wait_s += self._gpu_waits.collect(block)

    def snapshot(self) -> dict:
        self.collect_gpu_waits()
        with self._lock:   # by_op too: a background thread may insert a key meanwhile
            d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
            d["by_op"] = {k: list(v) for k, v in self.by_op.items()}
        return d

    def load(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, dict(v) if k == "by_op" else v)


class TimedWork:
    """A pending collective whose ``wait()`` time is charged to the exposed-communication
    clock (unless the communicator runs on a background thread, whose waits hide nothing)."""

    def __init__(self, work: Optional[dist.Work], stats: CommStats, timed: bool = True,
                 device: Optional[torch.device] = None):
        self._work = work
        self._stats = stats
        self._timed = timed
        self._device = device     # the tensor's: on CUDA the wait is timed with events

    def wait(self) -> None:
        if self._work is None:
            return
        if self._timed:
            with self._stats.exposed(self._device):
                self._work.wait()
        else:
            self._work.wait()
        self._work = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def get_future(self, value: torch.Tensor) -> torch.futures.Future:
        """A future resolving to ``value`` when the collective is done (DDP comm hooks must
        return one; DDP awaits it inside backward, so no wait time is charged here)."""
        if self._work is None:       # no-op collective (world size 1) or already waited
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(value)
            return fut
        return self._work.get_future().then(lambda _: value)


class Communicator:
    """Thin, counted wrapper over a torch.distributed process group.

    Algorithms and collectives call these methods instead of ``torch.distributed``; each
    returns a :class:`TimedWork` (``async_op=True``) or completes before returning.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, stats: Optional[CommStats] = None,
                 time_waits: bool = True):
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self.time_waits = time_waits
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        #: where this group's collectives take tensors (NCCL: the current GPU), for the few
        #: tensors lowband allocates itself (checks, counts); cached once per communicator
        self.device = collective_device(group)
        #: all_gather between two gloo ranks as a send/receive pair (:meth:`all_gather`)
        self._pair_gather = self.world_size == 2 and dist.get_backend(group) == "gloo"
        self._gathers = 0                 # all_gathers started: the tag of the next pair

    # -- helpers --------------------------------------------------------------------------
    def _finish(self, work, async_op: bool, device: torch.device) -> TimedWork:
        tw = TimedWork(work, self.stats, self.time_waits, device)
        if not async_op:
            tw.wait()
        return tw

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False) -> TimedWork:
        n, p = self._nbytes(tensor), self.world_size
        wire = allreduce_bytes(n, p)
        self.stats.record("all_reduce", n, wire, wire)
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True) if p > 1 else None
        return self._finish(work, async_op, tensor.device)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> TimedWork:
        """Gather ``tensor`` from every rank into ``output`` (shape ``[world, *tensor.shape]`` or flat)."""
        n, p = self._nbytes(tensor), self.world_size
        self.stats.record("all_gather", n, allgather_bytes(n, p), allgather_bytes(n, p))
        if self._pair_gather:
            work = self._exchange(output, tensor.contiguous())
        elif p > 1:
            work = _all_gather_single(output, tensor.contiguous(), group=self.group, async_op=True)
        else:
            output.view(-1).copy_(tensor.view(-1))
            work = None
        return self._finish(work, async_op, tensor.device)

    def _exchange(self, output: torch.Tensor, tensor: torch.Tensor) -> "_Works":
        """Two gloo ranks' all_gather as one isend and one irecv. Over a paced 20 Mbit/s link
        gloo's all_gather of 117 KB took 73 ms a call when the two ranks came to it from their
        own compute, the pair 52 ms (47 ms on the wire; benchmarks/gather_pair.py,
        docs/netem.md). Each call's messages carry their own tag (a count every rank keeps
        alike, as collectives are called in the same order everywhere)."""
        chunks = output.view(2, -1)
        chunks[self.rank].copy_(tensor.view(-1))
        peer, tag = 1 - self.rank, self._gathers % (1 << 24)
        self._gathers += 1
        recv = dist.irecv(chunks[peer], group=self.group, tag=tag, group_src=peer)
        send = dist.isend(tensor.view(-1), group=self.group, tag=tag, group_dst=peer)
        return _Works([recv, send])

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> TimedWork:
        """Even-split all-to-all: chunk i of ``tensor`` goes to rank i."""
        n, p = self._nbytes(tensor), self.world_size
        wire = alltoall_bytes(n, p)
        self.stats.record("all_to_all", n, wire, wire)
        if p > 1:
            work = dist.all_to_all_single(output, tensor.contiguous(), group=self.group, async_op=True)
        else:
            output.copy_(tensor)
            work = None
        return self._finish(work, async_op, tensor.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> TimedWork:
        n, p = self._nbytes(tensor), self.world_size
        sent = n * (p - 1) if self.rank == src else 0
        received = 0 if self.rank == src else n
        self.stats.record("broadcast", n, sent, received)
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=True) if p > 1 else None
        return self._finish(work, async_op, tensor.device)


class _Works:
    """Several pending operations as one (``wait`` waits for each)."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works])


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D copy of ``tensors`` (same dtype), for coalesced collectives."""
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` in place."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
