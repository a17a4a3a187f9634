"""Where the GPU backend runs: a GPU through CuPy, or the host, emulated, with the same code.

A device hands ``CupyBackend`` everything that differs between the two:

    xp             the array module (numpy or cupy)
    kernels        ``engine.kernels.Kernels`` over ``cupy.RawModule`` or the kernels' CPU builds
    gemm           ``out = x @ w.T`` through the device's own cuBLAS handle
    (``engine.kernels.gemm``) empty, zeros, upload, download, download_async, pinned_empty,
    copy_to, synchronize active()       a context in which the device's work runs (its stream made
    current) capture(fn)    a CUDA graph of ``fn``; calling the result replays it
    nccl           the NCCL library of tensor-parallel ranks (``cupy.cuda.nccl``, or emulated)
    measure_peak   peak device memory held while a call runs

``CupyDevice`` needs a GPU and imports CuPy when it is built, so importing this module never
needs one. ``EmulatedDevice`` (engine/emulation/device.py) is the ``cuda-cpu`` backend's: the
same interface over NumPy memory and the kernels' CPU builds.

``Device.capture`` is written once for both. Graph memory: a warm-up run records its
allocations, all kept alive; the capture, which asks for the same sizes in the same order, is
handed those very blocks back (``BlockReplay``), so nothing is allocated while capturing and no
block is reused inside one graph. A block the warm-up did not ask for fails the capture (the
engine then runs eager). Afterwards the blocks return to a graph pool: graphs replay one at a
time on one stream, so later captures share them; only each graph's output stays its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque

import numpy as np

from engine.kernels import (
    Kernels,
    define_options,
    define_sets,
    entry_points,
    include_options,
    kernel_names,
    read_source,
)
from engine.kernels.cublas import WORKSPACE_BYTES, Cublas, load_cublas
from engine.kernels.gemm import Gemm

log = logging.getLogger("engine.backend")

# What CuPy's NVRTC path appends to a RawModule's options (cupy/cuda/compiler.py), besides the
# -arch=sm_XX of the device; the compile check in the tests adds the same.
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
REQUIRE_GPU_ENV = "REQUIRE_GPU"


class CaptureAllocationError(RuntimeError):
    """Device memory asked for while a stream captures, outside the warm-up's blocks."""


def rawmodule_options(defines=()) -> tuple[str, ...]:
    """The options ``cupy.RawModule`` compiles a cuda_src file with: ``defines`` (sorted pairs)
    for a file built per set of compile-time constants."""
    return ("-std=c++17", *include_options(), *define_options(defines))


def gpu_status() -> tuple[int, str]:
    """(CUDA devices CuPy can see, why none when 0): no CuPy, no driver, no device."""
    try:
        import cupy

        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # ImportError, CUDARuntimeError, a missing libcuda, ...
        return 0, f"{type(exc).__name__}: {exc}".splitlines()[0]
    return n, "" if n else "CuPy's runtime reports 0 CUDA devices"


def gpu_count() -> int:
    return gpu_status()[0]


class PendingDownload:
    """A device -> host copy in flight: ``wait()`` -> the host array once the copy is done."""

    def __init__(self, host: np.ndarray, event):
        self.host, self.event = host, event  # event: recorded after the copy (None: done)

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


def raw_view(a):
    """The same bytes as unsigned integers of the same width (plain data movement, any dtype)."""
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class BlockReplay:
    """A warm-up's allocations, handed back in the same order to the capture that follows.

    ``record`` allocates and keeps each block alive; ``replay`` returns the recorded block when
    the next size asked for is the recorded one, and raises otherwise; ``handed`` lists what
    the capture got, in order (the emulated device replays a graph over exactly these)."""

    def __init__(self, malloc, blocks=()):
        self.malloc = malloc
        self.blocks: deque = deque(blocks)  # (size, block) in allocation order
        self.handed: list = []

    def record(self, size: int):
        block = self.malloc(size)
        self.blocks.append((size, block))
        return block

    def replay(self, size: int):
        if not self.blocks or self.blocks[0][0] != size:
            want = self.blocks[0][0] if self.blocks else "nothing more"
            raise CaptureAllocationError(
                f"graph capture asked for {size} bytes where the warm-up allocated {want}: the "
                "captured function must allocate the same sizes in the same order every call"
            )
        entry = self.blocks.popleft()
        self.handed.append(entry)
        return entry[1]

    def release(self) -> None:
        self.blocks.clear()


class Device:
    """What both devices share: the graph capture protocol."""

    stream = None
    graph_batch_limit: int | None = None  # the largest decode batch worth a graph (None: all)
    profiles_memory = True  # measure a profile forward's peak (else the computed one alone)

    def capture(self, fn):
        """A graph of ``fn``'s launches on the device's stream; calling it replays it and returns
        the array ``fn`` returned during capture (refreshed by each replay)."""
        blocks = BlockReplay(self._graph_malloc)
        with self.active():
            with self._allocating(blocks.record):
                fn()  # warm-up: module loads, first launches, the blocks recorded
            self.synchronize()
            self.stream.begin_capture()
            try:
                with self._allocating(blocks.replay):
                    out = fn()
            except BaseException:
                with contextlib.suppress(Exception):
                    self.stream.end_capture()
                raise
            graph = self.stream.end_capture()
            blocks.release()
            return self._graph(graph, fn, out, blocks.handed)

    def active(self):
        """``with device.active():`` makes this device's stream the current one."""
        return self.stream


class CupyDevice(Device):
    """One GPU: CuPy arrays on a private non-blocking stream, NVRTC kernels, cuBLAS on a handle
    of our own (bound to that stream, with a fixed workspace), CUDA graphs."""

    is_gpu = True

    def __init__(self, device_id: int = 0):
        import cupy

        self.xp = cupy
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        self.arch = f"sm_{self.device.compute_capability}"
        name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]  # bytes
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.name = f"{name} ({self.arch})"
        # Every launch, copy and cuBLAS call of the backend goes to this stream (graphs cannot
        # capture the legacy stream 0, and a non-blocking stream does not wait for it).
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        sm_count = cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]
        self.kernels = Kernels(self._load, self.empty, sm_count)
        self._modules: dict[tuple, object] = {}
        self._graph_pool = cupy.cuda.MemoryPool()
        with self.stream:
            self._cublas_workspace = cupy.empty(WORKSPACE_BYTES, np.uint8)
        self.cublas = Cublas(
            load_cublas(), self.stream.ptr, self._cublas_workspace.data.ptr, WORKSPACE_BYTES
        )
        self.gemm = Gemm(self.cublas, self.ptr)

    @staticmethod
    def ptr(a) -> int:
        return a.data.ptr

    @property
    def nccl(self):
        """NCCL for tensor parallel (``cupy.cuda.nccl``; a ValueError when CuPy has none)."""
        from engine.devices.nccl import cupy_nccl

        return cupy_nccl()

    @property
    def cupy_cublas(self):
        """CuPy's own cuBLAS module (only the tests call it: it refuses during capture)."""
        from cupy.cuda import cublas

        return cublas

    def cupy_cublas_handle(self) -> int:
        return self.xp.cuda.device.get_cublas_handle()

    def _load(self, name: str, defines=()):
        """cuda_src/<name>.cu as a RawModule, built with ``defines`` (sorted pairs)."""
        key = (name, tuple(defines))
        if key not in self._modules:
            options = rawmodule_options(defines)
            self._modules[key] = self.xp.RawModule(code=read_source(name), options=options)
        return self._modules[key]

    def compile_kernels(self, defines: dict | None = None) -> None:
        """Compile every kernel now (CuPy caches the cubins on disk across runs); a file that
        needs compile-time constants is built with ``defines`` (the model's), else with each
        of its ``define_sets``."""
        for name in kernel_names():
            for defs in define_sets(name, defines):
                module = self._load(name, defs)
                for entry in entry_points(read_source(name)):
                    module.get_function(entry)

    def empty(self, shape, dtype):
        """Uninitialised device memory from the current allocator (a graph's, while capturing)."""
        with self.stream:
            return self.xp.empty(shape, raw_view(np.empty(0, dtype)).dtype).view(dtype)

    def upload(self, a: np.ndarray):
        """A device copy of ``a``, moved as raw bits (no CuPy dtype conversion kernel)."""
        a = np.ascontiguousarray(a)
        with self.stream:
            dev = self.xp.asarray(raw_view(a))
        try:
            return dev.view(a.dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"this CuPy has no {a.dtype} dtype (bfloat16 needs CuPy >= 14 with ml_dtypes); "
                "use dtype float16"
            ) from exc

    def download(self, a) -> np.ndarray:
        """A host copy; waits for the device's stream (the work that wrote ``a``)."""
        return raw_view(a).get(stream=self.stream).view(a.dtype)

    def zeros(self, shape, dtype):
        with self.stream:
            return self.xp.zeros(shape, raw_view(np.empty(0, dtype)).dtype).view(dtype)

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        """Page-locked host memory (asynchronous copies); plain memory when empty."""
        import cupyx

        if int(np.prod(shape)) == 0:
            return np.empty(shape, dtype)
        return cupyx.empty_pinned(shape, dtype)

    def copy_to(self, dst, src: np.ndarray) -> None:
        """Host (pinned) -> device, asynchronous on the stream."""
        raw_view(dst).set(raw_view(src), stream=self.stream)

    def download_async(self, a) -> PendingDownload:
        """Start a copy of the contiguous ``a`` into pinned host memory, behind the work queued
        on the stream so far; ``wait()`` on the result waits for that copy alone."""
        import cupy

        host = self.pinned_empty(a.shape, a.dtype)
        if host.size:
            rt = cupy.cuda.runtime
            rt.memcpyAsync(
                host.ctypes.data, a.data.ptr, a.nbytes, rt.memcpyDeviceToHost, self.stream.ptr
            )
        return PendingDownload(host, self.stream.record())

    def synchronize(self) -> None:
        self.stream.synchronize()

    def total_memory_bytes(self) -> int:
        return int(self.xp.cuda.runtime.memGetInfo()[1])

    def _graph_malloc(self, size: int):
        return self._graph_pool.malloc(size)

    def _allocating(self, malloc):
        return self.xp.cuda.using_allocator(malloc)

    def _graph(self, graph, fn, out, handed):
        graph.upload(self.stream)
        return _Replay(graph, out, self.stream)

    def graph_pool_bytes(self) -> int:
        return int(self._graph_pool.total_bytes())

    def release_graph_pool(self) -> None:
        self._graph_pool.free_all_blocks()

    def measure_peak(self, fn) -> int:
        """Peak bytes held from CuPy's pool while ``fn`` runs (beyond what was held before)."""
        from cupy.cuda import memory_hook

        class Peak(memory_hook.MemoryHook):
            name = "PeakHook"

            def __init__(self):
                self.now = self.peak = 0

            def malloc_postprocess(self, **kw):
                self.now += kw["mem_size"]
                self.peak = max(self.peak, self.now)

            def free_postprocess(self, **kw):
                self.now -= kw["mem_size"]

        hook = Peak()
        with self.stream, hook:
            fn()
            self.stream.synchronize()
        return hook.peak


class _Replay:
    """A captured graph: calling it launches the graph and returns the captured output array."""

    def __init__(self, graph, out, stream):
        self.graph, self.out, self.stream = graph, out, stream

    def __call__(self):
        self.graph.launch(self.stream)
        return self.out
