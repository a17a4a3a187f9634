"""Several ranks for one model: tensor and pipeline parallel on the numpy backend, tensor parallel
on the GPU backend, a worker process or Ray actor per rank.

``configured_backend``: the engine's backend, in this process or as its ranks.

sharding.py     which layers (stage), heads, MLP units and vocabulary rows each rank holds
rank_numpy.py   one rank of the NumPy backend: the same forward over its cut, collectives over
                engine/devices/comm.py
rank_cupy.py    one rank of the GPU backend: CupyBackend over its cut, collectives over NCCL
                (engine/devices/nccl.py, or engine/emulation/nccl.py)
executor.py     the ranks behind the engine's Backend interface; the ``mp`` executor (forked
                worker processes)
ray_executor.py the ``ray`` executor (Ray actors in a placement group)
"""

from __future__ import annotations

from engine.backends import get_backend, resolve_backend_name


def configured_backend(model_config, weights, config):
    """The engine's backend: in this process, or (executor ``mp`` or ``ray``) its ranks'."""
    if config.distributed_executor_backend in ("mp", "ray"):
        return executor_backend(model_config, weights, config)
    return get_backend(config.backend, model_config, weights, config)


def executor_backend(model_config, weights, config):
    """The backend of an engine whose executor is ``mp`` or ``ray``: ranks of the numpy backend
    (tensor and pipeline parallel), or of the GPU backend (``cuda``, ``cuda-cpu``: tensor
    parallel over NCCL), as worker processes or Ray actors."""
    name = resolve_backend_name(config.backend)
    if name == "cpu":  # its ranks are the numpy backend's
        if config.backend != "auto":
            raise ValueError(
                "the cpu backend runs one rank; tensor and pipeline parallel ranks run on the "
                "numpy backend (--backend numpy)"
            )
        name = "numpy"
    if name != "numpy" and config.pipeline_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size {config.pipeline_parallel_size} runs on the numpy backend "
            f"only; the {name} backend's ranks split by tensor parallel alone"
        )
    if config.distributed_executor_backend == "ray":
        from engine.executor.ray_executor import RayExecutor

        return RayExecutor(model_config, weights, config, name)
    from engine.executor.executor import MultiprocExecutor

    return MultiprocExecutor(model_config, weights, config, name)
