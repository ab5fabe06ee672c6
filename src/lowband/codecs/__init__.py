"""Gradient codecs (bit-packed) and per-tensor error feedback.

``make_compressor(name, **options)`` builds a codec by name (see ``COMPRESSORS``);
``register(cls)`` adds a codec class under ``cls.name``; ``ErrorFeedback(codec)`` adds per-name
residual memory to a codec used tensor by tensor (the compressed reducer keeps its own
residuals per bucket). A codec with a fused bucket kernel names it in
``Compressor.kernel_kind``.
"""

from .base import COMPRESSORS, Compressor, Ctx, Identity, compressor_class, make_compressor, register
from .error_feedback import ErrorFeedback
from .factory import DEFAULT_TWO_BIT_OPTIONS, build_compressor
from .fp16 import BF16, FP16
from .onebit import OneBitSign
from .powersgd import PowerSGD
from .qsgd import QSGD
from .randomk import RandomK
from .terngrad import TernGrad
from .topk import TopK
from .twobit import TwoBitQuantizer

__all__ = [
    "BF16",
    "DEFAULT_TWO_BIT_OPTIONS",
    "build_compressor",
    "COMPRESSORS",
    "FP16",
    "OneBitSign",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "TernGrad",
    "TopK",
    "Compressor",
    "Ctx",
    "ErrorFeedback",
    "Identity",
    "TwoBitQuantizer",
    "compressor_class",
    "make_compressor",
    "register",
]
