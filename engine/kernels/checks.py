"""The argument checks every kernel launch makes (engine/kernels/launch.py, moe_launch.py):
each a ValueError of one line naming the operation, the argument and what was wrong."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

DTYPE_SUFFIX = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(ml_dtypes.bfloat16): "bf16",
}


def check(op: str, name: str, a, shape: tuple, dtype=None) -> None:
    """``a`` must be a C-contiguous array of ``shape`` (None: any size) and ``dtype``."""
    want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    if not hasattr(a, "shape") or len(a.shape) != len(shape):
        raise ValueError(f"{op}: {name} must be an array of shape {want}, got {_desc(a)}")
    if any(s is not None and s != n for s, n in zip(shape, a.shape, strict=True)):
        raise ValueError(f"{op}: {name} must have shape {want}, got {tuple(a.shape)}")
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise ValueError(f"{op}: {name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{op}: {name} must be C-contiguous, got strides {a.strides}")


def finite(op: str, name: str, value) -> float:
    """A float argument: a finite real number."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{op}: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be finite, got {value!r}")
    return float(value)


def suffix(op: str, a) -> str:
    """The entry point's suffix for a's dtype (f32, f16, bf16)."""
    dtype = np.dtype(a.dtype)
    if dtype not in DTYPE_SUFFIX:
        names = ", ".join(d.name for d in DTYPE_SUFFIX)
        raise ValueError(f"{op}: dtype must be one of {names}, got {dtype.name}")
    return DTYPE_SUFFIX[dtype]


def _desc(a) -> str:
    return f"shape {tuple(a.shape)}" if hasattr(a, "shape") else type(a).__name__
