"""The messages between the frontend and the engine core (msgspec structs, the same in one process
or over ZMQ): a tokenized request in; each step's token-id deltas and the core's counters out.
And the one refusal the queue makes, ``QueueFullError``."""

from __future__ import annotations

import msgspec

from engine.core.sequence import Sequence
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """More sequences would wait than ``max_waiting_requests`` allows; retry later."""


def check_queue(n: int, limit: int, waiting: int, busy: int, max_num_seqs: int) -> None:
    """QueueFullError if n more sequences would leave more than ``limit`` waiting once the
    next step has filled the free run slots (``max_num_seqs`` less the ``busy``: running or
    swapped)."""
    free = max(max_num_seqs - busy, 0)
    if waiting + n - free > limit:
        raise QueueFullError(
            f"the queue is full: {waiting} sequences wait for {free} free run slots and at "
            f"most {limit} may wait beyond them"
        )


class CoreRequest(msgspec.Struct, array_like=True, gc=False):
    """What the frontend hands the core: a tokenized, validated request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() (one clock for every process of the host)
    bad_words_ids: list[list[int]] = []
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sequence's news since its last delta."""

    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # new output tokens, in order
    logprobs: list[dict[int, float]] | None = None  # one per new token, when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while it runs
    stop_reason: int | None = None  # the stop token id that ended it
    error: str | None = None  # why the core aborted it
    num_cached_tokens: int | None = None  # prompt tokens its admission found cached
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, when complete
    logits: list | None = None  # (V,) float32 per new token; with record_logits (in-process)
    embedding: list[float] | None = None  # the pooling runner's vector, when it finishes


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core's queues and counters after a step."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0  # fraction of GPU blocks in use
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0
    tier_queries: int = 0  # cumulative prompt tokens looked up with KV tiers on
    tier_hits: int = 0  # of those, loaded from a tier
    # per KV tier: [name, capacity, used bytes, queries, hits, loads, load bytes, stores, store
    # bytes, evictions, rejected] (engine/kv_offload TierStats), None without tiers
    kv_tiers: list | None = None
    # LoRA (enable_lora): the adapters of the running and of the waiting sequences, by name;
    # the slots a step may use. None without LoRA
    lora_running: list[str] | None = None
    lora_waiting: list[str] | None = None
    max_loras: int = 0
    num_preemptions: int = 0
    num_added_seqs: int = 0  # cumulative: sequences queued
    # speculative decoding: [drafts, draft tokens, accepted tokens, accepted by position]
    spec_decode: list | None = None
    # a mixture of experts: per sparse layer [layer, rows routed to each expert so far]
    # (Backend.expert_tokens), None for a dense model
    expert_tokens: list | None = None


class CoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One step's deltas, when it ended, and the core's state after it."""

    deltas: list[SampleDelta]
    now: float  # time.monotonic() when its tokens were processed
    stats: CoreStats


def deltas(seqs, vectors: dict | None = None) -> list[SampleDelta]:
    """A delta for each sequence with news (a running plain decode's is its new ids alone);
    ``vectors``: seq_id -> the vector of a pooled prompt that finished."""
    out, vectors = [], vectors or {}
    for seq in seqs:
        sent = seq.num_sent
        if sent and seq.always_plain and not seq.new_logits and seq.finish_reason is None:
            ids = seq.output_token_ids  # a running plain decode: the common case
            seq.num_sent = len(ids)
            out.append(SampleDelta(seq.request_id, seq.index, ids[sent:]))
        else:
            out.append(delta(seq, vectors.get(seq.seq_id)))
    return out


def delta(seq: Sequence, vector=None) -> SampleDelta:
    """seq's tokens (and logprobs, logits) since its last delta; how it ended, once (with its
    ``vector``, a pooled prompt's); its cached prompt tokens with its first delta and its
    last."""
    sent, seq.num_sent = seq.num_sent, seq.num_output_tokens
    d = SampleDelta(seq.request_id, seq.index, seq.output_token_ids[sent:])
    if not sent or seq.is_finished:
        d.num_cached_tokens = seq.num_cached_tokens
    if seq.params.logprobs is not None:
        d.logprobs, seq.new_logprobs = seq.new_logprobs, []
    if seq.new_logits:
        d.logits, seq.new_logits = seq.new_logits, []
    if seq.is_finished:
        d.finish_reason, d.stop_reason, d.error = seq.finish_reason, seq.stop_reason, seq.error
        if vector is not None:
            d.embedding = vector.tolist()
    p = seq.params.prompt_logprobs
    if p is not None and not seq.prompt_logprobs_sent:
        if len(seq.prompt_logprobs) >= seq.num_prompt_tokens:
            d.prompt_logprobs, seq.prompt_logprobs_sent = list(seq.prompt_logprobs), True
    return d


TIER_FIELDS = (
    "name", "capacity_bytes", "used_bytes", "queries", "hits", "loads", "load_bytes", "stores",
    "store_bytes", "evictions", "rejected",
)  # fmt: skip


def core_stats(
    scheduler, num_added_seqs: int, spec_decode: list | None, experts: list | None = None
) -> CoreStats:
    """The scheduler's queues and counters (and its block manager's use) as a CoreStats."""
    bm = scheduler.block_manager
    tiers, running, waiting, lora = None, None, None, scheduler.lora
    if lora is not None:
        running = sorted({lora.name_of(s.lora_id) for s in scheduler.running if s.lora_id})
        waiting = sorted({lora.name_of(s.lora_id) for s in scheduler.waiting if s.lora_id})
    if bm.connector is not None:
        tiers = [[getattr(t, f) for f in TIER_FIELDS] for t in bm.connector.stats()]
    return CoreStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        kv_cache_usage=1.0 - bm.num_free_blocks / max(bm.num_blocks, 1),
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        tier_queries=scheduler.tier_queries,
        tier_hits=scheduler.tier_hits,
        kv_tiers=tiers,
        lora_running=running,
        lora_waiting=waiting,
        max_loras=0 if lora is None else len(lora.slots),
        num_preemptions=scheduler.num_preemptions,
        num_added_seqs=num_added_seqs,
        spec_decode=spec_decode,
        expert_tokens=experts,
    )
