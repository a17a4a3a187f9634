"""A float checkpoint's weights -> the same weights in one of llama.cpp's quantization mixes
(model_loader.kquant_mix), each matrix a ``BlockMatrix`` of the bytes ``llama-quantize`` would
write for it: what the engine's ``--quantization q4_k_m|q5_k_m|q6_k|q5_0`` loads, as if the
model came from such a GGUF file (the backends keep or widen the blocks as they do a file's).
Rows stay in Hugging Face's order: a block is a run of one row, so reordering Q/K rows as
llama.cpp's converter does would only reorder the same rows' bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import gguf
import numpy as np

from model_loader import kquant_encode, kquant_mix
from model_loader.config import ModelConfig
from model_loader.gguf_blocks import BlockMatrix
from model_loader.weights import ModelWeights

log = logging.getLogger("model_loader")
MIXES = tuple(kquant_mix.BASE)
# LayerWeights field -> GGUF tensor name ({i}: the layer), the matrices only
LAYER_MATRICES = {
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
}


def _to_type(name: str, a, type_name: str | None):
    """One (N, K) matrix -> a BlockMatrix of ``type_name`` (F16: float32 values rounded
    through float16; None: as it is)."""
    if type_name is None:
        return a
    if isinstance(a, BlockMatrix):
        raise ValueError(
            f"--quantization: {name} is already stored as {a.qtype.name}; the k-quant mixes "
            "quantize a float checkpoint (load the GGUF without --quantization)"
        )
    values = np.asarray(a, np.float32)  # (N, K)
    if type_name == "F16":
        return values.astype(np.float16).astype(np.float32)
    raw = kquant_encode.quantize(values, type_name)  # (N, bytes of a row)
    return BlockMatrix(name, gguf.GGMLQuantizationType[type_name], raw, values.shape)


def quantize_weights(w: ModelWeights, cfg: ModelConfig, mix: str) -> ModelWeights:
    """``w`` with every layer matrix, the embedding table and the LM head in the type the
    mix gives it (an untied LM head its own; a tied one the table's, Q6_K)."""
    if cfg.moe is not None:
        raise ValueError(
            f"--quantization {mix}: a mixture of experts' experts have no k-quant mix here; "
            "use --quantization q8_0 or int8"
        )
    t0, tied = time.perf_counter(), w.lm_head is w.embed
    shapes = {"token_embd.weight": tuple(w.embed.shape)}
    if not tied:
        shapes["output.weight"] = tuple(w.lm_head.shape)
    layers = list(w.layers)
    for i, lw in enumerate(layers):
        for field, pattern in LAYER_MATRICES.items():
            shapes[pattern.format(i=i)] = tuple(getattr(lw, field).shape)
    types = kquant_mix.tensor_types(shapes, mix, cfg.num_hidden_layers)
    embed = _to_type("token_embd.weight", w.embed, types["token_embd.weight"])
    head = embed if tied else _to_type("output.weight", w.lm_head, types["output.weight"])
    out = []
    for i, lw in enumerate(layers):
        mats = {f: p.format(i=i) for f, p in LAYER_MATRICES.items()}
        out.append(
            dataclasses.replace(
                lw, **{f: _to_type(n, getattr(lw, f), types[n]) for f, n in mats.items()}
            )
        )
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t or "kept"] = counts.get(t or "kept", 0) + 1
    log.info(
        "--quantization %s: %d matrices quantized at load in %.1f s (%s)", mix, len(types),
        time.perf_counter() - t0, ", ".join(f"{n} {t}" for t, n in sorted(counts.items())),
    )  # fmt: skip
    return dataclasses.replace(w, embed=embed, layers=out, lm_head=head)
