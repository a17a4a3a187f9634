"""What decides a stored block's bytes, as one digest: a block is only ever loaded into an
engine whose key is the same.

The key holds the weights' fingerprint, the model's config, the backend and its dtypes (the
weights', the cache's, the quantization: each changes K and V), the block's layout (block size,
layers, KV heads, head size; a grouped model's KV groups, whose blocks hold G layers of one
group), the tensor-parallel rank and size, and the cache format's version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 2  # of the disk tier's files; a change of layout bumps it
SAMPLES = 32  # chunks of a weights file (or array) read for its fingerprint
CHUNK = 1 << 16  # bytes each
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")


@dataclass(frozen=True)
class CacheKey:
    weights: str  # weights_fingerprint
    model: str  # the ModelConfig's digest
    backend: str
    dtype: str  # weights and activations
    cache_dtype: str
    quantization: str | None
    block_size: int
    layers: int
    kv_heads: int
    head_dim: int
    kv_groups: str = ""  # a grouped model's KVGroups.layout(); "": one slot per layer
    rank: int = 0
    world_size: int = 1
    version: int = FORMAT_VERSION

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def digest(self) -> bytes:
        """32 bytes naming the whole key."""
        text = json.dumps(self.as_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).digest()

    def describe(self) -> str:
        """One line for a log."""
        return (
            f"{self.backend}, {self.dtype} weights"
            + (f" ({self.quantization})" if self.quantization else "")
            + f", {self.cache_dtype} cache, blocks of {self.block_size} tokens, {self.layers} "
            f"layers x {self.kv_heads} KV heads x {self.head_dim}"
            + (f" in KV groups ({self.kv_groups})" if self.kv_groups else "")
            + f", rank {self.rank} of "
            f"{self.world_size}, format {self.version}"
        )


def engine_key(loaded, backend, config, groups=None) -> CacheKey:
    """The key of an engine's blocks: ``loaded`` (before its weights are dropped), its
    backend, its EngineConfig, its KVGroups (None or one group: a slot per layer)."""
    mc = backend.cfg
    model = hashlib.sha256(repr(mc).encode()).hexdigest()
    return CacheKey(
        weights=weights_fingerprint(loaded),
        model=model,
        backend=backend.name,
        dtype=backend.kv_dtype,
        cache_dtype=backend.cache_dtype,
        quantization=backend.quantization,
        block_size=config.block_size,
        layers=mc.num_hidden_layers,
        kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        kv_groups=groups.layout() if groups is not None and groups.grouped else "",
        world_size=config.world_size,
    )


def weights_fingerprint(loaded) -> str:
    """A hex digest of the weights: of their files where ``loaded.source`` is a file or a
    directory (each file's name, size and SAMPLES chunks spread over it, its header among
    them), else of the arrays in memory (names, shapes, dtypes and chunks of their bytes).
    A few MiB read, whatever the model's size; a retrained or merged matrix changes chunks
    of every file it is in."""
    h = hashlib.sha256()
    source = Path(str(loaded.source))
    files = _weight_files(source) if source.exists() else []
    if files:
        for f in files:
            _hash_file(h, f)
        config = source / "config.json" if source.is_dir() else None
        if config is not None and config.exists():
            h.update(config.read_bytes())
    elif loaded.weights is not None:
        for name, a in loaded.weights.arrays():
            _hash_array(h, name, a)
    else:
        raise ValueError(f"kv tiers: no weights to fingerprint for {loaded.source!r}")
    return h.hexdigest()


def _weight_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    return sorted(p for p in source.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def _hash_file(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        for off in _offsets(size):
            f.seek(off)
            h.update(f.read(CHUNK))


def _hash_array(h, name: str, a) -> None:
    raw = getattr(a, "raw", a)  # a GGUF BlockMatrix: its blocks as stored
    arr = np.ascontiguousarray(np.asarray(raw)).reshape(-1).view(np.uint8)  # (bytes,)
    h.update(f"{name}:{tuple(a.shape)}:{getattr(a, 'dtype', '')}".encode())
    for off in _offsets(arr.nbytes):
        h.update(arr[off : off + CHUNK].tobytes())


def _offsets(size: int) -> list[int]:
    """Where the chunks start: all of it when small, else SAMPLES spread from 0 to the end."""
    if size <= SAMPLES * CHUNK:
        return list(range(0, size, CHUNK))
    step = (size - CHUNK) / (SAMPLES - 1)
    return [int(i * step) for i in range(SAMPLES)]
