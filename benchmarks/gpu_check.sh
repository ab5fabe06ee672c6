#!/usr/bin/env bash
# One-shot GPU check of lowband, for a machine with one CUDA GPU (issue 12). Run from the
# repository root:
#
#     make venv && bash benchmarks/gpu_check.sh   # OUT=dir also keeps everything printed in
#                                                 # $OUT/gpu_check.txt, and the bench results
#
# Parts, each under its own timeout (7 min 50 s at most in all, with the CUDA probe: 30 + 25 +
# 155 + 40 + 140 + 80 s); a failing part does not stop the others, and the script exits 1 at
# the end if any part failed:
#   versions  torch, CUDA and the GPU
#   tests     the CUDA-marked tests (pytest -m cuda: tests/test_cuda.py), among them the
#             pipeline's side stream ordered by events with the compute stream, and waits
#             timed with CUDA events (lowband.streams), over gloo and NCCL
#   codecs    codec encode+decode throughput on the GPU against torch.clone
#   train-2   every algorithm, 2 ranks over gloo with CUDA tensors (NCCL refuses two ranks on
#             one GPU), a few steps each (lowband bench --device cuda); compressed, cpsgd
#             (adaptive period) and ddp-powersgd leave their warm-ups after 3 steps, so their
#             compressed steps run, on the pipeline's side stream for the first two
#   train-1   the same, 1 rank over NCCL
# Without CUDA the GPU parts print "skipped: no CUDA" and count as skipped, not failed.
set -u

# the project's venv (make venv) when there is one, else $PYTHON, else the python on PATH
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    PY=$PWD/.venv/bin/python
else
    PY=${PYTHON:-$(command -v python || command -v python3)}
fi
export PY
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
WORK=${OUT:-${TMPDIR:-/tmp}}/gpu_check
STEPS=${GPU_CHECK_STEPS:-10}
export WORK STEPS
declare -a SUMMARY=()
FAILED=0

part() {   # part NAME TIMEOUT_S NEEDS_CUDA COMMAND...
    local name=$1 limit=$2 needs=$3
    shift 3
    echo
    echo "=== $name (timeout ${limit}s) ==="
    if [ "$needs" = 1 ] && [ "$HAVE_CUDA" != 1 ]; then
        echo "skipped: no CUDA"
        SUMMARY+=("$name: skipped: no CUDA")
        return
    fi
    local t0=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    local took=$((SECONDS - t0))
    if [ "$rc" = 0 ]; then
        SUMMARY+=("$name: ok (${took}s)")
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        SUMMARY+=("$name: FAILED: timed out after ${limit}s")
        FAILED=1
    else
        SUMMARY+=("$name: FAILED: exit status $rc (${took}s)")
        FAILED=1
    fi
}

versions() {
    "$PY" - <<'EOF' || return 1
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}")
print(f"CUDA available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
print(f"NCCL available: {torch.distributed.is_nccl_available()}"
      + (f", version {'.'.join(map(str, torch.cuda.nccl.version()))}" if torch.cuda.is_available() else ""))
EOF
    if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L; fi
}

train() {   # train WORKERS: every algorithm, a few steps, on the GPU (short warm-ups: see above)
    local workers=$1 algorithms
    algorithms=$("$PY" -c "
from lowband.algorithms import ALGORITHMS
short = {'compressed': ':warmup_steps=3', 'cpsgd': ':warmup_steps=3:correction_period=3:adapt_period=true',
         'ddp-powersgd': ':start_powerSGD_iter=3'}
print(','.join(name + short.get(name, '') for name in sorted(ALGORITHMS)))") || return 1
    "$PY" -m lowband.cli bench --device cuda --workers "$workers" --algorithms "$algorithms" \
        --dataset synthetic --max-steps "$STEPS" --no-progress --out "$WORK/bench-${workers}w"
}

main() {
    echo "lowband gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    mkdir -p "$WORK"
    HAVE_CUDA=$(timeout 30 "$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
    part versions 25 0 bash -c versions
    part tests 155 1 "$PY" -m pytest -q -m cuda tests/test_cuda.py
    part codecs 40 1 "$PY" benchmarks/gpu_codecs.py --device cuda --reps 5
    part train-2 140 1 bash -c "train 2"
    part train-1 80 1 bash -c "train 1"
    echo
    echo "=== summary ==="
    printf '%s\n' "${SUMMARY[@]}"
    return $FAILED
}

export -f versions train   # parts run as `timeout bash -c NAME`
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/gpu_check.txt"
    exit "${PIPESTATUS[0]}"
fi
main
