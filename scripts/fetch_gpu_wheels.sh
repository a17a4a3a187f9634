#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels the GPU machine lacks, so the GPU check can carry them.
#
#   scripts/fetch_gpu_wheels.sh          # here, where PyPI is reachable
#
# The GPU image (Python 3.12) already has numpy, cupy-cuda13x, ml-dtypes, safetensors, tokenizers,
# jinja2, tqdm, huggingface-hub, pyyaml, requests, pytest and torch/transformers. It lacks `gguf`,
# which reference/loader.py imports. gguf's own needs (numpy, pyyaml, requests, tqdm) are there,
# so it is fetched alone (--no-deps). scripts/gpu_check.sh installs whatever .whl/ holds into
# /tmp/site before anything else.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
mkdir -p .whl
rm -f .whl/*.whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d .whl "gguf==$GGUF_VERSION"
ls -l .whl
