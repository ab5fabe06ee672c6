"""PyTorch DistributedDataParallel peers: ``ddp``, ``ddp-fp16``, ``ddp-powersgd``.

These run real ``torch.nn.parallel.DistributedDataParallel`` (its Reducer, bucketing and
overlap with backward) so lowband is compared against the system users actually run, not a
re-implementation of it. Only the communication hook is lowband's, and only so the bytes are
counted where they are sent:

* ``ddp``: divide the bucket by the world size, all-reduce (sum) — what
  ``default_hooks.allreduce_hook`` does, issued through lowband's :class:`Communicator`.
* ``ddp-fp16``: cast to fp16, divide, all-reduce, copy back — what ``fp16_compress_hook``
  does; the counted bytes are fp16 bytes.
* ``ddp-powersgd``: PyTorch's own layer-wise ``powerSGD_hook``; its all-reduces are counted
  from the P/Q/uncompressed sizes the hook will send (the same rule the hook applies).

Exposed communication wait: DDP waits for its buckets inside ``backward()`` (C++ finalize),
where no lowband code runs. What is measurable is the time from the moment the *last* bucket
was handed to the hook (backward compute is then essentially over) to the moment the last
bucket's reduction completed; ``comm_wait_s`` is that interval per step. It includes the
hook's own work after that moment (the fp16 cast-back, PowerSGD's matmuls on the last
bucket), so it is an upper bound on pure waiting. See ``docs/peers.md``.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from ...comm.communicator import flatten, unflatten_into
from ..base import Algorithm, BoundAlgorithm, EngineContext
from ..warmup import Warmup
from ...comm.wire import MIB, allreduce_bytes

#: DDP's own default bucket cap (``torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB``)
DDP_DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass
class DDP(Algorithm):
    """PyTorch DDP with its default (mean) all-reduce.

    Knobs:
        bucket_cap_mb: DDP's ``bucket_cap_mb``. Passed explicitly, so DDP also uses it for its
            first bucket (left unset, DDP caps the first bucket at 1 MiB).
        broadcast_buffers: DDP's default behaviour of broadcasting rank 0's buffers
            (BatchNorm statistics) before every forward (DDP's ``broadcast_buffers``, renamed
            ``forward_sync_buffers`` in torch 2.13). lowband performs that broadcast
            through its Communicator (a DDP buffer hook) so those bytes are counted too.
        find_unused_parameters: DDP's knob of that name (default False, as PyTorch's: the
            search walks the autograd graph every step). A model with parameters that some
            rank does not use in a step needs True; without it DDP itself stops with its
            "Expected to have finished reduction" error.
    """

    bucket_cap_mb: float = DDP_DEFAULT_BUCKET_CAP_MB
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False

    name: ClassVar[str] = "ddp"

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"{self.name}: bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        for knob in ("broadcast_buffers", "find_unused_parameters"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"{self.name}: {knob} must be True or False, got {getattr(self, knob)!r}")

    def bind(self, ctx: EngineContext) -> "BoundDDP":
        return BoundDDP(self, ctx)


@dataclass
class DDPFP16(DDP):
    """DDP with ``fp16_compress_hook``: gradients travel as fp16 (half the bytes), are summed
    in fp16 after dividing by the world size, and are cast back to the bucket's dtype."""

    name: ClassVar[str] = "ddp-fp16"

    def bind(self, ctx: EngineContext) -> "BoundDDPFP16":
        return BoundDDPFP16(self, ctx)


@dataclass
class DDPPowerSGD(DDP):
    """DDP with PyTorch's layer-wise ``powerSGD_hook`` (Vogels et al., 2019).

    Per bucket, every gradient matrix M (n x m) whose rank-r form saves at least
    ``min_compression_rate`` is sent as P = MQ (n x r) and Q = M^T P (m x r), two sequential
    all-reduces; 1-D tensors and small matrices are all-reduced uncompressed.

    Knobs:
        matrix_approximation_rank: r. Lower is more compression and less accuracy; 1-4 is
            typical. Default 2: rank 1 visibly lags on the LeNet CNN in short runs.
        start_powerSGD_iter: plain all-reduce for this many steps first. PyTorch requires
            > 1 with error feedback or warm start (DDP rebuilds its buckets after step 1,
            which would invalidate per-bucket memories). PyTorch's default is 1000 and its
            advice is ~10% of training; lowband's runs are a few hundred steps, so 10.
        min_compression_rate: compress a matrix only if n*m > rate * (n+m)*r.
        use_error_feedback: add the previous step's compression error back (PowerSGD is
            biased; without it accuracy suffers).
        warm_start: reuse last step's Q instead of a fresh random one (better approximation).
        orthogonalization_epsilon: added to column norms in Gram-Schmidt; > 0 avoids NaN
            when a layer's gradient is exactly zero.
        random_seed: seed of the shared RNG that draws Q when it is (re)initialised.
        bucket_cap_mb: must hold the whole model (one bucket): the layer-wise hook breaks on
            gloo with two or more buckets — see ``docs/peers.md`` for the root cause.
    """

    matrix_approximation_rank: int = 2
    start_powerSGD_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0

    name: ClassVar[str] = "ddp-powersgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.matrix_approximation_rank, int) or self.matrix_approximation_rank < 1:
            raise ValueError(f"ddp-powersgd: matrix_approximation_rank must be an integer >= 1, "
                             f"got {self.matrix_approximation_rank!r}")
        if not isinstance(self.start_powerSGD_iter, int) or self.start_powerSGD_iter < 0:
            raise ValueError(f"ddp-powersgd: start_powerSGD_iter must be an integer >= 0, got {self.start_powerSGD_iter!r}")
        if (self.use_error_feedback or self.warm_start) and self.start_powerSGD_iter <= 1:
            raise ValueError("ddp-powersgd: start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is "
                             "on, because DDP rebuilds its buckets after the first step and per-bucket memories "
                             f"made before that would not fit; got {self.start_powerSGD_iter}")
        if not self.min_compression_rate > 0:
            raise ValueError(f"ddp-powersgd: min_compression_rate must be > 0, got {self.min_compression_rate}")
        if not self.orthogonalization_epsilon >= 0:
            raise ValueError(f"ddp-powersgd: orthogonalization_epsilon must be >= 0, got {self.orthogonalization_epsilon}")
        for knob in ("use_error_feedback", "warm_start"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"ddp-powersgd: {knob} must be True or False, got {getattr(self, knob)!r}")
        if self.find_unused_parameters:
            raise ValueError("ddp-powersgd: find_unused_parameters=True is not supported: with it, PyTorch's "
                             "powerSGD_hook aborts gloo ('Received data size doesn't match') at its first "
                             "compressed step, with plain DDP too (docs/peers.md); use ddp or ddp-fp16")

    def bind(self, ctx: EngineContext) -> "BoundDDPPowerSGD":
        return BoundDDPPowerSGD(self, ctx)


#: DDP's per-forward buffer broadcast flag: ``forward_sync_buffers`` since torch 2.13,
#: ``broadcast_buffers`` before (the GPU image runs torch 2.11)
_SYNC_BUFFERS_FLAG = ("forward_sync_buffers"
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                      else "broadcast_buffers")


class BoundDDP(BoundAlgorithm):
    """DDP bound to one engine: the DistributedDataParallel wrapper and the wait clock."""

    cfg: DDP
    uses_gradient_hooks: ClassVar[bool] = False
    clips: ClassVar[bool] = True
    scales: ClassVar[bool] = True

    def __init__(self, cfg: DDP, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        self.ddp: Optional[DistributedDataParallel] = None
        self._t_last_ready: Optional[float] = None
        self._t_done: Optional[float] = None

    def wrap_module(self, model: nn.Module) -> nn.Module:
        # init_sync=False: the engine has already broadcast rank 0's parameters and buffers.
        # DDP's own buffer broadcast is replaced by a counted one (see _broadcast_buffers).
        self.ddp = DistributedDataParallel(
            model, process_group=self.ctx.comm.group, bucket_cap_mb=self.cfg.bucket_cap_mb,
            init_sync=False, find_unused_parameters=self.cfg.find_unused_parameters,
            **{_SYNC_BUFFERS_FLAG: self.cfg.broadcast_buffers})
        if self.cfg.broadcast_buffers and any(True for _ in model.buffers()):
            from torch.nn.parallel.distributed import _BufferCommHookLocation
            self.ddp._register_buffer_comm_hook(self, BoundDDP._broadcast_buffers, _BufferCommHookLocation.PRE_FORWARD)
        # A closure without annotations: DDP checks a hook's annotations against the classes,
        # which string annotations (``from __future__ import annotations``) would fail.
        self.ddp.register_comm_hook(None, lambda _state, bucket: self._hook(bucket))
        return self.ddp

    def no_sync(self) -> ContextManager[None]:
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    # -- communication -------------------------------------------------------------------
    def _broadcast_buffers(self, named_buffers: dict[str, torch.Tensor]) -> None:
        """DDP's default buffer sync (rank 0 is authoritative), coalesced per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in named_buffers.values():
            by_dtype.setdefault(b.dtype, []).append(b)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = flatten(group)
                self.ctx.comm.broadcast(flat, src=0)
                unflatten_into(flat, group)

    def _mark_ready(self) -> None:
        self._t_last_ready = time.perf_counter()

    def _mark_done(self, value: Any) -> Any:
        # runs on whichever thread completes the future; a float store is atomic under the GIL
        now = time.perf_counter()
        self._t_done = now if self._t_done is None else max(self._t_done, now)
        return value

    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """``allreduce_hook``: divide first (as PyTorch does, to avoid overflow), then sum."""
        self._mark_ready()
        tensor = bucket.buffer()
        tensor.div_(self.ctx.world_size)
        work = self.ctx.comm.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        return work.get_future(tensor).then(lambda fut: self._mark_done(tensor))

    # -- per iteration -------------------------------------------------------------------
    def step(self) -> None:
        if self._t_last_ready is not None and self._t_done is not None:
            self.ctx.charge_wait(max(0.0, self._t_done - self._t_last_ready))
        self._t_last_ready = self._t_done = None
        self.ctx.optimizer_step()         # DDP's .grad holds the average after backward

    def close(self) -> None:
        self.ddp = None


class BoundDDPFP16(BoundDDP):
    """DDP with the fp16 hook, bound to one engine."""

    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self._mark_ready()
        buffer = bucket.buffer()
        compressed = buffer.to(torch.float16).div_(self.ctx.world_size)
        work = self.ctx.comm.all_reduce(compressed, op=dist.ReduceOp.SUM, async_op=True)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(compressed)   # in place, as PyTorch does, to keep peak memory down
            return self._mark_done(buffer)

        return work.get_future(compressed).then(decompress)


class BoundDDPPowerSGD(BoundDDP):
    """DDP with PyTorch's PowerSGD hook, bound to one engine: the hook's state (memories, RNG).

    Under a GradScaler (``scales`` False) the engine's guard unscales each gradient in its
    post-accumulate-grad hook, which autograd runs before DDP's reducer copies the gradient
    into its bucket: ``powerSGD_hook`` compresses unscaled gradients, so the error feedback
    and the warm-started factors are in the units of an fp32 run whatever the scale does.

    The hook runs inside backward, before the ranks have agreed whether the step is finite.
    Where the engine may skip a step after its backward (``ctx.skippable``: a GradScaler's inf
    step, the policy "skip"), the hook first keeps what it is about to change
    (:class:`_Undo`), and a step the engine skipped (``step()`` was not called for it) is put
    back before anything reads the state again: the next backward's hook, ``state_dict``,
    ``drain``. The engine skips the step on every rank alike (the guard's exchange), so every
    rank puts its own state back and the skipped step leaves no trace: not in the error
    feedback, the factors, the iteration count (``start_powerSGD_iter``) or the RNG that draws
    fresh Q. Memory, only where ``ctx.skippable``: the error tensor the hook replaces stays
    alive from the hook to ``step()`` (one more bucket-sized buffer, the size of the model's
    gradients; the hook itself briefly holds three: that one, its input's copy and the new
    error), plus copies of the P and Q memories (the compressed sizes, sum of (n + m) * r
    over the compressed matrices) and of the RNG's state (2.5 KB)."""

    cfg: DDPPowerSGD
    scales: ClassVar[bool] = False

    def __init__(self, cfg: DDPPowerSGD, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        nbytes = sum(p.numel() * p.element_size() for p in ctx.params)
        if nbytes > self.cfg.bucket_cap_mb * MIB or len({p.dtype for p in ctx.params}) > 1:
            raise ValueError(
                f"ddp-powersgd: the model's {nbytes / MIB:.2f} MiB of gradients must fit one DDP bucket "
                f"(bucket_cap_mb={self.cfg.bucket_cap_mb}) and share one dtype, because PyTorch's layer-wise "
                "powerSGD_hook issues collectives from future callbacks and with two or more buckets the ranks "
                "issue them in different orders on gloo (mismatch or deadlock); raise bucket_cap_mb")
        self.state = psgd.PowerSGDState(
            process_group=ctx.comm.group, matrix_approximation_rank=self.cfg.matrix_approximation_rank,
            start_powerSGD_iter=self.cfg.start_powerSGD_iter, min_compression_rate=self.cfg.min_compression_rate,
            use_error_feedback=self.cfg.use_error_feedback, warm_start=self.cfg.warm_start,
            orthogonalization_epsilon=self.cfg.orthogonalization_epsilon, random_seed=self.cfg.random_seed)
        self.warmup = Warmup(self.cfg.start_powerSGD_iter)   # the same schedule the hook follows
        self._name_of = {id(p): n for n, p in zip(ctx.names, ctx.params)}
        self._param_of = dict(zip(ctx.names, ctx.params))
        self._layout: Optional[tuple[str, ...]] = None   # bucket order the memories follow
        self._undo: Optional[_Undo] = None   # the state before a step the engine may still skip

    def _count(self, bucket: dist.GradBucket) -> None:
        """Record the all-reduces ``powerSGD_hook`` is about to issue for this bucket, from
        the same per-tensor rule the hook applies (``psgd._should_compress``)."""
        comm, buffer = self.ctx.comm, bucket.buffer()
        esize = buffer.element_size()
        if self.warmup.active(self.state.iter):
            comm.stats.record("all_reduce", *_all_reduce_bytes(buffer.numel() * esize, comm.world_size))
            return
        uncompressed = ps = qs = 0
        for tensor in bucket.gradients():
            n, m = tensor.view(tensor.shape[0], -1).shape
            r = min(n, m, self.state.matrix_approximation_rank)
            if psgd._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                ps += n * r
                qs += m * r
            else:
                uncompressed += tensor.numel()
        for numel in (uncompressed, ps, qs):   # three all-reduces, in the hook's order
            comm.stats.record("all_reduce", *_all_reduce_bytes(numel * esize, comm.world_size))

    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if bucket.index() != 0 and not self.warmup.active(self.state.iter):
            raise RuntimeError("ddp-powersgd: DDP made a second bucket; the layer-wise PowerSGD hook is only "
                               "safe on gloo with one bucket (raise bucket_cap_mb)")
        self._mark_ready()
        self._put_back_skipped()
        self._follow_layout(bucket)
        self._keep()
        self._count(bucket)
        return psgd.powerSGD_hook(self.state, bucket).then(lambda fut: self._mark_done(fut.value()))

    def step(self) -> None:
        self._undo = None             # the step applies: what the hook did stays
        super().step()

    def drain(self) -> None:
        self._put_back_skipped()

    # -- skipped steps -------------------------------------------------------------------
    def _keep(self) -> None:
        """Before the hook's first bucket of step ``ctx.steps``, where the engine may skip
        that step: keep the state the hook is about to change. The error tensors are kept as
        they are (the hook replaces them, never writes into them); the P and Q memories are
        copied (the hook writes them in place)."""
        if not self.ctx.skippable or self._undo is not None:
            return
        s = self.state
        self._undo = _Undo(
            step=self.ctx.steps, iter=s.iter, rng=s.rng.get_state(),
            numel=(s.total_numel_before_compression, s.total_numel_after_compression),
            error=dict(s.error_dict),
            p_memory={k: v.clone() for k, v in s.p_memory_dict.items()},
            q_memory={k: v.clone() for k, v in s.q_memory_dict.items()})

    def _put_back_skipped(self) -> None:
        """Put the state back as it was before a step that is over and was not applied (the
        engine skipped it on every rank); nothing otherwise."""
        undo = self._undo
        if undo is None or undo.step >= self.ctx.steps:
            return
        self._undo = None
        s = self.state
        s.iter = undo.iter
        s.rng.set_state(undo.rng)
        s.total_numel_before_compression, s.total_numel_after_compression = undo.numel
        s.error_dict, s.p_memory_dict, s.q_memory_dict = undo.error, undo.p_memory, undo.q_memory

    # -- bucket layout -------------------------------------------------------------------
    def _follow_layout(self, bucket: dist.GradBucket) -> None:
        """Keep PowerSGD's flat per-bucket memories aligned with the bucket's parameter order.

        A fresh DDP orders its first bucket by registration and, after one backward,
        rebuilds it in gradient-ready order. In a fresh run the memories do not exist yet
        at that point, but after a resume they do, and PyTorch would silently apply them to
        the wrong parameters (same length, different order). The memories are permuted
        parameter by parameter whenever the order changes."""
        layout = tuple(self._name_of[id(p)] for p in bucket.parameters())
        if self._layout is not None and layout != self._layout:
            old, new = self._slices(self._layout), self._slices(layout)
            for memory, kind in ((self.state.error_dict, 0), (self.state.p_memory_dict, 1),
                                 (self.state.q_memory_dict, 2)):
                if 0 in memory:
                    memory[0] = _permute(memory[0], old[kind], new[kind])
        self._layout = layout

    def _slices(self, layout: tuple[str, ...]) -> tuple[dict[str, slice], dict[str, slice], dict[str, slice]]:
        """Where each parameter lives in the flat error, P and Q memories for ``layout``: the
        error follows bucket order; P and Q hold the compressed matrices grouped by shape in
        order of first appearance, as ``powerSGD_hook`` lays them out."""
        error: dict[str, slice] = {}
        by_shape: dict[tuple[int, int], list[str]] = {}
        offset = 0
        for name in layout:
            param = self._param_of[name]
            error[name] = slice(offset, offset + param.numel())
            offset += param.numel()
            n, m = param.view(param.shape[0], -1).shape
            r = min(n, m, self.cfg.matrix_approximation_rank)
            if psgd._should_compress(n, m, r, self.cfg.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append(name)
        p_slices: dict[str, slice] = {}
        q_slices: dict[str, slice] = {}
        p_off = q_off = 0
        for (n, m), names in by_shape.items():
            r = min(n, m, self.cfg.matrix_approximation_rank)
            for name in names:
                p_slices[name] = slice(p_off, p_off + n * r)
                q_slices[name] = slice(q_off, q_off + m * r)
                p_off += n * r
                q_off += m * r
        return error, p_slices, q_slices

    def step_metrics(self) -> dict[str, Any]:
        """``warmup``: whether the hook all-reduced the step just taken uncompressed
        (``start_powerSGD_iter``; the hook has counted the step by now)."""
        return {"warmup": self.warmup.active(self.state.iter - 1)}

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """PowerSGD's memories as tensors and plain numbers only, so that
        ``torch.load(weights_only=True)`` reads a checkpoint (``PowerSGDState`` itself pickles a
        numpy RandomState). Memories are flat over the single bucket; ``layout`` (parameter
        names in bucket order) lets a resumed run re-align them to its own bucket order. A
        skipped step's changes are put back first."""
        self._put_back_skipped()
        s = self.state
        kind, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            "iter": s.iter,
            "error": {k: v.clone() for k, v in s.error_dict.items()},
            "p_memory": {k: v.clone() for k, v in s.p_memory_dict.items()},
            "q_memory": {k: v.clone() for k, v in s.q_memory_dict.items()},
            "rng_keys": torch.from_numpy(keys.astype(np.int64)),
            "rng_pos": int(pos), "rng_has_gauss": int(has_gauss), "rng_cached_gaussian": float(cached),
            "numel_before": s.total_numel_before_compression, "numel_after": s.total_numel_after_compression,
            "layout": list(self._layout or ()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._undo = None
        s = self.state
        s.iter = int(state["iter"])
        s.error_dict = {int(k): v.clone() for k, v in state["error"].items()}
        s.p_memory_dict = {int(k): v.clone() for k, v in state["p_memory"].items()}
        s.q_memory_dict = {int(k): v.clone() for k, v in state["q_memory"].items()}
        s.rng.set_state(("MT19937", state["rng_keys"].cpu().numpy().astype(np.uint32), state["rng_pos"],
                         state["rng_has_gauss"], state["rng_cached_gaussian"]))
        s.total_numel_before_compression = int(state["numel_before"])
        s.total_numel_after_compression = int(state["numel_after"])
        self._layout = tuple(state["layout"]) or None


@dataclass
class _Undo:
    """What ``powerSGD_hook`` changes in one step, as it was before the step's backward
    (:meth:`BoundDDPPowerSGD._keep`)."""

    step: int                              #: ``ctx.steps`` of that step
    iter: int
    rng: tuple                             #: the state of the numpy RandomState that seeds fresh Q
    numel: tuple[int, int]                 #: the compression statistics' counters
    error: dict[int, torch.Tensor]         #: the error tensors themselves
    p_memory: dict[int, torch.Tensor]      #: copies
    q_memory: dict[int, torch.Tensor]      #: copies


def _permute(flat: torch.Tensor, old: dict[str, slice], new: dict[str, slice]) -> torch.Tensor:
    """``flat`` laid out by ``old`` rearranged into the ``new`` layout (same parameters)."""
    out = torch.empty_like(flat)
    for name, where in new.items():
        out[where] = flat[old[name]]
    return out


def _all_reduce_bytes(nbytes: int, world_size: int) -> tuple[int, float, float]:
    """(payload, sent, received) of one ring all-reduce — the Communicator's wire model, for
    collectives PyTorch's hook issues itself."""
    wire = allreduce_bytes(nbytes, world_size)
    return nbytes, wire, wire
