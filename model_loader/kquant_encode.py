"""float32 rows -> GGUF blocks (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, Q4_0), as llama.cpp's
reference quantizers make them when no importance matrix is given (what ``llama-quantize``
writes): the same searches, each step's float32 arithmetic in the C code's order, so the bytes
are the same. ``model_loader.kquants`` has the layouts and the way back.

  Q4_K / Q5_K: each 32-value group gets a scale and a min from a search over 21 (Q5_K: 16)
      candidate scales, (rmin + rdelta i + nmax) / (max - min), each fitted by weighted least
      squares with weights sqrt(mean x^2) + |x| (``_search_affine``); the eight scales and mins
      are rounded to 6 bits against the largest (d = max / 63), then every value is rounded
      again with the stored factors.
  Q6_K: each 16-value group gets a signed scale from a search over 19 candidates
      -(32 + 0.1 i) / max, weights x^2 (``_search_symmetric``); the 16 scales are rounded to
      int8 against the one of largest magnitude (d = max / -128), values rounded again.
  Q5_0 / Q4_0: d = (the value of largest magnitude) / -16 (-8), q = trunc(x / d + 16.5 (8.5));
  Q5_1: d = (max - min) / 31, m = min, q = trunc((x - m) / d + 0.5); Q8_0: d = absmax / 127,
      q = round(x / d) half away from zero. (x / d is x * (1 / d), as ggml computes it.)

Every sum is a running float32 sum in index order (``_run_sum``: NumPy's cumsum, sequential),
and rounding to the nearest integer is ties-to-even, as ggml's ``nearest_int``. Work is
vectorized over blocks; a loop runs only over a search's candidates.
"""

from __future__ import annotations

import numpy as np

from model_loader.kquants import LAYOUTS

F32 = np.float32
QK_K = 256
# every type this module writes: (values per block, bytes per block)
ENCODED = {**LAYOUTS, "Q8_0": (32, 34), "Q4_0": (32, 18)}
CHUNK_BLOCKS = 1 << 14  # blocks quantized at once (bounds the temporaries)


def _run_sum(a: np.ndarray) -> np.ndarray:
    """(..., n) float32 -> (...,): the sum a C loop ``s += a[i]`` makes, in float32."""
    return np.cumsum(a, axis=-1, dtype=F32)[..., -1]


def _nearest(v: np.ndarray) -> np.ndarray:
    """float32 -> int32 nearest integer, ties to even (ggml's nearest_int)."""
    return np.rint(v).astype(np.int32)


def _half(v: np.ndarray) -> np.ndarray:
    """float32 -> float16 (round to nearest even, as ggml's GGML_FP32_TO_FP16)."""
    return np.asarray(v, F32).astype(np.float16)


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S, n) -> (amax (S,), the first value of that magnitude (S,)), as ggml's scans."""
    i = np.argmax(np.abs(x), axis=1)
    v = np.take_along_axis(x, i[:, None], axis=1)[:, 0]
    return np.abs(v), v


def _search_affine(x, w, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml's make_qkx2_quants over groups: x, w (S, n) float32 -> (scale (S,), the_min (S,)
    = -min >= 0, L (S, n) int32 in [0, nmax]) with x ~ scale L - the_min."""
    lo = np.minimum(x.min(axis=1), F32(0))  # (S,) min, never above 0
    hi = x.max(axis=1)
    flat = hi == lo
    sum_w, sum_x = _run_sum(w), _run_sum(w * x)
    span = np.where(flat, F32(1), hi - lo)
    iscale = F32(nmax) / span
    scale = F32(1) / iscale
    big_l = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    diff = (scale[:, None] * big_l.astype(F32) + lo[:, None]) - x
    best = _run_sum(w * (diff * diff))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for step in range(nstep + 1):
            top = (F32(rmin) + F32(rdelta) * F32(step)) + F32(nmax)
            isc = top / np.where(flat, F32(1), hi - lo)  # lo moves with each better fit
            aux = np.clip(_nearest(isc[:, None] * (x - lo[:, None])), 0, nmax)
            fl = aux.astype(F32)
            wl = w * fl
            s_l, s_l2, s_xl = _run_sum(wl), _run_sum(wl * fl), _run_sum(wl * x)
            det = sum_w * s_l2 - s_l * s_l
            this_scale = (sum_w * s_xl - sum_x * s_l) / det
            this_min = (s_l2 * sum_x - s_l * s_xl) / det
            clamp = this_min > 0
            this_min = np.where(clamp, F32(0), this_min)
            this_scale = np.where(clamp, s_xl / s_l2, this_scale)
            diff = (this_scale[:, None] * fl + this_min[:, None]) - x
            cur = _run_sum(w * (diff * diff))
            better = (det > 0) & (cur < best) & ~flat
            big_l = np.where(better[:, None], aux, big_l)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
    big_l[flat] = 0
    return np.where(flat, F32(0), scale).astype(F32), -lo, big_l


def _search_symmetric(x: np.ndarray, nmax: int):
    """ggml's make_qx_quants (rmse_type 1, weights x^2) over groups: x (S, n) float32 ->
    (scale (S,), L (S, n) int32 in [0, 2 nmax), x ~ scale (L - nmax))."""
    amax, vmax = _first_absmax(x)
    zero = amax < F32(1e-15)
    vmax = np.where(zero, F32(1), vmax)
    w = x * x

    def fit(iscale):
        lv = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)
        fl = lv.astype(F32)
        return lv + nmax, _run_sum((w * x) * fl), _run_sum((w * fl) * fl)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        big_l, sumlx, suml2 = fit(F32(-nmax) / vmax)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        for step in [*range(-9, 0), *range(1, 10)]:
            aux, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / vmax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            big_l = np.where(better[:, None], aux, big_l)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    big_l[zero] = 0
    return np.where(zero, F32(0), scale).astype(F32), big_l


def _requantize(x, d, dm, keep, lmax: int):
    """Values again with the stored factors: x (B, G, n), d, dm (B, G) float32; groups whose
    d is 0 keep ``keep`` (B, G, n) (the search's L, as ggml leaves them)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(_nearest((x + dm[..., None]) / d[..., None]), 0, lmax)
    return np.where((d != 0)[..., None], q, keep)


def _k_factors(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K/Q5_K's first half: x (B, 256) -> (header (B, 16) uint8: d, dmin, 12 bytes of
    scales; L (B, 8, 32) int32)."""
    b = len(x)
    g = x.reshape(b * 8, 32)
    av = np.sqrt(_run_sum(g * g) / F32(32))  # (B*8,)
    sc, mn, first = _search_affine(g, av[:, None] + np.abs(g), nmax, rmin, 0.1, nstep)
    sc, mn = sc.reshape(b, 8), mn.reshape(b, 8)
    top_s = np.maximum(sc.max(axis=1), F32(0))
    top_m = np.maximum(mn.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_s = np.where(top_s > 0, F32(63) / top_s, F32(0)).astype(F32)
        inv_m = np.where(top_m > 0, F32(63) / top_m, F32(0)).astype(F32)
    ls = np.minimum(_nearest(inv_s[:, None] * sc) & 255, 63).astype(np.uint8)  # (B, 8)
    lm = np.minimum(_nearest(inv_m[:, None] * mn) & 255, 63).astype(np.uint8)
    d16, dmin16 = _half(top_s / F32(63)), _half(top_m / F32(63))
    packed = np.concatenate(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4),
        ],
        axis=1,
    )  # (B, 12)
    d = d16.astype(F32)[:, None] * ls.astype(F32)  # (B, 8)
    dm = dmin16.astype(F32)[:, None] * lm.astype(F32)
    q = _requantize(x.reshape(b, 8, 32), d, dm, first.reshape(b, 8, 32), nmax)
    halves = np.stack([d16, dmin16], axis=1).view(np.uint8)  # (B, 4)
    return np.concatenate([halves, packed], axis=1), q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """(B, 8, 32) -> (B, 128): byte 32 c + l = q[2c][l] & 15 | (q[2c + 1][l] & 15) << 4."""
    q = (q & 15).astype(np.uint8).reshape(len(q), 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """(B, 256) float32 -> (B, 144) uint8 Q4_K blocks."""
    head, q = _k_factors(x, 15, -1.0, 20)
    return np.concatenate([head, _low_nibbles(q)], axis=1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    """(B, 256) float32 -> (B, 176) uint8 Q5_K blocks (qh bit g of byte l: q[g][l] >= 16)."""
    head, q = _k_factors(x, 31, -0.5, 15)
    high = (q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(high, axis=1)  # (B, 32)
    return np.concatenate([head, qh, _low_nibbles(q)], axis=1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """(B, 256) float32 -> (B, 210) uint8 Q6_K blocks: ql, qh, int8 scales, d."""
    b = len(x)
    sc, first = _search_symmetric(x.reshape(b * 16, 16), 32)
    sc = sc.reshape(b, 16)
    amax, vmax = _first_absmax(sc)
    empty = amax < F32(1e-15)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-128) / np.where(empty, F32(1), vmax)
        d16 = _half(np.where(empty, F32(0), F32(1) / iscale))
        ls = np.minimum(_nearest(iscale[:, None] * sc), 127)
    ls = np.where(empty[:, None], 0, ls).astype(np.int8)  # (B, 16)
    d = d16.astype(F32)[:, None] * ls.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(_nearest(x.reshape(b, 16, 16) / d[..., None]), -32, 31) + 32
    q = np.where((d != 0)[..., None], q, first.reshape(b, 16, 16))
    q = np.where(empty[:, None, None], 0, q).astype(np.uint8).reshape(b, 2, 4, 32)
    ql = (q[:, :, :2] & 15) | ((q[:, :, 2:] & 15) << 4)  # (B, 2, 2, 32): ql[64h + 32j + l]
    qh = q[:, :, 0] >> 4  # (B, 2, 32)
    for j in range(1, 4):
        qh = qh | ((q[:, :, j] >> 4) << (2 * j))
    tail = [ls.view(np.uint8), d16[:, None].view(np.uint8)]
    return np.concatenate([ql.reshape(b, 128), qh.reshape(b, 64), *tail], axis=1)


def _symmetric_d(x: np.ndarray, div: float) -> tuple[np.ndarray, np.ndarray]:
    """(B, 32) -> (d (B,) = first value of largest magnitude / div, 1 / d or 0)."""
    _, vmax = _first_absmax(x)
    d = (vmax / F32(div)).astype(F32)
    with np.errstate(divide="ignore"):
        return d, np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


def _nibbles_and_high(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, 32) q in [0, 31] -> (qh (B, 4) uint8: little-endian bit i = bit 4 of q[i], qs (B, 16):
    byte j = q[j] & 15 | (q[j + 16] & 15) << 4)."""
    q = q.astype(np.uint32)
    qh = np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(32, dtype=np.uint32), axis=1)
    qs = ((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)).astype(np.uint8)
    return qh.astype("<u4")[:, None].view(np.uint8), qs


def encode_q5_0(x: np.ndarray) -> np.ndarray:
    """(B, 32) float32 -> (B, 22) uint8 Q5_0 blocks: d, qh, qs."""
    d, inv = _symmetric_d(x, -16)
    q = np.minimum(np.trunc(x * inv[:, None] + F32(16.5)), 31)
    qh, qs = _nibbles_and_high(q)
    return np.concatenate([_half(d)[:, None].view(np.uint8), qh, qs], axis=1)


def encode_q5_1(x: np.ndarray) -> np.ndarray:
    """(B, 32) float32 -> (B, 24) uint8 Q5_1 blocks: d, m, qh, qs."""
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = ((hi - lo) / F32(31)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = np.trunc((x - lo[:, None]) * inv[:, None] + F32(0.5))
    qh, qs = _nibbles_and_high(q)
    halves = np.stack([_half(d), _half(lo)], axis=1).view(np.uint8)
    return np.concatenate([halves, qh, qs], axis=1)


def encode_q8_0(x: np.ndarray) -> np.ndarray:
    """(B, 32) float32 -> (B, 34) uint8 Q8_0 blocks: d, 32 int8."""
    d = (np.abs(x).max(axis=1) / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    v = (x * inv[:, None]).astype(np.float64)  # exact; roundf: half away from zero
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    return np.concatenate([_half(d)[:, None].view(np.uint8), q.view(np.uint8)], axis=1)


def encode_q4_0(x: np.ndarray) -> np.ndarray:
    """(B, 32) float32 -> (B, 18) uint8 Q4_0 blocks: d, 16 bytes of nibbles."""
    d, inv = _symmetric_d(x, -8)
    q = np.minimum(np.trunc(x * inv[:, None] + F32(8.5)), 15).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([_half(d)[:, None].view(np.uint8), qs], axis=1)


ENCODE = {
    "Q4_K": encode_q4_k,
    "Q5_K": encode_q5_k,
    "Q6_K": encode_q6_k,
    "Q5_0": encode_q5_0,
    "Q5_1": encode_q5_1,
    "Q8_0": encode_q8_0,
    "Q4_0": encode_q4_0,
}


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """(..., K) float32 rows -> (..., bytes of a row) uint8 rows of ``type_name`` blocks, the
    bytes llama.cpp's reference quantizer writes; K a multiple of the type's block."""
    if type_name not in ENCODE:
        raise ValueError(f"no quantizer for GGUF type {type_name!r} (have {', '.join(ENCODE)})")
    x = np.asarray(values, F32)
    per, size = ENCODED[type_name]
    if x.ndim == 0 or x.shape[-1] % per:
        raise ValueError(
            f"{type_name}: rows of {x.shape[-1] if x.ndim else 0} values are not whole blocks "
            f"of {per}"
        )
    blocks = np.ascontiguousarray(x).reshape(-1, per)  # (blocks, values a block)
    out = np.empty((len(blocks), size), np.uint8)
    for a in range(0, len(blocks), CHUNK_BLOCKS):
        out[a : a + CHUNK_BLOCKS] = ENCODE[type_name](blocks[a : a + CHUNK_BLOCKS])
    return out.reshape(*x.shape[:-1], x.shape[-1] // per * size)
