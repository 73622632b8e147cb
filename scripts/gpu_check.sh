#!/usr/bin/env bash
# One-command check on a machine with one CUDA GPU (budget: under 9 minutes):
#   1. the CUDA-marked tests (pytest -m gpu);
#   2. the quickstart recipe on --device cuda (train, score, prune, fine-tune, evaluate, report);
#   3. the LLaMA-3-8B-shape figures (scripts/bench_scale.py --device cuda --shape llama3-8b): surgery,
#      head_measures, criteria, pruned vs unpruned prefill / decode speed, in one table;
#   4. peak memory and time in bf16 (scripts/bench_memory.py --only large --device cuda): a LLaMA-3-8B-shape
#      shrink (MEMORY_ARGS' --large-layers, default 8: the whole-model float64 statistics of 32 layers fit no
#      single GPU; 32 once shrink is layer-wise) and a Qwen3-30B-A3B-shape REAP expert cut
#      (4 layers of 128 experts), with the memory model's predictions beside them.
# Each step has its own time limit; a summary line per step at the end; exit status 1 if any failed.
#
#   bash scripts/gpu_check.sh                     # writes under runs/gpu_check/
#   OUT_DIR=/tmp/check PYTHON=.venv/bin/python bash scripts/gpu_check.sh
#   SCALE_ARGS="--layers 16" bash scripts/gpu_check.sh    # half the depth where memory is short
#   bash scripts/gpu_check.sh --cpu-smoke         # the script's own plumbing on a CPU: gpu tests (skipped),
#                                                 # quickstart --dry-run, bench_scale --shape tiny,
#                                                 # bench_memory --quick
#   MEMORY_ARGS="--large-layers 32" bash scripts/gpu_check.sh   # the full 8B depth (layer-wise shrink)
# Step limits (seconds, sum 540): LIMIT_TESTS=80 LIMIT_QUICKSTART=100 LIMIT_SCALE=120 LIMIT_MEMORY=240.
#
# Not run (too long for the budget); printed at the end: the second paper's optimizer comparison
# at nanoGPT scale, scripts/bench_symmetry.py --preset nanogpt --device cuda.
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
OUT_DIR="${OUT_DIR:-runs/gpu_check}"
SCALE_ARGS="${SCALE_ARGS:-}"
MEMORY_ARGS="${MEMORY_ARGS:---large-layers 8}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=cuda SHAPE=llama3-8b QUICKSTART_EXTRA=() MEMORY_MODE=(--only large)
case "${1:-}" in
    "") ;;
    --cpu-smoke) DEVICE=cpu SHAPE=tiny QUICKSTART_EXTRA=(--dry-run) MEMORY_MODE=(--quick --layers 2) MEMORY_ARGS="" ;;
    *) echo "error: unknown argument ${1}; the only option is --cpu-smoke" >&2; exit 2 ;;
esac
mkdir -p "$OUT_DIR"

if [ "$DEVICE" = cuda ]; then
    if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "error: torch sees no CUDA device; gpu_check needs one (--cpu-smoke tests the script itself)" >&2
        exit 2
    fi
    "$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}')"
fi

declare -a SUMMARY=()
FAILED=0
START=$SECONDS

step() {  # step NAME LIMIT_S LOG COMMAND...
    local name=$1 limit=$2 log=$3
    shift 3
    echo
    echo "=== $name (limit ${limit} s): $*"
    local t0=$SECONDS rc
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0)) status=PASS
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="TIMEOUT"
        FAILED=1
    elif [ "$rc" -ne 0 ]; then
        status="FAIL (exit $rc)"
        FAILED=1
    fi
    SUMMARY+=("$(printf '%-34s %-16s %4d s   log: %s' "$name" "$status" "$took" "$log")")
}

step "pytest -m gpu" "${LIMIT_TESTS:-80}" "$OUT_DIR/pytest_gpu.log" \
    "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/
step "quickstart recipe on $DEVICE" "${LIMIT_QUICKSTART:-100}" "$OUT_DIR/quickstart.log" \
    "$PYTHON" -c "from sinv_prune.cli import main; main()" run recipes/quickstart.yaml --device "$DEVICE" \
    --output "$OUT_DIR/quickstart" --overwrite --quiet "${QUICKSTART_EXTRA[@]}"
# shellcheck disable=SC2086  # SCALE_ARGS is a list of options
step "bench_scale $SHAPE on $DEVICE" "${LIMIT_SCALE:-120}" "$OUT_DIR/bench_scale.log" \
    "$PYTHON" scripts/bench_scale.py --device "$DEVICE" --shape "$SHAPE" --json "$OUT_DIR/bench_scale.json" $SCALE_ARGS
# shellcheck disable=SC2086  # MEMORY_ARGS is a list of options
step "bench_memory ${MEMORY_MODE[*]} on $DEVICE" "${LIMIT_MEMORY:-240}" "$OUT_DIR/bench_memory.log" \
    "$PYTHON" scripts/bench_memory.py "${MEMORY_MODE[@]}" --device "$DEVICE" --json "$OUT_DIR/bench_memory.json" $MEMORY_ARGS

echo
echo "=== summary ($((SECONDS - START)) s in all)"
printf '%s\n' "${SUMMARY[@]}"
echo
echo "not run (longer than the 9-minute budget): the second paper's optimizer claim at nanoGPT scale:"
echo "  $PYTHON scripts/bench_symmetry.py --preset nanogpt --device cuda --json $OUT_DIR/symmetry_nanogpt.json --plot $OUT_DIR/symmetry_nanogpt.png"
exit $FAILED
