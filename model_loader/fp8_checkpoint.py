"""An FP8 checkpoint's matrices kept in 8 bits: ``Fp8Matrix`` (N, K), the float8_e4m3fn bytes
and one float32 scale per row and run of K / nbk inputs (a per-tensor scale repeated on every
row, a per-channel one on its row, a ``weight_block_size`` block's on each of its rows). A
weight's value is float32(q) * s computed in float32 (q exact, one rounding of the product):
what rows, ``np.asarray`` (the numpy and cuda backends) and the cpu backend's kernel
(cpu_src/matmul_fp8.cpp, kind "fp8") all use.

``raw`` is (N, K + 4 nbk) bytes, a row's K e4m3 bytes then its nbk float32 scales, so the
rows of several matrices (Q | K | V) stack, and cut, as a GGUF's blocks do
(model_loader.gguf_blocks). A matrix whose width a scale block does not divide is widened to
float32 at load instead.
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np

from model_loader.gguf_blocks import BlockMatrix

log = logging.getLogger("model_loader")
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALES = ("weight_scale", "weight_scale_inv")


class Fp8Type:
    """The qtype of an Fp8Matrix with ``nbk`` scales a row (equal when nbk is)."""

    def __init__(self, nbk: int):
        self.nbk, self.name = nbk, "F8_E4M3"

    def __eq__(self, other) -> bool:
        return isinstance(other, Fp8Type) and other.nbk == self.nbk

    def __hash__(self) -> int:
        return hash(("F8_E4M3", self.nbk))


class Fp8Matrix(BlockMatrix):
    """(N, K) e4m3 weights and their scales, in ``raw`` (N, K + 4 nbk) uint8."""

    def __init__(self, name: str, qtype: Fp8Type, raw: np.ndarray, shape, as_stored=True):
        super().__init__(name, qtype, raw, shape, as_stored)
        self.kind = "fp8"

    def __getitem__(self, index) -> np.ndarray:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        q, s = self._split(np.asarray(self.raw[rows]))
        k, nbk = self.shape[1], self.qtype.nbk
        lead = q.shape[:-1]
        v = q.view(E4M3).astype(np.float32).reshape(*lead, nbk, k // nbk)  # exact
        values = (v * s[..., None]).reshape(*lead, k)  # (..., K) float32
        whole = isinstance(cols, slice) and cols == slice(None)
        return values if whole else values[..., cols]

    def _split(self, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = self.shape[1]
        q = np.ascontiguousarray(raw[..., :k])  # (..., K) uint8
        return q, np.ascontiguousarray(raw[..., k:]).view(np.float32)  # (..., nbk)

    def blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """(q (N, K) uint8 e4m3 bytes, scales (N, nbk) float32): quant.QuantWeight's "fp8"."""
        return self._split(self.raw)


def _row_scales(name: str, s: np.ndarray, n: int, k: int, block) -> np.ndarray | None:
    """The checkpoint's scale tensor -> (N, nbk) float32 per row; None where a block's width
    does not divide K (the matrix is widened instead)."""
    if block is not None:
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if s.shape != want:
            raise ValueError(f"checkpoint: {name} is {s.shape}, blocks of {block} imply {want}")
        return None if k % bk else np.repeat(s, bn, axis=0)[:n]  # (N, K/bk)
    if s.size == 1:
        return np.full((n, 1), s.reshape(()), np.float32)
    if s.size == n:
        return s.reshape(n, 1)
    raise ValueError(f"checkpoint: {name} is {s.shape}: not one scale or one per row of {n}")


def fp8_matrix(prefix: str, t, block: tuple[int, int] | None):
    """P.weight (N, K) float8_e4m3fn and its scale -> an Fp8Matrix (or, where a scale block
    does not divide K, its (N, K) float32 values)."""
    q = np.asarray(t[prefix + ".weight"])
    n, k = q.shape
    name = next(prefix + "." + s for s in SCALES if prefix + "." + s in t)
    s = np.asarray(t[name]).astype(np.float32)
    rows = _row_scales(name, s, n, k, block)
    if rows is None:
        bn, bk = block
        full = np.repeat(np.repeat(s, bn, axis=0), bk, axis=1)[:n, :k]  # (N, K)
        return q.astype(np.float32) * full
    raw = np.concatenate([q.view(np.uint8), np.ascontiguousarray(rows).view(np.uint8)], axis=1)
    return Fp8Matrix(prefix + ".weight", Fp8Type(rows.shape[1]), raw, (n, k))


def log_fp8(tensors, names: list[str]) -> None:
    """The one startup line: which FP8 weights are kept in 8 bits, and their bytes."""
    counts: dict[str, int] = {}
    for n in names:
        key = ".".join("*" if p.isdigit() else p for p in n.split("."))
        counts[key] = counts.get(key, 0) + 1
    listed = ", ".join(k if c == 1 else f"{k} x {c}" for k, c in counts.items())
    stored = sum(int(tensors[n].nbytes) for n in names)
    log.info(
        "fp8 checkpoint: F8_E4M3 weights kept in 8 bits with float32 scales (%s): %.1f MiB; "
        "the numpy and cuda backends widen them to float32, %.1f MiB", listed,
        stored / 2**20, 4 * stored / 2**20,
    )  # fmt: skip
