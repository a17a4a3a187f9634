"""How many KV-cache blocks fit: the memory budget minus weights and activations, per block.

``num_kv_blocks(config, backend)`` asks the backend for its sizes (``bytes_per_block``,
``weights_bytes``, ``profile_peak_bytes``, and on a GPU ``total_memory_bytes``), does the
arithmetic, logs it, and returns (device-pool blocks, CPU swap blocks). The engine allocates
exactly that many.
"""

from __future__ import annotations

import logging
import os

from .config import EngineConfig
from .utils import cdiv, mib

log = logging.getLogger("engine")

HOST_BACKENDS = ("numpy", "cuda-cpu")  # their "GPU" pool is host memory


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_kv_blocks(cfg: EngineConfig, backend) -> tuple[int, int]:
    """(GPU-pool blocks, CPU swap blocks) from the memory budget; logs the arithmetic.

    A pool too small for one ``max_model_len`` sequence is a ValueError saying what it needs."""
    per_block = backend.bytes_per_block
    budget, source = memory_budget(cfg, backend)
    weights = backend.weights_bytes
    peak = backend.profile_peak_bytes(
        cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs
    )
    fit = max((budget - weights - peak) // per_block, 0)
    num_blocks = cfg.num_gpu_blocks or fit
    # no swap with prefix caching (EngineConfig refuses it): no CPU pool either
    num_cpu_blocks = 0 if cfg.enable_prefix_caching else cfg.swap_space_bytes // per_block
    override = f" (overridden: num_gpu_blocks={num_blocks})" if cfg.num_gpu_blocks else ""
    log.info(
        "memory budget %s (%s) - weights %s - activation peak %s (profile: %d tokens) = %s "
        "for the KV cache; %s per block of %d tokens -> %d blocks%s",
        mib(budget),
        source,
        mib(weights),
        mib(peak),
        cfg.max_num_batched_tokens,
        mib(budget - weights - peak),
        mib(per_block),
        cfg.block_size,
        fit,
        override,
    )
    where = "host memory" if backend.name in HOST_BACKENDS else "device memory"
    log.info(
        "# GPU blocks: %d, # CPU blocks: %d  (the 'GPU' pool is %s on the %s backend; "
        "CPU blocks = swap_space %s GiB / block)",
        num_blocks,
        num_cpu_blocks,
        where,
        backend.name,
        cfg.swap_space,
    )
    _check_fits(cfg, num_blocks, per_block)
    return num_blocks, num_cpu_blocks


def memory_budget(cfg: EngineConfig, backend) -> tuple[int, str]:
    """(bytes the engine may use, where that number comes from)."""
    if cfg.memory_budget_bytes:
        return cfg.memory_budget_bytes, "explicit"
    on_device = backend.name == "cuda"
    total = backend.total_memory_bytes() if on_device else available_ram_bytes()
    memory = "GPU memory" if on_device else "available RAM"
    return int(cfg.gpu_memory_utilization * total), f"{cfg.gpu_memory_utilization:.2f} x {memory}"


def _check_fits(cfg: EngineConfig, num_blocks: int, per_block: int) -> None:
    need = cdiv(cfg.max_model_len, cfg.block_size)
    if num_blocks < need:
        raise ValueError(
            f"KV cache too small: one sequence of max_model_len={cfg.max_model_len} tokens "
            f"needs {need} blocks ({mib(need * per_block)}), the pool has {num_blocks} "
            f"({mib(num_blocks * per_block)}); give more memory or lower max_model_len"
        )
