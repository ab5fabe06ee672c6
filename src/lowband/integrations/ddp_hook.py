"""lowband's compressors as PyTorch DDP communication hooks (PowerSGD-hook style).

For users who keep :class:`torch.nn.parallel.DistributedDataParallel`::

    from lowband.integrations.ddp_hook import CompressionHookState, compression_hook
    state = CompressionHookState(compressor="2bit", collective="two-stage")
    ddp.register_comm_hook(state, compression_hook)
    ...
    print(state.compression_stats())      # fp32 ring bytes vs bytes really sent

Each DDP bucket is averaged through a lowband compressed collective (``allgather``: exact sum of
the decoded payloads; ``two-stage``: compressed all_to_all + server re-compression + all_gather),
with error feedback, each parameter of the bucket compressed as its own segment (per-layer scales
and residuals, as the ``compressed`` algorithm). The averaged bucket comes back on the bucket's
device. The collective runs on its own background thread and private process group,
so the hook returns a ``torch.futures.Future`` at once and backward keeps computing while the
bucket is compressed and sent; DDP waits on the futures at the end of backward.

Why the warm-up (``start_compress_iter``): DDP rebuilds its buckets after the first iteration
(in the order gradients became ready), and hands a hook only a bucket *index* and the bucket's
parameters. Residuals are keyed by the index plus the layout (the shapes of the bucket's
parameters, in order), and created only from iteration ``start_compress_iter >= 2`` on, when the
layout is final (as ``PowerSGDState.start_powerSGD_iter``). A few plain-allreduce iterations also
help accuracy early in training.

Restarts: a new DDP instance reduces its first iteration in its *initial* layout (parameter
registration order), then rebuilds (gradient-ready order). If, in the first iteration after the
state was restored, a bucket's layout differs from the saved one, that bucket is averaged with
plain fp32 allreduce and the saved residuals wait for the next iteration (counted in
``layout_changes``); they are never applied to the wrong elements. A resumed run therefore
equals the uninterrupted one bit for bit when the two layouts agree, and differs by one exact
(uncompressed) iteration otherwise. A layout change at any other time (e.g. a new bucket cap)
starts fresh residuals for the new layout, with a warning.

Pickling (checkpoints): ``__getstate__`` keeps the knobs, the iteration counter, the residuals
and the statistics and drops the process group, the communicator and the background thread;
``__setstate__`` attaches to the default process group. The private group is created
collectively on the first compressed iteration, so every rank must use the restored state.
DDP accepts one hook per model, so restore into a new DDP instance.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.)
"""
import hashlib
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..algorithms.warmup import DEFAULT_COMPRESSION_WARMUP_STEPS
from ..comm.communicator import CommStats, Communicator
from ..comm.plans import COLLECTIVE_CHOICES
from ..comm.wire import allreduce_bytes
from ..codecs import COMPRESSORS, build_compressor
from ..comm.pipeline import Handle
from ..comm.reducer import CompressedReducer, make_reducer

#: Iterations before which bucket-keyed state must not exist (DDP rebuilds buckets after the
#: first iteration; see the module docstring).
MIN_START_COMPRESS_ITER = 2


class CompressionHookState:
    """State of :func:`compression_hook`; one per DDP model.

    Args:
        process_group: the group DDP reduces over (default: the default group).
        compressor: codec name (``2bit``, ``1bit``, ``qsgd``, ... ``none``; as ``--compressor``).
        compressor_options: codec options; ``2bit`` without ``threshold``/``relative`` gets the
            ``compressed`` algorithm's default.
        collective: ``two-stage`` (O(1) bytes per rank in N) or ``allgather`` (exact sum of
            decoded payloads, O(N)).
        error_feedback: per-bucket residual memory on the worker (two-stage's server side always
            keeps its own). Biased codecs stall without it.
        start_compress_iter: iterations of plain fp32 allreduce first (>= 2, see module doc);
            the default matches the ``compressed`` algorithm's ``warmup_steps``.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        compressor: str = "2bit",
        compressor_options: Optional[dict[str, Any]] = None,
        collective: str = "two-stage",
        error_feedback: bool = True,
        start_compress_iter: int = DEFAULT_COMPRESSION_WARMUP_STEPS,
    ) -> None:
        if compressor not in COMPRESSORS:
            raise ValueError(f"unknown compressor {compressor!r}; choose one of: {', '.join(COMPRESSORS)}")
        if collective not in COLLECTIVE_CHOICES:
            raise ValueError(f"unknown collective {collective!r}; choose one of: {', '.join(COLLECTIVE_CHOICES)}")
        if start_compress_iter < MIN_START_COMPRESS_ITER:
            raise ValueError(f"start_compress_iter must be >= {MIN_START_COMPRESS_ITER} (DDP rebuilds "
                             f"buckets after iteration 1), got {start_compress_iter}")
        self.process_group = process_group
        self.compressor = compressor
        self.compressor_options = dict(compressor_options or {})
        self.collective = collective
        self.error_feedback = error_feedback
        self.start_compress_iter = int(start_compress_iter)
        build_compressor(compressor, self.compressor_options)   # validates options
        self.iter = 0
        self.stats = CommStats()
        self.fp32_ring_bytes = 0          # what fp32 ring allreduce would send for the same buckets
        self.layout_changes = 0
        self._layouts: dict[int, str] = {}
        self._restored_iter: Optional[int] = None   # iteration at which a pickled state resumed
        self._reducer: Optional[CompressedReducer] = None
        self._pending_state: dict[str, Any] = {}

    # -- pickling (PowerSGDState style) -----------------------------------------------------
    _UNPICKLED = ("process_group", "_reducer")

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in self._UNPICKLED}
        state["_pending_state"] = self._reducer.state_dict() if self._reducer is not None else self._pending_state
        state["stats"] = self.stats.snapshot()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        stats = CommStats()
        stats.load(state.pop("stats"))
        self.__dict__.update(state, stats=stats, process_group=None, _reducer=None)
        self._restored_iter = self.iter

    # -- internals ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def reducer(self) -> CompressedReducer:
        """The compressed collective, built (collectively: it creates a private group) on first use."""
        if self._reducer is None:
            codec = build_compressor(self.compressor, self.compressor_options)
            self._reducer = make_reducer(self.collective, Communicator(self.process_group, self.stats), codec,
                                         self.error_feedback)
            self._reducer.load_state_dict(self._pending_state)
            self._pending_state = {}
        return self._reducer

    def bucket_key(self, bucket: dist.GradBucket) -> Optional[str]:
        """Residual key of a bucket: its index and a digest of its layout (parameter shapes in
        order), so a residual is never applied to another layout. ``None``: the first iteration
        after a restore sees DDP's initial layout; reduce it uncompressed (module docstring)."""
        shapes = ";".join("x".join(map(str, p.shape)) for p in bucket.parameters())
        layout = hashlib.blake2b(shapes.encode(), digest_size=6).hexdigest()
        index = bucket.index()
        if self._layouts.get(index, layout) != layout:
            self.layout_changes += 1
            if self.iter == self._restored_iter:
                return None
            warnings.warn(f"DDP bucket {index} has a new layout; its error-feedback residuals start "
                          "from zero", stacklevel=3)
        self._layouts[index] = layout
        return f"bucket{index}:{layout}"

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Bucket 0 is reduced last, so an iteration ends with ``bucket.is_last()``."""
        if bucket.is_last():
            self.iter += 1

    # -- reporting ---------------------------------------------------------------------------
    def compression_stats(self) -> dict[str, float]:
        """Bytes this rank sent through the hook vs. fp32 ring allreduce of the same buckets
        (warm-up iterations included, as plain allreduce)."""
        sent = self.stats.bytes_sent
        return {
            "iterations": self.iter,
            "fp32_ring_bytes": self.fp32_ring_bytes,
            "bytes_sent": sent,
            "ratio": sent / self.fp32_ring_bytes if self.fp32_ring_bytes else float("nan"),
            "layout_changes": self.layout_changes,
        }

    def close(self) -> None:
        """Stop the background thread (idempotent)."""
        if self._reducer is not None:
            self._pending_state = self._reducer.state_dict()
            self._reducer.close()
            self._reducer = None


def _ring_bytes(numel: int, element_size: int, world: int) -> int:
    return int(round(allreduce_bytes(numel * element_size, world)))


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` through lowband's compressed collective (after the
    plain-allreduce warm-up). Register with ``ddp.register_comm_hook(state, compression_hook)``."""
    buf = bucket.buffer()
    world = state.world_size
    state.fp32_ring_bytes += _ring_bytes(buf.numel(), 4, world)
    key = state.bucket_key(bucket) if state.iter >= state.start_compress_iter else None
    if key is None:   # warm-up, or a restored state meeting DDP's initial layout
        state.maybe_increase_iter(bucket)
        nbytes = buf.numel() * buf.element_size()
        state.stats.record("all_reduce", nbytes, _ring_bytes(buf.numel(), buf.element_size(), world),
                           _ring_bytes(buf.numel(), buf.element_size(), world))
        buf.div_(world)   # divide before summing, as DDP's allreduce_hook (no fp16 overflow)
        work = dist.all_reduce(buf, group=state.process_group, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])
    state.maybe_increase_iter(bucket)
    dtype, device = buf.dtype, buf.device
    # on CUDA a stream-aware future: DDP's stream waits for the stream that set the result,
    # which itself waited for the pipeline's side stream (lowband.comm.streams)
    out: torch.futures.Future[torch.Tensor] = \
        torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()

    def finish(done: Handle) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(done.result().to(device=device, dtype=dtype))

    # each parameter is its own segment (per-layer scales and residuals), as in ``compressed``
    segments = [(f"{key}/{j}", p.numel()) for j, p in enumerate(bucket.parameters())]
    if sum(n for _, n in segments) != buf.numel():   # a bucket layout with padding: one segment
        segments = None
    state.reducer().start(buf.to(torch.float32), key, segments).add_done_callback(finish)
    return out
