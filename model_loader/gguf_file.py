"""GGUF files (llama.cpp's format) -> config, metadata and float32 tensors.

Three things differ from a Hugging Face checkpoint:
  * the config is read from ``llama.*`` metadata keys instead of ``config.json`` (a mixture
    of experts' keys and tensor names: ``model_loader.gguf_moe``);
  * tensors may be quantized (Q4_0, Q4_1, Q8_0, Q4_K, ...). Matrices in a k-quant, 5-bit,
    MXFP4 or IQ4 type (Q2_K to Q6_K, Q5_0, Q5_1, MXFP4, IQ4_NL, IQ4_XS), with, in a file
    that has them, its Q8_0/Q4_0/Q4_1 ones, and an embedding table or LM head in Q8_0, Q4_0
    or Q4_1, stay in their blocks (``model_loader.gguf_blocks.BlockMatrix``: float32 by row or
    whole when asked); every other tensor is dequantized to float32 when it is asked for,
    from the mapped file (``LazyTensors``; a model's layers one at a time: ``LazyLayers``),
    each type so widened logged once with its tensors and cost; and GGUF lists a tensor's
    dims fastest-first, the reverse of a NumPy shape;
  * llama.cpp's converter reorders the rows of the Q and K projections for its own rotary layout
    (pairs (2j, 2j+1) rotate together); ``unpermute_qk`` puts them back in Hugging Face's
    rotate-half layout (pairs (j, j + hd/2)), which ``reference.model.apply_rope`` expects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from model_loader.config import ModelConfig
from model_loader.families import FAMILIES
from model_loader.gguf_blocks import (  # noqa: F401  (BLOCK_KINDS, TransposedBlocks: re-exported)
    BLOCK_KINDS,
    KQUANT_TYPES,
    BlockMatrix,
    ExpertBlocks,
    TransposedBlocks,
)
from model_loader.gguf_gemma import (
    GEMMA_ARCHITECTURES,
    GGUF_SANDWICH_NAMES,
    OFFSET_NORMS,
    gemma_fields,
)
from model_loader.gguf_gpt_oss import GGUF_GPT_OSS_NAMES, GGUF_STACKED_BIAS, gpt_oss_fields
from model_loader.gguf_moe import (
    GGUF_SHARED,
    GGUF_STACKED,
    MOE_ARCHITECTURES,
    ROUTER,
    ROUTERS,
    clamp_kqv,
    gguf_moe_spec,
    moe_family,
)
from model_loader.hf_weights import (
    drop_pages,
    expected_shapes,
    family_layer_names,
    register_map,
    weights_from_tensors,
)
from model_loader.rope import RopeParams, parse_rope
from model_loader.weights import ModelWeights

log = logging.getLogger("model_loader")

# ModelWeights field -> GGUF tensor name.
GGUF_GLOBAL_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}

# LayerWeights field -> GGUF tensor name ({i} is the layer index).
GGUF_LAYER_NAMES = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
}

# general.architecture -> the family (model_loader.families) it is.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma"}
SUPPORTED_ARCHITECTURES["phi3"] = "phi3"
SUPPORTED_ARCHITECTURES |= GEMMA_ARCHITECTURES  # model_loader.gguf_gemma
SUPPORTED_ARCHITECTURES |= MOE_ARCHITECTURES  # and llama with experts: Mixtral (gguf_moe)
# llama.cpp's converter permutes Q/K rows for these only (the others rotate as HF does).
PERMUTED_QK = ("llama",)
# Family extras: LayerWeights field -> GGUF tensor name.
GGUF_BIAS_NAMES = {f"b{x}": f"blk.{{i}}.attn_{x}.bias" for x in "qkv"}
GGUF_QK_NORM_NAMES = {
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
}
# Phi-3's fused tensors (llama.cpp keeps them fused; ffn_up holds gate | up): fused -> parts.
GGUF_FUSED = {
    "blk.{i}.attn_qkv.weight": ("wq", "wk", "wv"),
    "blk.{i}.ffn_up.weight": ("w_gate", "w_up"),
}
# Norms llama.cpp's Gemma converter stores as 1 + w (the family's forward adds the 1 itself).
GGUF_NORMS = ("blk.{i}.attn_norm.weight", "blk.{i}.ffn_norm.weight")


class LazyTensors(Mapping):
    """GGUF name -> float32 array in NumPy (HF) orientation, made (dequantized from the mapped
    file, then reordered, split or offset as ``derive`` and ``split`` said) each time it is
    asked for; its shape is known before (``shape``)."""

    def __init__(self, reader: gguf.GGUFReader):
        self._shape = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
        has_k = any(t.tensor_type in KQUANT_TYPES for t in reader.tensors)
        self.kept = {t.name for t in reader.tensors if _kept(t, has_k)}
        self.multiplied = set(self.kept)  # kept to be multiplied as stored, not only read by row
        self._make = {t.name: (lambda t=t: self._tensor_of(t)) for t in reader.tensors}
        self._plain, self._tensor = dict(self._make), {t.name: t for t in reader.tensors}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._make[name]()

    def _tensor_of(self, t: gguf.ReaderTensor):
        if t.name not in self.kept:
            return _dequantized(t)
        kind = ExpertBlocks if len(t.shape) == 3 else BlockMatrix
        return kind.of(t, as_stored=t.name in self.multiplied)

    def keep_blocks(self, name: str) -> None:
        """tensors[name] becomes its BlockMatrix where the file stores it in a block format
        (and nothing derived it); otherwise it stays a float32 array."""
        t = self._tensor.get(name)
        if t is not None and t.tensor_type in BLOCK_KINDS and self._make[name] is self._plain[name]:
            self.kept.add(name)

    def __iter__(self):
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)

    def __contains__(self, name) -> bool:  # (Mapping's would make the array)
        return name in self._make

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def derive(self, name: str, fn) -> None:
        """tensors[name] becomes fn(what it was)."""
        make = self._make[name]
        self._make[name] = lambda: fn(make())

    def split(self, name: str, parts: dict[str, int]) -> None:
        """The (sum(rows), D) tensor ``name`` -> its consecutive row ranges, named by parts
        ({name: rows}); ``name`` itself goes."""
        make, (_, d) = self._make.pop(name), self._shape.pop(name)
        start = 0
        for part, rows in parts.items():
            self._shape[part] = (rows, d)
            self._make[part] = lambda a=start, b=start + rows: _rows(make(), a, b)
            start += rows

    def reshape(self, name: str, shape: tuple[int, ...]) -> None:
        """tensors[name] becomes its values in ``shape`` (as many)."""
        self._shape[name] = shape
        self.derive(name, lambda a: a.reshape(shape))

    def pop(self, name: str, default=None):
        if name not in self._make:
            return default
        self._shape.pop(name)
        return self._make.pop(name)()


def _kept(t: gguf.ReaderTensor, has_k: bool) -> bool:
    """Whether a tensor stays in its blocks: a matrix (or a mixture's 3-D experts) in a
    k-quant, 5-bit, MXFP4 or IQ4 type, or in Q8_0, Q4_0 or Q4_1 in a file that has those
    (``has_k``)."""
    if len(t.shape) not in (2, 3):
        return False
    return t.tensor_type in KQUANT_TYPES or (has_k and t.tensor_type in BLOCK_KINDS)


def _rows(a, start: int, stop: int):
    """Rows start..stop of a float32 array (a contiguous copy) or of a BlockMatrix (still in
    blocks)."""
    if isinstance(a, BlockMatrix):
        return a.take_rows(slice(start, stop))
    return np.ascontiguousarray(a[start:stop])


WIDER = {"F32": 4, "F16": 2, "BF16": 2}  # bytes a value of the plain float types


def log_widened(reader: gguf.GGUFReader, kept: set[str]) -> None:
    """One log line per type whose tensors are dequantized to float32 at load (float32 ones
    aside): the type, its tensors (layer numbers folded: ``blk.*.ffn_down.weight x 22``) and
    the bytes they take as float32 against the file's."""
    by_type: dict[str, list] = {}
    for t in reader.tensors:
        if t.name not in kept and t.tensor_type.name != "F32":
            by_type.setdefault(t.tensor_type.name, []).append(t)
    for name, ts in sorted(by_type.items()):
        counts: dict[str, int] = {}
        for t in ts:
            parts = t.name.split(".")
            key = ".".join(["blk", "*", *parts[2:]]) if parts[0] == "blk" else t.name
            counts[key] = counts.get(key, 0) + 1
        names = ", ".join(k if n == 1 else f"{k} x {n}" for k, n in counts.items())
        wide = sum(int(t.n_elements) * 4 for t in ts)
        log.info(
            "gguf: %s tensors are dequantized to float32 at load (%s): %.1f MiB as float32, "
            "%.1f MiB in the file", name, names, wide / 2**20,
            sum(int(t.n_bytes) for t in ts) / 2**20,
        )  # fmt: skip


@dataclass
class GGUFFile:
    config: ModelConfig
    metadata: dict[str, Any]  # every key/value pair (arrays as lists), tokenizer.* included
    tensors: LazyTensors  # GGUF name -> float32 array in NumPy (HF) orientation, on demand
    # (the table and the LM head in a block format: a BlockMatrix)


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Key -> Python value (str, int, float, bool, or a list of them)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _require(md: dict[str, Any], key: str):
    if key not in md:
        raise ValueError(f"gguf: missing required metadata key {key!r}")
    return md[key]


def _rope(md: dict[str, Any], arch: str, freq_factors) -> RopeParams:
    """RoPE from ``{arch}.rope.*``: none, linear or yarn scaling, or Llama 3's per-frequency
    factors (the ``rope_freqs.weight`` tensor, f_j divided by factor j)."""
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling == "none" or (scaling == "linear" and factor == 1.0):
        return RopeParams(theta=theta, freq_factors=freq_factors)
    if freq_factors:
        raise ValueError(f"gguf: rope_freqs.weight together with {scaling!r} scaling")
    if scaling == "linear":
        return RopeParams(theta=theta, rope_type="linear", factor=factor)
    if scaling == "yarn":
        original = int(_require(md, f"{arch}.rope.scaling.original_context_length"))
        d = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        return parse_rope({"rope_parameters": {**d, "rope_theta": theta}}, 0, "gguf")
    raise ValueError(f"gguf: {arch}.rope.scaling.type {scaling!r} is not supported")


def config_from_metadata(
    md: dict[str, Any], tied: bool, freq_factors=(), matrix_type: str | None = None, sparse=()
) -> ModelConfig:
    """ModelConfig from ``{arch}.*`` keys; ``tied`` when the file has no ``output.weight``;
    ``freq_factors``: the ``rope_freqs.weight`` tensor's values, if the file has one;
    ``matrix_type``: the type every layer matrix is stored in, when they share one;
    ``sparse``: per layer, whether it has a router (a mixture of experts: model_loader.gguf_moe)."""
    arch = _require(md, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"gguf: general.architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    family = moe_family(md, arch, SUPPORTED_ARCHITECTURES[arch])
    moe = gguf_moe_spec(md, arch, family, tuple(sparse)) if FAMILIES[family].moe else None
    n_heads = int(_require(md, f"{arch}.attention.head_count"))
    dim = int(_require(md, f"{arch}.embedding_length"))
    head_dim = int(md.get(f"{arch}.attention.key_length", dim // n_heads))
    rope_dims = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(
            f"gguf: partial rotary ({arch}.rope.dimension_count={rope_dims}) unsupported"
        )
    rope = _rope(md, arch, freq_factors)
    window = int(md.get(f"{arch}.attention.sliding_window", 0) or 0)
    vocab = md.get(f"{arch}.vocab_size") or len(_require(md, "tokenizer.ggml.tokens"))
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    n_layers = int(_require(md, f"{arch}.block_count"))
    windows = (window,) * n_layers if window else ()
    gemma = gemma_fields(md, arch, (dim, n_heads, n_layers))  # {} for the other families
    extra = {"layer_windows": windows, "rope": rope} | gemma
    extra |= gpt_oss_fields(md, arch, n_layers, rope)  # {} for the other families
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=dim,
        intermediate_size=int(_require(md, f"{arch}.feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(md.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope.theta,
        max_position_embeddings=int(md.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings=tied,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        torch_dtype="float32",  # dequantized
        stored_matrix_type=matrix_type,
        family=family,
        hidden_act="gelu_tanh" if family.startswith("gemma") else "silu",
        moe=moe,
        clip_qkv=clamp_kqv(md, arch),
        **extra,
    )


def matrix_type(reader: gguf.GGUFReader) -> str | None:
    """The type name ("Q8_0", "Q4_1", "F32", ...) every layer matrix of the file is stored in,
    or None when they differ: the engine's cpu backend can keep block formats as they are."""
    types = {
        t.tensor_type.name
        for t in reader.tensors
        if len(t.shape) in (2, 3) and t.name[:4] == "blk." and not t.name.endswith(ROUTERS)
    }  # a mixture's experts (3-D) too; its routers are read as float32 whatever their type
    return types.pop() if len(types) == 1 else None


def dequantize_tensor(t: gguf.ReaderTensor) -> np.ndarray:
    """One tensor as a writable float32 array; GGUF dims (fastest first) reversed to NumPy's."""
    shape = tuple(int(n) for n in reversed(t.shape))  # e.g. [dim, vocab] -> (vocab, dim)
    flat = gguf.quants.dequantize(t.data, t.tensor_type)
    if flat.size != int(np.prod(shape)):
        raise ValueError(f"gguf: tensor {t.name!r} holds {flat.size} values, dims say {shape}")
    return np.require(flat.reshape(shape), np.float32, ["C_CONTIGUOUS", "WRITEABLE"])


def _dequantized(t: gguf.ReaderTensor) -> np.ndarray:
    """dequantize_tensor, then the tensor's pages of the mapped file let go (read again, they
    come back from the page cache): the process holds the float32 values, not both."""
    a = dequantize_tensor(t)
    drop_pages(t.data)
    return a


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order, per head: interleaved pairs -> rotate-half halves.

    w: (n_heads * hd, dim). In the file, head h's rows are ordered (j, half) with half in {0, 1}
    varying fastest; Hugging Face orders them (half, j).
    """
    rows, dim = w.shape
    hd = rows // n_heads
    if isinstance(w, BlockMatrix):  # the same order of whole rows, still in blocks
        order = np.arange(rows).reshape(n_heads, hd // 2, 2).swapaxes(1, 2).reshape(rows)
        return w.take_rows(order)
    w = w.reshape(n_heads, hd // 2, 2, dim)  # (H, hd/2, 2, dim): as stored
    return w.swapaxes(1, 2).reshape(rows, dim)  # (H, 2, hd/2, dim) -> (H * hd, dim)


def _restore_qk(tensors: LazyTensors, cfg: ModelConfig) -> None:
    for i in range(cfg.num_hidden_layers):
        for name, n_heads in (
            (f"blk.{i}.attn_q.weight", cfg.num_attention_heads),
            (f"blk.{i}.attn_k.weight", cfg.num_key_value_heads),
        ):
            # (n_heads * hd, dim); a missing or misshapen one is reported with the others
            shape = tensors.shape(name) if name in tensors else ()
            if len(shape) == 2 and shape[0] == n_heads * cfg.head_dim:
                tensors.derive(name, lambda w, n=n_heads: unpermute_qk(w, n))


def _split_fused(tensors: LazyTensors, cfg: ModelConfig) -> None:
    """Phi-3's fused tensors (attn_qkv, ffn_up) -> the names of their parts."""
    shapes = expected_shapes(cfg)
    for i in range(cfg.num_hidden_layers):
        for fused, parts in GGUF_FUSED.items():
            name, rows = fused.format(i=i), [shapes[p][0] for p in parts]
            got = tensors.shape(name) if name in tensors else None
            if got is None or len(got) != 2 or got[0] != sum(rows):
                what = "missing" if got is None else f"of shape {got}"
                raise ValueError(
                    f"gguf: tensor {name!r} is {what}, config implies "
                    f"({sum(rows)}, {cfg.hidden_size})"
                )
            names = [GGUF_LAYER_NAMES[p].format(i=i) for p in parts]
            tensors.split(name, dict(zip(names, rows, strict=True)))


def read_gguf(path: str | Path) -> GGUFFile:
    """Config, metadata and every tensor (dequantized when asked for, Q/K rows in HF order,
    fused tensors split, Gemma's stored 1 + w norms back to w) of a .gguf file."""
    reader = gguf.GGUFReader(str(path))
    if isinstance(reader.data, np.memmap):
        register_map(reader.data)
    md = read_metadata(reader)
    tensors = LazyTensors(reader)
    factors = tensors.pop("rope_freqs.weight", None)  # (hd/2,) Llama 3's RoPE scaling
    tied = GGUF_GLOBAL_NAMES["lm_head"] not in tensors
    factors = () if factors is None else tuple(map(float, factors))
    arch = md.get("general.architecture")
    n = int(md.get(f"{arch}.block_count", 0) or 0)
    sparse = [ROUTER.format(i=i) in tensors for i in range(n)]
    cfg = config_from_metadata(md, tied, factors, matrix_type(reader), sparse)
    if cfg.moe is not None:
        _shared_gates_as_rows(tensors, cfg)
    if md["general.architecture"] in PERMUTED_QK:
        _restore_qk(tensors, cfg)
    if cfg.spec.fused_projections:
        _split_fused(tensors, cfg)
    if cfg.norm_offset:
        _unoffset_norms(tensors, cfg)
    for field in ("embed", "lm_head"):  # read by row, or kept in blocks: never widened whole
        tensors.keep_blocks(GGUF_GLOBAL_NAMES[field])
    log_widened(reader, tensors.kept)
    return GGUFFile(config=cfg, metadata=md, tensors=tensors)


def _unoffset_norms(tensors: LazyTensors, cfg: ModelConfig) -> None:
    offset = GGUF_NORMS + (OFFSET_NORMS if cfg.sandwich_norms else ())
    names = [n.format(i=i) for i in range(cfg.num_hidden_layers) for n in offset]
    for name in [*names, GGUF_GLOBAL_NAMES["final_norm"]]:
        if name in tensors:
            tensors.derive(name, lambda w: w - np.float32(cfg.norm_offset))


def _shared_gates_as_rows(tensors: LazyTensors, cfg: ModelConfig) -> None:
    """llama.cpp's (D,) shared-expert gates -> (1, D), the checkpoints' shape."""
    for i in range(cfg.num_hidden_layers):
        name = GGUF_SHARED["s_logit"].format(i=i)
        if name in tensors and tensors.shape(name) == (cfg.hidden_size,):
            tensors.reshape(name, (1, cfg.hidden_size))


def gguf_weights(gf: GGUFFile) -> ModelWeights:
    """ModelWeights from a read GGUF file, through the GGUF name tables (shapes checked)."""
    names = family_layer_names(
        gf.config,
        GGUF_LAYER_NAMES,
        GGUF_BIAS_NAMES,
        GGUF_QK_NORM_NAMES,
        GGUF_SANDWICH_NAMES,
        GGUF_GPT_OSS_NAMES,
    )
    moe_names = (GGUF_STACKED, GGUF_SHARED, GGUF_STACKED_BIAS)
    return weights_from_tensors(gf.tensors, gf.config, GGUF_GLOBAL_NAMES, names, moe_names)
