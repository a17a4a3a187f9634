"""What the engine hands back per request, shaped like vLLM's ``RequestOutput``.

A streaming engine builds an output per request per step, so the output processor builds them
as O(1) snapshots (``CompletionOutput.snapshot``, ``RequestOutput.snapshot``): a list field
(``token_ids``, ``logprobs``, ``step_logits``, ``prompt_token_ids``) holds the request's own
list and how many of its items the output covers, and becomes the output's own list (a copy of
those items) when it is first read; ``metrics`` is built on first read from the moments taken
at the snapshot. The lists behind a snapshot only grow (a stop string trims only items past
every output handed out), so what an output reads never changes after it was handed out, and a
caller that never reads a field never pays for it. Constructed by keyword, the classes hold the
given values as dataclasses do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_UNREAD = object()  # a snapshot's list field not yet copied out of the request's list


class _Fields:
    """``repr``, ``==`` and pickling over ``FIELDS`` (the public names, read as a caller
    reads them) for the slotted output classes."""

    __slots__ = ()
    FIELDS: tuple[str, ...] = ()

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def __repr__(self) -> str:
        args = ", ".join(f"{f}={v!r}" for f, v in zip(self.FIELDS, self._values(), strict=True))
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # mutable, as the dataclasses were

    def __getstate__(self) -> dict:
        return dict(zip(self.FIELDS, self._values(), strict=True))

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)


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

    @classmethod
    def from_moments(cls, moments: tuple) -> RequestMetrics:
        """From (arrival, first token, finish, itl, its length then, wall offset): moments on
        ``time.monotonic()``'s clock (None: not yet), itl the request's growing gap list, the
        wall offset ``time.time() - time.monotonic()``."""
        arrival, first, finish, itl, n, wall = moments
        return cls(
            arrival_time=arrival + wall,
            first_token_time=None if first is None else first + wall,
            finish_time=None if finish is None else finish + wall,
            itl=itl[:n],
            ttft=None if first is None else first - arrival,
            e2e_latency=None if finish is None else finish - arrival,
        )

    def as_dict(self) -> dict:
        return dict(
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            ttft=self.ttft,
            e2e_latency=self.e2e_latency,
            itl=list(self.itl),
        )


class CompletionOutput(_Fields):
    """One of a request's n samples, as it stood when the output was made."""

    __slots__ = (
        *("index", "text", "finish_reason", "stop_reason", "text_delta", "error"),
        *("_lists", "_token_ids", "_logprobs", "_step_logits"),
    )
    FIELDS = (
        *("index", "text", "token_ids", "finish_reason", "stop_reason", "logprobs"),
        *("text_delta", "step_logits", "error"),
    )

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        stop_reason: str | int | None = None,
        logprobs: list[dict[int, float]] | None = None,
        text_delta: str = "",
        step_logits: list[np.ndarray] | None = None,
        error: str | None = None,
    ):
        self.index = index  # which of the request's n samples
        self.text = text
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | None while running
        # the stop string (str) or stop token id (int) that ended it; None for EOS, length, abort
        self.stop_reason = stop_reason
        self.text_delta = text_delta  # text that is new since the previous output of this request
        self.error = error  # why the engine aborted it (e.g. the prompt can never fit)
        self._lists = None  # a snapshot's (token ids, logprobs, step logits, n); None: owned
        self._token_ids = token_ids
        self._logprobs = logprobs  # per token: {token_id: logprob}
        self._step_logits = step_logits  # (V,) per token; only with record_logits

    @classmethod
    def snapshot(cls, index, text, text_delta, finish_reason, stop_reason, error, lists):
        """An output over a sample's lists without copying them: ``lists`` is (token ids,
        logprobs or None, step logits or None, n), the first n items of each being this
        output's; they are copied out when first read (the lists must only grow meanwhile)."""
        c = cls.__new__(cls)
        c.index, c.text, c.text_delta = index, text, text_delta
        c.finish_reason, c.stop_reason, c.error = finish_reason, stop_reason, error
        c._lists = lists
        c._token_ids = c._logprobs = c._step_logits = _UNREAD
        return c

    def _copy_out(self, k: int) -> list | None:
        """The snapshot's k-th list, its first n items as a list of this output's own."""
        lists = self._lists
        src = lists[k]
        return None if src is None else src[: lists[3]]

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is _UNREAD:
            self._token_ids = self._copy_out(0)
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """Per token: {token_id: logprob}; None unless SamplingParams.logprobs asked for them."""
        if self._logprobs is _UNREAD:
            self._logprobs = self._copy_out(1)
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: list[dict[int, float]] | None) -> None:
        self._logprobs = value

    @property
    def step_logits(self) -> list[np.ndarray] | None:
        """(V,) per token; None unless the engine records logits."""
        if self._step_logits is _UNREAD:
            self._step_logits = self._copy_out(2)
        return self._step_logits

    @step_logits.setter
    def step_logits(self, value: list[np.ndarray] | None) -> None:
        self._step_logits = value

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' log-probabilities (only when logprobs were asked for)."""
        if self.logprobs is None:
            return None
        return float(sum(lp[t] for t, lp in zip(self.token_ids, self.logprobs, strict=True)))


class RequestOutput(_Fields):
    """One request as it stood when the output was made: its prompt and its samples."""

    __slots__ = (
        *("request_id", "prompt", "outputs", "finished", "num_cached_tokens"),
        *("prompt_logprobs", "embedding", "_prompt_src", "_prompt_token_ids"),
        *("_moments", "_metrics"),
    )
    FIELDS = (
        *("request_id", "prompt", "prompt_token_ids", "outputs", "finished", "metrics"),
        *("num_cached_tokens", "prompt_logprobs", "embedding"),
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: RequestMetrics,
        num_cached_tokens: int | None = None,
        prompt_logprobs: list[dict[int, float] | None] | None = None,
        embedding: list[float] | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self._prompt_src, self._prompt_token_ids = None, prompt_token_ids
        self.outputs = outputs
        self.finished = finished
        self._moments, self._metrics = None, metrics
        self.num_cached_tokens = num_cached_tokens  # prompt tokens found in the prefix cache
        # with SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} (None first)
        self.prompt_logprobs = prompt_logprobs
        self.embedding = embedding  # the pooling runner's vector for the prompt

    @classmethod
    def snapshot(cls, request_id, prompt, prompt_ids, outputs, finished, moments, extras):
        """An output whose ``prompt_token_ids`` is copied from ``prompt_ids`` (which must not
        change) and whose ``metrics`` is built from ``moments`` (``RequestMetrics.from_moments``)
        when first read; extras: (num_cached_tokens, prompt_logprobs, embedding)."""
        o = cls.__new__(cls)
        o.request_id, o.prompt, o.outputs, o.finished = request_id, prompt, outputs, finished
        o._prompt_src, o._prompt_token_ids = prompt_ids, _UNREAD
        o._moments, o._metrics = moments, _UNREAD
        o.num_cached_tokens, o.prompt_logprobs, o.embedding = extras
        return o

    @property
    def prompt_token_ids(self) -> list[int]:
        if self._prompt_token_ids is _UNREAD:
            self._prompt_token_ids = list(self._prompt_src)
        return self._prompt_token_ids

    @prompt_token_ids.setter
    def prompt_token_ids(self, value: list[int]) -> None:
        self._prompt_token_ids = value

    @property
    def metrics(self) -> RequestMetrics:
        if self._metrics is _UNREAD:
            self._metrics = RequestMetrics.from_moments(self._moments)
        return self._metrics

    @metrics.setter
    def metrics(self, value: RequestMetrics) -> None:
        self._metrics = value

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
