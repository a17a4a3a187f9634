"""The reference transformer: recompute vs KV-cached decoding, its math against independent
formulas, the KV memory arithmetic, and the CLI contract."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from model_loader.config import ModelConfig
from reference.generate import generate
from reference.model import KVCache, apply_rope, causal_attention, forward, rms_norm, rope_cos_sin

REPO = Path(__file__).resolve().parents[1]
STEPS = 64
SMOLLM2_STEPS = 12  # each recompute step reads SmolLM2's 1 GB of float64 weights (~0.25 s)
REL_TOL = 1e-9


def max_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: one number per step, scale-free."""
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def assert_recompute_equals_cached(weights, config, prompt_ids, steps: int = STEPS) -> None:
    cached = generate(weights, config, prompt_ids, steps, mode="cached")
    recomputed = generate(weights, config, prompt_ids, steps, mode="recompute")
    assert len(cached.token_ids) == steps
    assert recomputed.token_ids == cached.token_ids
    for step, (a, b) in enumerate(zip(cached.logits, recomputed.logits, strict=True)):
        assert a.dtype == np.float64
        err = max_rel_err(a, b)
        assert err <= REL_TOL, f"step {step}: relative logits error {err:.2e}"


# ---- recompute vs cached ------------------------------------------------------------------


def test_recompute_equals_cached_tiny(tiny):
    prompt = tiny.tokenizer.encode("today is a beautiful summer day")
    assert_recompute_equals_cached(tiny.weights.astype(np.float64), tiny.config, prompt)


@pytest.mark.slow
def test_recompute_equals_cached_smollm2(smollm2):
    """SmolLM2's shapes (GQA 3, head_dim 64, 30 layers, tied embeddings) over fewer steps than
    the tiny model's 64, which run the same cache code to longer positions."""
    prompt = smollm2.tokenizer.encode("hello there")  # short: recompute costs ~(T + n)^2 / 2 rows
    t0 = time.perf_counter()
    w = smollm2.weights.astype(np.float64)
    assert_recompute_equals_cached(w, smollm2.config, prompt, SMOLLM2_STEPS)
    print(f"smollm2 float64, {SMOLLM2_STEPS} steps both ways: {time.perf_counter() - t0:.1f} s")


def test_past_kv_never_change(tiny):
    """Decoding appends rows to the cache; the rows already there stay bit-identical."""
    w = tiny.weights.astype(np.float64)
    cache = KVCache()
    forward(w, tiny.config, tiny.tokenizer.encode("hi my name is"), cache)
    before = [(k.copy(), v.copy()) for k, v in zip(cache.k, cache.v, strict=True)]
    n = cache.length
    for token in (5, 17, 42):
        forward(w, tiny.config, [token], cache)
    assert cache.length == n + 3
    for (k0, v0), k, v in zip(before, cache.k, cache.v, strict=True):
        np.testing.assert_array_equal(k[:n], k0)
        np.testing.assert_array_equal(v[:n], v0)


# ---- the math against independent formulas -----------------------------------------------


def test_rms_norm_matches_formula():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 48)) * 3.0  # (T, D)
    w = rng.standard_normal(48)  # (D,)
    eps = 1e-5
    for t in range(5):
        rms = np.linalg.norm(x[t]) / np.sqrt(48)
        want = w * x[t] / np.sqrt(rms**2 + eps)  # (D,)
        np.testing.assert_allclose(rms_norm(x, w, eps)[t], want, rtol=1e-12)


def rope_by_complex_rotation(x, positions, theta):
    """Rotate pair j (elements j and j + hd/2) by position * theta^(-2j/hd), as a complex number."""
    hd = x.shape[-1]
    half = hd // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)  # (hd,)
    pairs = x[..., order]  # (T, nh, hd): interleaved (re, im) pairs
    z = pairs[..., 0::2] + 1j * pairs[..., 1::2]  # (T, nh, hd/2)
    freq = np.array([theta ** (-2.0 * j / hd) for j in range(half)])  # (hd/2,)
    z = z * np.exp(1j * positions[:, None, None] * freq[None, None, :])
    out = np.empty_like(x)
    out[..., :half], out[..., half:] = z.real, z.imag  # undo the reordering
    return out


def test_rope_matches_complex_rotation():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 3, 16))  # (T, nh, hd)
    positions = rng.integers(0, 500, size=6)  # (T,)
    cos, sin = rope_cos_sin(positions, 16, 10000.0, np.float64)  # (T, hd)
    got = apply_rope(x, cos, sin)
    np.testing.assert_allclose(got, rope_by_complex_rotation(x, positions, 10000.0), atol=1e-12)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 1, 1, 32))  # (1, 1, hd) each

    def score(m, n):
        rq = apply_rope(q, *rope_cos_sin(np.array([m]), 32, 1e5, np.float64))
        rk = apply_rope(k, *rope_cos_sin(np.array([n]), 32, 1e5, np.float64))
        return float(np.sum(rq * rk))

    assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-10)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)


def naive_attention(q, k, v, q_start):
    """Per query, per head: softmax over the visible keys of its K/V head h // group."""
    n_q, n_heads, hd = q.shape
    group = n_heads // k.shape[1]
    out = np.zeros_like(q)  # (T, H, hd)
    for t in range(n_q):
        visible = q_start + t + 1
        for h in range(n_heads):
            kh, vh = k[:visible, h // group], v[:visible, h // group]  # (visible, hd)
            s = kh @ q[t, h] / np.sqrt(hd)  # (visible,)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vh
    return out


@pytest.mark.parametrize("n_q, q_start, n_heads, n_kv", [(7, 0, 4, 4), (3, 5, 6, 2), (1, 9, 9, 3)])
def test_causal_attention_matches_naive_loop(n_q, q_start, n_heads, n_kv):
    rng = np.random.default_rng(4)
    s = q_start + n_q
    q = rng.standard_normal((n_q, n_heads, 8))  # (T, H, hd)
    k, v = rng.standard_normal((2, s, n_kv, 8))  # (S, Hkv, hd) each
    got = causal_attention(q, k, v, q_start)
    np.testing.assert_allclose(got, naive_attention(q, k, v, q_start), rtol=1e-12, atol=1e-12)


def test_gqa_head_h_reads_kv_head_h_over_group():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((4, 6, 8))  # (T, H=6, hd)
    k, v = rng.standard_normal((2, 4, 2, 8))  # (S, Hkv=2, hd): group of 3
    base = causal_attention(q, k, v, 0)
    v2 = v.copy()
    v2[:, 1] += rng.standard_normal((4, 8))  # change K/V head 1 only
    changed = np.any(causal_attention(q, k, v2, 0) != base, axis=(0, 2))  # (H,)
    assert changed.tolist() == [False, False, False, True, True, True]


def test_attention_is_causal():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((5, 2, 8))  # (T, H, hd)
    k, v = rng.standard_normal((2, 5, 2, 8))  # (S, Hkv, hd)
    base = causal_attention(q, k, v, 0)
    k2, v2 = k.copy(), v.copy()
    k2[3:] += 1.0
    v2[3:] += 1.0  # the future of query 2
    got = causal_attention(q, k2, v2, 0)
    np.testing.assert_array_equal(got[:3], base[:3])
    assert not np.allclose(got[3:], base[3:])


# ---- memory arithmetic ---------------------------------------------------------------------

TINYLLAMA_CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def test_kv_bytes_for_tinyllama(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINYLLAMA_CONFIG))
    cfg = ModelConfig.from_json(path)
    assert cfg.head_dim == 64
    assert cfg.kv_bytes_per_token() == 22_528  # 2 (K, V) * 22 layers * 4 heads * 64 * 2 bytes
    assert cfg.kv_bytes_per_block(16) == 360_448


# ---- CLI contract --------------------------------------------------------------------------


def run_cli(model_dir, prompt, n, *extra) -> dict:
    cmd = [sys.executable, "-m", "reference.generate", "--model", str(model_dir)]
    cmd += ["--prompt", prompt, "--max-tokens", str(n), "--json", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout)


def test_cli_json_matches_api(tiny_model_dir, tiny):
    prompt, n = "hello there", 12
    ids = tiny.tokenizer.encode(prompt)
    res = generate(
        tiny.weights.astype(np.float32), tiny.config, ids, n, "cached", tiny.config.eos_token_ids
    )
    want = {
        "prompt_token_ids": ids,
        "token_ids": res.token_ids,
        "text": tiny.tokenizer.decode(res.token_ids),
    }
    assert run_cli(tiny_model_dir, prompt, n) == want
    assert run_cli(tiny_model_dir, prompt, n, "--mode", "recompute")["token_ids"] == res.token_ids
