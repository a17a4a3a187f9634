"""Which float32 products the cpu backend runs, chosen by timing them on this machine, and how
every other format's products compare with NumPy's.

A float32 matrix can be kept two ways, and which is faster depends on the CPU, the build and
the shape: in panels for the project's own kernel (``cpu_src/matmul_panels.cpp``, no packing
per call), or plain (K, N) for OpenBLAS's sgemm and sgemv on the kernels' threads
(``cpu_src/matmul.cpp``). At load the backend times both on each of the model's matrix shapes,
and NumPy's own product (what ``--backend numpy`` runs) beside them, at ROWS rows (one
decode, a few, a batch), and keeps for each shape the layout whose times over the other's
have a geometric mean at most 1. A matrix kept in another format (bf16, int8, a GGUF block
format) has one kernel per instruction set: it is timed beside NumPy's float32 product of the
same shape. ``auto`` compares the chosen products with NumPy's and takes the numpy backend
where the cpu backend's were slower.

Timed once per (CPU, kernel build, threads, shape) on the model's own matrices: a few hundred
milliseconds for TinyLlama's, then read back from a JSON file beside the kernels' build (a shape
whose native products timed slower than NumPy's is not written: a busy machine's timings are
not kept for good, and the next start times it again).
In: {shape: a (K, N) float32 matrix of that shape} (or a kept matrix and its float32 values);
out: {shape: Choice}.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from ctypes import byref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backends.cpu_native import cpu_flags, cpuinfo, library, threads
from engine.backends.quant import to_panels

log = logging.getLogger("engine.backend")

ROWS = (1, 8, 64)  # rows of x the products are timed at
CANDIDATES = ("panels", "plain", "numpy")
MIN_SECONDS = 0.002  # each timing repeats the product until it has run this long, then takes
REPEATS = 3  # the best of this many such runs

_lock = threading.Lock()


@dataclass(frozen=True)
class Choice:
    """A shape's layout ('panels' or 'plain') and the seconds each candidate took per row
    count: times[candidate][i] at ROWS[i] rows."""

    layout: str
    times: dict

    def ratio(self, a: str, b: str) -> float:
        """The geometric mean over ROWS of candidate a's time over b's."""
        ta, tb = self.times[a], self.times[b]
        if math.inf in ta or math.inf in tb:  # a layout the shape cannot have (panels)
            return math.inf if math.inf in ta else 0.0
        return math.exp(sum(math.log(x / y) for x, y in zip(ta, tb, strict=True)) / len(ta))


def _seconds(product) -> float:
    """The best time of one call of product(), over REPEATS runs of at least MIN_SECONDS."""
    product()  # warm: caches, pages, the threads
    best = math.inf
    for _ in range(REPEATS):
        n, t0 = 0, time.perf_counter()
        while True:
            product()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= MIN_SECONDS:
                break
        best = min(best, elapsed / n)
    return best


def _native_seconds(x: np.ndarray, w) -> float:
    """The best of REPEATS native timings of x @ w (cpu_src/decode_layers.cpp: matmul_seconds,
    no ctypes call per product, as the decode step runs them), each at least MIN_SECONDS."""
    from engine.backends import cpu_ops

    m, k = x.shape
    n = w.shape[1]
    out = np.empty((m, n), np.float32)  # (M, N)
    args = (cpu_ops._p(out), cpu_ops._p(x), byref(cpu_ops.matrix(w)), m, k, n)
    once = library().matmul_seconds(*args, 1, threads())
    reps = max(1, int(MIN_SECONDS / max(once, 1e-7)))
    return min(library().matmul_seconds(*args, reps, threads()) for _ in range(REPEATS))


def _time_rows(w: np.ndarray, native: dict) -> dict:
    """{name: [seconds at each of ROWS]} for x @ each of ``native``'s matrices timed natively
    (inf for None), and "numpy": NumPy's product with w, the same values in float32
    (fast_ops.matmul, what the numpy backend runs), timed from Python."""
    from engine.backends import fast_ops

    rng = np.random.default_rng(0)
    times = {name: [] for name in [*native, "numpy"]}
    for m in ROWS:
        x = rng.standard_normal((m, w.shape[0]), dtype=np.float32)  # (m, K)
        for name, kept in native.items():
            times[name].append(math.inf if kept is None else _native_seconds(x, kept))
        times["numpy"].append(_seconds(lambda x=x: fast_ops.matmul(x, w)))
    return times


def time_shape(w: np.ndarray) -> dict:
    """{candidate: [seconds at each of ROWS]} for x @ w, w a (K, N) float32 matrix: the cpu
    backend's two layouts timed natively (panels: inf where N is not whole panels), NumPy's
    product from Python, as each backend runs them."""
    panels = to_panels(w) if w.shape[1] % 16 == 0 else None
    return _time_rows(w, {"panels": panels, "plain": w})


def cache_file() -> Path:
    """The measurements' file: one per loaded kernel build (sources, flags, CPU) and thread
    count, beside it."""
    lib = Path(library()._name)
    key = f"{lib.name} {cpu_model()} {threads()} {os.environ.get('OPENBLAS_NUM_THREADS', '')}"
    digest = hashlib.sha256((key + cpu_flags()).encode()).hexdigest()[:16]
    return lib.parent / f"products-{digest}.json"


def cpu_model() -> str:
    return cpuinfo("model name", "CPU part") or "unknown"


def _measured(keys: dict, timer) -> dict:
    """{key: what timer(key's value) gave}, from the cache file where it has the key (timed
    and added to it otherwise)."""
    path = cache_file()
    with _lock:
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        missing = [k for k in keys if k not in saved]
        if missing:
            timed = {}
            t0 = time.perf_counter()
            for k in missing:
                timed[k] = timer(keys[k])
            log.debug(
                "timed the products of %d matrix shape(s) on this CPU in %.2f s (kept in %s)",
                len(missing),
                time.perf_counter() - t0,
                path,
            )
            # a shape whose native products timed slower than NumPy's is not kept: it is
            # timed again next time, so a measurement disturbed by a busy machine (the native
            # threads waiting for cores: whole milliseconds per product) is not kept for good
            kept = {k: t for k, t in timed.items() if _native_ratio(t) <= 1.0}
            if kept:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({**saved, **kept}, indent=1))
                os.replace(tmp, path)
            saved |= timed  # this start uses every measurement, kept or not
    return {k: saved[k] for k in keys}


def _native_ratio(times: dict) -> float:
    """The fastest native candidate's time over NumPy's (geometric mean over ROWS)."""
    c = Choice("plain", times)
    return min(c.ratio(name, "numpy") for name in times if name != "numpy")


def choose(matrices: dict) -> dict:
    """{(K, N): a float32 matrix of that shape} -> {(K, N): Choice of panels or plain}."""
    keys = {f"{k}x{n}": (k, n) for k, n in matrices}
    times = _measured({key: matrices[s] for key, s in keys.items()}, time_shape)
    return {s: _choice(times[key]) for key, s in keys.items()}


def time_kept(pair) -> dict:
    """{'kept': [...], 'numpy': [...]} at ROWS rows: a matrix kept in another format (bf16,
    int8, a block format: a QuantWeight) timed natively, and NumPy's float32 product of the
    same shape, what the numpy backend would run."""
    kept, w = pair
    return _time_rows(np.asarray(w, np.float32), {"kept": kept})  # w: a view, maybe 16-bit


def measure_kept(kept, w: np.ndarray) -> Choice:
    """The Choice (layout: the kept format) for a matrix kept as `kept`, w its values (float32,
    or a 16-bit view widened only when the shape is timed)."""
    key = f"{kept.kind} {w.shape[0]}x{w.shape[1]}"
    return Choice(kept.kind, _measured({key: (kept, w)}, time_kept)[key])


def _choice(times: dict) -> Choice:
    c = Choice("plain", times)
    return Choice("panels" if c.ratio("panels", "plain") <= 1.0 else "plain", times)


def summary(choices: dict) -> tuple[str, float]:
    """A line saying which layout each shape got and how it compares, and the chosen products'
    time over NumPy's (geometric mean over shapes and ROWS)."""
    parts, logs = [], []
    for (k, n), c in sorted(choices.items()):
        vs_numpy = c.ratio("kept" if "kept" in c.times else c.layout, "numpy")
        if "kept" in c.times:
            parts.append(f"{k}x{n} {c.layout} (time {vs_numpy:.2f}x numpy's)")
        else:
            other = "plain" if c.layout == "panels" else "panels"
            vs_other = c.ratio(c.layout, other)
            ratios = f"time {vs_other:.2f}x {other}'s, {vs_numpy:.2f}x numpy's"
            if vs_other == 0.0:  # the other cannot hold this shape (N not whole panels)
                ratios = f"no {other} for this shape, time {vs_numpy:.2f}x numpy's"
            parts.append(f"{k}x{n} {c.layout} ({ratios})")
        logs.append(math.log(vs_numpy))
    return "; ".join(parts), math.exp(sum(logs) / len(logs))
