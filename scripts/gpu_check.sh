#!/usr/bin/env bash
# The prepared GPU check: one command on the GPU machine, under 5 minutes, results under $OUT.
#
#   OUT=/some/dir bash scripts/gpu_check.sh            # on a GPU machine (python3 with CuPy)
#   OUT=/some/dir bash scripts/gpu_check.sh --emulate  # the same stages on the emulated device
#
# Stages, in order, each bounded by `timeout` and by what is left of the whole budget; each
# writes its files the moment it ends, and a failing stage does not stop the next one:
#   env     versions, devices, CUDA headers, libcublas, project imports  -> env.log
#   models  the tiny model and a TinyLlama-shaped random bf16 model      -> models.log
#   smoke   every kernel once vs NumPy, a bf16 gemm, a captured graph
#           holding a gemm, a pinned copy                                 -> smoke.log, smoke.json
#   tests   REQUIRE_GPU=1 pytest -m gpu -x                                -> pytest.log
#   tp      tensor parallel 2 on the tiny model against one process, two
#           ranks on the one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1), NCCL's
#           version                                                       -> tp.log, tp.json
#   bench   python -m engine.tools.bench_gpu, graphs and eager                  -> bench.log, bench.json
#   gguf    the GGUF block products (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K) at 1..64
#           rows against NumPy, timed beside bf16 cuBLAS                  -> gguf.log, gguf.json
# summary.md: each stage's exit status and seconds, then the tests' and the benchmark's ends.
# --emulate: backend cuda-cpu, the tiny model, PAGEDLLM_EMULATE_GPU=1 for the gpu tests, a small
# benchmark workload. CI runs it (tests/test_gpu_check_script.py); the files are the same.
# Exit status: the number of stages that failed (0: all passed).
set -u
cd "$(dirname "$0")/.."
EMULATE=""
[ "${1:-}" = "--emulate" ] && EMULATE="--emulate"
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"  # the GPU image's python3 holds CuPy, torch and transformers
[ -n "$EMULATE" ] && [ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
if [ -z "${MODELS:-}" ]; then
  MODELS="$(mktemp -d /tmp/pagedllm_models.XXXX)"
  trap 'rm -rf "$MODELS"' EXIT
fi
BUDGET="${BUDGET:-285}"  # seconds for all stages: a second, corrected call still fits
export PYTHONUNBUFFERED=1  # a stage killed by its timeout still leaves its log
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/pagedllm_cupy_cache}"  # compiled kernels
SUMMARY="$OUT/summary.md"
FAILED=0

{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)${EMULATE:+ (emulated device)}"
  echo
  echo "| stage | exit | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"

stage() {  # stage NAME SECONDS LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET - SECONDS)) t0=$SECONDS
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 0 ]; then
    echo "| $name | skipped (budget spent) | 0 |" >> "$SUMMARY"
    FAILED=$((FAILED + 1))
    return
  fi
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$? note=""
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && note=" (timed out at ${limit} s)"
  [ $rc -ne 0 ] && FAILED=$((FAILED + 1))
  echo "| $name | $rc$note | $((SECONDS - t0)) |" >> "$SUMMARY"
  echo "$name: exit $rc$note after $((SECONDS - t0)) s"
}

if [ -n "$EMULATE" ]; then
  export PAGEDLLM_EMULATE_GPU=1
  BENCH_MODEL="$MODELS/tiny"
else
  BENCH_MODEL="$MODELS/tinyllama"
fi
TINY_ONLY=""
[ -n "$EMULATE" ] && TINY_ONLY="--tiny-only"

stage env 20 env.log "$PY" scripts/gpu_env.py $EMULATE
stage models 50 models.log "$PY" scripts/make_random_model.py "$MODELS" $TINY_ONLY
stage smoke 45 smoke.log "$PY" scripts/gpu_smoke.py --out "$OUT" $EMULATE
stage tests 80 pytest.log env REQUIRE_GPU=1 "$PY" -m pytest -m gpu -x -q -rs \
  -p no:cacheprovider tests/test_gpu.py tests/test_capture_rules.py
stage tp 40 tp.log env NCCL_MULTI_RANK_GPU_ENABLE=1 "$PY" scripts/gpu_tp_check.py \
  --model "$MODELS/tiny" --json "$OUT/tp.json" $EMULATE
stage bench 90 bench.log "$PY" -m engine.tools.bench_gpu --model "$BENCH_MODEL" \
  --json "$OUT/bench.json" $EMULATE
stage gguf 30 gguf.log "$PY" scripts/gpu_gguf_check.py --json "$OUT/gguf.json" $EMULATE

{
  echo
  echo "## tests (last lines)"
  echo '```'
  tail -n 15 "$OUT/pytest.log" 2>/dev/null
  echo '```'
  echo
  echo "## tp"
  echo '```'
  tail -n 1 "$OUT/tp.log" 2>/dev/null
  echo '```'
  echo
  echo "## bench"
  echo '```'
  grep -v '^INFO\|^WARNING' "$OUT/bench.log" 2>/dev/null | tail -n 20
  echo '```'
  echo
  echo "## gguf"
  echo '```'
  grep -v '^INFO\|^WARNING' "$OUT/gguf.log" 2>/dev/null | tail -n 20
  echo '```'
} >> "$SUMMARY"
cat "$SUMMARY"
exit "$FAILED"
