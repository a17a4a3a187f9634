"""A mixture of experts from a GGUF file whose experts are k-quants (as a Q4_K_M Qwen3-MoE or
Mixtral is; Q2_K/Q3_K as a Q3_K_M one), MXFP4 (as gpt-oss's) or IQ4_XS/IQ4_NL: each expert's
(N, K) matrix stays in the file's blocks (model_loader.gguf_blocks ExpertBlocks), the cpu
backend multiplies those bytes, and the logits are the float32 file's (numpy: the same
dequantized values, exactly; cpu: against a twin that quantizes x the same)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from model_loader.gguf_blocks import ExpertBlocks
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
from tests.test_kquants import (
    assert_runs_as_the_float32_file,
    kinds,
    q8_0_raw,
    random_raw,
    write_twins,
)
from tests.utils import make_engine

Q = gguf.GGMLQuantizationType
D, F, E, TOP_K, HD, VOCAB = 256, 256, 4, 2, 64, 320
# per layer: the experts' types (gate, up, down); the attention's matrices are Q8_0
EXPERT_TYPES = [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q4_K", "Q5_0"), ("MXFP4", "MXFP4", "MXFP4")]
EXPERT_TYPES += [("IQ4_XS", "IQ4_NL", "IQ4_XS"), ("Q2_K", "Q3_K", "Q3_K")]


def matrices() -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (type, NumPy shape) of every quantized tensor."""
    out = {"token_embd.weight": ("Q8_0", (VOCAB, D)), "output.weight": ("Q6_K", (VOCAB, D))}
    for i, (g, u, d) in enumerate(EXPERT_TYPES):
        attn = {"attn_q": 4 * HD, "attn_k": 2 * HD, "attn_v": 2 * HD}
        out |= {f"blk.{i}.{n}.weight": ("Q8_0", (rows, D)) for n, rows in attn.items()}
        out[f"blk.{i}.attn_output.weight"] = ("Q8_0", (D, 4 * HD))
        out[f"blk.{i}.ffn_gate_exps.weight"] = (g, (E, F, D))
        out[f"blk.{i}.ffn_up_exps.weight"] = (u, (E, F, D))
        out[f"blk.{i}.ffn_down_exps.weight"] = (d, (E, D, F))
    return out


def floats(rng) -> dict[str, np.ndarray]:
    """The float32 tensors: norms and routers."""
    out = {"output_norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    for i in range(len(EXPERT_TYPES)):
        for n, size in (
            ("attn_norm", D),
            ("ffn_norm", D),
            ("attn_q_norm", HD),
            ("attn_k_norm", HD),
        ):
            out[f"blk.{i}.{n}.weight"] = (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)
        out[f"blk.{i}.ffn_gate_inp.weight"] = rng.standard_normal((E, D)).astype(np.float32)
    return out


def write_files(tmp_path, model_dir, rng) -> list:
    """The same weights twice: a qwen3moe GGUF of random blocks, and a float32 GGUF of their
    values."""
    raws = {}
    for name, (t, shape) in matrices().items():
        rows, k = int(np.prod(shape[:-1])), shape[-1]
        raw = q8_0_raw(rng, rows, k) if t == "Q8_0" else random_raw(rng, t, rows, k, 0.004)
        raws[name] = raw.reshape(*shape[:-1], -1)

    def header(w: gguf.GGUFWriter) -> None:
        w.add_block_count(len(EXPERT_TYPES)), w.add_context_length(512)
        w.add_embedding_length(D), w.add_feed_forward_length(F), w.add_head_count(4)
        w.add_head_count_kv(2), w.add_key_length(HD), w.add_value_length(HD)
        w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-6), w.add_vocab_size(VOCAB)
        w.add_expert_count(E), w.add_expert_used_count(TOP_K)
        w.add_expert_feed_forward_length(F)

    types = {name: t for name, (t, _) in matrices().items()}
    return write_twins(tmp_path, "qwen3moe", header, model_dir, raws, types, floats(rng))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-kquants")
    model_dir = make_tiny_model(tmp / "tok", seed=1)
    return write_files(tmp, model_dir, np.random.default_rng())


def test_the_experts_stay_in_the_files_blocks(files):
    blocks, f32 = (load_model(str(p)) for p in files)
    assert blocks.config.moe.num_experts == E and blocks.config.family == "qwen3_moe"
    lw = blocks.weights.layers[1]
    assert isinstance(lw.e_gate, ExpertBlocks) and isinstance(lw.e_down, ExpertBlocks)
    # the values are what gguf-py dequantizes from the file's bytes (the float32 file)
    np.testing.assert_array_equal(np.asarray(lw.e_up), np.asarray(f32.weights.layers[1].e_up))
    cpu = make_engine(blocks, backend="cpu").backend
    ex0, ex1 = cpu.layers[0].experts, cpu.layers[1].experts
    assert {w.kind for w in ex0.gate_up} == {"q4_k"} and {w.kind for w in ex0.down} == {"q6_k"}
    assert kinds(ex1.gate_up[2]) == ["q5_k", "q4_k"] and ex1.down[3].kind == "q5_0"
    (raw,) = [t for t in gguf.GGUFReader(str(files[0])).tensors if "1.ffn_down_exps" in t.name]
    np.testing.assert_array_equal(ex1.down[3].data, raw.data[3])  # expert 3's bytes as stored
    assert ex0.router.dtype == np.float32
    ex2 = cpu.layers[2].experts  # gpt-oss's format: gate and up joined in one MXFP4 matrix
    assert {w.kind for w in ex2.gate_up} == {w.kind for w in ex2.down} == {"mxfp4"}
    ex3 = cpu.layers[3].experts  # IQ4_XS gate beside an IQ4_NL up: two parts
    assert kinds(ex3.gate_up[0]) == ["iq4_xs", "iq4_nl"] and ex3.down[1].kind == "iq4_xs"
    ex4 = cpu.layers[4].experts  # a Q2_K gate beside a Q3_K up (the k-quants' integer dots)
    assert kinds(ex4.gate_up[2]) == ["q2_k", "q3_k"] and ex4.down[0].kind == "q3_k"


def test_the_logits_are_the_float32_files(files, monkeypatch):
    blocks, f32 = (load_model(str(p)) for p in files)
    assert_runs_as_the_float32_file(blocks, f32, monkeypatch, max_tokens=5)


def test_tensor_parallel_cuts_of_kept_experts_are_their_values(files):
    """A rank's units of each kept expert come as float32 values (the stack widened, then cut),
    never as cut blocks: each rank's experts equal the float32 file's."""
    from engine.executor.sharding import Shard

    blocks, f32 = (load_model(str(p)) for p in files)
    for rank in range(2):
        shard = Shard.of(blocks.config, rank, 2)
        a = shard.weights(blocks.weights, blocks.config).layers
        b = shard.weights(f32.weights, f32.config).layers
        for x, y in zip(a, b, strict=True):
            for name in ("e_gate", "e_up", "e_down"):
                np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
