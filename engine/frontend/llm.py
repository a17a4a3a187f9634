"""``LLM``: the offline batch API. Add every prompt, step the engine until all finish."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
from tqdm.auto import tqdm

from engine.frontend import harmony
from engine.frontend.chat import chat_prompt_ids, is_conversation
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.recorder import Recorder
from engine.frontend.tokenizer import HFTokenizerAdapter
from engine.lora.request import LoRARequest
from engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling_params import PoolingParams, prompt_before, score_pooling, score_prompt
from engine.sampling_params import SamplingParams, is_integer


class LLM:
    """``LLM(model=..., **engine_args)``; engine_args are ``EngineConfig`` fields.

    ``trace_html="run.html"`` records every step (engine/frontend/recorder.py) and, after each
    ``generate`` or ``chat``, writes the run so far there as a self-contained HTML replay."""

    def __init__(self, model: str | None = None, trace_html: str | None = None, **engine_args):
        if trace_html and engine_args.get("engine_core_process"):
            raise ValueError(
                "trace_html records the scheduler and block pool of an in-process engine core: "
                "not with engine_core_process"
            )
        self.engine = LLMEngine(model, **engine_args)
        self._batch = 0
        self.trace_html = trace_html
        self.recorder = Recorder(self.engine) if trace_html else None

    def shutdown(self) -> None:
        """Stop the engine: a core process exits; KV tiers save the pool's cached blocks and
        finish their disk writes (also done when the interpreter exits)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> HFTokenizerAdapter:
        """The model's tokenizer with Hugging Face's methods (encode, decode, __call__,
        apply_chat_template, eos_token_id, vocab_size, len())."""
        return HFTokenizerAdapter(self.engine.tokenizer)

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come back in input order.
        ``lora_request``: the adapter every prompt runs with, or a list with one per prompt
        (None: the base model); needs ``enable_lora=True``.

        Every prompt is validated before any runs: a bad one is a ValueError naming its index,
        and the engine stays usable."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        ids = self._add_all(prompts, params, loras)
        try:
            done = self._run(ids, use_tqdm)
        except BaseException:  # Ctrl-C or an engine error: nothing of this call keeps running
            self._abort_all(ids)
            raise
        if self.recorder is not None:
            self.recorder.write_html(self.trace_html)
        return [done[r] for r in ids]

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt without SamplingParams gets: the model's generation_config.json
        defaults, with override_generation_config over them (none with generation_config='vllm')."""
        return self.engine.default_sampling_params()

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step until every request of ids finished: request id -> its final output."""
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while len(done) < len(ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step(stream=False):  # finished outputs only
                if out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return done

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation ([{"role", "content"}, ...], any number of turns, system
        prompts included) or a list of them, through the model's chat template (a gpt-oss
        model's: rendered in harmony, engine/frontend/harmony.py, the assistant's turn open
        whatever ``add_generation_prompt`` says)."""
        convs = [messages] if is_conversation(messages) else list(messages)
        tok = self.engine.tokenizer
        speaks_harmony = harmony.uses_harmony(self.engine.model_config)
        prompts = []
        for i, conv in enumerate(convs):
            try:
                if speaks_harmony:
                    prompts.append(harmony.prompt_ids(tok, conv))
                else:
                    prompts.append(chat_prompt_ids(tok, conv, add_generation_prompt))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def embed(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        prompt_name: str | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's vector (an engine made with ``runner="pooling"``): its hidden states
        pooled as ``pooling_params`` says (None: the checkpoint's sentence-transformers config,
        then ``pooler_config``); outputs in input order, ``.outputs.embedding``. A text prompt
        gets the checkpoint's prompt ``prompt_name`` (config_sentence_transformers.json's, as
        sentence-transformers' ``encode(prompt_name=...)``; None: its default prompt, if any)
        put before it; token ids are embedded as given. ``lora_request``: an adapter for all
        prompts or one per prompt (``enable_lora``)."""
        if self.engine.config.runner != "pooling":
            raise ValueError("LLM.embed needs an engine made with runner='pooling'")
        pooling = pooling_params or self.engine.pooling_defaults
        if not isinstance(pooling, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {pooling!r}")
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        inputs = self._with_prompt(prompts, prompt_name)
        outs = self.generate(inputs, params, use_tqdm, lora_request)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding))
            for o in outs
        ]

    def _with_prompt(self, prompts, name: str | None):
        """Text prompts with the checkpoint's prompt ``name`` (or default) before each."""
        e = self.engine
        before = prompt_before(e.prompts, name, e.default_prompt_name)
        if not before:
            return prompts
        if isinstance(prompts, str):
            return before + prompts
        return [before + p if isinstance(p, str) else p for p in prompts]

    def score(
        self,
        query: str,
        documents: str | list[str],
        score_tokens: tuple[int, int] | None = None,
        template: str | None = None,
        instruction: str | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """A reranker's relevance of each document to the query (an engine made with
        ``runner="pooling"``): each pair in ``template`` (Qwen3-Reranker's by default), the
        probability the model gives "yes" against "no" next (``score_tokens``: their ids, by
        default the vocabulary's one-token "yes" and "no"), or a one-label classifier's
        sigmoid of its logit (a *ForSequenceClassification reranker); ``.outputs.score``."""
        if self.engine.config.runner != "pooling":
            raise ValueError("LLM.score needs an engine made with runner='pooling'")
        docs = [documents] if isinstance(documents, str) else list(documents)
        e = self.engine
        pooling = score_pooling(score_tokens, e.model_config.num_labels, e.tokenizer)
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        prompts = [score_prompt(query, d, template, instruction) for d in docs]
        outs = self.generate(prompts, params, use_tqdm)
        return [
            ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.embedding[0]))
            for o in outs
        ]

    def classify(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        activation: bool = True,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities from a sequence classifier (a
        *ForSequenceClassification checkpoint, ``runner="pooling"``): its score head on the
        last token, softmax over the labels (sigmoid for one label or a multi-label problem;
        ``activation=False``: the logits); ``.outputs.probs``, labels in
        ``model_config.labels``' order."""
        if self.engine.config.runner != "pooling":
            raise ValueError("LLM.classify needs an engine made with runner='pooling'")
        pooling = PoolingParams(task="classify", activation=activation)
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        outs = self.generate(prompts, params, use_tqdm)
        return [
            ClassificationRequestOutput(
                o.request_id, o.prompt_token_ids, ClassificationOutput(o.embedding)
            )
            for o in outs
        ]

    def _add_all(self, prompts, params, loras) -> list[str]:
        """Add every prompt; on any failure (a bad prompt, a tokenizer error, Ctrl-C) abort what
        this call added, so nothing of it runs in a later call, and re-raise."""
        self._batch += 1
        ids = [f"{self._batch}-{i}" for i in range(len(prompts))]
        added = []
        try:
            for i, (rid, prompt, p, lora) in enumerate(
                zip(ids, prompts, params, loras, strict=True)
            ):
                try:
                    self.engine.add_request(rid, prompt, p, lora_request=lora)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                added.append(rid)
        except BaseException:
            self._abort_all(added)
            raise
        return ids

    def _abort_all(self, ids: list[str]) -> None:
        for rid in ids:  # a finished request is a no-op
            self.engine.abort(rid)


def run_to_completion(
    engine: LLMEngine, prompts: list, params, check_invariants: bool = False, loras=None
) -> list[RequestOutput]:
    """Add every prompt (request ids "0", "1", ...) and step until all finish: the finished
    outputs in input order. ``params``: one SamplingParams for all, or a list, one per prompt.
    The loop of ``LLM.generate`` without its checks and progress bar, for tools and tests;
    ``check_invariants`` runs the block and queue invariant checks after every step; ``loras``:
    a LoRARequest (or None) per prompt."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    loras = loras or [None] * len(prompts)
    for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras, strict=True)):
        engine.add_request(str(i), prompt, p, lora_request=lora)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step(stream=False)})
        if check_invariants:
            engine.check_invariants()
    return [done[str(i)] for i in range(len(prompts))]


def _as_lora_list(lora_request, n: int) -> list:
    """One LoRARequest (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request: {len(loras)} given for {n} prompts")
    for i, lora in enumerate(loras):
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request {i}: a LoRARequest or None, got {type(lora).__name__}")
    return loras


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        return [prompts]  # one prompt given as an array of token ids
    if isinstance(prompts, Seq) and prompts and all(is_integer(t) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, Seq) or isinstance(prompts, bytes):
        raise ValueError(f"prompts must be a string or a list, got {type(prompts).__name__}")
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
