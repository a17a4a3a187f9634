"""Several ranks for one model: tensor parallel on the host, one worker process per rank.

sharding.py   which heads, MLP units and vocabulary rows each rank holds, and its weights
comm.py       the shared-memory all-reduce and all-gather between the ranks of one host
tp_numpy.py   one rank of the NumPy backend: the same forward, three collectives
executor.py   the ``mp`` executor: the worker processes behind the engine's Backend interface
"""

from __future__ import annotations

from ..backends import resolve_backend_name


def tensor_parallel_backend(model_config, weights, config):
    """The backend of an engine with tensor_parallel_size > 1 (the numpy backend's ranks)."""
    name = resolve_backend_name(config.backend)
    if name != "numpy":
        raise ValueError(
            f"tensor_parallel_size > 1 runs on the numpy backend only; backend auto picked {name}"
        )
    from .executor import MultiprocTensorParallel

    return MultiprocTensorParallel(model_config, weights, config)
