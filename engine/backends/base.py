"""The interface every backend implements, and the code the backends share.

The engine talks to a backend through these methods alone: it sizes the pool from
``weights_bytes``, ``bytes_per_block`` and ``profile_peak_bytes``, allocates it once, moves
blocks (``swap_out``, ``swap_in``, ``copy_blocks``) as the scheduler says, and runs one step with
``forward`` (logits) or ``forward_greedy`` (argmax ids only), or, with async scheduling, starts
one with ``launch_greedy`` and reads its ids later from the handle it returns. The KV cache of
every backend has the shape ``cache_shape``: (L, 2, num_blocks, block_size, Hkv, hd), K and V of
a layer side by side, so a block id names the same rows in every layer. A grouped model
(``use_kv_groups``, engine/backends/kv_groups.py) has G slots in place of its L layers: layer l
reads and writes slot ``layer_slot[l]`` through its group's page table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

import numpy as np

from engine.backends.forward_batch import ForwardBatch
from model_loader.config import ModelConfig

KV_DTYPES = ("float32", "float16", "bfloat16")


ML_DTYPES = {"bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# the 8-bit floats' largest finite values: a cache write saturates there (vLLM's rule)
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def numpy_dtype(name: str) -> np.dtype:
    """A dtype name of the engine (``fp8_e4m3``, ``bfloat16``, ...) -> NumPy's dtype."""
    if name in ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, ML_DTYPES[name]))
    return np.dtype(name)


def resolve_kv_dtype(dtype: str, model_config: ModelConfig, on_gpu: bool) -> str:
    """The dtype of weights, activations and KV cache (the host backends' cache may differ:
    ``--kv-cache-dtype``). ``auto``: the checkpoint's on a GPU (bf16 for TinyLlama), float32 on
    the host (NumPy has no fast 16-bit products)."""
    if dtype == "auto":
        keep = on_gpu and model_config.torch_dtype in KV_DTYPES
        return model_config.torch_dtype if keep else "float32"
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(KV_DTYPES)}, got {dtype!r}")
    return dtype


def retain_freed_memory(retain: bool = True) -> None:
    """Tell glibc's malloc to keep freed memory for reuse instead of handing it back to the OS
    (large blocks are otherwise mapped fresh and unmapped on free). A host backend's step
    allocates the same large temporaries every layer; fresh pages fault in on first touch, and
    on this project's VMs a fault costs tens of microseconds (measured: a 6 GB array's first
    fill 68 s, its second 0.8 s). ``retain=False`` while weights load: their temporaries
    (a layer's matrices in conversion) are freed for good, so they do not stay resident between
    the kept arrays (measured: 0.2-0.5 GB of a 1.1B model's peak). Not glibc: nothing to do."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    # retained: blocks up to 64 MB come from the heap, which is never trimmed; released: blocks
    # from 1 MB are mapped on their own, and the heap's free top goes back past 1 MB
    libc.mallopt(M_MMAP_THRESHOLD, 64 << 20 if retain else 1 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1 if retain else 1 << 20)


def cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """(L, 2, num_blocks, block_size, Hkv, hd): the KV pool of every backend."""
    L, Hkv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    return (L, 2, num_blocks, block_size, Hkv, hd)


def block_pairs(pairs) -> tuple[np.ndarray, np.ndarray]:
    """(src ids, dst ids), int32, from (src, dst) pairs (a list or an (n, 2) array)."""
    a = np.asarray(pairs, np.int32).reshape(-1, 2)  # (n, 2)
    return a[:, 0], a[:, 1]


def copy_host_blocks(dst: np.ndarray, src: np.ndarray, pairs) -> None:
    """dst[:, :, d] = src[:, :, s] for each (s, d): a swap between two host pools."""
    s, d = block_pairs(pairs)
    if len(s):
        dst[:, :, d] = src[:, :, s]


def greedy_ids(logits: np.ndarray) -> np.ndarray:
    """(B, V) -> (B,) int32 first argmax, NaN ignored; -1 where no value is above -inf."""
    clean = np.where(np.isnan(logits), -np.inf, logits)  # (B, V)
    ids = np.argmax(clean, axis=1).astype(np.int32)  # (B,)
    ids[~(clean[np.arange(len(ids)), ids] > -np.inf)] = -1
    return ids


class GreedyIds:
    """A launched greedy step: ``result()`` -> its (B,) int32 ids on the host (waiting for the
    device where it still runs). This one holds ids already computed."""

    def __init__(self, ids: np.ndarray):
        self.ids = ids  # (B,)

    def result(self) -> np.ndarray:
        return self.ids


def take_prev_ids(batch: ForwardBatch, prev_ids: np.ndarray) -> ForwardBatch:
    """The batch with each token that ``prev_rows`` names taken from the previous step's (B',)
    ids (on the host: what a device backend does with a gather)."""
    rows = batch.prev_rows  # (T,)
    tokens = batch.token_ids.copy()  # (T,)
    mask = rows >= 0
    # a failed row's -1 becomes 0: its sequence is ended when the ids are read, its row dropped
    tokens[mask] = np.maximum(prev_ids[rows[mask]], 0)
    assert (tokens >= 0).all(), "a placeholder token has no row of the previous step's ids"
    return replace(batch, token_ids=tokens, prev_rows=None)


class Backend(ABC):
    """One model's forward over a paged KV cache. ``kv_cache``: ``cache_shape(num_blocks)``
    where the step runs; ``cpu_cache``: the swap space, in host memory."""

    name: str
    cfg: ModelConfig
    block_size: int
    kv_dtype: str  # "float32" | "float16" | "bfloat16"
    kv_cache = None
    cpu_cache = None
    quantization: str | None = None  # the matrices' format when not kv_dtype ("int8", "q8_0")

    @property
    @abstractmethod
    def weights_bytes(self) -> int:
        """Bytes of the weights as the backend holds them."""

    _cache_dtype: str | None = None  # set by a backend that keeps its cache apart

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype: kv_dtype's, or ``--kv-cache-dtype``'s on the host backends."""
        return self._cache_dtype or self.kv_dtype

    supports_kv_groups = False  # whether ``use_kv_groups`` may give it a grouped layout
    kv_groups = None  # a grouped model's KVGroups; None: one slot per layer

    def use_kv_groups(self, groups) -> None:
        """A grouped model's layout (before ``allocate_kv_cache``): ``groups.num_slots`` slots
        in the pool, not one per layer; the step's ForwardBatch carries each group's tables."""
        if not self.supports_kv_groups:
            raise ValueError(f"backend {self.name!r} does not run a grouped KV cache")
        self.kv_groups = groups

    @property
    def kv_slots(self) -> int:
        """Layers' worth of K and V a block holds: the G slots of a grouped model, else L."""
        groups = self.kv_groups
        return self.cfg.num_hidden_layers if groups is None else groups.num_slots

    @property
    def bytes_per_block(self) -> int:
        per_block = self.cfg.kv_bytes_per_block(self.block_size, self.cache_dtype)
        return per_block // self.cfg.num_hidden_layers * self.kv_slots

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.kv_slots, *cache_shape(self.cfg, num_blocks, self.block_size)[1:])

    def expert_tokens(self) -> list[list[int]] | None:
        """A mixture of experts: per sparse layer, [its index, then the rows routed to each of
        its experts so far]; None for a dense model or a backend that does not count."""
        return None

    @abstractmethod
    def profile_peak_bytes(self, num_tokens: int, max_seq_len: int, num_seqs: int) -> int:
        """Activation bytes of the largest step (``num_tokens`` tokens in ``num_seqs``
        sequences, the longest ``max_seq_len``)."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """The block pool (``num_blocks``) and the swap space (``num_cpu_blocks``)."""

    @abstractmethod
    def swap_out(self, pairs) -> None:
        """Pool block -> swap block, for each (pool id, swap id)."""

    @abstractmethod
    def swap_in(self, pairs) -> None:
        """Swap block -> pool block, for each (swap id, pool id)."""

    @abstractmethod
    def copy_blocks(self, pairs) -> None:
        """Whole blocks within the pool, for each (src, dst) (copy-on-write)."""

    @property
    def block_dtype(self) -> np.dtype:
        """The dtype of ``read_blocks``' arrays: the pool's (a host pool's own)."""
        return np.dtype(self.kv_cache.dtype)

    def hidden_states(self, batch: ForwardBatch) -> np.ndarray:
        """(T, D) float32 final-normed hidden states of every row (the pooling runner)."""
        raise ValueError(f"runner='pooling': the {self.name} backend has no pooling (numpy and "
                         "cpu do)")  # fmt: skip

    @property
    def lora_bytes(self) -> int:
        """Bytes this backend keeps for LoRA adapters besides the loaded pairs themselves (its
        own layouts of them, its slots)."""
        return 0

    def set_lora(self, slot: int, weights) -> None:
        """LoRA slot ``slot`` holds this adapter from now on (engine/lora/adapter.py)."""
        raise ValueError(
            f"enable_lora: the {self.name} backend has no LoRA products "
            "(numpy, cpu, cuda and cuda-cpu do)"
        )

    def read_blocks(self, ids, groups=None) -> np.ndarray:
        """(L, 2, n, block_size, Hkv, hd) a host copy of pool blocks ``ids``, their bytes as
        they are (the KV tiers store them); a grouped pool's (G, 2, ...). ``groups``: each
        block's KV group (the executor's pipeline stages hold a group's slots apart; one
        pool holds them together and needs none)."""
        return self.kv_cache[:, :, np.asarray(ids, dtype=np.intp)]

    def write_blocks(self, ids, data: np.ndarray, groups=None) -> None:
        """Pool blocks ``ids`` = ``data`` (L, 2, n, block_size, Hkv, hd), as ``read_blocks``
        gave them (a KV tier's load)."""
        self.kv_cache[:, :, np.asarray(ids, dtype=np.intp)] = data

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """One step -> (B, V) float32 logits on the host, one row per sequence."""

    @abstractmethod
    def forward_greedy(self, batch: ForwardBatch) -> np.ndarray:
        """One step -> (B,) int32 argmax of each row's logits (the first maximum; NaN never
        wins; -1 for a row with nothing above -inf, which the engine ends as a failed sample)."""

    def launch_greedy(self, batch: ForwardBatch, prev: GreedyIds | None = None) -> GreedyIds:
        """Start one greedy step; its ids come from the handle's ``result()``. Tokens that
        ``batch.prev_rows`` names are the ids of ``prev``, the step launched before. This
        default runs the step now (a device backend returns before the step has run)."""
        if batch.prev_rows is not None:
            batch = take_prev_ids(batch, prev.result())
        return GreedyIds(self.forward_greedy(batch))
