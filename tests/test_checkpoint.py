"""Checkpoint and resume through ``lowband train``: a crash halfway through writing a
checkpoint leaves the previous one intact and loadable, and a run resumed from it ends with
bit-identical state to one that never stopped (``CRASH_ALGORITHMS``: CP-SGD with a step in
flight and DDP by default; every algorithm with LOWBAND_ALL_ALGORITHMS=1). The compressing
algorithms run past their warm-up (``PAST_WARMUP``) before the first checkpoint: compressed
SGD resumes with residuals from the background queue, CP-SGD with a step in flight (W, the
in-flight average, residuals, the correction schedule)."""
from __future__ import annotations

import contextlib
import glob
import io
import json
import os

import pytest
import torch

from lowband.app import checkpoint
from lowband.app.config import TrainConfig
from lowband.app.cli import main as cli_main
from lowband.app.metrics import read_jsonl

from .cli_runs import CRASH_ALGORITHMS, PAST_WARMUP, SMALL, train

TOTAL = 12          # steps of every run
EVERY = 4           # --checkpoint-every
STOP_AT = 8         # the interrupted run dies while writing this checkpoint
WARMUP = 3          # PAST_WARMUP's warm-up: checkpoints at 4, 8, 12 all fall in the pipelined phase
# cosine LR (scheduler state) and momentum (optimizer state) make a sloppy resume visible
FLAGS = [*SMALL, "--max-steps", str(TOTAL), "--checkpoint-every", str(EVERY), "--lr-schedule", "cosine",
         "--timeout", "20"]


def assert_same(a, b, where: str = "") -> None:
    """Recursive, bit-exact equality of checkpoint contents."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def final_states(run_dir: str) -> list[dict]:
    manifest = checkpoint.read_manifest(run_dir)
    assert manifest["step"] == TOTAL
    return [checkpoint.load(run_dir, r, 2, manifest) for r in range(2)]


TRAJECTORY = ("model", "optimizer", "scheduler", "engine", "rng", "epoch", "step_in_epoch")


def train_here(args: list[str]) -> tuple[int, str]:
    """``lowband train`` run by this process (``cli.main``, which the command runs): the same
    launcher and worker processes, without the command's own interpreter start-up (torch and
    lowband imported once more, seconds of CPU on a loaded 2-core machine). Its exit status and
    what it wrote to stderr; the workers write to this process's descriptors, as to the
    command's (pytest shows them with a failure)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli_main(["train", *args])
    return rc, err.getvalue()


def flags(algorithm: str) -> list[str]:
    return [*FLAGS, "--algorithm", algorithm, *PAST_WARMUP.get(algorithm, [])]


def assert_same_trajectory(run_dir: str, reference_dir: str) -> None:
    for got, want in zip(final_states(run_dir), final_states(reference_dir)):
        for key in TRAJECTORY:
            if key == "engine":     # wall-clock waits differ; everything else must not
                got[key]["stats"].pop("comm_wait_s"), want[key]["stats"].pop("comm_wait_s")
            assert_same(got[key], want[key], key)
    steps = [r["step"] for r in read_jsonl(os.path.join(run_dir, "steps.jsonl"))]
    assert steps == list(range(1, TOTAL + 1))        # metrics continued, no step twice


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, str]:
    """One uninterrupted run per algorithm, made on first use (:func:`train_here`)."""
    runs: dict[str, str] = {}

    def get(algorithm: str) -> str:
        if algorithm not in runs:
            run_dir = str(tmp_path_factory.mktemp(f"reference-{algorithm}"))
            rc, err = train_here([*flags(algorithm), "--run-dir", run_dir])
            assert rc == 0, err
            runs[algorithm] = run_dir
        return runs[algorithm]
    return get


@pytest.mark.parametrize("algorithm", CRASH_ALGORITHMS)
def test_crash_mid_checkpoint_then_resume_equals_uninterrupted_run(tmp_path, reference, algorithm):
    """Rank 1 is SIGKILLed halfway through writing its checkpoint of step STOP_AT: the
    previous checkpoint survives, and resuming from it reproduces the uninterrupted run. The
    crash goes through the command (its exit status and message); the reference and the resume
    run in this process (:func:`train_here`), the same launcher and workers."""
    run_dir = str(tmp_path / "run")
    crashed = train([*flags(algorithm), "--run-dir", run_dir],
                    LOWBAND_FAULT=f"checkpoint-write@{STOP_AT}", LOWBAND_FAULT_RANK="1")
    assert crashed.returncode != 0
    assert "lowband: error: worker rank 1 was killed by signal SIGKILL (first to fail)" in crashed.stderr, crashed.stderr
    # the crash really happened mid-write: rank 1's half-written temp file is there ...
    half = glob.glob(os.path.join(checkpoint.step_dir(run_dir, STOP_AT), "rank1.pt.tmp.*"))
    assert len(half) == 1 and os.path.getsize(half[0]) > 0
    with pytest.raises(Exception):
        torch.load(half[0], weights_only=True)
    # ... and the manifest still names the previous checkpoint, complete and loadable
    manifest = checkpoint.read_manifest(run_dir)
    assert manifest["step"] == STOP_AT - EVERY
    for r in range(2):
        path = os.path.join(run_dir, checkpoint.DIRNAME, manifest["dir"], checkpoint.rank_file(r))
        state = torch.load(path, weights_only=True)
        assert state["step"] == STOP_AT - EVERY and "model" in state
    algo_state = state["engine"]["algorithm"]
    if algorithm == "cpsgd":     # the checkpoint really holds a step in flight
        assert algo_state["pipelining"] and "in_flight" in algo_state and "global_weights" in algo_state
    elif algorithm == "compressed":
        assert algo_state["steps_done"] == STOP_AT - EVERY > WARMUP
    rc, err = train_here([*flags(algorithm), "--resume", run_dir])
    assert rc == 0, err
    assert_same_trajectory(run_dir, reference(algorithm))
    if algorithm == "cpsgd":     # the correction schedule continued where it stopped: 0, 1, 2, 0, ...
        phases = [r["correction_phase"] for r in read_jsonl(os.path.join(run_dir, "steps.jsonl"))]
        assert phases == [None] * WARMUP + [(t - WARMUP) % 3 for t in range(WARMUP, TOTAL)]
    # superseded and half-written checkpoint directories are pruned (keep 2)
    kept = sorted(os.listdir(os.path.join(run_dir, checkpoint.DIRNAME)))
    assert kept == sorted([os.path.basename(checkpoint.step_dir(run_dir, s)) for s in (TOTAL - EVERY, TOTAL)] + [checkpoint.MANIFEST])


@pytest.mark.parametrize("change, message", [
    (["--workers", "3"], "the checkpoint was written by 2 workers, but this run has 3; resume with --workers 2"),
    (["--lr", "0.01"], "the run configuration differs from the checkpointed one (lr: checkpoint 0.05, now 0.01)"),
])
def test_resume_with_a_different_setup_is_a_usage_error(reference, capsys, change, message):
    run_dir = reference("ssgd")
    assert cli_main(["train", *FLAGS, *change, "--resume", run_dir]) == 2
    assert message in capsys.readouterr().err


def test_options_naming_removed_knobs_resume_at_the_behaviour_the_code_now_has():
    """A run started by an earlier version with ``--option inline_last_bucket=...`` (a knob
    ``compressed`` no longer has): continued where that value is the code's one behaviour now,
    refused with one line naming the knob otherwise."""
    config = {**TrainConfig(algorithm="compressed").__dict__}
    for value in (True, "true", "True"):
        saved = {**config, "algorithm_options": {"inline_last_bucket": value, "warmup_steps": 3}}
        checkpoint.check_resumable({"world_size": 2, "config": saved},
                                   {**config, "algorithm_options": {"warmup_steps": 3}}, 2)
    saved = {**config, "algorithm_options": {"encode_from_gradients": False}}
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.check_resumable({"world_size": 2, "config": saved}, config, 2)
    assert str(refused.value).startswith("the checkpoint was written with compressed's encode_from_gradients=False, "
                                         "a knob this version of lowband no longer has: it always runs as "
                                         "encode_from_gradients=True"), refused.value
    # the options still compare as before: the knobs the run kept must hold the same values
    saved = {**config, "algorithm_options": {"inline_last_bucket": True, "warmup_steps": 3}}
    with pytest.raises(checkpoint.CheckpointError, match="algorithm_options"):
        checkpoint.check_resumable({"world_size": 2, "config": saved}, config, 2)


def test_options_naming_an_added_knob_at_its_earlier_value_continue_an_earlier_run():
    """A cp-diloco run from before ``inner_lr_scale`` (its steps at the optimizer's rate) is
    continued with ``--option inner_lr_scale=1``: the options compare as the same run (each
    rank's engine state, which holds the whole configuration, has the last word); another
    value is a different run."""
    config = {**TrainConfig(algorithm="cp-diloco").__dict__}
    old = {"world_size": 2, "config": {**config, "algorithm_options": {}}}
    for value in (1, 1.0, "1", "1.0"):
        checkpoint.check_resumable(old, {**config, "algorithm_options": {"inner_lr_scale": value}}, 2)
    checkpoint.check_resumable(old, {**config, "algorithm_options": {}}, 2)
    for value in (1.5, "auto", True):
        with pytest.raises(checkpoint.CheckpointError, match="algorithm_options"):
            checkpoint.check_resumable(old, {**config, "algorithm_options": {"inner_lr_scale": value}}, 2)
    # a knob the run did set keeps its value
    set_then = {"world_size": 2, "config": {**config, "algorithm_options": {"inner_lr_scale": 2.0}}}
    with pytest.raises(checkpoint.CheckpointError, match="algorithm_options"):
        checkpoint.check_resumable(set_then, {**config, "algorithm_options": {"inner_lr_scale": 1}}, 2)


def test_resume_without_checkpoint_is_a_usage_error(tmp_path, capsys):
    assert cli_main(["train", *FLAGS, "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint to resume from" in err and "--checkpoint-every" in err


def test_checkpoint_files_hold_only_weights_only_types(reference):
    manifest = json.loads(open(checkpoint.manifest_path(reference("ssgd"))).read())
    for r in range(2):
        path = os.path.join(reference("ssgd"), checkpoint.DIRNAME, manifest["dir"], checkpoint.rank_file(r))
        torch.load(path, weights_only=True)      # raises on anything but tensors / plain data


def _copy_run(src: str, dst: str) -> str:
    import shutil
    shutil.copytree(src, dst)
    return dst


def _snapshot(run_dir: str) -> dict[str, tuple[int, int]]:
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_mtime_ns, os.path.getsize(os.path.join(d, f)))
            for d, _, files in os.walk(run_dir) for f in files}


def test_a_checkpoint_with_flipped_bits_is_refused_naming_the_file(reference, tmp_path, capsys):
    """64 flipped bits inside rank 1's file (torch.load would load them silently): resume is
    one line naming the file, exit 2, and nothing in the run directory changes."""
    run_dir = _copy_run(reference("ssgd"), str(tmp_path / "run"))
    manifest = checkpoint.read_manifest(run_dir)
    path = checkpoint.file_path(run_dir, manifest, 1)
    data = bytearray(open(path, "rb").read())
    middle = len(data) // 2
    for i in range(8):
        data[middle + i] ^= 0xFF
    open(path, "wb").write(bytes(data))
    before = _snapshot(run_dir)
    assert cli_main(["train", *FLAGS, "--algorithm", "ssgd", "--resume", run_dir]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lowband: error: checkpoint file {path} is corrupted: its SHA-256 differs from the one "
                   "recorded in the manifest when it was written"]
    assert _snapshot(run_dir) == before
    # a worker started some other way (torchrun) refuses it too
    with pytest.raises(checkpoint.CheckpointError, match="rank1.pt is corrupted"):
        checkpoint.load(run_dir, 1, 2)
    checkpoint.load(run_dir, 0, 2)            # the intact file still loads


def test_an_edited_manifest_is_refused(reference, tmp_path, capsys):
    run_dir = _copy_run(reference("ssgd"), str(tmp_path / "run"))
    path = checkpoint.manifest_path(run_dir)
    manifest = json.load(open(path))
    manifest["step_in_epoch"] += 1
    open(path, "w").write(json.dumps(manifest))
    assert cli_main(["train", *FLAGS, "--algorithm", "ssgd", "--resume", run_dir]) == 2
    assert f"checkpoint manifest {path} is corrupted" in capsys.readouterr().err


def test_ranks_that_load_different_weights_refuse_to_train(reference, tmp_path):
    """A checkpoint whose files are intact but hold different replicated weights (saved
    wrong; the SHA-256 cannot tell): every worker stops after loading, naming the parameter."""
    import io
    run_dir = _copy_run(reference("ssgd"), str(tmp_path / "run"))
    manifest = checkpoint.read_manifest(run_dir)
    path = checkpoint.file_path(run_dir, manifest, 1)
    state = torch.load(path, weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name].view(-1)[0] += 1e-3
    buf = io.BytesIO()
    torch.save(state, buf)
    open(path, "wb").write(buf.getvalue())
    manifest["sha256"][checkpoint.rank_file(1)] = checkpoint.sha256(buf.getvalue())
    manifest["manifest_sha256"] = checkpoint._manifest_digest(manifest)
    open(checkpoint.manifest_path(run_dir), "w").write(json.dumps(manifest))
    resumed = train([*FLAGS, "--algorithm", "ssgd", "--resume", run_dir, "--max-steps", str(TOTAL + 4)])
    assert resumed.returncode == 1, resumed.stderr
    for rank in range(2):
        assert f"lowband worker rank {rank}: error: after loading the checkpoint of step {TOTAL}, ranks hold " \
               f"different values of parameter {name!r}" in resumed.stderr, resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert [r["step"] for r in read_jsonl(os.path.join(run_dir, "steps.jsonl"))][-1] == TOTAL   # no step taken
