"""GGUF matrices the GPU backend keeps as the file stores them: a layer matrix or LM head that
the loader keeps in its blocks (model_loader/gguf_blocks.py: a file with k-quants) goes to the
device as the file's bytes when every part of it is in a format the kernels read
(engine/kernels/gguf_launch.py GGUF_KINDS: Q8_0, Q4_0, Q5_0, Q4_K, Q6_K); any other matrix
(Q4_1, Q5_1, Q5_K, a part stored wider) is widened to the backend's dtype as before.

``BlockGemm`` is the backend's ``gemm(x, w, out)``: a plain weight through cuBLAS, a
``DeviceBlocks`` one by its parts, each writing its own columns of out: up to
GGUF_MATVEC_MAX_BATCH rows of x by ``gguf_matvec`` (each weight byte read once), more rows by
``gguf_dequantize`` into a tile of at most TILE_BYTES (rows of the part at a time) and cuBLAS
into those columns.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.gguf_launch import GGUF_KINDS, GGUF_MATVEC_MAX_BATCH
from engine.utils import MiB
from model_loader.gguf_blocks import BlockMatrix, stack_rows

TILE_BYTES = 32 * MiB  # the widened tile of a larger batch's product, at most


class DeviceBlocks:
    """A (N, K) matrix, (out, in), on the device in GGUF blocks: ``parts`` [(kind, raw
    (n_i, bytes of a row) uint8 device array)], their rows one after another (Q | K | V)."""

    def __init__(self, parts: list[tuple[str, object]], K: int):
        self.parts = parts
        self.shape = (sum(int(raw.shape[0]) for _, raw in parts), K)

    @property
    def nbytes(self) -> int:
        return sum(int(raw.nbytes) for _, raw in self.parts)

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, raw in self.parts:
            out[kind] = out.get(kind, 0) + int(raw.nbytes)
        return out

    def tile_bytes(self, itemsize: int) -> int:
        """The largest tile a larger batch's product widens this matrix into."""
        K = self.shape[1]
        rows = max(int(raw.shape[0]) for _, raw in self.parts)
        return min(rows, tile_rows(K, itemsize)) * K * itemsize


def tile_rows(K: int, itemsize: int) -> int:
    """Rows of a part widened at a time: as many as TILE_BYTES hold, at least one."""
    return max(1, TILE_BYTES // (K * itemsize))


def keep_blocks(mats, upload) -> DeviceBlocks | None:
    """(out, in) matrices stacked along rows (Q, K, V), on the device in their blocks through
    ``upload`` (neighbours of one format joined, as ``stack_rows`` joins them); None, before
    any copy, unless every one is a BlockMatrix kept to be multiplied in a format the kernels
    read."""
    for m in mats:
        if not (isinstance(m, BlockMatrix) and m.as_stored and m.kind in GGUF_KINDS):
            return None
    parts = getattr(stack_rows(list(mats)), "parts", list(mats[:1]))
    kept = [(p.kind, upload(np.ascontiguousarray(p.raw))) for p in parts]
    return DeviceBlocks(kept, int(parts[0].shape[1]))


def bytes_by_format(arrays) -> dict[str, int]:
    """Device weights (arrays, DeviceBlocks) -> bytes held per format ("bfloat16", "q4_k")."""
    out: dict[str, int] = {}
    for a in arrays:
        # DeviceBlocks, and a layer of experts (cupy_moe.DeviceExperts), count their parts
        kinds = a.bytes_by_kind() if hasattr(a, "bytes_by_kind") else {a.dtype.name: a.nbytes}
        for kind, n in kinds.items():
            out[kind] = out.get(kind, 0) + int(n)
    return out


class BlockGemm:
    """``gemm(x, w, out)``: out = x @ w.T for a plain weight (cuBLAS, ``engine.kernels.gemm``)
    or one kept in blocks (the GGUF kernels). ``kernels``: the device's ``Kernels``;
    ``empty``: its allocator (a graph capture's blocks while capturing)."""

    def __init__(self, gemm, kernels, empty):
        self.gemm, self.k, self.empty = gemm, kernels, empty

    def __call__(self, x, w, out) -> None:
        if not isinstance(w, DeviceBlocks):
            return self.gemm(x, w, out)
        M, K = x.shape
        if w.shape[1] != K or tuple(out.shape) != (M, w.shape[0]):
            raise ValueError(
                f"gemm: want x (M, K), w (N, K), out (M, N); got {tuple(x.shape)}, {w.shape}, "
                f"{tuple(out.shape)}"
            )
        if M == 0:
            return None
        col = 0
        for kind, raw in w.parts:
            if M <= GGUF_MATVEC_MAX_BATCH:
                self.k.gguf_matvec(out, x, raw, kind, col)
            else:
                self._tiled(x, kind, raw, out, col)
            col += int(raw.shape[0])
        return None

    def _tiled(self, x, kind: str, raw, out, col: int) -> None:
        """out[:, col:col + n] = x @ the part's values^T, widened a tile of rows at a time."""
        n, K = int(raw.shape[0]), x.shape[1]
        rows = min(n, tile_rows(K, np.dtype(x.dtype).itemsize))
        tile = self.empty((rows, K), x.dtype)  # (rows, K)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            t = tile[: r1 - r0]
            self.k.gguf_dequantize(t, raw[r0:r1], kind)
            self.gemm.columns(x, t, out, col + r0)
