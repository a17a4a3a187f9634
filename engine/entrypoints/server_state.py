"""What every route of the server reads: ``Server`` (the engine, tokenizer, limits, served names,
parsers and the checks a request passes before it is queued), ``start_chat`` (a chat request
checked, templated and queued, shared by the chat, Responses and Messages routes) and ``call``
(a ValueError as a 400)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading

from fastapi import Request
from pydantic import BaseModel, ValidationError

from engine.core.structured import StructuredOutputsParams
from engine.entrypoints.harmony_parser import grammar_end
from engine.entrypoints.limits import KiB, ServerLimits, check_sampling_bounds, parse_json_body
from engine.entrypoints.lora_routes import ServedAdapters
from engine.entrypoints.middleware import (
    ApiError,
)
from engine.entrypoints.prometheus import PrometheusStatLogger
from engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    UnsupportedField,
)
from engine.entrypoints.reasoning import grammar_bounds, prompt_state
from engine.entrypoints.responses import ChatFormat
from engine.entrypoints.responses_api import (
    ResponseStore,
)
from engine.entrypoints.tool_calls import ToolMode
from engine.entrypoints.tool_parsers import parser_for_template
from engine.frontend import harmony
from engine.frontend.async_llm import AsyncLLM, QueueFullError, RequestStream
from engine.frontend.chat import chat_prompt_ids
from engine.frontend.input_processor import tokenize_prompt
from engine.lora.request import LoRARequest

HEAVY_BYTES = 16 * KiB  # bodies from this size are parsed and tokenized in a worker thread
TEXT_WORKERS = 2  # worker threads for those: big requests wait for each other, not the loop
log = logging.getLogger("engine.serve")


class Server:
    """What the routes share: the engine, the names it answers to, the key, the limits, the
    metrics, and the worker threads for large inputs."""

    def __init__(
        self, llm: AsyncLLM, model_name: str, api_key: str | None, aliases=(), limits=None
    ):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.names = {model_name, *aliases}
        self.api_key = api_key
        self.limits = limits or ServerLimits()
        self.max_model_len = llm.engine.config.max_model_len
        self.max_prompt_chars = llm.engine.max_prompt_chars  # no longer text fits max_model_len
        self.vocab_size = llm.engine.model_config.vocab_size
        # the model's generation_config.json defaults, for the fields a request leaves unset
        self.sampling_defaults = llm.engine.sampling_defaults
        self.metrics = PrometheusStatLogger(model_name)
        llm.stat_loggers.append(self.metrics)
        # /metrics: this engine's, or (replicas behind this server) every replica's, gathered
        self.render_metrics = getattr(llm, "render_metrics", None) or self._render_own_metrics
        self.workers = concurrent.futures.ThreadPoolExecutor(TEXT_WORKERS, "pagedllm-text")
        self.adapters = ServedAdapters(llm.engine, self.names)  # LoRA adapters, by model name
        self.responses = ResponseStore(self.limits.responses_store, self.limits.responses_ttl)
        self.reasoning_parser: str | None = None  # --reasoning-parser
        # tool_choice auto's format: --tool-call-parser, else the one the template writes
        self.tool_parser = "hermes"
        # prompts in OpenAI's harmony format instead of the chat template (gpt-oss): set_format
        self.harmony = False
        self.set_format(harmony.uses_harmony(llm.engine.model_config))
        self._compiler_lock = threading.Lock()  # the engine's grammar compiler is built once

    def set_format(self, use_harmony: bool) -> None:
        """Harmony or the chat template: with harmony, its parsers (openai_gptoss, openai)
        until --reasoning-parser / --tool-call-parser say otherwise (build_app sets those
        after this)."""
        self.harmony = use_harmony
        if use_harmony:
            self.reasoning_parser, self.tool_parser = harmony.REASONING_PARSER, "openai"
        else:
            self.reasoning_parser = None
            self.tool_parser = parser_for_template(getattr(self.tokenizer, "chat_template", None))

    async def _render_own_metrics(self) -> bytes:
        return self.metrics.render()

    def check_model(self, name: str | None) -> None:
        """A model this server does not serve: 404 NotFoundError, as OpenAI and vLLM answer."""
        if name is not None and name not in self.names and name not in self.adapters.by_name:
            raise ApiError(
                404, f"The model `{name}` does not exist (this server serves {self.model_name!r})",
                "NotFoundError", param="model",
            )  # fmt: skip

    def check_room(self, prompts: list, max_tokens: int | None, field: str) -> None:
        """A 400 when a prompt and the ``max_tokens`` asked for exceed max_model_len (vLLM's
        and OpenAI's answer; left unchecked, the sequence would run to the context's end)."""
        if max_tokens is None:
            return
        limit = self.max_model_len
        for ids in prompts:  # a prompt that fills the context alone: the engine's own 400
            if len(ids) < limit < len(ids) + max_tokens:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                    f"{max_tokens} in the completion). Please reduce the length of the prompt "
                    f"or {field}.",
                    param=field,
                )

    def lora_of(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.adapters.by_name.get(name) if name is not None else None

    def check_request(self, req: SamplingRequest, logprobs: tuple[str, int | None]) -> None:
        """The model, fields given values this server does not implement, and the bounds: a
        400 for the first that fails. Unknown fields are logged and ignored."""
        self.check_model(req.model)
        try:
            req.check_supported()
        except UnsupportedField as e:
            raise ApiError(400, str(e), param=e.field) from None
        unknown = req.unknown_fields()
        if unknown:
            log.warning("ignoring unknown request fields: %s", ", ".join(unknown[:20]))
        self.check_bounds(req, logprobs)

    def check_bounds(self, req: SamplingRequest, logprobs: tuple[str, int | None]) -> None:
        try:
            check_sampling_bounds(req, self.limits, logprobs)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def compile(self, named: tuple[str, StructuredOutputsParams] | None) -> None:
        """Compile (field name, constraint on the output) in a worker thread (a large schema
        takes long): the engine thread then finds it in the compiler's cache. One that does
        not compile is a 400 naming the field."""
        if named is None:
            return
        field, constraint = named
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.workers, self._compile, constraint)
        except ValueError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None

    def _compile(self, constraint: StructuredOutputsParams) -> None:
        with self._compiler_lock:  # the first call builds it (half a second for 49k tokens)
            compiler = self.llm.engine.structured_compiler()
        compiler.compile(constraint)

    async def run(self, size: int, fn, *args):
        """``fn(*args)`` for a request of ``size`` body bytes: here when it is small, in a worker
        thread from HEAVY_BYTES (megabytes of JSON, template or tokenizer work would stall every
        other request, and /health, for seconds)."""
        if size < HEAVY_BYTES:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.workers, functools.partial(fn, *args))

    async def parse(self, raw: Request, model: type[BaseModel]) -> tuple[BaseModel, int]:
        """The body as ``model`` (400 for one that is not), and its size in bytes."""
        body = await raw.body()  # within max_request_bytes and request_body_timeout
        return await self.run(len(body), _parse, body, model, self.limits), len(body)

    def prompt_ids(self, req: CompletionRequest) -> list:
        """The request's text prompts tokenized (checked against max_model_len and the
        vocabulary); token id prompts as given, for the engine to check."""
        prompts, out = req.prompts(), []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                try:
                    args = (self.tokenizer, self.vocab_size, self.max_model_len)
                    p = tokenize_prompt(p, *args, self.max_prompt_chars)[1]
                except ValueError as e:
                    where = f"prompt {i}: " if len(prompts) > 1 else ""
                    raise ApiError(400, f"{where}{e}") from None
            out.append(p)
        return out

    def prompt_texts(self, req: CompletionRequest, prompts: list) -> list[str]:
        """Each prompt's text for echo: as given, or its token ids decoded."""
        given = req.prompts()
        return [
            p if isinstance(p, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
            for p, ids in zip(given, prompts, strict=True)
        ]

    def chat_ids(
        self, conversation: list[dict], add_generation_prompt, max_chars, tools, *why, kw=None,
        effort=None,
    ):  # fmt: skip
        """The prompt of a conversation: through the chat template, or rendered in harmony
        (``effort``: its reasoning effort; the template's ``kw`` and add_generation_prompt do
        not apply there: a harmony prompt always ends with the assistant's turn opened)."""
        try:
            if self.harmony:
                return harmony.prompt_ids(
                    self.tokenizer, conversation, tools, effort, max_chars, None, *why
                )
            return chat_prompt_ids(
                self.tokenizer, conversation, add_generation_prompt, max_chars, tools, *why,
                template_kwargs=kw,
            )  # fmt: skip
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def start(self, prompts, params, stream: bool, model=None) -> list[RequestStream]:
        """Queue every prompt, or none; bad input -> 400, a full queue -> 503 with Retry-After.
        Not ``stream``ed: each request's finished output alone comes back (none per step).
        ``model``: the request's, which may name a LoRA adapter."""
        lora = self.lora_of(model)
        extra = {} if lora is None else {"lora_request": lora}  # replicas: the base model alone
        try:
            return await self.llm.add_requests(prompts, params, final_only=not stream, **extra)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except QueueFullError as e:
            raise ApiError(503, str(e), "ServiceUnavailableError", {"Retry-After": "1"}) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "ServiceUnavailableError") from None


def _parse(body: bytes, model: type[BaseModel], limits: ServerLimits) -> BaseModel:
    try:
        return model.model_validate(parse_json_body(body, limits))
    except ValidationError as e:
        raise ApiError(400, validation_message(e.errors())) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def validation_message(errors: list[dict]) -> str:
    """pydantic's first complaint in one line: ``field: message``."""
    if not errors:
        return "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == "extra_forbidden":
        return f"{where}: unknown field, not supported"
    return f"{where or 'body'}: {first.get('msg')}"


def validated_chat(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise ApiError(400, validation_message(e.errors())) from None


def call(fn, *args, **kwargs):
    """fn(*args, **kwargs), its ValueError a 400."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def openai_error(e: Exception) -> tuple[str, dict]:
    return "error", {"type": "error", "code": "503", "message": str(e), "param": None}


async def start_chat(server: Server, req: ChatCompletionRequest, size: int):
    """A chat request checked, templated and queued: (its streams, the ChatFormat that turns
    them into bodies or chunks, the prompt's ids). Every field is checked before the template
    runs."""
    top = (req.top_logprobs or 0) if req.logprobs else None
    effort = _harmony_effort(server, req)
    server.check_request(req, ("top_logprobs", top))
    mode = call(req.tool_mode, server.tool_parser)
    if server.harmony:
        mode = call(_harmony_mode, mode)
    named = call(req.constraint, mode)
    constraint = named[1] if named else None
    max_tokens = req.max_completion_tokens
    max_tokens = req.max_tokens if max_tokens is None else max_tokens
    given = server.max_model_len if max_tokens is None else max_tokens  # unset: what fits
    args = (given, top, server.sampling_defaults, constraint, req.prompt_logprobs)
    params = await server.run(size, call, req.sampling_params, *args)
    ids = await server.run(size, chat_request_ids, server, req, effort)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    server.check_room([ids], max_tokens, field)
    if max_tokens is None:
        fits = max(server.max_model_len - len(ids), 1)
        params = call(dataclasses.replace, params, max_tokens=fits)
    reasoning = None
    if server.harmony:
        reasoning = (server.reasoning_parser, False)
        params = _harmony_params(server, params, constraint, mode)
    elif server.reasoning_parser is not None:
        tail = server.tokenizer.decode(ids[-64:], skip_special_tokens=False)
        opened, closed = prompt_state(tail)
        reasoning = (server.reasoning_parser, opened)
        bounds = grammar_bounds(opened, closed)
        if constraint is not None and bounds is not None:  # the grammar is for the answer
            start, end = bounds
            so = dataclasses.replace(constraint, reasoning_start=start, reasoning_end=end)
            params = dataclasses.replace(params, structured_outputs=so)
    await server.compile(named)
    streams = await server.start([ids], params, req.stream, req.model)
    model = req.model or server.model_name
    fmt = ChatFormat(server.tokenizer, model, req, mode, reasoning)
    fmt.id = streams[0].request_id  # chatcmpl-<the engine's request id>: the live view's id
    return streams, fmt, ids


def chat_request_ids(server: Server, req: ChatCompletionRequest, effort=None) -> list[int]:
    """The chat request's prompt: its conversation and tools through the chat template (or in
    harmony, with ``effort``, else the request's own reasoning_effort)."""
    conv = call(req.conversation)
    tools, agp = req.template_tools(), req.add_generation_prompt
    if effort is None:
        effort = (req.model_extra or {}).get("reasoning_effort")
    return server.chat_ids(
        conv, agp, server.max_prompt_chars, tools, kw=req.chat_template_kwargs, effort=effort
    )


# ---- the harmony format (gpt-oss): engine/frontend/harmony.py, harmony_parser.py ----


def _harmony_effort(server: Server, req: ChatCompletionRequest) -> str | None:
    """A harmony model's reasoning_effort (taken out of the fields the check refuses; a
    value other than low, medium or high is a 400); None for another model (the check
    refuses the field there)."""
    if not server.harmony:
        return None
    effort = (req.model_extra or {}).pop("reasoning_effort", None)
    return call(harmony.check_effort, effort)


def _harmony_mode(mode: ToolMode) -> ToolMode:
    """Tool calls read back from harmony (the openai parser) whatever tool_choice is; a named
    choice keeps its schema (the grammar of the call's arguments)."""
    if mode.kind == "required":
        raise ValueError(
            "tool_choice: 'required' is not supported with the harmony format (name the "
            "function, or use 'auto')"
        )
    return dataclasses.replace(mode, parser="openai", kind="auto")


def _harmony_params(server: Server, params, constraint, mode: ToolMode):
    """The output's special tokens kept in its text (the parser reads them), <|return|> and
    <|call|> as stop tokens, and a constraint's grammar from the final channel's content (or
    the named call's arguments) on."""
    stops = [server.tokenizer.token_to_id(t) for t in harmony.STOP_TOKENS]
    stops = [*(params.stop_token_ids or []), *(t for t in stops if t is not None)]
    params = dataclasses.replace(params, skip_special_tokens=False, stop_token_ids=stops)
    if constraint is not None:
        end = grammar_end(mode.name)  # the named function, if tool_choice names one
        so = dataclasses.replace(constraint, reasoning_end=end, reasoning_end_regex=True)
        params = dataclasses.replace(params, structured_outputs=so)
    return params
