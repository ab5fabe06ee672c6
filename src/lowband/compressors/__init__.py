"""Gradient codecs (bit-packed) and the error-feedback wrapper.

``make_compressor(name, **options)`` builds a codec by name (see ``COMPRESSORS``);
``ErrorFeedback(codec)`` adds per-name residual memory to any codec.
"""

from .base import COMPRESSORS, Compressor, Ctx, Identity, compressor_class, make_compressor
from .error_feedback import ErrorFeedback
from .twobit import TwoBitQuantizer

__all__ = [
    "COMPRESSORS",
    "Compressor",
    "Ctx",
    "ErrorFeedback",
    "Identity",
    "TwoBitQuantizer",
    "compressor_class",
    "make_compressor",
]
