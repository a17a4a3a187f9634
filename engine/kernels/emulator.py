"""Run the CPU builds of the kernels (``build.compile_cpu``), called exactly like CuPy's.

``cpu_module(name)`` loads cuda_src/<name>.cu's library with ctypes, as a ``CpuModule`` used
like ``cupy.RawModule``; its ``get_function(entry)`` is a ``CpuKernel`` called like
``cupy.RawKernel``: ``kernel(grid, block, args, shared_mem=...)``, arrays and numpy scalars of
the parameter's exact type (np.int32, np.float32, ...), checked against the signature the
library reports. ``set_thread_order`` orders each block's threads (and the blocks) to expose
missing barriers.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

from .build import (
    KernelBuildError,
    asan_enabled,
    compile_cpu,
    compile_cpu_source,
    normalize_defines,
)

ORDERS = ("forward", "reversed", "shuffled")


class KernelLaunchError(RuntimeError):
    """The CPU emulator stopped a launch (deadlock, divergent barrier, bad warp op, ...)."""


_SCALARS = {"i": np.int32, "u": np.uint32, "l": np.int64, "L": np.uint64}
_SCALARS |= {"f": np.float32, "d": np.float64}
_CTYPES = {"i": ctypes.c_int32, "u": ctypes.c_uint32, "l": ctypes.c_int64}
_CTYPES |= {"L": ctypes.c_uint64, "f": ctypes.c_float, "d": ctypes.c_double}
_lock = threading.Lock()
_order = {"order": 0, "seed": 1}


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
        values, ptrs = self._pack(args)
        cfg = (ctypes.c_uint * 7)(*_dims(grid), *_dims(block), int(shared_mem))
        with _lock:
            self._lib.emu_set_order(_order["order"], ctypes.c_uint64(_order["seed"]))
            rc = self._launch(cfg, ptrs)
            if rc != 0:
                raise KernelLaunchError(f"{self.name}: {self._lib.emu_last_error().decode()}")
        del values


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


_cpu_modules: dict[tuple[str, bool, tuple], CpuModule] = {}


def cpu_module(name: str, defines=None) -> CpuModule:
    """The (cached) CPU build of cuda_src/<name>.cu with ``defines`` (e.g. {"HEAD_DIM": 64});
    ASan when PAGEDLLM_EMU_ASAN=1."""
    key = (name, asan_enabled(), normalize_defines(name, defines))
    if key not in _cpu_modules:
        _cpu_modules[key] = CpuModule(compile_cpu(name, key[1], key[2]))
    return _cpu_modules[key]


def cpu_module_from_source(source: str, tag: str = "snippet") -> CpuModule:
    """A CPU build of kernel source text (tests of the emulator); kernels found as in .cu files."""
    return CpuModule(compile_cpu_source(source, tag))
