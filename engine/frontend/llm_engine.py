"""The engine as a caller sees it: a frontend (tokenize, validate, detokenize, stop strings,
outputs) around an engine core (scheduler, block manager, forward, sampling:
engine/core/engine_core.py), in this process or, with ``engine_core_process``, in its own
(engine/frontend/core_client.py).

add_request -> 1. validate and tokenize (request_checks)  2. OutputProcessor.add_request
            -> 3. core.add_request: one Sequence per sample joins the waiting queue
step        -> 4. core.step: one scheduled forward, a token-id delta per sequence with news
            -> 5. OutputProcessor.process: text, stop strings (a sample one ends is finished in
               the core)  6. OutputProcessor.outputs: every request with news (with
               ``stream=False`` only the finished ones; text is detokenized as it is read)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator

from engine.config import EngineConfig, make_config
from engine.core.engine_core import EngineCore
from engine.core.messages import CoreRequest, CoreStats
from engine.frontend.input_processor import FrontendState
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.request_checks import RequestChecks
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput, StreamChunk
from engine.pooling_params import matryoshka_dimensions, pooling_defaults
from engine.sampling_params import SamplingParams
from model_loader.load import LoadedModel, default_model, load_model

log = logging.getLogger("engine")


class LLMEngine(FrontendState):
    """``LLMEngine(model, **engine_args)``: engine_args are ``EngineConfig`` fields.

    ``record_logits=True`` keeps every sampled row of logits (for ``engine.diff``); ``loaded``
    reuses an already loaded model (tests share one between engines), ``draft_loaded`` the
    same for a draft model; ``backend_factory`` ``(model_config, weights, config) -> Backend``
    replaces the configured backend (the host benchmark's ``StubBackend``). These three stay
    in this process: not with ``engine_core_process``.
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
        if config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size: replicas run behind the server (python -m engine.serve "
                "--data-parallel-size N); one engine is one replica"
            )
        if not config.model and loaded is None:
            name, why = default_model()
            log.info("model: %s (%s)", name, why)
            config = dataclasses.replace(config, model=name)
        if loaded is None:  # beside a core process, which loads the weights, none here
            loaded = load_model(config.model, weights=not config.engine_core_process)
        self.init_frontend(config, loaded)
        # runner='pooling': the PoolingParams of a request that sets none, and the checkpoint's
        # sentence-transformers prompts (name -> text put before an input) and default one
        self.pooling_defaults, self.prompts, self.default_prompt_name = pooling_defaults(config)
        self.checks = RequestChecks(self, matryoshka_dimensions(config))
        self.output_processor = OutputProcessor(self.tokenizer, record_logits)
        self._counter = itertools.count()
        self._core_ids = itertools.count()
        if self.config.engine_core_process:
            from engine.frontend.core_client import CoreClient

            CoreClient.check_local(
                dict(
                    record_logits=record_logits,
                    draft_loaded=draft_loaded,
                    backend_factory=backend_factory,
                )
            )
            self.loaded = dataclasses.replace(self.loaded, weights=None)  # the core's, not ours
            self.core = CoreClient(self.config, self.loaded)
        else:
            self.core = EngineCore(
                self.loaded,
                self.config,
                record_logits=record_logits,
                draft_loaded=draft_loaded,
                backend_factory=backend_factory,
            )
            self.loaded = self.core.loaded  # without the weights: the backend has its own

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams for a request that sets only ``overrides``: the model's defaults
        (``sampling_defaults``) under them."""
        return SamplingParams(**{**self.sampling_defaults, **overrides})

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> LLMEngine:
        return cls(config=config, **kwargs)

    # the in-process core's parts, for tests, benchmarks and the recorder
    scheduler = property(lambda self: self.core.scheduler)
    block_manager = property(lambda self: self.core.block_manager)
    backend = property(lambda self: self.core.backend)
    runner = property(lambda self: self.core.runner)
    sampler = property(lambda self: self.core.sampler)
    drafter = property(lambda self: self.core.drafter)
    spec_stats = property(lambda self: self.core.spec_stats)
    kv_plan = property(lambda self: self.core.kv_plan)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)

    @property
    def recorder(self):
        return self.core.recorder

    @recorder.setter
    def recorder(self, recorder) -> None:
        if not isinstance(self.core, EngineCore):  # it reads the scheduler and block pool
            raise ValueError(
                "a Recorder records an in-process engine core: not with engine_core_process"
            )
        self.core.recorder = recorder

    # ---- requests ----
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        max_waiting: int | None = None,
        final_only: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[int]:
        """Validate and queue one request (ValueError for bad input); returns its prompt ids.

        ``arrival_time``: seconds on ``time.monotonic()``'s clock (None: now); ``max_waiting``:
        a QueueFullError when more sequences would wait beyond the free run slots;
        ``final_only``: ``step`` gives its output once, when it finishes (vLLM's
        ``RequestOutputKind.FINAL_ONLY``: none is built per step for a caller that reads only
        the last); ``lora_request``: the adapter it runs with (``enable_lora``). Every check runs
        before anything is queued or allocated, the cheap ones first."""
        if not isinstance(request_id, str) or request_id in self.output_processor:
            raise ValueError(f"request_id {request_id!r} is not a new string id")
        params = self.default_sampling_params() if params is None else params
        text, ids, arrival, bad = self.checks.check(prompt, params, arrival_time, lora_request)
        # a core process may still send about an earlier request of this id: its own id there
        core_id = (
            f"{request_id}@{next(self._core_ids)}" if self.config.engine_core_process else None
        )
        self.output_processor.add_request(
            request_id, text, ids, params, arrival, core_id, final_only
        )
        req = CoreRequest(core_id or request_id, ids, params, arrival, bad, lora_request)
        try:
            self.core.add_request(req, max_waiting)
        except BaseException:
            self.output_processor.abort(request_id)
            raise
        return ids

    def structured_compiler(self):
        """The core's structured-output compiler (this process's own beside a core process):
        a constraint that compiles here compiles there."""
        return self.core.structured_compiler()

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back at once. False if unknown."""
        core_id = self.output_processor.abort(request_id)
        if core_id is None:
            return False
        self.core.abort(core_id)
        return True

    abort_request = abort  # vLLM's name

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def core_stats(self) -> CoreStats:
        """The core's queues and counters (a core process's: as its last message said)."""
        return self.core.stats()

    def check_invariants(self) -> None:
        self.core.check_invariants()

    def check_core(self) -> None:
        """A RuntimeError if a core process has died (a no-op for the in-process core)."""
        getattr(self.core, "check_alive", lambda: None)()

    def shutdown(self) -> None:
        """Stop a core process; the in-process core saves its KV tiers (when on)."""
        getattr(self.core, "shutdown", lambda: None)()

    # ---- the loop ----
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """One scheduled forward. Returns an output for every request that got a token, finished
        or was rejected in this step (finished requests are then forgotten). ``stream=False``:
        only for the requests that finished, for a caller that reads final outputs alone (no
        per-step outputs are built, and text is detokenized once, at the end)."""
        out = self.core.step()  # 0.-4. in the core
        if out is None:  # a core process sent nothing yet
            return []
        for rid, index, kept in self.output_processor.process(out.deltas, out.now):  # 5.
            self.core.finish_sample(rid, index, kept)
        return self.output_processor.outputs(stream)  # 6.

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
