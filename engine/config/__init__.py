"""The engine's configuration: one dataclass, vLLM's names and defaults, checked at construction.

Each field carries its command-line help (and choices); engine/entrypoints/engine_args.py turns
the fields into flags (``--block-size`` -> ``block_size``). Values that depend on
the model (``max_model_len``, the default ``max_num_batched_tokens``) are filled in by
``EngineConfig.resolve(model_config)``, which returns a checked copy.
"""

from engine.config.checks import (
    BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    host_only_refusal,
    is_int,
    is_number,
)
from engine.config.engine_config import EngineConfig, make_config

__all__ = [
    "BACKENDS",
    "KV_CACHE_DTYPES",
    "QUANTIZATIONS",
    "EngineConfig",
    "host_only_refusal",
    "is_int",
    "is_number",
    "make_config",
]
