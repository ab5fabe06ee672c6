"""Where one training step's time goes, per rank: an instrumented 2-rank run over loopback.

Wraps (timing only, behaviour unchanged) the pieces of a step that lowband's algorithms run:
the bucket codec's encode and decode, the reducer's job on the background thread and its
all-gather, the handle waits, the guard's exchange, gradient copies into the buckets, the
optimizer step, CP-SGD's fused SGD pass and in-flight result. Prints, per rank, the median over
steps (after ``--skip``) of each piece's total wall time in that step, in ms (``mark``: the
bucket copies with the launches they trigger; ``guard_hook``: the guard's part of the gradient
hook, which contains ``mark``; background-thread pieces are charged to the step the training
thread is in). With ``--clock cpu`` the pieces are the calling thread's CPU time instead.
``process_cpu`` is the whole process's CPU time per step (every thread: the pipeline's and
gloo's too), the number that decides a step on a machine with no spare core.

Every rank trains ``cnn`` on synthetic Fashion-MNIST-shaped data with one intra-op thread.

    PYTHONPATH=src python benchmarks/step_breakdown.py --algorithm cpsgd --steps 100
"""
from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from ranks import run_ranks

#: (module, class or None, attribute, key) of what is timed
TIMED = [
    ("lowband.compressors.bucket", "BucketCodec", "encode", "encode"),
    ("lowband.compressors.bucket", "BucketCodec", "decode", "decode"),
    ("lowband.pipeline", "CompressedReducer", "_run", "job"),
    ("lowband.pipeline", "CompressedReducer", "start", "start"),
    ("lowband.pipeline", "Handle", "wait", "wait"),
    ("lowband.collectives.communicator", "Communicator", "all_gather", "gather"),
    ("lowband.guard", "GradientGuard", "check", "guard"),
    ("lowband.algorithms.buckets", "BucketSet", "mark_ready", "mark"),
    ("lowband.algorithms.buckets", "BucketSet", "write_gradients", "write_gradients"),
    ("lowband.algorithms.cpsgd", "_InFlight", "result", "in_flight_result"),
    ("lowband.algorithms.local_update", "FusedSGDStep", "step", "fused_sgd"),
    ("lowband.guard", "GradientGuard", "on_gradient", "guard_hook"),
    ("lowband.guard", None, "all_finite", "finite_test"),
    ("lowband.guard", "GradientGuard", "start", "guard_start"),
    ("lowband.algorithms.cpsgd", "BoundCPSGD", "_launch", "launch"),
]


def _process_cpu() -> float:
    """CPU seconds of this process so far, every thread (the pipeline's and gloo's included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


#: the step being timed (the training loop advances it); every timed call is charged to it
CURRENT_STEP = [0]


#: the clock of the timed pieces: wall time, or the calling thread's CPU time (``--clock cpu``)
CLOCK = [time.perf_counter]


def _wrap(owner, name: str, key: str, marks: dict) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)        # keeps the signature: cpsgd inspects the reducer's start()
    def timed(*a, **k):
        clock = CLOCK[0]
        t0 = clock()
        try:
            return f(*a, **k)
        finally:
            per_step = marks.setdefault(key, {})
            step = CURRENT_STEP[0]
            per_step[step] = per_step.get(step, 0.0) + clock() - t0
    setattr(owner, name, timed)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    import importlib
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import lowband
    from lowband.data import ShardedBatches, make_synthetic
    from lowband.models import make_model
    from lowband.perf.plan import parse_algorithm
    marks: dict[str, list[float]] = {}
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    for module, cls, attr, key in TIMED:
        owner = importlib.import_module(module)
        _wrap(owner if cls is None else getattr(owner, cls), attr, key, marks)
    torch.manual_seed(0)
    model = make_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    _wrap(opt, "step", "optimizer", marks)
    name, options = parse_algorithm(args.algorithm)
    engine = lowband.distribute(model, opt, name, nonfinite=args.nonfinite, **options)
    data = ShardedBatches(make_synthetic(64 * world * (args.steps + 10), seed=1), 64, rank, world, seed=3)
    rows = []
    for i, (x, y) in enumerate(data.epoch(0)):
        if i >= args.steps:
            break
        CURRENT_STEP[0] = i
        t0, p0 = time.perf_counter(), _process_cpu()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(engine.module(x), y)
        t1, c1 = time.perf_counter(), time.thread_time()
        loss.backward()
        t2, c2 = time.perf_counter(), time.thread_time()
        engine.step()
        rows.append((t1 - t0, t2 - t1, c2 - c1, time.perf_counter() - t2, time.perf_counter() - t0,
                     _process_cpu() - p0))
    engine.close()
    skip = args.skip

    def med(xs):
        xs = xs[skip:]
        return 1e3 * statistics.median(xs) if xs else 0.0
    out = {"step": med([r[4] for r in rows]), "forward": med([r[0] for r in rows]),
           "backward": med([r[1] for r in rows]), "backward_cpu": med([r[2] for r in rows]),
           "engine.step": med([r[3] for r in rows]), "process_cpu": med([r[5] for r in rows])}
    for key, per_step in marks.items():   # a step without the call counts 0 (e.g. every k-th)
        out[key] = med([per_step.get(i, 0.0) for i in range(len(rows))])
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", default="cpsgd:warmup_steps=0",
                    help="as lowband bench writes it, e.g. compressed:warmup_steps=0 (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--nonfinite", default="raise")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time the pieces in wall time or in the calling thread's CPU time (the "
                         "step, forward and backward columns stay wall time) (default: %(default)s)")
    args = ap.parse_args()
    results = run_ranks(_worker, args.workers, args)
    print(f"# {args.algorithm}, cnn, {args.workers} gloo ranks on loopback, median ms per step after {args.skip} steps"
          f" (pieces: {args.clock} time)")
    keys = sorted({k for r in results.values() for k in r}, key=lambda k: list(results[0]).index(k) if k in results[0] else 99)
    print("| rank | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for r in sorted(results):
        print(f"| {r} | " + " | ".join(f"{results[r].get(k, 0.0):.2f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
