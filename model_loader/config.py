"""The model's configuration: the handful of numbers that fix a LLaMA-architecture network.

Read once from a Hugging Face ``config.json`` (or from GGUF metadata, see
``model_loader.gguf_file``) into one frozen dataclass that every other module takes as given. Which
family the checkpoint is, and which keys each family reads, is ``model_loader.families``'s table: a
config that names another family, or holds a key that would change the math and is not implemented,
is refused here, before any weights are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from model_loader.checkpoint_quant import CheckpointQuant, parse_quantization
from model_loader.families import (
    FAMILIES,
    activation,
    check_keys,
    family_of,
    is_classifier,
    layer_windows,
)
from model_loader.gemma import attention_params, kind_ropes, text_config
from model_loader.moe import MoeSpec, moe_spec
from model_loader.rope import RopeParams, parse_rope

# Hugging Face config.json keys that must be present (no sensible default exists).
REQUIRED_HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DTYPE_BYTES |= {"fp8_e4m3": 1, "fp8_e5m2": 1}  # the host backends' 8-bit KV caches


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # dim of the residual stream
    intermediate_size: int  # hidden dim of the SwiGLU MLP
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # K/V heads (grouped-query attention when fewer than query heads)
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"  # the checkpoint's dtype as config.json names it
    family: str = "llama"  # model_loader.families.FAMILIES key
    rope: RopeParams | None = None  # None: default RoPE with rope_theta
    hidden_act: str = "silu"  # silu | gelu_tanh | gelu: the gated MLP's activation
    layer_windows: tuple[int, ...] = ()  # per layer, its sliding window (0 or absent: none)
    stored_matrix_type: str | None = None  # a GGUF's layer matrices' type if one ("Q8_0")
    labels: tuple[str, ...] = ()  # a sequence classifier's labels, in id order (): a causal LM)
    problem_type: str | None = None  # a classifier's: how its logits become probabilities
    moe: MoeSpec | None = None  # a mixture of experts' experts and routing (None: dense)
    # Gemma 2 / 3 (model_loader.gemma): scores scaled by query_pre_attn_scalar ** -0.5 (None:
    # head_dim's), soft-capped tanh(s / cap) * cap (0: not), logits likewise, and the sliding
    # layers' own RoPE (None: ``rope`` for every layer)
    query_pre_attn_scalar: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    local_rope: RopeParams | None = None
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv]
    quantization: CheckpointQuant | None = None  # a quantized checkpoint's (AWQ, GPTQ, FP8)

    def __post_init__(self):
        if self.rope is None:
            object.__setattr__(self, "rope", RopeParams(theta=self.rope_theta))
        if self.rope.theta != self.rope_theta:
            object.__setattr__(self, "rope_theta", self.rope.theta)
        if self.family not in FAMILIES:
            raise ValueError(f"config: family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(
                f"config: {len(self.layer_windows)} layer windows for "
                f"{self.num_hidden_layers} layers"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def num_labels(self) -> int:
        """A sequence classifier's outputs (its score head's rows); 0 for a causal LM."""
        return len(self.labels)

    @property
    def spec(self):
        """The family's flags (model_loader.families.Family)."""
        return FAMILIES[self.family]

    @property
    def qkv_bias(self) -> bool:
        return self.spec.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return bool(self.spec.qk_norm)

    @property
    def qk_norm_whole(self) -> bool:
        """q and k RMS-normalised over the whole projection (OLMoE), not per head."""
        return self.spec.qk_norm == "projection"

    @property
    def norm_offset(self) -> float:
        """RMSNorms scale by (norm_offset + w): 1.0 for Gemma, else 0.0."""
        return self.spec.norm_offset

    @property
    def sandwich_norms(self) -> bool:
        """The attention's and the MLP's outputs are RMS-normalised too (Gemma 2 and 3)."""
        return self.spec.sandwich_norms

    @property
    def attn_scale(self) -> float:
        """What q.k is multiplied by: query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> RopeParams:
        """Layer ``layer``'s RoPE: Gemma 3's sliding layers have their own."""
        return self.local_rope if self.local_rope and self.window(layer) else self.rope

    @property
    def embed_scale(self) -> float:
        """Embeddings are multiplied by this: sqrt(hidden_size) for Gemma, else 1.0."""
        return float(self.hidden_size) ** 0.5 if self.spec.scale_embeddings else 1.0

    def summary(self) -> str:
        """One line for a log: its size in the terms of its config."""
        return (
            f"{self.num_hidden_layers} layers, hidden {self.hidden_size}, "
            f"{self.num_attention_heads} heads ({self.num_key_value_heads} KV), "
            f"head dim {self.head_dim}, vocab {self.vocab_size}"
        )

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window: a query at p sees keys > p - window (0: all)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def uniform_window(self) -> int:
        """The sliding window every layer has; 0 when some layer sees every key (Gemma 2/3's
        full layers) or the windows differ."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 and len(self.layer_windows) else 0

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def fused_shapes(self) -> dict[str, tuple[int, list[int]]]:
        """The engine's four fused matrices (q|k|v, o, gate|up, down): each one's input width
        and its parts' output widths."""
        d, f = self.hidden_size, self.intermediate_size
        return {
            "w_qkv": (d, [self.q_dim, self.kv_dim, self.kv_dim]),
            "w_o": (self.q_dim, [d]),
            "w_gate_up": (d, [f, f]),
            "w_down": (f, [d]),
        }

    @property
    def gqa_group(self) -> int:
        """Query heads that share one K/V head."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """K and V, every layer, for one token: 2 * layers * kv_heads * head_dim * bytes."""
        nbytes = DTYPE_BYTES[dtype or self.torch_dtype]
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * nbytes

    def kv_bytes_per_block(self, block_size: int = 16, dtype: str | None = None) -> int:
        return block_size * self.kv_bytes_per_token(dtype)

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        d = text_config(d)  # a Gemma 3 multimodal config: its language model's
        fam = family_of(d)
        check_keys(d, fam)
        missing = [k for k in REQUIRED_HF_FIELDS if k not in d]
        if missing:
            raise ValueError(f"config.json: missing required field {missing[0]!r}")
        n_heads, max_pos = d["num_attention_heads"], d.get("max_position_embeddings", 2048)
        rope, local = (
            kind_ropes(d, max_pos)
            if fam.kind_rope
            else (parse_rope({"rope_theta": fam.rope_theta, **d}, max_pos), None)
        )
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            family=fam.name,
            rope=rope,
            hidden_act=activation(d, fam),
            layer_windows=layer_windows(d, fam, d["num_hidden_layers"]),
            labels=classifier_labels(d),
            problem_type=d.get("problem_type") if is_classifier(d) else None,
            moe=moe_spec(d, fam.name, d["num_hidden_layers"]) if fam.moe else None,
            local_rope=local,
            **attention_params(d, fam),
            clip_qkv=clip_qkv(d),
            quantization=parse_quantization(d.get("quantization_config")),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))


def clip_qkv(d: dict) -> float | None:
    """OLMoE's clip_qkv: a positive bound, or None (no clamp)."""
    value = d.get("clip_qkv")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"config.json: clip_qkv must be a positive number or null, got {value!r}")
    return float(value)


PROBLEM_TYPES = (None, "single_label_classification", "multi_label_classification", "regression")


def classifier_labels(d: dict) -> tuple[str, ...]:
    """A *ForSequenceClassification config's labels in id order (id2label's names, LABEL_i
    where it names none; num_labels, else id2label's size, else transformers' 2); () for a
    causal LM."""
    if not is_classifier(d):
        return ()
    names = d.get("id2label") or {}
    n = d.get("num_labels") or len(names) or 2
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"config.json: num_labels must be a positive int, got {n!r}")
    if d.get("problem_type") not in PROBLEM_TYPES:
        raise ValueError(
            f"config.json: problem_type {d['problem_type']!r} is not one of "
            f"{', '.join(str(p) for p in PROBLEM_TYPES[1:])}"
        )
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(n))
