"""The ``cuda-cpu`` backend's device: the host as a GPU, with the same code as ``CupyDevice``.

NumPy memory, the kernels' CPU builds (``engine.emulation.kernels``), cuBLAS emulated on raw
memory and CUDA's, cuBLAS's and CuPy's capture rules enforced (``engine.emulation.runtime``), the
emulated NCCL between processes (``engine.emulation.nccl``): every CPU run checks what would stop
a GPU.
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

from engine.devices.device import (
    BlockReplay,
    CaptureAllocationError,
    Device,
    PendingDownload,
    host_memory_bytes,
    raw_view,
)
from engine.emulation import runtime as emulated
from engine.emulation.kernels import cpu_module
from engine.kernels import Kernels, build_all_cpu
from engine.kernels.cublas import WORKSPACE_BYTES, Cublas
from engine.kernels.gemm import Gemm


class EmulatedDevice(Device):
    """The host as a GPU: NumPy memory, the kernels' CPU builds, emulated cuBLAS, and CUDA's,
    cuBLAS's and CuPy's capture rules (``engine.emulation.runtime``). A graph replay runs the
    captured function again over the capture's very blocks and checks that it launches exactly
    what was captured (same kernels, same addresses, same scalars), as a real graph would."""

    name = "cpu (CUDA emulation)"
    is_gpu = False
    xp = np
    graph_batch_limit = 8  # each capture runs the step twice through the emulated kernels
    profiles_memory = False  # a profile forward through the emulated kernels takes minutes

    def __init__(self):
        self.stream = emulated.EmuStream()
        self.kernels = Kernels(self._load, self.empty)
        self._cublas_lib = emulated.EmulatedCublas()
        self._cublas_workspace = np.empty(WORKSPACE_BYTES, np.uint8)
        self.cublas = Cublas(
            self._cublas_lib, self.stream.ptr, self.ptr(self._cublas_workspace), WORKSPACE_BYTES
        )
        self.gemm = Gemm(self.cublas, self.ptr)
        self.cupy_cublas = emulated.EmulatedCupyCublas(self._cublas_lib)
        self._malloc = self._fresh
        self._graph_blocks: list[np.ndarray] = []
        self.live = self.peak = 0  # bytes of device memory held (measure_peak)

    @staticmethod
    def ptr(a: np.ndarray) -> int:
        return a.ctypes.data

    @property
    def nccl(self):
        """The emulated NCCL (``engine.emulation.nccl``): NCCL's rules, between processes."""
        from engine.emulation.nccl import EMULATED_NCCL

        return EMULATED_NCCL

    def cupy_cublas_handle(self) -> int:
        return self.cupy_cublas.handle

    def _load(self, name: str, defines=()):
        return emulated.LoggedModule(cpu_module(name, defines), self.stream)

    def compile_kernels(self, defines: dict | None = None) -> None:
        build_all_cpu(defines=defines)

    # ---- memory ----
    def _fresh(self, size: int) -> np.ndarray:
        """A new block of device memory; while capturing, only through ``capture`` (this
        engine's rule: CUDA's relaxed mode would allow it, but the graph could then keep a
        block that is freed and reused after capture)."""
        if self.stream.is_capturing():
            raise CaptureAllocationError(
                f"{size} bytes of device memory asked for while the stream captures, outside "
                "Device.capture's warm-up blocks"
            )
        block = np.empty(size, np.uint8)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(block, self._freed, size)
        return block

    def _freed(self, size: int) -> None:
        self.live -= size

    def empty(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        return self._malloc(size)[:size].view(dtype).reshape(shape)

    def zeros(self, shape, dtype) -> np.ndarray:
        a = self.empty(shape, dtype)
        a.reshape(-1).view(np.uint8).fill(0)  # a memset: allowed while capturing
        return a

    def upload(self, a: np.ndarray) -> np.ndarray:
        """A private copy in device memory (an H2D copy: refused while capturing, as CuPy)."""
        self._no_transfer("H2D")
        a = np.ascontiguousarray(a)
        out = self.empty(a.shape, a.dtype)
        out.reshape(-1).view(np.uint8)[...] = a.reshape(-1).view(np.uint8)
        return out

    def download(self, a: np.ndarray) -> np.ndarray:
        self._no_transfer("D2H")
        return np.array(a)

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def copy_to(self, dst: np.ndarray, src: np.ndarray) -> None:
        self._no_transfer("H2D")
        np.copyto(raw_view(dst), raw_view(src))

    def download_async(self, a: np.ndarray) -> PendingDownload:
        """The emulated stream has run everything queued: the copy is done at once."""
        return PendingDownload(self.download(a), None)

    def _no_transfer(self, kind: str) -> None:
        if self.stream.is_capturing():  # CuPy's check in copy_{from,to}_host_async
            raise RuntimeError(
                f"the current stream is capturing, so {kind} transfers are disallowed"
            )

    def synchronize(self) -> None:
        self.stream.synchronize()

    def total_memory_bytes(self) -> int:
        return host_memory_bytes()

    def measure_peak(self, fn) -> int:
        """Peak device bytes held while ``fn`` runs, beyond what was held before."""
        before, self.peak = self.live, self.live
        fn()
        return self.peak - before

    # ---- graphs ----
    def _graph_malloc(self, size: int) -> np.ndarray:
        block = np.empty(size, np.uint8)
        self._graph_blocks.append(block)
        return block

    @contextlib.contextmanager
    def _allocating(self, malloc):
        saved, self._malloc = self._malloc, malloc
        try:
            yield
        finally:
            self._malloc = saved

    def _graph(self, launches, fn, out, handed):
        return _EmulatedReplay(self, fn, out, launches, handed)

    def graph_pool_bytes(self) -> int:
        return sum(b.nbytes for b in self._graph_blocks)

    def release_graph_pool(self) -> None:
        self._graph_blocks.clear()


class _EmulatedReplay:
    """A "graph" on the emulated device: the captured function run again, under the capture
    rules, over the blocks the capture was handed, and its launches compared to the capture's."""

    def __init__(self, device: EmulatedDevice, fn, out, launches: list, handed: list):
        self.device, self.fn, self.out = device, fn, out
        self.launches, self.handed = launches, handed

    def __call__(self):
        dev, stream = self.device, self.device.stream
        blocks = BlockReplay(None, self.handed)
        stream.status, stream.log = "replaying", []
        try:
            with dev._allocating(blocks.replay):
                out = self.fn()
        finally:
            stream.status = None
        if stream.log != self.launches:
            pairs = zip(stream.log, self.launches, strict=False)
            i = next((i for i, (a, b) in enumerate(pairs) if a != b), len(self.launches))
            raise RuntimeError(
                f"graph replay differs from its capture at launch {i}: the captured function "
                "must launch the same kernels on the same memory with the same scalars each time"
            )
        assert out.ctypes.data == self.out.ctypes.data, "a graph's output is fixed at capture"
        return self.out
