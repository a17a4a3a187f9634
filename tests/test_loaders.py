"""Loaders: Hugging Face safetensors (single, sharded, bf16/f16/f32, tied), GGUF (quant types, the
Q/K row permutation, metadata), model arguments (paths, alias, Hub) and every error they raise."""

from __future__ import annotations

import json
import shutil

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file

from engine.golden import read_golden
from model_loader.config import ModelConfig
from model_loader.gguf_file import gguf_weights, read_gguf
from model_loader.hf_weights import load_hf_weights
from model_loader.load import TINYLLAMA, default_model, load_model, resolve_model
from model_loader.synthetic import CORPUS, SPECIALS, make_tiny_model
from model_loader.tokenizer import Tokenizer
from reference.model import forward

# The test's own copy of the Hugging Face names (the spec the loader's table must agree with).
HF_LAYER = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
# Hugging Face layer tensor -> llama.cpp's GGUF name.
GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """(config dict, HF-named float32 tensors) of the tiny model."""
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    return cfg, load_file(str(tiny_model_dir / "model.safetensors"))


def copy_model(src, dst, tensors=None, **config_changes):
    """A copy of an HF directory, optionally with other tensors or config fields."""
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_changes)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def assert_weights_are(w, tensors, n_layers, tied=False):
    """Every ModelWeights field equals the HF tensor of that name (same dtype)."""
    pairs = [(w.embed, "model.embed_tokens.weight"), (w.final_norm, "model.norm.weight")]
    pairs.append((w.lm_head, "model.embed_tokens.weight" if tied else "lm_head.weight"))
    for i in range(n_layers):
        for field, hf_name in HF_LAYER.items():
            pairs.append((getattr(w.layers[i], field), f"model.layers.{i}.{hf_name}.weight"))
    for arr, name in pairs:
        assert arr.dtype == tensors[name].dtype, name
        np.testing.assert_array_equal(arr, tensors[name], err_msg=name)


# --- safetensors ------------------------------------------------------------------------------


def test_single_file_maps_every_tensor(tiny_model_dir, hf):
    cfg_dict, tensors = hf
    cfg = ModelConfig.from_hf_dict(cfg_dict)
    w = load_hf_weights(tiny_model_dir, cfg)
    assert_weights_are(w, tensors, cfg.num_hidden_layers)
    assert w.lm_head is not w.embed


def test_sharded_checkpoint_loads_the_same_arrays(tiny_model_dir, hf, tmp_path):
    cfg_dict, tensors = hf
    d = copy_model(tiny_model_dir, tmp_path / "sharded")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(d / shard))
    weight_map = {n: shard for shard, ns in shards.items() for n in ns}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    w = load_hf_weights(d, ModelConfig.from_hf_dict(cfg_dict))
    assert_weights_are(w, tensors, cfg_dict["num_hidden_layers"])


@pytest.mark.parametrize(
    "dtype, name, rtol",
    [
        (ml_dtypes.bfloat16, "bfloat16", 2**-8),
        (np.float16, "float16", 2**-11),
        (np.float32, "float32", 0),
    ],
)
def test_checkpoint_dtype_is_kept(tiny_model_dir, hf, tmp_path, dtype, name, rtol):
    cfg_dict, tensors = hf
    cast = {n: t.astype(dtype) for n, t in tensors.items()}
    d = copy_model(tiny_model_dir, tmp_path / name, cast, torch_dtype=name)
    loaded = load_model(str(d))
    assert loaded.config.torch_dtype == name
    assert_weights_are(loaded.weights, cast, cfg_dict["num_hidden_layers"])
    wq = tensors["model.layers.1.self_attn.q_proj.weight"]  # the cast is a rounding, not garbage
    np.testing.assert_allclose(loaded.weights.layers[1].wq.astype(np.float32), wq, rtol=rtol)


def test_tied_embeddings_share_one_array(tmp_path, hf):
    d = make_tiny_model(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    loaded = load_model(str(d))
    assert loaded.config.tie_word_embeddings
    assert loaded.weights.lm_head is loaded.weights.embed
    tensors = load_file(str(d / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    assert_weights_are(loaded.weights, tensors, 2, tied=True)


def test_load_model_from_hf_dir(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir))
    eos = loaded.tokenizer.token_to_id("<|endoftext|>")
    assert loaded.config.eos_token_ids == (eos,)
    assert loaded.tokenizer.eos_token_ids == [eos]
    assert loaded.source == str(tiny_model_dir)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(CORPUS[1])) == CORPUS[1]


def test_eos_from_generation_config_is_merged(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "eos")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_model(str(d)).config.eos_token_ids == (0, 2)


# --- errors -----------------------------------------------------------------------------------


def test_missing_tensor_is_named(tiny_model_dir, hf, tmp_path):
    tensors = dict(hf[1])
    del tensors["model.layers.1.mlp.up_proj.weight"]
    d = copy_model(tiny_model_dir, tmp_path / "missing", tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(d))


def test_wrong_shape_names_tensor_and_both_shapes(tiny_model_dir, hf, tmp_path):
    tensors = dict(hf[1])
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.ones((48, 64), np.float32)
    d = copy_model(tiny_model_dir, tmp_path / "shape", tensors)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(48, 64\).*\(32, 64\)"):
        load_model(str(d))


def test_unexpected_tensor_is_an_error(tiny_model_dir, hf, tmp_path):
    tensors = {**hf[1], "model.layers.0.self_attn.q_proj.bias": np.ones(64, np.float32)}
    d = copy_model(tiny_model_dir, tmp_path / "bias", tensors)
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"
    ):
        load_model(str(d))


def test_config_missing_required_field(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "nofield")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="intermediate_size"):
        load_model(str(d))


@pytest.mark.parametrize("model", ["/no/such/dir", "./nowhere", "not a model"])
def test_unknown_path_is_named(model):
    with pytest.raises(ValueError, match="no such file or directory") as e:
        resolve_model(model)
    assert repr(model) in str(e.value)


def test_directory_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match=r"\.gguf"):
        resolve_model(str(tmp_path / "x.bin"))


def test_hub_unreachable_says_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ValueError) as e:
        load_model(TINYLLAMA)
    message = str(e.value)
    assert "\n" not in message and TINYLLAMA in message
    assert "local Hugging Face directory" in message and "'smollm2'" in message
    model, why = default_model()
    assert model == "smollm2" and "TinyLlama" in why


def fake_hub_cache(hf_home, repo_id, src_dir):
    """The Hub cache layout snapshot_download reads offline: refs/main -> snapshots/<commit>."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_hub_repo_id_from_cache(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    fake_hub_cache(tmp_path, TINYLLAMA, tiny_model_dir)
    loaded = load_model(TINYLLAMA)
    assert loaded.source.startswith(TINYLLAMA) and str(tmp_path) in loaded.source
    assert loaded.config.hidden_size == 64
    assert default_model()[0] == TINYLLAMA


# --- GGUF -------------------------------------------------------------------------------------


def llama_cpp_permute(w, n_heads):
    """What llama.cpp's HF->GGUF converter does to q_proj/k_proj rows (rotate-half -> pairs)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tokenizer_metadata(writer, model_dir):
    """The tiny model's byte-level BPE as GGUF tokenizer.ggml.* keys."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template("{{ messages[0]['content'] }}")


def add_tensor(writer, name, arr, qtype):
    q = gguf.quants.quantize(arr, qtype)
    writer.add_tensor(name, q, raw_dtype=qtype if q.dtype == np.uint8 else None)


def write_gguf(path, cfg, tensors, model_dir, qtype=Q.F32, skip_keys=(), tok_model="gpt2"):
    """A llama-architecture GGUF of HF-named tensors: matrices as qtype, norms F32, Q/K permuted."""
    w = gguf.GGUFWriter(str(path), "llama")
    keys = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "head_count": cfg["num_attention_heads"],
        "head_count_kv": cfg["num_key_value_heads"],
        "rope_freq_base": cfg["rope_theta"],
        "layer_norm_rms_eps": cfg["rms_norm_eps"],
        "vocab_size": cfg["vocab_size"],
    }
    for key, value in keys.items():
        if key not in skip_keys:
            getattr(w, f"add_{key}")(value)
    gguf_tokenizer_metadata(w, model_dir)
    if tok_model != "gpt2":
        w.kv_data[0]["tokenizer.ggml.model"].value = tok_model
    add_tensor(w, "token_embd.weight", tensors["model.embed_tokens.weight"], qtype)
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in GGUF_LAYER.items():
            t = tensors[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                t = llama_cpp_permute(t, cfg["num_attention_heads"])
            if hf_name == "self_attn.k_proj":
                t = llama_cpp_permute(t, cfg["num_key_value_heads"])
            add_tensor(w, f"blk.{i}.{gguf_name}.weight", t, qtype if t.ndim == 2 else Q.F32)
    add_tensor(w, "output_norm.weight", tensors["model.norm.weight"], Q.F32)
    if "lm_head.weight" in tensors:
        add_tensor(w, "output.weight", tensors["lm_head.weight"], qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_f32_round_trips_hf_weights_and_qk_permutation(tiny_model_dir, hf, tmp_path, tiny):
    cfg_dict, tensors = hf
    q0 = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q0, 4), q0)  # the permutation is not a no-op
    path = write_gguf(tmp_path / "tiny.gguf", cfg_dict, tensors, tiny_model_dir)
    loaded = load_model(str(path))
    assert_weights_are(loaded.weights, tensors, cfg_dict["num_hidden_layers"])
    ids = np.array(tiny.tokenizer.encode(CORPUS[0]))
    np.testing.assert_array_equal(
        forward(loaded.weights, loaded.config, ids), forward(tiny.weights, tiny.config, ids)
    )


def test_gguf_config_from_metadata(tiny_model_dir, hf, tmp_path):
    cfg_dict, tensors = hf
    gf = read_gguf(write_gguf(tmp_path / "tiny.gguf", cfg_dict, tensors, tiny_model_dir))
    expected = ModelConfig.from_hf_dict(cfg_dict)
    fields = """vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
    num_key_value_heads head_dim rope_theta max_position_embeddings tie_word_embeddings"""
    for field in fields.split():
        assert getattr(gf.config, field) == getattr(expected, field), field
    assert gf.config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    assert gf.config.eos_token_ids == (2,) and gf.config.bos_token_id == 0
    assert gf.metadata["tokenizer.ggml.model"] == "gpt2"


def test_gguf_tied_when_no_output_tensor(tiny_model_dir, tmp_path):
    d = make_tiny_model(tmp_path / "tied", seed=5, tie_word_embeddings=True)
    cfg = json.loads((d / "config.json").read_text())
    tensors = load_file(str(d / "model.safetensors"))
    loaded = load_model(str(write_gguf(tmp_path / "tied.gguf", cfg, tensors, d)))
    assert loaded.config.tie_word_embeddings and loaded.weights.lm_head is loaded.weights.embed


# Worst-case dequantization error as a fraction of each 32-value block's max |x|: half a step of
# the quant's grid (Q4_0 may clamp a full step), plus a little for its float16 scales.
QUANT_ERROR = {Q.Q4_0: 0.13, Q.Q4_1: 0.07, Q.Q8_0: 0.005, Q.F16: 2**-11, Q.BF16: 2**-8, Q.F32: 0}


@pytest.mark.parametrize("qtype", list(QUANT_ERROR), ids=lambda q: q.name)
def test_gguf_quant_types_dequantize_within_their_error(tiny_model_dir, hf, tmp_path, qtype):
    cfg_dict, tensors = hf
    gf = read_gguf(write_gguf(tmp_path / "q.gguf", cfg_dict, tensors, tiny_model_dir, qtype))
    w = gguf_weights(gf)
    for name, got in [
        ("model.embed_tokens.weight", w.embed),
        ("lm_head.weight", w.lm_head),
        ("model.layers.1.mlp.down_proj.weight", w.layers[1].w_down),
        ("model.layers.1.self_attn.k_proj.weight", w.layers[1].wk),
    ]:
        want = tensors[name]  # (rows, cols), cols a multiple of 32
        assert got.dtype == np.float32 and got.shape == want.shape, name
        block_max = np.abs(want.reshape(want.shape[0], -1, 32)).max(
            -1, keepdims=True
        )  # (r, c/32, 1)
        err = np.abs(got - want).reshape(block_max.shape[:2] + (32,))  # (r, c/32, 32)
        assert np.all(err <= QUANT_ERROR[qtype] * block_max), (name, float((err / block_max).max()))
    np.testing.assert_array_equal(w.final_norm, tensors["model.norm.weight"])  # F32 stays exact


def test_gguf_tokenizer_matches_the_hf_one(tiny_model_dir, hf, tmp_path):
    gf = read_gguf(write_gguf(tmp_path / "t.gguf", *hf, tiny_model_dir))
    from_gguf = Tokenizer.from_gguf(gf.metadata)
    from_hf = Tokenizer.from_hf_dir(tiny_model_dir)
    for text in [*CORPUS, "<|im_start|>user\nhi there<|im_end|>\n"]:
        assert from_gguf.encode(text) == from_hf.encode(text), text
    assert from_gguf.encode("<|im_start|>") == [from_hf.token_to_id("<|im_start|>")]
    assert from_gguf.eos_token_ids == [2] and not from_gguf.add_bos


def test_gguf_missing_metadata_key(tiny_model_dir, hf, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", *hf, tiny_model_dir, skip_keys=("feed_forward_length",))
    with pytest.raises(ValueError, match=r"llama\.feed_forward_length"):
        read_gguf(path)


def test_gguf_sentencepiece_tokenizer_needs_scores(tiny_model_dir, hf, tmp_path):
    """load_model builds a ``llama`` tokenizer from the metadata (tests/test_tokenizer_sentencepiece
    checks it against sentencepiece); without tokenizer.ggml.scores it can't."""
    path = write_gguf(tmp_path / "sp.gguf", *hf, tiny_model_dir, tok_model="llama")
    with pytest.raises(ValueError, match="missing required metadata key 'tokenizer.ggml.scores'"):
        load_model(str(path))


# --- the real model ---------------------------------------------------------------------------


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (30, 576, 9)
    assert (c.num_key_value_heads, c.head_dim, c.rope_theta) == (3, 64, 100000.0)
    assert c.tie_word_embeddings and smollm2.weights.lm_head is smollm2.weights.embed
    assert c.vocab_size == 49152 and c.intermediate_size == 1536
    assert c.eos_token_ids == (2,)
    assert smollm2.source.startswith("smollm2 (") and smollm2.source.endswith(".gguf)")


def test_smollm2_tokenizer(smollm2):
    tok = smollm2.tokenizer
    text = "Hello, world! café naïve 東京 🙂\n\tend"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1]
    digits = tok.encode("12345")
    assert len(digits) == 5 and [tok.decode([i]) for i in digits] == list("12345")
    assert not tok.add_bos and tok.encode("hi")[0] != tok.bos_token_id


def test_smollm2_first_greedy_token_matches_transformers(smollm2):
    """The golden file's first case: the loaded weights (dequantized, Q/K restored) predict
    the token transformers predicted."""
    golden = read_golden("smollm2")["cases"][0]
    logits = forward(smollm2.weights, smollm2.config, np.array(golden["prompt_token_ids"]))
    assert int(np.argmax(logits)) == golden["token_ids"][0]


def test_loading_a_hf_directory_does_not_import_gguf(tiny_model_dir):
    """gguf is needed for .gguf files only (the GPU machine's image has no gguf)."""
    import subprocess
    import sys

    code = (
        "import sys; from model_loader.load import load_model; "
        f"load_model({str(tiny_model_dir)!r}); print('gguf' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_safetensors_are_mapped_with_the_bytes_safetensors_reads(tmp_path):
    """map_safetensors against the safetensors package's own reader, on fresh random tensors
    of every dtype the checkpoints use; read-only views of the file, and a file that is not
    safetensors named."""
    from model_loader.hf_weights import map_safetensors

    rng = np.random.default_rng()
    tensors = {
        f"t.{np.dtype(dt).name}": rng.standard_normal(shape).astype(dt)
        for dt, shape in [(np.float32, (3, 5)), (np.float16, (7,)), (ml_dtypes.bfloat16, (4, 2, 3)),
                          (np.int8, (9, 1)), (np.float64, (2,)), (np.int32, (0, 4))]
    }  # fmt: skip
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"format": "np"})
    want, got = (
        load_file(str(tmp_path / "m.safetensors")),
        map_safetensors(tmp_path / "m.safetensors"),
    )
    assert got.keys() == want.keys()
    for name, a in want.items():
        b = got[name]
        assert b.dtype == a.dtype and b.shape == a.shape and not b.flags.writeable
        np.testing.assert_array_equal(b.view(np.uint8), a.view(np.uint8))
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="bad.safetensors is not a safetensors file"):
        map_safetensors(tmp_path / "bad.safetensors")


def test_dropped_pages_leave_the_process_and_read_back_the_same(tmp_path):
    """drop_pages on a mapped tensor: the process's resident memory falls by about its bytes,
    and reading it again gives the file's values."""
    import os

    from model_loader.hf_weights import drop_pages, map_safetensors

    def resident() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    big = np.random.default_rng().standard_normal((1024, 4096), dtype=np.float32)  # 16 MiB
    save_file({"w": big}, str(tmp_path / "m.safetensors"))
    w = map_safetensors(tmp_path / "m.safetensors")["w"]
    assert float(w.sum(dtype=np.float64)) == pytest.approx(float(big.sum(dtype=np.float64)))
    before = resident()
    drop_pages(w, np.ones(4096, np.float32))  # an array that is not mapped: left alone
    assert before - resident() > 12 * 2**20
    np.testing.assert_array_equal(w, big)
