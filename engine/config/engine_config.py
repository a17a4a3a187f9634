"""``EngineConfig``: every option of the engine, vLLM's names and defaults, each field with its
command-line help; checked at construction (engine/config/checks.py), resolved against the
model by ``resolve``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.config.checks import (
    BACKENDS,
    DEFAULT_BATCHED_TOKENS,
    DEFAULT_KV_DISK_GIB,
    DEFAULT_SWAP_GIB,
    DTYPES,
    EXECUTORS,
    KV_CACHE_DTYPES,
    MAX_SWAP_GIB,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    check_choices,
    check_lora,
    check_parallel,
    check_pooling,
    check_ranges,
    check_tiers,
    check_types,
)
from engine.config.generation import check_generation_config, parse_override
from engine.config.speculative import parse_speculative_config
from engine.utils import GiB
from model_loader.config import ModelConfig


def option(default, help: str, choices: tuple[str, ...] | None = None, default_help=None):
    """A field with its command-line help beside it (engine/entrypoints/engine_args.py makes the
    flag). default_help: how ``--help`` describes a default of None."""
    meta = {"help": help, "choices": choices, "default_help": default_help}
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    model: str = option(
        "",
        "HF directory, .gguf file, Hub id or 'smollm2'",
        default_help="TinyLlama when cached or reachable, else the bundled SmolLM2",
    )
    block_size: int = option(16, "tokens per KV-cache block")
    gpu_memory_utilization: float = option(
        0.90,
        "cuda backend: fraction of device memory for weights, activations and the KV cache "
        "(the host backends size their pool from max_num_seqs x max_model_len tokens, at most "
        "half the available RAM)",
    )
    swap_space: float | None = option(
        None,
        f"GiB of host memory for swapped-out blocks, at most {MAX_SWAP_GIB}",
        default_help=f"{DEFAULT_SWAP_GIB} with preemption_mode swap, 0 with recompute",
    )
    max_num_seqs: int = option(256, "sequences in one step at most")
    max_num_batched_tokens: int | None = option(
        None,
        "tokens in one step at most",
        default_help=f"max(max_model_len, {DEFAULT_BATCHED_TOKENS}); "
        f"{DEFAULT_BATCHED_TOKENS} with chunked prefill",
    )
    max_model_len: int | None = option(
        None, "prompt + output tokens per sequence", default_help="the model's"
    )
    num_gpu_blocks: int | None = option(
        None,
        "KV-cache blocks in the pool, overriding the size computed from the memory budget",
        default_help="computed",
    )
    preemption_mode: str = option(
        "recompute",
        "what to do with a running sequence when blocks run out: recompute (free its blocks, "
        "re-prefill later) or swap (copy its blocks to host memory)",
        choices=PREEMPTION_MODES,
    )
    dtype: str = option(
        "auto",
        "weights and KV-cache dtype; auto keeps the checkpoint's (float32 on the host backends); "
        "half is float16, float is float32",
        choices=DTYPES,
    )
    quantization: str | None = option(
        None,
        "int8: weight-only int8 for the matrices of every layer and the LM head, symmetric, one "
        "float32 scale per output channel (its absmax / 127), each weight rounded to the nearest "
        "multiple of it; activations and accumulation stay float32. The cpu backend keeps them "
        "as int8 (a quarter of float32's bytes); the numpy backend dequantizes them to float32 "
        "at load (the plain reference for the same values). q8_0, q4_0, q4_1: llama.cpp's "
        "block formats, float16 scales per 32 inputs of an output channel (the LM head Q8_0 "
        "under the 4-bit ones); the cpu backend quantizes activations to 8 bits per 32 and "
        "multiplies with integer dot products; a GGUF already in the format keeps its own "
        "blocks, and one whose layers are all Q8_0 runs q8_0 without the flag. q4_k_m, q5_k_m, "
        "q6_k, q5_0: llama.cpp's k-quant mixes, a float checkpoint quantized at load into the "
        "blocks llama-quantize writes (as engine.tools.quantize does to a file), kept as a "
        "GGUF's are. cpu and numpy backends, one rank",
        choices=QUANTIZATIONS,
        default_help="none: the weights in --dtype (on the cpu backend, bfloat16 keeps them in "
        "bf16, half the bytes)",
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's dtype, apart from the weights': float16 or bfloat16 halve a float32 "
        "cache's bytes (twice the tokens in the same memory, half the bytes decode attention "
        "reads); fp8 (vLLM's name for fp8_e4m3) and fp8_e5m2 quarter them, 8-bit floats with "
        "3 or 2 mantissa bits and no scales, saturating at their largest value (448, 57344): "
        "a real accuracy cost (SmolLM2, float32 weights: mean KL 0.011 for e4m3, 0.040 for "
        "e5m2, against 4e-5 for bfloat16). K and V are rounded to it (to nearest even) when "
        "written, and attention still computes in float32. cpu and numpy backends, one rank",
        choices=KV_CACHE_DTYPES,
        default_help="auto: the --dtype's",
    )
    backend: str = option(
        "auto",
        "auto: cuda when CuPy sees a GPU, else cpu (numpy without g++); cpu: native C++ "
        "kernels on the host, multi-threaded, NumPy's BLAS for the products; numpy: NumPy on "
        "the host, the plain one; cuda: the kernels on a GPU through CuPy; cuda-cpu: the cuda "
        "backend on an emulated device (the kernels' CPU builds, CUDA's capture rules checked)",
        choices=BACKENDS,
    )
    seed: int = option(0, "engine seed for sampling (a request's own seed overrides it)")
    enable_chunked_prefill: bool = option(
        False, "split long prefills into chunks that fit the token budget, mixed with decodes"
    )
    enable_prefix_caching: bool = option(
        False,
        "reuse the KV blocks of a prompt prefix already computed for an earlier request (full "
        "blocks, matched by chained hashes; needs preemption_mode recompute)",
    )
    kv_offload_bytes: int = option(
        0,
        "bytes of host memory for a KV tier under the prefix cache: a cached block evicted "
        "from the pool is kept there (least recently used out first), and a later prompt with "
        "that prefix loads it instead of computing it; needs enable_prefix_caching (0: off)",
    )
    kv_cache_dir: str | None = option(
        None,
        "a directory for a KV tier on disk under the prefix cache (and under kv_offload_bytes' "
        "host tier): evicted blocks are written there as files that outlive the process, keyed "
        "by the model's weights, dtypes and layout, so a restarted engine loads a prompt's "
        "prefix instead of computing it; engines may share it; needs enable_prefix_caching",
        default_help="off",
    )
    kv_disk_bytes: int | None = option(
        None,
        "bytes the kv_cache_dir directory may hold (every model's files in it); past them the "
        "least recently used files go",
        default_help=f"{DEFAULT_KV_DISK_GIB} GiB with kv_cache_dir",
    )
    enable_lora: bool = option(
        False,
        "serve LoRA adapters (PEFT directories) over the base weights: a request names one "
        "(LoRARequest, or the server's model name) and a step batches rows of several adapters "
        "and of the base model; every backend (parallel ranks each keep their cut; on cuda a "
        "step with adapter rows runs without CUDA graphs)",
    )
    max_loras: int = option(1, "adapters a step may use at once (their slots)")
    max_lora_rank: int = option(16, "the largest adapter rank accepted")
    max_cpu_loras: int | None = option(
        None, "adapters kept loaded in host memory", default_help="max_loras"
    )
    runner: str = option(
        "generate",
        "generate: requests sample tokens; pooling: the engine embeds prompts (LLM.embed, the "
        "server's /v1/embeddings), each prompt's hidden states pooled into one vector, scores "
        "pairs (LLM.score, /score, /rerank) or, with a *ForSequenceClassification checkpoint, "
        "classifies prompts (LLM.classify, /classify)",
        choices=("generate", "pooling"),
    )
    pooler_config: str | None = option(
        None,
        "the pooling runner's defaults, a JSON object with vLLM's keys: pooling_type (last, "
        "mean, cls), normalize, dimensions; and default_prompt_name (a prompt of the "
        "checkpoint's config_sentence_transformers.json put before every text input, null: "
        "none)",
        default_help="the checkpoint's sentence-transformers config, else last and normalized",
    )
    memory_budget_bytes: int | None = option(
        None,
        "explicit memory budget in bytes, instead of gpu_memory_utilization",
        default_help="off",
    )
    enforce_eager: bool = option(False, "cuda and cuda-cpu backends: no CUDA graphs for decode")
    speculative_config: str | None = option(
        None,
        "speculative decoding, a JSON object with vLLM's keys: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4, "disable_by_batch_size": 16}\': prompt lookup drafts up to k '
        "tokens per decode, all checked by one forward (greedy outputs unchanged, sampled ones "
        'drawn from the same distribution); \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\': a smaller model with the same tokenizer drafts them',
        default_help="off",
    )
    generation_config: str = option(
        "auto",
        "auto: the model's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens; do_sample false means greedy) gives the default "
        "sampling parameters of requests that do not set them; vllm (or ignore): SamplingParams' "
        "own defaults; a directory: the generation_config.json in it",
    )
    override_generation_config: str | None = option(
        None,
        "a JSON object of generation-config keys laid over those defaults, e.g. "
        '\'{"temperature": 0.2, "top_p": 0.9}\' for a model whose checkpoint sets none',
        default_help="none",
    )
    async_scheduling: bool = option(
        False,
        "schedule and launch the next decode step before the current one's token ids are read "
        "back, so the host's bookkeeping (appends, stop checks, detokenizing, outputs) overlaps "
        "the device's forward; only steps of plain-greedy decodes are overlapped, outputs are "
        "identical",
    )
    engine_core_process: bool = option(
        False,
        "run the engine core (scheduler, KV cache, executor, sampler) in a process of its own, "
        "fed over ZMQ: this process keeps tokenizing, detokenizing, stop strings and the "
        "outputs, so their cost overlaps the core's steps",
    )

    tensor_parallel_size: int = option(
        1,
        "ranks the model is split across: attention heads, MLP units and vocabulary rows "
        "sharded, one all-reduce after attention and one after the MLP (one worker process "
        "per rank; on the cuda backends the collectives are NCCL's)",
    )
    pipeline_parallel_size: int = option(
        1,
        "stages the layers are split into, each of tensor_parallel_size ranks; each stage "
        "hands its hidden state to the next (numpy backend only, one worker process per rank)",
    )
    distributed_executor_backend: str | None = option(
        None,
        "uni: one rank, in this process; mp: one worker process per rank on this host; ray: "
        "one Ray actor per rank, in a placement group (numpy ranks: on this node)",
        choices=EXECUTORS,
        default_help="uni for one rank, mp for more",
    )
    ray_address: str | None = option(
        None,
        "the Ray cluster to join with the ray executor or data parallel (host:port, or 'auto' "
        "for the one running here)",
        default_help="RAY_ADDRESS, else a new local cluster",
    )
    data_parallel_size: int = option(
        1,
        "replicas of the whole engine (each with its tensor x pipeline parallel ranks) behind "
        "one endpoint, on Ray Serve, a router choosing the replica of each request (the "
        "server only: python -m engine.serve)",
    )

    def __post_init__(self):
        check_types(self)
        check_ranges(self)
        check_choices(self)
        self.speculative = parse_speculative_config(self.speculative_config)
        check_generation_config(self.generation_config)
        self.generation_overrides = parse_override(self.override_generation_config)
        check_parallel(self)
        check_tiers(self)
        check_lora(self)
        self.pooler = check_pooling(self)
        if self.enable_prefix_caching and self.preemption_mode == "swap":
            raise ValueError(
                "EngineConfig: preemption_mode='swap' does not work with "
                "enable_prefix_caching=True (shared blocks cannot be swapped); use 'recompute'"
            )

    @property
    def kv_disk_limit(self) -> int:
        """kv_disk_bytes, or its default with kv_cache_dir."""
        return self.kv_disk_bytes or DEFAULT_KV_DISK_GIB * GiB

    @property
    def world_size(self) -> int:
        """Ranks the model runs on: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def swap_gib(self) -> float:
        """swap_space, or its default: DEFAULT_SWAP_GIB when preempting by swap, else 0."""
        if self.swap_space is not None:
            return self.swap_space
        return DEFAULT_SWAP_GIB if self.preemption_mode == "swap" else 0

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_gib * GiB)

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        """A copy with max_model_len and max_num_batched_tokens filled in and cross-checked."""
        if model_config.num_labels and self.runner != "pooling":
            raise ValueError(
                "EngineConfig: the model is a sequence classifier (a score head, no LM head): "
                "it runs with runner='pooling' (LLM.classify, /classify), never generates"
            )
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


def make_config(model: str | None = None, **engine_args) -> EngineConfig:
    """EngineConfig from keyword arguments; an unknown name is a ValueError naming it."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_args) - names)
    if unknown:
        raise ValueError(f"unknown engine argument {unknown[0]!r}")
    return EngineConfig(model=model or "", **engine_args)
