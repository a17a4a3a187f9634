"""Backends: one interface (``NumpyBackend``'s), several ways to run the ops underneath.

numpy     NumPy on the host (ops: ``fast_ops``, the vectorised twin of ``numpy_ops``)
cuda-cpu  the CUDA kernels' C++ emulation on the host (ops: ``cuda_cpu_ops``)
cuda      the CUDA kernels on a GPU through CuPy (``CupyBackend``)
auto      cuda when CuPy sees a GPU, else numpy
"""

from __future__ import annotations

import logging

from ..config import BACKENDS
from .numpy_backend import NumpyBackend

log = logging.getLogger("engine.backend")


def resolve_backend_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        from .devices import gpu_count

        n = gpu_count()
        picked = "cuda" if n else "numpy"
        why = f"CuPy sees {n} GPU(s)" if n else "CuPy sees no GPU"
        log.info("backend auto -> %s (%s)", picked, why)
        return picked
    return name


def get_backend(name: str, model_config, weights, engine_config):
    """Build the backend called ``name`` for this model (ValueError for an unknown name)."""
    name = resolve_backend_name(name)
    if name == "numpy":
        return NumpyBackend(model_config, weights, engine_config)
    if name == "cuda-cpu":
        from . import cuda_cpu_ops  # lazy: compiles the CPU emulation of the kernels

        backend = NumpyBackend(model_config, weights, engine_config, ops=cuda_cpu_ops)
        backend.name = "cuda-cpu"
        return backend
    from .cupy_backend import cuda_backend  # lazy: imports CuPy

    return cuda_backend(model_config, weights, engine_config)
