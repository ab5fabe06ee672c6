"""How a worker's C heap hands memory back to the system (``--malloc cached|system``).

Every CPU training step allocates and frees the same few megabytes (activations, gradients,
the codec's buffers). glibc's malloc adapts two thresholds to that as it goes, and depending
on what else sits on the heap it may keep undoing its own work: freed blocks at the top of
the heap beyond ``M_TRIM_THRESHOLD`` go back to the kernel and the next step faults them in
again, a page at a time. How often that happens differs from run to run and between the ranks
of one run; in a bare loop of steps on one batch it can cost a noticeable share of the step
(docs/architecture.md). ``cached`` is the workers' default so that no process's step depends
on where glibc's heap happens to end, and ``lowband profile`` (a bare loop) uses it so that
it measures the step the workers run.

* ``cached`` (the default of lowband's workers): large blocks come from the heap up to
  ``MMAP_THRESHOLD`` (glibc's ceiling, 32 MiB on 64-bit systems) and the heap is trimmed only
  beyond ``TRIM_THRESHOLD``, so a step reuses the last step's pages; what the process has once
  touched stays mapped (its resident size stays at its peak, as under jemalloc or tcmalloc,
  which PyTorch's performance guide recommends for CPU training). Blocks above 32 MiB are
  still mapped and unmapped each time.
* ``system``: glibc's defaults, untouched.

Both thresholds must be set together: setting either one turns glibc's adaptation of both
off, and each alone is slower than the defaults (with the trim threshold alone every block
over 128 KiB is mapped afresh each step).

Only the allocator's bookkeeping changes, never a value: a run's results are bit-identical
under both. Where the C library has no ``mallopt`` (macOS, musl) ``cached`` does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

MALLOC_MODES = ("cached", "system")
#: lowband's workers' mode, and that of every bare loop that measures their step (``lowband
#: profile``, the validation's probes)
DEFAULT_MODE = "cached"

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: blocks up to this size come from the heap under ``cached`` (glibc refuses more: its
#: ``HEAP_MAX_SIZE / 2`` on 64-bit systems)
MMAP_THRESHOLD = 32 * 1024 * 1024
#: free memory at the heap's top is given back only beyond this under ``cached``
TRIM_THRESHOLD = 1024 * 1024 * 1024


def check_mode(mode: str) -> None:
    """ValueError, one sentence naming the flag, unless ``mode`` is a malloc mode."""
    if mode not in MALLOC_MODES:
        raise ValueError(f"--malloc must be one of: {', '.join(MALLOC_MODES)}, got {mode!r}")


def _mallopt():
    """glibc's ``mallopt``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        fn = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    return fn


def configure(mode: str) -> Optional[dict[str, int]]:
    """Apply ``mode`` to this process's allocator (from now on); the thresholds set, or None
    when ``mode`` is ``system`` or the C library cannot take them."""
    check_mode(mode)
    if mode == "system":
        return None
    mallopt = _mallopt()
    if mallopt is None:
        return None
    settings = {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    # the mmap threshold first: it is the one glibc may refuse, and the trim threshold
    # alone is worse than the defaults (module docstring)
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return None
    if not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return None
    return settings
