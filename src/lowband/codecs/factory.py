"""Building a codec the way lowband's algorithms and hooks do: a registry name, options and
lowband's defaults for the 2-bit codec. (Error feedback is the caller's: the compressed
reducer keeps residuals per bucket, :class:`ErrorFeedback` per tensor.)"""
from __future__ import annotations

from typing import Any

from .base import Compressor, make_compressor

#: What ``--compressor 2bit`` gets when neither ``threshold`` nor ``relative`` is given: the
#: scale-aware mode (fire at 1x the RMS of each 256-element block, decode to the fired mean).
#: Every fixed (exact MXNet) threshold of the cnn sweep diverged at lr 0.05, and per-block
#: scales beat one scale per bucket on both models (docs/compression.md, "Threshold study").
#: Exact MXNet semantics: ``--compressor-option threshold=T``.
DEFAULT_TWO_BIT_OPTIONS: dict[str, float | int] = {"relative": 1.0, "scale_block": 256}


def build_compressor(name: str, options: dict[str, Any]) -> Compressor:
    """A codec by registry name, with lowband's defaults filled in."""
    opts = dict(options)
    if name == "2bit" and "threshold" not in opts and "relative" not in opts:
        opts.update(DEFAULT_TWO_BIT_OPTIONS)
    return make_compressor(name, **opts)
