"""CUDA stream order for the background pipeline, and exposed-wait timing with CUDA events.

Everything here is a no-op on the CPU: a ``cpu`` device (or none) creates no stream, no event
and no CUDA call at all. The decision is made by ``device.type``, never by whether CUDA is
available.

On CUDA (``benchmarks/gpu_check.sh`` and tests/test_cuda.py check it on a GPU):

* :class:`SideStream` — a pipeline's own stream. The submitting thread records an event on its
  current (compute) stream after the job's inputs are written (:meth:`SideStream.ready`); the
  pipeline thread runs the job with the side stream current, after that event
  (:meth:`SideStream.run`), and records an event at its end; whoever takes the result makes
  its current stream wait for that event (:meth:`SideStream.consume`). Neither side blocks
  the host on the GPU. A tensor allocated on one stream and used on the other is marked with
  ``Tensor.record_stream``, so the caching allocator does not reuse its memory before the other
  stream is done with it: the inputs for the side stream at submit, the results for the
  consumer's stream when they are taken.
* :class:`GpuWaits` — exposed communication as the compute stream sees it. Under NCCL a
  ``wait()`` does not block the host, so wall time reads about 0; instead an event is recorded
  on the compute stream before the wait and one after it, and the GPU time between them
  (the stream stalled on communication, or idle while the host waited) is added to the
  clock once both events have completed: at a later step or when the counters are read, never
  by a host sync of its own (:meth:`GpuWaits.collect` with ``block=False``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch


def on_cuda(device: Optional[torch.device]) -> bool:
    return device is not None and device.type == "cuda"


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (nested tuples, lists and dict values)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


def cuda_device_of(obj: Any) -> Optional[torch.device]:
    """The device of the first CUDA tensor in ``obj``; None when it holds none."""
    for t in tensors_in(obj):
        if t.device.type == "cuda":
            return t.device
    return None


class SideStream:
    """The CUDA stream of one pipeline, created on its first CUDA job (one device per
    pipeline). On the CPU (``device`` None or ``cpu``) every method does nothing."""

    def __init__(self) -> None:
        self.stream: Optional["torch.cuda.Stream"] = None
        self.device: Optional[torch.device] = None

    def _for(self, device: torch.device) -> "torch.cuda.Stream":
        if self.stream is None:
            self.stream, self.device = torch.cuda.Stream(device), device
        elif device != self.device:
            raise ValueError(f"a pipeline serves one device: it runs on {self.device}, a job brought {device}")
        return self.stream

    def ready(self, device: Optional[torch.device], inputs: Any = ()) -> Optional["torch.cuda.Event"]:
        """Submitting thread: an event on its current stream, after which the job may read
        ``inputs``; their memory is kept from reuse until the side stream is done with it."""
        if not on_cuda(device):
            return None
        stream = self._for(device)
        for t in tensors_in(inputs):
            if t.device.type == "cuda":
                t.record_stream(stream)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def run(self, job: Callable[[], Any], device: Optional[torch.device],
            ready: Optional["torch.cuda.Event"]) -> tuple[Any, Optional["torch.cuda.Event"]]:
        """Pipeline thread: ``(job(), done event)``, the job run on the side stream after
        ``ready``. A job with no CUDA tensor of its own (``device`` None) runs there too once
        the pipeline has a stream (it reads the pipeline's state: residuals). On the CPU:
        ``(job(), None)``."""
        if device is None:
            device = self.device
        if not on_cuda(device):
            return job(), None
        stream = self._for(device)
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            result = job()
            done = torch.cuda.Event()
            done.record(stream)
        return result, done

    def consume(self, result: Any, done: Optional["torch.cuda.Event"]) -> Any:
        """Taking thread: its current stream waits for ``done``, and the CUDA tensors of
        ``result`` are marked as used there. Returns ``result``."""
        if done is None:
            return result
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in tensors_in(result):
            if t.device.type == "cuda":
                t.record_stream(current)
        return result


class GpuWaits:
    """Pairs of timing events on a compute stream, summed (in seconds) once completed."""

    def __init__(self) -> None:
        self._pairs: list[tuple["torch.cuda.Event", "torch.cuda.Event"]] = []

    @staticmethod
    def mark(device: torch.device) -> "torch.cuda.Event":
        """A timing event recorded now on ``device``'s current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def add(self, start: "torch.cuda.Event", end: "torch.cuda.Event") -> None:
        self._pairs.append((start, end))

    def __len__(self) -> int:
        return len(self._pairs)

    def collect(self, block: bool = False) -> float:
        """Seconds of the pairs that have completed, which are dropped; with ``block``, all
        of them (waiting for the last: a host sync, for the end of a run)."""
        seconds, keep = 0.0, []
        for start, end in self._pairs:
            if block:
                end.synchronize()
            elif not end.query():
                keep.append((start, end))
                continue
            seconds += start.elapsed_time(end) / 1e3
        self._pairs = keep
        return seconds
