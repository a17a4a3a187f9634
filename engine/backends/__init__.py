"""Backends: one interface (``base.Backend``), two implementations, three devices.

numpy     ``NumpyBackend``: NumPy on the host (ops: ``fast_ops``), the fast host backend
cuda      ``CupyBackend`` on a GPU through CuPy: the project's kernels, cuBLAS, CUDA graphs
cuda-cpu  ``CupyBackend`` on the emulated device: the same code, the kernels' CPU builds, and
          CUDA's and CuPy's rules checked (``devices.EmulatedDevice``)
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
        backend = NumpyBackend(model_config, weights, engine_config)
    else:
        from .cupy_backend import cuda_backend  # CuPy itself is imported only by a GPU device

        backend = cuda_backend(model_config, weights, engine_config, emulate=name == "cuda-cpu")
    if engine_config.dtype == "auto" and backend.kv_dtype != model_config.torch_dtype:
        log.info(
            "dtype auto -> %s on the %s backend (the checkpoint is %s; NumPy has no fast 16-bit "
            "matrix products)",
            backend.kv_dtype,
            backend.name,
            model_config.torch_dtype,
        )
    return backend
