"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) in
terms of the server's chat completions: a Responses request becomes a chat request
(``ResponsesRequest.chat``), runs as one, and its answer comes back as a ``response`` object
(``response_body``), or streamed as the Responses API's typed events (``ResponseEvents``).

    Responses                               chat completions
    instructions                            a system message first (not carried over by
                                            previous_response_id, as OpenAI's is not)
    input: a string                         a user message
    input items: messages (user, system,    the same messages (input_text / output_text
      developer, assistant)                   parts as text)
    function_call {call_id, name,           an assistant message with that tool call
      arguments}
    function_call_output {call_id, output}  a tool message
    tools [{type: function, name, ...}]     tools [{type: function, function: {...}}]
    tool_choice auto / none / required /    the same; {"type": "function", "name"} named
      {"type": "function", "name"}
    text.format text / json_object /        response_format
      json_schema {name, schema, strict}
    max_output_tokens, temperature, top_p   max_tokens, temperature, top_p

``store`` (the default) keeps the response, and the conversation it ends, in ``ResponseStore``
(in memory, bounded in count and age): ``previous_response_id`` continues that conversation,
``GET`` returns the response and ``DELETE`` forgets it. Fields this server does not implement are
a 400 naming them: built-in tools (web search, file search, computer use, code interpreter, MCP,
image generation, ...), ``background``, ``prompt``, ``conversation``, ``include`` entries,
images and files in the input.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.tool_calls import function_tool

REFUSED = {  # request fields not implemented -> why (a value other than its "off" is a 400)
    "background": "background responses are not implemented",
    "prompt": "reusable prompts are not implemented",
    "conversation": "the Conversations API is not implemented (use previous_response_id)",
    "max_tool_calls": "max_tool_calls is not implemented",
    "context_management": "context management (compaction) is not implemented",
    "top_logprobs": "logprobs are not implemented on /v1/responses (chat completions has them)",
}
OFF = (None, False, [], "disabled", "auto")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # effort: a harmony model's; summary: none made
    include: list[str] | None = None
    truncation: str | None = None  # "disabled" (the default); "auto" is refused
    # accepted, no effect: they tune OpenAI's service, not what the model writes
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    max_tool_calls: int | None = None
    context_management: list[Any] | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        for name, why in REFUSED.items():
            if getattr(self, name) not in OFF:
                raise ValueError(f"{name}: {why}")
        if self.include:
            raise ValueError(f"include: {self.include[0]!r} is not implemented (nothing is)")
        if self.truncation not in (None, "disabled"):
            raise ValueError("truncation: only 'disabled' (a prompt too long is a 400)")
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function":
                raise ValueError(
                    f"tools.{i}: built-in tool {tool.type!r} is not implemented (function tools "
                    "are)"
                )
            if not tool.name:
                raise ValueError(f"tools.{i}.name: required for a function tool")

    def messages(self) -> list[dict]:
        """This request's input as chat messages (without instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for i, item in enumerate(self.input):
            _add_item(out, item, i)
        return out

    def chat(self, history: list[dict]) -> dict:
        """The chat completions request body this runs as, after ``history`` (the stored
        conversation previous_response_id continues)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages + history + self.messages(),
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tools:
            body["tools"] = [function_tool(t.name, t.description, t.parameters) for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError(
                    "tool_choice: 'auto', 'none', 'required' or {'type': 'function', 'name'}"
                )
            choice = {"type": "function", "function": {"name": choice["name"]}}
        if choice is not None:
            body["tool_choice"] = choice
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:  # a harmony model's (the server drops it for other models)
            body["reasoning_effort"] = "low" if effort == "minimal" else effort
        return body


def _response_format(fmt: dict) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise ValueError(f"text.format.type must be text, json_object or json_schema, got {kind!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise ValueError("text.format.schema: a JSON schema object is required with json_schema")
    schema = {"name": fmt.get("name") or "output", "schema": fmt["schema"]}
    if fmt.get("strict") is not None:
        schema["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": schema}


def _text(content, where: str) -> str:
    """A message's content as text: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise ValueError(f"{where}.content.{j}: part type {kind!r} is not supported (text)")
        parts.append(part["text"])
    return "".join(parts)


def _add_item(out: list[dict], item: dict, i: int) -> None:
    """One input item onto the chat messages: consecutive function calls join one assistant
    turn, as a model that calls several tools at once wrote them."""
    where = f"input.{i}"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ValueError(f"{where}.role: user, assistant, system or developer, got {role!r}")
        out.append({"role": role, "content": _text(item.get("content", ""), where)})
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise ValueError(f"{where}.{key}: a string is required in a function_call")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
        last = out[-1] if out else None
        if last and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ValueError(f"{where}.call_id: a string is required in a function_call_output")
        output = item.get("output", "")
        text = output if isinstance(output, str) else _text(output, where)
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    elif kind == "reasoning":
        return  # a reasoning model's summary: not shown to this model's template
    else:
        raise ValueError(f"{where}.type {kind!r} is not supported (message, function_call, "
                         "function_call_output)")  # fmt: skip


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict, status: str) -> list[dict]:
    """A chat message -> the response's output items: a message with its text, then one
    function_call per tool call."""
    items = []
    if message.get("reasoning_content") is not None:  # a reasoning parser's thinking
        text = {"type": "reasoning_text", "text": message["reasoning_content"]}
        items.append({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                      "content": [text], "status": status})  # fmt: skip
    if message.get("content"):
        text = {"type": "output_text", "text": message["content"], "annotations": []}
        items.append({"type": "message", "id": _new_id("msg"), "status": status,
                      "role": "assistant", "content": [text]})  # fmt: skip
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append({"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                      "name": fn["name"], "arguments": fn["arguments"],
                      "status": "completed"})  # fmt: skip
    return items


def response_body(req: ResponsesRequest, response_id: str, created: float, output: list,
                  finish: str | None, usage: dict) -> dict:  # fmt: skip
    """The ``response`` object: the request's settings echoed, its output and usage."""
    incomplete = finish == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if incomplete else "completed",
        "completed_at": time.time(),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0),
        },
        "user": req.user,
    }


def as_chat_message(output: list[dict]) -> dict:
    """A response's output items as the assistant turn a later request continues after."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output if item["type"] == "function_call"
    ]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    return turn


class ResponseStore:
    """Stored responses (``store``): id -> (the response, the conversation it ends: chat
    messages without instructions), at most ``size`` of them, each for ``ttl`` seconds; the
    oldest go first."""

    def __init__(self, size: int = 1000, ttl: float = 3600.0):
        self.size, self.ttl = size, ttl
        self._items: OrderedDict[str, tuple[float, dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, body: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[body["id"]] = (time.monotonic(), body, conversation)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                return None
            if time.monotonic() - found[0] > self.ttl:
                del self._items[response_id]
                return None
            return found[1], found[2]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None


class ResponseEvents:
    """A chat completion's chunks -> the Responses API's stream events, as (type, data):
    response.created and response.in_progress; per output item output_item.added, then a
    message's content_part.added, output_text.delta ..., output_text.done, content_part.done,
    a reasoning item's reasoning_text.delta ..., .done, or a function call's
    function_call_arguments.delta ..., .done; output_item.done; and
    response.completed (or response.incomplete) with the whole response. ``finish(body)``
    is handed the final response object, to store it."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: float, on_done):
        self.req, self.id, self.created, self.on_done = req, response_id, created, on_done
        self.seq = 0
        self.items: list[dict] = []  # the output so far
        self.open: str | None = None  # "text" or a tool call's key
        self.finish: str | None = None
        self.usage: dict = {}

    def _event(self, kind: str, **data) -> tuple[str, dict]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **data}

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[tuple[str, dict]]:
        shell = response_body(self.req, self.id, self.created, [], None, {})
        shell |= {"status": "in_progress", "completed_at": None, "usage": None}
        yield self._event("response.created", response=shell)
        yield self._event("response.in_progress", response=shell)
        async for chunk in chunks:
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk.get("choices", []):
                for event in self._choice(choice):
                    yield event
        for event in self._close():
            yield event
        body = response_body(self.req, self.id, self.created, self.items, self.finish, self.usage)
        self.on_done(body)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=body)

    def _choice(self, choice: dict) -> list[tuple[str, dict]]:
        out, delta = [], choice.get("delta") or {}
        if delta.get("reasoning_content"):
            out += self._text("reasoning", self._open_reasoning, "response.reasoning_text.delta",
                              delta["reasoning_content"])  # fmt: skip
        if delta.get("content"):
            out += self._text("text", self._open_message, "response.output_text.delta",
                              delta["content"], logprobs=[])  # fmt: skip
        for call in delta.get("tool_calls") or []:
            key = f"call{call['index']}"
            fn = call.get("function") or {}
            if self.open != key:
                out += self._close() + self._open_call(key, call.get("id"), fn.get("name"))
            if fn.get("arguments"):
                item = self.items[-1]
                item["arguments"] += fn["arguments"]
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=item["id"], output_index=len(self.items) - 1,
                                       delta=fn["arguments"]))  # fmt: skip
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        return out

    def _text(self, kind: str, open_item, event: str, text: str, **extra):
        """A text piece of the open ``kind`` item (a message's text, a reasoning item's),
        opening one first when another is open: its delta event."""
        out = [] if self.open == kind else self._close() + open_item()
        item = self.items[-1]
        item["content"][0]["text"] += text
        index = len(self.items) - 1
        return out + [self._event(event, item_id=item["id"], output_index=index,
                                  content_index=0, delta=text, **extra)]  # fmt: skip

    def _open_message(self) -> list[tuple[str, dict]]:
        item = {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        self.items.append(item)
        self.open = "text"
        index = len(self.items) - 1
        added = self._event("response.output_item.added", output_index=index, item=dict(item))
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        return [
            added,
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            ),
        ]

    def _open_reasoning(self) -> list[tuple[str, dict]]:
        item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": "in_progress",
                "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
        self.items.append(item)
        self.open = "reasoning"
        shown = {**item, "content": []}
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=shown)]  # fmt: skip

    def _open_call(self, key: str, call_id, name) -> list[tuple[str, dict]]:
        item = {"type": "function_call", "id": _new_id("fc"),
                "call_id": call_id or _new_id("call"), "name": name or "", "arguments": "",
                "status": "in_progress"}  # fmt: skip
        self.items.append(item)
        self.open = key
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=dict(item))]  # fmt: skip

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        item, index, out = self.items[-1], len(self.items) - 1, []
        status = "incomplete" if self.finish == "length" else "completed"
        if self.open == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=index, content_index=0,
                                   text=item["content"][0]["text"]))  # fmt: skip
        elif self.open == "text":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=part["text"],
                                   logprobs=[]))  # fmt: skip
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=part))  # fmt: skip
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=item["arguments"],
                                   name=item["name"]))  # fmt: skip
            status = "completed"
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.open = None
        return out
