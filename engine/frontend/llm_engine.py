"""The engine as a caller sees it: a frontend (tokenize, validate, detokenize, stop strings,
outputs) around an engine core (scheduler, block manager, forward, sampling:
engine/core/engine_core.py), in this process or, with ``engine_core_process``, in its own
(engine/frontend/core_client.py).

add_request -> 1. tokenize and validate (input_processor)  2. OutputProcessor.add_request
            -> 3. core.add_request: one Sequence per sample joins the waiting queue
step        -> 4. core.step: one scheduled forward, a token-id delta per sequence with news
            -> 5. OutputProcessor.process: text, stop strings (a sample one ends is finished in
               the core)  6. OutputProcessor.outputs: every request with news (with
               ``stream=False`` only the finished ones; text is detokenized as it is read)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from engine.config import EngineConfig, make_config
from engine.core.engine_core import EngineCore
from engine.core.messages import CoreRequest, CoreStats
from engine.frontend.input_processor import (
    FrontendState,
    bad_words_token_ids,
    check_arrival_time,
    check_token_ids,
    tokenize_prompt,
)
from engine.frontend.output_processor import OutputProcessor
from engine.lora.adapter import load_adapter
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput, StreamChunk
from engine.pooling_params import PoolingParams, checkpoint_pooling
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
        self.matryoshka = matryoshka_dimensions(config)  # the dimensions cuts it declares
        self.output_processor = OutputProcessor(self.tokenizer, record_logits)
        self._counter = itertools.count()
        self._core_ids = itertools.count()
        self._checked_adapters: set = set()  # (lora_int_id, path) read here (a core process)
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

    def _check_pooling(self, p: PoolingParams) -> None:
        """What the model cannot do for ``p``: a classifier's task without a score head, token
        logits from a classifier (it has no LM head), a Matryoshka cut it does not declare."""
        labels = self.model_config.num_labels
        if p.task == "classify" and not labels:
            raise ValueError(
                "classify needs a sequence classifier (a *ForSequenceClassification checkpoint "
                "with a score head); this model has none"
            )
        if p.score_tokens is not None and labels:
            raise ValueError(
                "score_tokens: this model is a sequence classifier, with no LM head to read "
                "token logits from; its scores come from its own head (leave score_tokens out)"
            )
        if p.task == "score" and p.score_tokens is None and labels != 1:
            raise ValueError(
                "score without score_tokens needs a one-label classifier; this model has "
                f"{labels or 'no'} label{'s' if labels != 1 else ''}: give the yes/no token ids"
            )
        if p.dimensions is not None:
            self._check_dimensions(p.dimensions)

    def _check_dimensions(self, d: int) -> None:
        """A Matryoshka cut the model declares (config.json's matryoshka_dimensions or
        is_matryoshka, as vLLM reads them), no longer than its hidden size."""
        hidden = self.model_config.hidden_size
        if self.matryoshka is None:
            raise ValueError(
                f"dimensions: this model does not declare Matryoshka embeddings (config.json "
                f"matryoshka_dimensions or is_matryoshka); its vectors have {hidden}"
            )
        if d > hidden:
            raise ValueError(f"dimensions {d} is more than the model's {hidden}")
        if self.matryoshka and d not in self.matryoshka:
            raise ValueError(f"dimensions {d} is not one the model declares: {self.matryoshka}")

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
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        mc, cfg = self.model_config, self.config
        if (params.pooling is not None) != (cfg.runner == "pooling"):
            if cfg.runner == "pooling":
                raise ValueError(
                    "this engine was started with runner='pooling': it embeds prompts "
                    "(LLM.embed, /v1/embeddings) and generates nothing"
                )
            raise ValueError("a pooling request needs an engine started with runner='pooling'")
        if params.pooling is not None:
            self._check_pooling(params.pooling)
        if params.n > cfg.max_num_seqs:
            raise ValueError(f"n must be in [1, max_num_seqs={cfg.max_num_seqs}], got {params.n}")
        arrival = check_arrival_time(arrival_time)
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(
                    f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
                )
            if not cfg.enable_lora:
                raise ValueError("lora_request needs an engine made with enable_lora=True")
            lora_request.check()
            if cfg.engine_core_process:  # the core's refusal would come back as an abort
                self._check_adapter(lora_request)
        text, ids = tokenize_prompt(
            prompt, self.tokenizer, mc.vocab_size, cfg.max_model_len, self.max_prompt_chars
        )
        check_token_ids(params, mc.vocab_size)
        bad = bad_words_token_ids(self.tokenizer, params.bad_words or [])
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

    def _check_adapter(self, req: LoRARequest) -> None:
        """Read ``req``'s adapter here once (a ValueError names what is wrong), so that a core
        process's requests are refused as an in-process core's are."""
        key = (req.lora_int_id, req.lora_path)
        if key not in self._checked_adapters:
            load_adapter(req.lora_path, self.model_config, self.config.max_lora_rank, req.lora_name)
            self._checked_adapters.add(key)

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


def pooling_defaults(config) -> tuple[PoolingParams | None, dict[str, str], str | None]:
    """The pooling runner's PoolingParams for a request that sets none (the checkpoint's
    sentence-transformers config under ``pooler_config``'s keys), its prompts and default
    prompt name (``pooler_config``'s ``default_prompt_name`` over the checkpoint's); None,
    {}, None for a generate engine."""
    if config.runner != "pooling":
        return None, {}, None
    found = {}
    if config.model and Path(config.model).is_dir():  # a GGUF or a name: no such config
        found = checkpoint_pooling(config.model)
    prompts, default = found.pop("prompts", {}), found.pop("default_prompt_name", None)
    over = dict(config.pooler)
    default = over.pop("default_prompt_name", default)
    if default is not None and default not in prompts:
        known = ", ".join(prompts) or "none"
        raise ValueError(f"default_prompt_name: {default!r} is not one of the model's prompts "
                         f"({known})")  # fmt: skip
    return PoolingParams(**{**found, **over}), prompts, default


def matryoshka_dimensions(config) -> list[int] | None:
    """The Matryoshka cuts a pooling model directory's config.json declares: its
    ``matryoshka_dimensions`` ([] for ``is_matryoshka`` without a list: any cut), None when it
    declares none (or there is no directory, or the engine generates: not read then)."""
    conf = Path(config.model) / "config.json" if config.model else None
    if config.runner != "pooling" or conf is None or not conf.is_file():
        return None
    raw = json.loads(conf.read_text())
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        return sorted(dims)
    return [] if raw.get("is_matryoshka") else None
