"""Checked launches: ``Kernels`` wraps each kernel in a method that checks shapes, dtypes and
contiguity, picks the dtype's entry point, grid and block, and launches it with
``kernel(grid, block, args, shared_mem=...)``, CuPy's launch shape, which the CPU emulator's
kernels mirror. Scalars are numpy scalars of the parameter's exact type (np.int32, np.float32).
"""

from __future__ import annotations

import math

import numpy as np

from engine.kernels.build import normalize_defines
from engine.kernels.checks import check as _check
from engine.kernels.checks import finite as _finite
from engine.kernels.checks import suffix as _suffix
from engine.kernels.gguf_launch import GgufLaunches
from engine.kernels.moe_launch import MoeLaunches
from engine.utils import cdiv

NORM_THREADS = 128  # row kernels: the block of rows that share one, and the least per long row
ROW_CACHE = 4  # norm.cuh kRowCache: vectors per thread a row kernel holds in registers
ROTARY_TOKENS_PER_BLOCK = 4  # rotary_cache.cu kRotaryWarps: one warp per token
ATTN_THREADS = 128  # attention kernels: four warps (prefill and decode)
SAMPLE_THREADS = 256
MAX_HEAD_DIM = 256  # the attention kernels' largest head dim
PARTITION_SIZE = 512  # decode: tokens per partition, the largest the split picks
DECODE_CHUNK = 64  # decode: tokens scored per round (kChunk); partition sizes are multiples
DECODE_MIN_PARTITION = 256  # decode: no shorter partitions, whatever the SM count
DECODE_GROUP = 8  # decode: query heads per block (kMaxGroup)
EMULATED_SM_COUNT = 132  # what the emulated device reports: an H100/H200's SM count
PREFILL_TILE = 32  # prefill: query rows per block (prefill_attention.cu kTileRows)
PREFILL_DIM_MULTIPLE = 8  # prefill: K/V rows are read 16 bytes at a time
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # act_and_mul.cu's activation ids
ROTARY_BIAS, ROTARY_NORM = 1, 2  # rotary_cache.cu's flags: add the bias, norm q and k heads
LORA_TILE_ROWS = 16  # lora_shrink.cu / lora_expand.cu kTileRows: rows of one adapter per tile
LORA_RANK_COLS = 64  # lora_shrink.cu kRankCols: rank columns per block
LORA_MAX_MODULES = 3  # lora_expand.cu kMaxModules: q | k | v
LORA_SPLIT = 256  # lora_shrink.cu: the shortest K range a block sums (a multiple of 32)
LORA_MAX_SPLITS = 8  # and the most ranges K is cut into


def row_launch(rows: int, width: int, itemsize: int) -> tuple[tuple, tuple, int]:
    """(grid, block, row_threads) of a row kernel over (rows, width) elements in vectors of the
    kernels' width (common.cuh vec_width: the widest power of two up to 16 bytes that divides
    the width): a row of up to 32 * ROW_CACHE vectors gets a group of lanes (a power of two,
    about ROW_CACHE / 2 vectors each) and NORM_THREADS / group rows share a block; a longer row
    gets a block of its own, one to two vectors per thread (at most 1024 threads)."""
    vectors = width // math.gcd(width, max(1, 16 // itemsize))
    if vectors <= 32 * ROW_CACHE:
        group = min(32, 1 << max(0, cdiv(vectors, ROW_CACHE // 2) - 1).bit_length())
        per_block = NORM_THREADS // group
        return (cdiv(rows, per_block),), (NORM_THREADS,), group
    threads = min(1024, max(NORM_THREADS, 32 * cdiv(vectors, 64)))
    return (rows,), (threads,), threads


def decode_split(max_context_len: int, blocks: int, sm_count: int) -> tuple[int, int]:
    """(partitions, partition size) for a decode step whose longest context is
    ``max_context_len`` and that has ``blocks`` thread blocks per partition: enough partitions
    that the grid covers every SM once, none shorter than DECODE_MIN_PARTITION tokens, none
    longer than PARTITION_SIZE; the size a multiple of DECODE_CHUNK."""
    n = max(1, int(max_context_len))
    fill = cdiv(sm_count, max(1, blocks))
    parts = max(cdiv(n, PARTITION_SIZE), min(fill, cdiv(n, DECODE_MIN_PARTITION)))
    size = cdiv(cdiv(n, parts), DECODE_CHUNK) * DECODE_CHUNK
    return cdiv(n, size), size


def lora_tiles(slots: np.ndarray, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A step's rows by adapter for the LoRA kernels: (order (T,) int32, the rows whose slot is
    >= 0, slot by slot; tiles (n, 3) int32, (slot, first index into order, rows <= 16)). The
    base model's rows (slot -1) are in no tile. ``pad_to``: n at least this, with empty tiles
    (count 0) after the real ones; a step's n is at most ``lora_max_tiles``."""
    slots = np.asarray(slots, np.int32)
    order = np.argsort(slots, kind="stable").astype(np.int32)  # (T,) base rows first
    order = order[slots[order] >= 0]
    tiles = []
    if order.size:
        ids = slots[order]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        ends = np.r_[starts[1:], order.size]
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            slot = int(ids[s])
            tiles += [(slot, i, min(LORA_TILE_ROWS, e - i)) for i in range(s, e, LORA_TILE_ROWS)]
    n = max(len(tiles), pad_to or 0)
    out = np.zeros((n, 3), np.int32)
    if tiles:
        out[: len(tiles)] = tiles
    full = np.zeros(slots.shape[0], np.int32)
    full[: order.size] = order
    return full, out


def lora_max_tiles(T: int, active: int) -> int:
    """The most tiles ``lora_tiles`` makes of T rows over ``active`` adapters."""
    return cdiv(T, LORA_TILE_ROWS) + max(0, min(active, T) - 1)


def lora_split(K: int) -> int:
    """The K range each lora_shrink block sums: at least LORA_SPLIT, at most
    LORA_MAX_SPLITS ranges, a multiple of 32 (the kernel's staging chunk)."""
    return cdiv(max(LORA_SPLIT, cdiv(K, LORA_MAX_SPLITS)), 32) * 32


def _window(op: str, window) -> int:
    """A sliding window: an int >= 0 (0: none)."""
    if not isinstance(window, int | np.integer) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{op}: window must be an int >= 0 (0: no window), got {window!r}")
    return int(window)


def _softcap(op: str, softcap) -> float:
    """An attention soft-capping value: a float >= 0 (0: none)."""
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not softcap >= 0:
        raise ValueError(f"{op}: softcap must be a number >= 0 (0: none), got {softcap!r}")
    return float(softcap)


def _span(max_context_len: int, window: int) -> int:
    """The keys a query can see at most: the longest context, or the window when shorter."""
    return min(int(max_context_len), window) if window > 0 else int(max_context_len)


def _address(a) -> int:
    """The device (CuPy) or host (NumPy) address of an array's first element."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(iface["data"][0])


i32, f32 = np.int32, np.float32


class Kernels(GgufLaunches, MoeLaunches):
    """Every kernel behind a method that checks its arguments first.

    ``load(name, defines)`` returns a module for cuda_src/<name>.cu built with ``defines``
    (sorted (name, value) pairs; empty but for the decode attention's head dim and block size)
    with ``get_function(entry)``: ``cpu_module`` here, a ``cupy.RawModule`` in the GPU backend.
    Outputs are written in place.
    ``empty(shape, dtype)`` allocates the kernels' scratch on the device (the device's own
    allocator, so a graph capture hands out its recorded blocks); NumPy's by default.
    ``sm_count``: the device's multiprocessors, which the decode split fills.
    The GGUF block products (``gguf_matvec``, ``gguf_dequantize``): engine/kernels/gguf_launch.py;
    a mixture of experts' routing and grouped products (``moe_*``): engine/kernels/moe_launch.py.
    """

    def __init__(self, load, empty=np.empty, sm_count: int = EMULATED_SM_COUNT):
        self._load = load
        self._empty = empty
        self.sm_count = sm_count
        self._fns: dict[tuple, object] = {}

    def _fn(self, file: str, entry: str, defines: dict | None = None):
        key = (entry, tuple(defines.items()) if defines else ())  # checked once, on a miss
        fn = self._fns.get(key)
        if fn is None:
            module = self._load(file, normalize_defines(file, defines))
            fn = self._fns[key] = module.get_function(entry)
        return fn

    def _rows(self, op: str, a, args: tuple, *tail) -> None:
        """Launch row kernel ``op`` over a's (T, D) rows: args, T, D, threads per row, tail."""
        T, D = a.shape
        if T:
            grid, block, row_threads = row_launch(T, D, np.dtype(a.dtype).itemsize)
            fn = self._fn(op, f"{op}_{_suffix(op, a)}")
            fn(grid, block, args + (i32(T), i32(D), i32(row_threads), *tail))

    def embedding(self, out, token_ids, table, scale: float = 1.0, vocab_start: int = 0) -> None:
        """out[t] = table[token_ids[t] - vocab_start] * scale (float32, rounded once; 1: an exact
        copy); an id outside the table's rows (another tensor-parallel rank's) gives zeros."""
        V, D = table.shape
        T = token_ids.shape[0]
        _check("embedding", "token_ids", token_ids, (T,), np.int32)
        _check("embedding", "table", table, (V, D))
        _check("embedding", "out", out, (T, D), table.dtype)
        scale = _finite("embedding", "scale", scale)
        if T:
            grid, block, row_threads = row_launch(T, D, np.dtype(table.dtype).itemsize)
            fn = self._fn("embedding", f"embedding_{_suffix('embedding', table)}")
            args = (out, token_ids, table, i32(T), i32(V), i32(D), i32(row_threads))
            fn(grid, block, args + (f32(scale), i32(vocab_start)))

    def rms_norm(self, out, x, weight, eps: float, offset: float = 0.0) -> None:
        """out = x * rsqrt(mean(x^2) + eps) * (offset + weight): offset 1 for Gemma's norms."""
        T, D = x.shape
        _check("rms_norm", "x", x, (T, D))
        _check("rms_norm", "weight", weight, (D,), x.dtype)
        _check("rms_norm", "out", out, (T, D), x.dtype)
        offset = _finite("rms_norm", "offset", offset)
        self._rows("rms_norm", x, (out, x, weight), f32(eps), f32(offset))

    def fused_add_rms_norm(self, out, residual, x, weight, eps: float, offset: float = 0.0):
        """residual += x in place; out = rms_norm(residual) * (offset + weight)."""
        T, D = x.shape
        op = "fused_add_rms_norm"
        _check(op, "x", x, (T, D))
        _check(op, "residual", residual, (T, D), x.dtype)
        _check(op, "weight", weight, (D,), x.dtype)
        _check(op, "out", out, (T, D), x.dtype)
        offset = _finite(op, "offset", offset)
        self._rows(op, x, (out, residual, x, weight), f32(eps), f32(offset))

    def act_and_mul(self, out, gate_up, activation: str = "silu") -> None:
        """out = act(gate) * up over gate_up (T, 2F) = [gate | up]; act one of ACTIVATIONS."""
        op = "act_and_mul"
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            names = ", ".join(ACTIVATIONS)
            raise ValueError(f"{op}: activation must be one of {names}, got {activation!r}")
        T, F2 = gate_up.shape
        _check(op, "gate_up", gate_up, (T, F2))
        if F2 % 2:
            raise ValueError(f"{op}: gate_up width must be even, got {F2}")
        _check(op, "out", out, (T, F2 // 2), gate_up.dtype)
        self._rows(op, out, (out, gate_up), i32(ACTIVATIONS[activation]), f32(0), f32(0))

    def silu_and_mul(self, out, gate_up) -> None:
        """act_and_mul with silu (SwiGLU)."""
        self.act_and_mul(out, gate_up, "silu")

    def rotary_cache(
        self,
        q,
        k_cache,
        v_cache,
        qkv,
        positions,
        slot_mapping,
        cos_sin,
        bias=None,
        q_norm=None,
        k_norm=None,
        eps: float = 1e-6,
    ) -> None:
        """From qkv (T, (H + 2 Hkv) hd) rows q | k | v: q rotated into q (T, H, hd); k rotated
        and v copied into the caches (N, bs, Hkv, hd) at slot_mapping (slot < 0: no write).
        cos_sin: (max_pos, hd) float32. bias ((H + 2 Hkv) hd,): added to the row first;
        q_norm, k_norm (hd,), both or neither: each q (k) head RMS-normalised with eps and
        scaled by q_norm (k_norm) before the rotation."""
        op = "rotary_cache"
        N, bs, Hkv, hd = k_cache.shape
        T, H = q.shape[0], q.shape[1] if q.ndim == 3 else 0
        _check(op, "k_cache", k_cache, (N, bs, Hkv, hd))
        _check(op, "v_cache", v_cache, (N, bs, Hkv, hd), k_cache.dtype)
        _check(op, "q", q, (T, H, hd), k_cache.dtype)
        _check(op, "qkv", qkv, (T, (H + 2 * Hkv) * hd), k_cache.dtype)
        _check(op, "positions", positions, (T,), np.int32)
        _check(op, "slot_mapping", slot_mapping, (T,), np.int32)
        _check(op, "cos_sin", cos_sin, (None, hd), np.float32)
        if hd % 2 or hd > MAX_HEAD_DIM:
            raise ValueError(f"{op}: head_dim must be even and <= {MAX_HEAD_DIM}, got {hd}")
        flags = 0
        if bias is not None:
            _check(op, "bias", bias, ((H + 2 * Hkv) * hd,), k_cache.dtype)
            flags |= ROTARY_BIAS
        if (q_norm is None) != (k_norm is None):
            missing = "k_norm" if k_norm is None else "q_norm"
            raise ValueError(f"{op}: q_norm and k_norm go together, {missing} is None")
        if q_norm is not None:
            _check(op, "q_norm", q_norm, (hd,), k_cache.dtype)
            _check(op, "k_norm", k_norm, (hd,), k_cache.dtype)
            flags |= ROTARY_NORM
        eps = _finite(op, "eps", eps)
        if T:
            fn = self._fn(op, f"{op}_{_suffix(op, q)}")
            unused = qkv  # a pointer the kernel does not read without its flag
            args = (q, k_cache, v_cache, qkv, positions, slot_mapping, cos_sin)
            args += tuple(unused if a is None else a for a in (bias, q_norm, k_norm))
            args += (i32(T), i32(H), i32(Hkv), i32(hd), i32(cos_sin.shape[0]), np.int64(N * bs))
            shared = ROTARY_TOKENS_PER_BLOCK * 2 * hd * 4 if flags & ROTARY_NORM else 0
            grid, block = (cdiv(T, ROTARY_TOKENS_PER_BLOCK),), (32 * ROTARY_TOKENS_PER_BLOCK,)
            fn(grid, block, args + (i32(flags), f32(eps)), shared_mem=shared)

    def _sinks(self, op: str, sinks, heads: int, unused) -> tuple:
        """The kernels' (sinks, use_sinks) arguments: a (H,) float32 array and 1, or ``unused``
        (an array the kernel does not read without the flag) and 0."""
        if sinks is None:
            return unused, i32(0)
        _check(op, "sinks", sinks, (heads,), np.float32)
        return sinks, i32(1)

    def _check_paged(self, op, q, k_cache, v_cache, block_tables, context_lens):
        N, bs, Hkv, hd = k_cache.shape
        B = context_lens.shape[0]
        _check(op, "q", q, (None, None, hd), k_cache.dtype)
        _check(op, "k_cache", k_cache, (N, bs, Hkv, hd))
        _check(op, "v_cache", v_cache, (N, bs, Hkv, hd), k_cache.dtype)
        _check(op, "block_tables", block_tables, (B, None), np.int32)
        _check(op, "context_lens", context_lens, (B,), np.int32)
        H = q.shape[1]
        if H % Hkv:
            raise ValueError(f"{op}: query heads ({H}) must be a multiple of KV heads ({Hkv})")
        if hd > MAX_HEAD_DIM:
            raise ValueError(f"{op}: head_dim must be <= {MAX_HEAD_DIM}, got {hd}")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if _address(cache) % 16:  # K/V rows are read 16 bytes at a time
                raise ValueError(f"{op}: {name} must start on a 16-byte boundary")
        return H, Hkv, hd, bs

    def decode_split(self, max_context_len: int, num_seqs: int, H: int, Hkv: int, window=0):
        """(partitions, partition size) the decode kernel uses on this device: the split of
        the longest visible span, min(max_context_len, window) with a sliding window > 0."""
        blocks = num_seqs * Hkv * cdiv(H // Hkv, DECODE_GROUP)
        span = _span(max_context_len, _window("decode_split", window))
        return decode_split(span, blocks, self.sm_count)

    def paged_attention_decode(
        self,
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale: float,
        max_context_len: int,
        partition_size: int | None = None,
        window: int = 0,
        softcap: float = 0.0,
        sinks=None,
    ) -> None:
        """One query per sequence, q: (B, H, hd), at position context_lens[b] - 1: it sees
        every cached key, or with a sliding window > 0 the last ``window``. The visible span
        is split into partitions (by default as ``decode_split`` picks from
        ``max_context_len``, the window and the SM count), combined by the reduce kernel when
        there are several. ``max_context_len`` must be at least every context length (longer
        is fine: the extra partitions' blocks exit at once). ``softcap`` > 0: every score s
        is tanh(s / softcap) * softcap (Gemma 2). ``sinks`` (H,) float32: each head's sink
        logit in its softmax (gpt-oss)."""
        op = "paged_attention_decode"
        H, Hkv, hd, bs = self._check_paged(op, q, k_cache, v_cache, block_tables, context_lens)
        B = context_lens.shape[0]
        _check(op, "q", q, (B, H, hd))
        _check(op, "out", out, (B, H, hd), q.dtype)
        window = _window(op, window)
        if partition_size is None:
            P, partition_size = self.decode_split(max_context_len, B, H, Hkv, window)
        elif partition_size <= 0 or partition_size % DECODE_CHUNK:
            raise ValueError(
                f"{op}: partition_size must be a positive multiple of {DECODE_CHUNK}, "
                f"got {partition_size}"
            )
        else:
            P = max(1, cdiv(_span(max_context_len, window), partition_size))
        if B == 0:
            return
        sfx, G = _suffix(op, q), H // Hkv
        parts = self._empty((B, H, P, hd) if P > 1 else (1,), np.float32)  # (B, H, P, hd)
        stats = self._empty((2, B, H, P) if P > 1 else (2, 1), np.float32)  # max, sum
        args = (out, parts, stats[0], stats[1], q, k_cache, v_cache, block_tables, context_lens)
        args += (i32(Hkv), i32(G), i32(block_tables.shape[1]), f32(scale), i32(partition_size))
        fn = self._fn(op, f"{op}_{sfx}", {"HEAD_DIM": hd, "BLOCK_SIZE": bs})
        sink_args = self._sinks(op, sinks, H, stats)
        args += (i32(window), f32(_softcap(op, softcap)), *sink_args)
        fn((Hkv * cdiv(G, DECODE_GROUP), B, P), (ATTN_THREADS,), args)
        if P > 1:
            red = "paged_attention_reduce"
            args = (out, parts, stats[0], stats[1], context_lens, i32(hd), i32(P))
            args += (i32(partition_size), i32(window), *sink_args)
            self._fn(red, f"{red}_{sfx}")((H, B), (ATTN_THREADS,), args)

    def paged_attention_prefill(
        self,
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks=None,
    ) -> None:
        """Causal attention of query runs q: (T, H, hd), split by query_start_loc (B+1,): a
        row at position p sees keys 0..p, or with a sliding window > 0 keys p - window + 1..p;
        ``softcap`` > 0 soft-caps the scores, tanh(s / softcap) * softcap; ``sinks`` (H,)
        float32: each head's sink logit (gpt-oss)."""
        op = "paged_attention_prefill"
        H, Hkv, hd, bs = self._check_paged(op, q, k_cache, v_cache, block_tables, context_lens)
        B, T = context_lens.shape[0], q.shape[0]
        _check(op, "query_start_loc", query_start_loc, (B + 1,), np.int32)
        _check(op, "out", out, (T, H, hd), q.dtype)
        if hd % PREFILL_DIM_MULTIPLE:
            raise ValueError(f"{op}: head_dim must be a multiple of 8, got {hd}")
        window = _window(op, window)
        if T == 0:
            return
        fn = self._fn("prefill_attention", f"prefill_attention_{_suffix(op, q)}")
        args = (out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens)
        args += (i32(B), i32(T), i32(Hkv), i32(hd), i32(bs), i32(block_tables.shape[1]))
        args += (f32(scale), i32(window), f32(_softcap(op, softcap)))
        args += self._sinks(op, sinks, H, context_lens)
        grid = (H, B + cdiv(T, PREFILL_TILE) - 1)  # spare slots between sequences exit at once
        fn(grid, (ATTN_THREADS,), args, shared_mem=PREFILL_TILE * hd * 4)

    def copy_blocks(self, src, dst, pairs) -> None:
        """dst[:, :, d] = src[:, :, s] for each row (s, d) of pairs (P, 2) int32."""
        L, two, Ns, bs, Hkv, hd = src.shape
        _check("copy_blocks", "src", src, (L, 2, Ns, bs, Hkv, hd))
        _check("copy_blocks", "dst", dst, (L, 2, None, bs, Hkv, hd), src.dtype)
        _check("copy_blocks", "pairs", pairs, (None, 2), np.int32)
        if pairs.shape[0]:
            fn = self._fn("copy_blocks", f"copy_blocks_{_suffix('copy_blocks', src)}")
            args = (dst, src, pairs, i32(Ns), i32(dst.shape[2]), i32(bs * Hkv * hd))
            fn((pairs.shape[0], L * 2), (256,), args)

    def lora(self, y, x, a, b, order, tiles, module_ends) -> None:
        """y (T, N) += each LoRA row's update, x (T, K) @ A[slot]^T @ B[slot] (float32, y
        rounded once), over ``lora_tiles``' order and tiles. a (S, M R_m, K): each slot's
        modules' A rows, R_m per module (zeros past a module's own rank); b (S, R_m, N): the
        columns of module m read its R_m rows of t; module_ends (M,) int32: each module's end
        column in y. The base model's rows are left as they are."""
        op = "lora"
        T, K = x.shape
        S, R, N = a.shape[0], a.shape[1], y.shape[1]
        M = module_ends.shape[0] if hasattr(module_ends, "shape") else 0
        if not 1 <= M <= LORA_MAX_MODULES or R % M:
            raise ValueError(f"{op}: module_ends must have 1 to 3 entries dividing A's {R} rows")
        _check(op, "x", x, (T, K))
        _check(op, "y", y, (T, N), x.dtype)
        _check(op, "a", a, (S, R, K), x.dtype)
        _check(op, "b", b, (S, R // M, N), x.dtype)
        _check(op, "order", order, (T,), np.int32)
        _check(op, "tiles", tiles, (None, 3), np.int32)
        _check(op, "module_ends", module_ends, (M,), np.int32)
        n = tiles.shape[0]
        if not (T and n):
            return
        split = lora_split(K)
        P = cdiv(K, split)
        partial = self._empty((P, T, R), np.float32)  # (P, T, R): written for the tiles' rows
        sfx = _suffix(op, x)
        args = (partial, x, a, order, tiles, i32(T), i32(K), i32(R), i32(S), i32(split))
        self._fn("lora_shrink", f"lora_shrink_{sfx}")((n, P, cdiv(R, LORA_RANK_COLS)), (256,), args)
        args = (y, partial, b, order, tiles, module_ends, i32(T), i32(N), i32(R // M), i32(M))
        args += (i32(S), i32(P))
        self._fn("lora_expand", f"lora_expand_{sfx}")((n, cdiv(N, 256)), (256,), args)

    def sample_greedy(self, out_ids, logits) -> None:
        B, V = logits.shape
        _check("sample_greedy", "logits", logits, (B, V))
        _check("sample_greedy", "out_ids", out_ids, (B,), np.int32)
        if B:
            fn = self._fn("sample_greedy", f"sample_greedy_{_suffix('sample_greedy', logits)}")
            fn((B,), (SAMPLE_THREADS,), (out_ids, logits, i32(V)))
