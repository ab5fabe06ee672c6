"""Validate lowband's performance model against real runs over emulated links.

Two phases, so each timing run stays short (run one `run` per link and worker count):

    # measure: a link probe (small and large all_reduce) and `lowband bench` of every algorithm
    python benchmarks/validate_perfmodel.py run --link 1gbit --workers 2 --out runs/validate
    python benchmarks/validate_perfmodel.py run --link 1gbit --workers 4 --out runs/validate
    ...  (200mbit, 50mbit)
    # predict and compare (no timing; rerun at will, e.g. with a new profile)
    python benchmarks/validate_perfmodel.py report --out runs/validate --profile cnn-2core \
        --doc docs/results.md --section perfmodel-validation

What is predicted and what is taken from the run under test:
* measured on the link (probe, before the bench): per-message latency (by default the step
  probe's second 4-byte all-reduce, between training steps, / 2(N-1):
  :func:`latency_from_step_probe`; ``report --latency-from probe``: the median, over
  ``LATENCY_PROBES`` independent probe runs, of the median all_reduce time of 64 bytes on
  idle ranks, / 2(N-1): :func:`latency_from_probes`) and bulk efficiency (4 MiB all_reduce
  rate / nominal rate); and, beside
  a compute loop on every rank (the contention probe, ``contention_worker``), the compute time
  the link's traffic takes per byte sent (``comm_cpu_s_per_byte``) and the wall time one
  synchronization costs beyond a 4-byte all-reduce's latency (``sync_s``, charged once per
  collective); ``report --idle-cpu-probe`` uses instead the per-byte CPU time of an all-reduce
  on an idle machine and no synchronization cost (the model before 2026-12-02); and, with the
  model's own training step on every rank (the step probe, ``step_sync_worker``, run
  ``STEP_PROBES`` times in fresh processes, each cost the median of the runs'), two 4-byte
  all-reduces after each backward, each timed on every rank: the first gives the least time of
  the collective that ends a step (``step_sync_s``: the later rank's arrival after a whole
  step), the second what a tiny collective right behind another costs (``exchange_s``, charged
  for the engine's finiteness exchange); then a chain of three 256-byte all-reduces, each after
  the first launched and waited for inside the previous one's future callback, as PyTorch's
  PowerSGD hook launches its P and Q all-reduces (``chained_s``: each link's time from its
  launch, charged to ddp-powersgd's P and Q); ``report --no-step-sync`` predicts without them;
* known from the link's set-up: tc tbf's bucket depth (``lowband.netem.paced`` of the rate, the
  default every bench run uses; ``--no-burst`` predicts with a plain rate limit);
* measured in the same bench run: the compute-only (`noop`) step time, which gives the
  compute scale (noop step / profile compute step: CPU contention of N workers on this
  machine's cores, and the load of the machine at the time). Each algorithm gets its own
  `lowband bench --algorithms noop,ALG --repeat R` run (``run --rounds R``, default 3: noop,
  ALG, noop, ALG, ... interleaved), so each round's compute scale comes from the noop run taken
  right before it (the machine is shared and its load drifts within minutes), and the report
  takes the round with the median error (one pair hit by a load spike does not decide; every
  round's error is printed beside it); for `lazy`, the sync interval tau, counted from the
  steps whose bytes exceed the non-sync steps';
* predicted by the model: everything else (communication, overlap, codec cost and placement,
  pipelining, periodic steps) from the profile, the network and the algorithm's rules.

Measured step time: mean of the steps after the algorithm's warm-up (+3), over whole cycles
of its periodic steps, from the run's steps.jsonl.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

#: every algorithm of lowband's registry, with warm-ups short enough for ~60-step runs
ALGORITHMS = ["noop", "ssgd", "ddp", "ddp-fp16", "ddp-powersgd", "compressed:warmup_steps=10",
              "cpsgd:warmup_steps=10", "lazy", "localsgd", "diloco", "streaming-diloco"]
#: steps excluded before the measured window: the algorithm's warm-up (as its steps.jsonl logs
#: it, ``"warmup": true``) plus ``AFTER_WARMUP``, at least ``DEFAULT_SKIP``. ``SKIP`` holds the
#: warm-up + 3 of runs made before every warm-up was logged (2026-12-04): ddp-powersgd's
#: start_powerSGD_iter 10, localsgd's warmup_steps 10, and the runs' warmup_steps=10
SKIP = {"ddp-powersgd": 13, "localsgd": 13, "compressed": 13, "cpsgd": 13}
DEFAULT_SKIP = 5
AFTER_WARMUP = 3
ALGO_ORDER = {a.replace(":", "-"): i for i, a in enumerate(ALGORITHMS)}
TARGET = 0.15


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def source_digest() -> str:
    """A digest of lowband's sources (``src/``): the runs import them from the working tree, so
    an edit during a run would measure other code than the one named by the commit."""
    import hashlib
    h = hashlib.sha256()
    root = os.path.join(os.path.dirname(HERE), "src")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".py", ".c", ".json")):
                path = os.path.join(dirpath, name)
                h.update(path.encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


def load_average() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


# -- run -------------------------------------------------------------------------------------

PROBE_PORT = "29519"   # free in rank 0's fresh namespace


def join_probe_group() -> Optional[int]:
    """A probe rank's set-up, as a lowband worker's: its C heap in the workers' default mode
    (:mod:`lowband.runtime.memory`), one intra-op thread, the gloo group of the launcher's environment
    and its threads' scheduler slice in the workers' default, once every one of them runs
    (:func:`lowband.runtime.comm_threads.shorten_settled`: asked for right after
    ``init_process_group``, the slice can miss some of gloo's threads). Returns how many threads took it (None: a kernel without custom slices)."""
    import torch
    import torch.distributed as dist
    from lowband.runtime import comm_threads, memory
    memory.configure(memory.DEFAULT_MODE)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return comm_threads.shorten_settled(comm_threads.WORKER_SLICE_US)


def probe_worker(size: int, iters: int) -> None:
    """One rank of the probe: time ``iters`` all_reduces of ``size`` bytes, wall and CPU."""
    import torch
    import torch.distributed as dist
    sliced = join_probe_group()
    dist.all_reduce(torch.ones(16))
    walls, cpus = [], []
    for _ in range(iters):
        t = torch.ones(max(1, size // 4))
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        dist.all_reduce(t)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    print(json.dumps({"walls": walls, "cpus": cpus, "sliced": sliced}), flush=True)
    dist.destroy_process_group()


def contention_worker(rate_bits: int, rounds: int) -> None:
    """One rank of the contention probe, on the emulated link, beside compute.

    * **communication beside compute**: a single-threaded matmul loop on the main thread (a
      fixed count of blocks, ~0.6 s, the same on every rank) alone, and again while a
      background thread runs all-reduces of 1 MiB worth ~40% of the loop's time at the
      link's rate; the loop's extra wall time per byte this rank sent is what the link's
      traffic (gloo's copies and reductions, the kernel's TCP and veth work) takes from
      compute on this machine: the model's ``comm_cpu_s_per_byte``;
    * **one synchronization beside compute**: the same loop cut into ~15 ms blocks with a
      4-byte all-reduce after each, against the blocks alone: the wall time of one
      synchronization point (latency, waking the waiting thread, the ranks' skew).
    Rounds alternate alone / with, so drift of the machine's speed cancels."""
    import threading
    import torch
    import torch.distributed as dist
    from lowband.comm.wire import allreduce_bytes
    sliced = join_probe_group()
    world = dist.get_world_size()
    a = torch.randn(160, 160)

    def blocks(n: int) -> None:
        for _ in range(n):
            for _ in range(8):
                torch.mm(a, a)

    # calibrate the block count (slowest rank's) so the loop takes ~0.6 s, the same on every rank
    blocks(50)
    t0 = time.perf_counter()
    blocks(200)
    slowest = torch.tensor([(time.perf_counter() - t0) / 200], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)      # every count below is derived from it alike
    per_block = float(slowest)
    n = max(20, int(0.6 / per_block))
    size = 1 << 20
    wire = allreduce_bytes(size, world)
    loop_s = n * per_block
    k = max(1, int(round(0.4 * loop_s * rate_bits / 8 / wire)))
    payload, flag = torch.ones(size // 4), torch.zeros(1)
    per_sync = max(1, int(round(0.015 / per_block)))     # ~15 ms of compute between syncs
    out = {"blocks": n, "allreduces": k, "bytes_sent": k * wire, "alone": [], "beside": [], "comm_s": [],
           "sync_blocks": per_sync, "syncs": n // per_sync, "unsynced": [], "synced": [], "sliced": sliced}
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        blocks(n)
        out["alone"].append(time.perf_counter() - t0)
        dist.barrier()
        done = []

        def comm() -> None:
            c0 = time.perf_counter()
            for _ in range(k):
                dist.all_reduce(payload)
            done.append(time.perf_counter() - c0)

        th = threading.Thread(target=comm)
        t0 = time.perf_counter()
        th.start()
        blocks(n)
        out["beside"].append(time.perf_counter() - t0)
        th.join()
        out["comm_s"].append(done[0])
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n // per_sync):
            blocks(per_sync)
        out["unsynced"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n // per_sync):
            blocks(per_sync)
            dist.all_reduce(flag)
        out["synced"].append(time.perf_counter() - t0)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


#: the step probe's chain (:func:`chain`): its all-reduces and their fp32 elements each
CHAIN_LINKS, CHAIN_FLOATS = 3, 64


def chain(links: list) -> list[float]:
    """PyTorch's communication-hook chain, as ``powerSGD_hook`` builds it: an all-reduce
    launched asynchronously, then each next one launched and waited for inside the previous
    one's future callback (on gloo's thread: ``fut.then(cb)``, ``cb`` calls
    ``all_reduce(async_op=True).get_future().wait()``). The seconds from each callback's launch
    to its all-reduce's end (the first all-reduce, launched by the caller, is not timed)."""
    import torch.distributed as dist
    spans: list[float] = []

    def link(k: int):
        def callback(_fut):
            t0 = time.perf_counter()
            value = dist.all_reduce(links[k], async_op=True).get_future().wait()[0]
            spans.append(time.perf_counter() - t0)
            return value
        return callback
    fut = dist.all_reduce(links[0], async_op=True).get_future()
    for k in range(1, len(links)):
        fut = fut.then(link(k))
    fut.wait()
    return spans


def step_sync_worker(model_name: str, rounds: int, steps: int) -> None:
    """One rank of the step-meeting probe, on the emulated link: ``rounds`` x ``steps``
    training steps of the validated model (forward, backward, an SGD step, on one random batch
    of 64), each with two 4-byte all-reduces right after backward, every call timed on every
    rank. The first is what a latency-bound collective costs right after a whole training
    step: its latency, waking the waiting thread, and waiting for the later rank (a step's
    compute varies from rank to rank by more than the contention probe's uniform 15 ms matmul
    blocks do); averaged over the ranks, that is what the slowest rank adds to a synchronous
    step beyond the mean rank's compute (what the noop run measures). The second, right behind
    the first, is what a collective costs when the ranks have just met (the engine's finiteness
    exchange after a synchronous algorithm's last collective). Then the hook chain
    (:func:`chain`): its second and third all-reduces, each launched and waited for inside the
    previous one's callback, timed from their launch (what PowerSGD's P and Q all-reduces cost;
    at 4 workers on 2 cores several times the all-reduce right behind another). Timed inside
    one loop, so the machine's drift between loops does not enter."""
    import torch
    import torch.distributed as dist
    from lowband.app.models import make_model
    from lowband.perf.profile import example_batch
    from lowband.app.tasks import loss
    sliced = join_probe_group()
    torch.manual_seed(0)
    model = make_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = example_batch(model_name, model, 64)
    flag = torch.zeros(1)
    links = [torch.zeros(CHAIN_FLOATS) for _ in range(CHAIN_LINKS)]
    out = {"steps": steps, "first": [], "second": [], "chained": [], "sliced": sliced}
    for r in range(rounds + 1):           # round 0 warms up
        dist.barrier()
        first, second, chained = [], [], []
        for _ in range(steps):
            opt.zero_grad()
            loss(model(x), y).backward()
            t0 = time.perf_counter()
            dist.all_reduce(flag)
            t1 = time.perf_counter()
            dist.all_reduce(flag)
            second.append(time.perf_counter() - t1)
            first.append(t1 - t0)
            chained.append(chain(links))
            opt.step()
        if r:
            out["first"].append(first)
            out["second"].append(second)
            out["chained"].append(chained)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def probe_contention(link: str, world: int, rounds: int = 5) -> dict:
    """``comm_cpu_s_per_byte`` and ``sync_s`` measured beside compute (:func:`contention_worker`):
    medians over ranks and rounds of each round's difference."""
    from lowband.netem import parse_rate
    outs = _probe_ranks(link, world, ["probe-contention-worker", str(parse_rate(link)), str(rounds)])
    lost = [(o["beside"][i] - o["alone"][i]) / o["bytes_sent"] for o in outs for i in range(rounds)]
    sync = [(o["synced"][i] - o["unsynced"][i]) / o["syncs"] for o in outs for i in range(rounds)]
    return {"cpu_s_per_byte": max(0.0, statistics.median(lost)), "sync_s": max(0.0, statistics.median(sync)),
            "comm_within_loop": all(c <= b for o in outs for c, b in zip(o["comm_s"], o["beside"])),
            "ranks": outs}


#: independent runs of the step probe (fresh processes each) behind its costs: one run's chained
#: links vary from one process group to the next, as the idle probe's do
STEP_PROBES = 3


def probed_costs(pr: dict) -> dict:
    """The step probe's costs of a run's probe record, by today's rule (:func:`step_probe_costs`
    on the raw timings runs keep): the median over its ``STEP_PROBES`` runs of each cost (each
    chained link separately); older runs that hold one step probe have its costs taken as
    they are; runs without a step probe, none ({})."""
    runs = pr.get("step_syncs") or ([pr["step_sync"]] if "step_sync" in pr else [])
    each = [step_probe_costs(r["ranks"]) for r in runs]
    if not each:
        return {}
    out = {k: statistics.median(c[k] for c in each) for k in ("step_sync_s", "met_again_s")}
    if all("chained_s" in c for c in each):
        out["chained_s"] = [statistics.median(c["chained_s"][i] for c in each) for i in range(len(each[0]["chained_s"]))]
    return out


def probe_step_sync(link: str, world: int, model: str, rounds: int = 4, steps: int = 30) -> dict:
    """The step probe (:func:`step_sync_worker`) on every rank; its costs by :func:`step_probe_costs`."""
    outs = _probe_ranks(link, world, ["probe-step-sync-worker", model, str(rounds), str(steps)])
    return {**step_probe_costs(outs), "model": model, "ranks": outs}


def step_probe_costs(outs: list[dict]) -> dict:
    """``step_sync_s`` and ``met_again_s`` from the step probe's timings (every rank's time in
    the first and in the second all-reduce of every step): per round, the mean over ranks of
    each rank's median step; the median round. Medians, as the measured step is robust to
    load spikes (the median of block means), so the probe must not count the spikes either:
    the calls have a long tail, which puts the ranks' means far above their medians."""
    rounds = len(outs[0]["first"])

    def cost(pick) -> float:
        return statistics.median(statistics.mean(statistics.median(pick(o, i)) for o in outs) for i in range(rounds))
    costs = {"step_sync_s": cost(lambda o, i: o["first"][i]), "met_again_s": cost(lambda o, i: o["second"][i])}
    if "chained" in outs[0]:       # runs before the chain was probed have none
        links = len(outs[0]["chained"][0][0])
        costs["chained_s"] = [cost(lambda o, i: [c[k] for c in o["chained"][i]]) for k in range(links)]
    return costs


def _probe_ranks(link: str, world: int, argv: list[str]) -> list[dict]:
    """Run this file's ``argv`` probe worker on every rank of an emulated cluster; their JSON lines."""
    from lowband.netem import EmulatedCluster, parse_rate
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(HERE), "src"))
    with EmulatedCluster(world, parse_rate(link)) as c:
        procs = [subprocess.Popen(c.worker_prefix(r) + [sys.executable, __file__, *argv],
                                  env={**env, **c.worker_env(r), "RANK": str(r), "WORLD_SIZE": str(world),
                                       "MASTER_PORT": PROBE_PORT, "TORCH_CPP_LOG_LEVEL": "ERROR"},
                                  stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        return [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]


def probe_allreduce(link: str, world: int, size: int, iters: int) -> dict:
    outs = _probe_ranks(link, world, ["probe-worker", str(size), str(iters)])
    wall = statistics.median(max(o["walls"][i] for o in outs) for i in range(iters))
    cpu = statistics.median(statistics.mean(o["cpus"][i] for o in outs) for i in range(iters))
    return {"wall_s": wall, "cpu_s": cpu}


#: independent runs of the 64-byte all-reduce probe (fresh processes each) behind the latency
LATENCY_PROBES = 5


def latency_from_probes(medians: list[float], world: int) -> float:
    """Per-message latency from the median 64-byte all-reduce time of each of several probe runs:
    the median of them over the ring's 2(N-1) messages. On a small machine one run's median can
    be bimodal (a run lands in a low or a high mode, several times apart). The median of
    independent runs keeps a run's own outliers out (a median) and a minority of runs in the
    bad mode too; the least of them would be biased low where the runs agree (docs/perfmodel.md,
    the validation section)."""
    from lowband.comm.wire import allreduce_messages
    if not medians:
        raise ValueError("no latency probe runs")
    return statistics.median(medians) / allreduce_messages(world)


def latency_from_step_probe(met_again_s: float, world: int) -> float:
    """Per-message latency from the step probe's second 4-byte all-reduce (the one right behind
    another, between training steps: the CPUs awake, the ranks just met), over the ring's
    2(N-1) messages. The idle 64-byte probe has a high mode on small machines that no training
    step shows, so this is the report's default (``report --latency-from probe``: the idle
    probe)."""
    from lowband.comm.wire import allreduce_messages
    if world < 2:
        raise ValueError("a latency needs at least 2 workers")
    return met_again_s / allreduce_messages(world)


def probe(link: str, world: int, model: str = "cnn") -> dict:
    """Per-message latency, bulk efficiency and gloo's CPU seconds per byte on the emulated link;
    the meeting costs beside compute (15 ms matmul blocks, and a whole step of ``model``)."""
    from lowband.comm.wire import allreduce_bytes
    from lowband.netem import parse_rate
    smalls = [probe_allreduce(link, world, 64, 40) for _ in range(LATENCY_PROBES)]
    big_size = 4 << 20
    big = probe_allreduce(link, world, big_size, 4)
    wire = allreduce_bytes(big_size, world)
    return {"latency_s": latency_from_probes([r["wall_s"] for r in smalls], world),
            "efficiency": min(1.0, wire * 8 / big["wall_s"] / parse_rate(link)),
            "cpu_s_per_byte": big["cpu_s"] / wire, "smalls": smalls, "big": big,
            "contention": probe_contention(link, world),
            "step_syncs": [probe_step_sync(link, world, model) for _ in range(STEP_PROBES)]}


def cmd_run(args: argparse.Namespace) -> int:
    out = os.path.join(args.out, f"{args.link}-{args.workers}w")
    os.makedirs(out, exist_ok=True)
    meta = {"link": args.link, "workers": args.workers, "commit": git_commit(), "load_before": load_average(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "max_steps": args.max_steps}
    print(f"[{args.link} x{args.workers}] link probe", file=sys.stderr, flush=True)
    meta["probe"] = probe(args.link, args.workers, args.model)
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(HERE), "src"))
    rc = 0
    for spec in [a for a in args.algorithms.split(",") if a and a != "noop"]:
        pair = os.path.join(out, spec.replace(":", "-"))
        cmd = [sys.executable, "-m", "lowband.app.cli", "bench", "--algorithms", f"noop,{spec}",
               "--bandwidth", args.link, "--workers", str(args.workers), "--model", args.model,
               "--max-steps", str(args.max_steps), "--no-progress", "--out", pair]
        if args.rounds > 1:
            cmd += ["--repeat", str(args.rounds)]
        pair_meta = {**meta, "command": "lowband " + " ".join(cmd[3:]), "load_before": load_average()}
        digest = source_digest()
        rc = subprocess.run(cmd, env=env).returncode or rc
        pair_meta["load_after"] = load_average()
        pair_meta["source_digest"] = digest
        if source_digest() != digest:
            print(f"[{args.link} x{args.workers}] {spec}: src/ changed during the run; it is not reported",
                  file=sys.stderr, flush=True)
            pair_meta["source_changed"] = True
        with open(os.path.join(pair, "validation-run.json"), "w") as f:
            json.dump(pair_meta, f, indent=1)
    return rc


# -- report ----------------------------------------------------------------------------------

def steady_steps(run_dir: str, name: str, cycle: int) -> list[dict]:
    from lowband.app.metrics import read_jsonl
    steps = read_jsonl(os.path.join(run_dir, "steps.jsonl"))
    if any("warmup" in s for s in steps):
        warm = [i for i, s in enumerate(steps) if s.get("warmup")]
        skip = max(DEFAULT_SKIP, (warm[-1] + 1 + AFTER_WARMUP) if warm else 0)
    else:
        skip = SKIP.get(name, DEFAULT_SKIP)
    window = steps[skip:]
    keep = max(cycle, len(window) // cycle * cycle) if cycle > 1 else len(window)
    return window[-keep:]


def robust_step(steps: list[dict], cycle: int) -> float:
    """Median over consecutive blocks of ``cycle`` steps of each block's mean step time. Any
    ``cycle`` consecutive steps hold exactly one periodic step (a CP-SGD burst correction, a local-SGD
    average), so every block mean is a fair sample of the mean step, and the median discards
    blocks hit by a load spike of the shared machine."""
    blocks = [steps[i:i + cycle] for i in range(0, len(steps) - cycle + 1, cycle)] or [steps]
    return statistics.median(statistics.mean(s["step_s"] for s in b) for b in blocks)


def measured_tau(steps: list[dict]) -> tuple[float, int]:
    """Sync interval from the bytes per step: sync steps send the lazy layers' accumulators."""
    low = min(s["bytes_sent"] for s in steps)
    syncs = sum(1 for s in steps if s["bytes_sent"] > low * 1.001 + 64)
    return (len(steps) / syncs if syncs else float(len(steps))), syncs


def predict_pair(group_dir: str, profile, rows_out: list[dict], latency_s=None, burst: bool = True,
                 contention: bool = True, step_sync: bool = True, latency_from: str = "step") -> None:
    """Predict one ``noop,ALG`` pair. ``contention``: take gloo's CPU cost per byte and the
    per-collective synchronization cost from the probe beside compute (when the run has it),
    not the per-byte CPU time of an all-reduce with nothing else running. ``step_sync``: the
    least time of the collective that ends a step and the finiteness exchange's cost from the
    step probe (when the run has it); otherwise no step-end lag and the exchange at the
    network's all-reduce time."""
    from lowband.perf.model import MODELS, Cluster, estimate, pattern_steps
    from lowband.perf.network import Network
    from lowband.perf.plan import parse_algorithm
    from lowband.netem import paced, parse_rate

    with open(os.path.join(group_dir, "validation-run.json")) as f:
        meta = json.load(f)
    with open(os.path.join(group_dir, "results.json")) as f:
        results = json.load(f)
    rate, world = parse_rate(meta["link"]), meta["workers"]
    pr = meta["probe"]
    # the step probe's costs, recomputed from its raw timings by today's rule (runs keep them)
    probed = probed_costs(pr)
    if latency_s is None and latency_from == "step" and probed:
        latency_s = latency_from_step_probe(probed["met_again_s"], world)
    if latency_s is None and "smalls" in pr:   # the probe runs themselves: today's statistic
        latency_s = latency_from_probes([r["wall_s"] for r in pr["smalls"]], world)
    if latency_s is not None:
        pr = {**pr, "latency_s": latency_s}
    # the runs shaped with netem's default (paced) bucket
    burst_bytes = float(paced(rate).bucket_bytes) if burst else 0.0
    network = Network(rate, pr["latency_s"], pr["efficiency"], burst_bytes=burst_bytes)
    cpu_s_per_byte, sync_s = pr.get("cpu_s_per_byte", 0.0), 0.0
    if contention and "contention" in pr:
        cpu_s_per_byte = pr["contention"]["cpu_s_per_byte"]
        # what one synchronization costs beyond the 4-byte all-reduce the model already charges
        sync_s = max(0.0, pr["contention"]["sync_s"] - network.allreduce_s(4.0, world))
    costs = probed if step_sync else {}
    step_sync_s = costs.get("step_sync_s", 0.0)
    # the engine's finiteness exchange: a tiny all-reduce right behind another, as the probe timed it
    exchange_s = costs.get("met_again_s")
    # a hook's callback-launched all-reduces (PowerSGD's P and Q), as the probe's chain timed them
    chained_s = tuple(costs.get("chained_s", ()))
    rounds = pair_rounds(group_dir, results, meta["link"], world)
    for spec in [a for a in rounds[0] if a != "noop"]:
        name, _ = parse_algorithm(spec)
        if name not in MODELS:
            continue
        per_round = []
        for runs in rounds:     # each round: the noop run just before gives the compute scale
            if spec not in runs or "noop" not in runs:
                continue
            _, opts = parse_algorithm(spec)
            scale = robust_step(steady_steps(runs["noop"], "noop", 1), 1) / profile.compute_s
            extra = ""
            cycle = pattern_steps(name, opts)
            steps = steady_steps(runs[spec], name, cycle)
            if name == "lazy":
                tau, syncs = measured_tau(steps)
                opts["tau"] = tau
                extra = f"tau {tau:.1f} ({syncs} syncs in {len(steps)} steps)"
                cycle = pattern_steps(name, opts)
                steps = steady_steps(runs[spec], name, cycle)
            # lazy: tau varies within the run, so its blocks would not hold one sync each: plain mean
            robust = statistics.mean(s["step_s"] for s in steps) if name == "lazy" else robust_step(steps, cycle)
            est = estimate(profile, name, opts, Cluster(world, network, compute_scale=scale,
                                                        comm_cpu_s_per_byte=cpu_s_per_byte, sync_s=sync_s,
                                                        step_sync_s=step_sync_s, exchange_s=exchange_s,
                                                        chained_s=chained_s))
            # without the noop calibration: contention assumed = workers per core (at least 1)
            raw = estimate(profile, name, opts,
                           Cluster(world, network, compute_scale=max(1.0, world / (os.cpu_count() or 1))))
            per_round.append({"robust": robust, "mean": statistics.mean(s["step_s"] for s in steps),
                              "est": est, "raw": raw, "scale": scale, "note": extra,
                              "mb": statistics.mean(s["bytes_sent"] for s in steps) / 1e6})
        if not per_round:
            continue
        # interleaved rounds (noop, ALG, noop, ALG, ...), each an independent pair: the reported
        # numbers are the median round's by error (the mean of the two middle ones for an even
        # count), so one round hit by the shared machine's drift does not decide; every round's
        # own error is kept beside
        ranked = sorted(per_round, key=lambda x: x["est"].step_s / x["robust"])
        middle = ranked[(len(ranked) - 1) // 2: len(ranked) // 2 + 1]
        avg = lambda f: statistics.mean(f(x) for x in middle)   # noqa: E731
        measured, predicted = avg(lambda x: x["robust"]), avg(lambda x: x["est"].step_s)
        rows_out.append({
            "link": meta["link"], "workers": world, "algorithm": spec, "measured_ms": 1e3 * measured,
            "mean_ms": 1e3 * avg(lambda x: x["mean"]), "predicted_ms": 1e3 * predicted,
            "error": predicted / measured - 1,
            "round_errors": [x["est"].step_s / x["robust"] - 1 for x in per_round],
            "predicted_exposed_ms": 1e3 * avg(lambda x: x["est"].exposed_s),
            "predicted_mb": avg(lambda x: x["est"].bytes_sent) / 1e6,
            "measured_mb": avg(lambda x: x["mb"]), "scale": avg(lambda x: x["scale"]),
            "latency_us": 1e6 * pr["latency_s"], "efficiency": pr["efficiency"],
            "note": "; ".join(dict.fromkeys(x["note"] for x in middle if x["note"])),
            "cpu_ns_per_byte": 1e9 * cpu_s_per_byte, "sync_ms": 1e3 * sync_s, "step_sync_ms": 1e3 * step_sync_s,
            "exchange_ms": None if exchange_s is None else 1e3 * exchange_s,
            "chained_ms": [1e3 * x for x in chained_s],
            "contention": bool(contention and "contention" in pr), "burst_bytes": burst_bytes,
            "commit": meta["commit"], "load": f"{meta['load_before']} / {meta['load_after']}",
            "command": meta["command"], "date": meta["date"], "raw_ms": 1e3 * avg(lambda x: x["raw"].step_s)})


def pair_rounds(group_dir: str, results: dict, link: str, world: int) -> list[dict[str, str]]:
    """The run directories of one pair's bench, per round: ``[{algorithm: run_dir}, ...]``
    (one round for a bench without ``--repeat``; with it, the bench ran noop, ALG, noop, ALG,
    ... and ``all_runs`` lists every run with its round)."""
    repeated = bool(results.get("all_runs"))
    rows = results["all_runs"] if repeated else results["rows"]
    rounds: dict[int, dict[str, str]] = {}
    for row in rows:
        spec, r = row["algorithm"], int(row.get("repeat", 1))
        name = f"{link}-{world}w-{spec.replace(':', '-')}" + (f"-r{r}" if repeated else "")
        rounds.setdefault(r, {})[spec] = os.path.join(group_dir, "runs", name)
    return [rounds[r] for r in sorted(rounds)]


def _ms(value: Optional[float]) -> str:
    return "net" if value is None else f"{value:.2f}"


def render(rows: list[dict], profile_name: str, profile) -> str:
    within = sum(1 for r in rows if abs(r["error"]) <= TARGET)
    by_commit: dict[str, set] = {}
    for r in rows:
        by_commit.setdefault(r["commit"], set()).add(r["algorithm"])
    commits = "; ".join(f"{c} ({', '.join(sorted(a, key=lambda x: ALGO_ORDER.get(x.replace(':', '-'), 99)))})"
                        for c, a in sorted(by_commit.items()))
    example = f", e.g. `{rows[0]['command']}`" if rows else ""
    bursts = sorted({r.get("burst_bytes", 0.0) for r in rows})
    bucket = ("each link's tc tbf bucket (`netem.paced` of its rate: "
              + ", ".join(f"{b / 1024:.1f} KB" for b in bursts) + ")") if any(bursts) else \
        "a plain rate limit (no tbf bucket: `--no-burst`)"
    cost = ("measured beside compute: the contention probe" if any(r.get("contention") for r in rows)
            else "per-byte CPU of an all-reduce on an idle machine; no synchronization cost")
    stepsync = ("the least time of the collective that ends a step (step sync) and the cost of the engine's "
                "finiteness exchange (exchange), both from the step probe (two 4-byte all-reduces after each of the "
                "model's own training steps, each timed on every rank)"
                + (", and the least time of a hook's callback-launched all-reduces (chained: links 1 and 2 of the "
                   "probe's chain, as PyTorch's PowerSGD hook launches P's and Q's; runs before it have none)"
                   if any(r.get("chained_ms") for r in rows) else "")
                if any(r.get("step_sync_ms") for r in rows)
                else "no step-end meeting cost and the finiteness exchange at the network's all-reduce time "
                     "(`net`: runs without the step probe, or `--no-step-sync`)")
    lines = [
        f"Profile: `{profile_name}` ({profile.source}; {profile.machine}; {profile.date}).",
        f"Runs, by the commit each algorithm's pairs ran on: {commits}; "
        f"dates {', '.join(sorted({r['date'] for r in rows}))}; one `lowband bench --algorithms noop,ALG` per "
        f"algorithm, link and worker count{example}.",
        f"Regenerate: `python benchmarks/validate_perfmodel.py report --out DIR --profile {profile_name} --doc docs/results.md`.",
        "",
        f"**{within} of {len(rows)} predictions within {TARGET:.0%}.** Columns: measured = the run's steady steps "
        "(steps.jsonl, after the warm-up), as the median over consecutive blocks of one period of the step pattern "
        "(`pattern_steps`, knobs at the code's defaults: k for cpsgd's burst correction, localsgd's period, the diloco methods' sync_every, "
        "1 otherwise, cpsgd's default spread correction included) of each block's mean step (robust to load "
        "spikes; lazy: the plain mean); "
        "mean = the plain mean of the same steps; predicted = the model with the per-message latency (the step probe's second all-reduce "
        "over the ring's 2(N-1) messages, unless stated above), the link probe's efficiency, "
        f"gloo CPU cost per byte and synchronization cost per collective ({cost}), {stepsync}, {bucket}, and the compute scale "
        "from the noop run just before; with interleaved rounds (noop, ALG, noop, ALG, ...: `run --rounds`), each "
        "round predicted with its own noop run, the row is the round with the median error (the mean of the two "
        "middle rounds for an even count); error = predicted / measured - 1; rounds = every round's own error, in "
        "round order; load = load averages before / after the pair (the machine was shared).",
        "",
        "| link | workers | algorithm | measured ms | mean ms | predicted ms | error | predicted exposed ms | "
        "rounds | MB/step measured | MB/step predicted | compute scale | latency us | link eff. | gloo CPU ns/B | "
        "sync ms | step sync ms | exchange ms | chained ms | load | note |",
        "|" + "---|" * 21,
    ]
    for r in rows:
        flag = "" if abs(r["error"]) <= TARGET else " **miss**"
        lines.append(
            f"| {r['link']} | {r['workers']} | {r['algorithm']} | {r['measured_ms']:.1f} | {r['mean_ms']:.1f} | "
            f"{r['predicted_ms']:.1f} | {r['error']:+.1%}{flag} | {r['predicted_exposed_ms']:.1f} | "
            f"{', '.join(f'{e:+.0%}' for e in r.get('round_errors', [r['error']]))} | "
            f"{r['measured_mb']:.3f} | {r['predicted_mb']:.3f} | {r['scale']:.2f} | {r['latency_us']:.0f} | "
            f"{r['efficiency']:.2f} | {r['cpu_ns_per_byte']:.2f} | {r.get('sync_ms', 0.0):.2f} | {r.get('step_sync_ms', 0.0):.2f} | {_ms(r.get('exchange_ms'))} | "
            f"{' / '.join(f'{x:.2f}' for x in r.get('chained_ms', [])) or '-'} | {r['load'].split(' / ')[0].split()[0]} / "
            f"{r['load'].split(' / ')[1].split()[0]} | {r['note']} |")
    return "\n".join(lines)


def cmd_report(args: argparse.Namespace) -> int:
    from lowband.perf.profile import load_profile
    from lowband.perf.network import parse_latency
    from lowband.app.report import update_doc

    profile = load_profile(args.profile)
    rows: list[dict] = []
    order = {"1gbit": 0, "200mbit": 1, "50mbit": 2}
    groups = sorted(glob.glob(os.path.join(args.out, "*-*w")),
                    key=lambda d: (order.get(os.path.basename(d).rsplit("-", 1)[0], 9), d))
    for g in groups:
        for pair in sorted(glob.glob(os.path.join(g, "*")), key=lambda d: ALGO_ORDER.get(os.path.basename(d), 99)):
            if os.path.exists(os.path.join(pair, "validation-run.json")) and os.path.exists(os.path.join(pair, "results.json")):
                with open(os.path.join(pair, "validation-run.json")) as f:
                    if json.load(f).get("source_changed"):
                        print(f"{pair}: src/ changed during its run; skipped", file=sys.stderr)
                        continue
                predict_pair(pair, profile, rows, None if args.latency is None else parse_latency(args.latency),
                             burst=not args.no_burst, contention=not args.idle_cpu_probe,
                             step_sync=not args.no_step_sync, latency_from=args.latency_from)
    if not rows:
        print(f"no completed runs under {args.out}", file=sys.stderr)
        return 2
    # a run recorded its --out in its command: cite it under DIR, the directory this report was
    # given (as the "Regenerate" line does), not the machine's path where the runs were kept
    here = os.path.abspath(args.out)
    for r in rows:
        r["command"] = r["command"].replace(here, "DIR").replace(os.path.normpath(args.out), "DIR")
    body = render(rows, args.profile, profile)
    if args.latency_from == "probe" and args.latency is None:
        body = ("Latency: the idle 64-byte probe's runs over the ring's messages "
                "(`report --latency-from probe`), not the step probe's warm all-reduce.\n\n" + body)
    print(body)
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if args.doc:
        update_doc(args.doc, body, args.section)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="probe the link and bench every algorithm (a timing run)")
    r.add_argument("--link", required=True, help="tc rate, e.g. 1gbit")
    r.add_argument("--workers", type=int, required=True)
    r.add_argument("--out", default="runs/validate")
    r.add_argument("--model", default="cnn")
    r.add_argument("--max-steps", type=int, default=40)
    r.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of each noop,ALG pair (bench --repeat); the report takes the round with "
                        "the median error, so one pair hit by the machine's drift does not decide (default: %(default)s)")
    r.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p = sub.add_parser("report", help="predict every run and compare")
    p.add_argument("--out", default="runs/validate")
    p.add_argument("--profile", default="cnn-2core")
    p.add_argument("--doc", default=None)
    p.add_argument("--section", default="perfmodel-validation")
    p.add_argument("--latency", default=None, help="use this per-message latency (e.g. 100us) instead of the probe's")
    p.add_argument("--latency-from", choices=("probe", "step"), default="step",
                   help="probe: the per-message latency of the idle 64-byte all-reduce (median of five runs); "
                        "step: of the step probe's second all-reduce between training steps (runs without a "
                        "step probe keep the idle one) (default: %(default)s)")
    p.add_argument("--idle-cpu-probe", action="store_true",
                   help="charge gloo's CPU per byte as an all-reduce on an idle machine costs, and no synchronization "
                        "cost (the model before 2026-12-02's contention probe)")
    p.add_argument("--no-step-sync", action="store_true",
                   help="predict without the step probe: no step-end meeting cost, and the finiteness exchange "
                        "at the network's all-reduce time")
    p.add_argument("--no-burst", action="store_true",
                   help="predict with a plain rate limit, without the links' tbf bucket (the model before 2026-12-02)")
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "probe-worker":
        probe_worker(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    if argv is None and len(sys.argv) == 5 and sys.argv[1] == "probe-step-sync-worker":
        step_sync_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "probe-contention-worker":
        contention_worker(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    args = ap.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
