"""Loader of the native codec kernels (``lowband_codecs.c``, built by ``pip install``).

``LOWBAND_CODEC_KERNELS`` selects the implementation of the fused bucket codecs:
``auto`` (default: native where the library loaded and the tensor is on the CPU, torch
otherwise), ``native`` (fail if the library is missing) or ``torch`` (the bit-identical torch
path everywhere). ctypes releases the GIL for every call, so a background thread encoding a
bucket really runs beside the training thread.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from typing import Iterator, Optional

ENV = "LOWBAND_CODEC_KERNELS"
CHOICES = ("auto", "native", "torch")

#: the bucket kernels' codec kinds (the ``kind`` argument of ``lb_decode``; the Triton kernels use
#: the same numbers). A codec names the one implementing it in ``Compressor.kernel_kind``.
KIND_TWOBIT, KIND_TWOBIT_REL, KIND_ONEBIT = 0, 1, 2

_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None
_loaded = False

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "lb_twobit_encode": (None, [_p, _p, _p, _i64, _p, _f32, _p]),
    "lb_twobit_rel_encode": (_int, [_p, _p, _p, _i64, _p, _f32, _i64, _p]),
    "lb_onebit_encode": (_int, [_p, _p, _p, _i64, _p, _p]),
    "lb_decode": (None, [_int, _p, _i64, _i64, _p, _i64, _f32, _i64, _int, _f32, _p]),
    "lb_canon_sum": (_f32, [_p, _i64]),
    "lb_set_simd": (_int, [_int]),
    "lb_sum_rows": (None, [_p, _i64, _i64, _i64, _f32, _p]),
    "lb_sgd_pipeline": (None, [_p, _p, _p, _p, _p, _i64, _f32, _f32, _f32, _f32, _int]),
}
#: functions newer builds have; a build without them (an old one loaded for an A/B) still opens,
#: and its callers take the numpy / torch path instead (``lib.has_spans``, ``lib.has_flags``)
_OPTIONAL = {
    "lb_gather_spans": (None, [_p, _p, _p, _i64, _p]),
    "lb_scatter_mean": (None, [_p, _i64, _i64, _p, _i64, _f32, _p]),
    "lb_write_flags": (None, [_p, _i64, _i64, _i64, _i64, _p]),
    "lb_read_flags": (_int, [_p, _i64, _i64, _i64, _i64, ctypes.c_uint8, ctypes.c_uint8, _p, _p]),
    # the encoders with each run's input address (gradients encoded where autograd left them)
    "lb_twobit_encode_at": (None, [_p, _p, _p, _i64, _p, _p, _f32, _p]),
    "lb_twobit_rel_encode_at": (_int, [_p, _p, _p, _i64, _p, _p, _f32, _i64, _p]),
    "lb_onebit_encode_at": (_int, [_p, _p, _p, _i64, _p, _p, _p]),
    # the decoder with each run's output address (averages written into the gradients)
    "lb_decode_at": (None, [_int, _p, _i64, _i64, _p, _i64, _p, _f32, _i64, _int, _f32, _p]),
    # CP-SGD's Adam / AdamW global step and local update (lowband_adam.c)
    "lb_adam_moments": (None, [_p, _p, _p, _p, _p, _p, _p, _p, _i64, _f32, _f32, _f32, _f32, _int]),
    "lb_adam_apply": (None, [_p, _p, _p, _p, _p, _p, _i64, _f32, _f32, _f32, _f32, _f32, _f32, _int]),
}


def mode() -> str:
    """The selected implementation (``ValueError`` for an unknown value of the variable)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}; choose one of: {', '.join(CHOICES)}")
    return value


def open_library(path: str) -> ctypes.CDLL:
    """A build of the codec library at ``path``, with its functions' signatures set
    (``OSError`` / ``AttributeError`` when it cannot be loaded or lacks a function)."""
    lib = ctypes.CDLL(path)
    for name, (res, args) in {**_SIGNATURES, **_OPTIONAL}.items():
        fn = getattr(lib, name) if name in _SIGNATURES else getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = res, args
    # builds before lb_proves_finite return 0 from the encoders whatever the input
    lib.proves_finite = hasattr(lib, "lb_proves_finite")
    lib.has_spans = hasattr(lib, "lb_gather_spans") and hasattr(lib, "lb_scatter_mean")
    lib.has_flags = hasattr(lib, "lb_write_flags") and hasattr(lib, "lb_read_flags")
    lib.has_adam = hasattr(lib, "lb_adam_moments") and hasattr(lib, "lb_adam_apply")
    lib.has_sources = all(hasattr(lib, f"lb_{k}_encode_at") for k in ("twobit", "twobit_rel", "onebit")) and \
        hasattr(lib, "lb_decode_at")
    return lib


def _load() -> None:
    global _lib, _error, _loaded
    _loaded = True
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_lowband_codecs*.so")) + glob.glob(os.path.join(here, "_lowband_codecs*.pyd")))
    if not found:
        _error = f"native codec library not built in {here} (reinstall lowband with a C compiler)"
        return
    try:
        lib = open_library(found[0])
    except (OSError, AttributeError) as exc:
        _error = f"native codec library {found[0]} failed to load: {exc}"
        return
    _lib = lib


@contextlib.contextmanager
def using(lib: ctypes.CDLL) -> Iterator[None]:
    """Within the block, the codecs call ``lib`` (another build, from :func:`open_library`)
    instead of the installed one: for A/B benchmarks of two builds in one process."""
    global _lib, _loaded
    saved = (_lib, _loaded)
    _lib, _loaded = lib, True
    try:
        yield
    finally:
        _lib, _loaded = saved


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, or None when the torch path is selected or it is unavailable
    (``RuntimeError`` when ``LOWBAND_CODEC_KERNELS=native`` and it is unavailable)."""
    m = mode()
    if m == "torch":
        return None
    if not _loaded:
        _load()
    if _lib is None and m == "native":
        raise RuntimeError(f"{ENV}=native but {_error}")
    return _lib


def library_having(capability: str) -> Optional[ctypes.CDLL]:
    """:func:`library` when its build has ``capability`` (``has_spans``, ``has_flags``,
    ``has_sources``: an attribute :func:`open_library` sets), else None (the caller's numpy /
    torch path)."""
    lib = library()
    return lib if lib is not None and getattr(lib, capability, False) else None


def unavailable_reason() -> Optional[str]:
    """Why the library did not load (None when it did or was never tried)."""
    return _error
