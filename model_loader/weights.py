"""Model weights as NumPy arrays, under the project's own names.

``ModelWeights`` is the one shape every loader produces (safetensors, GGUF) and every forward
consumes (the reference, the engine's backends). Matrices keep Hugging Face's
(out_features, in_features) orientation, so a linear layer is ``x @ w.T``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (dim,)
    wq: np.ndarray  # (n_heads * head_dim, dim)
    wk: np.ndarray  # (n_kv_heads * head_dim, dim)
    wv: np.ndarray  # (n_kv_heads * head_dim, dim)
    wo: np.ndarray  # (dim, n_heads * head_dim)
    mlp_norm: np.ndarray  # (dim,)
    w_gate: np.ndarray | None = None  # (ffn_dim, dim); None in a layer of experts
    w_up: np.ndarray | None = None  # (ffn_dim, dim)
    w_down: np.ndarray | None = None  # (dim, ffn_dim)
    # family extras, None where the family has none (model_loader.families)
    bq: np.ndarray | None = None  # (n_heads * head_dim,) q projection bias (Qwen2)
    bk: np.ndarray | None = None  # (n_kv_heads * head_dim,)
    bv: np.ndarray | None = None  # (n_kv_heads * head_dim,)
    bo: np.ndarray | None = None  # (dim,) o projection bias (gpt-oss)
    sinks: np.ndarray | None = None  # (n_heads,) each head's sink logit (gpt-oss)
    q_norm: np.ndarray | None = None  # (head_dim,) per-head RMSNorm of q before RoPE (Qwen3);
    #   OLMoE's over the whole projection: (n_heads * head_dim,)
    k_norm: np.ndarray | None = None  # (head_dim,); OLMoE's (n_kv_heads * head_dim,)
    post_attn_norm: np.ndarray | None = None  # (dim,) RMSNorm of the attention's output (Gemma 2)
    post_mlp_norm: np.ndarray | None = None  # (dim,) RMSNorm of the MLP's output
    # a layer of experts (model_loader.moe) in place of w_gate, w_up, w_down
    router: np.ndarray | None = None  # (n_experts, dim)
    e_gate: np.ndarray | None = None  # (n_experts, expert_ffn_dim, dim)
    e_up: np.ndarray | None = None  # (n_experts, expert_ffn_dim, dim)
    e_down: np.ndarray | None = None  # (n_experts, dim, expert_ffn_dim)
    # gpt-oss's biases of the router and of each expert's products
    router_bias: np.ndarray | None = None  # (n_experts,)
    e_gate_bias: np.ndarray | None = None  # (n_experts, expert_ffn_dim)
    e_up_bias: np.ndarray | None = None  # (n_experts, expert_ffn_dim)
    e_down_bias: np.ndarray | None = None  # (n_experts, dim)
    # Qwen2-MoE's shared expert, beside the routed ones: a gated MLP scaled by sigmoid(s_logit x)
    s_gate: np.ndarray | None = None  # (shared_ffn_dim, dim)
    s_up: np.ndarray | None = None  # (shared_ffn_dim, dim)
    s_down: np.ndarray | None = None  # (dim, shared_ffn_dim)
    s_logit: np.ndarray | None = None  # (1, dim) the shared expert's gate


class LazyLayers(Sequence):
    """A model's layers, each made on first use by ``make(i)`` and kept until ``release(i)``:
    a GGUF's are dequantized so, and the engine packs them one at a time and releases each,
    so the file's float32 values never all exist at once (the reference keeps them)."""

    def __init__(self, n: int, make):
        self._n, self._make, self._made = n, make, {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = range(self._n)[i]  # negative indices; IndexError past the end
        if i not in self._made:
            self._made[i] = self._make(i)
        return self._made[i]

    def release(self, i: int) -> None:
        self._made.pop(i, None)


def release_layer(layers: Sequence[LayerWeights], i: int) -> None:
    """Let layer i go where layers are made on demand (a list keeps it: nothing to do)."""
    if isinstance(layers, LazyLayers):
        layers.release(i)


@dataclass
class ModelWeights:
    embed: np.ndarray  # (vocab, dim)
    layers: Sequence[LayerWeights]  # a list, or LazyLayers
    final_norm: np.ndarray  # (dim,)
    lm_head: np.ndarray  # (vocab, dim); the same array as embed when embeddings are tied
    #   (a sequence classifier has no LM head: embed stands in, and nothing samples from it)
    score: np.ndarray | None = None  # (num_labels, dim) a sequence classifier's head

    def arrays(self):
        """Every array once, with its internal name (for byte counts and dtype casts)."""
        yield "embed", self.embed
        for i, layer in enumerate(self.layers):
            for f in fields(layer):
                if getattr(layer, f.name) is not None:
                    yield f"layers.{i}.{f.name}", getattr(layer, f.name)
        yield "final_norm", self.final_norm
        if self.lm_head is not self.embed:
            yield "lm_head", self.lm_head
        if self.score is not None:
            yield "score", self.score

    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.arrays())

    def astype(self, dtype) -> ModelWeights:
        """A copy with every array cast to ``dtype`` (ties preserved)."""
        embed = self.embed.astype(dtype)
        tied = self.lm_head is self.embed
        return ModelWeights(
            embed=embed,
            layers=[
                LayerWeights(**{f.name: _cast(getattr(lw, f.name), dtype) for f in fields(lw)})
                for lw in self.layers
            ],
            final_norm=self.final_norm.astype(dtype),
            lm_head=embed if tied else self.lm_head.astype(dtype),
            score=_cast(self.score, dtype),
        )


def _cast(a: np.ndarray | None, dtype) -> np.ndarray | None:
    return None if a is None else a.astype(dtype)
