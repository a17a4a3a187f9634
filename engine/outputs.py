"""What the engine hands back per request, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestMetrics:
    """Times as vLLM reports them: ``time.time()`` seconds (wall clock). The intervals (ttft,
    itl, e2e_latency) are measured on ``time.monotonic()``'s clock, so a clock step between two
    moments never shows in them."""

    arrival_time: float  # time.time() seconds
    first_token_time: float | None = None  # time.time() seconds
    finish_time: float | None = None  # time.time() seconds
    itl: list[float] = field(default_factory=list)  # seconds between successive tokens
    ttft: float | None = None  # time to first token: arrival -> first generated token
    e2e_latency: float | None = None  # arrival -> finish

    def as_dict(self) -> dict:
        return dict(
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            ttft=self.ttft,
            e2e_latency=self.e2e_latency,
            itl=list(self.itl),
        )


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    # the stop string (str) or stop token id (int) that ended it; None for EOS, length or abort
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}
    text_delta: str = ""  # text that is new since the previous output of this request
    step_logits: list[np.ndarray] | None = None  # (V,) per token; only with record_logits
    error: str | None = None  # why the engine aborted it (e.g. the prompt can never fit)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' log-probabilities (only when logprobs were asked for)."""
        if self.logprobs is None:
            return None
        return float(sum(lp[t] for t, lp in zip(self.token_ids, self.logprobs, strict=True)))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (if on)
    # with SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} (None first)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # the pooling runner's vector for the prompt

    # convenience: the first (usually only) completion
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def as_dict(self) -> dict:
        """The JSON the CLI prints for one request."""
        d = dict(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.text,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            metrics=self.metrics.as_dict(),
        )
        if len(self.outputs) > 1:
            d["outputs"] = [
                dict(text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason)
                for o in self.outputs
            ]
        return d


@dataclass(frozen=True)
class StreamChunk:
    """What ``LLMEngine.stream`` yields: one sample's new text, and how it ended once it did."""

    index: int  # which of the request's n samples
    text: str  # new since this sample's previous chunk ("" for a last chunk with no new text)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the sample's last chunk
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if one


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled vector (normalized, cut, as its PoolingParams asked)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s answer for one prompt (vLLM's shape: ``.outputs.embedding``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float  # a reranker's relevance in (0, 1): P(yes) against P(no), or a one-label
    #   classifier's sigmoid


@dataclass
class ClassificationOutput:
    probs: list[float]  # each label's probability (softmax, or sigmoid: classifier_activation)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify``'s answer for one prompt (vLLM's shape: ``.outputs.probs``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s answer for one document (vLLM's shape: ``.outputs.score``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
