"""One ordered queue per rank: every collective a rank issues, recorded at the torch.distributed
call (group, operation, size, dtype, issuing thread), forms the same sequence on both ranks on
each group, even when the ranks' backward passes produce different parameters' gradients; and
every collective of a compressing algorithm (warm-up all-reduces, compressed buckets, fp32
side channels) is issued on the pipeline's own group by its one thread (or, for
``compressed``'s last bucket when nothing else is in flight, by the training thread in the
queue's order: tests/test_pipeline.py), while
``ssgd`` and ``lazy`` issue theirs from the training thread. The engine's non-finite guard
has a group of its own (its exchange may come before or after a bucket launched in ``step()``,
which is why: docs/reliability.md), so it is compared as a sequence of its own. On CUDA the same queue runs its jobs on one side
stream (lowband.comm.streams), so this order is also the order of the stream's collectives."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import lowband
from lowband.comm import communicator

from .distributed import run_distributed
from .training import PartlyUsed, batches, make_optimizer, train

STEPS = 6
#: past the warm-ups within STEPS, several buckets each (so their order can differ)
ALGORITHMS = {
    "ssgd": {"bucket_mb": 0.01},
    "compressed": {"warmup_steps": 2, "bucket_mb": 0.01},
    "cpsgd": {"warmup_steps": 2, "correction_period": 3, "bucket_mb": 0.01},
    "lazy": {"bucket_mb": 0.01, "lazy_layers": 1},
}
PIPELINED = ("compressed", "cpsgd")


def _group_name(group) -> str:
    return "world" if group is None else group.group_name


def _recorder(log: list):
    """Wrappers of the torch.distributed calls lowband makes, appending one entry each."""
    def wrap(op, fn, tensor_arg):
        def call(*args, **kwargs):
            t = args[tensor_arg] if len(args) > tensor_arg else kwargs["tensor" if tensor_arg == 0 else "input"]
            log.append((_group_name(kwargs.get("group")), op, t.numel(), str(t.dtype), threading.current_thread().name))
            return fn(*args, **kwargs)
        return call
    return wrap


def _collectives(rank: int, world: int):
    wrap = _recorder(log := [])
    saved = (dist.all_reduce, dist.all_to_all_single, dist.broadcast, communicator._all_gather_single, dist.isend)
    out = {}
    try:
        dist.all_reduce = wrap("all_reduce", saved[0], 0)
        dist.all_to_all_single = wrap("all_to_all", saved[1], 1)
        dist.broadcast = wrap("broadcast", saved[2], 0)
        communicator._all_gather_single = wrap("all_gather", saved[3], 1)
        dist.isend = wrap("all_gather", saved[4], 0)      # two gloo ranks gather by a send/receive pair
        for name, options in ALGORITHMS.items():
            torch.manual_seed(0)
            model = PartlyUsed(rank)
            opt = make_optimizer("sgd", model)
            engine = lowband.distribute(model, opt, name, **options)
            log.clear()                      # training only: construction is the engine's
            train(model, opt, batches(rank, world), engine.step, STEPS, forward=engine.module)
            engine.synchronize()             # cpsgd's last step is in flight until drained
            pipeline = getattr(getattr(engine.bound, "reducer", None), "pipeline", None)
            out[name] = {
                "log": list(log),
                "guard": _group_name(engine.guard.comm.group),
                "pipeline": None if pipeline is None else (_group_name(pipeline.comm.group), pipeline._thread.name),
            }
            engine.close()
    finally:
        (dist.all_reduce, dist.all_to_all_single, dist.broadcast, communicator._all_gather_single,
         dist.isend) = saved
    return out


def test_every_collective_of_a_rank_goes_through_one_ordered_queue():
    ranks = run_distributed(_collectives, 2)
    for name in ALGORITHMS:
        mine, other = ranks[0][name], ranks[1][name]
        log = mine["log"]
        assert log, name
        for group in {e[0] for e in log + other["log"]}:
            assert [e for e in log if e[0] == group] == [e for e in other["log"] if e[0] == group], \
                f"{name}: the ranks issued different sequences of collectives on group {group}"
        algorithm = [e for e in log if e[0] != mine["guard"]]
        issuers = {(group, thread) for group, *_, thread in algorithm}
        if name in PIPELINED:
            group, thread = mine["pipeline"]
            # compressed's last bucket (cpsgd's in its warm-up) may run on the training thread
            # when the queue is idle (Pipeline.submit's inline), still on the pipeline's group and in
            # its order
            expected = {(group, thread), (group, "MainThread")}
            assert issuers == expected, (name, issuers)
            ops = {op for _, op, *_ in algorithm}
            assert {"all_reduce", "all_gather"} <= ops, (name, ops)    # warm-up and compressed steps
        else:
            assert issuers == {("world", "MainThread")}, (name, issuers)
        assert all(thread == "MainThread" for group, *_, thread in log if group == mine["guard"]), name
