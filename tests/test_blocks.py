"""GGUF block formats as weights (Q8_0, Q4_0, Q4_1): the quantizers against gguf-py's (an
independent implementation of the formats) bit for bit; the cpu backend's integer-dot products
(cpu_src/matmul_blocks.cpp) against their NumPy twin; the engine on cpu against the numpy
backend running that twin; a GGUF's blocks kept as stored (a written file and the bundled
SmolLM2); what each format costs SmolLM2 in KL."""

from __future__ import annotations

import os
import types

import gguf
import numpy as np
import pytest

from engine.backends import cpu_native, cpu_ops, fast_ops, get_backend
from engine.backends.quant import BLOCK_FORMATS, IQ4_FORMATS, QuantWeight, quantize
from engine.config import EngineConfig
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from engine.tools.quant_eval import agreement, evaluate, teacher_forced_logits
from model_loader.gguf_file import GGUF_LAYER_NAMES
from model_loader.load import load_model, resolve_model
from reference.kernel_ops import matmul_q8_0, quantize_rows_q8_0
from tests.native import remote
from tests.test_kquants import kquant_weight, quantized_x, x_block
from tests.test_loaders import hf, write_gguf  # noqa: F401 (hf: a fixture)
from tests.test_quant import KL_TOKENS, matrices, smollm2_float32, threads  # noqa: F401
from tests.utils import SEED_PROMPTS, make_engine

GGML = {kind: getattr(gguf.GGMLQuantizationType, kind.upper()) for kind in BLOCK_FORMATS}
# per block: bytes of float16 scales, bytes of q
LAYOUT = {"q8_0": (2, 32), "q4_0": (2, 16), "q4_1": (4, 16)}


def file_blocks(raw: np.ndarray, kind: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF tensor's bytes, (n, K) values -> (data, scales) as QuantWeight holds them."""
    s, q = LAYOUT[kind]
    b = np.ascontiguousarray(raw).reshape(-1, s + q)  # one row per block: scales, then q
    data = b[:, s:].copy().reshape(n, -1)
    scales = b[:, :s].copy().view(np.float16).reshape(n, -1)
    return (data.view(np.int8) if kind == "q8_0" else data), scales


def random_weight(rng, k: int, n: int) -> np.ndarray:
    """(K, N) float32 with columns of very different magnitudes, a column with one outlier per
    block and a block of zeros."""
    scale = rng.uniform(1e-4, 8, n).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) * scale
    w[::32, -1] *= 50
    w[:32, 0] = 0.0
    return w


def assert_same(a: QuantWeight, data: np.ndarray, scales: np.ndarray) -> None:
    np.testing.assert_array_equal(a.data, data)
    np.testing.assert_array_equal(a.scales.view(np.uint16), scales.view(np.uint16))


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
@pytest.mark.parametrize("k, n", [(32, 2), (96, 7), (576, 333)])
def test_quantizers_are_gguf_py_bit_for_bit(kind, k, n):
    """The blocks gguf-py writes for the same values; the values gguf-py reads back; quantizing
    those values again gives the same blocks (how a GGUF's blocks are kept as stored)."""
    rng = np.random.default_rng()
    w = random_weight(rng, k, n)
    qw = quantize(w, kind)
    assert qw.shape == (k, n) and qw.scales.dtype == np.float16
    want = gguf.quants.quantize(np.ascontiguousarray(w.T), GGML[kind])
    assert_same(qw, *file_blocks(want, kind, n))
    values = gguf.quants.dequantize(want, GGML[kind]).reshape(n, k).T
    np.testing.assert_array_equal(qw.dequantize(), values)
    assert_same(quantize(qw.dequantize(), kind), qw.data, qw.scales)
    bytes_per_block = sum(LAYOUT[kind])
    assert qw.nbytes == n * k // 32 * bytes_per_block
    assert not qw.dequantize()[:32, 0].any()  # a block of zeros stays zeros


def assert_product(x: np.ndarray, qw: QuantWeight) -> float:
    """cpu_ops.matmul(x, qw) is the twin's product of x quantized to 8 bits per 32 and W, to
    float32 rounding; a row's bits are the same whatever the rows beside it (up to 64 rows, the
    integer dots). Returns how far the product is from float32 x's, relative."""
    rows, w = len(x), qw.dequantize()
    got = cpu_ops.matmul(x, qw)
    assert got.shape == (rows, qw.shape[1]) and got.dtype == np.float32
    want = matmul_q8_0(x, w)
    scale = np.abs(want).max()
    # float32 rounding of terms that cancel (Q4_1's m + 8 d against the dot, large in a column
    # of outliers): bounded by the terms' size, |x~| @ |w|, not by the result's
    size = np.abs(quantize_rows_q8_0(x)) @ np.abs(w.astype(np.float64))  # (rows, n)
    off = np.abs(got - want) / (1e-5 * scale + 4e-6 * size)  # (rows, n), at most 1
    assert off.max() <= 1, f"{qw.kind} {qw.shape}: {off.max():.2f} of the bound"
    if rows <= 64:
        for i in (0, rows - 1):
            np.testing.assert_array_equal(got[i], cpu_ops.matmul(x[i : i + 1], qw)[0])
    return np.abs(got - x.astype(np.float64) @ w).max() / scale


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 23, 64, 65, 100])
def test_products_against_the_numpy_twin(threads, kind, rows):  # noqa: F811
    """The GEMV (up to 8 rows), the same integer dots over chunks of W (9 to 64 rows: each row
    with the GEMV's bits) and the float32 tiles + sgemm (more) compute x quantized to 8 bits per
    32 times W; K of 1, 18, 48 and 3 blocks (Q4's dots take blocks in pairs: an odd count leaves
    one); (1536, 777) runs on two threads. Against float32 x the error is far larger, so
    skipping x's quantization (or Q4's x-sum term) would fail."""
    rng = np.random.default_rng()
    off_float32 = []  # per shape
    for k, n in [(32, 5), (576, 333), (1536, 777), (64, 1), (576, 272), (96, 16)]:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        x[:, 3] *= 40  # an outlier widens its block's step
        off_float32.append(assert_product(x, quantize(random_weight(rng, k, n), kind)))
    # over all shapes (the smallest maximum of 24 runs: 2.7e-2): one output of 64 inputs alone
    # can land within 1e-4 (measured 7.6e-5)
    assert max(off_float32) > 1e-4, off_float32


@pytest.mark.parametrize("rows", [1, 9, 65])
def test_products_with_arm_dot_products(rows, monkeypatch):
    """The aarch64 build for ARMv8.2's dot products (vdotq_s32; tests/test_cpu_kernels.py runs
    the baseline build) under qemu-user, against the twin (IQ4_NL/IQ4_XS: against x quantized
    as the kernels do, to float32 rounding); in CI, where the tools are there."""
    try:
        lib = remote.load("aarch64-dotprod")
    except LookupError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the aarch64-dotprod build: {e}")
    monkeypatch.setattr(cpu_native, "_lib", [lib])
    monkeypatch.setattr(cpu_ops, "_p", lambda a: a)  # the arrays themselves go down the pipe
    rng = np.random.default_rng()
    try:
        for kind in BLOCK_FORMATS:
            for k, n in [(96, 16), (576, 33)]:
                x = rng.standard_normal((rows, k), dtype=np.float32)
                x[:, 3] *= 40
                assert_product(x, quantize(random_weight(rng, k, n), kind))
        for kind in IQ4_FORMATS:
            x = rng.standard_normal((rows, 512), dtype=np.float32)
            w = kquant_weight(rng, kind, 512, 33)
            xq, vals = quantized_x(x, x_block(kind)), w.dequantize().astype(np.float64)
            err = np.abs(cpu_ops.matmul(x, w) - xq @ vals)
            assert (err <= 1e-5 * (np.abs(xq) @ np.abs(vals))).all(), kind
    finally:
        lib.close()


def test_bad_block_weights_are_one_line():
    msg = r"q4_1: a matrix's input size must be a multiple of 32, got \(40, 3\)"
    with pytest.raises(ValueError, match=msg):
        quantize(np.ones((40, 3), np.float32), "q4_1")
    x = np.ones((2, 40), np.float32)
    odd = QuantWeight("q8_0", np.ones((3, 40), np.int8), np.ones((3, 1), np.float16))
    with pytest.raises(ValueError, match=r"matmul \(q8_0\): shape \(2, 40, 3\) is beyond"):
        cpu_ops.matmul(x, odd)


def twin_ops():
    """fast_ops with the products of the block twin: a numpy backend that quantizes x too."""
    ops = types.SimpleNamespace(**{k: getattr(fast_ops, k) for k in dir(fast_ops)})
    ops.matmul = lambda x, w: matmul_q8_0(x, w).astype(np.float32)
    return ops


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
def test_cpu_engine_against_the_numpy_twin(tiny, kind):
    """Greedy tokens equal and logits close to a numpy engine holding the same values and
    quantizing x the same way (an outlier step aside, below); the layers in the format, the
    LM head Q8_0 under Q4."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = make_engine(tiny, backend="numpy", record_logits=True, quantization=kind)
    ref.backend.ops = twin_ops()
    cpu = make_engine(tiny, backend="cpu", record_logits=True, quantization=kind)
    outs = [run_to_completion(e, SEED_PROMPTS, greedy) for e in (ref, cpu)]
    steps = []  # per step, the largest logit difference
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = np.stack(a.outputs[0].step_logits) - np.stack(b.outputs[0].step_logits)
        steps += list(np.abs(diff).max(axis=1))
    # x's rounding to 8 bits is a step function: two float orders can round a value near a
    # half differently, and that moves later logits by a few 1e-2 here (q4_1 measured once in
    # 36 steps, 0.033); all else agrees to float rounding
    assert np.mean(np.array(steps) < 1e-4) >= 0.9 and max(steps) < 0.1, steps
    packed = matrices(cpu.backend)  # the head first
    assert [w.kind for w in packed] == ["q8_0"] + [kind] * (len(packed) - 1)
    for f32, q in zip(matrices(ref.backend), packed, strict=True):
        np.testing.assert_array_equal(q.dequantize(), f32)
    assert cpu.backend.quantization == kind


def raw_blocks(path) -> dict:
    """GGUF tensor name -> (kind, data, scales) of its block-format tensors."""
    kinds = {v: k for k, v in GGML.items()}
    reader = gguf.GGUFReader(str(path))
    return {
        t.name: (kinds[t.tensor_type], *file_blocks(t.data, kinds[t.tensor_type], int(t.shape[1])))
        for t in reader.tensors
        if t.tensor_type in kinds
    }


def unpermute(a: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order -> Hugging Face's (rows are whole blocks)."""
    rows = a.shape[0]
    return a.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def assert_file_blocks(backend, raw, heads: dict, kind: str) -> None:
    """Every layer matrix of the backend is the file's blocks: Q/K rows in Hugging Face's
    order, Q|K|V and gate|up side by side."""
    fused = {"w_qkv": ("wq", "wk", "wv"), "w_o": ("wo",), "w_gate_up": ("w_gate", "w_up")}
    fused["w_down"] = ("w_down",)
    for i, lw in enumerate(backend.layers):
        for field, parts in fused.items():
            datas, scales = [], []
            for part in parts:
                k, data, s = raw[GGUF_LAYER_NAMES[part].format(i=i)]
                assert k == kind
                if part in heads:
                    data, s = unpermute(data, heads[part]), unpermute(s, heads[part])
                datas.append(data)
                scales.append(s)
            w = getattr(lw, field)
            assert w.kind == kind
            assert_same(w, np.concatenate(datas), np.concatenate(scales))


def test_a_q8_0_gguf_is_kept_as_stored(tiny_model_dir, hf, tmp_path):  # noqa: F811
    """No --quantization: the cpu backend holds the file's own Q8_0 blocks, the numpy backend
    their float32 values."""
    cfg, tensors = hf
    path = write_gguf(tmp_path / "q8.gguf", cfg, tensors, tiny_model_dir, GGML["q8_0"])
    loaded = load_model(str(path))
    assert loaded.config.stored_matrix_type == "Q8_0"
    cpu = make_engine(loaded, backend="cpu").backend
    assert cpu.quantization == "q8_0"
    assert make_engine(loaded, backend="numpy").backend.quantization is None
    raw = raw_blocks(path)
    heads = {"wq": cfg["num_attention_heads"], "wk": cfg["num_key_value_heads"]}
    assert_file_blocks(cpu, raw, heads, "q8_0")
    _, data, scales = raw.get("output.weight", raw["token_embd.weight"])
    assert_same(cpu.lm_head, data, scales)


def test_the_bundled_q4_1_gguf_is_kept_as_stored(smollm2):
    """SmolLM2 as shipped (Q4_1 layers, a Q8_0 embedding the head shares): with
    --quantization q4_1 the cpu backend holds every block of the file; without it, float32 (the
    file's values, in panels or plain: whichever measured faster)."""
    assert smollm2.config.stored_matrix_type == "Q4_1"
    config = EngineConfig(model="smollm2", backend="cpu", quantization="q4_1")
    cpu = get_backend("cpu", smollm2.config, smollm2.weights, config)
    raw = raw_blocks(resolve_model("smollm2"))
    c = smollm2.config
    assert_file_blocks(cpu, raw, {"wq": c.num_attention_heads, "wk": c.num_key_value_heads}, "q4_1")
    kind, data, scales = raw["token_embd.weight"]
    assert kind == "q8_0" and cpu.lm_head.kind == "q8_0"
    assert_same(cpu.lm_head, data, scales)
    plain = get_backend("cpu", c, smollm2.weights, EngineConfig(model="smollm2", backend="cpu"))
    head = plain.lm_head  # panels or plain, as measured faster on this CPU
    values = head if isinstance(head, np.ndarray) else head.dequantize()
    assert plain.quantization is None and values.dtype == np.float32
    np.testing.assert_array_equal(values, smollm2.weights.lm_head.T)


# Measured over the 128 tokens of tests/test_quant.py (2026-12-02): q8_0 mean KL 6.54e-3, top-1
# 94.5%; q4_1 (the bundled model's own blocks, so its float32 values: x's 8 bits alone) 4.53e-3,
# 92.9%; q4_0 (4-bit blocks quantized again from the Q4_1 values) 0.337, 64.6%. x's
# quantization is most of q8_0's: the same weights with float32 x (numpy backend) measured
# 1.46e-3 over 2,000 tokens against 5.0e-3. Bounds: 3x the mean, top-1 a few points under.
# Over so few tokens the top-1 moves with the products' float32 order alone (x's 8-bit rounding
# flips): with the float32 reference in panels and with the block tiles multiplied two ways,
# q8_0 measured 95.3% / 90.6% and q4_1 91.3% / 94.5% at equal mean KL (over 511 tokens 95.1-95.5%
# and 95.1-96.1%), hence 0.88 for both.
KL_BOUNDS = {"q8_0": (0.02, 0.88), "q4_1": (0.014, 0.88), "q4_0": (1.0, 0.6)}


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
def test_smollm2_kl_against_float32(smollm2, smollm2_float32, kind):  # noqa: F811
    """Teacher-forced over the first tokens of the project's docs, as int8 is."""
    tokens, want = smollm2_float32
    config = EngineConfig(model="smollm2", backend="cpu", quantization=kind)
    backend = get_backend("cpu", smollm2.config, smollm2.weights, config)
    got = agreement(want, teacher_forced_logits(backend, tokens, KL_TOKENS), tokens)
    max_kl, min_top1 = KL_BOUNDS[kind]
    assert got.tokens == KL_TOKENS - 1
    assert 0 < got.mean_kl < max_kl and got.top1 >= min_top1, got
    assert abs(np.log(got.ppl_quant / got.ppl_ref)) < 0.1, got


def test_quant_eval_compares_a_q8_0_gguf_against_its_float32_values(tiny_model_dir, hf, tmp_path):  # noqa: F811
    """The float32 run of a Q8_0 file is its values in float32, not the blocks the cpu backend
    would keep: otherwise the two runs are the same and the KL is 0."""
    cfg, tensors = hf
    path = write_gguf(tmp_path / "q8.gguf", cfg, tensors, tiny_model_dir, GGML["q8_0"])
    loaded = load_model(str(path))
    tokens = np.random.default_rng().integers(3, cfg["vocab_size"], 40)
    config = EngineConfig(model=str(path), backend="cpu", quantization="q8_0")
    got = evaluate(loaded, config, tokens, chunk=16)
    assert got.tokens == 39 and got.mean_kl > 1e-6, got


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
def test_a_block_format_quantized_in_column_slices_has_the_bytes_of_all_at_once(kind, monkeypatch):
    from engine.backends import quant

    rng = np.random.default_rng()
    w = rng.standard_normal((64, 150), dtype=np.float32) * rng.uniform(0.01, 3, 150).astype(
        np.float32
    )
    data, scales = quant.QUANTIZE[kind](w)
    monkeypatch.setattr(quant, "COLUMNS_AT_ONCE", 32)  # 150 = 4 x 32 + 22
    q = quant.quantize(w, kind)
    np.testing.assert_array_equal(q.data, data)
    np.testing.assert_array_equal(q.scales.view(np.uint16), scales.view(np.uint16))
