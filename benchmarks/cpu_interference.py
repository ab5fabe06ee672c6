"""What a background thread's work costs the training thread when no core is spare.

On a machine with as many cores as workers (this project's 2-core vm, 2 workers), every
worker's main thread keeps one core busy with forward and backward, so whatever a worker's
background thread does (CP-SGD's pipeline job, compressed's codec) has to take that time from
some main thread. This benchmark measures it without lowband's algorithms: ``--workers``
processes each train ``cnn`` (one intra-op thread, no communication) while a background
thread of each process, woken at the start of every step, runs one kind of work:

* ``none``: nothing (the thread sleeps on its event);
* ``stream``: ``--stream-passes`` native passes over bucket-sized fp32 tensors (``torch.add``
  of two ``--numel`` tensors into a third, GIL released: about the memory traffic of one
  encode plus one decode of cnn's bucket per pass);
* ``python``: ``--python-ms`` of pure-Python work holding the GIL;
* ``sleep``: a 2 ms sleep (wakes, costs nothing).

It prints, per kind, the median forward and backward wall time of the main thread over the
steps after ``--skip``, per process, and the mean over processes. Kinds run in turn,
``--rounds`` times, so a drift of the machine shows as a spread between rounds.

    PYTHONPATH=src python benchmarks/cpu_interference.py --workers 2 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from ranks import run_ranks

KINDS = ("none", "stream", "python", "sleep")


def _work(kind: str, args, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """One step's background work of ``kind``."""
    if kind == "stream":
        for _ in range(args.stream_passes):
            torch.add(a, b, out=c)
    elif kind == "python":
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.python_ms / 1e3:
            pass
    elif kind == "sleep":
        time.sleep(0.002)


def _tensors(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(args.numel), torch.randn(args.numel), torch.empty(args.numel)


def _background(kind: str, args, wake: threading.Event, stop: threading.Event) -> None:
    a, b, c = _tensors(args)
    while not stop.is_set():
        if wake.wait(0.1):
            wake.clear()
            _work(kind, args, a, b, c)


def _alone_ms(kind: str, args) -> float:
    """The work's own wall time, on the main thread with no training beside it."""
    a, b, c = _tensors(args)
    times = []
    for _ in range(60):
        t0 = time.perf_counter()
        _work(kind, args, a, b, c)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[10:])


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    del world, port                      # no communication: the processes only share the cores
    torch.set_num_threads(1)
    from lowband.models import make_model
    torch.manual_seed(rank)
    model = make_model("cnn")
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    out = {("alone", kind): _alone_ms(kind, args) for kind in args.kinds}
    for rnd in range(args.rounds):
        for kind in args.kinds:
            wake, stop = threading.Event(), threading.Event()
            thread = threading.Thread(target=_background, args=(kind, args, wake, stop), daemon=True)
            thread.start()
            fwd, bwd = [], []
            for i in range(args.steps):
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                wake.set()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                if i >= args.skip:
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
            stop.set()
            thread.join()
            out[(rnd, kind)] = (1e3 * statistics.median(fwd), 1e3 * statistics.median(bwd))
    queue.put((rank, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="processes training at once (default 2)")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--skip", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--numel", type=int, default=431_080, help="elements per tensor (cnn's parameters)")
    ap.add_argument("--stream-passes", type=int, default=3)
    ap.add_argument("--python-ms", type=float, default=0.5)
    args = ap.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.workers < 1 or args.rounds < 1 or not 0 <= args.skip < args.steps:
        ap.error("need --workers >= 1, --rounds >= 1 and 0 <= --skip < --steps")
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown kind(s) {', '.join(bad)}; choose from {', '.join(KINDS)}")
    results = run_ranks(_worker, args.workers, args)
    print(f"# cnn, {args.workers} processes, 1 thread each, median ms per step after {args.skip} of {args.steps}")
    alone = {k: statistics.mean(results[r][("alone", k)] for r in results) for k in args.kinds}
    print("background work alone (ms, mean of processes, both processes timing it at once): "
          + ", ".join(f"{k} {v:.2f}" for k, v in alone.items()))
    print("| round | background | forward (mean of processes) | backward | forward + backward | per process fwd/bwd |")
    print("|---|---|---|---|---|---|")
    for rnd in range(args.rounds):
        for kind in args.kinds:
            per = [results[r][(rnd, kind)] for r in sorted(results)]
            f = statistics.mean(p[0] for p in per)
            b = statistics.mean(p[1] for p in per)
            each = " ".join(f"{p[0]:.2f}/{p[1]:.2f}" for p in per)
            print(f"| {rnd} | {kind} | {f:.2f} | {b:.2f} | {f + b:.2f} | {each} |")


if __name__ == "__main__":
    main()
