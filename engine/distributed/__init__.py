"""Several ranks for one model on one host: tensor and pipeline parallel, a worker process per
rank, on the numpy backend.

sharding.py     which layers (stage), heads, MLP units and vocabulary rows each rank holds
comm.py         the shared-memory all-reduce and all-gather between the ranks of a stage
rank_numpy.py   one rank of the NumPy backend: the same forward over its cut
executor.py     the ranks behind the engine's Backend interface; the ``mp`` executor (forked
                worker processes)
ray_executor.py the ``ray`` executor (Ray actors in a placement group)
"""

from __future__ import annotations

from ..backends import resolve_backend_name


def executor_backend(model_config, weights, config):
    """The backend of an engine whose executor is ``mp`` or ``ray`` (the numpy backend's
    ranks, as worker processes or Ray actors)."""
    name = resolve_backend_name(config.backend)
    if name != "numpy":
        raise ValueError(
            f"tensor and pipeline parallel run on the numpy backend only; backend auto picked "
            f"{name}"
        )
    if config.distributed_executor_backend == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor(model_config, weights, config)
    from .executor import MultiprocExecutor

    return MultiprocExecutor(model_config, weights, config)
