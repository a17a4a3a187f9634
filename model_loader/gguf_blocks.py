"""GGUF matrices kept in their blocks, as the file stores them: ``BlockMatrix`` (N, K), its
transpose ``TransposedBlocks`` (K, N) as a weight's products take it, ``BlockStack``, the
rows of several stacked (Q, K and V; gate and up) without widening any, and ``ExpertBlocks``,
a mixture's (E, N, K) experts, each a BlockMatrix.

Kept so: an embedding table or LM head in Q8_0, Q4_0 or Q4_1 (BLOCK_KINDS: the cpu backend
splits their blocks into q and scales), and every matrix in a k-quant, 5-bit, MXFP4 or IQ4
type (model_loader.kquants.LAYOUTS: the cpu backend multiplies the file's bytes), a mixture's
experts in those types likewise; in a file that has such matrices, its Q8_0/Q4_0/Q4_1 layer
matrices and experts too (a Q4_K_M file's fallbacks). Each widens
to float32 by rows, or whole through ``np.asarray``, for whoever wants values. A 4-bit Hugging
Face checkpoint's groups come as a subclass of the same (model_loader.int4_checkpoint); a
gpt-oss checkpoint's MXFP4 blocks and scales as a BlockMatrix (``mxfp4_matrix``) or
ExpertBlocks (``mxfp4_experts``) of GGUF's MXFP4 blocks, their nibbles repacked.
"""

from __future__ import annotations

import gguf
import numpy as np

from model_loader import kquants, mxfp4

# GGUF's block formats that a backend may keep as stored (engine/backends/quant.py's kinds),
# and a block's layout: (bytes of float16 scales, bytes of q).
BLOCK_KINDS = {
    gguf.GGMLQuantizationType.Q8_0: ("q8_0", 2, 32),
    gguf.GGMLQuantizationType.Q4_0: ("q4_0", 2, 16),
    gguf.GGMLQuantizationType.Q4_1: ("q4_1", 4, 16),
}
# the types kept in blocks wherever they are (their kind: the type's name in lower case); MXFP4
# where this gguf-py knows it (0.17 and later)
_TYPES = gguf.GGMLQuantizationType.__members__
KQUANT_TYPES = {_TYPES[name] for name in kquants.LAYOUTS if name in _TYPES}


class BlockMatrix:
    """A (N, K) GGUF matrix kept as the file stores it, ``raw``: (N, bytes of a row) uint8, a
    read-only view of the mapped file (or its rows, reordered). Indexed by rows it gives those
    rows' float32 values (an embedding table's gather: the values a dequantized copy holds, bit
    for bit); ``m[rows, cols]`` the same, then the columns; ``np.asarray`` all of them; ``.T``
    is the (K, N) matrix, still in blocks (``TransposedBlocks``)."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, name: str, qtype, raw: np.ndarray, shape, as_stored: bool = True):
        self.name, self.qtype, self.raw, self.shape = name, qtype, raw, shape  # shape (N, K)
        self.as_stored = as_stored  # False: kept to be read by row, multiplied as float32
        self.kind = BLOCK_KINDS[qtype][0] if qtype in BLOCK_KINDS else qtype.name.lower()
        if raw.ndim != 2 or len(raw) != shape[0]:
            raise ValueError(f"gguf: tensor {name!r} is not a matrix of {shape[0]} rows")

    @classmethod
    def of(cls, t: gguf.ReaderTensor, as_stored: bool = True) -> BlockMatrix:
        shape = tuple(int(n) for n in reversed(t.shape))
        return cls(t.name, t.tensor_type, t.data, shape, as_stored)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @property
    def T(self) -> TransposedBlocks:
        return TransposedBlocks(self)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        """Rows (an index, a slice, an array of ids) as float32: (..., K); (rows, cols): those
        rows' values, then the columns."""
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        raw = self.raw[rows]
        if self.qtype in KQUANT_TYPES:
            values = kquants.dequantize(raw, self.qtype.name)
        else:
            values = gguf.quants.dequantize(raw, self.qtype)
        whole = isinstance(cols, slice) and cols == slice(None)
        return values if whole else values[..., cols]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self[:]  # (N, K) float32, a new array
        return a if dtype is None else a.astype(dtype, copy=False)

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return np.asarray(self, dtype)

    def take_rows(self, rows) -> BlockMatrix:
        """Rows (a slice or an array of indices) of the stored matrix, still in blocks."""
        raw = np.ascontiguousarray(self.raw[rows])  # (n, bytes of a row): copied bytes
        return type(self)(self.name, self.qtype, raw, (len(raw), self.shape[1]), self.as_stored)

    def blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """BLOCK_KINDS only: (q (N, K/32 * bytes of a block's q): Q8_0's int8, Q4's uint8
        nibbles; scales (N, K/32 * scales a block) float16): the file's bytes, split as
        engine/backends/quant.py keeps a block format."""
        n, (_, s, q) = self.shape[0], BLOCK_KINDS[self.qtype]
        b = self.raw.reshape(n, -1, s + q)  # (N, K/32, a block's bytes)
        data = np.ascontiguousarray(b[:, :, s:]).reshape(n, -1)
        data = data.view(np.int8) if self.kind == "q8_0" else data
        scales = np.ascontiguousarray(b[:, :, :s]).view(np.float16).reshape(n, -1)
        return data, scales


class BlockStack:
    """(sum of N, K): several matrices' rows one after another (Q | K | V, gate | up), each
    kept in its blocks; neighbours of one type joined into one BlockMatrix (their bytes
    copied). ``parts``: the BlockMatrix (or float32 array, for a part stored wider) of each run
    of rows, in order."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, mats):
        self.parts: list = []
        for m in mats:
            last = self.parts[-1] if self.parts else None
            if (
                isinstance(m, BlockMatrix)
                and isinstance(last, BlockMatrix)
                and m.qtype == last.qtype
            ):
                raw = np.concatenate([last.raw, m.raw])  # (n1 + n2, bytes of a row)
                shape, kept = (len(raw), m.shape[1]), m.as_stored and last.as_stored
                self.parts[-1] = type(last)(last.name, m.qtype, raw, shape, kept)
            else:
                self.parts.append(m)
        self.shape = (sum(len(p) for p in self.parts), self.parts[0].shape[1])

    @property
    def T(self) -> TransposedBlocks:
        return TransposedBlocks(self)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = np.concatenate([np.asarray(p, np.float32) for p in self.parts])  # (N, K)
        return a if dtype is None else a.astype(dtype, copy=False)

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self)[index]

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return np.asarray(self, dtype)


class ExpertBlocks:
    """A (E, N, K) stack of experts' matrices (llama.cpp's ``ffn_*_exps``) kept as the file
    stores it: ``m[e]`` is expert e's (N, K) BlockMatrix, a view of the mapped file's rows;
    ``np.asarray`` widens all of them."""

    dtype = np.dtype(np.float32)
    ndim = 3

    def __init__(self, name: str, qtype, raw: np.ndarray, shape, as_stored: bool = True):
        self.name, self.qtype, self.shape, self.as_stored = name, qtype, shape, as_stored
        self.raw = raw.reshape(shape[0] * shape[1], -1)  # (E*N, bytes of a row)

    @classmethod
    def of(cls, t: gguf.ReaderTensor, as_stored: bool = True) -> ExpertBlocks:
        shape = tuple(int(n) for n in reversed(t.shape))
        return cls(t.name, t.tensor_type, t.data, shape, as_stored)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e) -> BlockMatrix:
        if not isinstance(e, int | np.integer):
            return np.asarray(self)[e]
        n = self.shape[1]
        raw = self.raw[int(e) * n : (int(e) + 1) * n]  # (N, bytes of a row): a view
        return BlockMatrix(f"{self.name}[{e}]", self.qtype, raw, self.shape[1:], self.as_stored)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = np.stack([np.asarray(self[e]) for e in range(len(self))])  # (E, N, K) float32
        return a if dtype is None else a.astype(dtype, copy=False)

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return np.asarray(self, dtype)


def mxfp4_matrix(name: str, blocks: np.ndarray, scales: np.ndarray) -> BlockMatrix:
    """A checkpoint's (rows, cols/32, 16) MXFP4 blocks and (rows, cols/32) scales -> the
    (rows, cols) matrix kept in GGUF's MXFP4 blocks: the same values (model_loader.mxfp4)."""
    if blocks.ndim != 3:
        raise ValueError(f"mxfp4: {name!r} blocks must be (rows, cols/32, 16), got {blocks.shape}")
    raw = mxfp4.from_hf(blocks, scales)  # (rows, cols/32 * 17)
    return BlockMatrix(name, _TYPES["MXFP4"], raw, (len(raw), blocks.shape[1] * mxfp4.QK))


def mxfp4_experts(name: str, blocks: np.ndarray, scales: np.ndarray) -> ExpertBlocks:
    """A checkpoint's (E, rows, cols/32, 16) blocks and (E, rows, cols/32) scales -> the
    (E, rows, cols) experts kept in GGUF's MXFP4 blocks (``m[e]`` a BlockMatrix)."""
    if blocks.ndim != 4:
        raise ValueError(
            f"mxfp4: {name!r} blocks must be (experts, rows, cols/32, 16), got {blocks.shape}"
        )
    e, rows, groups, _ = blocks.shape
    raw = mxfp4.from_hf(blocks, scales)  # (E, rows, cols/32 * 17)
    return ExpertBlocks(name, _TYPES["MXFP4"], raw, (e, rows, groups * mxfp4.QK))


def stack_rows(mats):
    """Matrices (N_i, K) -> their rows stacked: a BlockStack where any is in blocks, else one
    NumPy array."""
    if len(mats) == 1:
        return mats[0]
    if any(isinstance(m, BlockMatrix) for m in mats):
        return BlockStack(mats)
    return np.concatenate(mats, axis=0)


class TransposedBlocks:
    """The (K, N) transpose of a BlockMatrix or BlockStack, as a weight matrix's products take
    it: ``m[:, a:b]`` widens the columns a..b (rows a..b of the stored matrix), ``np.asarray``
    all of them; ``stored`` is the stored matrix, for a backend that keeps its blocks."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, stored):
        self.stored = stored
        self.shape = stored.shape[::-1]

    @property
    def T(self):
        return self.stored

    def __getitem__(self, index) -> np.ndarray:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        return self.stored[cols].T[rows]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.stored, dtype).T

    def __rmatmul__(self, x) -> np.ndarray:
        return np.asarray(x) @ np.asarray(self)
