"""NCCL for the ranks of the GPU backend: one communicator per rank, over its device's stream.

``NcclComm`` is written once over an NCCL library with ``cupy.cuda.nccl``'s interface:

    cupy.cuda.nccl   on GPUs (CuPy's binding of libnccl; the ``nvidia-nccl-cu13`` wheel)
    EmulatedNccl     on the emulated device (``nccl_emu.py``): the same calls between the
                     host processes of the ranks, NCCL's rules enforced

A collective is queued on the device's stream and returns at once, so a CUDA graph captures it
with the kernels around it. The unique id that the ranks of one communicator share is made by
its first rank (``unique_id``) and handed to the others by the executor over its own channel.
"""

from __future__ import annotations

import numpy as np

# ncclDataType_t and ncclRedOp_t (nccl.h)
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_BFLOAT16 = 6, 7, 9
NCCL_SUM = 0
TYPE_NAMES = {NCCL_FLOAT16: "float16", NCCL_FLOAT32: "float32", NCCL_BFLOAT16: "bfloat16"}


def nccl_type(dtype) -> int:
    name = np.dtype(dtype).name
    for code, n in TYPE_NAMES.items():
        if n == name:
            return code
    raise ValueError(f"NCCL: no data type for {name}")


def cupy_nccl():
    """``cupy.cuda.nccl``, or a ValueError saying how to get it."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ValueError(f"tensor parallel on GPUs needs NCCL through CuPy ({exc})") from None
    if not getattr(nccl, "available", True):
        raise ValueError(
            "tensor parallel on GPUs needs NCCL: CuPy finds no libnccl (pip install "
            "nvidia-nccl-cu13)"
        )
    return nccl


def nccl_version(lib) -> str:
    """'2.30.1' from NCCL's version code (2.9 and later: major * 10000 + minor * 100 + patch)."""
    code = int(lib.get_version())
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


class NcclComm:
    """Rank ``rank`` of ``world`` in the communicator of ``uid``; ``device`` gives the stream
    and the device pointers. Its calls: ``all_reduce`` (in place) and ``all_gather``."""

    def __init__(self, lib, world: int, uid, rank: int, device):
        self.lib, self.world, self.rank, self.device = lib, world, rank, device
        self.comm = lib.NcclCommunicator(world, uid, rank)
        self.calls = 0  # collectives queued

    def all_reduce(self, x) -> None:
        """x = the sum of every rank's x (same shape and dtype on every rank), in place."""
        ptr, stream = self.device.ptr(x), self.device.stream.ptr
        self.comm.allReduce(ptr, ptr, x.size, nccl_type(x.dtype), NCCL_SUM, stream)
        self.calls += 1

    def all_gather(self, send, recv) -> None:
        """recv (world, *send.shape) = every rank's send, in rank order."""
        assert recv.shape == (self.world, *send.shape) and recv.dtype == send.dtype
        stream = self.device.stream.ptr
        send_ptr, recv_ptr = self.device.ptr(send), self.device.ptr(recv)
        self.comm.allGather(send_ptr, recv_ptr, send.size, nccl_type(send.dtype), stream)
        self.calls += 1

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
