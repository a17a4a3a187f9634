#!/usr/bin/env bash
# The prepared GPU check: one command on the GPU machine, under 8 minutes, results under $OUT.
#
#   OUT=/some/dir scripts/gpu_check.sh
#
# Stages (each bounded by `timeout`; a failing stage is recorded and the next one still runs):
#   env     nvidia-smi, CuPy and NVRTC versions                          -> env.log
#   models  the tiny model and a TinyLlama-shaped random bf16 model      -> models.log
#   tests   pytest -m gpu tests/test_gpu.py (kernels, gemm, engine)      -> pytest.log
#   bench   python -m engine.bench_gpu on the TinyLlama-shaped model     -> bench.log, bench.json
# summary.md lists each stage's exit status and time, then the benchmark's figures.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
MODELS="${MODELS:-/tmp/pagedllm_models}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.md"
{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "| stage | exit | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"

stage() {  # stage NAME SECONDS LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  echo "| $name | $rc$([ $rc -eq 124 ] && echo ' (timed out)') | $((SECONDS - t0)) |" >> "$SUMMARY"
  echo "$name: exit $rc after $((SECONDS - t0)) s"
}

stage env 30 env.log bash -c "nvidia-smi; $PY -c 'import cupy, numpy; \
print(\"cupy\", cupy.__version__, \"numpy\", numpy.__version__); \
print(\"nvrtc\", cupy.cuda.nvrtc.getVersion(), \"devices\", cupy.cuda.runtime.getDeviceCount())'"
stage models 100 models.log "$PY" scripts/make_random_model.py "$MODELS"
stage tests 130 pytest.log "$PY" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider
stage bench 210 bench.log "$PY" -m engine.bench_gpu --model "$MODELS/tinyllama" \
  --json "$OUT/bench.json"

{
  echo
  echo "## tests (last lines)"
  echo '```'
  tail -n 15 "$OUT/pytest.log"
  echo '```'
  echo
  echo "## bench"
  echo '```'
  grep -v '^INFO' "$OUT/bench.log" | tail -n 20
  echo '```'
} >> "$SUMMARY"
cat "$SUMMARY"
