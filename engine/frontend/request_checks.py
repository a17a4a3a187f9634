"""What ``LLMEngine.add_request`` checks before anything is queued or allocated, cheapest first:
the parameters' type, the engine's runner against the request's kind (a pooling request, its
task, head and Matryoshka cut), ``n``, the arrival time, the adapter, then the prompt
(tokenized and bounded), its token-id fields and its bad words. A bad request is one
ValueError naming what is wrong.
"""

from __future__ import annotations

from engine.frontend.input_processor import (
    bad_words_token_ids,
    check_arrival_time,
    check_token_ids,
    tokenize_prompt,
)
from engine.lora.adapter import load_adapter
from engine.lora.request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class RequestChecks:
    """``frontend``: what the checks read of the engine (a ``FrontendState``: the resolved
    config, the model config, the tokenizer, the prompt bound); ``matryoshka``: the
    Matryoshka cuts a pooling model declares (None: none)."""

    def __init__(self, frontend, matryoshka: list[int] | None):
        self.config, self.model_config = frontend.config, frontend.model_config
        self.tokenizer, self.max_prompt_chars = frontend.tokenizer, frontend.max_prompt_chars
        self.matryoshka = matryoshka
        self._checked_adapters: set = set()  # (lora_int_id, path) read here (a core process)

    def check(self, prompt, params, arrival_time, lora_request) -> tuple:
        """(text or None, prompt ids, arrival time, bad words as ids) of a request that passes
        every check."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        self._check_kind(params)
        arrival = check_arrival_time(arrival_time)
        if lora_request is not None:
            self._check_lora(lora_request)
        mc, cfg = self.model_config, self.config
        text, ids = tokenize_prompt(
            prompt, self.tokenizer, mc.vocab_size, cfg.max_model_len, self.max_prompt_chars
        )
        check_token_ids(params, mc.vocab_size)
        bad = bad_words_token_ids(self.tokenizer, params.bad_words or [])
        return text, ids, arrival, bad

    def _check_kind(self, params: SamplingParams) -> None:
        """A pooling request on a pooling engine and only there; ``n`` within max_num_seqs."""
        cfg = self.config
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

    def _check_lora(self, lora_request) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        if not self.config.enable_lora:
            raise ValueError("lora_request needs an engine made with enable_lora=True")
        lora_request.check()
        if self.config.engine_core_process:  # the core's refusal would come back as an abort
            self._check_adapter(lora_request)

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

    def _check_adapter(self, req: LoRARequest) -> None:
        """Read ``req``'s adapter here once (a ValueError names what is wrong), so that a core
        process's requests are refused as an in-process core's are."""
        key = (req.lora_int_id, req.lora_path)
        if key not in self._checked_adapters:
            load_adapter(req.lora_path, self.model_config, self.config.max_lora_rank, req.lora_name)
            self._checked_adapters.add(key)
