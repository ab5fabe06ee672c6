"""The ``lowband`` command line.

``lowband train`` spawns its workers on this machine, or, when started under torchrun
(RANK and WORLD_SIZE set), joins that world as one worker, so the same command scales to
many nodes. Usage errors, unknown names and bad dataset files exit with status 2 and one line.
"""
from __future__ import annotations

import argparse
import ast
import atexit
import functools
import dataclasses
import os
import sys
from typing import Any, Optional, Sequence

from .. import __version__
from ..algorithms import ALGORITHMS, make_algorithm
from .checkpoint import CheckpointError, check_resumable, read_manifest, verify
from ..runtime.cpus import CPU_BINDINGS
from ..runtime.memory import MALLOC_MODES
from .config import LR_SCHEDULES, OPTIMIZERS, TrainConfig
from .data import DATASETS, DatasetError, load_dataset
from ..runtime.device import DEVICES, resolve as resolve_device
from ..engine.guard import NONFINITE_POLICIES
from .models import MODELS
from ..netem import NetemError
from .tasks import LANGUAGE_MODELS, TASK_DEFAULTS, defaults_for

EXIT_USAGE = 2
DEFAULT_RUN_DIR = "runs/latest"


class UsageError(Exception):
    """A problem with what the user asked for: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise UsageError(message)


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise UsageError(f"--option expects KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key.strip().replace("-", "_"), value


def _update_options(options: dict[str, Any], texts: list[str]) -> None:
    """An algorithm's own ``KEY=VALUE`` options (``--algorithms NAME:KEY=VALUE``) over
    ``options``; ``compressor_options.KEY=VALUE`` sets one codec option, over the
    ``--compressor-option`` ones."""
    for text in texts:
        key, value = _parse_option(text)
        head, dot, sub = key.partition(".")
        if not dot:
            options[key] = value
        elif head == "compressor_options" and sub:
            options["compressor_options"] = {**options.get("compressor_options", {}), sub: value}
        else:
            raise UsageError(f"--algorithms: {text!r}: only compressor_options.KEY=VALUE takes a dotted key")


def _by_task(key: str) -> str:
    """The --help text of a default that depends on the model: "default: 64; gpt: 8"."""
    image, text = TASK_DEFAULTS["classification"][key], TASK_DEFAULTS["lm"][key]
    return f"default: {image}; {', '.join(LANGUAGE_MODELS)}: {text}".replace("%", "%%")


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    """--burst and --rtt: how the emulated links beyond their rate behave (docs/netem.md)."""
    p.add_argument("--burst", default="none",
                   help="model a bursting policer: each emulated link gets a token bucket of this size "
                        "(e.g. 96kb, at least 2kb) and 64 KB packets, so after an idle period that many "
                        "bytes pass at line speed. 'none' (default): a paced link on which every message "
                        "takes about its bytes / rate")
    p.add_argument("--rtt", default="0",
                   help="round-trip propagation delay between two workers, e.g. 40ms; needs the kernel's "
                        "netem qdisc, and a kernel without it is refused with one line (default: %(default)s)")


def parse_burst(text: str, bandwidth: str) -> Optional[int]:
    """``--burst``: None for 'none' (a paced link), else bytes (at least one MTU frame); a usage
    error for a bad value or when ``--bandwidth`` asks for no emulated link (with
    --fallback-loopback on a machine without emulation the value is then simply unused)."""
    if text.strip().lower() in ("none", "off"):
        return None
    from ..netem import check_burst
    from ..perf.network import parse_bytes
    try:
        value = int(parse_bytes(text))
        check_burst(value)
    except ValueError as e:
        raise UsageError(f"--burst: {e}") from None
    if all(label.strip().lower() in ("", "none") for label in bandwidth.split(",")):
        raise UsageError("--burst shapes emulated links; it needs --bandwidth with a rate (e.g. 8mbit)")
    return value


def parse_rtt(text: str, bandwidth: str) -> float:
    """``--rtt`` in seconds; a usage error for a bad value, for a delay without an emulated link,
    and for a kernel that cannot add delay."""
    from ..perf.network import parse_latency
    try:
        rtt = parse_latency(text)
    except ValueError as e:
        raise UsageError(f"--rtt: {e}") from None
    if rtt <= 0:
        return 0.0
    if all(label.strip().lower() in ("", "none") for label in bandwidth.split(",")):
        raise UsageError("--rtt adds delay to emulated links; it needs --bandwidth with a rate (e.g. 20mbit)")
    from ..netem import has_qdisc
    if not has_qdisc("netem"):
        raise UsageError("--rtt: this kernel has no netem qdisc, so propagation delay cannot be emulated "
                         "(run with --rtt 0; the links are still shaped to their rate)")
    return rtt


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `train` and `bench` (everything except algorithm and worker count)."""
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help=f"model name: {', '.join(MODELS)} (default: %(default)s)")
    p.add_argument("--dataset", default=None, help=f"{', '.join(DATASETS)} ({_by_task('dataset')})")
    p.add_argument("--data-dir", default=d.data_dir, help="directory of the Fashion-MNIST IDX .gz files (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="epochs (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--batch-size", type=int, default=None, help=f"per-worker batch size ({_by_task('batch_size')})")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="split each worker's batch into this many forward/backward passes whose gradients add up "
                        "before one synchronized step (gradient accumulation: activations of one micro-batch at a "
                        "time; default: %(default)s)")
    p.add_argument("--lr", type=float, default=None, help=f"(peak) learning rate ({_by_task('lr')})")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=None, help=f"weight decay ({_by_task('weight_decay')})")
    p.add_argument("--optimizer", default=None, help=f"{', '.join(OPTIMIZERS)} ({_by_task('optimizer')})")
    p.add_argument("--lr-schedule", default=None,
                   help=f"{', '.join(LR_SCHEDULES)}; warmup-cosine warms up linearly over --warmup-steps, "
                        f"then decays to 10%% of --lr ({_by_task('lr_schedule')})")
    p.add_argument("--warmup-steps", type=int, default=None, help=f"learning-rate warm-up steps ({_by_task('warmup_steps')})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for data order and initial weights (default: %(default)s)")
    p.add_argument("--device", default=d.device, choices=DEVICES,
                   help="where model, batches and algorithm state live: cpu, cuda (this rank's GPU: LOCAL_RANK, "
                        "else rank %% GPUs; NCCL when every local rank has a GPU of its own, else gloo) or auto "
                        "(cuda if available) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads, help="intra-op threads per worker (default: %(default)s)")
    p.add_argument("--cpu-binding", default=d.cpu_binding, choices=CPU_BINDINGS,
                   help="spread: bind each worker of this machine to its own slice of the cores this process "
                        "may use (LOCAL_RANK of LOCAL_WORLD_SIZE; round-robin when there are more workers than "
                        "cores); none: the OS places every thread (docs/architecture.md) (default: %(default)s)")
    p.add_argument("--malloc", default=d.malloc, choices=MALLOC_MODES,
                   help="cached: the C heap keeps the pages a step freed for the next step (glibc's "
                        "mmap threshold 32 MiB, trim threshold 1 GiB), so a step never faults them in "
                        "again, and a worker's resident memory stays at its peak; system: glibc's adaptive "
                        "defaults, which give freed memory back to the system: use it when the workers share "
                        "the machine's memory with other work and their peak must not stay resident "
                        "(docs/architecture.md). Results are bit-identical (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s",
                   help="seconds before a silent peer is reported as failed (default: %(default)s)")
    p.add_argument("--no-progress", action="store_false", dest="progress", help="no progress bar")
    p.add_argument("--nonfinite", default=d.nonfinite, choices=NONFINITE_POLICIES,
                   help="when any rank's gradient has a NaN/Inf: raise on every rank, skip the step on "
                        "every rank, or off (no check) (default: %(default)s)")
    p.add_argument("--max-skips", type=int, default=d.max_consecutive_skips, dest="max_consecutive_skips",
                   metavar="N", help="with --nonfinite skip: after N consecutive skipped steps, the next "
                                     "non-finite one stops every rank with an error (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="STEPS",
                   help="write a crash-safe checkpoint every STEPS steps and at the end (default: 0, never)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                   help="complete checkpoints to keep (default: %(default)s)")
    p.add_argument("--master-addr", default=d.master_addr,
                   help="rendezvous address; anything but loopback exposes the workers' sockets to that "
                        "network (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=None, dest="eval_every_steps",
                   help="also evaluate every N steps (for accuracy-against-time curves)")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket size cap in MiB for bucketed algorithms")
    p.add_argument("--no-overlap", action="store_true", help="launch communication only after backward (ssgd)")
    p.add_argument("--compressor", default=None, help="codec for compressed algorithms: 2bit, 1bit, qsgd, terngrad, "
                   "topk, randomk, fp16, bf16, powersgd, none")
    p.add_argument("--collective", default=None, help="compressed collective: auto (allgather up to 4 workers, else two-stage), "
                   "two-stage or allgather")
    p.add_argument("--compressor-option", action="append", default=[], metavar="KEY=VALUE",
                   help="codec option, e.g. --compressor-option threshold=0.01 (repeatable)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other algorithm option, e.g. --option bucket_mb=4 (repeatable)")


def algorithm_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if args.bucket_mb is not None:
        opts["bucket_mb"] = args.bucket_mb
    if args.no_overlap:
        opts["overlap"] = False
    if args.compressor is not None:
        opts["compressor"] = args.compressor
    if args.collective is not None:
        opts["collective"] = args.collective
    if args.compressor_option:
        opts["compressor_options"] = dict(_parse_option(t) for t in args.compressor_option)
    for text in args.option:
        k, v = _parse_option(text)
        opts[k] = v
    return opts


def config_from_args(args: argparse.Namespace, algorithm: str, workers: int, run_dir: str,
                     model: Optional[str] = None) -> TrainConfig:
    model = model or args.model
    try:
        where = resolve_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    # settings the user left unset take the defaults of the model's task (lowband.app.tasks)
    task = {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in defaults_for(model).items()}
    cfg = TrainConfig(
        model=model, algorithm=algorithm, algorithm_options=algorithm_options(args),
        dataset=task["dataset"], data_dir=args.data_dir, workers=workers, epochs=args.epochs,
        max_steps=args.max_steps, batch_size=task["batch_size"], micro_batches=args.micro_batches,
        lr=task["lr"], momentum=args.momentum,
        weight_decay=task["weight_decay"], optimizer=task["optimizer"], lr_schedule=task["lr_schedule"],
        warmup_steps=task["warmup_steps"], seed=args.seed, threads=args.threads, cpu_binding=args.cpu_binding,
        malloc=args.malloc,
        run_dir=run_dir, timeout_s=args.timeout_s,
        progress=args.progress, nonfinite=args.nonfinite, max_consecutive_skips=args.max_consecutive_skips,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, master_addr=args.master_addr,
        eval_every_steps=args.eval_every_steps, device=where,
        resume=getattr(args, "resume", None) is not None,
    )
    check_config(cfg)
    return cfg


def check_config(cfg: TrainConfig) -> None:
    """Everything that can be checked before any worker starts; raises UsageError."""
    try:
        if cfg.model not in MODELS:
            raise ValueError(f"unknown model {cfg.model!r}; choose one of: {', '.join(sorted(MODELS))}")
        if cfg.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {cfg.dataset!r}; choose one of: {', '.join(DATASETS)}")
        cfg.validate()
        make_algorithm(cfg.algorithm, **cfg.algorithm_options)   # validates names and options
        size = check_dataset(cfg.dataset, cfg.data_dir, cfg.seed)
        share = size // cfg.workers
        if cfg.batch_size > share:
            raise ValueError(f"--batch-size {cfg.batch_size} is larger than each worker's share of the training "
                             f"set ({share} of the {size} {cfg.dataset} examples with --workers {cfg.workers})")
    except (ValueError, DatasetError) as e:
        raise UsageError(str(e)) from None


@functools.lru_cache(maxsize=None)
def check_dataset(name: str, data_dir: str, seed: int) -> int:
    """Load (and so validate) both splits once per process (a bench checks many
    configurations); returns the size of the training split."""
    sizes = [len(load_dataset(name, split, data_dir, seed)) for split in ("train", "test")]
    return sizes[0]


def check_output_dir(path: str, flag: str) -> str:
    """UsageError unless ``path`` is, or can be created as, a writable directory."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is an existing file, not a directory")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} is not writable ({parent})")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lowband", description="Data-parallel training for slow networks.")
    parser.add_argument("--version", action="version", version=f"lowband {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train one configuration with N workers",
                       description="Train with N workers on this machine (gloo over loopback), or as one "
                                   "worker of a torchrun world when RANK/WORLD_SIZE are set.")
    t.add_argument("--algorithm", default="ssgd", help=f"{', '.join(sorted(ALGORITHMS))} (default: %(default)s)")
    t.add_argument("--workers", type=int, default=TrainConfig.workers, help="worker processes (default: %(default)s)")
    t.add_argument("--run-dir", default=None, help="where config, metrics and summary go (default: runs/latest)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR's run from its latest checkpoint (same flags; --epochs, "
                        "--max-steps, --eval-every, --timeout, --nonfinite, --max-skips, --threads, --cpu-binding and --malloc may change; a "
                        "cosine schedule is stretched from the resume point to the new end)")
    t.add_argument("--bandwidth", default="none",
                   help="emulated per-worker link rate, e.g. 1gbit, 200mbit (needs root; default: %(default)s = loopback)")
    add_link_arguments(t)
    add_run_arguments(t)

    b = sub.add_parser("bench", help="run algorithms side by side over emulated links",
                       description="Run every combination of algorithm, link rate and worker count with the same "
                                   "seed and data; write results.json and plots to --out and print a markdown table. "
                                   "Step times are medians over the steady steps: after the first 5 and after the "
                                   "algorithm's own warm-up (the steps it logs as warmup); 'mean step ms' and the "
                                   "time to target cover the whole run. A run that fails is reported and the "
                                   "others still run; the exit status is then the first failure's.")
    b.add_argument("--algorithms", default="noop,ssgd",
                   help="comma-separated algorithm names, each optionally with its own options as "
                        "NAME:KEY=VALUE[:KEY=VALUE], a codec option as compressor_options.KEY=VALUE "
                        "(default: %(default)s)")
    b.add_argument("--bandwidth", default="none", help="comma-separated link rates, e.g. none,1gbit,200mbit (default: %(default)s)")
    add_link_arguments(b)
    b.add_argument("--workers", default="2", help="comma-separated worker counts (default: %(default)s)")
    b.add_argument("--out", default="runs/bench", help="output directory (default: %(default)s)")
    b.add_argument("--fallback-loopback", action="store_true",
                   help="if network emulation is unavailable, run over loopback instead of failing")
    b.add_argument("--doc", default=None,
                   help="also replace a generated section of this markdown file, in place: the one between "
                        "'<!-- lowband:begin NAME -->' and '<!-- lowband:end NAME -->' (checked before any run)")
    b.add_argument("--section", default="bench", help="NAME of that section (default: %(default)s)")
    b.add_argument("--repeat", type=int, default=1,
                   help="run the whole list this many times, round-robin, and report for each configuration "
                        "the run with the median step time, and per round its ratio to the same round's noop "
                        "with the median of those ratios (a machine's step times drift between runs minutes "
                        "apart; interleaved repeats cancel the drift; default: %(default)s)")
    add_run_arguments(b)
    b.set_defaults(max_steps=100)

    r = sub.add_parser("report", help="re-render a bench results file as a table, plots and docs section")
    r.add_argument("results", help="results.json written by `lowband bench`")
    r.add_argument("--doc", default=None,
                   help="markdown file whose generated section (between '<!-- lowband:begin NAME -->' and "
                        "'<!-- lowband:end NAME -->') is replaced in place; `make results` regenerates them all")
    r.add_argument("--images", default=None, help="directory for the plots (default: next to the results file)")
    r.add_argument("--section", default="bench", help="NAME of the generated section (default: %(default)s)")

    pr = sub.add_parser("profile", help="measure a model's per-layer compute, codec and peer-engine costs (a JSON profile)",
                        description="Measure, on this machine and one worker, forward time, per-parameter backward "
                                    "time in gradient-ready order, optimizer time, gradient sizes and every "
                                    "compressor's encode/decode throughput, PowerSGD's hook phases and what each peer's engine "
                                    "(DDP, torchft's DiLoCo) adds to a compute-only step; write them as a profile for "
                                    "`lowband plan`.")
    pr.add_argument("--model", required=True, help=f"model name: {', '.join(MODELS)}")
    pr.add_argument("--out", required=True, help="profile file to write (JSON)")
    pr.add_argument("--batch-size", type=int, default=None, help=f"per-worker batch size ({_by_task('batch_size')})")
    pr.add_argument("--reps", type=int, default=20, help="measured steps (default: %(default)s)")
    pr.add_argument("--threads", type=int, default=TrainConfig.threads, help="intra-op threads (default: %(default)s)")
    pr.add_argument("--codecs", default=None, help="comma-separated compressors to measure (default: all)")
    pr.add_argument("--malloc", default=TrainConfig.malloc, choices=MALLOC_MODES,
                    help="the C heap's mode while measuring, as the workers' --malloc (default: %(default)s)")

    pl = sub.add_parser("plan", help="project step time and speedup of algorithms over worker counts",
                        description="Project, from a profile and a network, each algorithm's steady-state step time, "
                                    "throughput, speedup over one worker and scaling efficiency (docs/perfmodel.md).")
    pl.add_argument("--profile", required=True, help="profile file from `lowband profile`, or a bundled one "
                    "(resnet50-v100, resnet50-knl, cnn-2core)")
    pl.add_argument("--workers", default="8,16,32", help="comma-separated worker counts (default: %(default)s)")
    pl.add_argument("--bandwidth", required=True, help="per-worker link rate, e.g. 56gbit, 1gbit")
    pl.add_argument("--latency", default="0", help="per-message latency, e.g. 5us, 0.2ms (default: %(default)s)")
    pl.add_argument("--efficiency", type=float, default=1.0,
                    help="achieved fraction of the link rate for bulk transfers (default: %(default)s)")
    pl.add_argument("--burst", default="0",
                    help="token-bucket depth of each link, e.g. 96kb: after an idle period that many bytes pass at "
                         "line speed (tc tbf's burst, as on lowband bench's emulated links); 0 = a plain rate "
                         "limit (default: %(default)s)")
    pl.add_argument("--algorithms", default="ssgd,compressed,cpsgd,lazy",
                    help="comma-separated NAME[:KEY=VALUE...] with the algorithms' own knobs plus the model's "
                         "what-ifs: lazy:tau=T, cp-diloco:tau=T (the mean rounds between lazy_layers' syncs under "
                         "lazy_every=auto), ssgd|lazy:pattern=pcnn, compressed|cpsgd:collective=ps, "
                         "cpsgd:correction=spread|burst (default: %(default)s)")
    pl.add_argument("--batch-size", type=int, default=None, help="per-worker batch (compute scaled linearly from the profile's)")
    pl.add_argument("--compute-scale", type=float, default=1.0,
                    help="multiply the profile's compute and codec times, e.g. for CPU contention (default: %(default)s)")
    pl.add_argument("--out", default=None, help="also draw speedup vs workers to this image file")

    k = sub.add_parser("knobs", help="every algorithm's options as a markdown reference",
                       description="Print every registered algorithm's options (type, default, what each does, "
                                   "from the dataclass fields and their docstrings) as markdown: the reference "
                                   "docs/knobs.md holds.")
    k.add_argument("--out", default=None, help="write it to this file instead of printing it (docs/knobs.md)")
    return parser


def resolve_run_dir(args: argparse.Namespace) -> str:
    """``--resume RUN_DIR`` names the run directory; ``--run-dir`` may repeat it, not contradict it."""
    if args.resume is None:
        return check_output_dir(args.run_dir or DEFAULT_RUN_DIR, "--run-dir")
    if args.run_dir is not None and os.path.abspath(args.run_dir) != os.path.abspath(args.resume):
        raise UsageError(f"--resume {args.resume} continues that run directory; drop --run-dir {args.run_dir}")
    if not os.path.isdir(args.resume):
        raise UsageError(f"--resume {args.resume} is not a run directory")
    return args.resume


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOWBAND_LAUNCHED" not in os.environ


def cmd_train(args: argparse.Namespace) -> int:
    from .bench import run_on_link
    from .metrics import format_table
    from .runner import RunFailed
    from .train import print_summary
    from .worker import run_reported

    run_dir = resolve_run_dir(args)
    if under_torchrun():
        cfg = config_from_args(args, args.algorithm, int(os.environ["WORLD_SIZE"]), run_dir)
        summary = run_reported(cfg)    # a failure: one line naming this rank, as with lowband's launcher
        if summary is not None:
            print_summary(summary)
        return 0
    cfg = config_from_args(args, args.algorithm, args.workers, run_dir)
    burst = parse_burst(args.burst, args.bandwidth)
    rtt = parse_rtt(args.rtt, args.bandwidth)
    rate = parse_bandwidths(args.bandwidth, fallback=False, workers=[cfg.workers])[0][1]
    if cfg.resume:
        try:   # the workers check again; this turns the common mistakes into a usage error
            manifest = read_manifest(cfg.run_dir)
            check_resumable(manifest, dataclasses.asdict(cfg), cfg.workers)
            verify(cfg.run_dir, manifest)      # every file's SHA-256, before anything is touched
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    try:
        row = run_on_link(cfg, rate, burst, rtt)
    except RunFailed as e:
        print(f"lowband: error: {e.result.describe()}", file=sys.stderr)
        return e.result.returncode
    print(format_table([row]))
    link = "loopback" if rate is None else \
        f"link {args.bandwidth} per worker, both directions, {row.get('link')}"
    print(f"run directory: {cfg.run_dir} ({link}; device {row.get('device', cfg.device)}, "
          f"backend {row.get('backend', 'gloo')})")
    return 0


def parse_bandwidths(text: str, fallback: bool, workers: Sequence[int] = ()) -> list[tuple[str, Optional[int]]]:
    """``"none,1gbit"`` -> [("none", None), ("1gbit", 10**9)]; checks that emulation is usable
    when a rate is asked for, for every count in ``workers`` (or, with ``fallback``, says so
    and uses loopback)."""
    from .. import netem
    out = []
    for label in [x.strip() for x in text.split(",") if x.strip()]:
        try:
            out.append((label, netem.parse_rate(label)))
        except ValueError as e:
            raise UsageError(f"--bandwidth: {e}") from None
    if not out:
        raise UsageError("--bandwidth needs at least one rate")
    if any(rate is not None for _, rate in out):
        too_many = [w for w in workers if w > netem.MAX_WORLD_SIZE]
        if too_many:
            raise UsageError(f"--workers {too_many[0]} is more than the {netem.MAX_WORLD_SIZE} workers that network "
                             "emulation (--bandwidth) supports")
        reason = netem.check_available()
        if reason:
            if not fallback:
                raise UsageError(reason)
            print(f"lowband: network emulation unavailable ({reason}); running over loopback", file=sys.stderr)
            out = [("none", None)]
        else:
            netem.cleanup_stale()
    return list(dict.fromkeys(out))


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} values must be >= 1, got {text!r}")
    return values


def unavailable(name: str) -> Optional[str]:
    """Why an algorithm that needs an optional extra (the torchft peers) cannot run here."""
    check = getattr(ALGORITHMS.get(name), "unavailable", None)
    return check() if check is not None else None


def cmd_bench(args: argparse.Namespace) -> int:
    import platform
    from .bench import RESULTS_FILE, run_on_link
    from .runner import RunFailed
    from .metrics import read_jsonl, write_json_atomic
    from .report import derive, eval_points, find_section, plot, print_tables, write_section

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if not algorithms:
        raise UsageError(f"--algorithms needs at least one algorithm name, got {args.algorithms!r}")
    workers = _int_list(args.workers, "--workers")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be an integer >= 1, got {args.repeat}")
    check_output_dir(args.out, "--out")
    if args.doc:                 # a section to replace, not one to append after hours of runs
        try:
            find_section(args.doc, args.section)
        except ValueError as e:
            raise UsageError(f"--doc: {e}") from None
    burst = parse_burst(args.burst, args.bandwidth)
    rtt = parse_rtt(args.rtt, args.bandwidth)
    links = parse_bandwidths(args.bandwidth, fallback=args.fallback_loopback, workers=workers)
    configs = []
    for li, (label, rate) in enumerate(links):
        for wi, w in enumerate(workers):
            for ai, spec in enumerate(algorithms):
                name, *own = spec.split(":")     # per-algorithm options: cpsgd:warmup_steps=20
                reason = unavailable(name)
                if reason:
                    if (label, w) == (links[0][0], workers[0]):
                        print(f"lowband: skipping {spec}: {reason}", file=sys.stderr)
                    continue
                for r in range(args.repeat):
                    run_dir = os.path.join(args.out, "runs", f"{label}-{w}w-{spec.replace(':', '-')}"
                                           + (f"-r{r + 1}" if args.repeat > 1 else ""))
                    cfg = config_from_args(args, name, w, run_dir)
                    if own:
                        _update_options(cfg.algorithm_options, own)
                        check_config(cfg)
                    configs.append((r, label, rate, cfg, spec, (li, wi, ai)))
    # round-robin, every configuration once per round; within a round each link and worker
    # count in turn, their algorithms as listed
    configs.sort(key=lambda c: (c[0], c[5]))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    # the command line as typed (`lowband bench ...` or `python -m lowband.app.cli bench ...`);
    # called from Python with another argv, every parsed option instead
    command = "lowband " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else \
        "lowband bench " + " ".join(f"{k}={v}" for k, v in vars(args).items())
    results = {"command": command, "machine": f"{platform.node()}, {os.cpu_count()} cores",
               "link": ("tc tbf on both ends of each worker's veth, "
                        + ("paced" if burst is None else f"bursting ({burst} B bucket)")
                        + (f", rtt {rtt * 1e3:g} ms" if rtt else ", no added delay")) if any(r for _, r in links) else "loopback",
               "rows": rows}
    failed: list[tuple[str, int]] = []     # (what, exit status): a failed run does not stop the others
    for i, (r, label, rate, cfg, spec, _) in enumerate(configs, 1):
        what = f"{spec} x{cfg.workers} over {label}" + (f" (round {r + 1})" if args.repeat > 1 else "")
        print(f"[{i}/{len(configs)}] {spec} x{cfg.workers} over {label} on {cfg.device}"
              + (f" (round {r + 1} of {args.repeat})" if args.repeat > 1 else ""), file=sys.stderr, flush=True)
        try:
            row = run_on_link(cfg, rate, burst, rtt)
        except RunFailed as e:
            print(f"lowband: error: {e}", file=sys.stderr)
            failed.append((what, e.result.returncode or 1))
            results["failed"] = [w for w, _ in failed]
            write_json_atomic(os.path.join(args.out, RESULTS_FILE), results)
            continue
        if row["warmup_steps_logged"] and not row["steady_steps"]:
            print(f"lowband: note: {spec} x{cfg.workers} over {label}: all {row['steps']} steps were in the "
                  "algorithm's warm-up, so its step times are the warm-up's (raise --max-steps or lower "
                  "its warmup_steps)", file=sys.stderr)
        epochs = read_jsonl(os.path.join(cfg.run_dir, "epochs.jsonl"))
        row.update(bandwidth=label, rate_bits=rate, algorithm=spec, repeat=r + 1,
                   curve=[(e["wall_s"], e["test_accuracy"]) for e in epochs], evals=eval_points(epochs))
        rows.append(row)
        write_json_atomic(os.path.join(args.out, RESULTS_FILE), results)
    if args.repeat > 1:
        results["all_runs"] = list(rows)
        rows[:] = median_runs(rows)
        write_json_atomic(os.path.join(args.out, RESULTS_FILE), results)
        for row in rows:
            print(f"{row['algorithm']} x{row['workers']} over {row['bandwidth']}: median step ms of the "
                  f"{args.repeat} runs " + ", ".join(f"{x:.1f}" for x in row["median_step_ms_repeats"])
                  + f" (reported: run {row['repeat']})", file=sys.stderr)
    if rows:
        print_tables(derive(rows), results.get("all_runs") or ())
        images = plot(derive(rows), args.out)
        print(f"results: {os.path.join(args.out, RESULTS_FILE)}; plots: {', '.join(images)}", file=sys.stderr)
    if failed:    # the tables hold the runs that finished; a partial section is not written into --doc
        print(f"lowband: error: {len(failed)} of {len(configs)} runs failed: {', '.join(w for w, _ in failed)}"
              + (f"; {args.doc} left unchanged" if args.doc else ""), file=sys.stderr)
        return failed[0][1]
    if args.doc:
        try:
            write_section(args.doc, args.section, os.path.join(args.out, RESULTS_FILE), results, args.out)
        except ValueError as e:
            print(f"lowband: error: {e}; {args.doc} left unchanged", file=sys.stderr)
            return 1
    return 0


def median_runs(rows: list[dict]) -> list[dict]:
    """One row per (bandwidth, workers, algorithm): the repeat whose median step time is the
    median of the repeats (the lower one for an even count), so every reported field comes
    from one real run; ``median_step_ms_repeats`` keeps all of them, in round order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["bandwidth"], row["workers"], row["algorithm"]), []).append(row)
    merged = []
    for runs in groups.values():
        ranked = sorted(runs, key=lambda x: x["median_step_ms"])
        chosen = dict(ranked[(len(ranked) - 1) // 2])
        chosen["median_step_ms_repeats"] = [x["median_step_ms"] for x in runs]
        merged.append(chosen)
    return merged


def cmd_report(args: argparse.Namespace) -> int:
    from .report import DocSectionError, ResultsFileError, main_report
    if not os.path.exists(args.results):
        raise UsageError(f"results file {args.results} does not exist")
    if os.path.isdir(args.results):
        raise UsageError(f"results file {args.results} is a directory (pass its results.json)")
    try:
        return main_report(args.results, args.doc, args.images or os.path.dirname(os.path.abspath(args.results)),
                           args.section)
    except (ResultsFileError, DocSectionError) as e:
        raise UsageError(str(e)) from None


def cmd_profile(args: argparse.Namespace) -> int:
    from ..codecs import COMPRESSORS
    from ..perf.profile import measure
    if args.model not in MODELS:
        raise UsageError(f"unknown model {args.model!r}; choose one of: {', '.join(sorted(MODELS))}")
    if args.batch_size is None:
        args.batch_size = defaults_for(args.model)["batch_size"]
    if args.batch_size < 1 or args.reps < 1 or args.threads < 1:
        raise UsageError("--batch-size, --reps and --threads must be >= 1")
    codecs = None
    if args.codecs is not None:
        codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
        bad = [c for c in codecs if c not in COMPRESSORS]
        if bad:
            raise UsageError(f"unknown compressor(s) {bad}; choose from: {', '.join(COMPRESSORS)}")
    prof = measure(args.model, args.batch_size, codecs, reps=args.reps, threads=args.threads, malloc=args.malloc,
                   progress=lambda m: print(f"profile: {m}", file=sys.stderr, flush=True))
    prof.save(args.out)
    print(f"{args.out}: {len(prof.params)} parameters, {prof.gradient_bytes / 1e6:.2f} MB of gradients; "
          f"forward {1e3 * prof.forward_s:.2f} ms, backward {1e3 * prof.backward_total_s:.2f} ms, "
          f"optimizer {1e3 * prof.optimizer_s:.2f} ms; {len(prof.codecs)} codecs")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .. import netem
    from ..perf.network import Network, parse_bytes, parse_latency
    from ..perf.plan import format_rows, plot_speedup, run_plan
    from ..perf.profile import ProfileError, load_profile
    try:
        prof = load_profile(args.profile)
        if args.batch_size is not None:
            if args.batch_size < 1:
                raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
            prof = prof.scaled(args.batch_size)
        rate = netem.parse_rate(args.bandwidth)
        if rate is None:
            raise ValueError("--bandwidth needs a rate (e.g. 56gbit); 'none' has no time model")
        network = Network(rate, parse_latency(args.latency), args.efficiency, burst_bytes=parse_bytes(args.burst))
        workers = _int_list(args.workers, "--workers")
        algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        if not algorithms:
            raise ValueError("--algorithms needs at least one name")
        rows = run_plan(prof, algorithms, workers, network, compute_scale=args.compute_scale)
    except (ProfileError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(f"profile: {args.profile} ({prof.model}, batch {prof.batch_size} per worker; {prof.source})")
    burst = f", burst {args.burst}" if network.burst_bytes > 0 else ""
    print(f"network: {args.bandwidth} per worker, latency {args.latency} per message, efficiency {args.efficiency}{burst}; "
          f"one-worker compute-only step {1e3 * prof.compute_s * args.compute_scale:.1f} ms")
    print(format_rows(rows))
    if args.out:
        plot_speedup(rows, args.out, f"{prof.model} ({args.profile}), {args.bandwidth}, latency {args.latency}")
        print(f"plot: {args.out}", file=sys.stderr)
    return 0


def cmd_knobs(args: argparse.Namespace) -> int:
    from .knobs import knob_reference
    text = knob_reference()
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.out, "w") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"--out {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "bench": cmd_bench, "report": cmd_report, "profile": cmd_profile, "plan": cmd_plan,
            "knobs": cmd_knobs}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"lowband: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except NetemError as e:           # building or querying an emulated link failed mid-run
        print(f"lowband: error: network emulation: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lowband: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``lowband`` command: :func:`main`, then leave without the interpreter's
    finalization (tearing down torch's modules takes about 1 s, after every result is
    written). ``atexit`` handlers still run (the emulated links' clean-up is one), streams are
    flushed; every file lowband writes is closed by then (``with`` blocks)."""
    rc = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):     # a closed pipe (``lowband ... | head``) or stream
            pass
    os._exit(rc)


if __name__ == "__main__":
    entry()
