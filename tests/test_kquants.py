"""GGUF's k-quants, 5-bit formats, MXFP4 and IQ4 (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, MXFP4, IQ4_NL,
IQ4_XS) kept as stored: the engine's dequantizers (model_loader/kquants.py) against gguf-py's
(an independent implementation) bit for bit on random blocks; a GGUF file of every type loaded
with its matrices kept in their blocks, its logits against a float32 file of the same values on
the numpy and cpu backends. The kernels' products are checked on every build in
tests/test_cpu_kernels.py (``assert_kquant_product``)."""

from __future__ import annotations

import types

import gguf
import numpy as np
import pytest

from engine.backends import fast_ops
from engine.backends.numpy_backend import NumpyBackend
from engine.backends.quant import RAW_FORMATS, QuantWeight, keep_stored
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from model_loader import kquants
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
from tests.test_loaders import gguf_tokenizer_metadata
from tests.utils import SEED_PROMPTS, make_engine

Q = gguf.GGMLQuantizationType
# type -> byte offsets of its float16 factors in a block
HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}
HALVES["MXFP4"] = ()  # its factor: an e8m0 exponent, byte 0
HALVES |= {"IQ4_NL": (0,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,)}


def random_raw(rng, type_name: str, rows: int, k: int, scale: float | None = None) -> np.ndarray:
    """(rows, bytes of a row) random blocks of the type: random bytes, the float16 factors
    finite (any finite bit pattern, or uniform in +-scale when given); MXFP4's exponents any
    byte, or given a scale such that the largest value 6 2^(e - 127) is within it, down to a
    sixteenth of it."""
    per, size = kquants.LAYOUTS[type_name]
    raw = rng.integers(0, 256, (rows * k // per, size), dtype=np.uint8)  # (blocks, bytes)
    if type_name == "MXFP4" and scale is not None:
        top = 127 + int(np.floor(np.log2(scale / 6)))
        raw[:, 0] = rng.integers(top - 4, top + 1, len(raw))
    for at in HALVES[type_name]:
        if scale is None:
            bits = rng.integers(0, 2**16, len(raw), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBBFF  # inf/NaN exponents -> finite
            h = bits.view(np.float16)
        else:
            h = rng.uniform(-scale, scale, len(raw)).astype(np.float16)
        raw[:, at : at + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


# (MXFP4 against gguf-py where it has the type; tests/test_mxfp4.py against its committed values)
@pytest.mark.parametrize("type_name", [t for t in kquants.LAYOUTS if t in Q.__members__])
def test_dequantizers_equal_gguf_py_bit_for_bit(type_name):
    rng = np.random.default_rng()
    per, _ = kquants.LAYOUTS[type_name]
    raw = random_raw(rng, type_name, 37, 4 * max(per, 256))
    mine = kquants.dequantize(raw, type_name)
    with np.errstate(over="ignore"):  # (MXFP4's largest exponents: inf)
        theirs = gguf.quants.dequantize(raw, Q[type_name])
    assert mine.dtype == np.float32 and mine.shape == theirs.shape == (37, 4 * max(per, 256))
    np.testing.assert_array_equal(mine.view(np.uint32), theirs.view(np.uint32))
    w = QuantWeight(type_name.lower(), raw)  # (K, N): the transpose, as a product takes it
    assert w.shape == mine.T.shape
    np.testing.assert_array_equal(w.dequantize(), mine.T)


def test_a_row_that_is_not_whole_blocks_is_one_line():
    with pytest.raises(ValueError, match="^Q6_K: a row of 200 bytes is not whole blocks of 210$"):
        kquants.dequantize(np.zeros((2, 200), np.uint8), "Q6_K")


# GGUF layer tensor -> its type in the file: every kept type, a Q8_0 fallback beside them
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
     "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_1", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
     "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "MXFP4"},
]  # fmt: skip
DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
DIMS |= dict(head_dim=64, num_hidden_layers=2)


def q8_0_raw(rng, rows: int, k: int) -> np.ndarray:
    return gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.05, Q.Q8_0)


def write_files(
    tmp_path, model_dir, rng, layers=LAYER_TYPES, table="Q4_K", head="Q6_K", scale=0.004
):
    """The same weights twice: a GGUF of random blocks of each type (``layers``: LAYER_TYPES'
    shape, the table ``table``, the LM head ``head``; float16 factors within +-``scale``) and a
    float32 GGUF of their values."""
    c = DIMS
    hd, dim, ffn = c["head_dim"], c["hidden_size"], c["intermediate_size"]
    rows = {"attn_q": 4 * hd, "attn_k": 2 * hd, "attn_v": 2 * hd, "attn_output": dim}
    rows |= {"ffn_gate": ffn, "ffn_up": ffn, "ffn_down": dim}
    cols = {name: (ffn if name == "ffn_down" else dim) for name in rows}
    tensors = {"token_embd.weight": (table, 320, dim), "output.weight": (head, 320, dim)}
    for i, layer in enumerate(layers):
        for name, t in layer.items():
            tensors[f"blk.{i}.{name}.weight"] = (t, rows[name], cols[name])
    raws = {}
    for name, (t, n, k) in tensors.items():
        raws[name] = q8_0_raw(rng, n, k) if t == "Q8_0" else random_raw(rng, t, n, k, scale)
    norms = [f"blk.{i}.{n}_norm.weight" for i in range(2) for n in ("attn", "ffn")]
    norms = {n: (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32) for n in norms}
    norms["output_norm.weight"] = np.ones(dim, np.float32)

    def header(w: gguf.GGUFWriter) -> None:
        w.add_block_count(2), w.add_context_length(512), w.add_embedding_length(dim)
        w.add_feed_forward_length(ffn), w.add_head_count(4), w.add_head_count_kv(2)
        w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(320)

    types = {name: t for name, (t, _, _) in tensors.items()}
    return write_twins(tmp_path, "llama", header, model_dir, raws, types, norms)


def write_twins(tmp_path, arch: str, header, model_dir, raws: dict, types: dict, plain: dict):
    """The same weights twice, [blocks.gguf, float32.gguf]: ``raws`` (name -> blocks of the
    type ``types`` names) as stored in one and dequantized by gguf-py in the other, the float32
    tensors ``plain`` in both; ``header(writer)`` adds the architecture's keys."""
    paths = []
    for kind in ("blocks", "float32"):
        w = gguf.GGUFWriter(str(tmp_path / f"{kind}.gguf"), arch)
        header(w)
        gguf_tokenizer_metadata(w, model_dir)
        for name, raw in raws.items():
            if kind == "blocks":
                w.add_tensor(name, raw, raw_dtype=Q[types[name]])
            else:
                w.add_tensor(name, gguf.quants.dequantize(raw, Q[types[name]]))
        for name, a in plain.items():
            w.add_tensor(name, a)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
        w.close()
        paths.append(tmp_path / f"{kind}.gguf")
    return paths


@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kquants")
    model_dir = make_tiny_model(tmp / "tok", seed=1)
    return write_files(tmp, model_dir, np.random.default_rng())


def kinds(w) -> list[str]:
    return [p.kind for p in w.parts] if w.kind == "parts" else [w.kind]


def test_a_kquant_gguf_is_kept_as_stored(kquant_files, caplog):
    blocks, _ = kquant_files
    loaded = load_model(str(blocks))
    caplog.set_level("INFO")
    cpu = make_engine(loaded, backend="cpu").backend
    assert kinds(cpu.layers[0].w_qkv) == ["q4_k", "q6_k"]  # q | k joined, v apart
    assert kinds(cpu.layers[1].w_qkv) == ["q5_1", "q5_0", "q8_0"]
    assert [cpu.layers[0].w_o.kind, cpu.layers[0].w_down.kind] == ["q5_k", "q6_k"]
    assert kinds(cpu.layers[0].w_gate_up) == ["q5_0", "q5_1"]
    assert cpu.layers[1].w_gate_up.kind == "q4_k" and cpu.lm_head.kind == "q6_k"
    assert cpu.layers[1].w_down.kind == "mxfp4"
    (raw,) = [
        t for t in gguf.GGUFReader(str(blocks)).tensors if t.name == "blk.1.attn_output.weight"
    ]
    np.testing.assert_array_equal(cpu.layers[1].w_o.data, raw.data)  # the file's bytes
    assert "weights resident, by format: q4_k" in caplog.text
    assert "mxfp4 0." in caplog.text  # (its 256 x 512 values: 0.1 MiB)


def test_tensor_parallel_cuts_of_kept_blocks_are_their_values(kquant_files):
    """A rank's rows and columns of a kept matrix come as float32 values (whole rows widened,
    then cut), never as cut blocks: each rank's weights equal the float32 file's."""
    from engine.executor.sharding import Shard

    blocks, f32 = (load_model(str(p)) for p in kquant_files)
    for rank in range(2):
        shard = Shard.of(blocks.config, rank, 2)
        a = shard.weights(blocks.weights, blocks.config)
        b = shard.weights(f32.weights, f32.config)
        for (name, x), (_, y) in zip(a.arrays(), b.arrays(), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def x_block(kind: str) -> int:
    """The values per scale of x as the kernels quantize it for a kept kind: 256 (Q8_K) for the
    k-quants and IQ4_XS, 32 for the 32-value block formats."""
    return 256 if kind.endswith("_k") or kind == "iq4_xs" else 32


def quantized_x(x: np.ndarray, per: int) -> np.ndarray:
    """x (M, K) -> (M, K) float64, x as the kernels quantize it: per row and ``per`` values,
    d = absmax / 127 (float32), q = x * (1 / d) rounded half to even."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // per, per)
    d = np.abs(blocks).max(axis=2) / np.float32(127)  # (M, K/per)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(blocks * inv[:, :, None])  # (M, K/per, per)
    return (q.astype(np.float64) * d[:, :, None]).reshape(m, k)


def twin_matmul(x: np.ndarray, w) -> np.ndarray:
    """The product the cpu backend computes for a kept weight, in float64: x quantized per 256
    (k-quants, IQ4_XS) or 32 (Q5_0, Q5_1, Q8_0, IQ4_NL), times the weight's dequantized values;
    each part of a fused matrix so."""
    if not isinstance(w, QuantWeight):
        return fast_ops.matmul(x, w)
    if w.kind == "parts":
        return np.concatenate([twin_matmul(x, p) for p in w.parts], axis=1)
    per = x_block(w.kind)
    return (quantized_x(x, per) @ w.dequantize().astype(np.float64)).astype(np.float32)


def twin_engine(loaded, monkeypatch):
    """A numpy engine holding the weights as the cpu backend keeps them, multiplying them with
    twin_matmul."""
    monkeypatch.setattr(
        NumpyBackend, "_matrix_store", lambda self, q, head=False: lambda w: keep_stored(w)
    )
    e = make_engine(loaded, backend="numpy", record_logits=True)
    e.backend.ops = types.SimpleNamespace(**{k: getattr(fast_ops, k) for k in dir(fast_ops)})
    e.backend.ops.matmul = twin_matmul
    return e


def test_kquant_logits_equal_a_float32_load_and_the_twin(kquant_files, monkeypatch):
    """numpy: the dequantized values, so the float32 file's logits exactly. cpu: x quantized
    to 8 bits per product, so against a numpy engine that does the same (twin_matmul): the same
    greedy tokens and logits to float rounding, a few outlier steps aside (x's rounding is a step
    function: two float orders may round a value near a half differently)."""
    blocks, f32 = (load_model(str(p)) for p in kquant_files)
    assert_runs_as_the_float32_file(blocks, f32, monkeypatch, max_tokens=6)


def assert_runs_as_the_float32_file(blocks, f32, monkeypatch, max_tokens: int) -> None:
    """``blocks`` (a file's kept blocks) against ``f32`` (their values in float32) on three
    prompts: numpy gives the same tokens and bit-equal logits; cpu the tokens and, to float
    rounding, the logits of a numpy twin that quantizes x as the kernels do."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(engine):  # per prompt: (tokens, (steps, V) logits)
        outs = run_to_completion(engine, SEED_PROMPTS[:3], greedy)
        return [(o.outputs[0].token_ids, np.stack(o.outputs[0].step_logits)) for o in outs]

    def numpy_engine(loaded):
        return make_engine(loaded, backend="numpy", record_logits=True)

    for (ta, a), (tb, b) in zip(run(numpy_engine(blocks)), run(numpy_engine(f32)), strict=True):
        assert ta == tb
        np.testing.assert_array_equal(a, b)
    cpu = run(make_engine(blocks, backend="cpu", record_logits=True))
    steps = []  # per step, the largest logit difference over the logits' size
    for (tc, c), (tt, t) in zip(cpu, run(twin_engine(blocks, monkeypatch)), strict=True):
        assert tc == tt
        steps += list(np.abs(c - t).max(axis=1) / np.abs(t).max())
    # measured: most steps 1e-7, a few of the 18 past 1e-5 on some random files
    assert np.median(steps) < 1e-5 and max(steps) < 0.05, steps


def kquant_weight(rng, kind: str, k: int, n: int) -> QuantWeight:
    """A (K, N) weight of random blocks of a RAW_FORMATS kind, factors of a real model's size."""
    return QuantWeight(kind, random_raw(rng, kind.upper(), n, k, 0.01))


def assert_kquant_product(x: np.ndarray, w: QuantWeight, got: np.ndarray) -> None:
    """got ~ x @ w's values in float64, within x's quantization to 8 bits (per 256 values for
    the k-quants and IQ4_XS, 32 for the others: |x - x~| <= step / 2 per value) and float32
    sums."""
    vals = w.dequantize().astype(np.float64)  # (K, N)
    per = x_block(w.kind)
    m, k = x.shape
    step = np.abs(x).reshape(m, k // per, per).max(axis=2) / 127  # (M, K/per)
    absw = np.abs(vals).reshape(k // per, per, -1).sum(axis=1)  # (K/per, N)
    bound = 0.5 * step @ absw + 1e-5 * (np.abs(x) @ np.abs(vals)) + 1e-30
    err = np.abs(got - x.astype(np.float64) @ vals)
    assert (err <= bound).all(), (err / bound).max()


assert set(RAW_FORMATS) == {t.lower() for t in kquants.LAYOUTS}
