"""The memory plan (engine/core/memory.py): host pools that fit the available RAM, said in the log,
flags too large for the memory refused before anything is allocated, and memory that stays flat
over a long run."""

from __future__ import annotations

import dataclasses
import logging
import tracemalloc

import numpy as np
import pytest

from engine import LLMEngine, SamplingParams
from engine.core import memory
from engine.frontend.llm import run_to_completion
from engine.utils import GiB, MiB, mib


def fake_ram(monkeypatch, n: int) -> None:
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: n)


def default_engine(tiny, **kw) -> LLMEngine:
    """An engine with the default sizing (no num_gpu_blocks, no swap_space)."""
    return LLMEngine(loaded=tiny, model="test", **kw)


def host_plan(engine: LLMEngine) -> tuple[int, int, int]:
    """(KV pool, swap pool, activation peak) bytes the engine planned."""
    be, cfg = engine.backend, engine.config
    peak = be.profile_peak_bytes(cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs)
    return be.kv_cache.nbytes, be.cpu_cache.nbytes, peak


def test_default_host_plan_fits_the_available_ram_and_says_so(tiny, monkeypatch, caplog):
    """KV pool + swap pool + activation peak together stay within a share of the available RAM
    (no swap pool in recompute mode), and the startup log states that sum."""
    fake_ram(monkeypatch, 48 * MiB)
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = default_engine(tiny)
    kv, swap, peak = host_plan(engine)
    assert swap == 0 and engine.block_manager.num_cpu_blocks == 0
    assert kv + swap + peak <= memory.HOST_RAM_FRACTION * 48 * MiB
    assert kv > 0 and engine.block_manager.num_blocks == kv // engine.backend.bytes_per_block
    line = next(r.message for r in caplog.records if r.message.startswith("host memory plan"))
    assert f"= {mib(kv + swap + peak)} of {mib(48 * MiB)} available RAM" in line
    assert "capped at 0.50 x available RAM" in line


def test_weights_mapped_from_their_file_are_not_planned_on(tiny, monkeypatch, caplog):
    """MemAvailable counts a mapped file's pages as free: with the machine's RAM only 80 MiB
    past the weights, the plan takes its share of those 80 MiB, not of the 512 MiB that
    MemAvailable says (which would push the weights back out to the disk)."""
    fake_ram(monkeypatch, 512 * MiB)
    weights = default_engine(tiny, num_gpu_blocks=64).backend.weights_bytes
    monkeypatch.setattr(memory, "total_ram_bytes", lambda: weights + 80 * MiB)
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = default_engine(tiny)
    kv, swap, peak = host_plan(engine)
    assert 0 < kv + swap + peak <= memory.HOST_RAM_FRACTION * 80 * MiB
    assert f"the RAM beside them, {mib(80 * MiB)} of the available {mib(512 * MiB)}" in caplog.text


def test_swap_mode_counts_its_swap_pool_in_the_host_plan(tiny, monkeypatch):
    fake_ram(monkeypatch, 128 * MiB)
    engine = default_engine(tiny, preemption_mode="swap", swap_space=0.01)
    kv, swap, peak = host_plan(engine)
    assert swap == engine.block_manager.num_cpu_blocks * engine.backend.bytes_per_block > 0
    assert kv + swap + peak <= memory.HOST_RAM_FRACTION * 128 * MiB


def test_default_host_pool_holds_max_num_seqs_full_sequences(tiny, monkeypatch, caplog):
    fake_ram(monkeypatch, 8 * GiB)
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = default_engine(tiny, max_num_seqs=8, max_model_len=256)
    assert engine.block_manager.num_blocks == 8 * 256 // 16
    assert "(max_num_seqs 8 x max_model_len 256 tokens)" in caplog.text


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(num_gpu_blocks=100_000_000), "num_gpu_blocks=100000000 x block_size=16 needs"),
        (dict(block_size=1024, num_gpu_blocks=100_000), "num_gpu_blocks=100000 x block_size=1024"),
        (dict(memory_budget_bytes=10**14), "memory_budget_bytes=100000000000000 less the weights"),
        (dict(swap_space=1000), "swap_space=1000 GiB needs"),
        (dict(max_num_seqs=60_000), "activation peak of max_num_batched_tokens=60000 tokens"),
    ],
)
def test_pools_larger_than_the_memory_are_refused_before_allocating(tiny, monkeypatch, kw, named):
    fake_ram(monkeypatch, 256 * MiB)
    with pytest.raises(ValueError, match=named) as e:
        default_engine(tiny, **kw)
    assert "\n" not in str(e.value)


def test_a_long_context_models_default_step_names_max_model_len_and_chunked_prefill(
    tiny, monkeypatch
):
    """Chunked prefill off, the step budget defaults to max_model_len: a long-context model's
    first run would be refused with nothing to say which setting made the step that big."""
    long = dataclasses.replace(
        tiny, config=dataclasses.replace(tiny.config, max_position_embeddings=1 << 16)
    )
    fake_ram(monkeypatch, 256 * MiB)
    with pytest.raises(ValueError, match="max_model_len=65536 .* enable chunked prefill"):
        default_engine(long, max_num_seqs=2)
    for kw in (dict(max_model_len=512), dict(enable_chunked_prefill=True)):  # the hint's two
        assert default_engine(long, max_num_seqs=2, **kw).config.max_num_batched_tokens == 2048


def run_rounds(engine: LLMEngine, rng: np.random.Generator, rounds: int) -> None:
    """Rounds of 8 random requests (random lengths, temperatures, seeds) run to completion."""
    for _ in range(rounds):
        prompts = [rng.integers(3, 300, rng.integers(2, 24)).tolist() for _ in range(8)]
        temps, lens, seeds = rng.uniform(0, 1.5, 8), rng.integers(1, 12, 8), rng.integers(0, 9, 8)
        params = [
            SamplingParams(temperature=float(t), max_tokens=int(m), seed=int(s))
            for t, m, s in zip(temps, lens, seeds, strict=True)
        ]
        run_to_completion(engine, prompts, params)


def test_memory_stays_flat_over_hundreds_of_batches(tiny):
    """Default settings, a fixed-seed workload: after a warm-up, hundreds more steps leave the
    traced Python and NumPy memory where it was (finished requests leave nothing behind)."""
    engine = default_engine(tiny, max_model_len=128)
    rng = np.random.default_rng(0)
    run_rounds(engine, rng, 5)
    tracemalloc.start()
    try:
        run_rounds(engine, rng, 5)
        base, _ = tracemalloc.get_traced_memory()
        run_rounds(engine, rng, 25)
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - base < 256 * 1024, f"grew {end - base} bytes"
