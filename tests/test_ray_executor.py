"""The ray executor: tensor- and pipeline-parallel ranks as Ray actors in a placement group on a
local Ray instance (four logical CPUs, no dashboard, a small object store, one instance for the
module), against the single process, on the numpy backend and (tensor parallel, the emulated
NCCL) on cuda-cpu; a killed actor is an error naming its rank, in seconds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray

from engine.emulation.nccl import block_name
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from tests.utils import assert_same_greedy, kill_rank_mid_run, make_engine, patience

PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=12, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local test instance, on 127.0.0.1
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=80 << 20,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


def released() -> None:
    """Wait (up to 10 s, longer on a busy machine) for the instance's four CPUs: Ray removes a
    shut-down engine's placement group in the background."""
    deadline = time.monotonic() + patience(10)
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.1)


def _ray_engine(loaded, tp: int, **kw):
    return make_engine(loaded, tensor_parallel_size=tp, distributed_executor_backend="ray", **kw)


@pytest.mark.parametrize("backend", ["numpy", "cuda-cpu"])  # cuda-cpu: the emulated NCCL
def test_ray_ranks_equal_one_process(tiny, backend):
    tp = 2  # four actors: the pipeline test's TP 2 x PP 2
    one = run_to_completion(make_engine(tiny, backend=backend, record_logits=True), PROMPTS, GREEDY)
    engine = _ray_engine(tiny, tp, backend=backend, record_logits=True)
    assert engine.backend.name == f"{backend}-ray" and len(set(engine.backend.pids)) == tp
    many = run_to_completion(engine, PROMPTS, GREEDY)
    assert_same_greedy(one, many)
    blocks = [Path("/dev/shm", block_name(i)) for i in engine.backend.nccl_ids]
    assert len(blocks) == (backend == "cuda-cpu") and all(b.exists() for b in blocks)
    engine.backend.shutdown()  # kills the actors: the executor removes what rank 0 cannot
    assert not any(b.exists() for b in blocks)
    released()
    assert ray.available_resources().get("CPU") == 4


def test_pipeline_parallel_on_ray_equals_one_process(tiny):
    """TP 2 x PP 2: each stage's hidden state reaches the next through the object store; greedy
    steps take the argmax path, seeded sampled ones with logprobs the logits path."""
    engine = _ray_engine(tiny, 2, pipeline_parallel_size=2)
    for params in (GREEDY, SEEDED):
        one = run_to_completion(make_engine(tiny), PROMPTS, params)
        many = run_to_completion(engine, PROMPTS, params)
        for a, b in zip(one, many, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs or (), b.outputs[0].logprobs or (), strict=True):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    engine.backend.shutdown()


def test_a_killed_actor_is_an_error_naming_its_rank(tiny):
    """Rank 1 of stage 0 killed mid-run: its tensor-parallel peer waits in a collective for it,
    the next stage for its output; the error names it."""
    died = r"worker rank 1 \(stage 0, tensor-parallel rank 1\): its actor died"
    engine = _ray_engine(tiny, 2, pipeline_parallel_size=2)
    kill_rank_mid_run(engine, 1, PROMPTS[0], died)


def test_pooling_on_ray_stages(tmp_path):
    """The pooling runner over Ray, TP 2 x PP 2: the stages hand their hidden states on and the
    last pools them; the vectors are sentence-transformers' (tests/data/pooling/golden.json) and
    the reranker's scores transformers' (the LM head gathered on the last stage)."""
    from tests.test_pooling import pools_and_scores_as_golden

    par = dict(tensor_parallel_size=2, pipeline_parallel_size=2)
    pools_and_scores_as_golden(dict(distributed_executor_backend="ray", **par), tmp_path, released)
