"""Error feedback (residual memory) for a codec used tensor by tensor.

For each tensor name the wrapper keeps a residual ``e`` (fp32, zero-initialised, never reset
implicitly) and performs exactly
``corrected = e + g; payload = compress(corrected); e = corrected - decompress(payload)``.
With the 2-bit codec this is MXNet's ``r <- e + g; q = Q(r); e <- r - q``. Summed over steps,
the decoded payloads plus the final residual equal the summed gradients (mass conservation),
which is what makes biased codecs converge.

The wrapper is a drop-in :class:`Compressor` for code that compresses named tensors one at a
time (a training loop of its own, ``lowband profile``'s per-tensor timings, the reference
implementations the tests compare against): ``compress`` returns the inner payload and ctx,
and ``decompress`` / ``payload_nbytes`` / ``context_for`` delegate. The residual lives in the
wrapper, not in the inner codec, so any codec gets EF without duplicating it. A codec can fuse
the update through ``compress_residual_``.

lowband's algorithms do not use it: their compressed reducer
(:class:`lowband.comm.reducer.CompressedReducer`, ``error_feedback=True``) keeps one flat
residual per bucket, which the bucket kernels update in the same pass as the encode, with the
same arithmetic per element. It refuses an ``ErrorFeedback`` in place of a codec.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .base import Compressor, Ctx, Payload


class ErrorFeedback(Compressor):
    """Wrap ``compressor`` with per-name error feedback (residuals are checkpointable)."""

    def __init__(self, compressor: Compressor) -> None:
        if not isinstance(compressor, Compressor) or isinstance(compressor, ErrorFeedback):
            raise ValueError(f"ErrorFeedback needs a non-EF Compressor, got {compressor!r}")
        self.inner = compressor
        self.name = f"ef+{compressor.name}"
        self._residuals: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Ctx]:
        e = self._residuals.get(name)
        if e is None or e.shape != tensor.shape or e.device != tensor.device:
            if e is not None:
                raise ValueError(
                    f"residual for {name!r} has shape {tuple(e.shape)} on {e.device}, "
                    f"got {tuple(tensor.shape)} on {tensor.device}; call reset({name!r}) first"
                )
            e = torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device)
            self._residuals[name] = e
        payload, ctx = self.inner.compress_residual_(e, name, add=tensor.detach())
        if ctx.dtype != tensor.dtype:  # decode to the caller's dtype, not the residual's
            ctx = Ctx(ctx.shape, tensor.dtype, ctx.name, ctx.step)
        return payload, ctx

    def decompress(self, tensors: Payload, ctx: Ctx) -> torch.Tensor:
        return self.inner.decompress(tensors, ctx)

    def payload_nbytes(self, shape: Iterable[int] | torch.Size | int) -> int:
        return self.inner.payload_nbytes(shape)

    def context_for(self, shape: Any, dtype: torch.dtype = torch.float32, name: str = "", step: int = 0) -> Ctx:
        return self.inner.context_for(shape, dtype, name, step)

    # -- residual management ---------------------------------------------------------------
    def residual(self, name: str) -> torch.Tensor:
        """The live residual tensor of ``name`` (``KeyError`` if ``name`` was never compressed)."""
        if name not in self._residuals:
            raise KeyError(f"no residual for {name!r}; known: {sorted(self._residuals)}")
        return self._residuals[name]

    def has_residual(self, name: str) -> bool:
        """Whether ``name`` has been compressed (and so has a residual) yet."""
        return name in self._residuals

    def reset(self, name: str | None = None) -> None:
        """Drop the residual of ``name`` (or all residuals); they restart from zero."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {k: v.detach().clone() for k, v in self._residuals.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"residuals", "inner"}
        if unknown:
            raise ValueError(f"ErrorFeedback: unknown state keys {sorted(unknown)}")
        self._residuals = {
            k: v.detach().to(torch.float32).clone().contiguous()
            for k, v in state.get("residuals", {}).items()
        }
        self.inner.load_state_dict(state.get("inner", {}))
