"""gpt-oss GGUF files (``general.architecture`` ``gpt-oss``), read as llama.cpp reads them.

llama.cpp's converter de-interleaves the experts' gate and up (``ffn_gate_exps``,
``ffn_up_exps`` (E, F, D)) and writes their biases apart; the attention's biases are
``attn_{q,k,v,output}.bias``, the sinks ``attn_sinks.weight`` (H,), the MLP's input norm
``post_attention_norm``, the router's bias ``ffn_gate_inp.bias``. The file says nothing of the
clamped SwiGLU: llama.cpp runs every gpt-oss file with alpha 1.702 and limit 7 (the released
models' values), and so does this loader. The layers alternate sliding and full attention,
even layers sliding, unless ``gpt-oss.attention.sliding_window_pattern`` says otherwise;
RoPE is the file's yarn scaling, without rounding the correction range to whole dimensions:
gpt-oss's own definition (its config's ``truncate: false``, as transformers runs it), where
llama.cpp's ``ggml_rope_yarn_corr_dims`` floors and ceils the range for every model (the
ramp of a few low-frequency dimensions differs; the tiny test model's greedy tokens are
llama.cpp's either way).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model_loader.gguf_gemma import sliding_windows
from model_loader.rope import RopeParams

ARCH = "gpt-oss"

# LayerWeights field -> GGUF name: the attention's extras and the MLP's input norm
GGUF_GPT_OSS_NAMES = {
    "bo": "blk.{i}.attn_output.bias",
    "sinks": "blk.{i}.attn_sinks.weight",
    "mlp_norm": "blk.{i}.post_attention_norm.weight",
}
# the router's and the experts' biases (model_loader.moe.STACKED_BIAS's fields)
GGUF_STACKED_BIAS = {
    "router_bias": "blk.{i}.ffn_gate_inp.bias",  # (E,)
    "e_gate_bias": "blk.{i}.ffn_gate_exps.bias",  # (E, F)
    "e_up_bias": "blk.{i}.ffn_up_exps.bias",  # (E, F)
    "e_down_bias": "blk.{i}.ffn_down_exps.bias",  # (E, D)
}


def gpt_oss_fields(md: dict[str, Any], arch: str, n_layers: int, rope: RopeParams) -> dict:
    """ModelConfig's gpt-oss fields of a file (layer_windows, its RoPE untruncated); other
    architectures: nothing."""
    if arch != ARCH:
        return {}
    windows = sliding_windows(md, arch, n_layers)
    if not any(windows):
        raise ValueError(f"gguf: {arch}.attention.sliding_window is missing or 0")
    return {"layer_windows": windows, "rope": dataclasses.replace(rope, truncate=False)}
