"""The pipeline's inline jobs (``Pipeline.submit(..., inline=True)``): a job the caller will
wait for is held until it is waited for, then runs on the waiting thread when the queue is
idle and is queued behind the job in flight otherwise; a later submit queues it first. Each
rank's collectives keep one order even when the ranks choose differently. And ``compressed``'s
last bucket and ``cpsgd``'s warm-up last bucket, which use it, train to the same bits as with
every job on the thread, also when a parameter's bucket completes in backward on one rank and
in ``step()`` on the other (where running the job at launch deadlocks against the engine's
guard exchange)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import lowband
from lowband.comm.communicator import Communicator
from lowband.comm.pipeline import Pipeline

from .distributed import run_distributed
from .training import PartlyUsed, SmallNet, batches, make_optimizer, train


def _sum_job(order: list, name: str, value: float, gate: threading.Event = None):
    """A job that records where it ran, then all-reduces ``value`` on the pipeline's group."""
    def job(pipeline: Pipeline):
        if gate is not None:
            assert gate.wait(30)
        order.append((name, threading.current_thread().name))
        t = torch.tensor([value])
        pipeline.comm.all_reduce(t)
        return t, None
    return job


def _inline_checks(rank: int, world: int):
    pipeline = Pipeline(Communicator(), "test")
    stats = pipeline.caller.stats
    order, out = [], {}

    # idle queue: held until waited for, then run on the waiting thread, its time exposed wait
    def slow(p):
        time.sleep(0.05)
        return _sum_job(order, "idle", rank + 1.0)(p)
    h = pipeline.submit(slow, pipeline, inline=True)
    held = (h.done(), list(order))
    before = stats.comm_wait_s
    out["idle"] = (held, float(h.wait()), order[-1][1], pipeline.inline_jobs, stats.comm_wait_s - before >= 0.05)

    # a later submit queues the held job first: both on the thread, in submission order
    held_job = pipeline.submit(_sum_job(order, "held", 2.0 * (rank + 1)), pipeline, inline=True)
    later = pipeline.submit(_sum_job(order, "later", 3.0 * (rank + 1)), pipeline)
    out["later"] = (float(later.wait()), float(held_job.wait()), order[-2:], pipeline.inline_jobs)

    # rank 0 waits for its inline job while an earlier job is in flight (held by a gate): it
    # must queue behind it; rank 1's queue is idle, so it runs both itself. Same collectives,
    # same order, on both ranks. (Rank 0 claims before opening the gate, as wait() does first:
    # a timer could open it before a slow wait() got there.)
    gate = threading.Event()
    first = pipeline.submit(_sum_job(order, "first", 10.0 * (rank + 1), gate if rank == 0 else None), pipeline,
                            inline=rank == 1)
    second = pipeline.submit(_sum_job(order, "second", 100.0 * (rank + 1)), pipeline, inline=True)
    if rank == 0:
        pipeline.claim(second._future)
    gate.set()
    out["pair"] = (float(second.wait()), float(first.wait()), order[-2:], pipeline.inline_jobs)

    # a failing inline job fails its handle and every later job, inline or queued
    def boom(p):
        raise ValueError("boom")
    bad = pipeline.submit(boom, pipeline, inline=True)
    with pytest.raises(ValueError, match="boom"):
        bad.wait()
    for inline in (True, False):
        with pytest.raises(RuntimeError, match="an earlier collective of this rank failed"):
            pipeline.submit(_sum_job(order, "after", 1.0), pipeline, inline=inline).wait()
    out["after_failure"] = [name for name, _ in order].count("after")
    pipeline.close()
    return out


def test_inline_jobs_run_when_waited_for_on_an_idle_queue_and_queue_otherwise():
    ranks = run_distributed(_inline_checks, 2)
    thread = "test-pipeline"
    for rank, out in enumerate(ranks):
        held, value, where, jobs, exposed = out["idle"]
        assert held == (False, []), (rank, held)               # nothing ran before the wait
        assert (value, where, jobs, exposed) == (3.0, "MainThread", 1, True), (rank, out["idle"])
        later, held_value, order, jobs = out["later"]
        assert (held_value, later) == (6.0, 9.0) and jobs == 1, (rank, out["later"])
        assert order == [("held", thread), ("later", thread)], (rank, order)
        second, first, order, jobs = out["pair"]
        assert (first, second) == (30.0, 300.0), rank
        if rank == 0:   # queued behind its job in flight: on the thread, after it
            assert order == [("first", thread), ("second", thread)] and jobs == 1, order
        else:
            assert order == [("first", "MainThread"), ("second", "MainThread")] and jobs == 3, order
        assert out["after_failure"] == 0, rank


STEPS = 12          # past the warm-up of 3
#: one bucket (compressed's default cap): its job runs inline every step, warm-up included;
#: several: the earlier buckets' jobs run on the thread during backward, the last inline;
#: partly used: a head only rank 0 uses on odd steps (its bucket completes in backward there,
#: in step() on rank 1), with the engine's guard exchanging a flag every warm-up step
LAYOUTS = {"one": (SmallNet, {"warmup_steps": 3}),
           "several": (SmallNet, {"warmup_steps": 3, "bucket_mb": 0.01}),
           "partly used": (PartlyUsed, {"warmup_steps": 3})}


#: per algorithm, the steps whose last bucket runs inline: compressed's every step; cpsgd's
#: warm-up steps only (its pipelined jobs are waited for a step later, on the thread)
INLINE_STEPS = {"compressed": STEPS, "cpsgd": 3}


def _on_the_thread(reducer) -> None:
    """Submit every job of ``reducer`` to the pipeline's thread (``inline=False``): the reference
    for the last bucket run on the training thread."""
    for method in ("start", "start_full_precision"):
        submit = getattr(reducer, method)
        setattr(reducer, method, lambda *args, _submit=submit, **kw: _submit(*args, **{**kw, "inline": False}))


def _both_ways(rank: int, world: int):
    out = {}
    for algorithm in INLINE_STEPS:
        for layout, (net, options) in LAYOUTS.items():
            for inline in (True, False):
                torch.manual_seed(0)
                model = net(rank) if net is PartlyUsed else net()
                opt = make_optimizer("sgd", model)
                engine = lowband.distribute(model, opt, algorithm, **options)
                if not inline:
                    _on_the_thread(engine.bound.reducer)
                params = train(model, opt, batches(rank, world), engine.step, STEPS, forward=engine.module)
                out[algorithm, layout, inline] = (params, engine.bound.reducer.pipeline.inline_jobs,
                                                  len(engine.bound.buckets.buckets))
                engine.close()
    return out


@pytest.fixture(scope="module")
def inline_runs():
    return run_distributed(_both_ways, 2)


@pytest.mark.parametrize("algorithm", list(INLINE_STEPS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_last_bucket_inline_trains_to_the_same_bits_as_on_the_thread(inline_runs, algorithm, layout):
    for rank, out in enumerate(inline_runs):
        inline_params, inline_jobs, buckets = out[algorithm, layout, True]
        thread_params, thread_jobs, _ = out[algorithm, layout, False]
        assert (buckets > 1) == (layout == "several"), buckets
        assert thread_jobs == 0, rank
        # the last bucket of every such step: step() waits for the earlier buckets first, so
        # the queue is idle when it comes to the last one
        assert inline_jobs == INLINE_STEPS[algorithm], (rank, algorithm, inline_jobs)
        for name in thread_params:
            assert torch.equal(inline_params[name], thread_params[name]), (rank, layout, name)
