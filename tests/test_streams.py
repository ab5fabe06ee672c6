"""The pipeline's CUDA stream order and the CUDA-event timing of exposed waits, checked on the
CPU: against a recording stand-in of ``torch.cuda`` (streams, events, ``record_stream``) and
tensors that say they are on ``cuda:0``, the pipeline must record an event on the compute
stream at submit, run the job on its side stream after that event, record one at the job's
end, and make the consumer's stream wait for it, with no host sync anywhere; and on the CPU
it must create no CUDA object at all. Whether real CUDA honours this is for
tests/test_cuda.py and benchmarks/gpu_check.sh on a GPU (they passed on one H200 on
2026-12-04: docs/results.md, "First GPU run")."""
from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from lowband.comm.communicator import GPU_WAITS_COLLECT_AT, CommStats, Communicator
from lowband.codecs import make_compressor
from lowband.comm.pipeline import Pipeline
from lowband.comm.reducer import make_reducer

from .distributed import run_distributed

CUDA0 = torch.device("cuda", 0)


class FakeCuda:
    """A recording stand-in for the parts of ``torch.cuda`` that lowband.comm.streams uses. Each
    thread's current stream is ``compute`` (the training thread) or ``default`` (others);
    events complete when ``complete()`` says so; every call is logged."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.ids = itertools.count()
        self.local = threading.local()
        self.done = False
        fake = self

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name
                fake.log.append(("new stream", name))

            def wait_event(self, event):
                fake.log.append(("wait", self.name, event.id))

        class Event:
            def __init__(self, enable_timing=False):
                self.id, self.timing = next(fake.ids), enable_timing

            def record(self, stream):
                self.stream = stream.name
                fake.log.append(("record", stream.name, self.id, self.timing))

            def query(self):
                return fake.done

            def synchronize(self):
                fake.log.append(("synchronize", self.id))

            def elapsed_time(self, end):
                return 5.0          # ms

        self.Stream, self.Event = Stream, Event
        self.streams = {"compute": Stream(name="compute"), "default": Stream(name="default")}
        self.log.clear()

    def current_stream(self, device=None):
        name = getattr(self.local, "current", None) or \
            ("compute" if threading.current_thread() is threading.main_thread() else "default")
        return self.streams.get(name) or self.local.stream

    @contextmanager
    def stream(self, stream):
        saved = getattr(self.local, "current", None)
        self.local.current, self.local.stream = stream.name, stream
        try:
            yield
        finally:
            self.local.current = saved

    def install(self, monkeypatch) -> None:
        for name in ("Stream", "Event", "current_stream", "stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


class OnCuda(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 and logs ``record_stream``."""

    log: list = []

    @property
    def device(self):
        return CUDA0

    def record_stream(self, stream):
        OnCuda.log.append(("record_stream", stream.name))


def _no_cuda(*_args, **_kwargs):
    raise AssertionError("a CUDA object was created on the CPU path")


def _pipeline_checks(rank: int, world: int):
    from _pytest.monkeypatch import MonkeyPatch
    mp = MonkeyPatch()
    out = {}
    try:
        # on the CPU: a compressed reduce, an fp32 job and a state read create no CUDA object
        for name in ("Stream", "Event", "current_stream", "stream"):
            mp.setattr(torch.cuda, name, _no_cuda)
        comm = Communicator()
        reducer = make_reducer("allgather", comm, make_compressor("2bit", threshold=0.5))
        x = torch.randn(40)
        y = reducer.start(x, "b", [("w", 30), ("v", 10)], present=torch.tensor([True, False])).wait()
        mean = reducer.start_full_precision(x, "mean").wait()
        reducer.state_dict()
        out["cpu"] = (y.device.type, reducer.pipeline.side.stream, torch.equal(mean, x), comm.stats.comm_wait_s > 0)
        reducer.close()

        # on "CUDA": the order of events and streams
        fake = FakeCuda()
        fake.install(mp)
        OnCuda.log = fake.log
        stats = CommStats()
        pipeline = Pipeline(Communicator(None, stats), "fake")

        def job(t):
            fake.log.append(("job", fake.current_stream().name))
            return (t * 2).as_subclass(OnCuda), None
        handle = pipeline.submit(job, torch.ones(3).as_subclass(OnCuda))
        result = handle.wait()
        out["waited"] = (stats.comm_wait_s, len(stats._gpu_waits), type(result).__name__)
        pipeline.call(lambda: fake.log.append(("job", fake.current_stream().name)))
        fake.done = True
        stats.collect_gpu_waits()
        out["collected"] = (stats.comm_wait_s, len(stats._gpu_waits))
        out["log"] = list(fake.log)
        pipeline.close()
    finally:
        mp.undo()
    return out


@pytest.fixture(scope="module")
def checks():
    return run_distributed(_pipeline_checks, 1)[0]


def test_on_the_cpu_the_pipeline_creates_no_cuda_object(checks):
    assert checks["cpu"] == ("cpu", None, True, True)


def test_jobs_run_on_the_side_stream_ordered_by_events(checks):
    log = checks["log"]
    pos = {e: i for i, e in reversed(list(enumerate(log)))}    # first position of each entry
    assert log.count(("new stream", "side")) == 1               # one stream per pipeline
    ready = next(e for e in log if e[:2] == ("record", "compute") and not e[3])
    job = log.index(("job", "side"))
    done = next(e for e in log[job:] if e[:2] == ("record", "side"))
    # submit: the input is kept for the side stream, then the compute stream's event
    assert pos[("record_stream", "side")] < pos[ready]
    # the side stream waits for that event before the job, and records its end after it
    assert pos[("wait", "side", ready[2])] < job < pos[done]
    # the consumer's stream waits for the end, then the result is marked as used there
    assert pos[("wait", "compute", done[2])] < pos[("record_stream", "compute")]
    # the wait is timed on the compute stream: an event before the host waits, one after
    timing = [e for e in log if e[:2] == ("record", "compute") and e[3]]
    assert len(timing) == 2 and pos[timing[0]] < pos[("wait", "compute", done[2])] < pos[timing[1]]
    # a job without tensors (state reads) runs on the side stream too, and nothing blocked
    assert log.count(("job", "side")) == 2
    assert not any(e[0] == "synchronize" for e in log)


def test_cuda_waits_reach_the_clock_only_when_their_events_completed(checks):
    assert checks["waited"] == (0.0, 1, "OnCuda")      # timed, not yet collected: no host sync
    assert checks["collected"] == (pytest.approx(0.005), 0)


def test_gpu_waits_block_only_when_asked(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    stats = CommStats()
    with stats.exposed(CUDA0):
        pass
    with stats.exposed(CUDA0):
        pass
    stats.collect_gpu_waits()
    assert stats.comm_wait_s == 0.0 and len(stats._gpu_waits) == 2
    assert stats.snapshot()["comm_wait_s"] == 0.0
    stats.collect_gpu_waits(block=True)
    assert stats.comm_wait_s == pytest.approx(0.010) and len(stats._gpu_waits) == 0
    assert [e[0] for e in fake.log].count("synchronize") == 2
    # a loop that never reads its stats keeps a bounded number of completed pairs
    fake.done = True
    for _ in range(2 * GPU_WAITS_COLLECT_AT):
        with stats.exposed(CUDA0):
            pass
    assert len(stats._gpu_waits) < GPU_WAITS_COLLECT_AT
    assert stats.comm_wait_s == pytest.approx(0.010 + 0.005 * (2 * GPU_WAITS_COLLECT_AT - len(stats._gpu_waits)))
    # the CPU: wall time, at once, and no CUDA call
    for name in ("Stream", "Event", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, _no_cuda)
    before = stats.comm_wait_s
    with stats.exposed(torch.device("cpu")):
        time.sleep(0.01)
    assert stats.comm_wait_s >= before + 0.01
