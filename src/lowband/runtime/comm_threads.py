"""A short scheduler slice for a worker's communication threads.

A worker's training thread computes for the whole step; gloo's threads (``gloo_tcp_loop``,
``pt_gloo_runloop``), the store's (``pt_tcpstore_uv``) and lowband's pipeline thread
(``lowband-pipe``) wake for a few microseconds at a time to move bytes or encode a bucket.
Linux's EEVDF scheduler (6.6+) gives every task a virtual deadline one *slice* after it becomes
eligible; a task that asks for a shorter slice (``sched_setattr``'s ``sched_runtime`` for a
``SCHED_OTHER`` task, honoured since 6.12, 0.1-100 ms, no privilege needed) gets an earlier
deadline, so on a busy core it preempts the training thread sooner when it wakes instead of
waiting up to the default slice (``/sys/kernel/debug/sched/base_slice_ns``, about 0.7 ms times
1 + log2 of up to 8 cores). The peer rank, blocked in the collective,
is what waits for that wake-up.

:func:`shorten` gives every communication thread of this process (found by name in
``/proc/self/task``) the slice asked for and leaves every other thread (the training thread,
torch's intra-op threads) at the kernel's default. It reads each slice back: a kernel that
ignores the request (before 6.12) or a platform without the system call reports that nothing
was applied, and nothing else changes. Only the schedule changes, never a value: the
trajectory is bit-identical. ``lowband train``'s workers give their communication threads
:data:`WORKER_SLICE_US` after their first step; its effect on step time: docs/architecture.md.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
from typing import Optional

#: thread names (``/proc/<pid>/task/<tid>/comm``) of the threads :func:`shorten` reaches
COMM_THREAD_PREFIXES = ("gloo_", "pt_gloo_", "pt_tcpstore", "lowband-")
#: the kernel's bounds on a custom slice (kernel/sched/syscalls.c), in microseconds
MIN_SLICE_US, MAX_SLICE_US = 100, 100_000
#: the slice ``lowband train``'s workers give their communication threads (microseconds): the
#: shortest the kernel takes
WORKER_SLICE_US = MIN_SLICE_US
#: (sched_setattr, sched_getattr) system call numbers per machine
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275), "arm64": (274, 275),
             "ppc64le": (355, 356), "s390x": (345, 346), "riscv64": (274, 275)}
_PR_SET_NAME = 15


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr`` (include/uapi/linux/sched/types.h, version 1)."""
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64),
                ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]


def check_slice(slice_us: int) -> None:
    """ValueError, one sentence, unless ``slice_us`` is 0 (the kernel's default) or a slice
    the kernel accepts."""
    if (isinstance(slice_us, bool) or not isinstance(slice_us, int)
            or not (slice_us == 0 or MIN_SLICE_US <= slice_us <= MAX_SLICE_US)):
        raise ValueError(f"slice_us must be 0 (the kernel's default) or an integer in "
                         f"[{MIN_SLICE_US}, {MAX_SLICE_US}], got {slice_us!r}")


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    if not platform.system() == "Linux" or platform.machine() not in _SYSCALLS:
        return None
    return ctypes.CDLL(None, use_errno=True)


_SET, _GET = 0, 1


def _call(which: int, *args) -> None:
    """``syscall(sched_setattr or sched_getattr, *args)`` (``which``: ``_SET`` or ``_GET``); the
    integers passed as C longs (syscall(2) is variadic)."""
    libc = _libc()
    args = tuple(ctypes.c_long(a) if isinstance(a, int) else a for a in args)
    if libc is None or libc.syscall(ctypes.c_long(_SYSCALLS[platform.machine()][which]), *args) != 0:
        err = ctypes.get_errno() if libc is not None else 0
        raise OSError(err, os.strerror(err) if err else "no sched_setattr on this platform")


def read_attr(tid: int = 0) -> _SchedAttr:
    """Thread ``tid``'s ``sched_attr`` (0: the calling thread); OSError where unsupported."""
    attr = _SchedAttr()
    _call(_GET, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    return attr


def read_slice_ns(tid: int = 0) -> int:
    """Thread ``tid``'s slice in ns: the one it asked for, else the kernel's default (kernels
    before 6.12 report 0)."""
    return int(read_attr(tid).runtime)


def set_slice_ns(tid: int, slice_ns: int) -> None:
    """Ask for a ``slice_ns`` slice for thread ``tid`` (0 restores the default), keeping its
    policy and nice value."""
    attr = read_attr(tid)
    attr.size, attr.flags, attr.runtime = ctypes.sizeof(attr), 0, slice_ns
    _call(_SET, tid, ctypes.byref(attr), 0)


def name_this_thread(name: str) -> None:
    """Set the calling thread's kernel name (what ``top -H``, ``/proc`` and :func:`shorten` see;
    at most 15 bytes kept); nothing where the platform has no ``prctl``."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def comm_threads() -> dict[int, str]:
    """The communication threads of this process: thread id -> name."""
    found = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    me = threading.get_native_id()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:     # the thread ended meanwhile
            continue
        if int(tid) != me and name.startswith(COMM_THREAD_PREFIXES):
            found[int(tid)] = name
    return found


def shorten(slice_us: int) -> Optional[int]:
    """Give every communication thread of this process a ``slice_us`` slice; how many threads
    now have it, or None when this kernel or platform does not take custom slices (then
    nothing changed). ``slice_us`` 0 leaves every thread alone and returns 0."""
    check_slice(slice_us)
    if slice_us == 0:
        return 0
    want, done = slice_us * 1000, 0
    for tid in comm_threads():
        try:
            set_slice_ns(tid, want)
            if read_slice_ns(tid) != want:
                return None          # accepted but ignored: a kernel before custom slices
            done += 1
        except OSError as e:
            if e.errno == 3:         # ESRCH: the thread ended meanwhile
                continue
            return None
    return done


def shorten_settled(slice_us: int, group=None) -> Optional[int]:
    """:func:`shorten` for a process whose gloo ``group`` (None: the default group) may have just
    been made: first one 1-element all-reduce and a barrier on it, as gloo starts a group's
    threads as it connects and each names itself once it runs, so right after
    ``init_process_group`` or ``new_group`` some are not there or not named yet (a shorten right
    after ``init_process_group`` can miss some of the group's threads). A training worker needs none of this:
    it shortens after its first step, when every group has run a collective. Every rank of
    ``group`` must call it."""
    import torch
    import torch.distributed as dist
    check_slice(slice_us)
    dist.all_reduce(torch.zeros(1), group=group)
    dist.barrier(group=group)
    return shorten(slice_us)
