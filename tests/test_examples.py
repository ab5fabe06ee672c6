"""The scripts in examples/ run as a user runs them: ``python examples/X.py`` from another
directory, spawning 2 local gloo ranks themselves, for a few steps at tiny sizes."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
SCRIPTS = ("train_lm.py", "train_resnet.py", "ddp_hook.py")
#: a subprocess that runs longer than this has hung (a few steps take seconds)
TIMEOUT_S = 180
TINY_LM = ["--batch-size", "2", "--context", "32", "--d-model", "32", "--layers", "1", "--heads", "2",
           "--eval-windows", "8", "--warmup-steps", "2"]
#: set by torchrun; inherited, they would make the scripts join that world instead of spawning
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FINAL = re.compile(r"^final step (\d+) loss (\S+)(.*)$", re.MULTILINE)


def run_example(script: str, args: list[str], cwd) -> str:
    """Run one example with 2 spawned ranks from ``cwd``; its stdout, after asserting exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--nproc", "2", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def final_line(out: str, steps: int) -> re.Match:
    found = FINAL.search(out)
    assert found, f"no final line in:\n{out}"
    assert int(found[1]) == steps and math.isfinite(float(found[2])), found[0]
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_is_short(script):
    with open(os.path.join(EXAMPLES, script)) as f:
        assert len(f.read().splitlines()) < 150, f"examples/{script} should stay under 150 lines"


def test_train_lm_resume_continues_bit_for_bit(tmp_path):
    """cpsgd (pipelined from step 2, an average in flight at each checkpoint) with bf16
    autocast and clipping: 4 steps with checkpoints at 2 and 4, then a resume from step 2's
    checkpoint ends with the same loss and the same weights."""
    ckpt = tmp_path / "ckpt"
    args = ["--algorithm", "cpsgd", "--option", "warmup_steps=1", "--bf16", "--max-steps", "4",
            "--eval-every", "2", "--ckpt-every", "2", "--ckpt-dir", str(ckpt), *TINY_LM]
    out = run_example("train_lm.py", args, tmp_path)
    whole = final_line(out, 4)
    assert re.search(r"^step 2 val_loss \d", out, re.MULTILINE), out
    assert sorted(os.listdir(ckpt)) == [f"step{s:08d}-rank{r}.pt" for s in (2, 4) for r in (0, 1)]
    for r in (0, 1):
        os.remove(ckpt / f"step{4:08d}-rank{r}.pt")
    resumed = run_example("train_lm.py", [*args, "--resume"], tmp_path)
    assert "resumed from step 2" in resumed, resumed
    assert final_line(resumed, 4)[0] == whole[0]


def test_train_resnet_synthetic(tmp_path):
    out = run_example("train_resnet.py", ["--synthetic", "--algorithm", "lazy", "--max-steps", "3",
                                          "--batch-size", "8", "--test-samples", "64"], tmp_path)
    final = final_line(out, 3)
    accuracy = float(re.search(r"test_accuracy (\S+)", final[3])[1])
    assert 0.0 <= accuracy <= 1.0, final[0]
    if not torch.cuda.is_available():
        assert "lazy on 2 ranks, cpu, GradScaler off" in out, out


def test_ddp_hook_compresses(tmp_path):
    """Two fp32 iterations, then two through the 2-bit codec: fewer bytes than fp32 all-reduce."""
    out = run_example("ddp_hook.py", ["--synthetic", "--compressor", "2bit", "--start-compress-iter", "2",
                                      "--max-steps", "4", "--batch-size", "8"], tmp_path)
    final = final_line(out, 4)
    ratio = float(re.search(r"bytes_sent/fp32 (\S+)", final[3])[1])
    assert 0.0 < ratio < 1.0, final[0]
