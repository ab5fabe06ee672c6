"""Compressed averaging collectives on torch.distributed.

Ternary 2-bit codes cannot be summed in 2 bits, so the collective that moves compressed
payloads is an explicit choice (spec A.3):

* :class:`AllgatherCollective` — every rank all-gathers every rank's packed payload, decodes
  each and sums them in rank order. The result is exactly the sum of the individually decoded
  payloads (what MXNet's parameter server computes), identical on every rank. Each rank
  receives (N-1) payloads: O(N) traffic per rank.
* :class:`TwoStageAllreduce` — DeepSpeed-style compressed all-reduce. The (padded) tensor is cut
  into N equal chunks, each compressed separately; an ``all_to_all`` sends chunk i to rank i,
  which decodes the N versions, averages them, re-compresses the average with its own
  *server-side* error feedback and ``all_gather``s it. O(1) traffic per rank in N.

Both run their whole pipeline — compression included — on a background thread with a process
group of their own, so the caller's thread keeps computing (CP-SGD hides compression as well as
communication). A dedicated group matters for correctness: collectives issued from two threads
on one group could be ordered differently on different ranks. Jobs run in submission order, so
every rank issues the same sequence on the private group.

Payload tensors of one compress() call are shipped as one byte buffer (one collective, not one
per payload tensor); their sizes depend only on the tensor's shape, so no size exchange is needed.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..compressors import Compressor, ErrorFeedback
from ..compressors.base import Payload
from .communicator import Communicator

COLLECTIVES = ("allgather", "two-stage")


def payload_to_bytes(payload: Payload) -> torch.Tensor:
    """Concatenate payload tensors into one flat uint8 buffer (their raw bytes)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])


def bytes_to_payload(buf: torch.Tensor, like: Payload) -> Payload:
    """Split a byte buffer back into tensors shaped and typed like ``like``."""
    out, offset = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(buf[offset:offset + n].view(t.dtype).reshape(t.shape))
        offset += n
    return out


class PendingReduce:
    """Handle of an in-flight compressed averaging; ``wait()`` returns the averaged tensor.
    Time spent in ``wait()`` is charged to the exposed-communication clock."""

    def __init__(self, future: Future, comm: Communicator):
        self._future = future
        self._comm = comm

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        result = self._future.result()
        self._comm.stats.comm_wait_s += time.perf_counter() - t0
        return result

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        """Call ``fn(concurrent_future)`` when the reduction finishes (on the worker thread);
        this is how the DDP hook completes its ``torch.futures.Future`` without blocking."""
        self._future.add_done_callback(fn)


class CompressedCollective(ABC):
    """Averages a flat fp32 tensor across ranks through a compressor, asynchronously.

    Args:
        comm: the caller's counted communicator (its stats receive the bytes; its group is
            the one whose ranks take part).
        compressor: the worker-side codec; wrap it in :class:`ErrorFeedback` for residual
            memory (the collective does not add it by itself, so "no error feedback" stays
            expressible).
    """

    name: str = ""

    def __init__(self, comm: Communicator, compressor: Compressor):
        self.comm = comm
        self.compressor = compressor
        self.world_size = comm.world_size
        self.rank = comm.rank
        # a private group for the background thread (created collectively, same order on all ranks)
        ranks = list(range(dist.get_world_size(comm.group))) if comm.group is not None else None
        group = dist.new_group(ranks=ranks) if self.world_size > 1 else comm.group
        self.bg_comm = Communicator(group, comm.stats, time_waits=False)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lowband-{self.name}")
        self._error: Optional[BaseException] = None

    def start(self, tensor: torch.Tensor, name: str) -> PendingReduce:
        """Begin averaging ``tensor`` (flat fp32). It is copied first, so the caller may
        overwrite it as soon as ``start`` returns. ``name`` keys error-feedback residuals."""
        snapshot = tensor.detach().clone()
        return PendingReduce(self._executor.submit(self._run, snapshot, name), self.comm)

    def reduce(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Synchronous convenience: start and wait."""
        return self.start(tensor, name).wait()

    @abstractmethod
    def _run(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The whole pipeline, on the background thread: compress, communicate, decode, average."""

    def state_dict(self) -> dict[str, Any]:
        return {"worker": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state.get("worker", {}))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class AllgatherCollective(CompressedCollective):
    """Exact sum of every rank's decoded payload (divided by N), via one all_gather."""

    name = "allgather"

    def _run(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        payload, ctx = self.compressor.compress(tensor, name)
        buf = payload_to_bytes(payload)
        gathered = torch.empty(self.world_size * buf.numel(), dtype=torch.uint8)
        self.bg_comm.all_gather(gathered, buf)
        total = torch.zeros(ctx.numel, dtype=torch.float32)
        for r, part in enumerate(gathered.view(self.world_size, -1)):
            decoded = self.compressor.decompress(bytes_to_payload(part, payload), ctx)
            total.add_(decoded.reshape(-1).to(torch.float32))
        return total.div_(self.world_size)


class TwoStageAllreduce(CompressedCollective):
    """Compressed reduce-scatter (all_to_all) + server-side re-compression + all_gather.

    Args:
        server_compressor: codec used by each chunk's owner to re-compress the averaged
            chunk; defaults to the worker codec's inner codec with its own error feedback
            (the server-side residual), as in DeepSpeed's compressed all-reduce.
    """

    name = "two-stage"

    def __init__(self, comm: Communicator, compressor: Compressor, server_compressor: Optional[Compressor] = None):
        super().__init__(comm, compressor)
        if server_compressor is None:
            inner = compressor.inner if isinstance(compressor, ErrorFeedback) else compressor
            server_compressor = ErrorFeedback(_fresh_copy(inner))
        self.server = server_compressor

    def chunk_numel(self, numel: int) -> int:
        """Elements per chunk: ceil(numel / N) (the tensor is zero-padded to N chunks)."""
        return -(-numel // self.world_size)

    def _run(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        n, p = tensor.numel(), self.world_size
        c = self.chunk_numel(n)
        padded = torch.zeros(c * p, dtype=torch.float32)
        padded[:n] = tensor.reshape(-1)
        # stage 1: worker-side compression of each chunk, chunk i to rank i
        payloads, ctxs = [], []
        for i, chunk in enumerate(padded.view(p, c)):
            pl, ctx = self.compressor.compress(chunk, f"{name}/chunk{i}")
            payloads.append(pl)
            ctxs.append(ctx)
        send = torch.cat([payload_to_bytes(pl) for pl in payloads])
        recv = torch.empty_like(send)
        self.bg_comm.all_to_all(recv, send)
        # the owner averages the N versions of its chunk and re-compresses with its residual
        mine = torch.zeros(c, dtype=torch.float32)
        like = payloads[self.rank]
        for part in recv.view(p, -1):
            mine.add_(self.compressor.decompress(bytes_to_payload(part, like), ctxs[self.rank]).reshape(-1))
        mine.div_(p)
        server_payload, server_ctx = self.server.compress(mine, f"{name}/server")
        # stage 2: every rank gets every owner's re-compressed chunk
        sbuf = payload_to_bytes(server_payload)
        gathered = torch.empty(p * sbuf.numel(), dtype=torch.uint8)
        self.bg_comm.all_gather(gathered, sbuf)
        out = torch.empty(c * p, dtype=torch.float32)
        for i, part in enumerate(gathered.view(p, -1)):
            ctx = self.server.context_for(server_ctx.shape, torch.float32, f"{name}/server", server_ctx.step)
            out[i * c:(i + 1) * c] = self.server.decompress(bytes_to_payload(part, server_payload), ctx).reshape(-1)
        return out[:n]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "server": self.server.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.server.load_state_dict(state.get("server", {}))


def _fresh_copy(compressor: Compressor) -> Compressor:
    """An independent codec with the same configuration (taken before any use, so stateless)."""
    import copy
    return copy.deepcopy(compressor)


def make_collective(kind: str, comm: Communicator, compressor: Compressor) -> CompressedCollective:
    if kind == "allgather":
        return AllgatherCollective(comm, compressor)
    if kind == "two-stage":
        return TwoStageAllreduce(comm, compressor)
    raise ValueError(f"unknown collective {kind!r}; choose one of: {', '.join(COLLECTIVES)}")
