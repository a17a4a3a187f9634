"""The native kernels of another architecture's build, called from this Python: cpu_src/ and
kernel_driver.cpp cross-compiled for aarch64 (Debian's g++-aarch64-linux-gnu) and run under
qemu-user behind a pipe. ``RemoteLibrary`` stands where ``cpu_native.library()`` stands, with
the argument types ``cpu_native._declare`` gives each kernel: a pointer argument arrives as the
array itself (the caller's ``cpu_ops._p`` made the identity), is sent whole, and is updated
in place from the bytes the kernel left."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
import struct
import subprocess
import time
from pathlib import Path

import numpy as np

from engine.backends import cpu_native
from engine.kernels.build import REPO, build_dir

CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
DRIVER = Path(__file__).with_name("kernel_driver.cpp")
log = logging.getLogger("tests.native")
FLAGS = ["-O2", "-fno-trapping-math", "-fopenmp", "-std=c++17", "-Wall",
         "-Werror", "-Wno-psabi"]  # fmt: skip


def available() -> str | None:
    """None, or what is missing to build and run the aarch64 kernels here."""
    for tool in (CXX, QEMU):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install g++-aarch64-linux-gnu qemu-user)"
    return None


# build name -> -march: the baseline (NEON, no dot products), and ARMv8.2 with them (vdotq_s32)
MARCH = {"aarch64": "armv8-a", "aarch64-dotprod": "armv8.2-a+dotprod"}


def build(name: str = "aarch64") -> Path:
    """The driver and every kernel, built for an aarch64 target once per source change (each
    file on its own, one compiler a core)."""
    sources = [*sorted((REPO / "cpu_src").glob("*.cpp")), DRIVER]
    flags = [*FLAGS, f"-march={MARCH[name]}"]
    h = hashlib.sha256(" ".join(flags).encode())
    for f in [*sources, *sorted((REPO / "cpu_src").glob("*.h"))]:
        h.update(f.name.encode() + f.read_bytes())
    out = build_dir() / "native" / f"kernel_driver-{name}-{h.hexdigest()[:16]}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info("building the %s kernels and driver (%s) -> %s", name, CXX, out)
        t0 = time.perf_counter()
        jobs = cpu_native.available_cores()
        cpu_native.compile_and_link(sources, flags, out, jobs, CXX)
        log.info("built the %s kernels and driver in %.1f s", name, time.perf_counter() - t0)
    return out


class _Signature:
    """What cpu_native._declare says of one kernel."""

    def __init__(self):
        self.argtypes, self.restype = [], None


class _Signatures:
    def __init__(self):
        self.kernels = {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "matmul_init":  # the driver brings its own BLAS
            return lambda *args: None
        return self.kernels.setdefault(name, _Signature())


class RemoteLibrary:
    """The aarch64 kernels under qemu: lib.<kernel>(*args) as ctypes would call them."""

    def __init__(self, name: str = "aarch64"):
        sigs = _Signatures()
        cpu_native._declare(sigs)
        self._sigs = sigs.kernels
        self._proc = subprocess.Popen(
            [QEMU, "-L", SYSROOT, str(build(name))], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        sig = self._sigs[name]
        return lambda *args: self._call(name, sig, args)

    def _call(self, name, sig, args):
        arrays, ints, floats = [], [], []
        for t, a in zip(sig.argtypes, args, strict=True):
            if t is ctypes.c_void_p:
                arrays.append(a)
            elif t is ctypes.c_float:
                floats.append(float(a))
            else:
                ints.append(int(a))
        msg = [struct.pack("<I", len(name)), name.encode(), struct.pack("<I", len(arrays))]
        for a in arrays:
            if a is None:
                msg.append(struct.pack("<q", -1))
            else:
                assert isinstance(a, np.ndarray) and a.flags.c_contiguous, name
                msg += [struct.pack("<q", a.nbytes), a.tobytes()]
        msg += [struct.pack(f"<I{len(ints)}q", len(ints), *ints)]
        msg += [struct.pack(f"<I{len(floats)}f", len(floats), *floats)]
        self._proc.stdin.write(b"".join(msg))
        self._proc.stdin.flush()
        (status,) = struct.unpack("<q", self._read(8))
        if status == -1000:
            raise NotImplementedError(f"kernel_driver.cpp does not call {name}")
        for a in arrays:
            if a is not None:
                got = np.frombuffer(self._read(a.nbytes), np.uint8)
                mine = a.reshape(-1).view(np.uint8)
                if not np.array_equal(got, mine):
                    mine[:] = got
        return status if sig.restype is not None else None

    def _read(self, n: int) -> bytes:
        data = self._proc.stdout.read(n)
        if len(data) != n:
            raise RuntimeError(f"the aarch64 kernel driver stopped (exit {self._proc.poll()})")
        return data


BUILDS = ("native", "x86-64-v3", "generic", "aarch64")  # what the kernel tests run on


def load(name: str):
    """The kernels of one build, as cpu_native.library() gives them: this machine's own
    (native), another x86-64 target built and loaded here, or the aarch64 build under qemu
    (a RemoteLibrary). Raises LookupError with the reason where this machine cannot run it."""
    if name in MARCH:
        missing = available()
        if missing:
            raise LookupError(missing)
        return RemoteLibrary(name)
    try:
        path = cpu_native.library_path(name)
    except ValueError as e:  # this CPU cannot run the target
        raise LookupError(str(e)) from e
    lib = ctypes.CDLL(str(path))
    cpu_native._declare(lib)
    return lib


if __name__ == "__main__":  # make test's setup: the aarch64 builds ahead, where they can be
    missing = available()
    for name in MARCH:
        if missing:
            print(f"not built: the {name} kernels ({missing})")
            continue
        print(f"building the {name} kernels (-march={MARCH[name]}) ...", end=" ", flush=True)
        t0 = time.perf_counter()
        build(name)
        print(f"{time.perf_counter() - t0:.0f} s", flush=True)
