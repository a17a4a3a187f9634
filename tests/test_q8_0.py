"""Q8_0 weights (llama.cpp's 8-bit blocks): the quantizer against gguf-py's (an independent
implementation of the format) bit for bit; the cpu backend's integer-dot product
(cpu_src/matmul_q8_0.cpp) against its NumPy twin; the engine on cpu against the numpy backend
running that twin; a GGUF's Q8_0 tensors kept as stored; what Q8_0 costs SmolLM2 in KL."""

from __future__ import annotations

import types

import gguf
import numpy as np
import pytest

from engine.backends import cpu_ops, fast_ops, get_backend
from engine.backends.quant import QuantWeight, dequantize_q8_0, quantize_q8_0, to_q8_0
from engine.config import EngineConfig
from engine.entrypoints.quant_eval import agreement, teacher_forced_logits
from engine.llm import run_to_completion
from engine.sampling_params import SamplingParams
from reference.loader import load_model
from tests.oracles.numpy_ops import matmul_q8_0
from tests.test_loaders import hf, write_gguf  # noqa: F401 (hf: a fixture)
from tests.test_quant import KL_TOKENS, matrices, smollm2_float32, threads  # noqa: F401
from tests.utils import SEED_PROMPTS, assert_same_greedy, make_engine

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def file_blocks(blocks: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes of an (n, K) tensor -> (q (n, K) int8, d (n, K/32) float16)."""
    b = np.ascontiguousarray(blocks).reshape(-1, 34)  # per block: float16 d, 32 int8
    return b[:, 2:].copy().view(np.int8).reshape(n, -1), b[:, :2].copy().view(np.float16).reshape(
        n, -1
    )


def random_weight(rng, k: int, n: int) -> np.ndarray:
    """(K, N) float32 with columns of very different magnitudes, a column with one outlier per
    block and a block of zeros."""
    w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(1e-4, 8, n).astype(np.float32)
    w[::32, -1] *= 50
    w[:32, 0] = 0.0
    return w


@pytest.mark.parametrize("k, n", [(32, 1), (96, 7), (576, 333)])
def test_quantizer_is_gguf_py_bit_for_bit(k, n):
    rng = np.random.default_rng()
    w = random_weight(rng, k, n)
    q, d = quantize_q8_0(w)
    assert (
        q.shape == (n, k)
        and q.dtype == np.int8
        and d.shape == (n, k // 32)
        and d.dtype == np.float16
    )
    want_q, want_d = file_blocks(gguf.quants.quantize(np.ascontiguousarray(w.T), Q8_0), n)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(d.view(np.uint16), want_d.view(np.uint16))
    assert not q[0, :32].any() and d[0, 0] == 0  # a zero block: d = 0, q = 0
    # within half a step of w, plus d's rounding to float16 (at most 127 * 2^-11 steps)
    err = np.abs(dequantize_q8_0(q, d) - w).reshape(k // 32, 32, n).max(axis=1)  # (K/32, N)
    assert (err <= d.T.astype(np.float32) * (0.5 + 127 * 2**-11) + 1e-12).all()
    # quantizing the dequantized values gives the same blocks back (a GGUF's kept as stored)
    q2, d2 = quantize_q8_0(dequantize_q8_0(q, d))
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(d2.view(np.uint16), d.view(np.uint16))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 64])
def test_product_against_the_numpy_twin(threads, rows):  # noqa: F811
    """The GEMV (up to 8 rows) and the float32 tiles + sgemm (more) compute x quantized to
    Q8_0 times W; (1536, 777) runs on two threads. Against float32 x the error is far larger,
    so skipping x's quantization would fail."""
    rng = np.random.default_rng()
    for k, n in [(32, 5), (576, 333), (1536, 777), (64, 1)]:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        x[:, 3] *= 40  # an outlier widens its block's step
        qw = to_q8_0(random_weight(rng, k, n))
        w = qw.dequantize()
        got = cpu_ops.matmul(x, qw)
        assert got.shape == (rows, n) and got.dtype == np.float32
        want = matmul_q8_0(x, w)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
        assert np.abs(got - x.astype(np.float64) @ w).max() > 1e-4 * scale


def test_bad_q8_0_weights_are_one_line():
    with pytest.raises(
        ValueError, match=r"q8_0: a matrix's input size must be a multiple of 32, got \(40, 3\)"
    ):
        to_q8_0(np.ones((40, 3), np.float32))
    x = np.ones((2, 40), np.float32)
    odd = QuantWeight("q8_0", np.ones((3, 40), np.int8), np.ones((3, 1), np.float16))
    with pytest.raises(ValueError, match=r"matmul_q8_0: shape \(2, 40, 3\) is beyond"):
        cpu_ops.matmul(x, odd)


def twin_ops():
    """fast_ops with the products of the Q8_0 twin: a numpy backend that quantizes x too."""
    ns = types.SimpleNamespace(
        **{k: getattr(fast_ops, k) for k in dir(fast_ops) if not k.startswith("__")}
    )
    ns.matmul = lambda x, w: matmul_q8_0(x, w).astype(np.float32)
    return ns


def test_cpu_engine_against_the_numpy_twin(tiny):
    """Greedy tokens equal and logits close to a numpy engine holding the same Q8_0 values
    and quantizing x the same way; the matrices take 34 bytes per 32 weights."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = make_engine(tiny, backend="numpy", record_logits=True, quantization="q8_0")
    ref.backend.ops = twin_ops()
    cpu = make_engine(tiny, backend="cpu", record_logits=True, quantization="q8_0")
    outs = [run_to_completion(e, SEED_PROMPTS, greedy) for e in (ref, cpu)]
    assert_same_greedy(outs[0], outs[1], tol=1e-4)
    packed = matrices(cpu.backend)
    assert all(isinstance(w, QuantWeight) and w.kind == "q8_0" for w in packed)
    for f32, q in zip(matrices(ref.backend), packed, strict=True):
        np.testing.assert_array_equal(q.dequantize(), f32)
        assert q.nbytes == f32.size // 32 * 34
    assert cpu.backend.quantization == "q8_0"


def test_a_q8_0_gguf_is_kept_as_stored(tiny_model_dir, hf, tmp_path):  # noqa: F811
    """No --quantization: the cpu backend holds the file's own blocks (Q/K rows in Hugging
    Face's order, Q|K|V and gate|up side by side), the numpy backend their float32 values."""
    cfg_dict, tensors = hf
    path = write_gguf(tmp_path / "q8.gguf", cfg_dict, tensors, tiny_model_dir, Q8_0)
    loaded = load_model(str(path))
    assert loaded.config.stored_matrix_type == "Q8_0"
    cpu = make_engine(loaded, backend="cpu").backend
    assert (
        cpu.quantization == "q8_0"
        and make_engine(loaded, backend="numpy").backend.quantization is None
    )
    reader = gguf.GGUFReader(str(path))
    raw = {
        t.name: file_blocks(t.data, int(t.shape[1]))
        for t in reader.tensors
        if t.tensor_type == Q8_0
    }
    heads = {"attn_q": cfg_dict["num_attention_heads"], "attn_k": cfg_dict["num_key_value_heads"]}
    for i, lw in enumerate(cpu.layers):
        parts = []
        for name in ("attn_q", "attn_k", "attn_v"):
            q, d = raw[f"blk.{i}.{name}.weight"]
            if name in heads:  # the file's rows are llama.cpp's rotary order
                q, d = (unpermute(a, heads[name]) for a in (q, d))
            parts.append((q, d))
        assert_blocks(lw.w_qkv, parts)
        assert_blocks(lw.w_o, [raw[f"blk.{i}.attn_output.weight"]])
        assert_blocks(
            lw.w_gate_up, [raw[f"blk.{i}.ffn_gate.weight"], raw[f"blk.{i}.ffn_up.weight"]]
        )
        assert_blocks(lw.w_down, [raw[f"blk.{i}.ffn_down.weight"]])
    assert_blocks(cpu.lm_head, [raw.get("output.weight", raw["token_embd.weight"])])


def unpermute(a: np.ndarray, n_heads: int) -> np.ndarray:
    rows = a.shape[0]
    return a.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def assert_blocks(w: QuantWeight, parts) -> None:
    assert w.kind == "q8_0"
    np.testing.assert_array_equal(w.data, np.concatenate([q for q, _ in parts]))
    np.testing.assert_array_equal(
        w.scales.view(np.uint16), np.concatenate([d for _, d in parts]).view(np.uint16)
    )


# measured over the 128 tokens of tests/test_quant.py (2026-12-02): mean KL 6.54e-3, top-1 94.5%
# (x's quantization is most of it: the same weights with float32 x, the numpy backend, measured
# 1.46e-3 over 2,000 tokens against 5.0e-3). Bounds: 3x the mean, top-1 a few points under.
def test_smollm2_q8_0_kl_against_float32(smollm2, smollm2_float32):  # noqa: F811
    """Teacher-forced over the first tokens of the project's docs, as int8 is."""
    tokens, want = smollm2_float32
    config = EngineConfig(model="smollm2", backend="cpu", quantization="q8_0")
    backend = get_backend("cpu", smollm2.config, smollm2.weights, config)
    got = agreement(want, teacher_forced_logits(backend, tokens, KL_TOKENS), tokens)
    assert got.tokens == KL_TOKENS - 1
    assert 0 < got.mean_kl < 0.02 and got.top1 >= 0.91, got
    assert abs(np.log(got.ppl_quant / got.ppl_ref)) < 0.05, got
