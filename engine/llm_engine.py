"""The engine loop: requests in, one scheduled forward per ``step()``, outputs back.

add_request -> tokenize, validate, one Sequence per sample -> Scheduler.add (waiting queue)
step        -> 1. Scheduler.schedule  2. ModelRunner.execute (swaps, forward)  3. Sampler.sample
            -> 4. Scheduler.update (append tokens; OutputProcessor: stop checks)
            -> 5. OutputProcessor.outputs (every request with news; with ``stream=False`` only
               the finished ones; text is detokenized as it is read)
            (a step whose rows are all plain greedy asks the backend for argmax ids instead of
            logits, so no (B, V) array reaches the host: ``sampler.plain_greedy``)

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
from collections.abc import Iterator

import numpy as np

from reference.loader import LoadedModel, default_model, load_model

from . import tracing
from .backends import get_backend
from .backends.numpy_backend import greedy_ids
from .block_manager import BlockManager
from .config import EngineConfig, make_config
from .input_processor import max_prompt_chars, tokenize_prompt
from .memory import plan_kv_cache
from .model_runner import ModelRunner, needs_rows, output_row_counts, wants_prompt_rows
from .output_processor import OutputProcessor
from .outputs import RequestOutput, StreamChunk
from .sampler import (
    NO_TOKEN,
    Sampler,
    plain_greedy,
    rows_to_sample,
    sampling_probs,
    top_logprobs,
)
from .sampling_params import SamplingParams, generation_defaults, is_real
from .scheduler import Scheduler, SchedulerOutput
from .sequence import PENDING_TOKEN, Sequence
from .spec_decode import DraftModel, SpecStats, accept_greedy, accept_sampled, propose_ngram

log = logging.getLogger("engine")
MAX_SPEC_BACKOFF = 16  # steps without drafts at most, after repeated rejections

# arrival_time is on time.monotonic()'s clock; a value further ahead than this is another clock
# (time.time() is ~1.7e9 s, far beyond any monotonic reading)
ARRIVAL_SLACK_S = 60.0


def check_arrival_time(arrival_time) -> float:
    """arrival_time (None: now) as a float on time.monotonic()'s clock, else a ValueError."""
    now = time.monotonic()
    if arrival_time is None:
        return now
    if not is_real(arrival_time) or not np.isfinite(arrival_time):
        raise ValueError(f"arrival_time must be a finite number of seconds, got {arrival_time!r}")
    if arrival_time > now + ARRIVAL_SLACK_S:
        raise ValueError(
            f"arrival_time must be on time.monotonic()'s clock (now {now:.1f} s, at most "
            f"{ARRIVAL_SLACK_S:g} s ahead), got {arrival_time!r}"
        )
    return float(arrival_time)


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


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word as tokenized alone and with a leading space (as it reads after
    another word); both spellings are banned."""
    out = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


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


def _configured_backend(model_config, weights, config: EngineConfig):
    if config.distributed_executor_backend in ("mp", "ray"):
        from .distributed import executor_backend

        return executor_backend(model_config, weights, config)
    return get_backend(config.backend, model_config, weights, config)


class LLMEngine:
    """``LLMEngine(model, **engine_args)``: engine_args are ``EngineConfig`` fields.

    ``record_logits=True`` keeps every sampled row of logits (for ``engine.diff``); ``loaded``
    reuses an already loaded model (tests share one between engines), ``draft_loaded`` the
    same for a draft model; ``backend_factory``
    ``(model_config, weights, config) -> Backend`` replaces the configured backend (the host
    benchmark's ``StubBackend``).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        draft_loaded: LoadedModel | None = None,
        record_logits: bool = False,
        backend_factory=None,
        **engine_args,
    ):
        if config is None:
            config = make_config(model, **engine_args)
        if not config.model and loaded is None:
            name, why = default_model()
            log.info("model: %s (%s)", name, why)
            config = dataclasses.replace(config, model=name)
        self.loaded = loaded if loaded is not None else load_model(config.model)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.config = config.resolve(self.model_config)
        self.record_logits = record_logits
        self.draft_loaded = draft_loaded
        self.sampling_defaults = self._sampling_defaults()
        self._setup(backend_factory or _configured_backend)

    def _sampling_defaults(self) -> dict:
        """The model's default SamplingParams fields (generation_config 'auto'), else {}."""
        if self.config.generation_config != "auto":
            return {}
        try:
            defaults = generation_defaults(self.loaded.generation_config)
        except ValueError as e:
            raise ValueError(f"generation_config.json: {e}") from None
        if defaults:
            log.info(
                "default sampling parameters from the model's generation_config.json: %s "
                "(--generation-config ignore to use SamplingParams' own)",
                ", ".join(f"{k}={v}" for k, v in defaults.items()),
            )
        return defaults

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams for a request that sets only ``overrides``: the model's defaults
        (``sampling_defaults``) under them."""
        return SamplingParams(**{**self.sampling_defaults, **overrides})

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> LLMEngine:
        return cls(config=config, **kwargs)

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
        self.eos_token_ids = list(mc.eos_token_ids or self.tokenizer.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_ids, cfg.max_model_len, self.record_logits
        )
        self.trace_schedule = tracing.ScheduleTracer(
            self.block_manager, cfg.block_size, cfg.preemption_mode
        )
        self._counter = itertools.count()
        self.in_flight: InFlight | None = None  # async scheduling: the step launched last
        # a sequence this long would be rejected by the scheduler: read its pending token first
        self._longest_ok = min(cfg.max_model_len, num_blocks * cfg.block_size)
        self.recorder = None  # engine/recorder.py's Recorder attaches itself here
        self.spec_stats = SpecStats(cfg.speculative)  # speculative decoding's counters
        if cfg.speculative is not None:
            log.info("speculative decoding: %s", cfg.speculative)
            if cfg.async_scheduling:
                log.info("async scheduling overlaps no step while speculative decoding is on")
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, cfg.max_model_len)

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
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> list[int]:
        """Validate and queue one request (ValueError for bad input); returns its prompt ids.

        ``arrival_time``: seconds on ``time.monotonic()``'s clock (None: now). Every check runs
        before anything is queued or allocated, the cheap ones first."""
        if not isinstance(request_id, str) or request_id in self.output_processor:
            raise ValueError(f"request_id {request_id!r} is not a new string id")
        params = self.default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        mc, cfg = self.model_config, self.config
        if params.n > cfg.max_num_seqs:
            raise ValueError(f"n must be in [1, max_num_seqs={cfg.max_num_seqs}], got {params.n}")
        arrival = check_arrival_time(arrival_time)
        text, ids = tokenize_prompt(
            prompt, self.tokenizer, mc.vocab_size, cfg.max_model_len, self.max_prompt_chars
        )
        self._check_token_ids(params)
        seqs = [Sequence(request_id, ids, params, arrival) for _ in range(params.n)]
        self._attach_rules(seqs, params)
        gens = [self._generator(params, i) for i in range(params.n)]
        self.output_processor.add_request(request_id, text, ids, params, seqs, gens, arrival)
        for seq in seqs:
            self.scheduler.add(seq)
        tracing.queued(request_id, ids, len(self.scheduler.waiting))
        return ids

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in logit_bias and allowed_token_ids must be in the vocabulary."""
        v = self.model_config.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias),
            ("allowed_token_ids", params.allowed_token_ids),
        ):
            bad = [t for t in ids or () if t >= v]
            if bad:
                raise ValueError(
                    f"SamplingParams: {name} has token id {bad[0]}, not below the vocab size {v}"
                )

    def _attach_rules(self, seqs: list[Sequence], params: SamplingParams) -> None:
        """Each sequence's bad words as token ids and its own grammar state (structured output:
        the constraint is compiled, or refused, here)."""
        if params.bad_words:
            ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            for seq in seqs:
                seq.bad_words_ids = ids
        if params.structured_outputs is not None:
            compiler = self.structured_compiler()
            compiler.compile(params.structured_outputs)  # a ValueError names a bad constraint
            for seq in seqs:
                seq.matcher = compiler.matcher(params.structured_outputs)

    def structured_compiler(self):
        """The structured-output compiler over the model's tokenizer, built on first use (about
        half a second for a 49k vocabulary)."""
        if self.sampler.structured is None:
            from .structured import StructuredOutputCompiler

            self.sampler.structured = StructuredOutputCompiler(
                self.tokenizer,
                vocab_size=self.model_config.vocab_size,
                eos_token_ids=self.eos_token_ids,
            )
        return self.sampler.structured

    def _generator(self, params: SamplingParams, index: int) -> np.random.Generator:
        """Per-sequence RNG: the request's seed, else the engine seed and a request counter."""
        if params.seed is not None:
            return np.random.default_rng([params.seed % 2**64, index])
        return np.random.default_rng([self.config.seed % 2**64, next(self._counter), index])

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back at once. False if unknown."""
        if not self.output_processor.abort(request_id):
            return False
        self.scheduler.abort(request_id)
        if self.drafter is not None:
            self.drafter.release_except(seq.seq_id for seq in self.scheduler.running)
        return True

    abort_request = abort  # vLLM's name

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        if self.drafter is not None:
            self.drafter.check_invariants()

    # ---- the loop ----
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """One scheduled forward. Returns an output for every request that got a token, finished
        or was rejected in this step (finished requests are then forgotten). ``stream=False``:
        only for the requests that finished, for a caller that reads final outputs alone (no
        per-step outputs are built, and text is detokenized once, at the end)."""
        if self.in_flight is not None and self._would_reject(self.in_flight):
            self._drain()
        if self.config.speculative is not None:
            self._propose()  # 0. drafts for the decodes (speculative decoding)
        # 1. schedule: who runs, with which blocks; who can never run
        out = self.scheduler.schedule()
        self.output_processor.process_rejected(self.scheduler.take_rejected())
        self.trace_schedule(out)
        if self.recorder is not None:
            self.recorder.on_schedule(out)
        if self._can_overlap(out):
            self._launch(out)  # 2.-4. for the step before, while this one runs
            outputs = self.output_processor.outputs(stream)  # 5.
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
        if self.drafter is not None:  # the draft's blocks of sequences no longer running
            self.drafter.release_except(seq.seq_id for seq in self.scheduler.running)
        # 5. process outputs
        return self.output_processor.outputs(stream)

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
            gens = [self.output_processor.generator(s) for s in plain_seqs]
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
            gen = self.output_processor.generator(seq)
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
        gens = [self.output_processor.generator(s) for s in seqs]
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
        """Stop checks (and text) for each sequence's new last token; the stopped ones finish."""
        now, op = time.monotonic(), self.output_processor
        for seq in grown:
            if seq.matcher is not None and not self._advance_grammar(seq):
                continue
            reason = op.process_token(seq, *extra.get(seq.seq_id, (None, None)), now)
            if reason is not None:
                self.scheduler.finish(seq, reason)  # its blocks go back to the free queue now
                free = self.block_manager.num_free_blocks
                tracing.finished(seq.request_id, reason, seq.num_output_tokens, free)

    def _advance_grammar(self, seq: Sequence) -> bool:
        """Feed seq's new token to its grammar; a token it refuses (or a matcher error) ends
        the sequence as an error, never as unconstrained text."""
        if seq.matcher.accept(seq.last_token_id):
            return True
        why = seq.matcher.error or f"token {seq.last_token_id} is not allowed by the grammar"
        self.scheduler.finish(seq, "abort")
        self.output_processor.process_rejected([(seq, f"structured output: {why}")])
        return False

    def _abort_unsampled(self, seqs, ids) -> None:
        """Sequences whose row had no token to pick (NaN or all banned) end as an error."""
        why = "sampling failed: no finite logit to pick a token from"
        failed = [(s, why) for s, t in zip(seqs, ids, strict=True) if t == NO_TOKEN]
        for seq, _ in failed:
            self.scheduler.finish(seq, "abort")  # its blocks go back now
        self.output_processor.process_rejected(failed)

    # ---- conveniences ----
    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Add one request and drive the engine until it ends, yielding each sample's new text
        as it comes, and its finish reason on its last chunk (other requests in the engine
        advance too). Leaving early (``break``, ``close()``, an exception) aborts the request."""
        rid = f"stream-{next(self._counter)}"
        self.add_request(rid, prompt, params)
        try:
            yield from self._stream_chunks(rid)
        finally:
            self.abort(rid)  # False (a no-op) once it finished

    def _stream_chunks(self, rid: str) -> Iterator[StreamChunk]:
        ended: set[int] = set()  # samples whose last chunk went out
        while self.has_unfinished_requests() and rid in self.output_processor:
            for o in (o for o in self.step() if o.request_id == rid):
                for c in o.outputs:
                    if c.index not in ended and (c.text_delta or c.finished):
                        yield StreamChunk(c.index, c.text_delta, c.finish_reason, c.stop_reason)
                        ended |= {c.index} if c.finished else set()
