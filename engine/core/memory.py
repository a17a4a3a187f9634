"""How many KV-cache blocks fit, checked against the memory there is before anything is allocated.

``plan_kv_cache(config, backend)`` asks the backend for its sizes (``bytes_per_block``,
``weights_bytes``, ``profile_peak_bytes``, and on a GPU ``total_memory_bytes``), plans the pools,
logs the arithmetic, and returns it as a ``KVPlan``. The engine allocates exactly that many
blocks and keeps the plan (``LLMEngine.kv_plan``).

With a draft model (speculative decoding) its backend is planned alongside: the draft's pool
holds as many tokens as the target's plus ``num_speculative_tokens`` (and a block) per sequence,
so each target block costs its bytes plus a draft block's; the draft's weights and activation
peak are taken out of the same memory.

On a GPU (``cuda``) the pool is what ``gpu_memory_utilization`` of device memory leaves after the
weights and the activation peak; the swap pool lives in host memory. On the host backends
(``numpy``, ``cuda-cpu``) the pool, the swap pool and the activation peak all come out of host
RAM (the weights are already loaded): the default pool holds ``max_num_seqs x max_model_len``
tokens, capped so that the three together take at most ``HOST_RAM_FRACTION`` of the available
RAM. The host KV tier under the prefix cache (``kv_offload_bytes``) is host memory taken as the
swap pool is. An explicit ``num_gpu_blocks``, ``memory_budget_bytes`` or ``swap_space`` that
does not fit the memory there is is a ValueError naming it, never a MemoryError.

A model whose layers attend differently (KV groups, engine/backends/kv_groups.py) has blocks of
G layers, not L: ``bytes_per_block`` is G layers', a sequence holds each group's blocks
(``seq_blocks`` sums them: a sliding group holds only its window's), and an explicit
``num_gpu_blocks`` (blocks of every layer) becomes num_gpu_blocks x L / G blocks, the same bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.utils import cdiv, mib

log = logging.getLogger("engine")

# their "GPU" pool is host memory
HOST_BACKENDS = ("cpu", "numpy", "numpy-mp", "numpy-ray", "cuda-cpu", "cuda-cpu-mp", "cuda-cpu-ray")
HOST_RAM_FRACTION = 0.5  # of available RAM, for the default host plan: room for other processes
PEAK_FIX = "lower max_num_batched_tokens or max_num_seqs, or give more memory"


def _peak_fix(cfg: EngineConfig) -> str:
    """PEAK_FIX, and where the budget is max_model_len because chunked prefill is off (a
    long-context model's default), the two settings that lower it."""
    if cfg.enable_chunked_prefill or cfg.max_num_batched_tokens != cfg.max_model_len:
        return PEAK_FIX
    return (
        f"without chunked prefill a step takes a whole prompt of max_model_len="
        f"{cfg.max_model_len} tokens: lower max_model_len (--max-model-len) or enable chunked "
        f"prefill (--enable-chunked-prefill), or {PEAK_FIX}"
    )


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_ram_bytes()


def total_ram_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _ram_beside_weights(available: int, weights: int) -> int:
    """The available RAM the host pools may plan on: MemAvailable counts the pages of weights
    mapped from their file (a GGUF's kept blocks, a safetensors file's tensors) as free to
    reclaim, so it is capped at the machine's RAM less the weights; a pool planned on them
    would push the weights out to be read again from the disk at every step."""
    beside = max(0, total_ram_bytes() - weights)
    if beside < available:
        log.info(
            "the weights (%s) are mapped from their file and count as available RAM: the "
            "pools plan on the RAM beside them, %s of the available %s",
            mib(weights),
            mib(beside),
            mib(available),
        )
    return min(available, beside)


@dataclass(frozen=True)
class KVPlan:
    """The startup arithmetic: how many blocks of how many bytes, out of which memory."""

    block_size: int  # tokens per block
    bytes_per_block: int  # K and V of block_size tokens, every layer
    num_blocks: int  # the (GPU) pool
    num_cpu_blocks: int  # the swap pool
    weights_bytes: int
    peak_bytes: int  # the activation peak of the largest step
    swap_bytes: int
    room_bytes: int  # what the pool may take: the memory left after weights, peak and swap
    room: str  # where room_bytes comes from
    why: str  # why num_blocks is what it is
    num_draft_blocks: int = 0  # the draft model's pool (speculative decoding), else 0

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


@dataclass(frozen=True)
class _DraftSizes:
    """What a draft model adds to the plan."""

    per_block: int = 0  # draft bytes for each target block
    lookahead_blocks: int = 0  # draft blocks beyond the target's count
    fixed: int = 0  # lookahead blocks + the draft's activation peak
    weights: int = 0


def _draft_sizes(cfg: EngineConfig, draft) -> _DraftSizes:
    if draft is None:
        return _DraftSizes()
    k = cfg.speculative.num_speculative_tokens
    lookahead = cfg.max_num_seqs * (cdiv(k, cfg.block_size) + 1)
    peak = _activation_peak(cfg, draft)
    sizes = _DraftSizes(draft.bytes_per_block, lookahead, lookahead * draft.bytes_per_block + peak)
    sizes = dataclasses.replace(sizes, weights=draft.weights_bytes)
    log.info(
        "draft model: weights %s, %s per KV block (one per target block, plus %d lookahead "
        "blocks = %s), activation peak %s: counted in the plan below",
        mib(sizes.weights),
        mib(sizes.per_block),
        lookahead,
        mib(lookahead * sizes.per_block),
        mib(peak),
    )
    return sizes


def seq_blocks(cfg: EngineConfig, windows: tuple[int, ...] = (0,)) -> int:
    """The most blocks one sequence holds at once, summed over the KV groups (``windows``: each
    group's sliding window, 0: full attention): those of max_model_len tokens, or with a
    sliding window those of the window before a step (one more, block-aligned) and of the
    step's tokens (the engine gives back the blocks before)."""
    full = cdiv(cfg.max_model_len, cfg.block_size)
    step = min(cfg.max_num_batched_tokens, cfg.max_model_len)
    return sum(min(full, cdiv(w - 1 + step, cfg.block_size) + 1) if w else full for w in windows)


def plan_kv_cache(cfg: EngineConfig, backend, draft=None, groups=None) -> KVPlan:
    """The pools (GPU blocks, CPU swap blocks, and with a ``draft`` backend its blocks),
    checked to fit; logs the arithmetic. ``groups``: the model's KVGroups (None: one group of
    full attention), whose windows bound the blocks a sequence holds (``seq_blocks``).

    A pool too small for one ``max_model_len`` sequence, or a plan larger than the memory there
    is, is a ValueError naming the field to change."""
    d = _draft_sizes(cfg, draft)
    windows = (0,) if groups is None else groups.windows
    cfg = _grouped_blocks(cfg, groups)
    per_block = backend.bytes_per_block
    # no swap with prefix caching (EngineConfig refuses it): no CPU pool either
    num_cpu_blocks = 0 if cfg.enable_prefix_caching else cfg.swap_space_bytes // per_block
    swap = num_cpu_blocks * per_block
    ram = available_ram_bytes()
    if backend.name in HOST_BACKENDS:
        ram = _ram_beside_weights(ram, backend.weights_bytes + d.weights)
    _check_below(swap, ram, f"swap_space={cfg.swap_gib:g} GiB", "the available RAM")
    host = swap + cfg.kv_offload_bytes  # the host KV tier is host memory, as the swap pool is
    if cfg.kv_offload_bytes:
        tier = f"kv_offload_bytes={cfg.kv_offload_bytes}"
        _check_below(host, ram, tier, "the available RAM")
    peak = _activation_peak(cfg, backend)
    both = per_block + d.per_block, peak + d.fixed, backend.weights_bytes + d.weights
    if backend.name in HOST_BACKENDS:
        num_blocks, room_bytes, room, why = _host_pool(cfg, *both, host, ram, windows)
    else:
        num_blocks, room_bytes, room, why = _device_pool(cfg, backend, *both)
    log.info(
        "# GPU blocks: %d, # CPU blocks: %d  (the 'GPU' pool is %s on the %s backend; "
        "CPU blocks = swap_space %g GiB / block)",
        num_blocks,
        num_cpu_blocks,
        "host memory" if backend.name in HOST_BACKENDS else "device memory",
        backend.name,
        cfg.swap_gib,
    )
    _log_window(cfg, num_blocks, groups)
    _check_fits(cfg, num_blocks, per_block, windows)
    sizes = (cfg.block_size, per_block, num_blocks, num_cpu_blocks, backend.weights_bytes, peak)
    num_draft = num_blocks + d.lookahead_blocks if draft is not None else 0
    if draft is not None:
        log.info("# draft blocks: %d (%s)", num_draft, mib(num_draft * d.per_block))
    return KVPlan(*sizes, swap, room_bytes, room, why, num_draft)


def _grouped_blocks(cfg: EngineConfig, groups) -> EngineConfig:
    """``num_gpu_blocks`` counts blocks of every layer (their bytes): a grouped model's pool
    of G-layer blocks has num_gpu_blocks x L / G of them."""
    if groups is None or not groups.grouped or not cfg.num_gpu_blocks:
        return cfg
    layers = sum(len(ls) for ls in groups.layers)
    n = cfg.num_gpu_blocks * layers // groups.num_slots
    log.info(
        "num_gpu_blocks=%d blocks of %d layers: %d blocks of %d KV slots (the same bytes)",
        cfg.num_gpu_blocks, layers, n, groups.num_slots,
    )  # fmt: skip
    return dataclasses.replace(cfg, num_gpu_blocks=n)


def _activation_peak(cfg: EngineConfig, backend) -> int:
    """The backend's activation peak of the largest step; a profile that runs out of memory is a
    ValueError naming the step's size."""
    try:
        return backend.profile_peak_bytes(
            cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs
        )
    except MemoryError:
        raise ValueError(
            f"the profile step of max_num_batched_tokens={cfg.max_num_batched_tokens} tokens "
            f"(max_num_seqs={cfg.max_num_seqs}) ran out of memory; {_peak_fix(cfg)}"
        ) from None


def _host_pool(
    cfg: EngineConfig, per_block: int, peak: int, weights: int, swap: int, ram: int, windows
):
    """(blocks, room bytes, room, why) of a pool in host RAM, such that KV pool + swap pool +
    activation peak fit."""
    limit, limit_name = _host_limit(cfg, weights, ram)
    where = f"{limit_name} less the swap pool"
    _check_below(peak, limit - swap, _peak_name(cfg), where, _peak_fix(cfg))
    fit = (limit - swap - peak) // per_block
    if cfg.num_gpu_blocks:
        num_blocks, why = cfg.num_gpu_blocks, "num_gpu_blocks"
        pool = f"num_gpu_blocks={num_blocks} x block_size={cfg.block_size}"
        room = f"{limit_name} less the swap pool and the activation peak"
        _check_below(num_blocks * per_block, limit - swap - peak, pool, room)
    elif cfg.memory_budget_bytes:
        num_blocks, why = fit, limit_name
    else:
        want = cfg.max_num_seqs * seq_blocks(cfg, windows)
        num_blocks = min(want, fit)
        why = f"max_num_seqs {cfg.max_num_seqs} x max_model_len {cfg.max_model_len} tokens"
        if any(windows):
            kind = f"sliding window {windows[0]}" if len(windows) == 1 else "KV groups"
            why += f" ({kind}: {seq_blocks(cfg, windows)} blocks)"
        why += f", capped at {limit_name}" if fit < want else ""
    _log_host_plan(cfg, num_blocks * per_block, swap, peak, ram, why, weights)
    room = f"{limit_name} less the swap pool and the activation peak"
    return num_blocks, limit - swap - peak, room, why


def _host_limit(cfg: EngineConfig, weights: int, ram: int) -> tuple[int, str]:
    """(bytes the KV pool, the swap pool and the activation peak may take together, its name)."""
    if cfg.num_gpu_blocks:
        return ram, "the available RAM"
    if cfg.memory_budget_bytes:
        room, name = cfg.memory_budget_bytes - weights, "memory_budget_bytes"
        _check_below(room, ram, f"{name}={cfg.memory_budget_bytes} less the weights", "the RAM")
        return room, f"{name} less the weights"
    return int(HOST_RAM_FRACTION * ram), f"{HOST_RAM_FRACTION:.2f} x available RAM"


def _log_host_plan(
    cfg: EngineConfig, pool: int, swap: int, peak: int, ram: int, why: str, weights: int
):
    log.info(
        "host memory plan: KV pool %s (%s) + swap and host KV tier %s + activation peak %s "
        "(profile: %d tokens) "
        "= %s of %s available RAM (weights already loaded: %s resident)",
        mib(pool),
        why,
        mib(swap),
        mib(peak),
        cfg.max_num_batched_tokens,
        mib(pool + swap + peak),
        mib(ram),
        mib(weights),
    )


def _device_pool(cfg: EngineConfig, backend, per_block: int, peak: int, weights: int):
    """(blocks, room bytes, room, why) of a pool in device memory: the budget less weights and
    the activation peak."""
    total = backend.total_memory_bytes()
    budget, source = cfg.memory_budget_bytes, "explicit"
    if budget:
        _check_below(budget, total, f"memory_budget_bytes={budget}", "the device memory")
    else:
        budget = int(cfg.gpu_memory_utilization * total)
        source = f"{cfg.gpu_memory_utilization:.2f} x GPU memory"
    where = "the memory budget less the weights"
    _check_below(peak, budget - weights, _peak_name(cfg), where, _peak_fix(cfg))
    fit = (budget - weights - peak) // per_block
    num_blocks = cfg.num_gpu_blocks or fit
    if cfg.num_gpu_blocks:
        pool = f"num_gpu_blocks={num_blocks} x block_size={cfg.block_size}"
        _check_below(num_blocks * per_block + weights + peak, total, pool, "the device memory")
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
    room = f"memory budget ({source}) less the weights and the activation peak"
    why = "num_gpu_blocks" if cfg.num_gpu_blocks else "as many as fit"
    return num_blocks, budget - weights - peak, room, why


def _peak_name(cfg: EngineConfig) -> str:
    return (
        f"the activation peak of max_num_batched_tokens={cfg.max_num_batched_tokens} tokens "
        f"(max_num_seqs={cfg.max_num_seqs})"
    )


def _check_below(need: int, have: int, what: str, where: str, fix: str = "lower it") -> None:
    """A ValueError naming ``what`` when it needs more than ``have`` bytes."""
    if need > have:
        raise ValueError(f"{what} needs {mib(need)}, more than {where} ({mib(have)}); {fix}")


def _log_window(cfg: EngineConfig, num_blocks: int, groups) -> None:
    """With a sliding window every layer has, or KV groups: what a sequence holds at once, and
    how many of max_model_len tokens the pool holds together."""
    if groups is None or not any(groups.windows):
        return
    if groups.grouped:
        _log_groups(cfg, num_blocks, groups)
        return
    window = groups.windows[0]
    per_seq, full = seq_blocks(cfg, (window,)), cdiv(cfg.max_model_len, cfg.block_size)
    log.info(
        "sliding window %d on every layer: a sequence holds at most %d blocks at once "
        "(max_num_batched_tokens=%d per step), not %d for max_model_len=%d: the pool holds "
        "%d such sequences, not %d",
        window,
        per_seq,
        cfg.max_num_batched_tokens,
        full,
        cfg.max_model_len,
        num_blocks // per_seq,
        num_blocks // full,
    )


def _log_groups(cfg: EngineConfig, num_blocks: int, groups) -> None:
    """A grouped model: its groups, what a sequence holds at once (blocks of G layers) and how
    many max_model_len sequences the pool holds, against one block of every layer per token."""
    per_seq, full = seq_blocks(cfg, groups.windows), cdiv(cfg.max_model_len, cfg.block_size)
    layers = sum(len(ls) for ls in groups.layers)
    log.info(
        "%s: a sequence holds at most %d blocks of %d layers at once (max_num_batched_tokens="
        "%d per step), not %d blocks of %d layers for max_model_len=%d: the pool holds %d "
        "such sequences, not %d",
        groups.describe(),
        per_seq,
        groups.num_slots,
        cfg.max_num_batched_tokens,
        full,
        layers,
        cfg.max_model_len,
        num_blocks // per_seq,
        num_blocks * groups.num_slots // (full * layers),
    )


def _check_fits(cfg: EngineConfig, num_blocks: int, per_block: int, windows=(0,)) -> None:
    need = seq_blocks(cfg, windows)
    if num_blocks < need:
        raise ValueError(
            f"KV cache too small: one sequence of max_model_len={cfg.max_model_len} tokens "
            f"needs {need} blocks ({mib(need * per_block)}), the pool has {num_blocks} "
            f"({mib(num_blocks * per_block)}); give more memory or lower max_model_len"
        )
