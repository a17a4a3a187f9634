"""GGUF's non-linear 4-bit types IQ4_NL and IQ4_XS (ggml's types 20 and 23): each value a
4-bit index into KVALUES, sixteen int8 levels spaced for a bell-shaped distribution, times a
block's scale.

As a GGUF file stores them (llama.cpp's block_iq4_nl, block_iq4_xs):
  IQ4_NL (32 values, 18 bytes): d (float16), then 16 bytes of indices, byte j holding value j
      in its low nibble and value j + 16 in its high one (Q4_0's order): w = d KVALUES[q].
  IQ4_XS (256 values, 136 bytes): d (float16), scales_h (uint16 little-endian), scales_l (4
      bytes), then 8 runs of 16 bytes of indices, run j the 32 values 32 j.. in IQ4_NL's
      order. Run j's 6-bit scale ls_j is nibble j % 2 of scales_l[j // 2] (low first) with
      bits 2j, 2j + 1 of scales_h above it: w = d (ls_j - 32) KVALUES[q].
llama-quantize writes IQ4_NL for the rows of an IQ4_XS file that are not whole super-blocks.
"""

from __future__ import annotations

import numpy as np

F32 = np.dtype(np.float32)
KVALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)
# type name -> (values per block, bytes per block)
LAYOUTS = {"IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}


def _d(b: np.ndarray) -> np.ndarray:
    """Bytes 0..2 of each block as float16 -> (n, 1) float32."""
    return np.ascontiguousarray(b[:, 0:2]).view(np.float16).astype(F32)


def indices(qs: np.ndarray) -> np.ndarray:
    """(n, 16) index bytes -> (n, 32) uint8 indices in value order."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=1)


def xs_scales(b: np.ndarray) -> np.ndarray:
    """(n, 136) IQ4_XS blocks -> (n, 8) int32 ls_j - 32."""
    h = np.ascontiguousarray(b[:, 2:4]).view("<u2").astype(np.int32)  # (n, 1)
    lo = b[:, 4:8].astype(np.int32)  # (n, 4)
    low = np.stack([lo & 15, lo >> 4], axis=2).reshape(len(b), 8)  # nibble j % 2 of byte j // 2
    high = (h >> (2 * np.arange(8))) & 3  # (n, 8)
    return (low | (high << 4)) - 32


def dequantize_iq4_nl(b: np.ndarray) -> np.ndarray:
    """(n, 18) uint8 blocks -> (n, 32) float32."""
    return _d(b) * KVALUES[indices(b[:, 2:18])].astype(F32)


def dequantize_iq4_xs(b: np.ndarray) -> np.ndarray:
    """(n, 136) uint8 blocks -> (n, 256) float32: (d (ls - 32)) KVALUES[q], per 32 values."""
    n = len(b)
    q = indices(b[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)
    ds = (_d(b) * xs_scales(b).astype(F32))[:, :, None]  # (n, 8, 1)
    return (ds * KVALUES[q].astype(F32)).reshape(n, 256)
