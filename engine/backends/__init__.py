"""Backends: one interface (``base.Backend``), three implementations, four devices.

cpu       ``CpuBackend``: the NumPy backend's forward with native C++ kernels between its
          matrix products (ops: ``cpu_ops`` over ``cpu_src/``), the fast host backend
numpy     ``NumpyBackend``: NumPy on the host (ops: ``fast_ops``), the plain, readable one
cuda      ``CupyBackend`` on a GPU through CuPy: the project's kernels, cuBLAS, CUDA graphs
cuda-cpu  ``CupyBackend`` on the emulated device: the same code, the kernels' CPU builds, and
          CUDA's and CuPy's rules checked (``devices.EmulatedDevice``)
auto      cuda when CuPy sees a GPU, else cpu (numpy where there is no g++ to build it, or
          where the cpu backend's products measured slower than NumPy's: cpu_tuning)
"""

from __future__ import annotations

import logging

from engine.backends.numpy_backend import NumpyBackend
from engine.config import BACKENDS, host_only_refusal

log = logging.getLogger("engine.backend")


def resolve_backend_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        from engine.backends.cpu_native import compiler_available
        from engine.devices.device import gpu_count

        n = gpu_count()
        if n:
            picked, why = "cuda", f"CuPy sees {n} GPU(s)"
        elif compiler_available():
            picked, why = "cpu", "CuPy sees no GPU"
        else:
            picked, why = "numpy", "CuPy sees no GPU, and there is no g++ for the cpu backend"
        log.info("backend auto -> %s (%s)", picked, why)
        return picked
    return name


def _cpu_backend(model_config, weights, engine_config):
    """The cpu backend; where ``auto`` chose it and it cannot be built, the numpy one."""
    from engine.backends.cpu_backend import CpuBackend
    from engine.backends.cpu_native import NativeBuildError

    try:
        backend = CpuBackend(model_config, weights, engine_config)
    except NativeBuildError as e:
        if engine_config.backend != "auto":
            raise ValueError(str(e).splitlines()[0]) from e
        log.warning("backend auto -> numpy: %s", str(e).splitlines()[0])
        return NumpyBackend(model_config, weights, engine_config)
    slower = backend.products_vs_numpy
    if engine_config.backend == "auto" and slower is not None and slower > 1.0:
        log.warning(
            "backend auto -> numpy: the cpu backend's products measured %.2fx NumPy's on this CPU",
            slower,
        )
        del backend
        return NumpyBackend(model_config, weights, engine_config)
    return backend


def get_backend(name: str, model_config, weights, engine_config):
    """Build the backend called ``name`` for this model (ValueError for an unknown name)."""
    name = resolve_backend_name(name)
    why = host_only_refusal(engine_config, name)  # auto resolved: cuda?
    if why:
        raise ValueError(why)
    if name == "numpy":
        backend = NumpyBackend(model_config, weights, engine_config)
    elif name == "cpu":
        backend = _cpu_backend(model_config, weights, engine_config)
    else:
        from engine.backends.cupy_backend import (
            cuda_backend,  # CuPy itself is imported only by a GPU device
        )

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
