"""Quantized Hugging Face checkpoints (AWQ, GPTQ, FP8), written here as their tools write them
(the tensor names and config keys of AutoAWQ's gemm layers, auto-gptq / GPTQModel's, and
transformers' / AutoFP8's FP8 layers), loaded as the engine keeps them: the 4-bit groups as
q4_z blocks holding exactly (q - z) s, FP8 widened to float32 at load. Each against the same
model written as float32 values of its own (numpy, from the q, s, z drawn here)."""

from __future__ import annotations

import json
import logging
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.backends import cpu_ops
from engine.backends.quant import QuantWeight
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from model_loader.config import ModelConfig
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
from tests.test_blocks import assert_product, twin_ops
from tests.test_model_families_config import BASE
from tests.test_quant import matrices
from tests.utils import SEED_PROMPTS, make_engine

# widths that whole groups of 128 divide: q 128, k/v 64, ffn 256
SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32, num_attention_heads=4)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJ += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_PACK = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: nibble i <- output 8c + AWQ_PACK[i]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


# ---- the writers: pack q as each tool does ----
def pack_awq(q: np.ndarray) -> np.ndarray:
    """(rows, N) in 0..15 -> (rows, N/8) int32, AutoAWQ's interleaved order."""
    out = np.zeros((q.shape[0], q.shape[1] // 8), np.uint32)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= q[:, col * 8 + AWQ_PACK[i]].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def pack_seq(q: np.ndarray, axis: int) -> np.ndarray:
    """Eight consecutive values along ``axis`` in one int32, the first in the low nibble."""
    q = np.moveaxis(q, axis, 0).astype(np.uint32)
    out = np.zeros((q.shape[0] // 8, *q.shape[1:]), np.uint32)
    for j in range(8):
        out |= q[j::8] << np.uint32(4 * j)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis)).view(np.int32)


def unpack_nibble(packed: np.ndarray, i: int) -> np.ndarray:
    return (packed.view(np.uint32) >> np.uint32(4 * i)) & np.uint32(15)


def draw_layer(rng, n: int, k: int, group: int, zero_offset: int):
    """q (N, K), scales (K/G, N) float16, zeros (K/G, N): a layer's random 4-bit groups (the
    zeros stored minus ``zero_offset``, so 1..16 for GPTQ's v1 format)."""
    q = rng.integers(0, 16, (n, k))
    scales = (rng.uniform(0.5, 2.0, (k // group, n)) / (8 * np.sqrt(k))).astype(np.float16)
    zeros = rng.integers(0, 16, (k // group, n)) + zero_offset
    return q, scales, zeros


def values(q, scales, zeros, group) -> np.ndarray:
    """The layer's (N, K) float32 values: s (q - z), float16 s and small integers: exact."""
    g = np.repeat(np.arange(q.shape[1] // group), group)  # (K,) each input's group
    return ((q - zeros.T[:, g]) * scales.T[:, g].astype(np.float32)).astype(np.float32)


def write_int4(path, method: str, group: int = 128, fmt: str = "gptq", seed: int = 0):
    """A tiny llama checkpoint quantized by ``method``, and its float32 twin at path/'float'.
    Embeddings, norms and the LM head float16, as in the tools' outputs."""
    base = make_tiny_model(path / "float", seed=seed, torch_dtype="float16", **SHAPE)
    tensors, rng = load_file(str(base / "model.safetensors")), np.random.default_rng(seed)
    for name in list(tensors):
        if not any(p in name for p in PROJ):
            tensors[name] = tensors[name].astype(np.float16)
    out = dict(tensors)
    for name in [n for n in tensors if any(p in n for p in PROJ)]:
        prefix, (n, k) = name[: -len(".weight")], tensors[name].shape
        g, offset = group if group > 0 else k, int(method == "gptq" and fmt == "gptq")
        q, scales, zeros = draw_layer(rng, n, k, g, offset)
        tensors[name] = values(q, scales, zeros, g)
        del out[name]
        out[prefix + ".scales"] = scales
        if method == "awq":
            out[prefix + ".qweight"] = pack_awq(q.T)  # (K, N/8)
            out[prefix + ".qzeros"] = pack_awq(zeros)  # (K/G, N/8)
        else:  # the v1 format stores z - 1
            out[prefix + ".qweight"] = pack_seq(q.T, 0)  # (K/8, N)
            out[prefix + ".qzeros"] = pack_seq(zeros - offset, 1)  # (K/G, N/8)
            out[prefix + ".g_idx"] = (np.arange(k) // g).astype(np.int32)
    save_file(tensors, str(base / "model.safetensors"))  # the float32 twin's values
    quant = path / method
    shutil.copytree(base, quant)
    save_file(out, str(quant / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm", "modules_to_not_convert": None}
        if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
              "sym": False, "damp_percent": 0.01, "true_sequential": True,
              "static_groups": False, "checkpoint_format": fmt, "model_file_base_name": "model"}
    )  # fmt: skip
    (quant / "config.json").write_text(json.dumps(config))
    return quant, base


@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    return write_int4(tmp_path_factory.mktemp("awq"), "awq", seed=1)


@pytest.fixture(scope="module")
def gptq(tmp_path_factory):
    return write_int4(tmp_path_factory.mktemp("gptq"), "gptq", seed=2)


def test_the_writers_pack_as_the_tools_do():
    """The test's own packing, read back nibble by nibble (AWQ: output 8c + [0,2,4,6,1,3,5,7][i]
    in nibble i; GPTQ: input 8r + j in nibble j of row r)."""
    rng = np.random.default_rng()
    q = rng.integers(0, 16, (40, 24))
    a, s = pack_awq(q), pack_seq(q, 0)
    for i in range(8):
        np.testing.assert_array_equal(unpack_nibble(a, i), q[:, AWQ_PACK[i] :: 8])
        np.testing.assert_array_equal(unpack_nibble(s, i), q[i::8])


@pytest.mark.parametrize("method, group, fmt", [
    ("awq", 128, None), ("awq", 64, None), ("gptq", 128, "gptq"), ("gptq", 32, "gptq_v2"),
    ("gptq", -1, "gptq"),
])  # fmt: skip
def test_kept_blocks_hold_the_checkpoint_values_exactly(tmp_path, method, group, fmt):
    """(a) every layer matrix loads as q4_z blocks whose values are (q - z) s bit for bit, as
    the loader hands them out and as the cpu backend keeps them."""
    quant, base = write_int4(tmp_path, method, group, fmt or "gptq")
    want = load_model(str(base)).weights
    got = load_model(str(quant))
    for lw, lf in zip(got.weights.layers, want.layers, strict=True):
        for field in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            m = getattr(lw, field)
            assert m.kind == "q4_z", field
            np.testing.assert_array_equal(np.asarray(m), getattr(lf, field))
            part = m.take_rows(slice(3, 9))  # rows cut out (a fused projection's), in blocks
            assert part.kind == "q4_z"
            np.testing.assert_array_equal(np.asarray(part), getattr(lf, field)[3:9])
    cpu = make_engine(got, backend="cpu")
    f32 = make_engine(load_model(str(base)), backend="numpy")
    kept = matrices(cpu.backend)[1:]
    assert {w.kind for w in kept} == {"q4_z"}
    for q, f in zip(kept, matrices(f32.backend)[1:], strict=True):
        np.testing.assert_array_equal(q.dequantize(), f)


def run(engine):
    outs = run_to_completion(engine, SEED_PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs], [
        np.stack(o.outputs[0].step_logits) for o in outs
    ]


@pytest.mark.parametrize("which", ["awq", "gptq"])
def test_a_whole_model_against_its_float32_values(which, request):
    """(b) numpy: the same tokens and bit-equal logits as the float32 twin; cpu (x quantized to
    8 bits per 32, as its block kernels do): the tokens and logits of a numpy twin that
    quantizes x the same way over the float32 twin."""
    quant, base = request.getfixturevalue(which)
    q_loaded, f_loaded = load_model(str(quant)), load_model(str(base))
    kw = dict(record_logits=True)
    q_tokens, q_logits = run(make_engine(q_loaded, backend="numpy", **kw))
    f_tokens, f_logits = run(make_engine(f_loaded, backend="numpy", **kw))
    assert q_tokens == f_tokens
    for a, b in zip(q_logits, f_logits, strict=True):
        np.testing.assert_array_equal(a, b)
    twin = make_engine(f_loaded, backend="numpy", **kw)
    twin.backend.ops = twin_ops()  # x quantized for the layer matrices, not the float LM head
    vocab, product = f_loaded.config.vocab_size, twin.backend.ops.matmul
    twin.backend.ops.matmul = lambda x, w: (x @ w) if w.shape[1] == vocab else product(x, w)
    t_tokens, t_logits = run(twin)
    c_tokens, c_logits = run(make_engine(q_loaded, backend="cpu", **kw))
    assert c_tokens == t_tokens
    pairs = zip(c_logits, t_logits, strict=True)
    steps = np.concatenate([np.abs(a - b).max(axis=1) for a, b in pairs])  # per step
    # as tests/test_blocks.py's twin: x's 8-bit rounding, a step function, may round a value
    # near a half differently in another float order
    assert np.mean(steps < 1e-4) >= 0.9 and steps.max() < 0.1, steps


def assert_q4_z_products(rng, rows: int, n: int, k: int) -> None:
    """Where m = -s z is a float16 (z 0, 1, 2, 4, 8), q4_z and Q4_1 blocks are the same
    values, and every path of the kernel (GEMV, integer chunks, VNNI or float32 tiles) gives
    the same bits; for any z in 0..16 the product is the twin's (x quantized, then exact)."""
    nib = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    d = (rng.uniform(0.5, 2.0, (n, k // 32)) / 64).astype(np.float16)
    z = rng.choice([0, 1, 2, 4, 8], (n, k // 32)).astype(np.float16)
    q4z = QuantWeight("q4_z", nib, np.stack([d, z], 2).reshape(n, -1))
    m = (-d.astype(np.float32) * z.astype(np.float32)).astype(np.float16)
    assert np.array_equal(m.astype(np.float32), -d.astype(np.float32) * z.astype(np.float32))
    q41 = QuantWeight("q4_1", nib, np.stack([d, m], 2).reshape(n, -1))
    np.testing.assert_array_equal(q4z.dequantize(), q41.dequantize())
    x = rng.standard_normal((rows, k), dtype=np.float32)
    x[:, 3] *= 40
    np.testing.assert_array_equal(cpu_ops.matmul(x, q4z), cpu_ops.matmul(x, q41))
    z = rng.integers(0, 17, (n, k // 32)).astype(np.float16)
    assert_product(x, QuantWeight("q4_z", nib, np.stack([d, z], 2).reshape(n, -1)))


@pytest.mark.parametrize("rows", [1, 3, 9, 64, 65, 100])
def test_q4_z_products_equal_q4_1_where_q4_1_holds_the_values(rows):
    """This machine's build (tests/test_cpu_kernels.py runs the others): N of 48 and 33
    (VNNI's runs of 16 cut short), K of 8 and 3 blocks (Q4's pairs leave one)."""
    rng = np.random.default_rng()
    for n, k in [(48, 256), (33, 96)]:
        assert_q4_z_products(rng, rows, n, k)


def write_fp8(path, scheme: str):
    """A tiny llama whose layer matrices are float8_e4m3fn with a per-tensor, per-channel or
    128x128-block scale, and its float32 twin."""
    base = make_tiny_model(path / "float", seed=3, torch_dtype="bfloat16", **SHAPE)
    tensors, rng = load_file(str(base / "model.safetensors")), np.random.default_rng(3)
    out = dict(tensors)
    for name in [n for n in tensors if any(p in n for p in PROJ)]:
        n, k = tensors[name].shape
        w8 = (rng.standard_normal((n, k)) * 40).astype(ml_dtypes.float8_e4m3fn)
        prefix = name[: -len(".weight")]
        if scheme == "block":
            s = rng.uniform(0.5, 2, (-(-n // 128), -(-k // 128))).astype(np.float32) / 400
            full = np.kron(s, np.ones((128, 128), np.float32))[:n, :k]
            out[prefix + ".weight_scale_inv"] = s
        else:
            shape = (n, 1) if scheme == "channel" else ()
            s = np.array(rng.uniform(0.5, 2, shape) / 400, np.float32)
            full = s
            out[prefix + ".weight_scale"] = s
            out[prefix + ".input_scale"] = np.array(0.05, np.float32)
        out[name] = w8
        tensors[name] = w8.astype(np.float32) * full
    save_file(tensors, str(base / "model.safetensors"))
    quant = path / "fp8"
    shutil.copytree(base, quant)
    save_file(out, str(quant / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if scheme == "block":
        q["weight_block_size"] = [128, 128]
    else:
        q["activation_scheme"] = "static"
    config["quantization_config"] = q
    (quant / "config.json").write_text(json.dumps(config))
    return quant, base


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_is_kept_in_8_bits_with_its_float32_values(tmp_path, scheme, caplog):
    """FP8 weights load as Fp8Matrix whose values are float32 q * scale (one log line naming
    them and the bytes); the cpu backend keeps them as kind fp8, the same values; numpy (which
    widens them) gives the float32 twin's tokens and logits bit for bit, cpu (float32 x, the
    same values, another order of sums) the same tokens and logits to float rounding."""
    quant, base = write_fp8(tmp_path, scheme)
    with caplog.at_level(logging.INFO, logger="model_loader"):
        q_loaded = load_model(str(quant))
        list(q_loaded.weights.layers)
    lines = [r.getMessage() for r in caplog.records if "fp8 checkpoint" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.*.mlp.down_proj.weight x 2" in lines[0], lines
    f_loaded = load_model(str(base))
    for lw, lf in zip(q_loaded.weights.layers, f_loaded.weights.layers, strict=True):
        for field in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            assert getattr(lw, field).kind == "fp8"
            np.testing.assert_array_equal(np.asarray(getattr(lw, field)), getattr(lf, field))
    numpy_f32 = make_engine(f_loaded, backend="numpy", record_logits=True)
    cpu = make_engine(q_loaded, backend="cpu", record_logits=True)
    kept = matrices(cpu.backend)[1:]
    assert {w.kind for w in kept} == {"fp8"}
    for q, f in zip(kept, matrices(numpy_f32.backend)[1:], strict=True):
        np.testing.assert_array_equal(q.dequantize(), f)
    want = run(numpy_f32)
    a = run(make_engine(q_loaded, backend="numpy", record_logits=True))
    assert a[0] == want[0]
    for x, y in zip(a[1], want[1], strict=True):
        np.testing.assert_array_equal(x, y)
    b = run(cpu)
    assert b[0] == want[0]
    for x, y in zip(b[1], want[1], strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-4 * np.abs(y).max())


def assert_fp8_products(rows: int) -> None:
    """cpu_src/matmul_fp8.cpp (the dot up to 4 rows, sgemm over widened tiles past): x @ the
    float32 values e4m3(q) * s, per-row scales of 1 and 3 runs a row (219 and 73 inputs: 16,
    8 and 1 at a time), every byte (NaN aside), N cut short of a tile (70), against float64."""
    rng = np.random.default_rng()
    n, k = 70, 219
    q = rng.integers(0, 256, (n, k), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0  # e4m3's NaNs
    for nbk in (1, 3):
        s = rng.uniform(0.5, 2, (n, nbk)).astype(np.float32) / 300
        w = QuantWeight("fp8", q, s)
        values = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(n, nbk, -1)
        want_w = (values * s[:, :, None]).reshape(n, k).T  # (K, N), independent of quant.py
        np.testing.assert_array_equal(w.dequantize(), want_w)
        x = rng.standard_normal((rows, k), dtype=np.float32)
        want = x.astype(np.float64) @ want_w.astype(np.float64)
        got = cpu_ops.matmul(x, w)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 4, 5, 70])
def test_fp8_products(rows):
    """This machine's build (tests/test_cpu_kernels.py runs the others)."""
    assert_fp8_products(rows)


def test_fp8_blocks_that_do_not_divide_a_row_widen_it():
    """A 128-wide scale block over 96 inputs: that matrix is float32 q * s at load."""
    from model_loader.fp8_checkpoint import fp8_matrix

    rng = np.random.default_rng()
    q = (rng.standard_normal((40, 96)) * 30).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2, (1, 1)).astype(np.float32)
    got = fp8_matrix("p", {"p.weight": q, "p.weight_scale_inv": s}, (128, 128))
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_array_equal(got, q.astype(np.float32) * s[0, 0])


REFUSED = [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "awq bits=8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 48, "version": "gemm"}, "group_size=48"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "'exllama'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits=3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "marlin"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
]  # fmt: skip


@pytest.mark.parametrize("q, words", REFUSED)
def test_every_other_variant_is_refused_in_one_line(q, words):
    with pytest.raises(ValueError, match="quantization_config") as e:
        ModelConfig.from_hf_dict({**BASE, "quantization_config": q})
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_act_order_groups_are_refused_at_load(tmp_path):
    """(c) a g_idx that is not input // group_size (act-order) names the tensor."""
    quant, _ = write_int4(tmp_path, "gptq", 128, "gptq")
    tensors = load_file(str(quant / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"  # 256 inputs, 2 groups: one input swapped
    i = np.random.default_rng().integers(0, 128)
    tensors[name][[i, 255 - i]] = tensors[name][[255 - i, i]]
    save_file(tensors, str(quant / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.g_idx is not") as e:
        list(load_model(str(quant)).weights.layers)
    assert "\n" not in str(e.value)
