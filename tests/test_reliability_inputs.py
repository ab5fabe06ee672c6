"""Every bad input to ``lowband`` ends with exit status 2 and one line naming the flag (or the
option), before any worker starts; no traceback. Table-driven and in-process (the CLI's
``main`` with an argv), so the whole table costs about a second."""
from __future__ import annotations

import json
import math

import pytest

from lowband.algorithms.base import OptionError, check_options
from lowband.algorithms import ALGORITHMS
from lowband.app.cli import main
from lowband.app.lr_schedule import CosineSchedule

FAST = ["--dataset", "synthetic", "--model", "mlp", "--no-progress"]

#: (argv after the command, text the one line must contain); "{file}" / "{dir}" are replaced
#: by an existing file / an empty directory
TRAIN = [
    # the bad inputs of issue 14
    (["--dataset", "fashion-mnist", "--batch-size", "40000"],
     "--batch-size 40000 is larger than each worker's share of the training set (30000 of the 60000"),
    (["--momentum", "-1"], "--momentum must be a number in [0, 1), got -1.0"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0, got -1.0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**32), got -1"),
    (["--seed", str(2 ** 40)], f"--seed must be an integer in [0, 2**32), got {2 ** 40}"),
    (["--seed", "2**40"], "argument --seed: invalid int value: '2**40'"),
    (["--timeout", "inf"], "--timeout must be a number of seconds > 0"),
    (["--workers", "255", "--batch-size", "1", "--bandwidth", "1gbit"],
     "--workers 255 is more than the 254 workers that network emulation (--bandwidth) supports"),
    (["--run-dir", "{file}"], "--run-dir {file} is an existing file, not a directory"),
    (["--run-dir", "{file}/sub"], "--run-dir {file}/sub cannot be created: {file} is a file"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--momentum", "nan"], "--momentum must be a number in [0, 1), got nan"),
    (["--algorithm", "cpsgd", "--option", "warmup_steps=abc"],
     "bad options for algorithm 'cpsgd': option 'warmup_steps' must be an integer, got 'abc'"),
    # more of the same kind
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--momentum", "1"], "--momentum must be a number in [0, 1), got 1.0"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
    (["--timeout", "0"], "--timeout must be a number of seconds > 0"),
    (["--timeout", "nan"], "--timeout must be a number of seconds > 0"),
    (["--timeout", "1e9"], "--timeout must be a number of seconds > 0 and <= 604800"),
    (["--max-skips", "0"], "--max-skips must be an integer >= 1, got 0"),
    (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
    (["--eval-every", "0"], "--eval-every must be an integer >= 1, got 0"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be an integer >= 0, got -1"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be an integer >= 1, got 0"),
    (["--max-steps", "0"], "--max-steps must be an integer >= 1, got 0"),
    (["--bucket-mb", "-1"], "bad options for algorithm 'ssgd': option 'bucket_mb' must be >= 0, got -1.0"),
    (["--bucket-mb", "nan"], "option 'bucket_mb' must be a finite number, got nan"),
    (["--algorithm", "ssgd", "--option", "warmup_steps=3"],
     "bad options for algorithm 'ssgd': unknown option 'warmup_steps'; its options are: bucket_mb, gradient_as_bucket_view, overlap"),
    (["--algorithm", "ssgd", "--option", "overlap=maybe"], "option 'overlap' must be true or false, got 'maybe'"),
    (["--algorithm", "localsgd", "--option", "period=0"], "localsgd: period must be an integer >= 1, got 0"),
    (["--algorithm", "localsgd", "--option", "period=2.5"], "option 'period' must be an integer, got 2.5"),
    (["--algorithm", "cpsgd", "--option", "local_lr=nan"], "option 'local_lr' must be a finite number or none, got 'nan'"),
    (["--algorithm", "cpsgd", "--option", "correction_period=-2"], "option 'correction_period' must be >= 0, got -2"),
    (["--algorithm", "lazy", "--option", "variant=3"], "option 'variant' must be a string, got 3"),
    (["--option", "bucket_mb"], "--option expects KEY=VALUE, got 'bucket_mb'"),
    (["--resume", "{file}"], "--resume {file} is not a run directory"),
    (["--resume", "{dir}"], "no checkpoint to resume from"),
    (["--resume", "{dir}", "--run-dir", "{file}"], "--resume {dir} continues that run directory; drop --run-dir"),
    # inputs that were already caught before issue 14 (kept here so they stay caught)
    (["--model", "vgg99"], "unknown model 'vgg99'"),
    (["--algorithm", "magic"], "unknown algorithm 'magic'"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
    (["--nonfinite", "ignore"], "argument --nonfinite: invalid choice: 'ignore'"),
    (["--optimizer", "lbfgs"], "unknown optimizer 'lbfgs'"),
    (["--bandwidth", "fast"], "--bandwidth: "),
]

BENCH = [
    (["--algorithms", ","], "--algorithms needs at least one algorithm name, got ','"),
    (["--algorithms", "ssgd,magic"], "unknown algorithm 'magic'"),
    (["--algorithms", "cpsgd:warmup_steps=abc"], "option 'warmup_steps' must be an integer, got 'abc'"),
    (["--workers", "0"], "--workers values must be >= 1"),
    (["--workers", "2,x"], "--workers expects comma-separated integers"),
    (["--workers", "255", "--batch-size", "1", "--bandwidth", "1gbit"], "--workers 255 is more than the 254"),
    (["--out", "{file}"], "--out {file} is an existing file, not a directory"),
]

REPORT = [
    (["{missing}"], "results file {missing} does not exist"),
    (["{dir}"], "results file {dir} is a directory"),
    (["{text}"], "{text} is not a lowband bench results file (not JSON"),
    (["{binary}"], "{binary} is not a lowband bench results file (not JSON text)"),
    (["{object}"], "{object} is not a lowband bench results file (no list of 'rows')"),
    (["{badrow}"], "{badrow} is not a lowband bench results file (row 0 lacks bandwidth, workers"),
    (["{badrun}"], "{badrun} is not a lowband bench results file (all_runs entry 1 lacks median_step_ms"),
]


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    p = {"file": tmp_path / "a-file", "dir": tmp_path / "empty", "missing": tmp_path / "nope.json",
         "text": tmp_path / "notes.txt", "binary": tmp_path / "blob.json", "object": tmp_path / "object.json",
         "badrow": tmp_path / "badrow.json", "badrun": tmp_path / "badrun.json"}
    p["file"].write_text("x")
    p["dir"].mkdir()
    p["text"].write_text("this is not json\n")
    p["binary"].write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    p["object"].write_text(json.dumps({"command": "lowband bench"}))
    p["badrow"].write_text(json.dumps({"rows": [{"algorithm": "ssgd", "median_step_ms": 1.0}]}))
    good = {"algorithm": "ssgd", "bandwidth": "none", "workers": 2, "median_step_ms": 1.0, "median_comm_wait_ms": 0.0}
    p["badrun"].write_text(json.dumps({"rows": [good], "all_runs": [good, {k: v for k, v in good.items()
                                                                          if k != "median_step_ms"}]}))
    return {k: str(v) for k, v in p.items()}


def _expect_usage_error(capsys, argv: list[str], expected: str, paths: dict[str, str]) -> None:
    argv = [a.format(**paths) for a in argv]
    expected = expected.format(**paths)
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lowband: error: ") and "Traceback" not in err
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("args, expected", TRAIN, ids=[" ".join(a) for a, _ in TRAIN])
def test_bad_train_input(capsys, paths, tmp_path, args, expected):
    run_dir = [] if any(a in ("--run-dir", "--resume") for a in args) else ["--run-dir", str(tmp_path / "run")]
    _expect_usage_error(capsys, ["train", *FAST, *run_dir, *args], expected, paths)
    assert not (tmp_path / "run").exists()        # nothing was started or written


@pytest.mark.parametrize("args, expected", BENCH, ids=[" ".join(a) for a, _ in BENCH])
def test_bad_bench_input(capsys, paths, tmp_path, args, expected):
    out = [] if "--out" in args else ["--out", str(tmp_path / "bench")]
    _expect_usage_error(capsys, ["bench", *FAST, *out, *args], expected, paths)
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("args, expected", REPORT, ids=[a[0] for a, _ in REPORT])
def test_bad_report_input(capsys, paths, args, expected):
    _expect_usage_error(capsys, ["report", *args], expected, paths)


def _example(tp_name: str):
    return {"int": 3, "float": 0.5, "bool": True, "str": "x", "dict": {}}.get(tp_name)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_option_of_every_algorithm_is_type_checked(name):
    """Generic: a value of the wrong type for any field is refused, naming the field; a string
    of the right type is coerced (the CLI's --option KEY=VALUE)."""
    import dataclasses
    import typing
    cls = ALGORITHMS[name]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        base = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
        base = typing.get_origin(base[0]) or base[0]
        with pytest.raises(OptionError, match=f"option '{f.name}' must be"):
            check_options(cls, {f.name: [1, 2]})                  # a list is no knob's type
        if base in (int, float):
            assert check_options(cls, {f.name: "1"})[f.name] == 1
            with pytest.raises(OptionError, match=f"option '{f.name}' must be >= 0"):
                check_options(cls, {f.name: "-1"})
        if base is bool:
            assert check_options(cls, {f.name: "false"})[f.name] is False


def test_cosine_extension_stretches_the_rest_of_the_schedule():
    """Extending a cosine run from 40 to 60 steps at step 40... or at step 25: the learning
    rate continues from where it was and decays to 0 at the new end; it never rises."""
    import torch
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    straight = CosineSchedule(opt, 40)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(25):
        straight.step()
        lrs.append(opt.param_groups[0]["lr"])
    saved = straight.state_dict()
    resumed = CosineSchedule(opt, 40)          # what a resumed worker builds, then loads
    resumed.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == lrs[-1]
    assert not resumed.retarget(40)            # same length: unchanged (bit-identical resume)
    assert resumed.retarget(60)
    assert opt.param_groups[0]["lr"] == lrs[-1]   # continuous at the resume point
    for _ in range(35):
        resumed.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert all(b <= a for a, b in zip(lrs, lrs[1:])), "the learning rate rose"
    assert lrs[-1] == 0.0 and lrs[-2] > 0.0       # reaches 0 exactly at the new end, step 60
    # the stretched part is the cosine from the resume point: halfway there, half the lr
    assert math.isclose(lrs[25 + 35 // 2 + 1], lrs[25] * 0.5 * (1 + math.cos(math.pi * 18 / 35)))
