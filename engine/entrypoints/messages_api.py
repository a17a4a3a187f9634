"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) in terms of the
server's chat completions: a Messages request becomes a chat request (``MessagesRequest.chat``),
runs as one, and its answer comes back in Anthropic's shape (``message_body``, or streamed as
Anthropic's events by ``MessageEvents``).

    Messages                                chat completions
    system (text or text blocks)            a system message first
    user text blocks                        a user message
    user tool_result blocks                 a tool message each (tool_call_id = tool_use_id)
    assistant text + tool_use blocks        an assistant message with tool_calls
    tools [{name, description,              tools [{type: function, function: {name,
      input_schema}]                          description, parameters}}]
    tool_choice auto / any / tool / none    auto / required / named / none
      disable_parallel_tool_use               parallel_tool_calls false
    stop_sequences, max_tokens,             stop, max_tokens, temperature, top_p, top_k
      temperature, top_p, top_k (older
      clients' sampling fields)
    output_config.format (json_schema)      response_format json_schema
    stop_reason end_turn / max_tokens /     finish_reason stop / length / stop (a stop
      stop_sequence / tool_use                string) / tool_calls

Errors on these routes are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
(``anthropic_error_body``). What is not implemented is a 400 naming it: image and document
blocks, server tools (``web_search_...``), ``thinking``, ``mcp_servers``, ``container``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.tool_calls import function_tool

# HTTP status -> Anthropic's error type (docs: "Errors"); others: 4xx invalid, 5xx api_error
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
REFUSED = {  # request fields this server does not implement -> why
    "thinking": "extended thinking is not implemented (no reasoning parser on this server)",
    "mcp_servers": "MCP servers are not implemented",
    "container": "code execution containers are not implemented",
}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, no effect

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(_text_of(b, "tool_result content") for b in self.content)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return [_block(b) for b in self.content]


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control: accepted

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom", or a server tool's versioned type (refused)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool = False
    output_config: dict[str, Any] | None = None  # format: a JSON schema; effort: no effect
    # accepted, no effect: they tune Anthropic's service, not what the model writes
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None  # the prefix cache applies by itself
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None

    def check_supported(self, reasoning: bool = False) -> None:
        """``reasoning``: the server splits thinking (--reasoning-parser): ``thinking`` is
        taken (enabled, adaptive or disabled)."""
        for name, why in REFUSED.items():
            value = getattr(self, name)
            if name == "thinking" and reasoning and value is not None:
                if value.get("type") not in ("enabled", "disabled", "adaptive"):
                    raise ValueError("thinking.type: enabled, adaptive or disabled")
                continue
            if value is not None and value != {"type": "disabled"}:
                raise ValueError(f"{name}: {why}")
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise ValueError(
                    f"tools.{i}: server tool {tool.type!r} is not implemented (client tools "
                    "with an input_schema are)"
                )
            if tool.input_schema is None:
                raise ValueError(f"tools.{i}.input_schema: required for a client tool")

    def conversation(self) -> list[dict]:
        """The chat messages of system and messages (see the module docstring)."""
        out = []
        if self.system:
            system = self.system
            if not isinstance(system, str):
                system = "".join(_text_of(b, "system") for b in system)
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            out += _chat_messages(m, i)
        return out

    def chat(self) -> dict:
        """The chat completions request body this runs as."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.conversation(),
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
                raise ValueError("output_config.format: only {'type': 'json_schema', 'schema'}")
            if not isinstance(fmt.get("schema"), dict):
                raise ValueError("output_config.format.schema: a JSON schema object is required")
            schema = {"name": "output", "schema": fmt["schema"]}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [
                function_tool(t.name, t.description, t.input_schema) for t in self.tools
            ]
        choice = self.tool_choice or {}
        kind = choice.get("type")
        if choice and kind not in ("auto", "any", "tool", "none"):
            raise ValueError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}")
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise ValueError("tool_choice.name: required with type 'tool'")
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        if choice.get("disable_parallel_tool_use"):
            body["parallel_tool_calls"] = False
        if (self.thinking or {}).get("type") == "disabled":  # the template closes the thinking
            body["chat_template_kwargs"] = {"enable_thinking": False}
        effort = thinking_effort(self.thinking)
        if effort is not None:  # a harmony model's (the server drops it for other models)
            body["reasoning_effort"] = effort
        return body


def thinking_effort(thinking: dict | None) -> str | None:
    """The reasoning effort ``thinking`` asks of a harmony model (gpt-oss, which always
    reasons): disabled -> low, adaptive -> medium, enabled with budget_tokens under 4096 ->
    low, under 16384 -> medium, else high; none given -> None (the format's default,
    medium)."""
    if not thinking:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return "low"
    if kind != "enabled":
        return "medium"
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int):
        return "medium"
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


class CountTokensRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a Messages request without max_tokens or stream."""

    max_tokens: int | None = None  # type: ignore[assignment]


def _block(b: dict) -> TextBlock | ToolUseBlock | ToolResultBlock:
    kind = b.get("type")
    models = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}
    if kind in ("thinking", "redacted_thinking"):
        return TextBlock(type="text", text="")  # earlier thinking: not shown to the template
    if kind not in models:
        raise ValueError(f"content block type {kind!r} is not supported (text, tool_use, "
                         "tool_result)")  # fmt: skip
    return models[kind].model_validate(b)


def _text_of(b: dict, where: str) -> str:
    if b.get("type") != "text" or not isinstance(b.get("text"), str):
        raise ValueError(f"{where}: block type {b.get('type')!r} is not supported (text)")
    return b["text"]


def _chat_messages(m: Message, i: int) -> list[dict]:
    """One Messages turn as chat messages: tool results first (each a tool message), then the
    turn's text (and an assistant's calls)."""
    out, text, calls = [], [], []
    for b in m.blocks():
        if isinstance(b, ToolResultBlock):
            if m.role != "user":
                raise ValueError(f"messages.{i}: tool_result blocks belong in a user turn")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, ToolUseBlock):
            if m.role != "assistant":
                raise ValueError(f"messages.{i}: tool_use blocks belong in an assistant turn")
            args = json.dumps(b.input, ensure_ascii=False)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": args}})  # fmt: skip
        else:
            text.append(b.text)
    if text or calls or not out:
        turn: dict[str, Any] = {"role": m.role, "content": "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _tool_use(call: dict) -> dict:
    """A chat tool call -> a tool_use block (its arguments parsed; kept as text if not JSON)."""
    fn = call["function"]
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        args = {"arguments": fn.get("arguments")}
    return {"type": "tool_use", "id": _tool_id(call["id"]), "name": fn["name"], "input": args}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop(choice: dict) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's ending."""
    finish, stop = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish, "end_turn"), None


def message_body(chat: dict, model: str) -> dict:
    """A chat.completion body -> Anthropic's message."""
    choice = chat["choices"][0]
    msg, content = choice["message"], []
    if msg.get("reasoning_content") is not None:  # a reasoning parser's thinking
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": ""})  # fmt: skip
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [_tool_use(c) for c in msg.get("tool_calls") or []]
    reason, sequence = _stop(choice)
    usage = chat.get("usage") or {}
    return {
        "id": "msg_" + chat["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
        },
    }


class MessageEvents:
    """A chat completion's chunks -> Anthropic's stream events, as (event name, data) pairs:
    message_start, then per content block content_block_start, its deltas (text_delta, or
    input_json_delta for a tool_use block's arguments as they come) and content_block_stop,
    then message_delta (stop_reason, output tokens) and message_stop."""

    def __init__(self, model: str, input_tokens: int):
        self.model, self.input_tokens = model, input_tokens
        self.index = -1  # the open block's index
        self.open: str | None = None  # its kind: "text" or a tool call's index
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.output_tokens = 0
        self.cached_tokens: int | None = None  # prompt tokens read from the prefix cache

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[tuple[str, dict]]:
        started = False
        async for chunk in chunks:
            if not started:
                started = True
                yield "message_start", self._start(chunk["id"])
            if chunk.get("usage"):
                self.output_tokens = chunk["usage"].get("completion_tokens", 0)
                details = chunk["usage"].get("prompt_tokens_details") or {}
                self.cached_tokens = details.get("cached_tokens", self.cached_tokens)
            for choice in chunk.get("choices", []):
                for event in self._choice(choice):
                    yield event
        for event in self._close():
            yield event
        reason, sequence = self.stop
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        # the final usage, as Anthropic's stream sends it: input tokens too (its SDK's
        # accumulated message and langchain's usage_metadata read them here)
        usage = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        if self.cached_tokens is not None:
            usage["cache_read_input_tokens"] = self.cached_tokens
        yield "message_delta", {"type": "message_delta", "delta": delta, "usage": usage}
        yield "message_stop", {"type": "message_stop"}

    def _start(self, chat_id: str) -> dict:
        message = {
            "id": "msg_" + chat_id.removeprefix("chatcmpl-"), "type": "message",
            "role": "assistant", "model": self.model, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }  # fmt: skip
        return {"type": "message_start", "message": message}

    def _choice(self, choice: dict) -> list[tuple[str, dict]]:
        out, delta = [], choice.get("delta") or {}
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
                out += self._close() + [self._open(block, "thinking")]
            out.append(self._delta({"type": "thinking_delta",
                                    "thinking": delta["reasoning_content"]}))  # fmt: skip
        if delta.get("content"):
            if self.open != "text":
                out += self._close() + [self._open({"type": "text", "text": ""}, "text")]
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            key = f"call{call['index']}"
            fn = call.get("function") or {}
            if self.open != key:
                block = {"type": "tool_use", "id": _tool_id(call.get("id") or uuid.uuid4().hex),
                         "name": fn.get("name") or "", "input": {}}  # fmt: skip
                out += self._close() + [self._open(block, key)]
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": fn["arguments"]}))  # fmt: skip
        if choice.get("finish_reason"):
            self.stop = _stop(choice)
        return out

    def _open(self, block: dict, kind: str) -> tuple[str, dict]:
        self.index += 1
        self.open = kind
        return "content_block_start", {"type": "content_block_start", "index": self.index,
                                       "content_block": block}  # fmt: skip

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                       "delta": delta}  # fmt: skip

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]
