"""Rotary position embeddings: the parameters a config gives, and the frequencies they make.

Hugging Face configs carry RoPE in two layouts: transformers 4 writes ``rope_theta`` and
``rope_scaling`` at the top level, transformers 5 writes one ``rope_parameters`` dict (with
``rope_theta`` inside it). ``parse_rope`` reads either into one frozen ``RopeParams``; a
``rope_type`` this code does not compute exactly, or a key it does not read, is refused by name.

The scaling types change only the inverse frequencies (``inv_freq``), computed once, and YaRN's
``attention_factor`` multiplies cos and sin; nothing depends on the sequence length, so one
rotary table serves every request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# rope_type -> the keys of its dict that this code reads (besides rope_type / type, rope_theta).
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
}
# Types whose frequencies depend on the sequence's length: not one table, so refused.
LENGTH_DEPENDENT = ("dynamic", "longrope", "su")


@dataclass(frozen=True)
class RopeParams:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn: the pre-training context
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: correction range rounded to whole dims
    attention_factor: float = 1.0  # cos and sin are multiplied by it (yarn)
    freq_factors: tuple[float, ...] = ()  # per frequency divisors (GGUF's rope_freqs.weight)


def _as_rope(rope) -> RopeParams:
    """A RopeParams, or a bare theta (float) meaning default RoPE with that base."""
    return rope if isinstance(rope, RopeParams) else RopeParams(theta=float(rope))


def parse_rope(d: dict, max_position_embeddings: int, where: str = "config.json") -> RopeParams:
    """RopeParams from a config dict in either layout (``rope_parameters`` wins when present)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: rope parameters must be a dict, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in LENGTH_DEPENDENT:
        raise ValueError(
            f"{where}: rope_type {rope_type!r} is not supported (its frequencies depend on the "
            f"sequence length); supported: {', '.join(ROPE_KEYS)}"
        )
    if rope_type not in ROPE_KEYS:
        raise ValueError(
            f"{where}: unknown rope_type {rope_type!r}; supported: {', '.join(ROPE_KEYS)}"
        )
    allowed = ROPE_KEYS[rope_type] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    extra = sorted(set(params) - allowed)
    if extra:
        raise ValueError(f"{where}: rope key {extra[0]!r} is not read for rope_type {rope_type!r}")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {partial} is not supported (only 1.0)")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    return _typed(rope_type, float(theta), params, d, max_position_embeddings)


def _typed(rope_type, theta, p: dict, d: dict, max_pos: int) -> RopeParams:
    if rope_type == "default":
        return RopeParams(theta=theta)
    factor = p.get("factor")
    original = int(
        p.get("original_max_position_embeddings")
        or d.get("original_max_position_embeddings")
        or max_pos
    )
    if rope_type == "yarn" and factor is None:
        factor = max_pos / original
    if factor is None or float(factor) <= 0:
        raise ValueError(f"config.json: rope_type {rope_type!r} needs a positive factor")
    common = dict(theta=theta, rope_type=rope_type, factor=float(factor))
    if rope_type == "linear":
        return RopeParams(**common)
    if rope_type == "llama3":
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        return RopeParams(
            **common,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )
    return RopeParams(  # yarn
        **common,
        original_max_position_embeddings=original,
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        truncate=bool(p.get("truncate", True)),
        attention_factor=_yarn_attention_factor(p, float(factor)),
    )


def _yarn_attention_factor(p: dict, factor: float) -> float:
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("mscale") and p.get("mscale_all_dim"):
        return mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
    return mscale(factor)


def inv_freq(rope, head_dim: int) -> np.ndarray:
    """(hd/2,) float64 inverse frequencies f_j; default RoPE: theta^(-2j/hd)."""
    r = _as_rope(rope)
    base = 1.0 / (r.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if r.freq_factors:  # llama.cpp's Llama 3 scaling: the factors computed at conversion
        base = base / np.asarray(r.freq_factors, np.float64)
    if r.rope_type == "linear":
        return base / r.factor
    if r.rope_type == "llama3":
        return _llama3(base, r)
    if r.rope_type == "yarn":
        return _yarn(base, r, head_dim)
    return base


def _llama3(f: np.ndarray, r: RopeParams) -> np.ndarray:
    """Long wavelengths divided by factor, short ones kept, a smooth blend between."""
    old = r.original_max_position_embeddings
    wavelen = 2 * math.pi / f
    scaled = np.where(wavelen > old / r.low_freq_factor, f / r.factor, f)
    smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < old / r.high_freq_factor) & ~(wavelen > old / r.low_freq_factor)
    return np.where(medium, blended, scaled)


def _yarn(f: np.ndarray, r: RopeParams, dim: int) -> np.ndarray:
    """Interpolated (f / factor) below the correction range, extrapolated (f) above it."""

    def correction_dim(rotations):
        num = dim * math.log(r.original_max_position_embeddings / (rotations * 2 * math.pi))
        return num / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return (f / r.factor) * (1 - extrapolate) + f * extrapolate


def rope_cos_sin(positions: np.ndarray, head_dim: int, rope, dtype) -> tuple:
    """cos and sin tables, (T, hd), in Hugging Face's rotate-half layout (frequencies repeated),
    times the attention factor. ``rope``: a RopeParams or a bare theta."""
    r = _as_rope(rope)
    angles = positions.astype(np.float64)[:, None] * inv_freq(r, head_dim)[None, :]  # (T, hd/2)
    angles = np.concatenate([angles, angles], axis=-1)  # (T, hd)
    scale = r.attention_factor
    return (np.cos(angles) * scale).astype(dtype), (np.sin(angles) * scale).astype(dtype)


@lru_cache(maxsize=8)
def rope_table(max_positions: int, head_dim: int, rope) -> np.ndarray:
    """(max_positions, hd) float32: cos(p * f_j) for j < hd/2, then sin(p * f_j), both times
    the attention factor (YaRN's; 1 otherwise): the table the kernels read (the engine's
    backends and the CUDA emulation). The angles are ``rope_cos_sin``'s (float64, any scaling
    in f_j); the kernels need one of its two halves.
    ``rope``: a RopeParams or a bare theta."""
    half = head_dim // 2
    cos, sin = rope_cos_sin(np.arange(max_positions), head_dim, rope, np.float32)  # (P, hd)
    table = np.concatenate([cos[:, :half], sin[:, :half]], axis=-1)  # (P, hd)
    table.setflags(write=False)
    return table
