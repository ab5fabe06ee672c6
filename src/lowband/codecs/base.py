"""Compressor interface, receiver-side contexts, seeded RNG and the name registry.

Design
------
* ``compress(tensor, name) -> (payload, ctx)``. ``payload`` is the list of tensors that
  **travel**. Their number, dtypes and sizes depend only on ``(shape, config)``, never on the
  data, so they can go through ``all_gather`` / ``all_to_all`` without a size exchange.
  ``payload_nbytes(shape)`` states the exact byte count. Payload tensors never alias the input.
* ``ctx`` is a small, immutable :class:`Ctx` ``(shape, dtype, name, step)``. A receiver that
  did not compress the tensor itself rebuilds it with ``context_for(shape, dtype, name, step)``.
  In data-parallel training, every rank compresses the same name at the same step, so a rank
  can decode peers' payloads with the ctx of its own ``compress`` call. ``name`` and ``step``
  matter only to codecs whose decoding depends on shared randomness (random-k). All other
  codecs ignore them.
* Error feedback lives outside the codec, in whoever keeps the residuals: the compressed
  reducer (one flat residual per bucket) or :class:`~.error_feedback.ErrorFeedback` (one per
  tensor name). A codec may override :meth:`Compressor.compress_residual_` to compress a
  buffer and turn it into its own residual in one fused pass. This is what makes 2-bit + EF reach memory-bound speed. The default is the
  generic ``buf -= decompress(compress(buf))``.
* Stochastic codecs draw from a *local* ``torch.Generator`` seeded by ``(seed, name, step)``.
  ``step`` is a per-name counter kept in the codec's ``state_dict``, so runs are reproducible
  and resumable. They never touch the global RNG.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import numbers
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable

import torch

Payload = list[torch.Tensor]


@dataclass(frozen=True)
class Ctx:
    """Everything needed to decode a payload, derivable by a receiver from metadata alone."""

    shape: torch.Size
    dtype: torch.dtype = torch.float32
    name: str = ""
    step: int = 0

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def as_shape(shape: Iterable[int] | torch.Size | int) -> torch.Size:
    """Normalise ``shape`` arguments (``int`` means a flat tensor)."""
    if isinstance(shape, int):
        return torch.Size([shape])
    return torch.Size(tuple(int(s) for s in shape))


def seed_for(seed: int, name: str, step: int) -> int:
    """A stable 63-bit seed from ``(seed, name, step)``.

    Python's ``hash(str)`` is salted per process, so ranks would disagree. blake2b is stable
    across processes, hosts and Python versions.
    """
    digest = hashlib.blake2b(f"{seed}\x00{name}\x00{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def make_generator(seed: int, name: str, step: int, device: torch.device) -> torch.Generator:
    """A local generator on ``device`` seeded from ``(seed, name, step)`` (global RNG untouched)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_for(seed, name, step))
    return gen


class _Scratch(threading.local):
    """Per-thread, grow-only CPU scratch buffers, reused across calls.

    Fresh multi-MB CPU allocations page-fault on first touch, which costs about as much as a
    full pass over the data. A thread-local buffer avoids that and stays safe when the engine
    compresses from a background thread. On CUDA the caching allocator already reuses memory
    and respects stream order, so we allocate normally there.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def clear(self) -> None:
        """Release this thread's buffers (they grow to the largest tensor seen)."""
        self.buffers.clear()

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self.buffers.get((key, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self.buffers[(key, dtype)] = buf
        return buf[:numel]


scratch = _Scratch()


class Compressor(ABC):
    """Base class of all gradient codecs (see the module docstring for the contract)."""

    name: str = ""

    @property
    def kernel_kind(self) -> int | None:
        """The fused bucket kernel (native on the CPU, Triton on CUDA) that encodes and decodes
        this codec bit for bit, as a ``KIND_*`` of :mod:`lowband._native`; None (the default):
        the bucket codec goes through :meth:`compress_residual_` and :meth:`decompress`. A
        subclass that changes the encoding of a codec with a kernel must return None."""
        return None

    # ---- required -------------------------------------------------------------------------
    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        """Encode ``tensor`` (float, any shape, CPU or CUDA); return (travelling tensors, ctx)."""

    @abstractmethod
    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        """Decode a payload into a tensor of ``ctx.shape`` and ``ctx.dtype``."""

    @abstractmethod
    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        """Exact bytes of the travelling tensors of one ``compress`` of a tensor of ``shape``."""

    # ---- optional -------------------------------------------------------------------------
    def context_for(
        self,
        shape: Iterable[int] | torch.Size | int,
        dtype: torch.dtype = torch.float32,
        name: str = "",
        step: int = 0,
    ) -> Ctx:
        """Receiver-side ctx. ``name``/``step`` are needed only by shared-randomness codecs."""
        return Ctx(as_shape(shape), dtype, name, step)

    def compress_residual_(
        self, buf: torch.Tensor, name: str, add: torch.Tensor | None = None
    ) -> tuple[Payload, Ctx]:
        """Error-feedback step in place: ``buf += add`` (if given), compress ``buf``, then
        overwrite ``buf`` with ``buf - decompress(payload)``. ``buf`` is contiguous fp32.

        Codecs may override this with a fused, cache-blocked sequence (2-bit does). The
        result must equal this generic version as values.
        """
        if add is not None:
            buf.add_(add.reshape(buf.shape))
        payload, ctx = self.compress(buf, name)
        buf.sub_(self.decompress(payload, ctx).reshape(buf.shape).to(buf.dtype))
        return payload, ctx

    def state_dict(self) -> dict[str, Any]:
        """State that affects future outputs (RNG step counters, warm starts); default none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Stateless codecs accept only an empty dict."""
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SteppedCompressor(Compressor):
    """Base for codecs that draw randomness: keeps the per-name step counter and the seed."""

    def __init__(self, seed: int = 0) -> None:
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = int(seed)
        self._steps: dict[str, int] = {}

    def _next_step(self, name: str) -> int:
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return step

    def _generator(self, name: str, step: int, device: torch.device) -> torch.Generator:
        return make_generator(self.seed, name, step, device)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": dict(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"steps"}
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown state keys {sorted(unknown)}")
        self._steps = {str(k): int(v) for k, v in state.get("steps", {}).items()}


def flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Contiguous flat fp32 view (a copy only when the input is not already one)."""
    return tensor.detach().reshape(-1).to(torch.float32)


def exact_divisor(value: float, like: torch.Tensor) -> "float | torch.Tensor":
    """``value`` as a divisor that torch divides ``like`` by with a correctly rounded division
    on every device. On CUDA, torch turns a division by a Python number into a multiplication
    by its reciprocal, which is not correctly rounded (1/3, say), so the codecs would stop
    matching the CPU's bits there; a 0-dim tensor on the device divides exactly. On the CPU
    the number itself (no allocation)."""
    if like.device.type == "cpu":
        return value
    return torch.full((), value, dtype=like.dtype, device=like.device)


def check_positive(name: str, value: Any, kind: type = float) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive real (``kind=int``: integer) number.

    Accepts numpy scalars (via ``numbers``), rejects bools, strings and NaN.
    """
    wanted = numbers.Integral if kind is int else numbers.Real
    if isinstance(value, bool) or not isinstance(value, wanted) or not value > 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r}")


class Identity(Compressor):
    """No compression: the payload is an fp32 copy (never an alias, so EF cannot clobber it)."""

    name = "none"

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        return [flat_fp32(tensor).clone()], Ctx(tensor.shape, tensor.dtype, name)

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        return tensors[0].reshape(ctx.shape).to(ctx.dtype)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        return 4 * as_shape(shape).numel()


# ---- registry -----------------------------------------------------------------------------
# name -> "module:Class" (resolved lazily: the codec modules import this one) or a registered class.
_REGISTRY: dict[str, "str | type[Compressor]"] = {
    "none": "base:Identity",
    "2bit": "twobit:TwoBitQuantizer",
    "1bit": "onebit:OneBitSign",
    "qsgd": "qsgd:QSGD",
    "terngrad": "terngrad:TernGrad",
    "topk": "topk:TopK",
    "randomk": "randomk:RandomK",
    "fp16": "fp16:FP16",
    "bf16": "fp16:BF16",
    "powersgd": "powersgd:PowerSGD",
}
#: the registered names (a live view: :func:`register` adds to it)
COMPRESSORS = _REGISTRY.keys()


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator / function adding a codec to the registry under ``cls.name``: then
    ``make_compressor``, ``--compressor`` and the algorithms' ``compressor`` knob accept it."""
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise TypeError(f"register() takes a Compressor subclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name (set the class attribute ``name``)")
    _REGISTRY[cls.name] = cls
    return cls


def compressor_class(name: str) -> type[Compressor]:
    """The class registered under ``name``; ``ValueError`` listing valid names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; valid choices: {', '.join(COMPRESSORS)}")
    entry = _REGISTRY[name]
    if isinstance(entry, type):
        return entry
    module, cls = entry.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def make_compressor(name: str, **options: Any) -> Compressor:
    """Build a codec by registry name, e.g. ``make_compressor("2bit", threshold=0.05)``.

    Unknown names, unknown options and invalid option values raise ``ValueError``.
    """
    cls = compressor_class(name)
    params = [
        p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    valid = [p.name for p in params]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"compressor {name!r} got unknown option(s) {unknown}; valid options: {valid or 'none'}"
        )
    missing = [p.name for p in params if p.default is p.empty and p.name not in options]
    if missing:
        raise ValueError(f"compressor {name!r} needs option(s) {missing}; valid options: {valid}")
    return cls(**options)
