"""Mixtures of experts from GGUF: the tiny qwen3_moe, qwen2_moe, mixtral and olmoe checkpoints
written in llama.cpp's layout (3-D ffn_*_exps, the router ffn_gate_inp, Qwen2-MoE's *_shexp,
the <arch>.expert_* keys) load to the same model as from safetensors.

The writer here is held to what llama.cpp's convert_hf_to_gguf.py writes for the same
checkpoints (tests/data/gguf_moe_layout.json, scripts/record_gguf_moe_layout.py): metadata keys
and values, tensor names, dims and types, F32 and Q8_0. It writes two keys the converter
does not (EXTRA_KEYS): Mixtral's sliding window and OLMoE's clip_qkv, which llama.cpp's
converter drops; the loader reads both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from engine import SamplingParams
from engine.frontend.llm import run_to_completion
from model_loader.load import load_model
from reference.model import forward
from tests.test_families import FAMILY_DIR, golden, loaded
from tests.test_gguf_families import GGUF_NAMES
from tests.test_loaders import add_tensor, gguf_tokenizer_metadata, llama_cpp_permute
from tests.utils import make_engine

LAYOUT = json.loads((Path(__file__).parent / "data" / "gguf_moe_layout.json").read_text())
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}
MOE_NAMES = {  # HF name after model.layers.{i}. -> GGUF name after blk.{i}.
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
STACKED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
STACKED |= {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # Mixtral's
F32_ONLY = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # the converter keeps them so
EXTRA_KEYS = {"mixtral": {"llama.attention.sliding_window"}, "olmoe": {"olmoe.attention.clamp_kqv"}}


def metadata(name: str, d: dict) -> dict:
    """The <arch>.* keys llama.cpp's converter writes for this config.json (and EXTRA_KEYS)."""
    a = ARCH[name]
    md = {
        "block_count": d["num_hidden_layers"],
        "context_length": d["max_position_embeddings"],
        "embedding_length": d["hidden_size"],
        "feed_forward_length": d["intermediate_size"],
        "attention.head_count": d["num_attention_heads"],
        "attention.head_count_kv": d["num_key_value_heads"],
        "rope.freq_base": d["rope_parameters"]["rope_theta"],
        # OlmoeModel's converter writes 1e-5 whatever the config says
        "attention.layer_norm_rms_epsilon": 1e-5 if name == "olmoe" else d["rms_norm_eps"],
        "expert_count": d.get("num_experts") or d["num_local_experts"],
        "expert_used_count": d["num_experts_per_tok"],
    }
    if "head_dim" in d:
        md |= {"attention.key_length": d["head_dim"], "attention.value_length": d["head_dim"]}
    if "moe_intermediate_size" in d:
        md["expert_feed_forward_length"] = d["moe_intermediate_size"]
    if "shared_expert_intermediate_size" in d:
        md["expert_shared_feed_forward_length"] = d["shared_expert_intermediate_size"]
    if a == "llama":
        md |= {"vocab_size": d["vocab_size"], "rope.dimension_count": d["head_dim"]}
    if d.get("sliding_window") and name == "mixtral":
        md["attention.sliding_window"] = d["sliding_window"]
    if d.get("clip_qkv") is not None:
        md["attention.clamp_kqv"] = d["clip_qkv"]
    return {f"{a}.{k}": v for k, v in md.items()}


def add_key(w: gguf.GGUFWriter, key: str, value) -> None:
    vtype = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
    w.add_key_value(key, value, vtype)


def gguf_tensors(name: str, d: dict, shexp_1d: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> array (NumPy orientation): the experts stacked (E, rows, cols), Mixtral's
    q/k rows permuted as llama.cpp's converter does."""
    out, experts = {}, {}
    for hf, t in load_file(str(FAMILY_DIR / name / "model.safetensors")).items():
        m = EXPERT.fullmatch(hf)
        if m:
            i, e, kind = int(m[1]), int(m[2]), m[3]
            experts.setdefault(f"blk.{i}.{STACKED[kind]}.weight", {})[e] = t
            continue
        if ARCH[name] == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = d["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"]
            t = llama_cpp_permute(t, heads)
        if hf.endswith("shared_expert_gate.weight") and shexp_1d:
            t = t.reshape(-1)  # (D,): the shape llama.cpp declares
        out[gguf_tensor_name(hf)] = t
    for gname, by_expert in experts.items():
        out[gname] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def gguf_tensor_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    if hf in top or hf == "model.norm.weight":
        return top.get(hf, "output_norm.weight")
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{MOE_NAMES.get(rest) or GGUF_NAMES[rest]}"


def write_moe_gguf(name: str, path, qtype=Q.F32, shexp_1d: bool = False, edit=None) -> None:
    d = json.loads((FAMILY_DIR / name / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), ARCH[name])
    md = metadata(name, d) | (edit or {})
    for key, value in md.items():
        if value is not None:
            add_key(w, key, value)
    gguf_tokenizer_metadata(w, FAMILY_DIR / name)
    for gname, t in gguf_tensors(name, d, shexp_1d).items():
        quantized = t.ndim >= 2 and not gname.endswith(F32_ONLY)
        add_tensor(w, gname, np.ascontiguousarray(t, np.float32), qtype if quantized else Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def layout(path) -> dict:
    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith(arch + ".")}
    tensors = {
        t.name: [[int(n) for n in t.shape], t.tensor_type.name]
        for t in r.tensors
        if not t.name.startswith("blk.") or t.name.startswith("blk.0.")
    }
    return {"architecture": arch, "metadata": meta, "tensors": tensors}


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("name", sorted(ARCH))
def test_the_writer_writes_llama_cpps_layout(name, qtype, tmp_path):
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf(name, path, qtype)
    got, want = layout(path), LAYOUT[name][qtype.name.lower()]
    assert got["architecture"] == want["architecture"]
    assert got["tensors"] == want["tensors"]
    assert set(got["metadata"]) - set(want["metadata"]) <= EXTRA_KEYS.get(name, set())
    for key, value in want["metadata"].items():
        assert np.float32(got["metadata"][key]) == np.float32(value), key


def greedy(m, prompt, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine = make_engine(m, backend="cpu", block_size=4, num_gpu_blocks=128)
    return run_to_completion(engine, [prompt], params)[0].token_ids


@pytest.mark.parametrize("name", sorted(ARCH))
def test_moe_gguf_loads_as_the_checkpoint(name, tmp_path):
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf(name, path)
    hf, gg = loaded(name), load_model(str(path))
    for field in ("family", "moe", "clip_qkv", "qkv_bias", "qk_norm", "qk_norm_whole"):
        assert getattr(gg.config, field) == getattr(hf.config, field), field
    assert [gg.config.window(i) for i in range(3)] == [hf.config.window(i) for i in range(3)]
    ids = list(np.random.default_rng().integers(3, 320, size=45))
    np.testing.assert_allclose(
        forward(gg.weights, gg.config, ids), forward(hf.weights, hf.config, ids), atol=2e-5
    )
    case = golden(name)["cases"][1]
    assert greedy(gg, case["prompt_token_ids"], 6) == case["token_ids"][:6]


def q8_0(a: np.ndarray) -> np.ndarray:
    """a's values through Q8_0 and back (gguf's own quantizer), per row of 32-value blocks."""
    return gguf.quants.dequantize(gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_a_q8_0_moe_gguf_keeps_its_experts_as_stored(name, tmp_path):
    """Q8_0 experts (F32 routers): the loaded values are the file's blocks, and the cpu
    backend keeps the experts in Q8_0 as it keeps the dense matrices, its router float32."""
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf(name, path, Q.Q8_0)
    hf, gg = loaded(name), load_model(str(path))
    assert gg.config.stored_matrix_type == "Q8_0"
    for a, b in zip(hf.weights.layers, gg.weights.layers, strict=True):
        if a.router is None:
            continue
        np.testing.assert_array_equal(b.router, a.router)
        for field in ("e_gate", "e_up", "e_down", "s_gate", "s_down"):
            if getattr(a, field) is not None:
                np.testing.assert_array_equal(getattr(b, field), q8_0(getattr(a, field)))
    cpu = make_engine(gg, backend="cpu").backend
    assert cpu.quantization == "q8_0"
    for packed in cpu.layers:
        if packed.experts is not None:
            ex = packed.experts
            assert ex.router.dtype == np.float32
            assert {w.kind for w in (*ex.gate_up, *ex.down)} == {"q8_0"}


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_mixtral_greedy_tokens_are_llama_cpps(qtype, backend, tmp_path):
    """llama.cpp's own greedy tokens (scripts/make_llama_cpp_greedy_golden.py: its converter's
    file, and that file through its llama-quantize) after a 49-token prompt, in 20-token
    prefill chunks. The converter writes no sliding window for Mixtral and llama.cpp attends to
    every position: so does the file here."""
    qname = qtype.name.lower()
    case = json.loads((FAMILY_DIR / "llama_cpp_greedy.json").read_text())["cases"]["mixtral"]
    case = case[qname]
    path = tmp_path / f"mixtral-{qname}.gguf"
    write_moe_gguf("mixtral", path, qtype, edit={"llama.attention.sliding_window": None})
    params = SamplingParams(temperature=0.0, max_tokens=len(case["token_ids"]), ignore_eos=True)
    engine = make_engine(
        load_model(str(path)), backend=backend, max_num_batched_tokens=20, max_num_seqs=4,
        enable_chunked_prefill=True,
    )  # fmt: skip
    out = run_to_completion(engine, [case["prompt_token_ids"]], params)[0]
    assert out.token_ids == case["token_ids"]


def test_a_shared_expert_gate_as_llama_cpp_declares_it(tmp_path):
    """ffn_gate_inp_shexp as a (D,) vector loads as the (1, D) row."""
    path = tmp_path / "qwen2_moe.gguf"
    write_moe_gguf("qwen2_moe", path, shexp_1d=True)
    hf, gg = loaded("qwen2_moe"), load_model(str(path))
    assert gg.weights.layers[0].s_logit.shape == (1, 64)
    ids = list(np.random.default_rng().integers(3, 320, size=20))
    np.testing.assert_allclose(
        forward(gg.weights, gg.config, ids), forward(hf.weights, hf.config, ids), atol=2e-5
    )


@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("qwen3_moe", {"qwen3moe.expert_gating_func": 2}, "expert_gating_func 2 is not softmax"),
        ("olmoe", {"olmoe.expert_used_count": None}, "missing required metadata key "
         "'olmoe.expert_used_count'"),
        ("qwen2_moe", {"qwen2moe.expert_count": 0}, "expert_count must be a positive integer"),
        ("olmoe", {"olmoe.attention.clamp_kqv": -1.0}, "clamp_kqv must be positive"),
    ],
)  # fmt: skip
def test_bad_expert_metadata_is_refused(name, edit, message, tmp_path):
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf(name, path, edit=edit)
    with pytest.raises(ValueError, match=message):
        load_model(str(path))
