"""A tiny random LLaMA checkpoint in Hugging Face layout, written by the tests.

Deterministic from its seed: the same arguments always write the same bytes, so golden data made
from it by another implementation stays valid.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "hi my name is",
    "today is a beautiful summer day",
    "hello there",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "a sunset is extremely beautiful, isn't it? café naïve 東京 🙂",
    "once upon a time in a land far away there lived a small language model",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# the tiny models' shapes: this module's checkpoint, the family checkpoints
# (scripts/make_family_golden.py) and the configs the tests build start from it
TINY_SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY = dict(
    **TINY_SHAPE,
    num_hidden_layers=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on a fixed corpus; specials get ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def random_weights(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """HF-named float32 tensors, scaled so activations stay O(1) through the layers."""
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, v = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["vocab_size"]

    def mat(rows, cols):  # (rows, cols)
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):  # (n,) around 1, never all ones
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "self_attn.q_proj.weight"] = mat(nq, d)
        t[p + "self_attn.k_proj.weight"] = mat(nkv, d)
        t[p + "self_attn.v_proj.weight"] = mat(nkv, d)
        t[p + "self_attn.o_proj.weight"] = mat(d, nq)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        t[p + "mlp.gate_proj.weight"] = mat(f, d)
        t[p + "mlp.up_proj.weight"] = mat(f, d)
        t[p + "mlp.down_proj.weight"] = mat(d, f)
    t["model.norm.weight"] = norm(d)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = mat(v, d) * 4.0  # sharper logits: greedy ties are unlikely
    return t


def save_tokenizer(path: Path, tok: Tokenizer) -> None:
    """tokenizer.json and tokenizer_config.json (ChatML template, no BOS) for ``tok``."""
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "add_bos_token": False,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


def make_tiny_model(path, seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY, **overrides}
    tok = train_tokenizer(cfg["vocab_size"])
    assert tok.get_vocab_size() <= cfg["vocab_size"], "tokenizer outgrew the vocab"
    eos = tok.token_to_id("<|endoftext|>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": eos,
        "eos_token_id": eos,
        **cfg,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": eos})
    )
    save_tokenizer(path, tok)
    save_file(random_weights(cfg, np.random.default_rng(seed)), str(path / "model.safetensors"))
    return path
