"""The engine's configuration: one dataclass, vLLM's names and defaults, checked at construction.

The CLI flags mirror these field names (``--block-size`` -> ``block_size``). Values that depend on
the model (``max_model_len``, the default ``max_num_batched_tokens``) are filled in by
``EngineConfig.resolve(model_config)``, which returns a checked copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from reference.config import ModelConfig

PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = ("auto", "numpy", "cuda", "cuda-cpu")
DEFAULT_BATCHED_TOKENS = 2048  # vLLM's default token budget per step


def _bad(name: str, value, expected: str) -> ValueError:
    return ValueError(f"EngineConfig: {name} must be {expected}, got {value!r}")


def is_int(value) -> bool:
    """A real int (bool is not one here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or float (bool is not one here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class EngineConfig:
    model: str = ""  # path or Hugging Face id; the engine resolves it
    block_size: int = 16  # tokens per KV block
    gpu_memory_utilization: float = 0.90  # fraction of device (NumPy: host) memory to use
    swap_space: float = 4  # GiB of host memory for swapped-out blocks
    max_num_seqs: int = 256  # sequences in one step at most
    max_num_batched_tokens: int | None = None  # token budget of one step (resolve() fills it)
    max_model_len: int | None = None  # prompt + output tokens (resolve() fills it)
    num_gpu_blocks: int | None = None  # override the profiled pool size
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    dtype: str = "auto"  # "auto" = the checkpoint's dtype
    backend: str = "auto"  # "auto" | "numpy" | "cuda" | "cuda-cpu"
    seed: int = 0
    enable_chunked_prefill: bool = False  # split long prefills to fit the token budget
    enable_prefix_caching: bool = False  # reuse the cached blocks of a shared prompt prefix
    memory_budget_bytes: int | None = None  # NumPy backend: explicit total budget
    enforce_eager: bool = False  # no CUDA graphs (accepted for vLLM compatibility)

    def __post_init__(self):
        self._check_types()
        self._check_ranges()
        self._check_choices()
        if self.enable_prefix_caching and self.preemption_mode == "swap":
            raise ValueError(
                "EngineConfig: preemption_mode='swap' does not work with "
                "enable_prefix_caching=True (shared blocks cannot be swapped); use 'recompute'"
            )

    def _check_types(self):
        if not isinstance(self.model, str):
            raise _bad("model", self.model, "a string")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False")
        if not is_int(self.seed):
            raise _bad("seed", self.seed, "an integer")

    def _check_ranges(self):
        for name in ("block_size", "max_num_seqs"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise _bad(name, value, "a positive integer")
        for name in (
            "max_num_batched_tokens",
            "max_model_len",
            "num_gpu_blocks",
            "memory_budget_bytes",
        ):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise _bad(name, value, "a positive integer or None")
        util = self.gpu_memory_utilization
        if not is_number(util) or not 0 < util <= 1:
            raise _bad("gpu_memory_utilization", util, "in (0, 1]")
        if not is_number(self.swap_space) or self.swap_space < 0:
            raise _bad("swap_space", self.swap_space, "a number of GiB >= 0")

    def _check_choices(self):
        for name, choices in (
            ("preemption_mode", PREEMPTION_MODES),
            ("dtype", DTYPES),
            ("backend", BACKENDS),
        ):
            if getattr(self, name) not in choices:
                raise _bad(name, getattr(self, name), "one of " + ", ".join(choices))

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * (1 << 30))

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        """A copy with max_model_len and max_num_batched_tokens filled in and cross-checked."""
        model_max = model_config.max_position_embeddings
        max_len = self.max_model_len or model_max
        if max_len > model_max:
            raise ValueError(
                f"EngineConfig: max_model_len ({max_len}) is longer than the model's "
                f"max_position_embeddings ({model_max})"
            )
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                budget = max(max_len, budget)
            budget = max(budget, self.max_num_seqs)
        if not self.enable_chunked_prefill and budget < max_len:
            raise ValueError(
                f"EngineConfig: max_num_batched_tokens ({budget}) is smaller than max_model_len "
                f"({max_len}); raise it or enable_chunked_prefill"
            )
        if budget < self.max_num_seqs:
            raise ValueError(
                f"EngineConfig: max_num_batched_tokens ({budget}) is smaller than max_num_seqs "
                f"({self.max_num_seqs})"
            )
        return dataclasses.replace(self, max_model_len=max_len, max_num_batched_tokens=budget)

    @property
    def is_resolved(self) -> bool:
        return self.max_model_len is not None and self.max_num_batched_tokens is not None


def make_config(model: str | None, **engine_args) -> EngineConfig:
    """EngineConfig from keyword arguments; an unknown name is a ValueError naming it."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_args) - names)
    if unknown:
        raise ValueError(f"unknown engine argument {unknown[0]!r}")
    return EngineConfig(model=model or "", **engine_args)
