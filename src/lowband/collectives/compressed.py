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

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

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


Segments = Sequence[tuple[str, int]]


class CompressedCollective(ABC):
    """Averages a flat fp32 tensor across ranks through a compressor, asynchronously.

    The tensor is a concatenation of *segments* (normally one per parameter, named after it):
    each segment is compressed on its own, so scale-dependent codecs (1-bit's scale, a 2-bit
    threshold, top-k's selection) see one layer's gradient rather than a mix of layers whose
    magnitudes differ by orders of magnitude, and error-feedback residuals are keyed by
    parameter name. All segments of one call still travel in one collective.

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
        group = dist.new_group(ranks=list(range(self.world_size))) if self.world_size > 1 else comm.group
        self.bg_comm = Communicator(group, comm.stats, time_waits=False)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lowband-{self.name}")

    @staticmethod
    def _segments(tensor: torch.Tensor, name: str, segments: Optional[Segments]) -> list[tuple[str, int]]:
        segs = [(name, tensor.numel())] if segments is None else list(segments)
        if sum(n for _, n in segs) != tensor.numel():
            raise ValueError(f"segments of {name!r} cover {sum(n for _, n in segs)} elements, tensor has {tensor.numel()}")
        return segs

    def start(self, tensor: torch.Tensor, name: str, segments: Optional[Segments] = None) -> PendingReduce:
        """Begin averaging ``tensor`` (flat fp32). It is copied first, so the caller may
        overwrite it as soon as ``start`` returns. ``segments`` — ``(name, numel)`` pairs
        covering the tensor — default to one segment called ``name``."""
        segs = self._segments(tensor, name, segments)
        snapshot = tensor.detach().clone()
        return PendingReduce(self._executor.submit(self._run, snapshot, segs), self.comm)

    def reduce(self, tensor: torch.Tensor, name: str, segments: Optional[Segments] = None) -> torch.Tensor:
        """Synchronous convenience: start and wait."""
        return self.start(tensor, name, segments).wait()

    def start_full_precision(self, tensor: torch.Tensor, name: str, segments: Optional[Segments] = None,
                             flush_residuals: bool = False) -> PendingReduce:
        """Average ``tensor`` uncompressed (fp32 all-reduce), queued behind earlier jobs on the
        same background thread. With ``flush_residuals`` the error-feedback memory of each
        segment is added to the contribution and zeroed, so this exact step also delivers what
        compression held back (CP-SGD's correction step, flushing variant)."""
        segs = self._segments(tensor, name, segments)
        snapshot = tensor.detach().clone()
        return PendingReduce(self._executor.submit(self._run_full, snapshot, segs, flush_residuals), self.comm)

    def _run_full(self, tensor: torch.Tensor, segments: list[tuple[str, int]], flush: bool) -> torch.Tensor:
        if flush:
            offset = 0
            for seg_name, n in segments:
                self._flush_into(tensor[offset:offset + n], seg_name)
                offset += n
        self.bg_comm.all_reduce(tensor, op=dist.ReduceOp.AVG)
        return tensor

    def _flush_into(self, segment: torch.Tensor, name: str) -> None:
        """Add and zero this rank's residual(s) for one segment."""
        _take_residual(self.compressor, name, segment)

    @abstractmethod
    def _run(self, tensor: torch.Tensor, segments: list[tuple[str, int]]) -> torch.Tensor:
        """The whole pipeline, on the background thread: compress, communicate, decode, average."""

    def state_dict(self) -> dict[str, Any]:
        return {"worker": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state.get("worker", {}))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _take_residual(codec: Compressor, name: str, into: torch.Tensor, scale: float = 1.0) -> None:
    """``into += scale * residual(name)`` and zero the residual (no-op without one)."""
    if isinstance(codec, ErrorFeedback) and codec.has_residual(name):
        e = codec.residual(name)
        into.add_(e.reshape(-1)[:into.numel()], alpha=scale)
        e.zero_()


class AllgatherCollective(CompressedCollective):
    """Exact sum of every rank's decoded payload (divided by N), via one all_gather."""

    name = "allgather"

    def _run(self, tensor: torch.Tensor, segments: list[tuple[str, int]]) -> torch.Tensor:
        payloads, ctxs, offset = [], [], 0
        for seg_name, n in segments:
            pl, ctx = self.compressor.compress(tensor[offset:offset + n], seg_name)
            payloads.append(pl)
            ctxs.append(ctx)
            offset += n
        like = [t for pl in payloads for t in pl]
        buf = payload_to_bytes(like)
        gathered = torch.empty(self.world_size * buf.numel(), dtype=torch.uint8)
        self.bg_comm.all_gather(gathered, buf)
        total = torch.zeros(tensor.numel(), dtype=torch.float32)
        for part in gathered.view(self.world_size, -1):
            tensors, offset, k = bytes_to_payload(part, like), 0, 0
            for pl, ctx in zip(payloads, ctxs):
                decoded = self.compressor.decompress(tensors[k:k + len(pl)], ctx)
                total[offset:offset + ctx.numel].add_(decoded.reshape(-1).to(torch.float32))
                offset += ctx.numel
                k += len(pl)
        return total.div_(self.world_size)


class TwoStageAllreduce(CompressedCollective):
    """Compressed reduce-scatter (all_to_all) + server-side re-compression + all_gather.

    Each segment is zero-padded to N equal chunks; rank i owns chunk i of every segment.

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
        """Elements per chunk: ceil(numel / N) (each segment is zero-padded to N chunks)."""
        return -(-numel // self.world_size)

    def _run(self, tensor: torch.Tensor, segments: list[tuple[str, int]]) -> torch.Tensor:
        p = self.world_size
        # stage 1: worker-side compression of chunk i of every segment, sent to rank i
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(p)]
        mine_ctx, offset = [], 0
        for seg_name, n in segments:
            c = self.chunk_numel(n)
            padded = torch.zeros(c * p, dtype=torch.float32)
            padded[:n] = tensor[offset:offset + n]
            offset += n
            for i, chunk in enumerate(padded.view(p, c)):
                pl, ctx = self.compressor.compress(chunk, f"{seg_name}/chunk{i}")
                per_rank[i].extend(pl)
                if i == self.rank:
                    mine_ctx.append((pl, ctx))
        send = torch.cat([payload_to_bytes(pls) for pls in per_rank])
        recv = torch.empty_like(send)
        self.bg_comm.all_to_all(recv, send)
        # the owner averages the N versions of its chunks and re-compresses with its residual
        like = per_rank[self.rank]
        server_payloads, server_ctxs = [], []
        versions = [bytes_to_payload(part, like) for part in recv.view(p, -1)]
        k = 0
        for (seg_name, _), (pl, ctx) in zip(segments, mine_ctx):
            avg = torch.zeros(ctx.numel, dtype=torch.float32)
            for tensors in versions:
                avg.add_(self.compressor.decompress(tensors[k:k + len(pl)], ctx).reshape(-1))
            avg.div_(p)
            k += len(pl)
            spl, sctx = self.server.compress(avg, f"{seg_name}/server")
            server_payloads.append(spl)
            server_ctxs.append(sctx)
        # stage 2: every rank gets every owner's re-compressed chunks
        slike = [t for spl in server_payloads for t in spl]
        sbuf = payload_to_bytes(slike)
        gathered = torch.empty(p * sbuf.numel(), dtype=torch.uint8)
        self.bg_comm.all_gather(gathered, sbuf)
        out = torch.empty(tensor.numel(), dtype=torch.float32)
        owners = [bytes_to_payload(part, slike) for part in gathered.view(p, -1)]
        offset, k = 0, 0
        for (seg_name, n), spl, sctx in zip(segments, server_payloads, server_ctxs):
            c = self.chunk_numel(n)
            full = torch.empty(c * p, dtype=torch.float32)
            for i, tensors in enumerate(owners):
                full[i * c:(i + 1) * c] = self.server.decompress(tensors[k:k + len(spl)], sctx).reshape(-1)
            out[offset:offset + n] = full[:n]
            offset += n
            k += len(spl)
        return out

    def _flush_into(self, segment: torch.Tensor, name: str) -> None:
        """Worker residuals live per chunk; this rank's server residual covers its own chunk.
        The server residual is scaled by N because the all-reduce averages contributions."""
        n, p = segment.numel(), self.world_size
        c = self.chunk_numel(n)
        padded = torch.zeros(c * p, dtype=torch.float32)
        for i in range(p):
            _take_residual(self.compressor, f"{name}/chunk{i}", padded[i * c:(i + 1) * c])
        _take_residual(self.server, f"{name}/server", padded[self.rank * c:(self.rank + 1) * c], scale=p)
        segment.add_(padded[:n])

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
