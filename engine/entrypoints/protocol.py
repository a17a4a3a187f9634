"""The OpenAI API's request and response bodies (the fields this server reads and writes), as
pydantic models, and their translation into ``SamplingParams``.

Three kinds of request field:

- implemented: declared below and turned into ``SamplingParams`` (and, for a constraint on the
  output, ``StructuredOutputsParams``); a wrong type or value is a 400 naming the field;
- known but not implemented (``UNSUPPORTED``, ``CHAT_UNSUPPORTED``, ``COMPLETION_UNSUPPORTED``):
  a value that would change the answer is a 400 naming the field (``check_supported``), never
  silently ignored; the values that change nothing (``"n": 1``-like defaults) pass;
- unknown: accepted and ignored (logged), as OpenAI's own server does for fields it does not
  know.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.core.structured import StructuredOutputsParams
from engine.entrypoints.tool_calls import Tool, ToolCall, ToolMode, tool_mode
from engine.sampling_params import SamplingParams

GUIDED_BACKENDS = ("auto", "guidance", "llguidance")  # guided_decoding_backend values served


def _none(v) -> bool:
    return v is None


def _falsy(v) -> bool:
    return not v


def _one_of(*values) -> Callable[[Any], bool]:
    return lambda v: v is None or v in values


# field -> (the values that change nothing, what to say). Known fields this server does not
# implement: any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (_falsy, "beam search is not implemented"),
    "length_penalty": (_one_of(1, 1.0), "it only applies to beam search"),
    "truncate_prompt_tokens": (_none, "prompts are never truncated"),
    "logits_processors": (_none, "custom logits processors are not supported"),
    "guided_whitespace_pattern": (_none, "use disable_any_whitespace in structured_outputs"),
    "structural_tag": (_none, "structural tags are not supported"),
    "return_tokens_as_token_ids": (_falsy, "tokens are returned as text"),
    "return_token_ids": (_falsy, "use /tokenize"),
    "priority": (_one_of(0), "requests are served first come, first served"),
    "spaces_between_special_tokens": (_one_of(True), "it cannot be turned off"),
    "cache_salt": (_none, "the prefix cache is shared by every request"),
    "kv_transfer_params": (_none, "KV transfer is not supported"),
    "vllm_xargs": (_none, "it is not supported"),
    "service_tier": (_one_of("auto", "default"), "there is one service tier"),
    "store": (_falsy, "nothing is stored"),
}
CHAT_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_none, "use tools"),
    "function_call": (_none, "use tool_choice"),
    "audio": (_none, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only ['text'] is supported"),
    "prediction": (_none, "predicted outputs are not supported"),
    "web_search_options": (_none, "web search is not supported"),
    "reasoning_effort": (_none, "the model does not reason"),
    "verbosity": (_none, "it is not supported"),
    "moderation": (_none, "it is not supported"),
    "echo": (_falsy, "echo is for /v1/completions"),
    "continue_final_message": (_falsy, "it is not supported"),
    "add_special_tokens": (_falsy, "the template holds its own special tokens"),
    "chat_template": (_none, "the model's own template is used"),
    "documents": (_none, "it is not supported"),
    "mm_processor_kwargs": (_none, "the model reads text only"),
}
COMPLETION_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_none, "insertion is not supported"),
    "prompt_embeds": (_none, "prompts are text or token ids"),
}


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with no choices and the request's usage
    continuous_usage_stats: bool = False  # every chunk with its choice's usage so far
    include_obfuscation: bool | None = None  # only false (or unset) is served


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``, as the ``openai`` client sends it (``parse()`` gives a
    pydantic model's strict schema, ``strict: true``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` object: exactly one constraint (``disable_any_whitespace``
    and ``disable_additional_properties`` aside)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True  # False: objects open unless the schema says


class SamplingRequest(BaseModel):
    """The sampling fields the two generation endpoints share (OpenAI's and vLLM's extras)."""

    model_config = ConfigDict(extra="allow")

    UNSUPPORTED_FIELDS: ClassVar[dict] = UNSUPPORTED

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: dict | None = None,
        constraint: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """ValueError (from SamplingParams) for a value out of range. ``defaults``: the
        model's generation_config.json values, for the fields this request does not set."""
        d = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        temperature = d.get("temperature", 1.0) if self.temperature is None else self.temperature
        return SamplingParams(
            n=self.n,
            temperature=temperature,
            top_p=d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=d.get("top_k", self.top_k),
            min_p=d.get("min_p", self.min_p),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=d.get("repetition_penalty", self.repetition_penalty),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=constraint,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check_supported(self) -> None:
        """``UnsupportedField`` (a ValueError) naming the first field given a value this server
        does not implement."""
        for name, (ok, why) in self.UNSUPPORTED_FIELDS.items():
            value = getattr(self, name, None)
            if not ok(value):
                raise UnsupportedField(name, f"{name}={_short(value)} is not supported: {why}")
        opts = self.stream_options
        if opts is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed with stream")
        if opts is not None and opts.include_obfuscation:
            raise UnsupportedField(
                "stream_options", "stream_options.include_obfuscation=true is not supported"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedField(
                "prompt_logprobs", "prompt_logprobs is not supported with stream"
            )
        backend = self.guided_decoding_backend
        if backend is not None and backend not in GUIDED_BACKENDS:
            raise UnsupportedField(
                "guided_decoding_backend",
                f"guided_decoding_backend {backend!r} is not supported: structured output is "
                f"llguidance's (one of {', '.join(GUIDED_BACKENDS)})",
            )

    def unknown_fields(self) -> list[str]:
        """Fields this server does not know (accepted and ignored)."""
        return sorted(self.model_extra or {})

    def constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """(field name, constraint): the one constraint on the output, from response_format,
        structured_outputs or a guided_* field; ValueError naming the fields when more than one
        is given."""
        return _one(self._constraints())

    def _constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """(field name, constraint) for every field that constrains the output."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            found.append(("response_format", _response_format(rf)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", _structured(self.structured_outputs)))
        guided = {
            "guided_json": "json",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        for name, kind in guided.items():
            value = getattr(self, name)
            if value is not None:
                found.append((name, _params(name, **{kind: value})))
        return found


def _one(found: list[tuple[str, StructuredOutputsParams]]):
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise ValueError(f"{names}: give at most one constraint on the output")
    return found[0] if found else None


class UnsupportedField(ValueError):
    """A known field given a value this server does not implement."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _params(where: str, **kw) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kw), its ValueError said in terms of the request field."""
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).removeprefix('StructuredOutputsParams: ')}") from None


def _response_format(rf: ResponseFormat) -> StructuredOutputsParams:
    if rf.type == "json_object":
        return _params("response_format", json_object=True)
    if rf.json_schema is None:
        raise ValueError("response_format.json_schema is required with type 'json_schema'")
    schema = rf.json_schema.schema_
    if schema is None:  # a name and no schema: any JSON object
        return _params("response_format", json_object=True)
    return _params("response_format.json_schema.schema", json=schema)


def _structured(so: StructuredOutputsRequest) -> StructuredOutputsParams:
    kinds = {
        "json": so.json_,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object,
    }
    given = [k for k, v in kinds.items() if v not in (None, False)]
    if len(given) != 1:
        names = ", ".join(given) or "none"
        raise ValueError(
            f"structured_outputs: exactly one of {', '.join(kinds)} must be set, got {names}"
        )
    kind = given[0]
    return _params(
        f"structured_outputs.{kind}",
        **{kind: kinds[kind]},
        disable_any_whitespace=so.disable_any_whitespace,
        disable_additional_properties=so.disable_additional_properties,
    )


class CompletionRequest(SamplingRequest):
    UNSUPPORTED_FIELDS: ClassVar[dict] = {**UNSUPPORTED, **COMPLETION_UNSUPPORTED}

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # only best_of == n (or unset) is served

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch: text, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        return list(p) if p else [p]

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedField(
                "best_of", f"best_of={self.best_of} is not supported: only best_of equal to n"
            )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None  # text, or parts [{"type": "text", ...}]
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    def text(self) -> str:
        """The content as one string; ValueError for a part that is not text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part type {part.get('type')!r} is not supported")
        return "".join(part["text"] for part in self.content)

    def for_template(self) -> dict:
        """The message as the chat template reads it: role, content, and the tool fields
        given (a call's arguments as an object, as transformers' templates expect)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        thinking = (self.model_extra or {}).get("reasoning_content")
        if isinstance(thinking, str):  # an earlier turn's thinking (the harmony format shows it)
            out["reasoning_content"] = thinking
        return out


class ChatCompletionRequest(SamplingRequest):
    UNSUPPORTED_FIELDS: ClassVar[dict] = {**UNSUPPORTED, **CHAT_UNSUPPORTED}

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (vLLM's)

    def conversation(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")

    def tool_mode(self, parser: str = "hermes") -> ToolMode:
        """How tools are used (ValueError for a bad tool_choice or tools); ``parser``: the
        format auto reads calls in."""
        return tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def constraint(
        self, mode: ToolMode | None = None
    ) -> tuple[str, StructuredOutputsParams] | None:
        """As for completions, and tool_choice's schema (named or "required") too."""
        found = self._constraints()
        mode = mode or self.tool_mode()
        if mode.schema is not None:
            found.insert(0, ("tool_choice", _params("tool_choice", json=mode.schema)))
        return _one(found)

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template gets them (none without tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # a harmony model's (rendered in its system message)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
