"""The engine core: requests as token ids in, one scheduled forward per ``step()``, token-id
deltas out. It holds the scheduler, the block manager and the model runner (which holds the
sampler); the frontend (engine/frontend/llm_engine.py, in this process, or
engine/frontend/core_client.py, in another) tokenizes, detokenizes, looks for stop strings and
builds the outputs.

add_request -> one Sequence per sample (its RNG, stop ids, bad words, grammar, length limit)
step        -> 0. drafts for the running decodes (speculative decoding: engine/core/spec_step.py)
            -> 1. Scheduler.schedule
            -> 2. ModelRunner.execute: swaps, the forward, sampling or draft verification ->
               a RunnerOutput (each sequence's token; each speculated run's accepted tokens)
            -> 3. Updater.update (engine/core/update.py): append the tokens (Scheduler.update,
               one at a time for accepted drafts), stop checks on ids (EOS, stop token ids,
               max_tokens, max_model_len, a finished grammar), grammars advanced, finished
               sequences' blocks freed
            -> 4. a ``SampleDelta`` per sequence with news: its new token ids (and logprobs),
               how it ended
finish_sample -> the frontend found a stop string: that sequence ends, its blocks go back

``async_scheduling``: a step of plain-greedy decodes alone is launched, not waited for. The next
``step()`` schedules as if each of its sequences had its token (a ``PENDING_TOKEN``), launches the
next such step (the device takes those tokens from the ids of the step before), and only then
reads the launched step's ids and runs 3. and 4. for them while the device computes: outputs lag
one step. Any other step first reads back the step in flight, then runs as above.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref

import numpy as np

from engine import tracing
from engine.backends.kv_groups import KVGroups, model_groups
from engine.config import EngineConfig
from engine.core.async_step import InFlight, can_overlap
from engine.core.block_manager import BlockManager
from engine.core.memory import plan_kv_cache
from engine.core.messages import (
    CoreOutputs,
    CoreRequest,
    CoreStats,
    core_stats,
)
from engine.core.model_runner import ModelRunner
from engine.core.pooling_runner import PoolingRunner
from engine.core.sampler import Sampler
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence, model_eos_ids
from engine.core.spec_step import Speculator, draft_backend, spec_counters
from engine.core.update import Updater
from engine.executor import configured_backend
from engine.kv_offload import KVConnector, make_connector
from engine.kv_offload.cache_key import engine_key
from engine.lora.manager import LoRAManager
from engine.sampling_params import SamplingParams
from model_loader.load import LoadedModel

log = logging.getLogger("engine")


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
        log.info("model %s: %s", self.loaded.source, mc.summary())
        self.backend = backend_factory(mc, self.loaded.weights, cfg)
        score = self.loaded.weights.score  # (L, D) a classifier's head (kept on the host)
        # speculative decoding's draft model, checked against this one
        draft = draft_backend(cfg, self.loaded, self.draft_loaded, backend_factory)
        self.kv_groups = self._groups()
        tiers = cfg.kv_offload_bytes or cfg.kv_cache_dir  # keyed while the weights are here
        tier_key = engine_key(self.loaded, self.backend, cfg, self.kv_groups) if tiers else None
        # the backends hold their own packed copies: the loaded arrays go (unless the caller
        # keeps them), so a run's memory is its packed weights, not those plus the file's
        self.loaded, self.draft_loaded = dataclasses.replace(self.loaded, weights=None), None
        self.kv_plan = plan_kv_cache(cfg, self.backend, draft, self.kv_groups)
        num_blocks, num_cpu_blocks = self.kv_plan.num_blocks, self.kv_plan.num_cpu_blocks
        self.backend.allocate_kv_cache(num_blocks, num_cpu_blocks)
        self.spec = Speculator(cfg, draft, self.kv_plan.num_draft_blocks)
        self.drafter, self.spec_stats = self.spec.drafter, self.spec.stats
        self.connector = None if tier_key is None else self._make_tiers(tier_key)
        self.lora = LoRAManager(cfg, mc, self.backend) if cfg.enable_lora else None
        self.block_manager = BlockManager(
            num_blocks,
            cfg.block_size,
            num_cpu_blocks,
            enable_caching=cfg.enable_prefix_caching,
            connector=self.connector,
            windows=self.kv_groups.windows,
        )
        self.scheduler = Scheduler(cfg, self.block_manager, lora=self.lora)
        self.eos_token_ids = model_eos_ids(self.loaded)
        self.sampler = Sampler(self.eos_token_ids, structured=self._make_compiler)
        self.runner = self._make_runner(score)
        if self.connector is not None:  # at exit the pool's cached blocks go to the tiers
            self._close_tiers = weakref.finalize(
                self, close_tiers, self.connector, self.block_manager, self.backend
            )
        self.trace_schedule = tracing.ScheduleTracer(
            self.block_manager, cfg.block_size, cfg.preemption_mode
        )
        self._counter = itertools.count()
        self.requests: dict[str, list[Sequence]] = {}  # live requests' sequences, by sample
        self.num_added_seqs = 0  # every sequence ever queued (a core process's frontend counts)
        pooling = isinstance(self.runner, PoolingRunner)
        owners = (self.spec, self.runner) if pooling else (self.spec,)  # state per sequence
        args = (self.scheduler, self.spec, self.requests, self.eos_token_ids, self.record_logits)
        self.updater = Updater(*args, owners=owners)
        # step 3 for the runner's output: sampled tokens, or a pooling runner's vectors
        self._apply = self.updater.update_pooled if pooling else self.updater.update
        self.in_flight: InFlight | None = None  # async scheduling: the step launched last
        # a sequence this long would be rejected by the scheduler: read its pending token first
        # (with sliding windows, a sequence holds only its windows' blocks in those groups)
        self._longest_ok = longest_fitting(self.block_manager, cfg.max_model_len)
        self.recorder = None  # engine/frontend/recorder.py's Recorder attaches itself here

    def _groups(self) -> KVGroups:
        """The model's KV groups, handed to the backend (an executor's: every rank's) when
        there are several; one group of every layer where the backend does not run groups."""
        mc = self.model_config
        why = None if self.backend.supports_kv_groups else f"backend {self.backend.name!r}"
        groups = model_groups(mc, enabled=False if why else None)
        if why and model_groups(mc).grouped:
            log.info("KV groups off (%s): every block of every layer is kept", why)
        if groups.grouped:
            self.backend.use_kv_groups(groups)
        return groups

    def _make_runner(self, score) -> ModelRunner:
        """The generating runner, or with runner='pooling' the pooling one (``score``: a
        classifier's (L, D) head, kept on the host in float64)."""
        parts = (self.model_config, self.config, self.backend, self.sampler, self.record_logits)
        groups = self.kv_groups if self.kv_groups.grouped else None
        kw = dict(lora=self.lora, connector=self.connector, kv_groups=groups)
        if self.config.runner != "pooling":
            return ModelRunner(*parts, **kw)
        head = None if score is None else np.asarray(score, np.float64)  # (L, D)
        return PoolingRunner(*parts, classifier=head, **kw)

    def _make_tiers(self, key) -> KVConnector:
        """The KV tiers under the prefix cache, handed to the block manager (which evicts into
        them) and the runner (which moves the bytes); at exit the pool's cached blocks are
        saved and the disk writes finished (``shutdown``, or when the interpreter exits)."""
        shape = self.backend.cache_shape(1)  # (L, 2, 1, bs, Hkv, hd)
        block_shape = shape[:2] + shape[3:]  # (L, 2, bs, Hkv, hd)
        return make_connector(self.config, key, block_shape, self.backend.block_dtype)

    def _make_compiler(self):
        """The structured-output compiler (the sampler builds it when a request first needs it)."""
        from engine.core.structured import model_compiler

        return model_compiler(self.loaded, self.eos_token_ids)

    def shutdown(self) -> None:
        """With KV tiers: the cached blocks still in the pool are saved to the tiers, and the
        disk tier's writes finished, so a restarted engine finds them. Parallel ranks (an
        executor's workers or Ray actors) stop."""
        if self.connector is not None:
            self._close_tiers()  # the connector is empty from now on
            self.connector = None
        getattr(self.backend, "shutdown", lambda: None)()

    # ---- requests ----
    def add_request(self, req: CoreRequest, max_waiting: int | None = None) -> None:
        """Queue one request's sequences; ValueError for a constraint that does not compile,
        QueueFullError when more than ``max_waiting`` sequences would wait beyond the free run
        slots (None: no limit)."""
        params = req.params
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is not a new string id")
        if max_waiting is not None:
            self.scheduler.check_queue(params.n, max_waiting)
        if req.lora_request is not None:  # read now: a bad adapter is this request's error
            live = {s.lora_id for seqs in self.requests.values() for s in seqs}
            self.lora.load(req.lora_request, live)
        eos = () if params.ignore_eos else self.eos_token_ids
        stop_ids = frozenset(params.stop_token_ids).union(eos)
        limit = self.config.max_model_len
        seqs = [
            Sequence.of_request(req, i, self._generator(params, i), stop_ids, limit)
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            compiler = self.structured_compiler()
            compiler.compile(params.structured_outputs)  # a ValueError names a bad constraint
            for seq in seqs:  # (after a reasoning model's thinking, where reasoning_end is set)
                seq.matcher = compiler.matcher(params.structured_outputs)
        self.requests[req.request_id] = seqs
        self.num_added_seqs += len(seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        tracing.queued(req.request_id, req.prompt_token_ids, len(self.scheduler.waiting))

    def structured_compiler(self):
        """The sampler's structured-output compiler, built on first use."""
        return self.sampler.structured_compiler()

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
            self.updater.touched.pop(seq.seq_id, None)
            self.scheduler.finish(seq, "abort")  # a no-op for one already finished
            self.updater.forget(seq)
        self._release_drafts()
        return True

    def finish_sample(self, request_id: str, index: int, num_tokens: int) -> None:
        """The frontend found a stop string in sample ``index`` at its output token
        ``num_tokens``: it ends there (the tokens after it are dropped; no delta follows)."""
        seqs = self.requests.get(request_id)
        if seqs is None or seqs[index].is_finished:
            return
        seq = seqs[index]
        self.updater.touched.pop(seq.seq_id, None)
        self.updater.finish(seq, "stop")
        seq.truncate_output(num_tokens)
        self._release_drafts()

    def _release_drafts(self) -> None:
        self.spec.release(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> CoreStats:
        spec = spec_counters(self.spec_stats) if self.config.speculative else None
        experts = self.runner.backend.expert_tokens()
        return core_stats(self.scheduler, self.num_added_seqs, spec, experts)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        self.spec.check_invariants()

    # ---- the loop ----
    def step(self) -> CoreOutputs:
        """One scheduled forward; a delta for every sequence that got a token, finished or was
        rejected in it."""
        if self.in_flight is not None and self._would_reject(self.in_flight):
            self._drain()
        speculates = self.config.speculative is not None and not self.record_logits
        if speculates and self.in_flight is None:
            self.spec.propose(self.scheduler.running)  # 0. drafts for the decodes
        # 1. schedule: who runs, with which blocks; who can never run
        out = self.scheduler.schedule(self.spec.drafts)
        self.updater.rejected(self.scheduler.take_rejected())
        self.trace_schedule(out)
        if self.recorder is not None:
            self.recorder.on_schedule(out)
        if can_overlap(self.config, self.record_logits, out):
            self._launch(out)  # 2.-3. for the step before, while this one runs
            outputs = self._outputs()  # 4.
            self.scheduler.advance(out)  # then its sequences take their pending tokens
            return outputs
        self._drain()  # async scheduling: the step in flight is read and processed first
        if not out.is_empty or out.drafts:
            result = self.runner.execute(out)  # 2. execute: the forward, sampling, verifying
            self._apply(out, result)  # 3. update: append, stop checks, free the finished
        self._release_drafts()
        return self._outputs()  # 4. the deltas

    def _outputs(self) -> CoreOutputs:
        return CoreOutputs(self.updater.deltas(), time.monotonic(), self.stats())

    # ---- async scheduling ----
    def _would_reject(self, flight: InFlight) -> bool:
        """Whether a sequence of the step in flight would be rejected by the next schedule (its
        length): its token is read first, so the outputs come in the order they do without
        async scheduling."""
        return max(seq.num_tokens for seq in flight.seqs) > self._longest_ok

    def _launch(self, out: SchedulerOutput) -> None:
        """Launch the decodes of ``out``; then read the step before and process its tokens
        (``Scheduler.advance(out)`` follows once the outputs are built)."""
        prev = self.in_flight
        flight = self.runner.launch(out, prev)
        self.in_flight = None
        if prev is not None:
            self.updater.process_flight(prev)
        self.in_flight = flight

    def _drain(self) -> None:
        """Read the step in flight, if any, and process its tokens."""
        if self.in_flight is not None:
            flight, self.in_flight = self.in_flight, None
            self.updater.process_flight(flight)


def close_tiers(connector: KVConnector, bm: BlockManager, backend, batch: int = 64) -> None:
    """Save the pool's cached blocks that some tier lacks, ``batch`` blocks a read, then close
    the tiers (the disk tier's writes finished)."""
    try:
        todo = [
            (b, h, bm.block_keys[b], g)
            for b, h in bm.block_hash.items()
            if connector.missing(h, g := bm.block_group.get(b, 0))
        ]
        for i in range(0, len(todo), batch):
            connector.save_pool_blocks(backend, todo[i : i + batch])
    finally:
        connector.close()


def longest_fitting(bm: BlockManager, max_model_len: int) -> int:
    """The longest sequence (at most max_model_len) whose blocks at a decode step fit the pool."""
    lo, hi = 0, max_model_len  # lo fits (or is 0), hi + 1 does not or is past the limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if bm.peak_blocks(mid, 1) <= bm.num_blocks else (lo, mid - 1)
    return lo
