"""A model's cost profile: what one worker spends on one step, measured or written by hand.

A profile is a small JSON document (``FORMAT``):

* ``params``: every trainable parameter in **registration order** (the order lowband's
  algorithms index them and ``plan_buckets`` buckets them): name, owning module, shape,
  element size, whether the module is a normalisation layer, whether it is an embedding table
  ``cp-diloco``'s ``sparse_rows`` averages by rows (``table``: an ``nn.Embedding``/
  ``nn.EmbeddingBag`` weight no other module holds) and, for a weight several modules hold
  directly (tied), all of them (``owners``); the last two are absent from older profiles
  (no tables, no ties);
* ``ready_order``: parameter indices in the order their gradients became ready in backward,
  and ``backward_s``: for each entry of ``ready_order``, the backward time from the previous
  ready gradient (the first: from the start of backward) to this one; ``backward_tail_s`` is
  what autograd spends after the last gradient is ready;
* ``forward_s`` (forward plus loss) and ``optimizer_s`` (one ``optimizer.step()``) at
  ``batch_size`` samples per worker; ``fused_update_s`` (optional): CP-SGD's global SGD step
  plus its look-ahead tentative step as the one native pass lowband runs on CPU with plain SGD
  (``FusedSGDStep``), where it was measured; ``powersgd_hook_s`` (optional): the compute of
  PyTorch's ``powerSGD_hook`` on the model's matrices per step, by rank, as three phases
  (before the P all-reduce: error feedback and P = MQ; between the all-reduces: orthogonalise
  P and Q = M^T P; after: M = PQ^T and the new error), measured with the hook's own ops
  (:func:`measure_powersgd_hook`); ``engine_overhead_s`` (optional): per algorithm (the
  peers: DDP's three, torchft's DiLoCo), the seconds per step its engine adds to a
  compute-only step in one process with no peer (:func:`measure_engine_overhead`);
  ``pipeline_cpu_s`` (optional): per lowband algorithm that compresses on its pipeline's
  thread (``compressed``, ``cpsgd``), the CPU seconds per step that thread spends inside its
  jobs (codec calls, the collective's call, flags, buffers: ``Pipeline.cpu_s``),
  in the same process and loop, warm-up 0;
* ``codecs``: per compressor, encode-with-error-feedback and decode throughput (GB/s of fp32
  input, i.e. ``4 * numel / seconds``) plus a fixed cost per call (per segment of a bucket),
  and the payload size as a ratio of the fp32 bytes plus a fixed number of bytes per call.
  Codecs with native kernels (2-bit, 1-bit) are measured through the bucket-level codec the
  collectives run (one call per bucket, so a segment's "call" is its share of that call); the
  others per tensor (:func:`measure_codec`);
* ``codec_shares_compute``: whether codec work competes with forward/backward for the same
  processor (true on CPU workers: lowband's background compression thread runs on the
  worker's core; false where the codec has a processor of its own);
* ``source``, ``machine``, ``date``: where the numbers come from.

``lowband profile`` measures one on this machine (:func:`measure`); the hand-written profiles
of hardware we do not have live in ``lowband/perf/profiles/`` (see :mod:`.resnet50`).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

# the C heap's mode a profile measures under: the workers' (:mod:`lowband.runtime.memory`)
from ..runtime.memory import DEFAULT_MODE as MALLOC_DEFAULT

FORMAT = "lowband-profile/1"
PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


class ProfileError(ValueError):
    """A profile file that cannot be used (missing, malformed, inconsistent)."""


@dataclass
class ParamInfo:
    name: str
    module: str
    shape: list[int]
    element_size: int = 4
    norm: bool = False
    #: an embedding table whose rows ``cp-diloco``'s ``sparse_rows`` averages over their
    #: trainers (:func:`lowband.algorithms.sparse_rows.row_tables`): its ``shape[0]`` rows'
    #: flags travel packed in the message that carries it
    table: bool = False
    #: every module that holds the parameter directly, in the model's module order, where
    #: more than one does (a tied weight); empty: ``module`` alone. What a ``lazy_layers``
    #: spec of module names must cover to select it (:func:`lowband.perf.model.lazy_selection`)
    owners: list[str] = field(default_factory=list)

    @property
    def holders(self) -> list[str]:
        """The modules that hold the parameter directly."""
        return list(self.owners) or [self.module]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


class _SizedParam:
    """What :func:`lowband.algorithms.buckets.plan_buckets` reads from a parameter."""

    def __init__(self, p: ParamInfo):
        self._p = p
        self.dtype = {2: "float16", 4: "float32", 8: "float64"}.get(p.element_size, str(p.element_size))

    def numel(self) -> int:
        return self._p.numel

    def element_size(self) -> int:
        return self._p.element_size

    def dim(self) -> int:
        return len(self._p.shape)


@dataclass
class CodecInfo:
    """Cost of one compressor with error feedback; times scale as ``call_s + bytes / (gbps*1e9)``."""

    encode_gbps: float
    decode_gbps: float
    encode_call_s: float = 0.0
    decode_call_s: float = 0.0
    payload_ratio: float = 1.0
    payload_fixed_bytes: float = 0.0
    note: str = ""

    def encode_s(self, nbytes: float, calls: int = 1) -> float:
        return calls * self.encode_call_s + nbytes / (self.encode_gbps * 1e9)

    def decode_s(self, nbytes: float, calls: int = 1) -> float:
        return calls * self.decode_call_s + nbytes / (self.decode_gbps * 1e9)

    def payload(self, nbytes: float, calls: int = 1) -> float:
        return self.payload_ratio * nbytes + calls * self.payload_fixed_bytes


@dataclass
class Profile:
    model: str
    batch_size: int
    forward_s: float
    optimizer_s: float
    params: list[ParamInfo]
    ready_order: list[int]
    backward_s: list[float]
    backward_tail_s: float = 0.0
    buffer_bytes: int = 0
    fused_update_s: Optional[float] = None
    powersgd_hook_s: dict[str, list[float]] = field(default_factory=dict)
    engine_overhead_s: dict[str, float] = field(default_factory=dict)
    pipeline_cpu_s: dict[str, float] = field(default_factory=dict)
    codecs: dict[str, CodecInfo] = field(default_factory=dict)
    codec_shares_compute: bool = True
    source: str = ""
    machine: str = ""
    date: str = ""
    notes: list[str] = field(default_factory=list)
    #: the lazy update's default lazy set on this model, as ``LazyPlan`` chose it from the
    #: forward order while profiling: ``{"parameters": [names], "probe": [names]}``. None (a
    #: hand-written profile): ``perf.model.lazy_split`` applies PCNN's rule in registration order
    lazy_default: Optional[dict[str, list[str]]] = None

    # -- derived ------------------------------------------------------------------------
    @property
    def backward_total_s(self) -> float:
        return sum(self.backward_s) + self.backward_tail_s

    @property
    def compute_s(self) -> float:
        """One step with no communication: forward + backward + optimizer."""
        return self.forward_s + self.backward_total_s + self.optimizer_s

    @property
    def gradient_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def sized_params(self) -> list[_SizedParam]:
        return [_SizedParam(p) for p in self.params]

    def codec(self, name: str) -> CodecInfo:
        if name not in self.codecs:
            have = ", ".join(sorted(self.codecs)) or "none"
            raise ProfileError(f"profile of {self.model!r} has no measurement of codec {name!r} (it has: {have}); "
                               f"run `lowband profile` on a machine that has it, or add it to the profile")
        return self.codecs[name]

    def scaled(self, batch_size: int) -> "Profile":
        """The same profile at another per-worker batch size, forward and backward scaled
        linearly (an assumption: per-sample cost constant; the optimizer does not scale)."""
        if batch_size == self.batch_size:
            return self
        f = batch_size / self.batch_size
        return dataclasses.replace(self, batch_size=batch_size, forward_s=self.forward_s * f,
                                   backward_s=[b * f for b in self.backward_s],
                                   backward_tail_s=self.backward_tail_s * f,
                                   notes=self.notes + [f"compute scaled linearly from batch {self.batch_size} to {batch_size}"])

    # -- I/O ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"format": FORMAT, **d}

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> "Profile":
        if d.get("format") != FORMAT:
            raise ProfileError(f"{where}: not a lowband profile (format {d.get('format')!r}, expected {FORMAT!r})")
        try:
            d = {k: v for k, v in d.items() if k != "format"}
            d["params"] = [ParamInfo(**p) for p in d["params"]]
            d["codecs"] = {k: CodecInfo(**v) for k, v in d.get("codecs", {}).items()}
            prof = cls(**d)
        except (KeyError, TypeError) as e:
            raise ProfileError(f"{where}: malformed profile ({e})") from None
        prof.check(where)
        return prof

    def check(self, where: str = "profile") -> None:
        n = len(self.params)
        if sorted(self.ready_order) != list(range(n)):
            raise ProfileError(f"{where}: ready_order must be a permutation of the {n} parameters")
        if len(self.backward_s) != n:
            raise ProfileError(f"{where}: backward_s has {len(self.backward_s)} entries for {n} parameters")
        if self.batch_size < 1 or min([self.forward_s, self.optimizer_s, self.backward_tail_s, *self.backward_s,
                                       self.fused_update_s or 0.0]) < 0:
            raise ProfileError(f"{where}: times must be >= 0 and batch_size >= 1")
        for r, phases in self.powersgd_hook_s.items():
            if not (str(r).isdigit() and int(r) >= 1 and len(phases) == 3 and min(phases) >= 0):
                raise ProfileError(f"{where}: powersgd_hook_s[{r!r}] must be three times >= 0 for a rank >= 1")
        for kind in ("engine_overhead_s", "pipeline_cpu_s"):
            for name, x in getattr(self, kind).items():
                if not (isinstance(x, (int, float)) and x >= 0):
                    raise ProfileError(f"{where}: {kind}[{name!r}] must be seconds >= 0")
        if self.lazy_default is not None:
            names = {p.name for p in self.params}
            lists = [self.lazy_default.get(k) if isinstance(self.lazy_default, dict) else None
                     for k in ("parameters", "probe")]
            if not all(isinstance(x, list) and set(x) <= names for x in lists):
                raise ProfileError(f"{where}: lazy_default must be {{\"parameters\": [...], \"probe\": [...]}} "
                                   f"naming parameters of the profile")
        for p in self.params:
            if p.table and len(p.shape) != 2:
                raise ProfileError(f"{where}: parameter {p.name!r} is marked an embedding table but is not 2-D")
            if p.owners and p.module not in p.owners:
                raise ProfileError(f"{where}: parameter {p.name!r}'s owners must include its module {p.module!r}")
        for name, c in self.codecs.items():
            if not (c.encode_gbps > 0 and c.decode_gbps > 0):
                raise ProfileError(f"{where}: codec {name!r} needs positive encode_gbps and decode_gbps")


def resolve_profile_path(name_or_path: str) -> str:
    """A file path, or the name of a bundled profile (``resnet50-v100`` -> profiles/resnet50-v100.json)."""
    if os.path.exists(name_or_path):
        return name_or_path
    bundled = os.path.join(PROFILE_DIR, name_or_path if name_or_path.endswith(".json") else name_or_path + ".json")
    if os.path.exists(bundled):
        return bundled
    names = ", ".join(sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json")))
    raise ProfileError(f"profile {name_or_path!r} is neither a file nor a bundled profile ({names})")


def load_profile(name_or_path: str) -> Profile:
    path = resolve_profile_path(name_or_path)
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not JSON ({e})") from None
    return Profile.from_dict(data, path)


# -- measuring ---------------------------------------------------------------------------

def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def measure_compute(model_name: str, batch_size: int, reps: int = 20, warmup: int = 5, threads: int = 1,
                    lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 1e-4) -> dict[str, Any]:
    """Forward, per-parameter backward (gradient-ready hooks) and optimizer times of one
    worker, with the optimizer lowband's runs use (SGD with momentum and weight decay), and the
    lazy update's default lazy set (from the order in which modules first run in forward)."""
    import torch
    from ..algorithms.lazy import ForwardOrder, LazyPlan, input_side_layers
    from ..app import tasks
    from ..app.models import make_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = make_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = param_infos(model)
    stamps: list[float] = [0.0] * len(named)
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, time.perf_counter()))
             for i, (_, p) in enumerate(named)]
    x, y = example_batch(model_name, model, batch_size)
    recorder = ForwardOrder(input_side_layers(model))     # one untimed forward: the lazy update's order
    with torch.no_grad():
        model(x)
    recorder.close()
    fwd, bwd_end, opt_t, ready = [], [], [], []
    for r in range(warmup + reps):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = tasks.loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if r >= warmup:
            fwd.append(t1 - t0)
            bwd_end.append(t2 - t1)
            opt_t.append(t3 - t2)
            ready.append([s - t1 for s in stamps])
    for h in hooks:
        h.remove()
    fused_s = _fused_update_s(opt, [p for _, p in named], reps)
    med_ready = [_median([row[i] for row in ready]) for i in range(len(named))]
    order = sorted(range(len(named)), key=lambda i: med_ready[i])
    backward_s, prev = [], 0.0
    for i in order:
        backward_s.append(max(0.0, med_ready[i] - prev))
        prev = max(prev, med_ready[i])
    buffers = sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point())
    plan = LazyPlan.build(model, [p for _, p in named], recorder.order, None)
    lazy_default = {"parameters": [named[i][0] for i in plan.indices],
                    "probe": [named[i][0] for i in plan.slices[-1]] if plan.slices else []}
    return {"params": params, "ready_order": order, "backward_s": backward_s, "lazy_default": lazy_default,
            "backward_tail_s": max(0.0, _median(bwd_end) - prev), "forward_s": _median(fwd),
            "optimizer_s": _median(opt_t), "buffer_bytes": int(buffers), "fused_update_s": fused_s}


def param_infos(model) -> list[ParamInfo]:
    """The profile's entries of ``model``'s trainable parameters, in registration order: the
    module that holds each (the last one in module order where several do, and then all of
    them as ``owners``), whether that module is a normalisation layer, and whether the
    parameter is an embedding table ``sparse_rows`` averages by rows (the algorithm's own
    rule, :func:`lowband.algorithms.sparse_rows.row_tables`)."""
    from ..algorithms.lazy import NORM_LAYERS, holders
    from ..algorithms.sparse_rows import row_tables
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    held_by = holders(model)
    tables = set(row_tables(model, [p for _, p in named], list(range(len(named)))))
    out = []
    for i, (n, p) in enumerate(named):
        held = held_by[id(p)]
        out.append(ParamInfo(name=n, module=held[-1][0], shape=list(p.shape), element_size=p.element_size(),
                             norm=isinstance(held[-1][1], NORM_LAYERS), table=i in tables,
                             owners=[m for m, _ in held] if len(held) > 1 else []))
    return out


def example_batch(model_name: str, model, batch_size: int):
    """A random batch of the shape ``model_name`` trains on: Fashion-MNIST images and classes,
    or for a language model byte ids over its whole context and the next bytes."""
    import torch
    from ..app import tasks
    from ..app.models import BYTE_VOCAB
    if tasks.task_of(model_name) == "lm":
        ids = torch.randint(0, BYTE_VOCAB, (batch_size, model.context + 1))
        return ids[:, :-1], ids[:, 1:]
    return torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))


def _fused_update_s(opt, params: list, reps: int) -> Optional[float]:
    """Median time of CP-SGD's fused global step + tentative step (``FusedSGDStep``) on
    ``params`` with optimizer ``opt``; None where lowband would not use it (not plain SGD,
    no native library...)."""
    import torch
    from ..optim.tentative import FusedSGDStep
    if FusedSGDStep.unavailable(opt, params) is not None:
        return None
    fused = FusedSGDStep(opt, params)
    W = [p.detach().clone() for p in params]
    G = [torch.randn_like(p) * 1e-3 for p in params]
    g = [torch.randn_like(p) * 1e-3 for p in params]
    w = [torch.empty_like(p) for p in params]
    return _time(lambda: fused.step(W, G, g, w), max(reps, 20))   # (moves opt's momentum: run last)


def _time(fn, reps: int) -> float:
    fn()   # warm-up (allocations, first-touch page faults)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _median(times)


#: ranks at which ``lowband profile`` measures PowerSGD's hook (``ddp-powersgd``'s default is 2)
POWERSGD_RANKS = (1, 2, 4)
#: the peers whose per-step engine overhead ``lowband profile`` measures: their machinery
#: (DDP's Reducer and hooks, torchft's manager and optimizer wrapper) is not among the tasks
#: the performance model builds, unlike lowband's own algorithms' buckets and codecs
MEASURED_PEERS = ("ddp", "ddp-fp16", "ddp-powersgd", "diloco", "streaming-diloco")
#: lowband's algorithms whose pipeline thread's CPU the profile measures (``pipeline_cpu_s``)
MEASURED_PIPELINES = ("compressed", "cpsgd")


def measure_engine_overhead(model_name: str, batch_size: int, algorithms: Sequence[str] = MEASURED_PEERS,
                            steps: int = 40, rounds: int = 5, warmup: int = 15, timeout_s: float = 900.0,
                            malloc: str = MALLOC_DEFAULT, pipelines: Sequence[str] = MEASURED_PIPELINES,
                            ) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`engine_overhead_here` in a fresh Python process, which leaves with ``os._exit``:
    tearing down DDP's Reducer and its gloo group after ``destroy_process_group`` can hang
    in ``~ProcessGroupGloo`` (seen in the test suite), and a child process needs no tear-down.
    Returns (engine overhead per peer, pipeline CPU per step of each of ``pipelines``). A
    child that fails or times out gives ``({}, {})`` (no measurement), with its error on
    stderr. The child's C heap runs in mode ``malloc`` (:mod:`lowband.runtime.memory`), as the workers'."""
    import subprocess
    import sys
    code = ("import json, os, sys\n"
            "from lowband.runtime import memory\n"
            f"memory.configure({malloc!r})\n"
            "from lowband.perf.profile import engine_overhead_here\n"
            "def report(r):\n"
            "    sys.stdout.write('\\nENGINE-OVERHEAD ' + json.dumps(r) + '\\n'); sys.stdout.flush(); os._exit(0)\n"
            f"engine_overhead_here({model_name!r}, {batch_size}, {list(algorithms)!r}, {steps}, {rounds}, {warmup}, "
            f"report, {list(pipelines)!r})\n")
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        print(f"lowband profile: engine overhead not measured (timed out after {timeout_s:.0f} s)", file=sys.stderr)
        return {}, {}
    for line in proc.stdout.splitlines():
        if line.startswith("ENGINE-OVERHEAD "):
            got = json.loads(line[len("ENGINE-OVERHEAD "):])
            return ({k: float(v) for k, v in got["engine"].items()},
                    {k: float(v) for k, v in got["pipeline"].items()})
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    print(f"lowband profile: engine overhead not measured (exit {proc.returncode}: {tail})", file=sys.stderr)
    return {}, {}


def engine_overhead_here(model_name: str, batch_size: int, algorithms: Sequence[str], steps: int, rounds: int,
                         warmup: int, report: Callable[[dict[str, dict[str, float]]], None],
                         pipelines: Sequence[str] = ()) -> None:
    """Seconds per step each algorithm's engine adds to a compute-only (``noop``) step, in
    this fresh process on a 1-rank gloo group (no peer, no network): for the DDP peers, DDP's
    Reducer (gradient copies into its buckets, autograd hooks, futures, the copy back) and the
    communication hook's own work (PowerSGD's matmuls included); for DiLoCo, torchft's. Each
    is lowband's engine as `lowband train` builds it; all of them and a ``noop`` engine take
    their steps in turn, ``warmup`` steps (past ``start_powerSGD_iter``) then ``steps *
    rounds`` measured; each median step (which leaves out DiLoCo's periodic syncs, charged by
    the model itself) minus noop's, at least 0, goes to ``report`` (as ``"engine"``) before
    anything is torn down (``report`` leaves the process: see :func:`measure_engine_overhead`).
    Each of ``pipelines`` (lowband's compressing algorithms, warm-up 0) steps in the same loop;
    its pipeline thread's CPU inside jobs per measured step (``Pipeline.cpu_s``) goes to
    ``report`` as ``"pipeline"``."""
    import torch
    import torch.distributed as dist
    import lowband
    from ..app import tasks
    from ..app.models import make_model

    def build(name: str, **options):
        torch.manual_seed(0)
        model = make_model(model_name)
        # lr 0: the same arithmetic per step as any learning rate, but the weights stay put.
        # Hundreds of steps on one random batch at lr 0.05 diverged on one machine (a NaN at
        # step 141: the guard stopped the measurement), and timing must not depend on values.
        opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=1e-4)
        return opt, lowband.distribute(model, opt, name, **options), example_batch(model_name, model, batch_size)

    def step(run) -> float:
        opt, engine, (x, y) = run
        t0 = time.perf_counter()
        opt.zero_grad()
        tasks.loss(engine.module(x), y).backward()
        engine.step()
        return time.perf_counter() - t0

    from ..algorithms import ALGORITHMS
    # peers whose optional extra is missing here (torchft) are left out
    algorithms = [a for a in algorithms if getattr(ALGORITHMS[a], "unavailable", lambda: None)() is None]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # every engine built first, then stepped in turn, step by step: the machine's drift
    # (other load, clock changes) hits every algorithm alike
    runs = {"noop": build("noop")}
    for a in algorithms:
        try:
            runs[a] = build(a)
        except ValueError:      # the peer refuses this model (ddp-powersgd: more than one bucket)
            continue
    pipes = {a: build(a, warmup_steps=0) for a in pipelines}

    def pipeline_cpu(a: str) -> float:
        return pipes[a][1].bound.reducer.pipeline.cpu_s

    times: dict[str, list[float]] = {a: [] for a in runs}
    cpu0: dict[str, float] = {}
    for i in range(warmup + steps * rounds):
        if i == warmup:
            cpu0 = {a: pipeline_cpu(a) for a in pipes}
        for a, run in runs.items():
            dt = step(run)
            if i >= warmup:
                times[a].append(dt)
        for run in pipes.values():
            step(run)
    base = _median(times["noop"])
    report({"engine": {a: max(0.0, _median(times[a]) - base) for a in runs if a != "noop"},
            "pipeline": {a: (pipeline_cpu(a) - c) / (steps * rounds) for a, c in cpu0.items()}})


def measure_powersgd_hook(shapes: Sequence[Sequence[int]], rank: int, reps: int = 10,
                          min_compression_rate: float = 2.0) -> list[float]:
    """Seconds per step of PyTorch's ``powerSGD_hook`` compute on one bucket of parameters
    ``shapes``, in its three phases (see the module docstring), with its defaults (warm start,
    error feedback, no batching of same-shape matrices). The ops are the hook's own, with its
    ``_orthogonalize``; its all-reduces are not run (the model charges them as messages)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

    gen = torch.Generator().manual_seed(0)
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    bucket = torch.randn(sum(sizes), generator=gen) * 1e-3
    error = torch.zeros_like(bucket)
    views = list(torch.split(bucket, sizes))
    matrices, rest = [], []
    for v, s in zip(views, shapes):
        if len(s) < 2:
            rest.append(v)
            continue
        m = v.view(s[0], -1)
        r = min(m.shape[0], m.shape[1], rank)
        (matrices if _should_compress(m.shape[0], m.shape[1], r, min_compression_rate)[0] else rest).append(m)
    ranks = [min(m.shape[0], m.shape[1], rank) for m in matrices]
    ps = [torch.empty(1, m.shape[0], r) for m, r in zip(matrices, ranks)]
    qs = [torch.randn(1, m.shape[1], r, generator=gen) for m, r in zip(matrices, ranks)]
    batched = [m.unsqueeze(0) for m in matrices]
    state: dict = {}

    def phase_p():
        bucket.add_(error)
        state["copy"] = bucket.detach().clone()
        state["rest"] = torch.cat([t.reshape(-1) for t in rest]) if rest else torch.tensor([])
        for q in qs:
            _orthogonalize(q, 0)
        for m, q, p in zip(batched, qs, ps):
            torch.bmm(m, q, out=p)

    def phase_q():
        for p in ps:
            _orthogonalize(p, 0)
        for m, p, q in zip(batched, ps, qs):
            torch.bmm(m.transpose(1, 2), p, out=q)

    def phase_m():
        off = 0
        for t in rest:
            t.copy_(state["rest"][off:off + t.numel()].view_as(t))
            off += t.numel()
        for p, q, m in zip(ps, qs, batched):
            torch.bmm(p, q.transpose(1, 2), out=m)
        error.copy_(state["copy"] - bucket)

    grad = bucket.clone()
    times: list[list[float]] = [[], [], []]
    for i in range(reps + 1):            # the first is a warm-up (allocations, first touch)
        bucket.copy_(grad)               # every repetition starts from the same gradient (untimed)
        for k, fn in enumerate((phase_p, phase_q, phase_m)):
            t0 = time.perf_counter()
            fn()
            if i:
                times[k].append(time.perf_counter() - t0)
    return [_median(t) for t in times]


#: options for codecs that need one to be built at all (the ratio of lowband's byte benchmark)
PROFILE_CODEC_OPTIONS: dict[str, dict[str, Any]] = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}}


def measure_codec(name: str, sizes: Sequence[int], reps: int = 5) -> CodecInfo:
    """Encode (with error feedback) and decode costs of one compressor, as lowband's algorithms
    build it (``build_compressor``), on the model's parameter sizes as separate segments and on
    one flat tensor of the same total size: the difference gives the fixed cost per segment,
    the flat run the throughput.

    Codecs with native kernels (2-bit, 1-bit) are timed through the bucket-level codec the
    collectives run (:class:`lowband.codecs.bucket.BucketCodec`, all-gather layout: one
    call per bucket). The others are timed per tensor (``compress`` / ``decompress``): the
    bucket codec's torch fallback makes the same calls per segment, and the model also uses
    ``fp16`` and ``powersgd`` to approximate DDP's own hooks, which cast and multiply per tensor
    without lowband's layout."""
    import torch
    from ..codecs import build_compressor

    options = PROFILE_CODEC_OPTIONS.get(name, {})
    total = int(sum(sizes))
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(total, generator=gen) * 1e-3
    codec = build_compressor(name, options)
    bucket_level = codec.kernel_kind is not None
    if bucket_level:
        enc_seg, dec_seg = _time_bucket_codec(codec, flat, list(sizes), reps)
        enc_flat, dec_flat = _time_bucket_codec(codec, flat, [total], reps)
    else:
        enc_seg, dec_seg = _time_codec_per_tensor(name, options, flat, list(sizes), reps)
        enc_flat, dec_flat = _time_codec_per_tensor(name, options, flat, [total], reps)
    n = len(sizes)
    enc_call = max(0.0, (enc_seg - enc_flat) / (n - 1)) if n > 1 else 0.0
    dec_call = max(0.0, (dec_seg - dec_flat) / (n - 1)) if n > 1 else 0.0
    nbytes = 4.0 * total
    big, small = max(total, 1 << 20), 1024
    p_big, p_small = codec.payload_nbytes(big), codec.payload_nbytes(small)
    ratio = (p_big - p_small) / (4.0 * (big - small))
    how = "bucket-level codec (native kernels)" if bucket_level else "per tensor"
    return CodecInfo(encode_gbps=nbytes / max(1e-9, enc_flat - enc_call) / 1e9,
                     decode_gbps=nbytes / max(1e-9, dec_flat - dec_call) / 1e9,
                     encode_call_s=enc_call, decode_call_s=dec_call, payload_ratio=ratio,
                     payload_fixed_bytes=max(0.0, p_small - ratio * 4 * small),
                     note=f"build_compressor({name!r}, {options}) with error feedback, {how}")


def _time_bucket_codec(codec, flat, sizes: list[int], reps: int) -> tuple[float, float]:
    """(encode, decode) seconds of one all-gather-layout bucket of segments ``sizes`` with
    ``codec`` (the residual is the bucket's own, as in the collectives)."""
    import torch
    from ..comm.plans import make_plan
    plan = make_plan("allgather", 1, 0, [(f"s{i}", int(n)) for i, n in enumerate(sizes)], codec)
    send = torch.zeros(plan.layout.section, dtype=torch.uint8)
    e = torch.zeros(plan.numel, dtype=torch.float32)
    out = torch.empty(plan.numel, dtype=torch.float32)
    t_enc = _time(lambda: plan.worker.encode(flat, e, send, None), reps)
    t_dec = _time(lambda: plan.worker.decode(send, 1, plan.dec, plan.dec_table, out, True, 1.0), reps)
    return t_enc, t_dec


def _time_codec_per_tensor(name: str, options: dict, flat, sizes: list[int], reps: int) -> tuple[float, float]:
    """(encode, decode) seconds of ``compress`` / ``decompress`` of each of ``sizes``' tensors."""
    import torch
    from ..codecs import ErrorFeedback, build_compressor
    tensors = list(torch.split(flat, sizes))
    codec = ErrorFeedback(build_compressor(name, options))

    def encode():
        return [codec.compress(t, f"s{i}") for i, t in enumerate(tensors)]

    encoded = encode()
    t_enc = _time(encode, reps)
    t_dec = _time(lambda: [codec.decompress(pl, ctx) for pl, ctx in encoded], reps)
    return t_enc, t_dec


def measure(model_name: str, batch_size: int = 64, codecs: Optional[Sequence[str]] = None, reps: int = 20,
            threads: int = 1, progress=None, malloc: str = MALLOC_DEFAULT) -> Profile:
    """A profile of ``model_name`` on this machine (one worker, ``threads`` intra-op threads),
    with this process's C heap in mode ``malloc`` (:mod:`lowband.runtime.memory`; from here on), as
    the workers whose steps it models run."""
    import torch
    from ..runtime import memory
    from ..codecs import COMPRESSORS

    memory.configure(malloc)

    say = progress or (lambda msg: None)
    say(f"compute: {model_name}, batch {batch_size}, {reps} steps")
    c = measure_compute(model_name, batch_size, reps=reps, threads=threads)
    sizes = [p.numel for p in c["params"]]
    infos = {}
    for name in (COMPRESSORS if codecs is None else codecs):
        say(f"codec: {name}")
        infos[name] = measure_codec(name, sizes)
    say(f"PowerSGD hook: ranks {', '.join(map(str, POWERSGD_RANKS))}")
    shapes = [p.shape for p in c["params"]]
    hook = {str(r): measure_powersgd_hook(shapes, r) for r in POWERSGD_RANKS}
    say(f"engine overhead: {', '.join(MEASURED_PEERS)} against noop, and the pipeline CPU of "
        f"{', '.join(MEASURED_PIPELINES)}, one process")
    # steps * rounds = 5 x reps measured steps per engine (a test's reps=1: 1 step, past the warm-up)
    overhead, pipeline_cpu = measure_engine_overhead(model_name, batch_size, steps=reps, rounds=5 if reps >= 10 else 1,
                                                     warmup=15 if reps >= 10 else 11, malloc=malloc)
    return Profile(
        model=model_name, batch_size=batch_size, forward_s=c["forward_s"], optimizer_s=c["optimizer_s"],
        params=c["params"], ready_order=c["ready_order"], backward_s=c["backward_s"],
        backward_tail_s=c["backward_tail_s"], buffer_bytes=c["buffer_bytes"],
        fused_update_s=c["fused_update_s"], powersgd_hook_s=hook, engine_overhead_s=overhead,
        pipeline_cpu_s=pipeline_cpu, codecs=infos,
        lazy_default=c["lazy_default"],
        codec_shares_compute=True,
        source=f"measured by `lowband profile --model {model_name} --batch-size {batch_size}` "
               f"(median of {reps} steps, {threads} thread(s), --malloc {malloc}, torch {torch.__version__})",
        machine=f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        notes=["codec_shares_compute: lowband's compression thread runs on the worker's own CPU core"])
