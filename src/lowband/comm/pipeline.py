"""One ordered queue per rank for every collective of an algorithm.

:class:`Pipeline` owns one background thread and a private process group built from the
caller's group (``dist.get_process_group_ranks``, so lowband also runs on a sub-group). Every
job submitted to it runs in submission order; since every rank submits the same jobs in the
same order (buckets launch in a fixed order), every rank issues the same sequence of
collectives on the private group (a job the caller will wait for at once may run on the
thread that waits for it when the queue is idle, :meth:`Pipeline.submit`'s ``inline``: still in
the same order, on the same group). An algorithm sends *all* its collectives through one
pipeline (fp32 warm-up all-reduces, fp32 buckets of 1-D parameters, compressed buckets,
corrections): two independent queues could be interleaved differently on different ranks.

On CUDA the pipeline's jobs run on a side stream of its own, ordered with the submitting
thread's compute stream by events (:mod:`lowband.comm.streams`): a job waits for an event recorded
when it was submitted, and ``wait()`` makes the caller's stream wait for one recorded at the
job's end, so neither thread blocks on the GPU to hand work over. The pipeline's thread itself
reads a few values back to the host (present and non-finite flags: which parameters any rank
produced, which segments the server re-compresses), which stalls that thread, not the compute
stream. On the CPU none of this exists (no stream, no event).
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from .communicator import Communicator
from ..runtime.comm_threads import name_this_thread
from .streams import SideStream, cuda_device_of



def private_group(comm: Communicator) -> Optional[dist.ProcessGroup]:
    """A new process group with the ranks of ``comm``'s group (members only synchronize)."""
    if comm.world_size == 1:
        return comm.group
    ranks = dist.get_process_group_ranks(comm.group if comm.group is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, use_local_synchronization=True)


class Handle:
    """An in-flight job of the pipeline; ``wait()`` returns its tensor. Time spent in
    ``wait()`` is charged to the exposed-communication clock. After ``wait()``, ``present``
    is a bool tensor per segment: whether any rank produced that segment's gradient, and
    ``nonfinite`` (for a bucket started with ``check_finite``) a ``[world, segments]`` bool
    array of the segments each rank found non-finite, or None when none did. ``targets``
    (set at the start): per segment, the tensor of its own that the job writes that segment's
    average into (a flat view of a ``sources`` entry, ``in_place``), or None (in the
    returned tensor); None when every segment's average is in the returned tensor."""

    def __init__(self, future: Future, comm: Communicator, side: SideStream, device: Optional[torch.device],
                 span: Optional[list[float]] = None, pipeline: Optional["Pipeline"] = None):
        self._future = future
        self._pipeline = pipeline        # set for a deferred job: waiting runs (or queues) it
        self._comm = comm
        self._side = side
        self._device = device
        self._span = span
        self.present: Optional[torch.Tensor] = None
        self.nonfinite: Optional[np.ndarray] = None
        self.targets: Optional[list] = None

    @property
    def span(self) -> Optional[tuple[float, float]]:
        """``(start, end)`` of the job on the pipeline's thread (``time.perf_counter``), once
        it has run; None before. Host time: on CUDA the job's launches, not its kernels."""
        if self._span is None or not self._future.done():
            return None
        return self._span[0], self._span[1]

    def _unpack(self) -> torch.Tensor:
        if self._pipeline is not None:
            self._pipeline.claim(self._future)
        result, self.present, *rest = self._side.consume(*self._future.result())
        self.nonfinite = rest[0] if rest else None
        return result

    def wait(self) -> torch.Tensor:
        """The job's tensor; on CUDA the caller's stream is ordered after the job and the
        wait is timed on that stream (:meth:`CommStats.exposed`), else in wall time."""
        with self._comm.stats.exposed(self._device):
            return self._unpack()

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` when the job finishes (on the pipeline's thread); inside,
        ``handle.exception()`` / ``handle.result()`` do not block."""
        self._future.add_done_callback(lambda _: fn(self))

    def exception(self) -> Optional[BaseException]:
        return self._future.exception()

    def result(self) -> torch.Tensor:
        """The tensor (blocking without charging the wait clock: for callbacks)."""
        return self._unpack()


class Pipeline:
    """One background thread and one private process group: jobs run in submission order.

    The thread is a daemon: a rank whose peer died must be able to report and exit while its
    thread is still blocked in a collective. After a job fails, every later job fails at once
    with the same cause (it could only hang or mismatch: the ranks' sequences diverged)."""

    def __init__(self, comm: Communicator, name: str = "lowband") -> None:
        self.caller = comm
        self.comm = Communicator(private_group(comm), comm.stats, time_waits=False)
        #: the CUDA stream the jobs run on (none on the CPU: :mod:`lowband.comm.streams`)
        self.side = SideStream()
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._closed = False
        #: jobs queued for the thread (counted by the submitting thread) and jobs the thread
        #: has finished (counted by the thread): each written by one thread only, so equal
        #: means idle, with no lock (:meth:`submit`'s ``inline``)
        self._queued = 0
        self._finished = 0
        #: inline jobs not run yet, in submission order: (queue item, the submitting thread,
        #: the only one that may run it)
        self._deferred: list[tuple[tuple, int]] = []
        #: jobs run on the calling thread (:meth:`submit`'s ``inline``)
        self.inline_jobs = 0
        #: CPU seconds inside jobs so far (codec, collectives' calls, glue; the jobs' waits for
        #: the network cost none), on this pipeline's thread or, for a job run ``inline``, the
        #: caller's: what ``lowband profile`` measures per step for the performance model
        #: (``Profile.pipeline_cpu_s``)
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-pipeline", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # the kernel's name too: top -H and the workers' short slice (lowband.runtime.comm_threads) see it
        name_this_thread("lowband-pipe")
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, device, ready, span = item
            if not future.set_running_or_notify_cancel():
                self._finished += 1
                continue
            outcome = self._execute(fn, args, device, ready, span)
            self._finished += 1          # before the waiter wakes: the queue is idle again
            _resolve(future, outcome)

    def _execute(self, fn: Callable[..., Any], args: tuple, device: Optional[torch.device], ready: Any,
                 span: list[float]) -> tuple[bool, Any]:
        """Run one job (on the thread, or on the caller's for an inline job): ``(True, (fn's
        value, the CUDA event at its end or None))`` or ``(False, the exception)``."""
        if self._error is not None:
            return False, RuntimeError(f"an earlier collective of this rank failed: {self._error!r}")
        cpu = time.thread_time()
        try:
            span[0] = time.perf_counter()
            result = self.side.run(lambda: fn(*args), device, ready)
            span[1] = time.perf_counter()
            self.cpu_s += time.thread_time() - cpu
            return True, result
        except BaseException as exc:   # delivered to whoever waits on the job
            self._error = exc
            return False, exc

    def _submit(self, fn: Callable[..., Any], args: tuple, inputs: Any,
                inline: bool = False) -> tuple[Future, Optional[torch.device], list[float]]:
        """Queue the job (or defer it, ``inline``); ``inputs`` are the tensors it reads that the
        caller produced (on CUDA: the job runs after them, on the device of the first). The
        list returned gets the job's start and end time on the thread that runs it."""
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        device = cuda_device_of(inputs)
        future: Future = Future()
        span = [0.0, 0.0]
        item = (future, fn, args, device, self.side.ready(device, inputs), span)
        if inline and device is None:
            self._deferred.append((item, threading.get_ident()))
        else:
            if self._deferred:
                self._dispatch()
            self._queued += 1
            self._queue.put(item)
        return future, device, span

    def _dispatch(self) -> None:
        """Queue every deferred job (in order, before anything submitted after them)."""
        for item, _ in self._deferred:
            self._queued += 1
            self._queue.put(item)
        self._deferred.clear()

    def claim(self, future: Future) -> None:
        """Before waiting for ``future``: if it is a deferred job, run it (and the deferred
        jobs before it) on this thread when the queue is idle and this thread submitted
        them; otherwise queue the deferred jobs for the thread."""
        while any(item[0] is future for item, _ in self._deferred):
            if self._finished != self._queued or threading.get_ident() != self._deferred[0][1]:
                self._dispatch()
                return
            (held, fn, args, device, ready, span), _ = self._deferred.pop(0)
            held.set_running_or_notify_cancel()
            self.inline_jobs += 1
            _resolve(held, self._execute(fn, args, device, ready, span))

    def submit(self, fn: Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]], *args: Any,
               inline: bool = False) -> Handle:
        """Queue ``fn(*args)`` (returning ``(tensor, present)``) behind every earlier job; the
        tensors among ``args`` are its inputs.

        ``inline`` (on the CPU; CUDA jobs always queue): for a job the caller will wait for
        before submitting anything else, to which the thread would add only two hand-offs.
        The job is held until its handle is waited for, and then runs on the waiting thread
        if every earlier job has finished (else it is queued then). So it runs at the point
        where the caller would have blocked on it anyway, never earlier: a rank's training
        thread blocks on collectives of the pipeline's group and of other groups (the
        engine's guard) in the same program order as with the thread, and no rank can wait
        in one group for a peer that waits in the other. A later submit, ``call`` or
        ``close`` queues held jobs first, so the order of collectives never changes."""
        future, device, span = self._submit(fn, args, [a for a in args if isinstance(a, torch.Tensor)], inline)
        return Handle(future, self.caller, self.side, device, span, self if inline else None)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the queue (after every earlier job) and return its result
        (every tensor in ``args``, nested ones too, is an input)."""
        future, _, _ = self._submit(fn, args, args)
        return self.side.consume(*future.result())

    def close(self) -> None:
        """Finish the queued jobs and stop the thread (idempotent; does not wait for a thread
        stuck after a failure)."""
        if self._closed:
            return
        self._closed = True
        self._dispatch()
        self._queue.put(None)
        if self._error is None:
            self._thread.join()


def _resolve(future: Future, outcome: tuple[bool, Any]) -> None:
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
