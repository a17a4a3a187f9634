"""The checks of ``EngineConfig``'s fields, one function per group of options (types, ranges,
choices, parallel ranks, KV tiers, pooling, LoRA), each a ValueError naming the field; the
choices and bounds they check against."""

from __future__ import annotations

import json
import math

PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's names
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # -> the canonical name the engine sees
BACKENDS = ("auto", "cpu", "numpy", "cuda", "cuda-cpu")
EXECUTORS = ("uni", "mp", "ray")
QUANTIZATIONS = ("int8", "q8_0", "q4_0", "q4_1", "q4_k_m", "q5_k_m", "q6_k", "q5_0")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's: fp8 is e4m3
HOST_ONLY_BACKENDS = ("auto", "cpu", "numpy")  # where --quantization, --kv-cache-dtype run
DEFAULT_BATCHED_TOKENS = 2048  # vLLM's default token budget per step
DEFAULT_SWAP_GIB = 4  # vLLM's swap_space, used when preemption_mode is swap
DEFAULT_KV_DISK_GIB = 16  # the disk tier's bound when only kv_cache_dir is given
# sane upper bounds: past them a value is a typo, not a configuration
MAX_BLOCK_SIZE = 1024
MAX_NUM_SEQS = 1 << 16
MAX_TOKENS = 1 << 24  # max_model_len, max_num_batched_tokens
MAX_BLOCKS = (1 << 31) - 1  # block ids are int32
MAX_BUDGET_BYTES = 1 << 50
MAX_SWAP_GIB = 1024
UPPER_BOUNDS = {
    "block_size": MAX_BLOCK_SIZE,
    "max_num_seqs": MAX_NUM_SEQS,
    "max_num_batched_tokens": MAX_TOKENS,
    "max_model_len": MAX_TOKENS,
    "num_gpu_blocks": MAX_BLOCKS,
    "memory_budget_bytes": MAX_BUDGET_BYTES,
}
OPTIONAL_COUNTS = (
    "max_num_batched_tokens",
    "max_model_len",
    "num_gpu_blocks",
    "memory_budget_bytes",
)


def bad(name: str, value, expected: str) -> ValueError:
    return ValueError(f"EngineConfig: {name} must be {expected}, got {value!r}")


def check_count(name: str, value, top: int, optional: bool) -> None:
    """An integer in [1, top] (or None when optional), else a ValueError naming the field."""
    if optional and value is None:
        return
    if not is_int(value) or not 1 <= value <= top:
        raise bad(name, value, f"an integer in [1, {top}]" + (" or None" if optional else ""))


def is_int(value) -> bool:
    """A real int (bool is not one here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or float (bool is not one here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_types(cfg) -> None:
    """The model string, the switches and the seed."""
    if not isinstance(cfg.model, str):
        raise bad("model", cfg.model, "a string")
    bools = (
        "enable_lora",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "enforce_eager",
        "async_scheduling",
        "engine_core_process",
    )
    for name in bools:
        if not isinstance(getattr(cfg, name), bool):
            raise bad(name, getattr(cfg, name), "True or False")
    if not is_int(cfg.seed):
        raise bad("seed", cfg.seed, "an integer")


def check_ranges(cfg) -> None:
    """Counts and sizes within their bounds."""
    for name, top in UPPER_BOUNDS.items():
        check_count(name, getattr(cfg, name), top, optional=name in OPTIONAL_COUNTS)
    util = cfg.gpu_memory_utilization
    if not is_number(util) or not 0 < util <= 1:
        raise bad("gpu_memory_utilization", util, "in (0, 1]")
    swap = cfg.swap_space
    finite = is_number(swap) and math.isfinite(swap)
    if swap is not None and not (finite and 0 <= swap <= MAX_SWAP_GIB):
        raise bad("swap_space", swap, f"a number of GiB in [0, {MAX_SWAP_GIB}] or None")


def check_choices(cfg) -> None:
    """Named choices among their values; vLLM's aliases become the canonical names."""
    for name, choices in (
        ("preemption_mode", PREEMPTION_MODES),
        ("dtype", DTYPES),
        ("backend", BACKENDS),
        ("kv_cache_dtype", KV_CACHE_DTYPES),
    ):
        if getattr(cfg, name) not in choices:
            raise bad(name, getattr(cfg, name), "one of " + ", ".join(choices))
    cfg.dtype = DTYPE_ALIASES.get(cfg.dtype, cfg.dtype)
    cfg.kv_cache_dtype = KV_CACHE_ALIASES.get(cfg.kv_cache_dtype, cfg.kv_cache_dtype)
    q = cfg.quantization
    if q is not None and q not in QUANTIZATIONS:
        raise bad("quantization", q, "None or one of " + ", ".join(QUANTIZATIONS))


def check_parallel(cfg) -> None:
    """The parallel sizes and their executor; what is not built is refused by name."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        n = getattr(cfg, name)
        if not is_int(n) or not 1 <= n <= 8:
            raise bad(name, n, "an integer in [1, 8]")
    ranks = cfg.world_size
    if ranks > 8:
        raise ValueError(
            f"EngineConfig: tensor_parallel_size x pipeline_parallel_size is {ranks} ranks, "
            "more than 8"
        )
    ex = cfg.distributed_executor_backend
    if ex is not None and ex not in EXECUTORS:
        raise bad("distributed_executor_backend", ex, "one of " + ", ".join(EXECUTORS))
    dp = cfg.data_parallel_size
    if not is_int(dp) or not 1 <= dp <= 64:
        raise bad("data_parallel_size", dp, "an integer in [1, 64]")
    if cfg.ray_address is not None and ex != "ray" and dp == 1:
        raise ValueError(
            "EngineConfig: ray_address needs distributed_executor_backend 'ray' or "
            "data_parallel_size above 1"
        )
    if ex is None:
        cfg.distributed_executor_backend = "uni" if ranks == 1 else "mp"
    elif ex == "uni" and ranks > 1:
        raise ValueError(
            f"EngineConfig: distributed_executor_backend 'uni' runs one rank; "
            f"{ranks} ranks (tensor x pipeline parallel) need 'mp'"
        )
    if cfg.pipeline_parallel_size > 1 and cfg.backend not in ("auto", "numpy"):
        raise ValueError(
            f"EngineConfig: pipeline parallel runs on the numpy backend only; the "
            f"{cfg.backend} backend's ranks split by tensor parallel alone"
        )
    why = host_only_refusal(cfg, cfg.backend, ranks)
    if why:
        raise ValueError(why)
    draft = cfg.speculative is not None and cfg.speculative.method == "draft_model"
    if ranks > 1 and draft:
        raise ValueError(
            "EngineConfig: speculative decoding with a draft model is not implemented under "
            "tensor or pipeline parallel (the ngram method is)"
        )


def check_tiers(cfg) -> None:
    """The KV tiers: sizes in range, under the prefix cache."""
    off, disk, where = cfg.kv_offload_bytes, cfg.kv_disk_bytes, cfg.kv_cache_dir
    if not is_int(off) or not 0 <= off <= MAX_BUDGET_BYTES:
        raise bad("kv_offload_bytes", off, f"an integer in [0, {MAX_BUDGET_BYTES}]")
    if where is not None and (not isinstance(where, str) or not where):
        raise bad("kv_cache_dir", where, "a directory's path or None")
    if disk is not None and (not is_int(disk) or not 1 <= disk <= MAX_BUDGET_BYTES):
        raise bad("kv_disk_bytes", disk, f"an integer in [1, {MAX_BUDGET_BYTES}] or None")
    if disk is not None and where is None:
        raise ValueError("EngineConfig: kv_disk_bytes bounds kv_cache_dir, which is not set")
    if not (off or where):
        return
    asked = "kv_offload_bytes" if off else "kv_cache_dir"
    if not cfg.enable_prefix_caching:
        raise ValueError(
            f"EngineConfig: {asked} is a tier under the prefix cache; it needs "
            "enable_prefix_caching=True"
        )


def check_pooling(cfg) -> dict:
    """pooler_config as a dict (checked); what the pooling runner does not do, refused."""
    conf = {}
    if cfg.pooler_config is not None:
        try:
            conf = json.loads(cfg.pooler_config)
        except (TypeError, ValueError) as e:
            raise bad("pooler_config", cfg.pooler_config, f"a JSON object ({e})") from None
        if not isinstance(conf, dict):
            raise bad("pooler_config", cfg.pooler_config, "a JSON object")
        keys = {"pooling_type", "normalize", "dimensions", "default_prompt_name"}
        unknown = sorted(set(conf) - keys)
        if unknown:
            raise ValueError(f"EngineConfig: pooler_config: unknown key {unknown[0]!r}")
        from engine.pooling_params import PoolingParams

        name = conf.get("default_prompt_name")
        if name is not None and not isinstance(name, str):
            raise bad("pooler_config", cfg.pooler_config, "default_prompt_name a string")
        try:
            PoolingParams(**{k: v for k, v in conf.items() if k != "default_prompt_name"})
        except ValueError as e:
            raise ValueError(f"EngineConfig: pooler_config: {e}") from None
    if cfg.runner != "pooling":
        if cfg.pooler_config is not None:
            raise ValueError("EngineConfig: pooler_config needs runner='pooling'")
        return conf
    refused = [  # both work on decode steps, and a pooling engine runs none
        ("speculative_config", cfg.speculative is not None, "drafts generated tokens"),
        ("async_scheduling", cfg.async_scheduling, "overlaps decode steps"),
    ]
    for name, on, what in refused:
        if on:
            raise ValueError(
                f"EngineConfig: {name}: it {what}, and runner='pooling' generates none"
            )
    return conf


def check_lora(cfg) -> None:
    """The LoRA sizes in range; what is not built refused by name."""
    for name, top in (("max_loras", 64), ("max_lora_rank", 512)):
        n = getattr(cfg, name)
        if not is_int(n) or not 1 <= n <= top:
            raise bad(name, n, f"an integer in [1, {top}]")
    cpu = cfg.max_cpu_loras
    if cpu is not None and (not is_int(cpu) or not cfg.max_loras <= cpu <= 1024):
        raise bad("max_cpu_loras", cpu, "None or an integer in [max_loras, 1024]")
    if not cfg.enable_lora:
        return
    if cfg.speculative is not None and cfg.speculative.method == "draft_model":
        raise ValueError(
            "EngineConfig: enable_lora with a draft model is not implemented (the ngram "
            "method works with adapters)"
        )


def host_only_refusal(config, backend: str, world_size: int = 1) -> str | None:
    """Why the options only the host backends build (``--quantization``, a ``--kv-cache-dtype``
    other than auto) cannot run on this backend (a resolved name, or auto) and this many ranks,
    in one line; None where they can."""
    asked = []
    if getattr(config, "quantization", None) is not None:
        asked.append((f"--quantization {config.quantization}", f"{config.quantization} kernels"))
    kv = getattr(config, "kv_cache_dtype", "auto")
    if kv != "auto":
        asked.append((f"--kv-cache-dtype {kv}", "cache dtype apart from --dtype"))
    for flag, what in asked:
        if backend not in HOST_ONLY_BACKENDS:
            return (
                f"{flag} runs on the cpu and numpy backends (the {backend} backend has no {what})"
            )
        if world_size > 1:
            return (
                f"{flag} runs on one rank; tensor_parallel_size x pipeline_parallel_size is "
                f"{world_size}"
            )
    return None
