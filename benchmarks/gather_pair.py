"""An all-gather between two ranks over an emulated link: gloo's collective against one
``isend``/``irecv`` pair and against lowband's ``Communicator.all_gather`` (which uses the pair
for two gloo ranks).

Each of two workers of a :class:`lowband.netem.EmulatedCluster` runs ``--reps`` times: ``--compute``
seconds of matrix products on one thread (a training step's compute), then one gather of
``--bytes`` bytes, timed. With ``--barrier`` every repetition starts with a barrier, so both
ranks start computing, and reach the gather, together; without it each rank comes to the gather
from its own compute, as in a training loop. Prints each mode's median and minimum over the
repetitions, on the slower rank, and the ideal ``bytes * 8 / rate``.

    PYTHONPATH=src python benchmarks/gather_pair.py --rate 20mbit --bytes 116868
    PYTHONPATH=src python benchmarks/gather_pair.py --rate 20mbit --bytes 116868 --barrier

Needs root and network namespaces (the same as ``lowband bench --bandwidth``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("gloo", "pair", "lowband")
PORT = 29657


def _worker(rank: int, addr: str, nbytes: int, compute_s: float, reps: int, barrier: bool, mode: str) -> None:
    import torch
    import torch.distributed as dist

    from lowband.comm.communicator import Communicator

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(PORT)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    comm = Communicator()
    x = torch.full((nbytes,), rank, dtype=torch.uint8)
    out = torch.empty(2 * nbytes, dtype=torch.uint8)
    peer = 1 - rank

    def gather(tag: int) -> None:
        if mode == "gloo":
            dist.all_gather_into_tensor(out, x)
        elif mode == "pair":
            out[rank * nbytes:(rank + 1) * nbytes].copy_(x)
            works = [dist.irecv(out[peer * nbytes:(peer + 1) * nbytes], src=peer, tag=tag),
                     dist.isend(x, dst=peer, tag=tag)]
            for w in works:
                w.wait()
        else:
            comm.all_gather(out, x)

    a = torch.randn(192, 192)
    times = []
    for r in range(5 + reps):               # 5 to warm the connection
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        while time.perf_counter() - start < compute_s:
            a = (a @ a).tanh_()
        t0 = time.perf_counter()
        gather(r)
        if r >= 5:
            times.append(time.perf_counter() - t0)
    expected = torch.cat([torch.zeros(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)])
    assert torch.equal(out, expected), "gathered the wrong bytes"
    dist.destroy_process_group()
    print(json.dumps({"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}), flush=True)


def measure(rate_text: str, nbytes: int, compute_s: float, reps: int, barrier: bool) -> dict:
    from lowband.netem import EmulatedCluster, parse_rate

    rate = parse_rate(rate_text)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    me = [sys.executable, str(Path(__file__).resolve())]
    rows = {}
    with EmulatedCluster(2, rate) as cluster:
        for mode in MODES:
            procs = [subprocess.Popen(cluster.worker_prefix(r) + me + [
                "--worker", str(r), "--addr", cluster.addresses[0], "--bytes", str(nbytes), "--compute",
                str(compute_s), "--reps", str(reps), "--mode", mode] + (["--barrier"] if barrier else []),
                env={**env, **cluster.worker_env(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(2)]
            outs = []
            for p in procs:
                stdout, stderr = p.communicate(timeout=600)
                if p.returncode != 0:
                    raise SystemExit(f"{mode}: a worker failed: {stderr[-2000:]}")
                outs.append(json.loads(stdout.strip().splitlines()[-1]))
            rows[mode] = max(outs, key=lambda o: o["median_ms"])
        link = cluster.shape.describe()
    return {"rows": rows, "link": link, "ideal_ms": nbytes * 8 / rate * 1e3 if rate else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="20mbit", help="tc rate of each worker's link (default: %(default)s)")
    ap.add_argument("--bytes", type=int, default=116_868,
                    help="bytes each rank contributes (default: %(default)s, cnn's 2-bit message)")
    ap.add_argument("--compute", type=float, default=0.035, help="seconds of compute before each gather "
                    "(default: %(default)s)")
    ap.add_argument("--reps", type=int, default=30, help="timed gathers per mode (default: %(default)s)")
    ap.add_argument("--barrier", action="store_true", help="a barrier before each repetition")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.addr, args.bytes, args.compute, args.reps, args.barrier, args.mode)
        return
    result = measure(args.rate, args.bytes, args.compute, args.reps, args.barrier)
    print(f"{args.bytes} bytes per rank over {args.rate} ({result['link']}), {args.compute * 1e3:g} ms of compute "
          f"before each, {'a barrier first' if args.barrier else 'no barrier'}; ideal {result['ideal_ms']:.1f} ms")
    print("| gather | median ms | min ms |\n|---|---:|---:|")
    for mode, r in result["rows"].items():
        print(f"| {mode} | {r['median_ms']:.1f} | {r['min_ms']:.1f} |")


if __name__ == "__main__":
    main()
