"""Backends: one interface (``NumpyBackend``'s), several ways to run the ops underneath.

numpy     NumPy on the host (ops: ``fast_ops``, the vectorised twin of ``numpy_ops``)
cuda-cpu  the CUDA kernels' C++ emulation on the host (ops: ``cuda_cpu_ops``)
cuda      the CUDA kernels on a GPU (not available yet)
auto      numpy for now
"""

from __future__ import annotations

import logging

from .numpy_backend import NumpyBackend

log = logging.getLogger("engine.backend")

BACKENDS = ("auto", "numpy", "cuda", "cuda-cpu")


def resolve_backend_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        log.info("backend auto -> numpy (the CUDA backend is not available yet)")
        return "numpy"
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
    raise ValueError("backend 'cuda' is not available yet; use --backend numpy or cuda-cpu")
