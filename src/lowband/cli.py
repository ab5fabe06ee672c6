"""The ``lowband`` command line.

``lowband train`` spawns its workers on this machine, or, when started under torchrun
(RANK and WORLD_SIZE set), joins that world as one worker, so the same command scales to
many nodes. Usage errors, unknown names and bad dataset files exit with status 2 and one line.
"""
from __future__ import annotations

import argparse
import ast
import functools
import dataclasses
import os
import sys
from typing import Any, Optional, Sequence

from . import __version__
from .algorithms import ALGORITHMS, make_algorithm
from .checkpoint import CheckpointError, check_resumable, read_manifest
from .config import LR_SCHEDULES, OPTIMIZERS, TrainConfig
from .data import DATASETS, DatasetError, load_dataset
from .guard import NONFINITE_POLICIES
from .models import MODELS
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


def _by_task(key: str) -> str:
    """The --help text of a default that depends on the model: "default: 64; gpt: 8"."""
    image, text = TASK_DEFAULTS["classification"][key], TASK_DEFAULTS["lm"][key]
    return f"default: {image}; {', '.join(LANGUAGE_MODELS)}: {text}".replace("%", "%%")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `train` and `bench` (everything except algorithm and worker count)."""
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help=f"model name: {', '.join(MODELS)} (default: %(default)s)")
    p.add_argument("--dataset", default=None, help=f"{', '.join(DATASETS)} ({_by_task('dataset')})")
    p.add_argument("--data-dir", default=d.data_dir, help="directory of the Fashion-MNIST IDX .gz files (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="epochs (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--batch-size", type=int, default=None, help=f"per-worker batch size ({_by_task('batch_size')})")
    p.add_argument("--lr", type=float, default=None, help=f"(peak) learning rate ({_by_task('lr')})")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=None, help=f"weight decay ({_by_task('weight_decay')})")
    p.add_argument("--optimizer", default=None, help=f"{', '.join(OPTIMIZERS)} ({_by_task('optimizer')})")
    p.add_argument("--lr-schedule", default=None,
                   help=f"{', '.join(LR_SCHEDULES)}; warmup-cosine warms up linearly over --warmup-steps, "
                        f"then decays to 10%% of --lr ({_by_task('lr_schedule')})")
    p.add_argument("--warmup-steps", type=int, default=None, help=f"learning-rate warm-up steps ({_by_task('warmup_steps')})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for data order and initial weights (default: %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads, help="intra-op threads per worker (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s",
                   help="seconds before a silent peer is reported as failed (default: %(default)s)")
    p.add_argument("--no-progress", action="store_false", dest="progress", help="no progress bar")
    p.add_argument("--nonfinite", default=d.nonfinite, choices=NONFINITE_POLICIES,
                   help="when any rank's gradient has a NaN/Inf: raise on every rank, skip the step on "
                        "every rank, or off (no check) (default: %(default)s)")
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
    p.add_argument("--collective", default=None, help="compressed collective: two-stage or allgather")
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
    # settings the user left unset take the defaults of the model's task (lowband.tasks)
    task = {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in defaults_for(model).items()}
    cfg = TrainConfig(
        model=model, algorithm=algorithm, algorithm_options=algorithm_options(args),
        dataset=task["dataset"], data_dir=args.data_dir, workers=workers, epochs=args.epochs,
        max_steps=args.max_steps, batch_size=task["batch_size"], lr=task["lr"], momentum=args.momentum,
        weight_decay=task["weight_decay"], optimizer=task["optimizer"], lr_schedule=task["lr_schedule"],
        warmup_steps=task["warmup_steps"], seed=args.seed, threads=args.threads, run_dir=run_dir, timeout_s=args.timeout_s,
        progress=args.progress, nonfinite=args.nonfinite, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, master_addr=args.master_addr,
        eval_every_steps=args.eval_every_steps,
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
        check_dataset(cfg.dataset, cfg.data_dir, cfg.seed)
    except (ValueError, DatasetError) as e:
        raise UsageError(str(e)) from None


@functools.lru_cache(maxsize=None)
def check_dataset(name: str, data_dir: str, seed: int) -> None:
    """Load (and so validate) both splits once per process: a bench checks many configurations."""
    for split in ("train", "test"):
        load_dataset(name, split, data_dir, seed)


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
                        "--max-steps, --timeout and --nonfinite may change)")
    t.add_argument("--bandwidth", default="none",
                   help="emulated per-worker link rate, e.g. 1gbit, 200mbit (needs root; default: %(default)s = loopback)")
    add_run_arguments(t)

    b = sub.add_parser("bench", help="run algorithms side by side over emulated links",
                       description="Run every combination of algorithm, link rate and worker count with the same "
                                   "seed and data; write results.json and plots to --out and print a markdown table.")
    b.add_argument("--algorithms", default="noop,ssgd",
                   help="comma-separated algorithm names, each optionally with its own options as "
                        "NAME:KEY=VALUE[:KEY=VALUE] (default: %(default)s)")
    b.add_argument("--bandwidth", default="none", help="comma-separated link rates, e.g. none,1gbit,200mbit (default: %(default)s)")
    b.add_argument("--workers", default="2", help="comma-separated worker counts (default: %(default)s)")
    b.add_argument("--out", default="runs/bench", help="output directory (default: %(default)s)")
    b.add_argument("--fallback-loopback", action="store_true",
                   help="if network emulation is unavailable, run over loopback instead of failing")
    b.add_argument("--doc", default=None, help="also update a generated section of this markdown file")
    b.add_argument("--section", default="bench", help="name of that section (default: %(default)s)")
    add_run_arguments(b)
    b.set_defaults(max_steps=100)

    r = sub.add_parser("report", help="re-render a bench results file as a table, plots and docs section")
    r.add_argument("results", help="results.json written by `lowband bench`")
    r.add_argument("--doc", default=None, help="markdown file whose benchmark section is replaced")
    r.add_argument("--images", default=None, help="directory for the plots (default: next to the results file)")
    r.add_argument("--section", default="bench", help="name of the generated section (default: %(default)s)")
    return parser


def resolve_run_dir(args: argparse.Namespace) -> str:
    """``--resume RUN_DIR`` names the run directory; ``--run-dir`` may repeat it, not contradict it."""
    if args.resume is None:
        return args.run_dir or DEFAULT_RUN_DIR
    if args.run_dir is not None and os.path.abspath(args.run_dir) != os.path.abspath(args.resume):
        raise UsageError(f"--resume {args.resume} continues that run directory; drop --run-dir {args.run_dir}")
    return args.resume


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOWBAND_LAUNCHED" not in os.environ


def cmd_train(args: argparse.Namespace) -> int:
    from .bench import run_on_link
    from .metrics import format_table
    from .runner import RunFailed
    from .train import print_summary, run_worker

    run_dir = resolve_run_dir(args)
    if under_torchrun():
        cfg = config_from_args(args, args.algorithm, int(os.environ["WORLD_SIZE"]), run_dir)
        summary = run_worker(cfg)
        if summary is not None:
            print_summary(summary)
        return 0
    cfg = config_from_args(args, args.algorithm, args.workers, run_dir)
    rate = parse_bandwidths(args.bandwidth, fallback=False)[0][1]
    if cfg.resume:
        try:   # the workers check again; this turns the common mistakes into a usage error
            check_resumable(read_manifest(cfg.run_dir), dataclasses.asdict(cfg), cfg.workers)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    try:
        row = run_on_link(cfg, rate)
    except RunFailed as e:
        print(f"lowband: error: {e.result.describe()}", file=sys.stderr)
        return e.result.returncode
    print(format_table([row]))
    link = "loopback" if rate is None else f"link {args.bandwidth} per worker, both directions"
    print(f"run directory: {cfg.run_dir} ({link})")
    return 0


def parse_bandwidths(text: str, fallback: bool) -> list[tuple[str, Optional[int]]]:
    """``"none,1gbit"`` -> [("none", None), ("1gbit", 10**9)]; checks that emulation is usable
    when a rate is asked for (or, with ``fallback``, says so and uses loopback)."""
    from . import netem
    out = []
    for label in [x.strip() for x in text.split(",") if x.strip()]:
        try:
            out.append((label, netem.parse_rate(label)))
        except ValueError as e:
            raise UsageError(str(e)) from None
    if not out:
        raise UsageError("--bandwidth needs at least one rate")
    if any(rate is not None for _, rate in out):
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


def cmd_bench(args: argparse.Namespace) -> int:
    import platform
    from .bench import RESULTS_FILE, run_on_link
    from .runner import RunFailed
    from .metrics import read_jsonl, write_json_atomic
    from .report import derive, markdown_table, plot, render_section, update_doc

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    workers = _int_list(args.workers, "--workers")
    links = parse_bandwidths(args.bandwidth, fallback=args.fallback_loopback)
    configs = []
    for label, rate in links:
        for w in workers:
            for spec in algorithms:
                name, *own = spec.split(":")     # per-algorithm options: cpsgd:warmup_steps=20
                run_dir = os.path.join(args.out, "runs", f"{label}-{w}w-{spec.replace(':', '-')}")
                cfg = config_from_args(args, name, w, run_dir)
                if own:
                    cfg.algorithm_options.update(dict(_parse_option(o) for o in own))
                    check_config(cfg)
                configs.append((label, rate, cfg, spec))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    command = "lowband " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("lowband") else \
        "lowband bench " + " ".join(f"{k}={v}" for k, v in vars(args).items())
    results = {"command": command, "machine": f"{platform.node()}, {os.cpu_count()} cores",
               "link": "tc tbf on both ends of each worker's veth" if any(r for _, r in links) else "loopback",
               "rows": rows}
    for i, (label, rate, cfg, spec) in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {spec} x{cfg.workers} over {label}", file=sys.stderr, flush=True)
        try:
            row = run_on_link(cfg, rate)
        except RunFailed as e:
            print(f"lowband: error: {e}", file=sys.stderr)
            return e.result.returncode
        epochs = read_jsonl(os.path.join(cfg.run_dir, "epochs.jsonl"))
        row.update(bandwidth=label, rate_bits=rate, algorithm=spec,
                   curve=[(e["wall_s"], e["test_accuracy"]) for e in epochs])
        rows.append(row)
        write_json_atomic(os.path.join(args.out, RESULTS_FILE), results)
    print(markdown_table(derive(rows)))
    images = plot(derive(rows), args.out)
    print(f"results: {os.path.join(args.out, RESULTS_FILE)}; plots: {', '.join(images)}", file=sys.stderr)
    if args.doc:
        update_doc(args.doc, render_section(results, os.path.join(args.out, RESULTS_FILE), args.out, args.doc,
                                            args.section), args.section)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import main_report
    if not os.path.exists(args.results):
        raise UsageError(f"results file {args.results} does not exist")
    return main_report(args.results, args.doc, args.images or os.path.dirname(os.path.abspath(args.results)),
                       args.section)


COMMANDS = {"train": cmd_train, "bench": cmd_bench, "report": cmd_report}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"lowband: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("lowband: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
