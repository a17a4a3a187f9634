"""MXFP4 (the OCP microscaling format gpt-oss stores its experts in): blocks of 32 values, each
a 4-bit e2m1 code (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times one shared power of
two, an 8-bit e8m0 exponent e (bias 127).

As a GGUF file stores it (ggml's type MXFP4, 39; llama.cpp's block_mxfp4), a block is 17 bytes:
e, then 16 bytes of codes, byte j holding value j in its low nibble and value j + 16 in its
high one (Q4_0's order). Its values are ``KVALUES[code] * 2^(e - 128)``: KVALUES the e2m1
values doubled, exact integers (code 8, e2m1's -0, is 0), and 2^(e - 128) ggml's
e8m0_to_fp32_half (subnormal for e 0 and 1). Every value is exact in float32, or infinite past
its range.

A Hugging Face gpt-oss checkpoint stores a matrix's ``*_blocks`` (rows, cols/32, 16) uint8 and
``*_scales`` (rows, cols/32) uint8 (its experts' axis first): byte j of a block holds value 2j
in its low nibble and 2j + 1 in its high one, and a value is e2m1(code) * 2^(e - 127)
(transformers' convert_moe_packed_tensors, which then transposes each expert to (cols, rows)).
``from_hf`` repacks such a matrix's nibbles into GGUF's blocks: the same values, none
requantized (e2m1's -0 becomes 0: equal, not the same bits).
"""

from __future__ import annotations

import numpy as np

F32 = np.dtype(np.float32)
QK, BLOCK_BYTES = 32, 17  # values and bytes of a block
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
# e2m1's sixteen values, -0 included, as a checkpoint's codes mean them
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)


def half_scale(e: np.ndarray) -> np.ndarray:
    """e8m0 bytes -> 2^(e - 128) float32 (ggml's e8m0_to_fp32_half), the same shape."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def codes(b: np.ndarray) -> np.ndarray:
    """(n, 17) GGUF blocks -> (n, 32) uint8 codes, in value order."""
    qs = b[:, 1:BLOCK_BYTES]
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=1)


def dequantize_blocks(b: np.ndarray) -> np.ndarray:
    """(n, 17) uint8 GGUF blocks -> (n, 32) float32 values."""
    with np.errstate(over="ignore"):  # a value past float32's range: inf, as ggml's
        return half_scale(b[:, :1]) * KVALUES[codes(b)].astype(F32)


def _check_hf(blocks: np.ndarray, scales: np.ndarray) -> None:
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"mxfp4: blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: blocks must be (..., cols/32, 16) with scales (..., cols/32), "
            f"got {blocks.shape} and {scales.shape}"
        )


def from_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's (..., rows, cols/32, 16) blocks and (..., rows, cols/32) scales ->
    (..., rows, cols/32 * 17) uint8 GGUF blocks of the same values: a (rows, cols) matrix's
    rows as a GGUF file stores them."""
    _check_hf(blocks, scales)
    lo, hi = blocks[..., :8], blocks[..., 8:]  # values 0..15 and 16..31, two a byte
    gguf = np.empty((*blocks.shape[:-1], BLOCK_BYTES), np.uint8)  # (..., G, 17)
    gguf[..., 0] = scales
    gguf[..., 1::2] = (lo & np.uint8(15)) | (hi << np.uint8(4))  # values 2k, 2k + 16
    gguf[..., 2::2] = (lo >> np.uint8(4)) | (hi & np.uint8(0xF0))  # 2k + 1, 2k + 17
    return gguf.reshape(*blocks.shape[:-2], -1)


def hf_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's blocks and scales -> (..., rows, cols) float32, as transformers
    dequantizes them (before its transpose): e2m1(code) * 2^(e - 127), -0 kept."""
    _check_hf(blocks, scales)
    pairs = np.stack([blocks & np.uint8(15), blocks >> np.uint8(4)], axis=-1)  # (..., G, 16, 2)
    v = E2M1[pairs.reshape(*blocks.shape[:-1], QK)]  # (..., G, 32)
    with np.errstate(over="ignore"):  # a value past float32's range: inf, as torch's
        v = np.ldexp(v, scales.astype(np.int32)[..., None] - 127).astype(F32)
    return v.reshape(*blocks.shape[:-2], -1)
