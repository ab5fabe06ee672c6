"""Synchronous compressed SGD: any codec (with error feedback) per bucket, launched during backward.

With ``compressor="2bit"`` this is the paper's baseline, "synchronous 2-bit gradient
compression" (MXNet's ``2bit`` + error feedback), on lowband's explicit collectives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import numpy as np
import torch

from ..comm.plans import COLLECTIVE_CHOICES
from ..comm.wire import MIB
from ..codecs import COMPRESSORS, build_compressor
from ..comm.pipeline import Handle
from ..comm.reducer import CompressedReducer, make_reducer
from .base import Algorithm, BoundAlgorithm, EngineContext, Finiteness
from .warmup import DEFAULT_COMPRESSION_WARMUP_STEPS, Warmup
from .buckets import Bucket, BucketSet


def check_compression_knobs(owner: str, compressor: str, options: dict[str, Any], collective: str,
                            bucket_mb: float) -> None:
    """The knobs every compressing algorithm shares; ValueError naming the first bad one."""
    if compressor not in COMPRESSORS:
        raise ValueError(f"unknown compressor {compressor!r}; choose one of: {', '.join(COMPRESSORS)}")
    if collective not in COLLECTIVE_CHOICES:
        raise ValueError(f"unknown collective {collective!r}; choose one of: {', '.join(COLLECTIVE_CHOICES)}")
    if not bucket_mb > 0:
        raise ValueError(f"{owner}: bucket_mb must be > 0, got {bucket_mb}")
    build_compressor(compressor, options)   # validates the codec's options


@dataclass
class CompressedSGD(Algorithm):
    """Knobs:
        compressor: codec name (``2bit``, ``1bit``, ``qsgd``, ``terngrad``, ``topk``,
            ``randomk``, ``fp16``, ``bf16``, ``powersgd``, ``none``).
        compressor_options: codec options, e.g. ``{"threshold": 0.01}`` for 2bit (in
            mean-gradient units; MXNet's summed-gradient threshold divided by the local batch).
        collective: ``two-stage`` (compressed all_to_all + server re-compression + all_gather,
            O(1) bytes per rank in N), ``allgather`` (every payload to every rank, exact sum of
            the decoded payloads, O(N)) or ``auto`` (the default: allgather up to 4 ranks,
            two-stage above; ``lowband.comm.plans.resolve_collective``).
        error_feedback: keep a per-bucket residual (worker side; the two-stage server keeps
            its own). Without it biased codecs stall.
        bucket_mb: bucket size cap in MiB, as DDP's ``bucket_cap_mb`` (25). Bigger than
            ``ssgd``'s 1: every bucket costs a codec call, one or two gloo collectives and the
            thread hand-offs, CPU per step that a 1-core worker cannot hide, while its
            compressed bytes are few to overlap with backward (docs/compression.md, "Bucket
            size").
        overlap: as for ``ssgd``.
        compress_vectors: also compress 1-D parameters (biases, BatchNorm scales). Off by
            default, as in PyTorch's PowerSGD hook: they are <1% of the elements of typical
            convnets (0.5% of ResNet-20), so sending them in fp32 costs little, and their
            gradients are systematically larger and matter more per element than weights'.
            They then share the buckets of the matrices and travel in fp32 in the same message
            as the codes (``exact_segments`` of the reducer): one collective per bucket.
        warmup_steps: steps averaged with plain fp32 all-reduce before compression starts (as
            PowerSGD's ``start_powerSGD_iter``, DeepSpeed's ``freeze_step``, CP-SGD's 1000
            S-SGD iterations): early gradients are large and change fast, when compression
            error hurts most. The default, 100 steps, is about a tenth of the 2-epoch ResNet-20
            run that reached S-SGD's accuracy only with it (docs/compression.md); set 0 for a
            compressed-from-step-one baseline. The hooks' ``start_compress_iter`` is the same knob.

    Each parameter is compressed on its own (layer-wise scales and thresholds) and its
    residual is keyed by its name; all parameters of a bucket travel in one collective, and
    every collective (warm-up, compressed buckets) goes through the reducer's one ordered
    queue. A parameter that got no gradient on a rank contributes zeros there (and its
    residual waits); one that no rank produced a gradient for keeps ``grad = None``.

    On the CPU, with a codec that has native kernels (2-bit, 1-bit), compressed steps encode
    each coded parameter's gradient where autograd left it and decode its average back into
    that same tensor, its ``.grad`` (``BucketSet.by_reference``, the reducer's ``sources`` with
    ``in_place``): the same bits as copying it into the bucket and the average back out, with
    two passes over the gradients less. Warm-up steps, exact (1-D) parameters and gradients that are not
    contiguous fp32 are copied. The last bucket's job runs on the training thread when
    ``step()`` waits for it and nothing else is in flight (CPU; ``Pipeline.submit``'s
    ``inline``): backward has ended, so the pipeline's thread would only add two hand-offs.
    """

    compressor: str = "2bit"
    compressor_options: dict[str, Any] = field(default_factory=dict)
    collective: str = "auto"
    error_feedback: bool = True
    bucket_mb: float = 25.0
    overlap: bool = True
    warmup_steps: int = DEFAULT_COMPRESSION_WARMUP_STEPS
    compress_vectors: bool = False

    name: ClassVar[str] = "compressed"
    #: knobs of earlier versions, each with the value of the path the code now always takes (above)
    removed_knobs: ClassVar[dict[str, Any]] = {
        "inline_last_bucket": True, "encode_from_gradients": True, "gradient_as_bucket_view": False}

    def __post_init__(self) -> None:
        check_compression_knobs(self.name, self.compressor, self.compressor_options, self.collective,
                                self.bucket_mb)
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"compressed: warmup_steps must be an int >= 0, got {self.warmup_steps!r}")

    def bind(self, ctx: EngineContext) -> "BoundCompressedSGD":
        return BoundCompressedSGD(self, ctx)


class BoundCompressedSGD(BoundAlgorithm):
    """Synchronous compressed SGD bound to one engine: buckets, reducer (residuals), step count."""

    cfg: CompressedSGD
    captures_gradients: ClassVar[bool] = True
    clips: ClassVar[bool] = True

    def __init__(self, cfg: CompressedSGD, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        self.steps_done = 0
        self.warmup = Warmup(cfg.warmup_steps)
        codec = build_compressor(cfg.compressor, cfg.compressor_options)
        self.reducer: CompressedReducer = make_reducer(cfg.collective, ctx.comm, codec, cfg.error_feedback)
        self.buckets = BucketSet(ctx.params, range(len(ctx.params)), int(cfg.bucket_mb * MIB), self._launch)
        self.segments = [bucket_segments(ctx.names, ctx.params, b.param_indices) for b in self.buckets.buckets]
        self.exact_segments = [exact_vector_segments(ctx.params, b.param_indices, cfg.compress_vectors)
                               for b in self.buckets.buckets]
        # the NaN/Inf check rides on the buckets' flag bytes (when the engine's policy asks for
        # it) unless some bucket goes whole in fp32
        self.checks_finite = ctx.decide_finiteness is not None and \
            not any(ex is not None and all(ex) for ex in self.exact_segments)
        # coded fp32 parameters: their gradients are encoded where they are and get their
        # average written back there, where the reducer's encoder reads them there (decided
        # once: off that path a job would copy them in, correct but no gain)
        device = ctx.params[0].device if ctx.params else torch.device("cpu")
        self.encodes_from_gradients = self.reducer.reads_sources(device)
        self.buckets.referable = frozenset(
            i for b, ex in zip(self.buckets.buckets, self.exact_segments)
            for k, i in enumerate(b.param_indices) if (ex is None or not ex[k]) and ctx.params[i].dtype == torch.float32)
        self._prepare_step()

    def _prepare_step(self) -> None:
        """Before the next backward: whether its compressed buckets encode the gradients where
        they are (not in a warm-up step)."""
        self.buckets.by_reference = self.encodes_from_gradients and not self.warmup.active(self.steps_done)

    def finiteness(self) -> Finiteness:
        """Compressed steps carry the check: they mark each parameter's NaN/Inf in their
        buckets' flag bytes, which every rank receives from every rank, and ``step()`` reports
        the verdict before the optimizer runs. Warm-up steps (fp32 all-reduces) are decided by
        the engine before ``step()``."""
        return Finiteness.CARRIED if self._carries_finiteness() else Finiteness.NOW

    def _carries_finiteness(self) -> bool:
        return self.checks_finite and not self.warmup.active(self.steps_done)

    def _launch(self, b: Bucket) -> Handle:
        key, segments = f"bucket{b.index}", self.segments[b.index]
        exact = self.exact_segments[b.index]
        # step() waits for the last bucket as soon as it is launched (backward has ended)
        inline = b.index == len(self.buckets.buckets) - 1
        if self.warmup.active(self.steps_done) or (exact is not None and all(exact)):
            return self.reducer.start_full_precision(b.grads, key, segments, present=b.flags > 0, inline=inline)
        # no copy: step() waits for every bucket before the next backward refills it. The
        # average is decoded into the gradients read where they are (sources)
        sources = b.sources if self.buckets.by_reference else None
        in_place = sources is not None and b.grads.dtype == torch.float32
        return self.reducer.start(b.grads, key, segments, present=b.present(), exact_segments=exact, copy=False,
                                  check_finite=self.checks_finite, inline=inline, in_place=in_place,
                                  sources=sources)

    def on_gradient_ready(self, index: int) -> None:
        self.buckets.mark_ready(index, overlap=self.cfg.overlap)

    def step(self) -> None:
        carried = self._carries_finiteness()
        self.buckets.launch_remaining()
        for b in self.buckets.buckets:
            averaged = b.handle.wait()
            self.buckets.write_gradients(b, averaged, present=b.handle.present, written=b.handle.targets)
        if carried:
            buckets = self.buckets.buckets
            self.ctx.decide_finiteness(first_nonfinite(buckets, [b.handle for b in buckets], self.ctx.world_size))
        if self.ctx.clip is not None:     # the averaged (decoded) gradient, as under ssgd
            self.ctx.clip_gradients([p.grad for p in self.ctx.params])
        self.ctx.optimizer.step()
        self.buckets.reset()
        self.steps_done += 1
        self._prepare_step()

    def step_metrics(self) -> dict[str, Any]:
        """``warmup``: whether the step just taken averaged in fp32 (as CP-SGD's)."""
        return {"warmup": self.warmup.active(self.steps_done - 1)}

    def state_dict(self) -> dict[str, Any]:
        return {"collective": self.reducer.state_dict(), "steps_done": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reducer.load_state_dict(state.get("collective", {}))
        self.steps_done = int(state.get("steps_done", 0))
        self._prepare_step()

    def close(self) -> None:
        self.reducer.close()


def first_nonfinite(buckets: list, handles: list, world: int) -> list[int]:
    """Per rank, the smallest parameter index it marked non-finite in the flag bytes of the
    waited-for ``handles`` of ``buckets`` (one segment per parameter, in bucket order; the
    reducer's ``check_finite``), -1 for none: the same on every rank, since each received
    every rank's flags."""
    first = [-1] * world
    for b, h in zip(buckets, handles):
        bad = getattr(h, "nonfinite", None)
        if bad is None:
            continue
        for r, s in zip(*np.nonzero(bad)):
            i = b.param_indices[int(s)]
            first[int(r)] = i if first[int(r)] < 0 else min(first[int(r)], i)
    return first


def bucket_segments(names: list[str], params: list, indices: list[int]) -> list[tuple[str, int]]:
    """``(parameter name, numel)`` for each parameter of a bucket, in bucket order."""
    return [(names[i], params[i].numel()) for i in indices]


def exact_vector_segments(params: list, indices: list[int], compress_vectors: bool) -> Optional[list[bool]]:
    """The reducer's ``exact_segments`` of a bucket: its 1-D (and 0-D) parameters, unless
    ``compress_vectors``; None when nothing is exact."""
    exact = [not compress_vectors and params[i].dim() <= 1 for i in indices]
    return exact if any(exact) else None
