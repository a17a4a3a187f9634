"""Collectives between the ranks of one host: a shared-memory all-reduce and all-gather.

``ShmComm`` is made by the parent before the workers start and handed to each (it pickles to the
name of its block, so forked processes and Ray's actors take it alike). The ranks meet at a
``SpinBarrier`` in the block itself. Each rank owns one slot in each of two slot sets in the
block. A collective writes the rank's array into its slot of the
current set, waits at the barrier for every rank to have written, and reads the others' slots.
The sets alternate, so one barrier per collective is enough: a rank can write a set again only
after the barrier of the collective in between, which no rank passes before every rank has
finished reading.

Every rank sums the slots in rank order, so every rank gets the same bits: the ranks' residual
streams stay identical, as one process's would be. A collective waits at most ``timeout``
seconds for the others (a dead rank breaks the barrier for all: a RuntimeError, not a hang).

The rules a collective keeps, checked on every call: float32, and the same size on every rank
for an all-reduce (the slots carry no shape: each rank writes its element count beside its
slot, and a count that differs is a ValueError on every rank). An array larger than a slot
goes in slot-sized pieces, one barrier each. Beside the count, a rank may write a few more
integers of its own about the call (``meta``): the emulated NCCL (``nccl_emu.py``) compares
the ranks' calls with them.
"""

from __future__ import annotations

import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

F32 = np.dtype(np.float32)
MAX_RANKS = 8
META = 8  # int64s per rank before each slot set: its element count, then the caller's meta
HEADER = 64  # bytes of the spin barrier's generations, one int64 per rank
SET_HEADER = MAX_RANKS * META * 8  # bytes before each slot set
SPIN_YIELDS = 200  # a spinning barrier yields this many times before it starts to sleep


class SpinBarrier:
    """A barrier in shared memory: each rank writes its own generation counter (one writer per
    int64, so no atomic operation is needed) and waits until every counter has reached it,
    yielding its core, then sleeping 20 us at a time. A rank's slot writes are seen before its
    counter's (x86's stores are not reordered with other stores). Measured against
    ``multiprocessing.Barrier`` (semaphores) on the 2-core VM, a (8, 576) all-reduce: 107 vs
    249 us at 2 ranks, 127 vs 389 us at 3; SmolLM2's decode step at TP 3, 122-135 vs 149-180 ms."""

    def __init__(self, gens: np.ndarray, rank: int):
        self.gens, self.rank, self.gen = gens, rank, int(gens[rank])  # (world,) int64

    def wait(self, timeout: float) -> None:
        self.gen += 1
        self.gens[self.rank] = self.gen
        deadline, spins = time.monotonic() + timeout, 0
        while self.gens.min() < self.gen:
            spins += 1
            time.sleep(0 if spins < SPIN_YIELDS else 20e-6)
            if spins % 1000 == 0 and time.monotonic() > deadline:
                raise TimeoutError


class ShmComm:
    """``world`` ranks, slots of ``slot_bytes``; a collective waits ``timeout`` seconds at most."""

    def __init__(self, world: int, slot_bytes: int, timeout: float = 60.0, name: str | None = None):
        if not 1 <= world <= MAX_RANKS:
            raise ValueError(f"ShmComm: world size must be 1..{MAX_RANKS}, got {world}")
        self.world, self.timeout = world, timeout
        self.slot_floats = max(slot_bytes // F32.itemsize, 1)
        size = HEADER + 2 * (SET_HEADER + world * self.slot_floats * F32.itemsize)
        # a new block is zeros (the barrier's generations among them): ranks that open it by
        # name the moment it exists may already be counting
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.name = self.shm.name
        self.barrier: SpinBarrier | None = None  # each rank's, made by attach
        self.rank: int | None = None
        self._flip = 0
        self._owner = True
        self.calls, self.seconds = 0, 0.0  # collectives (pieces) and the time spent in them
        self._views()

    def __getstate__(self):
        return {
            "world": self.world,
            "timeout": self.timeout,
            "slot_floats": self.slot_floats,
            "name": self.name,
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.shm, self.rank, self._flip, self._owner = None, None, 0, False
        self.barrier, self.calls, self.seconds = None, 0, 0.0

    @classmethod
    def join(cls, name: str, world: int, slot_bytes: int, timeout: float) -> ShmComm:
        """A comm over the block ``name`` that another process made with these sizes (not yet
        attached; ``attach`` opens it)."""
        comm = cls.__new__(cls)
        comm.__setstate__(
            dict(world=world, timeout=timeout, slot_floats=max(slot_bytes // 4, 1), name=name)
        )
        return comm

    def attach(self, rank: int) -> ShmComm:
        """In the worker of rank ``rank``: open the shared block (a fork's copy is open already)."""
        if self.shm is None:
            self.shm = shared_memory.SharedMemory(name=self.name)
            # the parent owns (and unlinks) the block: the worker's tracker must not
            resource_tracker.unregister(self.shm._name, "shared_memory")
        self.rank = rank
        self._owner = False
        self._views()
        self.barrier = SpinBarrier(np.ndarray((self.world,), np.int64, self.shm.buf), rank)
        return self

    def _views(self) -> None:
        per_set = SET_HEADER + self.world * self.slot_floats * F32.itemsize
        buf = self.shm.buf
        self._meta = [
            np.ndarray((MAX_RANKS, META), np.int64, buf, offset=HEADER + s * per_set)
            for s in range(2)
        ]  # 2 x (ranks, count | meta)
        self._slots = [
            np.ndarray(
                (self.world, self.slot_floats), F32, buf, offset=HEADER + s * per_set + SET_HEADER
            )
            for s in range(2)
        ]  # 2 x (world, slot_floats)

    def close(self) -> None:
        """Release the block (the parent also removes it)."""
        self._meta = self._slots = self.barrier = None
        if self.shm is not None:
            self.shm.close()
            if self._owner:
                self.shm.unlink()
            self.shm = None

    # ---- collectives ----
    def _exchange(self, x: np.ndarray, meta=()) -> tuple[np.ndarray, np.ndarray]:
        """Write x (and up to META - 1 integers of ``meta``) into this rank's slot, wait for
        every rank: (the slots, their counts); ``exchanged_meta``: every rank's meta."""
        if x.dtype != F32:
            raise ValueError(f"ShmComm: collectives take float32, got {x.dtype}")
        start = time.perf_counter()
        s = self._flip
        self._flip ^= 1
        slots, table = self._slots[s], self._meta[s]
        slots[self.rank, : x.size] = x.reshape(-1)
        table[self.rank, 1 : 1 + len(meta)] = meta
        table[self.rank, 0] = x.size
        try:
            self.barrier.wait(self.timeout)
        except TimeoutError:
            raise RuntimeError(
                f"rank {self.rank}: another tensor-parallel rank did not reach the collective "
                f"within {self.timeout:g} s (it died or diverged)"
            ) from None
        self.calls += 1
        self.seconds += time.perf_counter() - start  # the copy in and the wait; not the sum
        self.exchanged_meta = table[: self.world, 1:]  # (world, META - 1)
        return slots, table[: self.world, 0]

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The sum of every rank's x (same shape on every rank), in rank order: the same bits
        on every rank. More than a slot goes in slot-sized pieces."""
        flat = np.ascontiguousarray(x).reshape(-1)
        out = np.empty(flat.size, F32)
        for i in range(0, max(flat.size, 1), self.slot_floats):
            piece = flat[i : i + self.slot_floats]
            slots, counts = self._exchange(piece)
            if (counts != piece.size).any():
                raise ValueError(
                    f"ShmComm.all_reduce: ranks gave {counts.tolist()} elements; all must "
                    "give the same"
                )
            part = out[i : i + piece.size]
            part[:] = slots[0, : piece.size]
            for r in range(1, self.world):
                part += slots[r, : piece.size]
        return out.reshape(x.shape)

    def all_gather(self, x: np.ndarray, max_cols: int) -> np.ndarray:
        """(R, C_r) from each rank, C_r <= max_cols -> (R, sum C_r), the ranks' columns side by
        side; in pieces of rows that fit a slot (the same on every rank: max_cols decides)."""
        rows, pieces = x.shape[0], []
        step = max(self.slot_floats // max(max_cols, 1), 1)
        for i in range(0, max(rows, 1), step):
            piece = np.ascontiguousarray(x[i : i + step])
            n = piece.shape[0]
            slots, counts = self._exchange(piece)
            if n and (counts % n).any():
                raise ValueError(f"ShmComm.all_gather: ranks gave {counts.tolist()} elements")
            cols = [slots[r, : counts[r]].reshape(n, -1) for r in range(self.world)]
            pieces.append(np.concatenate(cols, axis=1))
        return np.concatenate(pieces, axis=0)
