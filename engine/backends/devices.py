"""Where the device backend runs: a GPU through CuPy, or the host with the same code.

A device hands ``CupyBackend`` everything that differs between the two:

    xp             the array module (numpy or cupy)
    kernels        ``engine.kernels.Kernels`` over ``cpu_module`` or ``cupy.RawModule``
    gemm           ``out = x @ w.T`` (``engine.gemm``)
    upload, download, zeros, pinned_empty, copy_to, synchronize
    active()       a context in which the device's work runs (its CUDA stream made current)
    capture(fn)    a "graph" of ``fn``: a CUDA graph on the GPU, ``fn`` itself on the host
    measure_peak   peak device memory of a call (GPU only)

``CpuDevice`` is what the CPU tests run; only ``CupyDevice`` needs a GPU, and it imports CuPy
when it is built, so importing this module never needs one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque

import numpy as np

from engine.gemm import cupy_gemm, numpy_gemm
from engine.kernels import (
    Kernels,
    build_all_cpu,
    cpu_kernels,
    entry_points,
    include_options,
    kernel_names,
    read_source,
)

log = logging.getLogger("engine.backend")

# What CuPy's NVRTC path appends to a RawModule's options (cupy/cuda/compiler.py), besides the
# -arch=sm_XX of the device; the compile check in the tests adds the same.
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def rawmodule_options() -> tuple[str, ...]:
    """The options ``cupy.RawModule`` compiles every cuda_src file with."""
    return ("-std=c++17", *include_options())


def gpu_count() -> int:
    """CUDA devices CuPy can see; 0 without CuPy, a driver or a device."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver (CUDARuntimeError), no libcuda: no GPU
        return 0


def raw_view(a):
    """The same bytes as unsigned integers of the same width (plain data movement, any dtype)."""
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class CpuDevice:
    """NumPy arrays, the kernels' CPU builds, the NumPy gemm; graphs are plain calls."""

    name = "cpu (CUDA emulation)"
    is_gpu = False
    xp = np

    def __init__(self):
        self.kernels = cpu_kernels()
        self.gemm = numpy_gemm

    def compile_kernels(self) -> None:
        build_all_cpu()

    def active(self):
        return contextlib.nullcontext()

    def upload(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, order="C")  # a private copy, as a device upload is

    def download(self, a: np.ndarray) -> np.ndarray:
        return np.array(a)

    def zeros(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def copy_to(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def synchronize(self) -> None:
        pass

    def total_memory_bytes(self) -> int:
        return host_memory_bytes()

    def capture(self, fn):
        """No graphs on the host: "replay" calls ``fn`` again (the padding logic still runs)."""
        return fn

    def graph_pool_bytes(self) -> int:
        return 0

    def measure_peak(self, fn) -> int | None:
        return None


class CupyDevice:
    """One GPU: CuPy arrays on a private non-blocking stream, NVRTC kernels, cuBLAS, graphs."""

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
        self.kernels = Kernels(self._load)
        self.gemm = cupy_gemm
        self._modules: dict[str, object] = {}
        self._graph_pool = cupy.cuda.MemoryPool()

    def _load(self, name: str):
        if name not in self._modules:
            source = read_source(name)
            self._modules[name] = self.xp.RawModule(code=source, options=rawmodule_options())
        return self._modules[name]

    def compile_kernels(self) -> None:
        """Compile every kernel now (CuPy caches the cubins on disk across runs)."""
        for name in kernel_names():
            module = self._load(name)
            for entry in entry_points(read_source(name)):
                module.get_function(entry)

    def active(self):
        """``with device.active():`` makes this device's stream the current one."""
        return self.stream

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

    def synchronize(self) -> None:
        self.stream.synchronize()

    def total_memory_bytes(self) -> int:
        return int(self.xp.cuda.runtime.memGetInfo()[1])

    def capture(self, fn):
        """A CUDA graph of ``fn``'s launches on the device's stream; calling it replays it.

        ``fn``'s temporaries come from a pool kept for graphs. A warm-up run (module loads,
        cuBLAS set-up) records its allocations, all kept alive; the capture, which asks for the
        same sizes in the same order, is handed those very blocks back, so nothing is allocated
        while capturing and no block is reused within one graph. Afterwards the blocks return to
        the graph pool: graphs replay one at a time on one stream, so later captures share them;
        only each graph's output array stays its own."""
        blocks = BlockReplay(self._graph_pool.malloc)
        with self.stream:
            with self.xp.cuda.using_allocator(blocks.record):
                fn()
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                with self.xp.cuda.using_allocator(blocks.replay):
                    out = fn()
            finally:
                graph = self.stream.end_capture()
            blocks.release()
            graph.upload(self.stream)
        if blocks.unmatched:
            log.warning("graph capture allocated %d blocks the warm-up did not", blocks.unmatched)
        return _Replay(graph, out, self.stream)

    def graph_pool_bytes(self) -> int:
        return int(self._graph_pool.total_bytes())

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


class BlockReplay:
    """A warm-up's allocations, handed back in the same order to the capture that follows.

    ``record`` allocates and keeps each block alive; ``replay`` returns the recorded block when
    the next size asked for is the recorded one (else allocates anew and counts it).
    """

    def __init__(self, malloc):
        self.malloc = malloc
        self.blocks: deque = deque()  # (size, block) in allocation order
        self.unmatched = 0

    def record(self, size: int):
        block = self.malloc(size)
        self.blocks.append((size, block))
        return block

    def replay(self, size: int):
        if self.blocks and self.blocks[0][0] == size:
            return self.blocks.popleft()[1]
        self.unmatched += 1
        return self.malloc(size)

    def release(self) -> None:
        self.blocks.clear()


class _Replay:
    """A captured graph: calling it launches the graph and returns the captured output array."""

    def __init__(self, graph, out, stream):
        self.graph, self.out, self.stream = graph, out, stream

    def __call__(self):
        self.graph.launch(self.stream)
        return self.out
