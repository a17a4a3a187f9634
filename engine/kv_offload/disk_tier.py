"""Blocks in files, one a block, that outlive the process: the tier under host memory.

Layout: ``DIR/<key>/<hash>.kvb``, ``<key>`` the first 8 bytes of the engine's cache key digest
in hex (cache_key.py; ``key.json`` beside the blocks says what it stands for in words), ``<hash>``
the block's chained hash as 16 hex digits; a grouped model's block of KV group g > 0 is
``<hash>-g<g>.kvb``. A file is a header, the block's token ids and its bytes:

    magic "PLLMKVB1" | version u32 | key digest 32 bytes | hash i64 | parent hash i64 |
    has parent u8 | group u32 | tokens u32 | payload bytes u64 | crc32 of tokens and payload u32
    block_size x int32 token ids | the block, (L, 2, block_size, Hkv, hd) in the cache dtype
    (a grouped model's: (G, 2, ...), its group's G slots)

Reading trusts nothing in the file: its size must be what this engine's own layout gives, the
header's version, key digest, hash, group and lengths must be this engine's and this block's,
its parent hash and token ids must be the ones being looked up, and the checksum must match.
A file that fails (from another model or layout renamed into place, truncated, a flipped byte)
is ignored with one log line and removed. Writes go to a temporary file of the writer's own and
are renamed into place (atomic on POSIX), so engines that share the directory never see each
other's half-written files; two that write one block write the same bytes. The writer is a
thread of its own: a step hands the blocks over and goes on.

The directory's size bound (``kv_disk_bytes``) counts every key's files: past it, the least
recently used files (a hit touches its file's mtime) are removed down to 90% of the bound.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from engine.kv_offload.cache_key import FORMAT_VERSION, CacheKey
from engine.kv_offload.tier import BlockKey, KVTier, TierStats

log = logging.getLogger("engine")

MAGIC = b"PLLMKVB1"
HEADER = struct.Struct("<8sI32sqqBIIQI")
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0  # a temporary file this old was left by a writer that died
LOW_WATER = 0.9  # a shrink goes down to this fraction of the bound
MASK64 = (1 << 64) - 1


class DiskTier(KVTier):
    name = "disk"

    def __init__(
        self, root, capacity_bytes: int, key: CacheKey, block_shape: tuple, dtype: np.dtype
    ):
        self.root, self.key, self.digest = Path(root), key, key.digest
        self.dir = self.root / self.digest[:8].hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._describe_key()
        except OSError as e:
            raise ValueError(
                f"kv_cache_dir {root}: cannot write there ({e.strerror or e})"
            ) from None
        self.block_shape, self.dtype = tuple(block_shape), np.dtype(dtype)
        self.block_size = block_shape[2]
        self.payload_bytes = int(np.prod(block_shape)) * self.dtype.itemsize
        self.file_bytes = HEADER.size + 4 * self.block_size + self.payload_bytes
        self.stats = TierStats(self.name, capacity_bytes)
        self._lock = threading.Lock()
        # (group, hash) -> (key, block): put, not yet written
        self._pending: dict[tuple[int, int], tuple[BlockKey, np.ndarray]] = {}
        self._queue: queue.Queue = queue.Queue()
        self._names = itertools.count()
        self._write_failed = False
        self.shrink()  # counts the bytes there are, clears dead temporaries, holds the bound
        self._thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def _describe_key(self) -> None:
        path = self.dir / "key.json"
        if not path.exists():
            tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}-key"
            tmp.write_text(json.dumps(self.key.as_dict(), indent=1, sort_keys=True))
            os.replace(tmp, path)

    def path(self, h: int, group: int = 0) -> Path:
        return self.dir / f"{h & MASK64:016x}{f'-g{group}' if group else ''}{SUFFIX}"

    def holds(self, h: int, group: int = 0) -> bool:
        with self._lock:
            if (group, h) in self._pending:
                return True
        return self.path(h, group).exists()

    # ---- reading ----
    def get(self, h: int, key: BlockKey, group: int = 0) -> np.ndarray | None:
        with self._lock:
            entry = self._pending.get((group, h))
        if entry is not None:
            return entry[1] if entry[0] == key else None
        path = self.path(h, group)
        try:
            size = path.stat().st_size
            if size != self.file_bytes:
                return self._reject(path, f"{size} bytes, a block here is {self.file_bytes}")
            raw = path.read_bytes()
        except FileNotFoundError:  # never written, or removed by another engine meanwhile
            return None
        if len(raw) != self.file_bytes:
            return self._reject(path, f"{len(raw)} bytes read, a block here is {self.file_bytes}")
        data = self._parse(path, raw, h, key, group)
        if data is not None:
            try:
                os.utime(path)  # most recently used
            except OSError:
                pass
        return data

    def _parse(self, path: Path, raw: bytes, h: int, key: BlockKey, group: int):
        """The block's array, or None (a miss; a file that fails its checks is removed)."""
        magic, version, digest, fh, parent, has_parent, g, n, nbytes, crc = HEADER.unpack_from(raw)
        if magic != MAGIC or version != FORMAT_VERSION:
            return self._reject(path, f"not a block file of format {FORMAT_VERSION}")
        if digest != self.digest:
            return self._reject(path, "made for another model, dtype or layout (its key differs)")
        if (fh & MASK64) != (h & MASK64) or g != group:
            return self._reject(path, "its header names another block or size")
        if n != self.block_size or nbytes != self.payload_bytes:
            return self._reject(path, "its header names another block or size")
        if zlib.crc32(memoryview(raw)[HEADER.size :]) != crc:
            return self._reject(path, "checksum mismatch (damaged)")
        tokens = np.frombuffer(raw, np.int32, n, HEADER.size).tolist()
        if (parent if has_parent else None, tuple(tokens)) != key:
            return None  # another prefix under the same 64-bit hash: a miss, the file stays
        offset = HEADER.size + 4 * n
        return np.frombuffer(raw, self.dtype, offset=offset).reshape(self.block_shape)

    def _reject(self, path: Path, why: str) -> None:
        log.warning("kv disk tier: ignored %s: %s", path, why)
        self.stats.rejected += 1
        try:
            path.unlink()
        except OSError:
            pass
        return None

    # ---- writing ----
    def put(self, h: int, key: BlockKey, data: np.ndarray, group: int = 0) -> None:
        with self._lock:
            self._pending[(group, h)] = (key, data)
        self._queue.put((group, h))

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                with self._lock:
                    entry = self._pending.get(item)
                if entry is not None:
                    self._write_logged(item, *entry)
                    with self._lock:
                        if self._pending.get(item) is entry:
                            del self._pending[item]
            finally:
                self._queue.task_done()

    def _write_logged(self, item: tuple[int, int], key: BlockKey, data: np.ndarray) -> None:
        """``_write``; any failure is logged (once) and the block dropped: the writer lives on,
        so ``flush`` never waits on a dead thread."""
        try:
            self._write(item, key, data)
        except Exception as e:  # noqa: BLE001 - a block not written is a miss later, no more
            if not self._write_failed:
                log.warning("kv disk tier: a block was not written (%r); dropped", e)
            self._write_failed = True

    def _write(self, item: tuple[int, int], key: BlockKey, data: np.ndarray) -> None:
        (group, h), (parent, tokens) = item, key
        ids = np.asarray(tokens, dtype=np.int32)  # (block_size,)
        payload = np.ascontiguousarray(data, dtype=self.dtype).view(np.uint8)  # (bytes,) any dtype
        crc = zlib.crc32(payload, zlib.crc32(ids.tobytes()))
        header = HEADER.pack(
            MAGIC, FORMAT_VERSION, self.digest, _signed(h), _signed(parent or 0),
            parent is not None, group, len(ids), payload.nbytes, crc,
        )  # fmt: skip
        tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{next(self._names)}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(ids.tobytes())
                f.write(payload.data)
            os.replace(tmp, self.path(h, group))
        except OSError as e:
            if not self._write_failed:
                log.warning("kv disk tier: could not write to %s (%s); blocks are dropped", tmp, e)
            self._write_failed = True
            tmp.unlink(missing_ok=True)
            return
        s = self.stats
        s.stores += 1
        s.store_bytes += payload.nbytes
        s.used_bytes += self.file_bytes
        if s.used_bytes > s.capacity_bytes:
            self.shrink()

    def shrink(self) -> None:
        """Count the directory's block files (every key's), remove temporaries left by dead
        writers, and past the bound the least recently used files, down to LOW_WATER of it."""
        files, total, now = [], 0, time.time()
        for sub in _scandir(self.root):
            if not sub.is_dir():
                continue
            for e in _scandir(sub.path):
                try:
                    st = e.stat()
                except OSError:
                    continue
                if e.name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, e.path))
                    total += st.st_size
                elif e.name.startswith(TMP_PREFIX) and now - st.st_mtime > STALE_TMP_S:
                    _unlink(e.path)
        if total > self.stats.capacity_bytes:
            files.sort()
            goal = LOW_WATER * self.stats.capacity_bytes
            for _, size, path in files:
                if total <= goal:
                    break
                _unlink(path)
                total -= size
                self.stats.evictions += 1
        self.stats.used_bytes = total

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _signed(h: int) -> int:
    """A 64-bit hash as int64 (Python's hashes are signed already; this keeps any int in range)."""
    h &= MASK64
    return h - (1 << 64) if h >= 1 << 63 else h


def _scandir(path) -> list:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
