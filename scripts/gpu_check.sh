#!/usr/bin/env bash
# The prepared GPU check: one command on the GPU machine, under 8 minutes, results under $OUT.
#
#   scripts/fetch_gpu_wheels.sh              # once, here: .whl/ gets the wheels the image lacks
#   OUT=/some/dir scripts/gpu_check.sh       # there (the device tool sets OUT; carry [".whl"])
#
# Stages (each bounded by `timeout`; a failing stage is recorded and the next one still runs):
#   env     nvidia-smi, versions, the imports the project needs             -> env.log
#   models  the tiny model and a TinyLlama-shaped random bf16 model         -> models.log
#   tests   pytest -m gpu tests/test_gpu.py (kernels, gemm, engine)         -> pytest.log
#   bench   python -m engine.bench_gpu on the TinyLlama-shaped model        -> bench.log, bench.json
# summary.md lists each stage's exit status and time, then the tests' and the benchmark's ends.
# Six files in all, named with letters, digits, '.', '_' and '-' only.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"  # the image's python3 holds CuPy, torch and transformers
MODELS="${MODELS:-/tmp/pagedllm_models}"
export PYTHONUNBUFFERED=1  # a stage killed by its timeout still leaves its log
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/pagedllm_cupy_cache}"  # compiled kernels
SUMMARY="$OUT/summary.md"

# Wheels the image lacks (gguf), carried in .whl/: installed into /tmp/site, no network needed.
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

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
  local note=""
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && note=" (timed out)"
  echo "| $name | $rc$note | $((SECONDS - t0)) |" >> "$SUMMARY"
  echo "$name: exit $rc$note after $((SECONDS - t0)) s"
}

stage env 30 env.log bash -c "nvidia-smi; $PY -c 'import cupy, numpy, ml_dtypes; \
print(\"cupy\", cupy.__version__, \"numpy\", numpy.__version__, \"ml_dtypes\", ml_dtypes.__version__); \
import gguf, safetensors, tokenizers, jinja2, tqdm, pytest; print(\"imports ok\"); \
import engine.backends.cupy_backend, reference.loader; print(\"project imports ok\"); \
print(\"nvrtc\", cupy.cuda.nvrtc.getVersion(), \"devices\", cupy.cuda.runtime.getDeviceCount())'"
stage models 90 models.log "$PY" scripts/make_random_model.py "$MODELS"
stage tests 150 pytest.log "$PY" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider
stage bench 190 bench.log "$PY" -m engine.bench_gpu --model "$MODELS/tinyllama" \
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
