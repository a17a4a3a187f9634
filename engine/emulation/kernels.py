"""Run the CPU builds of the kernels (``build.compile_cpu``), called exactly like CuPy's.

``cpu_module(name)`` loads cuda_src/<name>.cu's library with ctypes, as a ``CpuModule`` used
like ``cupy.RawModule``; its ``get_function(entry)`` is a ``CpuKernel`` called like
``cupy.RawKernel``: ``kernel(grid, block, args, shared_mem=...)``, arrays and numpy scalars of
the parameter's exact type (np.int32, np.float32, ...), checked against the signature the
library reports. ``set_thread_order`` orders each block's threads (and the blocks) to expose
missing barriers.

Counting builds (``cpu_module(name, counting=True)``) count the bytes each launch loads from
and stores to each array argument (cuda_src/cpu/emu_traffic.h); ``memory_traffic()`` collects
them::

    with memory_traffic() as t:
        counting_kernels().rms_norm(out, x, weight, 1e-5)
    t.read(x), t.written(out)  # bytes
"""

from __future__ import annotations

import ctypes
import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.kernels.build import (
    KernelBuildError,
    asan_enabled,
    compile_cpu,
    compile_cpu_source,
    normalize_defines,
)
from engine.kernels.launch import Kernels

ORDERS = ("forward", "reversed", "shuffled")


class KernelLaunchError(RuntimeError):
    """The CPU emulator stopped a launch (deadlock, divergent barrier, bad warp op, ...)."""


_SCALARS = {"i": np.int32, "u": np.uint32, "l": np.int64, "L": np.uint64}
_SCALARS |= {"f": np.float32, "d": np.float64}
_CTYPES = {"i": ctypes.c_int32, "u": ctypes.c_uint32, "l": ctypes.c_int64}
_CTYPES |= {"L": ctypes.c_uint64, "f": ctypes.c_float, "d": ctypes.c_double}
COUNTING = ("reads", "writes")  # the two counting builds (build.COUNTING_KINDS)
_lock = threading.Lock()
_order = {"order": 0, "seed": 1}


@dataclass
class Traffic:
    """Global memory traffic of the counting launches made inside ``memory_traffic()``: for
    each launch, its kernel's name and (begin, end, read, written) per argument range (array
    arguments that overlap are merged into one range)."""

    launches: list[tuple[str, list[tuple[int, int, int, int]]]] = field(default_factory=list)

    def _sum(self, a, column: int) -> int:
        lo = a.ctypes.data
        hi = lo + a.nbytes
        rows = (r for _, ranges in self.launches for r in ranges)
        return sum(r[column] for r in rows if r[0] < hi and lo < r[1])

    def read(self, a: np.ndarray) -> int:
        """Bytes loaded from argument ranges that overlap ``a``, over every launch."""
        return self._sum(a, 2)

    def written(self, a: np.ndarray) -> int:
        """Bytes stored to argument ranges that overlap ``a``, over every launch."""
        return self._sum(a, 3)


_traffic: list[Traffic] = []  # the innermost memory_traffic() is the last


@contextmanager
def memory_traffic():
    """Collect the traffic of every counting launch made inside the block."""
    t = Traffic()
    _traffic.append(t)
    try:
        yield t
    finally:
        _traffic.remove(t)


def merged_ranges(arrays) -> list[tuple[int, int]]:
    """The address ranges of ``arrays`` (empty ones dropped), overlapping ones merged, sorted."""
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.nbytes)
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo < out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def set_thread_order(order: str, seed: int = 1) -> None:
    """Run each block's threads (and the blocks) 'forward', 'reversed' or 'shuffled'."""
    if order not in ORDERS:
        raise ValueError(f"thread order must be one of {ORDERS}, got {order!r}")
    _order.update(order=ORDERS.index(order), seed=seed)


def thread_order() -> str:
    return ORDERS[_order["order"]]


def _dims(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int | np.integer) else tuple(d)
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


class CpuKernel:
    """One kernel of a CPU build, called like ``cupy.RawKernel``."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        self.name = name
        self._launch = getattr(lib, f"emu_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_void_p)]
        sig = getattr(lib, f"emu_signature_{name}")
        sig.restype = ctypes.c_char_p
        self.signature = sig().decode()
        self._lib = lib
        self._counting = hasattr(lib, "emu_traffic_set")  # a counting build

    def _pack(self, args) -> tuple[list, ctypes.Array]:
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name}: {len(self.signature)} arguments, got {len(args)}")
        values = []
        for i, (code, a) in enumerate(zip(self.signature, args, strict=True)):
            if code == "p":
                if not isinstance(a, np.ndarray):
                    raise TypeError(f"{self.name}: argument {i} must be an ndarray")
                values.append(ctypes.c_void_p(a.ctypes.data))
            elif type(a) is not _SCALARS[code]:
                want = _SCALARS[code].__name__
                raise TypeError(f"{self.name}: argument {i} must be np.{want}, got {type(a)}")
            else:
                values.append(_CTYPES[code](a.item()))
        ptrs = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )
        return values, ptrs

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        self.run(grid, block, args, shared_mem)

    def run(self, grid, block, args, shared_mem: int = 0) -> list[tuple[int, int, int, int]]:
        """Launch; in a counting build, return (begin, end, read, written) per argument range."""
        values, ptrs = self._pack(args)
        cfg = (ctypes.c_uint * 7)(*_dims(grid), *_dims(block), int(shared_mem))
        with _lock:
            self._lib.emu_set_order(_order["order"], ctypes.c_uint64(_order["seed"]))
            ranges = self._count_ranges(args) if self._counting else []
            rc = self._launch(cfg, ptrs)
            if rc != 0:
                raise KernelLaunchError(f"{self.name}: {self._lib.emu_last_error().decode()}")
            rows = self._collect(ranges) if self._counting else []
        del values
        return rows

    def _count_ranges(self, args) -> list[tuple[int, int]]:
        ranges = merged_ranges(a for a in args if isinstance(a, np.ndarray))
        n = len(ranges)
        lo = (ctypes.c_uint64 * max(n, 1))(*(r[0] for r in ranges))
        hi = (ctypes.c_uint64 * max(n, 1))(*(r[1] for r in ranges))
        if self._lib.emu_traffic_set(ctypes.c_int(n), lo, hi) != 0:
            raise KernelLaunchError(f"{self.name}: too many array arguments to count ({n})")
        return ranges

    def _collect(self, ranges) -> list[tuple[int, int, int, int]]:
        n = max(len(ranges), 1)
        read, written = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)()
        self._lib.emu_traffic_get(read, written)
        return [(lo, hi, read[i], written[i]) for i, (lo, hi) in enumerate(ranges)]


class CountingKernel:
    """One kernel of the two counting builds: a launch runs the loads-counting build, puts every
    array argument's bytes back, then runs the stores-counting build (whose results stay), and
    adds the launch's traffic to every open ``memory_traffic()``."""

    def __init__(self, reads: CpuKernel, writes: CpuKernel):
        self.name, self.signature = reads.name, reads.signature
        self._reads, self._writes = reads, writes

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        ranges = merged_ranges(a for a in args if isinstance(a, np.ndarray))
        saved = [ctypes.string_at(lo, hi - lo) for lo, hi in ranges]
        loads = self._reads.run(grid, block, args, shared_mem)
        for (lo, hi), data in zip(ranges, saved, strict=True):
            ctypes.memmove(lo, data, hi - lo)
        stores = self._writes.run(grid, block, args, shared_mem)
        rows = [(r[0], r[1], r[2], w[3]) for r, w in zip(loads, stores, strict=True)]
        for t in _traffic:
            t.launches.append((self.name, rows))


class CpuModule:
    """A CPU build of one .cu file, used like ``cupy.RawModule``."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            hint = (
                " (ASan builds need the env of kernels.asan_env())" if "asan" in path.name else ""
            )
            raise KernelBuildError(f"cannot load {path}: {exc}{hint}") from exc
        self._lib.emu_last_error.restype = ctypes.c_char_p
        self._lib.emu_set_order.argtypes = [ctypes.c_int, ctypes.c_uint64]
        self._kernels: dict[str, CpuKernel] = {}

    def get_function(self, name: str) -> CpuKernel:
        if name not in self._kernels:
            self._kernels[name] = CpuKernel(self._lib, name)
        return self._kernels[name]


class CountingModule:
    """The loads- and stores-counting builds of one source, used like ``cupy.RawModule``."""

    def __init__(self, reads: CpuModule, writes: CpuModule):
        self._reads, self._writes = reads, writes

    def get_function(self, name: str) -> CountingKernel:
        return CountingKernel(self._reads.get_function(name), self._writes.get_function(name))


_cpu_modules: dict[tuple, CpuModule | CountingModule] = {}


def cpu_module(name: str, defines=None, counting: bool = False) -> CpuModule | CountingModule:
    """The (cached) CPU build of cuda_src/<name>.cu with ``defines`` (e.g. {"HEAD_DIM": 64});
    ASan when PAGEDLLM_EMU_ASAN=1; with ``counting``, the builds that count global memory
    traffic (see ``memory_traffic``)."""
    defs = normalize_defines(name, defines)
    key = (name, asan_enabled() and not counting, counting, defs)
    if key not in _cpu_modules:
        if counting:
            builds = (CpuModule(compile_cpu(name, False, kind, defs)) for kind in COUNTING)
            _cpu_modules[key] = CountingModule(*builds)
        else:
            _cpu_modules[key] = CpuModule(compile_cpu(name, key[1], None, defs))
    return _cpu_modules[key]


def cpu_module_from_source(
    source: str, tag: str = "snippet", counting: bool = False
) -> CpuModule | CountingModule:
    """A CPU build of kernel source text (tests of the emulator); kernels found as in .cu files."""
    if counting:
        return CountingModule(*(CpuModule(compile_cpu_source(source, tag, k)) for k in COUNTING))
    return CpuModule(compile_cpu_source(source, tag))


_cpu_kernels: Kernels | None = None


def cpu_kernels() -> Kernels:
    """The checked launches over the CPU builds."""
    global _cpu_kernels
    if _cpu_kernels is None:
        _cpu_kernels = Kernels(cpu_module)
    return _cpu_kernels


_counting_kernels: Kernels | None = None


def counting_kernels() -> Kernels:
    """The checked launches over the counting CPU builds: use inside ``memory_traffic()``."""
    global _counting_kernels
    if _counting_kernels is None:
        _counting_kernels = Kernels(functools.partial(cpu_module, counting=True))
    return _counting_kernels
