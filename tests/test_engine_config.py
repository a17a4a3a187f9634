"""EngineConfig and SamplingParams: defaults, derived values, and one clear error per bad field."""

import re

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from model_loader.config import ModelConfig
from model_loader.synthetic import TINY_SHAPE


def model_config(max_positions: int = 4096) -> ModelConfig:
    return ModelConfig(
        **TINY_SHAPE, num_hidden_layers=2, head_dim=16, max_position_embeddings=max_positions
    )


def test_defaults_match_vllm():
    cfg = EngineConfig()
    assert (cfg.block_size, cfg.gpu_memory_utilization, cfg.swap_space) == (16, 0.90, None)
    assert (cfg.max_num_seqs, cfg.preemption_mode, cfg.dtype) == (256, "recompute", "auto")
    assert cfg.swap_space_bytes == 0 and not cfg.is_resolved  # recompute: no swap pool


def test_swap_space_defaults_to_vllms_4_gib_only_when_preempting_by_swap():
    assert EngineConfig(preemption_mode="swap").swap_space_bytes == 4 << 30
    assert EngineConfig(swap_space=0.5).swap_space_bytes == 1 << 29  # asked for: kept
    assert EngineConfig(preemption_mode="swap", swap_space=0).swap_space_bytes == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0),
        ("block_size", 2.5),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("swap_space", -1),
        ("swap_space", float("inf")),
        ("swap_space", float("nan")),
        ("swap_space", 1e30),
        ("swap_space", "4"),
        ("block_size", 100_000_000),
        ("max_num_seqs", 1_000_000_000),
        ("max_num_batched_tokens", 1 << 40),
        ("max_model_len", 1 << 40),
        ("num_gpu_blocks", 1 << 31),
        ("memory_budget_bytes", 1 << 60),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("max_model_len", -4),
        ("num_gpu_blocks", 0),
        ("memory_budget_bytes", 0),
        ("preemption_mode", "evict"),
        ("dtype", "int8"),
        ("backend", "tpu"),
        ("seed", "seven"),
        ("enable_chunked_prefill", "yes"),
        ("enforce_eager", 1),
        ("async_scheduling", "on"),
        ("model", None),
        ("max_num_seqs", True),
    ],
)
def test_each_bad_engine_field_is_named(field, value):
    got = re.escape(repr(value))
    with pytest.raises(ValueError, match=rf"^EngineConfig: {field} must be .*got {got}$"):
        EngineConfig(**{field: value})


def test_resolve_fills_max_model_len_and_budget():
    cfg = EngineConfig().resolve(model_config(4096))
    assert cfg.max_model_len == 4096 and cfg.max_num_batched_tokens == 4096 and cfg.is_resolved
    cfg = EngineConfig(max_model_len=1000).resolve(model_config(4096))
    assert cfg.max_model_len == 1000 and cfg.max_num_batched_tokens == 2048
    cfg = EngineConfig(enable_chunked_prefill=True).resolve(model_config(8192))
    assert cfg.max_model_len == 8192 and cfg.max_num_batched_tokens == 2048
    cfg = EngineConfig(max_num_seqs=3000, max_model_len=512).resolve(model_config())
    assert cfg.max_num_batched_tokens == 3000


def test_resolve_returns_a_copy():
    cfg = EngineConfig(block_size=8)
    resolved = cfg.resolve(model_config())
    assert cfg.max_model_len is None and resolved.block_size == 8


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_model_len=5000), "max_model_len"),
        (dict(max_model_len=4096, max_num_batched_tokens=1024), "max_num_batched_tokens"),
        (
            dict(max_num_seqs=64, max_num_batched_tokens=32, enable_chunked_prefill=True),
            "max_num_batched_tokens",
        ),
    ],
)
def test_resolve_rejects_inconsistent_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs).resolve(model_config(4096))


def test_chunked_prefill_allows_a_budget_below_max_model_len():
    cfg = EngineConfig(enable_chunked_prefill=True, max_num_batched_tokens=512)
    assert cfg.resolve(model_config(4096)).max_num_batched_tokens == 512


def test_sampling_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy and not p.top_k_enabled
    p = SamplingParams(temperature=0, stop="\n\n", stop_token_ids=(7, 9), top_k=5)
    assert p.greedy and p.stop == ["\n\n"] and p.stop_token_ids == [7, 9] and p.top_k_enabled
    assert isinstance(p.temperature, float)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("max_tokens", 0),
        ("max_tokens", 3.0),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("logprobs", -1),
        ("seed", 1.5),
        ("ignore_eos", "no"),
        ("temperature", "hot"),
    ],
)
def test_each_bad_sampling_field_is_named(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams: {field} must be "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", [("stop", ["ok", ""]), ("stop_token_ids", [3, -1])])
def test_bad_stop_entries_are_named(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams: {field} must be "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "given,canonical",
    [
        ("auto", "auto"),
        ("half", "float16"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("float", "float32"),
        ("float32", "float32"),
    ],
)
def test_dtype_takes_vllm_names_and_stores_the_canonical_one(given, canonical):
    assert EngineConfig(dtype=given).dtype == canonical


def test_dtype_flag_lists_vllm_names_and_normalises():
    import argparse

    from engine.entrypoints.engine_args import add_engine_args, engine_config

    parser = add_engine_args(argparse.ArgumentParser())
    help_text = " ".join(parser.format_help().split())
    assert "{auto,half,float16,bfloat16,float,float32}" in help_text
    assert engine_config(parser.parse_args(["--dtype", "half"])).dtype == "float16"
