"""Which GGUF type each tensor gets in llama.cpp's quantization mixes (``llama-quantize``'s
choice without an importance matrix, for a dense model that is not Falcon's):

  q4_k_m / q5_k_m: Q4_K / Q5_K; ``attn_v`` (and a fused ``attn_qkv``) and ``ffn_down`` in Q6_K
      on the layers ``more_bits`` names (the first and last eighth, every third between);
  q6_k, q5_0: that type throughout;
and in every mix the LM head (``output.weight``; the token embedding instead when the model
has no LM head of its own) in Q6_K, or Q8_0 when its rows are not whole blocks of the base
type; the token embedding of an untied model in the base type. A row length that is not a
multiple of the chosen type's block falls back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then
F16 when even 32 does not divide it. Only matrices whose names end in ``weight`` are
quantized, norms never; every other tensor keeps its type (None here).
"""

from __future__ import annotations

import re

BASE = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K", "q5_0": "Q5_0"}
MIXED = ("q4_k_m", "q5_k_m")  # the mixes that give attn_v and ffn_down more bits
BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "F16": 1}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# llama.cpp's ftype numbers (general.file_type) of the mixes
FILE_TYPE = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "q5_0": 8}
EMBED, HEAD = "token_embd.weight", "output.weight"


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: layer i of n gets Q6_K for attn_v/ffn_down in *_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize quantizes the tensor: a matrix named ``*weight``, not a norm."""
    return len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def file_order(names) -> list[str]:
    """llama.cpp's order of a file's tensors: by layer (the global ones first), then by name."""
    return sorted(names, key=lambda n: (_layer(n), n))


def _fallback(type_name: str, row: int) -> str:
    if row % BLOCK[type_name] == 0:
        return type_name
    type_name = FALLBACK.get(type_name, type_name)
    return type_name if row % BLOCK[type_name] == 0 else "F16"


def tensor_types(shapes: dict[str, tuple[int, ...]], mix: str, n_layers: int) -> dict:
    """{GGUF tensor name: NumPy shape (rows, row length)} -> {name: the GGUF type name it gets,
    or None where it keeps its own}, for ``mix`` (a key of BASE) and a model of ``n_layers``."""
    if mix not in BASE:
        raise ValueError(f"unknown quantization mix {mix!r} (have {', '.join(BASE)})")
    base, tied = BASE[mix], HEAD not in shapes
    n_v = sum(1 for n in shapes if _attn_v(n))
    i_v = i_down = 0
    out: dict[str, str | None] = {}
    for name in file_order(shapes):
        shape = shapes[name]
        if not quantized(name, shape):
            out[name] = None
            continue
        t, row = base, shape[-1]
        if name == HEAD or (tied and name == EMBED):
            t = "Q8_0" if row % BLOCK[base] else "Q6_K"
        elif _attn_v(name):
            t = "Q6_K" if mix in MIXED and more_bits(i_v, n_v) else base
            i_v += 1
        elif "ffn_down" in name:
            t = "Q6_K" if mix in MIXED and more_bits(i_down, n_layers) else base
            i_down += 1
        out[name] = _fallback(t, row)
    return out


def _attn_v(name: str) -> bool:
    return any(k in name for k in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"))
