"""NCCL on the emulated device: ``cupy.cuda.nccl``'s calls between the ranks' host processes.

The ranks of one communicator meet in a shared-memory block (``comm.ShmComm``) named after
their unique id: the first rank makes it, the others open it once it has its size. A collective
reads its send buffer at the pointer it is given (device memory is host memory here), and
writes the result at the receive pointer, as NCCL's kernels would. Sums are float32, in rank
order, rounded once to the data's type, so every rank gets the same bits.

What NCCL requires and does not check (a rank that breaks it hangs the others or corrupts
memory on a GPU) is checked here, on every rank at once, each as an ``EmuNcclError``:

- every rank calls the same collectives in the same order, each with the same count, data
  type and operation (each rank writes its call beside its data; the ranks compare them);
- ``groupEnd`` matches a ``groupStart``; the collectives of a group are carried out at its
  ``groupEnd``, not before (a caller that reads a result inside the group reads stale memory,
  as it would on a GPU);
- while a stream captures a CUDA graph, a collective goes to that stream (else it would run
  once, now, outside the graph), and a group whose collectives went to a capturing stream
  ends before that capture does; a communicator is made and destroyed outside any capture;
- an in-place all-gather sends from the receive buffer's own slice; other overlaps are refused.

A collective on a stream that captures or replays is logged there like a kernel launch, so an
emulated graph's replay is checked to make the same collectives on the same memory. A rank
that waits more than ``timeout`` seconds for the others raises (the others died or diverged).
"""

from __future__ import annotations

import ctypes
import os
import time

import ml_dtypes
import numpy as np

from engine.devices.comm import ShmComm
from engine.devices.nccl import NCCL_BFLOAT16, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_SUM, TYPE_NAMES
from engine.emulation import runtime as emulated

DTYPES = {NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32, NCCL_BFLOAT16: ml_dtypes.bfloat16}
SLOT_BYTES = 1 << 20  # each rank's slot in the shared block; larger calls go in pieces
INIT, ALL_REDUCE, ALL_GATHER = 1, 2, 3
KINDS = {INIT: "init", ALL_REDUCE: "allReduce", ALL_GATHER: "allGather"}


class EmuNcclError(RuntimeError):
    """A broken NCCL rule, or what CuPy raises for a failed NCCL call (its NcclError)."""


def _memory(ptr: int, dtype, count: int) -> np.ndarray:
    """The ``count`` elements of ``dtype`` at device pointer ``ptr`` (host memory here)."""
    dtype = np.dtype(dtype)
    if count == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype)


def _describe(meta) -> str:
    seq, kind, count, dtype, op = (int(v) for v in meta[:5])
    if kind == INIT:
        return f"init of {count} ranks"
    what = f"{KINDS.get(kind, kind)}(count={count}, {TYPE_NAMES.get(dtype, dtype)}"
    return f"call {seq}: {what}{', sum' if kind == ALL_REDUCE and op == NCCL_SUM else ''})"


def _capturing() -> emulated.EmuStream | None:
    capturing = [s for s in emulated._current if s.is_capturing()]
    return capturing[-1] if capturing else None


def block_name(commId) -> str:
    """The shared-memory block an emulated communicator of this unique id lives in."""
    return "emunccl-" + bytes(np.asarray(commId, np.int8).view(np.uint8)[:12]).hex()


def remove_block(commId) -> None:
    """Remove the block of this unique id if it is still there: its first rank removes it when
    it destroys the communicator, but a rank that is killed (a Ray actor at shutdown) cannot."""
    try:
        from _posixshmem import shm_unlink  # what SharedMemory.unlink calls, without a tracker

        shm_unlink("/" + block_name(commId))
    except FileNotFoundError:
        pass


class EmulatedNcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)`` on the emulated device."""

    def __init__(self, ndev: int, commId, rank: int, lib: EmulatedNccl):
        if not 0 <= rank < ndev:
            raise EmuNcclError(f"ncclInvalidArgument: rank {rank} of a communicator of {ndev}")
        if _capturing() is not None:
            raise EmuNcclError("ncclCommInitRank while a stream captures a CUDA graph")
        self.lib, self.ndev, self.rank = lib, ndev, rank
        self.shm = self._open(block_name(commId), ndev, rank, lib.timeout)
        self.seq = 0
        try:
            self._check(np.zeros(1, np.float32), INIT, ndev, 0, 0)  # every rank has joined
        except EmuNcclError:
            self.shm.close()  # the first rank's block is removed
            raise

    @staticmethod
    def _open(name: str, ndev: int, rank: int, timeout: float) -> ShmComm:
        if rank == 0:
            comm = ShmComm(ndev, SLOT_BYTES, timeout, name=name).attach(0)
            comm._owner = True  # the first rank removes the block when it destroys its comm
            return comm
        deadline = time.monotonic() + timeout
        while True:
            try:
                return ShmComm.join(name, ndev, SLOT_BYTES, timeout).attach(rank)
            except (FileNotFoundError, ValueError):
                # not there yet, or there and still empty ("cannot mmap an empty file": rank 0
                # has made the block and not yet given it its size)
                if time.monotonic() > deadline:
                    raise EmuNcclError(
                        f"ncclCommInitRank: rank 0 did not make the communicator in {timeout:g} s"
                    ) from None
                time.sleep(0.005)
            except TypeError:  # the block is too small for this rank's views: another ndev
                raise EmuNcclError(
                    f"ncclCommInitRank: rank {rank} was given {ndev} ranks, rank 0 another count"
                ) from None

    # ---- cupy.cuda.nccl.NcclCommunicator's calls ----
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream):
        if op != NCCL_SUM:
            raise EmuNcclError(f"the emulated NCCL reduces by sum only, got op {op}")
        self._issue(("ncclAllReduce", sendbuf, recvbuf, count, datatype, op), stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream):
        size = count * np.dtype(DTYPES[datatype]).itemsize
        in_place = sendbuf == recvbuf + self.rank * size
        overlaps = sendbuf < recvbuf + self.ndev * size and recvbuf < sendbuf + size
        if overlaps and not in_place:
            raise EmuNcclError(
                "ncclAllGather: the send buffer overlaps the receive buffer other than as its "
                "own rank's slice (in place)"
            )
        self._issue(("ncclAllGather", sendbuf, recvbuf, count, datatype, 0), stream)

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.ndev

    def destroy(self) -> None:
        if _capturing() is not None:
            raise EmuNcclError("ncclCommDestroy while a stream captures a CUDA graph")
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    # ---- carrying calls out ----
    def _issue(self, call: tuple, stream_ptr: int) -> None:
        if self.shm is None:
            raise EmuNcclError("ncclInvalidArgument: the communicator was destroyed")
        if call[4] not in DTYPES:
            raise EmuNcclError(f"ncclInvalidArgument: data type {call[4]}")
        capturing = _capturing()
        if capturing is not None and capturing.ptr != stream_ptr:
            raise emulated.EmuCudaError(
                f"{call[0]} during stream capture on another stream: it would run once now and "
                "not be part of the graph; queue it on the capturing stream"
            )
        if self.lib.depth:
            self.lib.queue.append((self, call, stream_ptr, capturing))
        else:
            self._run(call, stream_ptr)

    def _run(self, call: tuple, stream_ptr: int) -> None:
        name, send, recv, count, datatype, op = call
        stream = emulated._streams.get(stream_ptr)
        if stream is not None:
            stream.record((name, id(self), *call[1:]))
        dtype = DTYPES[datatype]
        kind = ALL_REDUCE if name == "ncclAllReduce" else ALL_GATHER
        data = _memory(send, dtype, count).astype(np.float32)  # exact for every NCCL type here
        out = self._collective(data, kind, count, datatype, op)
        if kind == ALL_REDUCE:
            _memory(recv, dtype, count)[...] = out.astype(dtype)
        else:
            _memory(recv, dtype, count * self.ndev)[...] = out.reshape(-1).astype(dtype)

    def _collective(self, data: np.ndarray, kind: int, count: int, datatype: int, op: int):
        """(count,) sums, or (ndev, count) gathered, in float32; in slot-sized pieces."""
        self.seq += 1
        step = self.shm.slot_floats
        out = np.empty(count if kind == ALL_REDUCE else (self.ndev, count), np.float32)
        for i in range(0, max(count, 1), step):
            piece = data[i : i + step]
            slots = self._check(piece, kind, count, datatype, op)
            n = piece.size
            if kind == ALL_REDUCE:
                out[i : i + n] = slots[0, :n]
                for r in range(1, self.ndev):
                    out[i : i + n] += slots[r, :n]
            else:
                out[:, i : i + n] = slots[:, :n]
        return out

    def _check(self, piece: np.ndarray, kind: int, count: int, datatype: int, op: int):
        """Exchange a piece with every rank, each rank's call beside it; the ranks' slots. Every
        rank raises the same error when the calls differ."""
        meta = (self.seq, kind, count, datatype, op, os.getpid())
        try:
            slots, _ = self.shm._exchange(piece, meta)
        except RuntimeError as exc:
            raise EmuNcclError(f"NCCL rank {self.rank}: {exc}") from None
        calls = self.shm.exchanged_meta[:, :5]  # (ndev, 5)
        if (calls != calls[0]).any():
            said = "; ".join(f"rank {r}: {_describe(c)}" for r, c in enumerate(calls))
            raise EmuNcclError(
                "NCCL rule broken: every rank must make the same collectives in the same order "
                f"with the same count, type and operation ({said})"
            )
        return slots


class EmulatedNccl:
    """``cupy.cuda.nccl`` for the emulated device: one per process (the group state is the
    process's, as NCCL's is its thread's)."""

    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_BFLOAT16, NCCL_SUM = (
        NCCL_FLOAT16,
        NCCL_FLOAT32,
        NCCL_BFLOAT16,
        NCCL_SUM,
    )
    VERSION = 23001  # what it answers get_version() with: NCCL 2.30.1's rules
    available = True

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self.depth = 0
        self.queue: list[tuple] = []  # (communicator, call, stream, capturing then) of a group

    def get_unique_id(self) -> tuple[int, ...]:
        return tuple(np.frombuffer(os.urandom(128), np.int8).tolist())

    def get_version(self) -> int:
        return self.VERSION

    def NcclCommunicator(self, ndev: int, commId, rank: int) -> EmulatedNcclCommunicator:  # noqa: N802
        return EmulatedNcclCommunicator(ndev, commId, rank, self)

    def groupStart(self) -> None:  # noqa: N802
        self.depth += 1

    def groupEnd(self) -> None:  # noqa: N802
        if self.depth == 0:
            raise EmuNcclError("ncclInvalidUsage: ncclGroupEnd without a ncclGroupStart")
        self.depth -= 1
        if self.depth:
            return
        queue, self.queue = self.queue, []
        for comm, call, stream_ptr, captured in queue:
            if captured is not None and not captured.is_capturing():
                raise EmuNcclError(
                    f"ncclGroupEnd after the capture its {call[0]} was queued in had ended: "
                    "the group's collectives are not in the graph; end the group inside the "
                    "capture"
                )
            comm._run(call, stream_ptr)


EMULATED_NCCL = EmulatedNccl()  # this process's (a forked rank starts from a copy, no group open)
