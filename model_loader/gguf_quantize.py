"""A model -> a GGUF file in one of llama.cpp's quantization mixes (model_loader.kquant_mix
picks each tensor's type, model_loader.kquant_encode makes its blocks, the bytes llama-quantize
writes). The source is a float32/float16/bfloat16 GGUF (its metadata copied, general.file_type
set to the mix's) or a Hugging Face safetensors directory of a llama model with a byte-level BPE
tokenizer (what the engine's loader reads; written as llama.cpp's converter lays it out: GGUF
names, Q/K rows in llama.cpp's rotary order, the tokenizer as ``tokenizer.ggml.*`` keys).
Tensors are written in llama.cpp's order (model_loader.kquant_mix.file_order).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from model_loader import kquant_encode, kquant_mix
from model_loader.gguf_file import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES

Q = gguf.GGMLQuantizationType
FLOATS = {Q.F32, Q.F16, Q.BF16}
# a tensor to write: (NumPy shape, its values as float32 when asked, its type in the source)
Source = tuple[tuple[int, ...], Callable[[], np.ndarray], str]


def _write_tensors(w: gguf.GGUFWriter, tensors: dict[str, Source], mix, n_layers, log) -> dict:
    """Each tensor quantized to the mix's type for it (or kept as float32 / its stored bytes),
    one progress line each; -> {name: the type written}."""
    types = kquant_mix.tensor_types({n: s for n, (s, _, _) in tensors.items()}, mix, n_layers)
    written, names = {}, kquant_mix.file_order(tensors)
    for k, name in enumerate(names, 1):
        shape, values, stored = tensors[name]
        t, start = types[name], time.perf_counter()
        if t is None:
            a = values()  # kept: float32, or float16 as stored
            w.add_tensor(name, a)
            written[name] = "F16" if a.dtype == np.float16 else "F32"
        else:
            a = np.asarray(values(), np.float32)  # (rows, K)
            if t == "F16":
                w.add_tensor(name, a.astype(np.float16))
            else:
                w.add_tensor(name, kquant_encode.quantize(a, t), raw_dtype=Q[t])
            written[name] = t
        secs = time.perf_counter() - start
        log(f"[{k:>4}/{len(names)}] {name:<34} {str(shape):<14} {stored:>4} -> "
            f"{written[name]:<4} {secs:6.2f} s")  # fmt: skip
    return written


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def _gguf_values(t: gguf.ReaderTensor) -> Callable[[], np.ndarray]:
    """A tensor's values: float32 (F16 stays float16, for a tensor kept as it is)."""
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type in (Q.F32, Q.F16):
        return lambda: np.array(t.data).reshape(shape)
    return lambda: gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)


def quantize_gguf(src: str | Path, dst: str | Path, mix: str, log=print) -> dict[str, str]:
    """A float GGUF file -> ``dst`` in ``mix``; -> {tensor name: type written}."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    tensors: dict[str, Source] = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        if kquant_mix.quantized(t.name, shape) and t.tensor_type not in FLOATS:
            raise ValueError(
                f"gguf: tensor {t.name!r} is already {t.tensor_type.name}; the quantizer reads "
                "F32, F16 or BF16 files only"
            )
        tensors[t.name] = (shape, _gguf_values(t), t.tensor_type.name)
    w = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",):
            continue
        if field.name in ("general.file_type", "general.quantization_version"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub)
    w.add_file_type(kquant_mix.FILE_TYPE[mix]), w.add_quantization_version(2)
    written = _write_tensors(w, tensors, mix, n_layers, log)
    _finish(w)
    return written


def _to_gguf_order(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face's rotate-half Q/K rows -> llama.cpp's interleaved pairs, per head (the
    inverse of model_loader.gguf_file.unpermute_qk): (n_heads * hd, dim) -> the same shape."""
    rows, dim = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, dim).swapaxes(1, 2).reshape(rows, dim)


def _name(a) -> str:
    """A checkpoint array's dtype as GGUF names it (F32, F16, BF16)."""
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(str(a.dtype), str(a.dtype))


def _checkpoint_tensors(cfg, weights) -> dict[str, Source]:
    def f32(a, fn=None):
        return lambda: fn(np.asarray(a, np.float32)) if fn else np.asarray(a, np.float32)

    src = {
        "embed": weights.embed,
        "final_norm": weights.final_norm,
        **({} if weights.lm_head is weights.embed else {"lm_head": weights.lm_head}),
    }
    out: dict[str, Source] = {
        GGUF_GLOBAL_NAMES[k]: (tuple(a.shape), f32(a), _name(a)) for k, a in src.items()
    }
    heads = {"wq": cfg.num_attention_heads, "wk": cfg.num_key_value_heads}
    for i, layer in enumerate(weights.layers):
        for field, pattern in GGUF_LAYER_NAMES.items():
            a = getattr(layer, field)
            fn = (lambda x, n=heads[field]: _to_gguf_order(x, n)) if field in heads else None
            out[pattern.format(i=i)] = (tuple(a.shape), f32(a, fn), _name(a))
    return out


def _tokenizer_keys(w: gguf.GGUFWriter, model_dir: Path, tokenizer, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json -> ``tokenizer.ggml.*`` (model gpt2, pre gpt-2), the
    token list padded to the embedding's rows with unused ``[PAD<i>]`` tokens."""
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text()) if path.exists() else {}
    model, decoder = tok.get("model", {}), tok.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise ValueError(
            f"checkpoint: {path} is not a byte-level BPE tokenizer; the quantizer writes only "
            "those (convert the model with llama.cpp's converter, then quantize that GGUF)"
        )
    vocab = {**model["vocab"], **{a["content"]: a["id"] for a in tok.get("added_tokens", [])}}
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    types = [3 if t in special else 1 for t in tokens]
    pad = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]  # as llama.cpp's converter
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("gpt-2"), w.add_token_list(tokens + pad)
    w.add_token_types(types + [5] * len(pad)), w.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        w.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_ids:
        w.add_eos_token_id(tokenizer.eos_token_ids[0])
    w.add_add_bos_token(bool(tokenizer.add_bos))
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)


def quantize_checkpoint(src: str | Path, dst: str | Path, mix: str, log=print) -> dict[str, str]:
    """A Hugging Face safetensors directory of a llama model -> ``dst`` in ``mix``."""
    from model_loader.load import load_model  # (the loader imports tokenizers, jinja2, ...)

    loaded = load_model(src)
    cfg = loaded.config
    if cfg.family != "llama" or cfg.rope.rope_type != "default" or cfg.rope.freq_factors:
        raise ValueError(
            f"checkpoint: the quantizer writes llama models with plain RoPE only (this is "
            f"{cfg.family!r}, rope {cfg.rope.rope_type!r}); convert it with llama.cpp's converter"
        )
    w = gguf.GGUFWriter(str(dst), "llama")
    w.add_name(Path(src).name), w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings), w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size), w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads), w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_vocab_size(cfg.vocab_size)
    w.add_key_length(cfg.head_dim), w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_file_type(kquant_mix.FILE_TYPE[mix]), w.add_quantization_version(2)
    _tokenizer_keys(w, Path(src), loaded.tokenizer, cfg.vocab_size)
    tensors = _checkpoint_tensors(cfg, loaded.weights)
    written = _write_tensors(w, tensors, mix, cfg.num_hidden_layers, log)
    _finish(w)
    return written


def quantize_file(src: str | Path, dst: str | Path, mix: str, log=print) -> dict[str, str]:
    """``src`` a .gguf file or a safetensors directory -> ``dst`` in ``mix``."""
    if mix not in kquant_mix.BASE:
        raise ValueError(f"unknown quantization mix {mix!r} (have {', '.join(kquant_mix.BASE)})")
    p = Path(src)
    if p.is_dir():
        return quantize_checkpoint(p, dst, mix, log)
    if p.is_file():
        return quantize_gguf(p, dst, mix, log)
    raise ValueError(f"{src}: neither a .gguf file nor a checkpoint directory")
