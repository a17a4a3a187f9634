"""Gemma 2 and Gemma 3 GGUF files, read as llama.cpp reads them.

llama.cpp's converter writes less than the Hugging Face config says, and llama.cpp fills the
rest in by rule; this module applies the same rules so a file runs as llama.cpp runs it:

- the attention's scale is ``head_dim ** -0.5`` (the 27B models, recognised by their layer
  count, use ``(hidden_size / heads) ** -0.5``): ``query_pre_attn_scalar`` is not written;
- the sliding layers: ``{arch}.attention.sliding_window`` with the per-layer flags of
  ``{arch}.attention.sliding_window_pattern`` (an array), or its period (an integer), else
  Gemma 2's period 2 and Gemma 3's 6 (every period-th layer full, the others sliding); a
  Gemma 3 file without a window has full attention on every layer;
- Gemma 3's sliding layers rotate with ``{arch}.rope.freq_base_swa`` (default 10,000) and
  no scaling; its full layers with ``rope.freq_base`` and the file's scaling; Gemma 2's
  layers share one RoPE;
- the soft-caps: ``{arch}.attn_logit_softcapping`` and ``{arch}.final_logit_softcapping``;
- every norm (``*norm.weight``, the sandwich norms and Gemma 3's q/k norms included) is stored
  as 1 + w.
"""

from __future__ import annotations

from typing import Any

from model_loader.rope import RopeParams

# general.architecture -> family
GEMMA_ARCHITECTURES = {"gemma2": "gemma2", "gemma3": "gemma3_text"}

# The sandwich norms' GGUF names (LayerWeights field -> name): llama.cpp's ffn_norm is the
# MLP's input norm (Hugging Face's pre_feedforward_layernorm).
GGUF_SANDWICH_NAMES = {
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
}

# the norms llama.cpp's Gemma 2/3 converters store as 1 + w, besides attn_norm and ffn_norm
OFFSET_NORMS = (
    "blk.{i}.post_attention_norm.weight",
    "blk.{i}.post_ffw_norm.weight",
    "blk.{i}.attn_q_norm.weight",
    "blk.{i}.attn_k_norm.weight",
)

PERIOD = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}  # llama.cpp's default sliding pattern
LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # the layer count llama.cpp takes for a 27B model


def sliding_windows(md: dict[str, Any], arch: str, n_layers: int) -> tuple[int, ...]:
    """Per layer, its sliding window (0: full attention), as llama.cpp reads a Gemma 2/3 or
    gpt-oss file."""
    window = int(md.get(f"{arch}.attention.sliding_window", 0) or 0)
    if window <= 0:
        if arch == "gemma2":
            window = 4096  # llama.cpp's default for Gemma 2
        else:
            return ()
    pattern = md.get(f"{arch}.attention.sliding_window_pattern", PERIOD[arch])
    if isinstance(pattern, list | tuple):
        if len(pattern) != n_layers:
            raise ValueError(
                f"gguf: {arch}.attention.sliding_window_pattern has {len(pattern)} flags for "
                f"{n_layers} layers"
            )
        flags = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        if period < 0:
            raise ValueError(f"gguf: {arch}.attention.sliding_window_pattern {period} < 0")
        flags = [period == 0 or i % period < period - 1 for i in range(n_layers)]
    return tuple(window if f else 0 for f in flags)


def gemma_fields(md: dict[str, Any], arch: str, dims: tuple[int, int, int]) -> dict[str, Any]:
    """ModelConfig's Gemma 2/3 fields of a file: query_pre_attn_scalar, the soft-caps,
    layer_windows and local_rope; ``dims``: (hidden size, heads, layers). Other
    architectures: nothing."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    dim, n_heads, n_layers = dims
    scalar = dim / n_heads if n_layers == LAYERS_27B[arch] else None  # None: head_dim's
    local = None
    if arch == "gemma3":
        local = RopeParams(theta=float(md.get(f"{arch}.rope.freq_base_swa", 10000.0)))
    return {
        "query_pre_attn_scalar": scalar,
        "attn_softcap": float(md.get(f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
        "final_softcap": float(md.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        "layer_windows": sliding_windows(md, arch, n_layers),
        "local_rope": local,
    }
