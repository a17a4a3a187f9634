"""Hugging Face safetensors checkpoints -> ``ModelWeights``, through one explicit name table.

A checkpoint is one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json``. Arrays keep the checkpoint's dtype (bfloat16 arrives as
``ml_dtypes.bfloat16``); every tensor is checked against the shape the config implies.
"""

from __future__ import annotations

import json
import mmap
import weakref
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from model_loader.checkpoint_quant import QuantizedTensors
from model_loader.config import ModelConfig
from model_loader.gemma import language_model_tensors
from model_loader.moe import SHARED, STACKED, moe_layer_names, moe_shapes, stack_experts
from model_loader.weights import LayerWeights, LazyLayers, ModelWeights

# ModelWeights field -> Hugging Face tensor name.
HF_GLOBAL_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "score": "score.weight",  # a *ForSequenceClassification checkpoint's head, instead of lm_head
}

# LayerWeights field -> Hugging Face tensor name ({i} is the layer index).
HF_LAYER_NAMES = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
}

# Family extras: LayerWeights field -> tensor name, for the families that have them.
HF_BIAS_NAMES = {
    "bq": "model.layers.{i}.self_attn.q_proj.bias",
    "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
}
# gpt-oss: the o projection's bias, each head's sink logit
HF_SINK_NAMES = {
    "bo": "model.layers.{i}.self_attn.o_proj.bias",
    "sinks": "model.layers.{i}.self_attn.sinks",
}
HF_QK_NORM_NAMES = {
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
# Gemma 2 and 3's sandwich norms: their post_attention_layernorm normalises the attention's
# output, pre_feedforward_layernorm is the MLP's input norm.
HF_SANDWICH_NAMES = {
    "mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Phi-3's fused projections, split at load into the names above: fused -> its parts.
HF_FUSED = {
    "model.layers.{i}.self_attn.qkv_proj.weight": ("wq", "wk", "wv"),
    "model.layers.{i}.mlp.gate_up_proj.weight": ("w_gate", "w_up"),
}

# Buffers some checkpoints carry that the forward recomputes instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every ModelWeights / LayerWeights field implied by the config."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    return {
        "embed": (v, d),
        "final_norm": (d,),
        "lm_head": (v, d),
        "score": (cfg.num_labels, d),
        "attn_norm": (d,),
        "wq": (cfg.q_dim, d),
        "wk": (cfg.kv_dim, d),
        "wv": (cfg.kv_dim, d),
        "wo": (d, cfg.q_dim),
        "mlp_norm": (d,),
        "w_gate": (f, d),
        "w_up": (f, d),
        "w_down": (d, f),
        "bq": (cfg.q_dim,),
        "bk": (cfg.kv_dim,),
        "bv": (cfg.kv_dim,),
        "q_norm": (cfg.q_dim,) if cfg.qk_norm_whole else (cfg.head_dim,),
        "k_norm": (cfg.kv_dim,) if cfg.qk_norm_whole else (cfg.head_dim,),
        "post_attn_norm": (d,),
        "post_mlp_norm": (d,),
        "bo": (d,),
        "sinks": (cfg.num_attention_heads,),
    } | (moe_shapes(cfg.moe, d) if cfg.moe is not None else {})


def family_layer_names(
    cfg: ModelConfig,
    base: Mapping[str, str],
    bias,
    qk_norm,
    sandwich=HF_SANDWICH_NAMES,
    sinks=HF_SINK_NAMES,
) -> dict[str, str]:
    """The name table of one layer for the config's family: the Llama table plus its extras."""
    names = dict(base)
    names.update(bias if cfg.qkv_bias else {})
    names.update(sinks if cfg.spec.sinks else {})
    names.update(qk_norm if cfg.qk_norm else {})
    names.update(sandwich if cfg.sandwich_norms else {})
    return names


def split_fused(
    tensors: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    fused_names: Mapping[str, tuple[str, ...]] = HF_FUSED,
    layer_names: Mapping[str, str] = HF_LAYER_NAMES,
    where: str = "checkpoint",
) -> dict[str, np.ndarray]:
    """Phi-3: each fused tensor (qkv_proj, gate_up_proj; GGUF's attn_qkv, ffn_up) split along
    its rows into the names of its parts."""
    out, shapes = dict(tensors), expected_shapes(cfg)
    for i in range(cfg.num_hidden_layers):
        for fused, parts in fused_names.items():
            name, rows = fused.format(i=i), [shapes[p][0] for p in parts]
            w = out.pop(name, None)
            if w is None or w.ndim != 2 or w.shape[0] != sum(rows):
                got = "missing" if w is None else f"of shape {tuple(w.shape)}"
                raise ValueError(
                    f"{where}: tensor {name!r} is {got}, config implies "
                    f"({sum(rows)}, {cfg.hidden_size})"
                )
            ends = np.cumsum([0, *rows])
            for part, a, b in zip(parts, ends[:-1], ends[1:], strict=True):
                kept = hasattr(w, "take_rows")  # blocks: cut between rows, still blocks
                chunk = w.take_rows(slice(a, b)) if kept else np.ascontiguousarray(w[a:b])
                out[layer_names[part].format(i=i)] = chunk
    return out


def _check(tensors: Mapping[str, np.ndarray], name: str, shape: tuple, used: set) -> None:
    """The tensor ``name`` is there with ``shape`` (from ``tensors.shape(name)`` where the
    mapping makes its arrays on demand); records it as used."""
    if name not in tensors:
        raise ValueError(f"checkpoint: missing tensor {name!r} (expected shape {shape})")
    got = tuple(tensors.shape(name) if hasattr(tensors, "shape") else tensors[name].shape)
    if got != shape:
        raise ValueError(f"checkpoint: tensor {name!r} has shape {got}, config implies {shape}")
    used.add(name)


def _take(tensors: Mapping[str, np.ndarray], name: str, shape: tuple, used: set) -> np.ndarray:
    """The tensor ``name``, checked against ``shape``; records it as used."""
    _check(tensors, name, shape, used)
    return tensors[name]


def weights_from_tensors(
    tensors: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    global_names: Mapping[str, str] = HF_GLOBAL_NAMES,
    layer_names: Mapping[str, str] | None = None,
    moe_names: tuple = (STACKED, SHARED),
) -> ModelWeights:
    """Assemble ModelWeights from named tensors through a name table (HF's by default).

    Every tensor is shape-checked; with tied embeddings ``lm_head`` is the embedding array itself.
    A sequence classifier (``cfg.num_labels``) brings ``score`` (its head) and no LM head.
    A sparse layer's experts are named by ``moe_names`` (stacked, shared: model_loader.moe's,
    or a GGUF's). A tensor the table does not know is an error: the forward would silently
    ignore it. From a mapping that makes its arrays on demand (a GGUF's), the layers are
    LazyLayers.
    """
    if layer_names is None:
        layer_names = family_layer_names(cfg, HF_LAYER_NAMES, HF_BIAS_NAMES, HF_QK_NORM_NAMES)
    shapes, used = expected_shapes(cfg), set()
    sparse = cfg.moe.sparse if cfg.moe is not None else (False,) * cfg.num_hidden_layers
    tables = [moe_layer_names(layer_names, cfg.moe, *moe_names) if s else layer_names
              for s in sparse]  # fmt: skip
    embed = _take(tensors, global_names["embed"], shapes["embed"], used)
    for i in range(cfg.num_hidden_layers):  # every layer's names and shapes, now
        for field, name in tables[i].items():
            _check(tensors, name.format(i=i), shapes[field], used)

    def layer(i: int) -> LayerWeights:
        return LayerWeights(**{f: tensors[n.format(i=i)] for f, n in tables[i].items()})

    n = cfg.num_hidden_layers
    layers = LazyLayers(n, layer) if hasattr(tensors, "shape") else [layer(i) for i in range(n)]
    final_norm = _take(tensors, global_names["final_norm"], shapes["final_norm"], used)
    score = None
    if cfg.num_labels:  # a classifier: its head; embed stands in for the LM head it lacks
        score = _take(tensors, global_names["score"], shapes["score"], used)
        lm_head = embed
    elif cfg.tie_word_embeddings:
        used.add(global_names["lm_head"])  # a tied checkpoint may still store a copy: unused
        lm_head = embed
    else:
        lm_head = _take(tensors, global_names["lm_head"], shapes["lm_head"], used)
    extra = sorted(n for n in tensors if n not in used and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"checkpoint: unexpected tensor {extra[0]!r} ({len(extra)} in all)")
    return ModelWeights(embed, layers, final_norm, lm_head, score)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: the shards named by the index, else ``model.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index}: missing field 'weight_map'")
        return [model_dir / shard for shard in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


# safetensors' dtype names -> NumPy's (bfloat16 and the 8-bit floats through ml_dtypes)
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


# (first byte's address, end, a weak reference to its mmap) per mapped file: the map closes
# when its last tensor goes
_MAPS: list[tuple[int, int, weakref.ref]] = []


def drop_pages(*arrays) -> None:
    """Let go of the memory-mapped pages that lie wholly inside these arrays (madvise
    MADV_DONTNEED): a read-only map of a file, so the bytes stay what they were and come back
    from the page cache if read again; the process stops counting them. Arrays that are not
    over a mapped checkpoint are left alone."""
    page = mmap.PAGESIZE
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.nbytes < page:
            continue
        lo = a.__array_interface__["data"][0]
        for start, end, ref in _MAPS:
            mm = ref()
            if mm is not None and start <= lo and lo + a.nbytes <= end:
                first = -(-(lo - start) // page) * page  # whole pages inside the array only
                last = (lo + a.nbytes - start) // page * page
                if last > first:
                    mm.madvise(mmap.MADV_DONTNEED, first, last - first)


def register_map(mapped: np.memmap) -> np.ndarray:
    """A read-only map of a checkpoint whose pages drop_pages may let go; -> a plain read-only
    array over it."""
    raw = np.asarray(mapped)
    if raw.size and hasattr(mmap, "MADV_DONTNEED"):
        start = raw.__array_interface__["data"][0]
        _MAPS[:] = [m for m in _MAPS if m[2]() is not None]
        _MAPS.append((start, start + raw.size, weakref.ref(mapped._mmap)))
    return raw


def map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as read-only arrays over a memory map of it: nothing is
    read or copied until a tensor's bytes are used, so a loader that converts tensor by tensor
    holds one converted copy, not the file's bytes as well. The format: an 8-byte little-endian
    header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}}, the data."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    raw = register_map(mapped)
    n = int(raw[:8].view("<u8")[0]) if raw.size >= 8 else -1
    if not 0 < n <= raw.size - 8:
        raise ValueError(f"checkpoint: {path.name} is not a safetensors file (header length)")
    header = json.loads(bytes(raw[8 : 8 + n]))
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"checkpoint: tensor {name!r} has dtype {info['dtype']}, not read")
        begin, end = (8 + n + o for o in info["data_offsets"])
        dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
        tensors[name] = raw[begin:end].view(dtype).reshape(info["shape"])
    return tensors


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (all shards), by Hugging Face name, in its stored dtype,
    memory-mapped (map_safetensors)."""
    tensors: dict[str, np.ndarray] = {}
    for path in safetensors_files(Path(model_dir)):
        if not path.exists():
            raise ValueError(f"checkpoint: shard {path.name!r} listed in the index is missing")
        tensors.update(map_safetensors(path))
    return tensors


def load_hf_weights(model_dir: str | Path, cfg: ModelConfig) -> ModelWeights:
    """Read a Hugging Face directory's safetensors into ModelWeights (checkpoint dtype kept;
    a quantized checkpoint's layers as model_loader.checkpoint_quant makes them)."""
    tensors = language_model_tensors(read_safetensors(model_dir))  # Gemma 3 multimodal: its LM
    mxfp4 = cfg.quantization is not None and cfg.quantization.method == "mxfp4"
    if mxfp4 and cfg.family != "gpt_oss":
        raise ValueError(f"config.json: quantization_config mxfp4 is read for gpt_oss only, "
                         f"not {cfg.family}")  # fmt: skip
    if cfg.quantization is not None and not mxfp4:  # MXFP4: the experts, model_loader.moe
        tensors = QuantizedTensors(tensors, cfg.quantization)
    if cfg.spec.fused_projections:
        tensors = split_fused(tensors, cfg)
    if cfg.moe is not None:
        tensors = stack_experts(tensors, cfg.family, cfg.moe, cfg.hidden_size)
    return weights_from_tensors(tensors, cfg)
