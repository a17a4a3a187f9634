"""The engine core: requests as token ids in, one scheduled forward per ``step()``, token-id
deltas out. It holds the scheduler, the block manager, the model runner and the sampler; the
frontend (engine/llm_engine.py, in this process, or engine/core_client.py, in another) tokenizes,
detokenizes, looks for stop strings and builds the outputs.

add_request -> one Sequence per sample (its RNG, bad words, grammar) -> Scheduler.add
step        -> 1. Scheduler.schedule  2. ModelRunner.execute (swaps, forward)  3. Sampler.sample
            -> 4. Scheduler.update (append tokens; stop checks on ids: EOS, stop token ids,
               max_tokens, max_model_len, a finished grammar)
            -> 5. a ``SampleDelta`` per sequence with news: its new token ids (and logprobs),
               how it ended
            (a step whose rows are all plain greedy asks the backend for argmax ids instead of
            logits, so no (B, V) array reaches the host: ``sampler.plain_greedy``)
finish_sample -> the frontend found a stop string: that sequence ends, its blocks go back

``async_scheduling``: a step of plain-greedy decodes alone is launched, not waited for. The next
``step()`` schedules as if each of its sequences had its token (a ``PENDING_TOKEN``), launches the
next such step (the device takes those tokens from the ids of the step before), and only then
reads the launched step's ids and runs 4. and 5. for them while the device computes: outputs lag
one step. Any other step first reads back the step in flight, then runs as above.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import msgspec
import numpy as np

from reference.loader import LoadedModel, load_model

from . import tracing
from .backends import get_backend
from .backends.numpy_backend import greedy_ids
from .block_manager import BlockManager
from .config import EngineConfig
from .memory import plan_kv_cache
from .model_runner import ModelRunner, needs_rows, output_row_counts, wants_prompt_rows
from .sampler import (
    NO_TOKEN,
    Sampler,
    plain_greedy,
    rows_to_sample,
    sampling_probs,
    top_logprobs,
)
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import PENDING_TOKEN, Sequence
from .spec_decode import DraftModel, SpecStats, accept_greedy, accept_sampled, propose_ngram

log = logging.getLogger("engine")
MAX_SPEC_BACKOFF = 16  # steps without drafts at most, after repeated rejections


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


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core's queues and counters after a step."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0  # fraction of GPU blocks in use
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_added_seqs: int = 0  # cumulative: sequences queued
    # speculative decoding: [drafts, draft tokens, accepted tokens, accepted by position]
    spec_decode: list | None = None


class CoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One step's deltas, when it ended, and the core's state after it."""

    deltas: list[SampleDelta]
    now: float  # time.monotonic() when its tokens were processed
    stats: CoreStats


class DraftPrefix:
    """A sequence as it would be after the first drafts: what the sampler's penalties and
    min_tokens ban read for one row of a speculated run."""

    def __init__(self, seq: Sequence, drafts: list[int]):
        self.params = seq.params
        self.prompt_token_ids = seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + drafts
        self.num_output_tokens = len(self.output_token_ids)
        self.bad_words_ids = seq.bad_words_ids
        assert seq.matcher is None, "structured-output requests do not speculate"
        self.matcher = None
        self.always_plain = False


def backoff(seq: Sequence, num_accepted: int) -> None:
    """After a wholly rejected draft a sequence decodes plainly for ``spec_backoff`` steps, the
    wait doubling (up to MAX_SPEC_BACKOFF) while its drafts keep failing; an accepted draft
    token resets it. Prompt lookup on text that does not repeat costs a verify row per step."""
    if num_accepted:
        seq.spec_backoff = 1
    else:
        seq.spec_wait = seq.spec_backoff
        seq.spec_backoff = min(2 * seq.spec_backoff, MAX_SPEC_BACKOFF)


@dataclasses.dataclass
class InFlight:
    """A launched step of decodes (async scheduling) whose ids are not read yet."""

    seqs: list[Sequence]  # row b of the step's ids is seqs[b]'s token
    handle: object  # the backend's GreedyIds
    rows: dict[int, int]  # seq_id -> its row


def spec_counters(stats: SpecStats) -> list:
    """SpecStats as [drafts, draft tokens, accepted tokens, accepted by draft position]."""
    return [
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.accepted_per_pos,
    ]


def model_eos_ids(loaded: LoadedModel) -> list[int]:
    """The ids that end a sequence: the model config's, else the tokenizer's."""
    return list(loaded.config.eos_token_ids or loaded.tokenizer.eos_token_ids)


def structured_compiler(loaded: LoadedModel, eos_token_ids: list[int]):
    """A structured-output compiler over the model's tokenizer (about half a second to build
    for a 49k vocabulary)."""
    from .structured import StructuredOutputCompiler

    return StructuredOutputCompiler(
        loaded.tokenizer, vocab_size=loaded.config.vocab_size, eos_token_ids=eos_token_ids
    )


def check_draft(draft: LoadedModel, target: LoadedModel, max_model_len: int) -> None:
    """A ValueError naming what makes ``draft`` unfit to propose for ``target``."""
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise ValueError(f"speculative_config: the draft's vocab_size {dv} != the target's {tv}")
    dt, tt = draft.tokenizer.backend.get_vocab(), target.tokenizer.backend.get_vocab()
    if dt != tt:
        differ = len(set(dt.items()) ^ set(tt.items()))
        raise ValueError(
            f"speculative_config: the draft model's tokenizer is not the target's "
            f"({differ} token <-> id pairs differ)"
        )
    dmax = draft.config.max_position_embeddings
    if dmax < max_model_len:
        raise ValueError(
            f"speculative_config: the draft model's max_position_embeddings {dmax} < "
            f"max_model_len {max_model_len}; lower max_model_len"
        )


def configured_backend(model_config, weights, config: EngineConfig):
    if config.distributed_executor_backend in ("mp", "ray"):
        from .distributed import executor_backend

        return executor_backend(model_config, weights, config)
    return get_backend(config.backend, model_config, weights, config)


class EngineCore:
    """``EngineCore(loaded, config)``: ``config`` resolved against the model. ``record_logits``
    hands every sampled row of logits on (``engine.diff``); ``draft_loaded`` reuses a loaded
    draft model; ``backend_factory`` ``(model_config, weights, config) -> Backend`` replaces
    the configured backend (the host benchmark's ``StubBackend``)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        record_logits: bool = False,
        draft_loaded: LoadedModel | None = None,
        backend_factory=None,
    ):
        self.loaded, self.config, self.model_config = loaded, config, loaded.config
        self.tokenizer = loaded.tokenizer
        self.record_logits = record_logits
        self.draft_loaded = draft_loaded
        self._setup(backend_factory or configured_backend)

    def _setup(self, backend_factory) -> None:
        cfg, mc = self.config, self.model_config
        log.info(
            "model %s: %d layers, hidden %d, %d heads (%d KV), head dim %d, vocab %d",
            self.loaded.source,
            mc.num_hidden_layers,
            mc.hidden_size,
            mc.num_attention_heads,
            mc.num_key_value_heads,
            mc.head_dim,
            mc.vocab_size,
        )
        self.backend = backend_factory(mc, self.loaded.weights, cfg)
        draft = self._draft_backend(backend_factory)  # speculative decoding's draft model
        # the backends hold their own packed copies: the loaded arrays go (unless the caller
        # keeps them), so a run's memory is its packed weights, not those plus the file's
        self.loaded, self.draft_loaded = dataclasses.replace(self.loaded, weights=None), None
        self.kv_plan = plan_kv_cache(cfg, self.backend, draft)
        num_blocks, num_cpu_blocks = self.kv_plan.num_blocks, self.kv_plan.num_cpu_blocks
        self.backend.allocate_kv_cache(num_blocks, num_cpu_blocks)
        self.drafter = None
        if draft is not None:
            draft.allocate_kv_cache(self.kv_plan.num_draft_blocks)
            n = self.kv_plan.num_draft_blocks
            self.drafter = DraftModel(draft, n, cfg.block_size, cfg.max_num_batched_tokens)
        self.block_manager = BlockManager(
            num_blocks, cfg.block_size, num_cpu_blocks, enable_caching=cfg.enable_prefix_caching
        )
        self.scheduler = Scheduler(cfg, self.block_manager)
        self.runner = ModelRunner(mc, cfg, self.backend)
        self.eos_token_ids = model_eos_ids(self.loaded)
        self.sampler = Sampler(self.eos_token_ids)
        self.trace_schedule = tracing.ScheduleTracer(
            self.block_manager, cfg.block_size, cfg.preemption_mode
        )
        self._counter = itertools.count()
        self.requests: dict[str, list[Sequence]] = {}  # live requests' sequences, by sample
        self.num_added_seqs = 0  # every sequence ever queued (a core process's frontend counts)
        self._touched: dict[int, Sequence] = {}  # seq_id -> sequence with news in this step
        self.in_flight: InFlight | None = None  # async scheduling: the step launched last
        # a sequence this long would be rejected by the scheduler: read its pending token first
        self._longest_ok = min(cfg.max_model_len, num_blocks * cfg.block_size)
        self.recorder = None  # engine/recorder.py's Recorder attaches itself here
        self.spec_stats = SpecStats(cfg.speculative)  # speculative decoding's counters
        if cfg.speculative is not None:
            log.info("speculative decoding: %s", cfg.speculative)
            if cfg.async_scheduling:
                log.info("async scheduling overlaps no step while speculative decoding is on")

    def _draft_backend(self, backend_factory):
        """The draft model's backend (method draft_model), checked against the target: the
        same vocabulary, room for max_model_len tokens; else None."""
        sc = self.config.speculative
        if sc is None or sc.method != "draft_model":
            return None
        draft = self.draft_loaded or load_model(sc.model)
        check_draft(draft, self.loaded, self.config.max_model_len)
        dc = draft.config
        log.info(
            "draft model %s: %d layers, hidden %d, %d heads (%d KV), vocab %d",
            draft.source,
            dc.num_hidden_layers,
            dc.hidden_size,
            dc.num_attention_heads,
            dc.num_key_value_heads,
            dc.vocab_size,
        )
        return backend_factory(dc, draft.weights, self.config)

    # ---- requests ----
    def add_request(self, req: CoreRequest, max_waiting: int | None = None) -> None:
        """Queue one request's sequences; ValueError for a constraint that does not compile,
        QueueFullError when more than ``max_waiting`` sequences would wait beyond the free run
        slots (None: no limit)."""
        params = req.params
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is not a new string id")
        if max_waiting is not None:
            self._check_queue(params.n, max_waiting)
        eos = () if params.ignore_eos else self.eos_token_ids
        stop_ids = frozenset(params.stop_token_ids).union(eos)
        seqs = []
        for index in range(params.n):
            seq = Sequence(req.request_id, req.prompt_token_ids, params, req.arrival_time)
            seq.index, seq.generator = index, self._generator(params, index)
            seq.bad_words_ids = req.bad_words_ids
            seq.stop_ids = stop_ids
            seq.max_num_tokens = min(seq.max_num_tokens, self.config.max_model_len)
            seqs.append(seq)
        if params.structured_outputs is not None:
            compiler = self.structured_compiler()
            compiler.compile(params.structured_outputs)  # a ValueError names a bad constraint
            for seq in seqs:
                seq.matcher = compiler.matcher(params.structured_outputs)
        self.requests[req.request_id] = seqs
        self.num_added_seqs += len(seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        tracing.queued(req.request_id, req.prompt_token_ids, len(self.scheduler.waiting))

    def _check_queue(self, n: int, limit: int) -> None:
        sched = self.scheduler
        busy = len(sched.running) + len(sched.swapped)
        check_queue(n, limit, len(sched.waiting), busy, self.config.max_num_seqs)

    def structured_compiler(self):
        """The sampler's structured-output compiler, built on first use."""
        if self.sampler.structured is None:
            self.sampler.structured = structured_compiler(self.loaded, self.eos_token_ids)
        return self.sampler.structured

    def _generator(self, params: SamplingParams, index: int) -> np.random.Generator:
        """Per-sequence RNG: the request's seed, else the engine seed and a request counter."""
        if params.seed is not None:
            return np.random.default_rng([params.seed % 2**64, index])
        return np.random.default_rng([self.config.seed % 2**64, next(self._counter), index])

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back at once. False if unknown."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:  # its own sequences: no search of the scheduler's queues
            self._touched.pop(seq.seq_id, None)
            self.scheduler.finish(seq, "abort")  # a no-op for one already finished
        self._release_drafts()
        return True

    def finish_sample(self, request_id: str, index: int, num_tokens: int) -> None:
        """The frontend found a stop string in sample ``index`` at its output token
        ``num_tokens``: it ends there (the tokens after it are dropped; no delta follows)."""
        seqs = self.requests.get(request_id)
        if seqs is None or seqs[index].is_finished:
            return
        seq = seqs[index]
        self._touched.pop(seq.seq_id, None)
        self._finish(seq, "stop")
        seq.truncate_output(num_tokens)
        self._release_drafts()

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)  # its blocks go back to the free queue now
        free = self.block_manager.num_free_blocks
        tracing.finished(seq.request_id, reason, seq.num_output_tokens, free)
        self._forget_if_done(seq.request_id)

    def _forget_if_done(self, request_id: str) -> None:
        """A request whose every sequence has finished is no longer the core's."""
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]

    def _release_drafts(self) -> None:
        if self.drafter is not None:  # the draft's blocks of sequences no longer running
            self.drafter.release_except(seq.seq_id for seq in self.scheduler.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> CoreStats:
        sched, bm = self.scheduler, self.block_manager
        return CoreStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            kv_cache_usage=1.0 - bm.num_free_blocks / max(bm.num_blocks, 1),
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            num_added_seqs=self.num_added_seqs,
            spec_decode=spec_counters(self.spec_stats) if self.config.speculative else None,
        )

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        if self.drafter is not None:
            self.drafter.check_invariants()

    # ---- the loop ----
    def step(self) -> CoreOutputs:
        """One scheduled forward; a delta for every sequence that got a token, finished or was
        rejected in it."""
        if self.in_flight is not None and self._would_reject(self.in_flight):
            self._drain()
        if self.config.speculative is not None:
            self._propose()  # 0. drafts for the decodes (speculative decoding)
        # 1. schedule: who runs, with which blocks; who can never run
        out = self.scheduler.schedule()
        self._rejected(self.scheduler.take_rejected())
        self.trace_schedule(out)
        if self.recorder is not None:
            self.recorder.on_schedule(out)
        if self._can_overlap(out):
            self._launch(out)  # 2.-4. for the step before, while this one runs
            outputs = self._outputs()  # 5.
            self.scheduler.advance(out)  # then its sequences take their pending tokens
            return outputs
        self._drain()  # async scheduling: the step in flight is read and processed first
        if out.drafts:  # 2.-4. with drafts: verify them, append what is accepted
            self._speculative_step(out)
        elif not out.is_empty:
            # 2. execute and 3. sample: one token for every sequence whose last token ran
            seqs, ids, extras = self._execute_and_sample(out)
            # 4. update: append the tokens, stop checks, free finished sequences
            self._update(out, seqs, ids, extras)
        self._release_drafts()
        # 5. the deltas
        return self._outputs()

    def _outputs(self) -> CoreOutputs:
        touched, self._touched = self._touched, {}
        deltas = []
        for seq in touched.values():
            sent = seq.num_sent
            if sent and seq.always_plain and not seq.new_logits and seq.finish_reason is None:
                seq.num_sent = seq.num_output_tokens  # a running plain decode: the common case
                deltas.append(SampleDelta(seq.request_id, seq.index, seq.output_token_ids[sent:]))
            else:
                deltas.append(self._delta(seq))
        return CoreOutputs(deltas, time.monotonic(), self.stats())

    @staticmethod
    def _delta(seq: Sequence) -> SampleDelta:
        """seq's tokens (and logprobs, logits) since its last delta; how it ended, once; its
        cached prompt tokens with its first delta and its last."""
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
        p = seq.params.prompt_logprobs
        if p is not None and not seq.prompt_logprobs_sent:
            if len(seq.prompt_logprobs) >= seq.num_prompt_tokens:
                d.prompt_logprobs, seq.prompt_logprobs_sent = list(seq.prompt_logprobs), True
        return d

    def _rejected(self, rejected: list[tuple[Sequence, str]]) -> None:
        """Sequences the scheduler finished because they can never run; an abort keeps why."""
        for seq, reason in rejected:
            if seq.request_id not in self.requests:
                continue
            if seq.finish_reason == "abort":
                seq.error = reason
            self._touched[seq.seq_id] = seq
            self._forget_if_done(seq.request_id)

    # ---- speculative decoding ----
    def _propose(self) -> None:
        """Drafts (``seq.spec_tokens``) for each running decode (greedy or sampled), cut so that
        no step can pass max_tokens or max_model_len; none while a step is in flight, when
        logits are recorded, or above disable_by_batch_size."""
        sc, running = self.config.speculative, self.scheduler.running
        if self.in_flight is not None or self.record_logits:
            return
        if sc.disable_by_batch_size is not None and len(running) > sc.disable_by_batch_size:
            return
        seqs, rooms = [], []
        for seq in running:
            seq.spec_tokens = []  # none left from a step that preempted it before its turn
            room = min(
                sc.num_speculative_tokens,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.config.max_model_len - seq.num_tokens - 1,
            )
            if room < 1 or seq.num_uncomputed_tokens != 1 or seq.matcher is not None:
                continue  # (a structured-output request decodes plainly)
            if seq.spec_wait:  # its last drafts were all rejected: plain decodes for a while
                seq.spec_wait -= 1
                continue
            seqs.append(seq)
            rooms.append(room)
        if self.drafter is not None:
            drafts = self.drafter.propose(seqs, rooms) if seqs else []
        else:
            n_min, n_max = sc.prompt_lookup_min, sc.prompt_lookup_max
            pairs = zip(seqs, rooms, strict=True)
            drafts = [propose_ngram(s.token_ids, r, n_min, n_max) for s, r in pairs]
        for seq, d in zip(seqs, drafts, strict=True):
            seq.spec_tokens = d

    def _speculative_step(self, out: SchedulerOutput) -> None:
        """Run a step with speculated rows: a run's rows are the target after its last token
        and after each draft. When every sequence is plain greedy only their argmax comes
        back; else the logits, and a sampled (or penalised) run is verified by rejection
        sampling. Each speculated sequence takes its accepted drafts and one more token, one
        token at a time through the stop checks; the other sequences as in a plain step."""
        if all(plain_greedy(seq) for seq, _ in out.scheduled):
            ids = self.runner.execute(out, greedy=True).tolist()  # (R,)
            logits = None
        else:
            logits = self.runner.execute(out)  # (R, V)
            ids = greedy_ids(logits).tolist()
        counts = output_row_counts(out)  # (B,) rows of logits (or ids) of each sequence
        sampled = {} if logits is None else self._verify_sampled(out, logits, counts)
        if logits is not None:
            self._record_prompt_logprobs(out, logits, counts)
        plain_seqs, plain_ids, plain_rows, accepted, r = [], [], [], [], 0
        for (seq, n), count in zip(out.scheduled, counts, strict=True):
            drafts = out.drafts.get(seq.seq_id)
            if drafts is not None:
                tokens = sampled.get(seq.seq_id) or accept_greedy(drafts, ids[r : r + n])
                lps = [None] * len(tokens)
                if seq.params.logprobs is not None:  # each token's from the row that chose it
                    rows = logits[r : r + len(tokens)]
                    lps = self.sampler.logprobs(rows, [seq] * len(tokens), np.array(tokens))
                accepted.append((seq, list(zip(tokens, lps, strict=True))))
                backoff(seq, len(tokens) - 1)
                self.spec_stats.record(len(drafts), len(tokens) - 1)
                r += n
                continue
            r += count
            if seq.num_computed_tokens + n == seq.num_tokens:  # its last token ran: it samples
                plain_seqs.append(seq)
                plain_ids.append(ids[r - 1])
                plain_rows.append(r - 1)
        extras = None
        if logits is not None and plain_seqs:
            gens = [s.generator for s in plain_seqs]
            plain_ids, lps = self.sampler.sample(logits[plain_rows], plain_seqs, gens)
            extras = [(lp, logits[i]) for lp, i in zip(lps, plain_rows, strict=True)]
        self._update(out, plain_seqs, plain_ids, extras)
        self._accept_all(accepted)

    def _verify_sampled(self, out: SchedulerOutput, logits: np.ndarray, counts) -> dict:
        """seq_id -> tokens, by rejection sampling, for every speculated run that is not plain
        greedy; the sampler's processing and the distributions of all their rows are made in
        one call each."""
        runs, r = [], 0  # (seq, first row, rows, drafts)
        for (seq, n), count in zip(out.scheduled, counts, strict=True):
            drafts = out.drafts.get(seq.seq_id)
            if drafts is not None and not plain_greedy(seq):
                runs.append((seq, r, n, drafts))
            r += count
        if not runs:
            return {}
        rows = [r + j for _, r, n, _ in runs for j in range(n)]
        views = [DraftPrefix(seq, d[:j]) for seq, _, n, d in runs for j in range(n)]
        probs = self._target_probs(logits[rows], views)  # (rows, V)
        tokens, a = {}, 0
        for seq, _, n, drafts in runs:
            gen = seq.generator
            tokens[seq.seq_id] = accept_sampled(probs[a : a + n], drafts, gen)
            a += n
        return tokens

    def _target_probs(self, rows: np.ndarray, views: list[DraftPrefix]) -> np.ndarray:
        """(N, V) the distribution each view's next token has at its row, as the sampler would
        make it, the view's drafts counted as output (penalties, min_tokens); greedy rows
        one-hot at their argmax; a row with nothing to pick NaN."""
        x = self.sampler.process(rows, views)  # (N, V)
        greedy = np.array([v.params.greedy for v in views])  # (N,)
        probs = np.zeros_like(x)
        if not greedy.all():
            probs[~greedy] = sampling_probs(
                x[~greedy], [v.params for v in views if not v.params.greedy]
            )
        g = np.flatnonzero(greedy)
        best = np.argmax(x[g], axis=1)  # (G,)
        probs[g, best] = 1.0
        picked = x[g, best]
        probs[g[np.isnan(picked) | np.isneginf(picked)]] = np.nan
        return probs

    def _accept_all(self, accepted: list) -> None:
        """Each speculated sequence's verified tokens, one by one: it stops at the first token
        that ends it (EOS, a stop id or string, max_tokens); the rest are dropped."""
        for seq, tokens in accepted:
            for token, logprob in tokens:
                if seq.is_finished:
                    break
                if token == NO_TOKEN:
                    self._abort_unsampled([seq], [NO_TOKEN])
                    break
                self.scheduler.accept(seq, token)
                self._process_tokens([seq], {seq.seq_id: (logprob, None)})
            self.scheduler.end_speculation(seq)

    # ---- async scheduling ----
    def _can_overlap(self, out: SchedulerOutput) -> bool:
        """Whether the step can be launched without waiting: decodes alone, every one plain
        greedy, no blocks to move, nobody preempted, no logits to record."""
        return (
            self.config.async_scheduling
            and self.config.speculative is None  # speculated steps run synchronously
            and not self.record_logits
            and bool(out.scheduled)
            and out.num_decodes == len(out.scheduled)
            and not (out.preempted or out.blocks_to_swap_out or out.blocks_to_swap_in)
            and not out.blocks_to_copy
            and all(plain_greedy(seq) for seq, _ in out.scheduled)
        )

    def _would_reject(self, flight: InFlight) -> bool:
        """Whether a sequence of the step in flight would be rejected by the next schedule (its
        length): its token is read first, so the outputs come in the order they do without
        async scheduling."""
        return max(seq.num_tokens for seq in flight.seqs) > self._longest_ok

    def _launch(self, out: SchedulerOutput) -> None:
        """Launch the decodes of ``out``; then read the step before and process its tokens
        (``Scheduler.advance(out)`` follows once the outputs are built)."""
        prev, batch = self.in_flight, self.runner.prepare(out)
        seqs = [seq for seq, _ in out.scheduled]
        if prev is not None:
            batch.prev_rows = np.fromiter(  # (B,) each decode's row in prev's ids, or -1
                (prev.rows.get(s.seq_id, -1) for s in seqs), np.int32, len(seqs)
            )
        handle = self.backend.launch_greedy(batch, None if prev is None else prev.handle)
        self.in_flight = None
        if prev is not None:
            self._collect(prev)
        self.in_flight = InFlight(seqs, handle, {s.seq_id: b for b, s in enumerate(seqs)})

    def _drain(self) -> None:
        """Read the step in flight, if any, and process its tokens."""
        if self.in_flight is not None:
            flight, self.in_flight = self.in_flight, None
            self._collect(flight)

    def _collect(self, flight: InFlight) -> None:
        """The step's ids in place of the pending tokens; stop checks and text for each. A
        sequence finished since (stopped at the step before, aborted) takes nothing: its row
        was an extra token, dropped here."""
        ids = flight.handle.result().tolist()  # (B,)
        grown, failed = [], []
        for seq, t in zip(flight.seqs, ids, strict=True):
            if seq.is_finished or seq.last_token_id != PENDING_TOKEN:
                continue
            if t == NO_TOKEN:
                seq.drop_pending()
                failed.append(seq)
            else:
                seq.resolve_pending(t)
                grown.append(seq)
        if failed:
            self._abort_unsampled(failed, [NO_TOKEN] * len(failed))
        self._process_tokens(grown, {})

    def _execute_and_sample(self, out: SchedulerOutput):
        """(sequences, their sampled ids, [(logprobs, logits row)] per sequence or None)."""
        rows, seqs = rows_to_sample(out.scheduled)
        if needs_rows(out):  # prompt chunks whose logprobs are asked: all their rows come back
            every = self.runner.execute(out)  # (R, V)
            counts = output_row_counts(out)  # (B,)
            self._record_prompt_logprobs(out, every, counts)
            logits = every[np.cumsum(counts) - 1]  # (B, V) each one's last row
        elif not self.record_logits and all(plain_greedy(s) for s in seqs):
            # the argmax where the logits are; only ids come back
            greedy = self.runner.execute(out, greedy=True)  # (B,)
            ids = (greedy if len(rows) == len(greedy) else greedy[rows]).tolist()  # (R,)
            return seqs, ids, None
        else:
            logits = self.runner.execute(out)  # (B, V)
        gens = [s.generator for s in seqs]
        ids, lps = self.sampler.sample(logits[rows], seqs, gens)
        return seqs, ids, [(lp, logits[r]) for lp, r in zip(lps, rows, strict=True)]

    def _record_prompt_logprobs(self, out: SchedulerOutput, logits: np.ndarray, counts) -> None:
        """For each prompt chunk whose logprobs are asked, the logprobs of the prompt tokens its
        rows predict (row q predicts token q + 1; the first prompt token has none). Positions
        already recorded (a prompt run again after a recompute preemption) are skipped."""
        r = 0
        for (seq, n), count in zip(out.scheduled, counts, strict=True):
            if wants_prompt_rows(seq):
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs.append(None)
                start, k = seq.num_computed_tokens, seq.params.prompt_logprobs
                for q in range(start, start + n):
                    nxt = q + 1
                    if len(seq.prompt_logprobs) == nxt < seq.num_prompt_tokens:
                        token = seq.prompt_token_ids[nxt]
                        seq.prompt_logprobs.append(top_logprobs(logits[r + q - start], token, k))
            r += count

    def _update(self, out: SchedulerOutput, seqs, ids, extras) -> None:
        if NO_TOKEN in ids:
            self._abort_unsampled(seqs, ids)
        sampled = {s.seq_id: t for s, t in zip(seqs, ids, strict=True) if t != NO_TOKEN}
        extra = {} if extras is None else {s.seq_id: e for s, e in zip(seqs, extras, strict=True)}
        self._process_tokens(self.scheduler.update(out, sampled), extra)

    def _process_tokens(self, grown: list[Sequence], extra: dict) -> None:
        """Stop checks on each sequence's new last token; the stopped ones finish. Its
        logprobs (and logits row) wait for the next delta."""
        touched, record = self._touched, self.record_logits
        for seq in grown:
            if seq.matcher is not None and not self._advance_grammar(seq):
                continue
            touched[seq.seq_id] = seq
            if extra:
                logprob, logits_row = extra.get(seq.seq_id, (None, None))
                if logprob is not None:
                    seq.new_logprobs.append(logprob)
                if record:
                    seq.new_logits.append(np.array(logits_row, dtype=np.float32))
            # most tokens end nothing: the full checks only where one could
            if (
                seq.last_token_id in seq.stop_ids
                or seq.num_tokens >= seq.max_num_tokens
                or seq.matcher is not None
            ):
                reason = self._stop_reason(seq)
                if reason is not None:
                    self._finish(seq, reason)

    def _stop_reason(self, seq: Sequence) -> str | None:
        """A finished grammar; EOS or a stop token id once min_tokens are out (the token id is
        the stop_reason; EOS comes first); else the length limits, max_tokens and
        max_model_len (``seq.max_num_tokens``). Stop strings are the frontend's."""
        if seq.matcher is not None and seq.matcher.is_stopped():
            return "stop"  # its grammar is complete: nothing but EOS could follow
        token, p = seq.last_token_id, seq.params
        if token in seq.stop_ids and seq.num_output_tokens >= p.min_tokens:
            if p.ignore_eos or token not in self.eos_token_ids:
                seq.stop_reason = token
            return "stop"
        if seq.num_tokens >= seq.max_num_tokens:
            return "length"
        return None

    def _advance_grammar(self, seq: Sequence) -> bool:
        """Feed seq's new token to its grammar; a token it refuses (or a matcher error) ends
        the sequence as an error, never as unconstrained text."""
        if seq.matcher.accept(seq.last_token_id):
            return True
        why = seq.matcher.error or f"token {seq.last_token_id} is not allowed by the grammar"
        self._fail(seq, f"structured output: {why}")
        return False

    def _abort_unsampled(self, seqs, ids) -> None:
        """Sequences whose row had no token to pick (NaN or all banned) end as an error."""
        for seq, t in zip(seqs, ids, strict=True):
            if t == NO_TOKEN:
                self._fail(seq, "sampling failed: no finite logit to pick a token from")

    def _fail(self, seq: Sequence, why: str) -> None:
        seq.error = why
        self._touched[seq.seq_id] = seq
        self._finish(seq, "abort")  # its blocks go back now
