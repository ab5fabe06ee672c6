#!/usr/bin/env bash
# One-shot GPU check of lowband, for a machine with one CUDA GPU (issue 12). Run from the
# repository root:
#
#     make venv && bash benchmarks/gpu_check.sh   # OUT=dir also keeps everything printed in
#                                                 # $OUT/gpu_check.txt, and the bench results
#
# Parts, each under its own timeout; a failing part does not stop the others, and the script
# exits 1 at the end if any part failed:
#   versions  torch, CUDA and the GPU
#   codecs    codec encode+decode throughput on the GPU against torch.clone, and the fused
#             bucket codecs (ResNet-50's tensors, 2 chunks) on the GPU and on the CPU
#   tests     the CUDA-marked tests (pytest -m cuda: tests/test_cuda.py and, when triton
#             imports, tests/test_triton_codecs.py), among them the fused reducers on CUDA
#             against the CPU's native kernels bit for bit, the pipeline's side stream ordered
#             by events with the compute stream, and waits timed with CUDA events, over gloo
#             and NCCL
#   train-2   every algorithm, 2 ranks over gloo with CUDA tensors (LOWBAND_BACKEND=gloo; with
#             one GPU NCCL would refuse two ranks on it), a few steps each (lowband bench
#             --device cuda); compressed, cpsgd (adaptive period) and ddp-powersgd leave their
#             warm-ups after 3 steps, so their compressed steps run, on the pipeline's side
#             stream for the first two; ssgd runs with gradient_as_bucket_view (the
#             average in the bucket, the gradients its views)
#   train-1   the same, 1 rank over NCCL
#   train-N-nccl  (2 or more GPUs only) the same, one rank per GPU (up to 4) over NCCL
#   train-2-extras  2 ranks over gloo: --micro-batches 2 (gradient accumulation) for ssgd,
#             compressed, cpsgd and lazy, and AdamW under compressed and cpsgd (which fused
#             optimizer step cpsgd took, or why none, is printed)
#   profile   torch.profiler over steady steps of noop, ssgd, compressed and cpsgd at one rank
#             (benchmarks/step_profile.py): where a small model's step goes on the GPU, host
#             and device, per operator (runs last, alone)
# versions and codecs run first, alone (codecs is a timing); the other three run side by side
# on a machine with 8 or more cores (GPU_CHECK_PARALLEL=0 or 1 overrides), one after the other
# otherwise: 107 s in all on a 16-core H200 machine (2026-12-04, before the profile part was
# added), under 8 minutes sequentially.
# Each part's output is printed whole when it ends (in the parts' order). Without CUDA the GPU
# parts print "skipped: no CUDA" and count as skipped, not failed. Bench results (results.json
# of each training part) are copied to $OUT when it is set.
set -u

# the project's venv (make venv) when there is one, else $PYTHON, else the python on PATH
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    PY=$PWD/.venv/bin/python
else
    PY=${PYTHON:-$(command -v python || command -v python3)}
fi
export PY
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
WORK=${TMPDIR:-/tmp}/gpu_check.$$
STEPS=${GPU_CHECK_STEPS:-10}
LANES=${GPU_CHECK_LANES:-$([ "$(nproc)" -ge 8 ] && echo 3 || echo 1)}   # training runs side by side
export WORK STEPS LANES
declare -a SUMMARY=()
FAILED=0

part() {   # part NAME TIMEOUT_S NEEDS_CUDA COMMAND...: runs it, its output to $WORK/NAME.log
    local name=$1 limit=$2 needs=$3
    shift 3
    local log=$WORK/$name.log
    echo "=== $name (timeout ${limit}s) ===" >"$log"
    if [ "$needs" = 1 ] && [ "$HAVE_CUDA" != 1 ]; then
        echo "skipped: no CUDA" >>"$log"
        echo "$name: skipped: no CUDA" >"$WORK/$name.result"
        return
    fi
    local t0=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 || rc=$?
    local took=$((SECONDS - t0))
    if [ "$rc" = 0 ]; then
        echo "$name: ok (${took}s)" >"$WORK/$name.result"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "$name: FAILED: timed out after ${limit}s" >"$WORK/$name.result"
    else
        echo "$name: FAILED: exit status $rc (${took}s)" >"$WORK/$name.result"
    fi
}

show() {   # show NAME...: print the parts' logs and add their results to the summary
    local name
    for name in "$@"; do
        echo
        cat "$WORK/$name.log"
        SUMMARY+=("$(cat "$WORK/$name.result")")
        case "$(cat "$WORK/$name.result")" in *FAILED*) FAILED=1 ;; esac
    done
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

bench_one() {   # bench_one WORKERS DIR SPEC: one algorithm's short run, its output to a log of its own
    local workers=$1 dir=$2 spec=$3
    local log=$dir/${spec%%:*}.log
    if "$PY" -m lowband.app.cli bench --device cuda --workers "$workers" --algorithms "$spec" --timeout 60 \
        --dataset synthetic --max-steps "$STEPS" --no-progress --out "$dir/${spec%%:*}" >"$log" 2>&1; then
        echo "ok: $spec x$workers"
    else
        echo "FAILED: $spec x$workers (exit status $?)"
    fi
}

train() {   # train WORKERS BACKEND: every algorithm, a few steps, on the GPU (short warm-ups: see above)
    local workers=$1 dir=$WORK/bench-$1w-$2 algorithms spec
    export LOWBAND_BACKEND=$2
    algorithms=$("$PY" -c "
from lowband.algorithms import ALGORITHMS
short = {'compressed': ':warmup_steps=3',
         'cpsgd': ':warmup_steps=3:correction_period=3:adapt_period=true',
         'ddp-powersgd': ':start_powerSGD_iter=3', 'ssgd': ':gradient_as_bucket_view=true'}
print(' '.join(name + short.get(name, '') for name in sorted(ALGORITHMS)))") || return 1
    mkdir -p "$dir"
    # one bench per algorithm (one failure does not hide the others' results), LANES at a time
    printf '%s\n' $algorithms | xargs -P "$LANES" -I{} bash -c 'bench_one "$0" "$1" "$2"' "$workers" "$dir" {} \
        >"$dir/status.txt"
    for spec in $algorithms; do
        echo "--- $spec x$workers"
        grep -v "UserWarning\|return func(\|Guessing device ID\|ax.legend" "$dir/${spec%%:*}.log"
    done
    "$PY" - "$dir" <<'EOF'
import glob, json, os, sys
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*", "results.json"))):
    with open(f) as fh:
        rows += json.load(fh)["rows"]
with open(os.path.join(sys.argv[1], "results.json"), "w") as fh:
    json.dump({"rows": rows}, fh, indent=1)
print(f"{len(rows)} result rows in {os.path.join(sys.argv[1], 'results.json')}")
EOF
    sort "$dir/status.txt"
    ! grep -q FAILED "$dir/status.txt"
}

extras() {   # extras DEVICE: what train-2 leaves out, 2 ranks over gloo: gradient accumulation
    # (--micro-batches 2: engine.no_sync() with CUDA gradients) for the main algorithms, and AdamW
    # under cpsgd (on CUDA its local update takes TentativeStep's torch operations: the fused
    # native step is CPU-only) and compressed; past the same short warm-ups as train
    local device=${1:-cuda} dir=$WORK/bench-extras rc=0
    export LOWBAND_BACKEND=gloo
    mkdir -p "$dir"
    local common=(--device "$device" --workers 2 --timeout 60 --dataset synthetic --max-steps "$STEPS" --no-progress)
    "$PY" -m lowband.app.cli bench "${common[@]}" --micro-batches 2 --out "$dir/micro" \
        --algorithms ssgd,compressed:warmup_steps=3,cpsgd:warmup_steps=3:correction_period=3,lazy || rc=1
    "$PY" -m lowband.app.cli bench "${common[@]}" --optimizer adamw --lr 0.001 --out "$dir/adamw" \
        --algorithms compressed:warmup_steps=3,cpsgd:warmup_steps=3:correction_period=3 || rc=1
    "$PY" - "$dir/adamw" <<'EOF2' || rc=1
import glob, json, os, sys
found = sorted(glob.glob(os.path.join(sys.argv[1], "runs", "*cpsgd*", "summary.json")))
for path in found:   # the run's summary: which fused optimizer step cpsgd took, or why none
    summary = json.load(open(path)).get("algorithm_summary") or {}
    print(os.path.basename(os.path.dirname(path)), {k: summary.get(k) for k in ("fused_step", "fused_step_unavailable")})
sys.exit(0 if found else "no cpsgd summary.json under " + sys.argv[1])
EOF2
    return $rc
}

tests() {   # the CUDA-marked tests; the Triton kernels' file too where triton imports
    local files=(tests/test_cuda.py)
    if [ -f tests/test_triton_codecs.py ] && "$PY" -c "import triton" 2>/dev/null; then
        files+=(tests/test_triton_codecs.py)
    fi
    local workers=()   # pytest-xdist, where installed, runs the files' tests 4 at a time
    if "$PY" -c "import xdist" 2>/dev/null && [ "$(nproc)" -ge 8 ]; then workers=(-n 4); fi
    "$PY" -m pytest -q -m cuda -p no:cacheprovider "${workers[@]}" "${files[@]}"
}

main() {
    echo "lowband gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null; [ $? = 1 ] && echo ' (with local changes)'), $(nproc) cores"
    mkdir -p "$WORK"
    HAVE_CUDA=$(timeout 60 "$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
    local gpus nccl_ranks extra=()
    gpus=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    nccl_ranks=$((gpus < 4 ? gpus : 4))
    if [ "$nccl_ranks" -ge 2 ]; then extra=("train-$nccl_ranks-nccl"); fi
    local parallel=${GPU_CHECK_PARALLEL:-$([ "$(nproc)" -ge 8 ] && echo 1 || echo 0)}
    part versions 30 0 bash -c versions
    show versions
    part codecs 60 1 "$PY" benchmarks/gpu_codecs.py --device cuda --reps 5 --bucket --chunks 2
    show codecs
    if [ "$parallel" = 1 ]; then
        echo
        echo "(tests, train-2, train-1 ${extra[*]:+and ${extra[*]} }run side by side; each part's output follows when all are done)"
        part tests 280 1 bash -c tests &
        part train-2 200 1 bash -c "train 2 gloo" &
        part train-1 150 1 bash -c "train 1 nccl" &
        if [ ${#extra[@]} -gt 0 ]; then part "${extra[0]}" 200 1 bash -c "train $nccl_ranks nccl" & fi
        wait
        part train-2-extras 150 1 bash -c "extras cuda"
    else
        part tests 280 1 bash -c tests
        part train-2 160 1 bash -c "train 2 gloo"
        part train-1 100 1 bash -c "train 1 nccl"
        if [ ${#extra[@]} -gt 0 ]; then part "${extra[0]}" 160 1 bash -c "train $nccl_ranks nccl"; fi
        part train-2-extras 120 1 bash -c "extras cuda"
    fi
    show tests train-2 train-1 "${extra[@]}" train-2-extras
    part profile 120 1 "$PY" benchmarks/step_profile.py --device cuda --algorithms noop,ssgd,compressed,cpsgd --top 12
    show profile
    if [ -n "${OUT:-}" ]; then
        for b in 2w-gloo 1w-nccl "${nccl_ranks}w-nccl"; do
            if [ -f "$WORK/bench-$b/results.json" ]; then cp "$WORK/bench-$b/results.json" "$OUT/bench-$b.json"; fi
        done
    fi
    echo
    echo "=== summary ==="
    printf '%s\n' "${SUMMARY[@]}"
    return $FAILED
}

export -f versions bench_one train extras tests   # parts run as `timeout bash -c NAME`
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/gpu_check.txt"
    exit "${PIPESTATUS[0]}"
fi
main
