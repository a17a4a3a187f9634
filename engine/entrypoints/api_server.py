"""The OpenAI-compatible HTTP API over one ``AsyncLLM`` (FastAPI): ``build_app(llm, name)``.

POST /v1/completions, /v1/chat/completions   (``stream: true``: server-sent events, ``[DONE]``)
GET  /v1/models, /health, /metrics            POST /tokenize, /detokenize

A request body is parsed by its pydantic model (engine/entrypoints/protocol.py), turned into a
``SamplingParams`` and handed to ``AsyncLLM.add_request``; every refusal on the way is an error
in OpenAI's shape (400 bad input, 401 no key, 503 queue full) and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from engine.async_llm import AsyncLLM, QueueFullError, RequestStream
from engine.chat import chat_prompt_ids
from engine.outputs import CompletionOutput, RequestOutput

from .prometheus import PrometheusStatLogger
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    error_body,
)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ApiError(Exception):
    """An error answer: HTTP status, OpenAI error type, message, optional headers."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.status)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class Server:
    """What the routes share: the engine, the names it answers to, the key, the metrics."""

    def __init__(self, llm: AsyncLLM, model_name: str, api_key: str | None, aliases=()):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.names = {model_name, *aliases}
        self.api_key = api_key
        self.max_model_len = llm.engine.config.max_model_len
        # the model's generation_config.json defaults, for the fields a request leaves unset
        self.sampling_defaults = llm.engine.sampling_defaults
        self.metrics = PrometheusStatLogger(model_name)
        llm.stat_loggers.append(self.metrics)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise ApiError(400, f"model {name!r} is not served here (try {self.model_name!r})")

    async def start(self, prompt, params) -> RequestStream:
        """Queue one request; bad input -> 400, a full queue -> 503 with Retry-After."""
        try:
            return await self.llm.add_request(prompt, params)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except QueueFullError as e:
            raise ApiError(503, str(e), "ServiceUnavailableError", {"Retry-After": "1"}) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "ServiceUnavailableError") from None

    async def start_all(self, prompts, params) -> list[RequestStream]:
        """Queue every prompt, or none: a refusal aborts the ones already queued."""
        streams: list[RequestStream] = []
        try:
            for p in prompts:
                streams.append(await self.start(p, params))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None, aliases=()) -> FastAPI:
    """The FastAPI app; ``app.state.server`` holds the shared state."""
    app = FastAPI(title="pagedllm", version="0.1.0")
    server = app.state.server = Server(llm, model_name, api_key, aliases)
    _add_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    _add_info_routes(app, server)
    _add_generation_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        return ApiError(400, _validation_message(exc)).response()

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return ApiError(exc.status_code, str(exc.detail), "HTTPError", exc.headers).response()


def _validation_message(exc: RequestValidationError) -> str:
    """pydantic's first complaint in one line: ``field: message``."""
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"{where or 'body'}: {first.get('msg')}"


class ApiKeyMiddleware:
    """Every /v1/* request without ``Authorization: Bearer <key>`` answers 401. (Plain ASGI:
    FastAPI's ``@app.middleware`` would hide a client's disconnect from the routes.)"""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}"

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if Headers(scope=scope).get("authorization") != self.expected:
                error = ApiError(401, "invalid or missing API key", "AuthenticationError")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_info_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health():
        try:
            await server.llm.check_health()
        except RuntimeError as e:
            raise ApiError(503, str(e), "ServiceUnavailableError") from None
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        card = dict(
            id=server.model_name,
            object="model",
            created=int(time.time()),
            owned_by="pagedllm",
            max_model_len=server.max_model_len,
        )
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        server.check_model(req.model)
        tokens = _tokenize(server, req)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        server.check_model(req.model)
        vocab = server.llm.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside [0, {vocab})")
        return {"prompt": server.tokenizer.decode(req.tokens)}


def _tokenize(server: Server, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages")
    try:
        if req.messages is not None:
            conv = [{"role": m.role, "content": m.text()} for m in req.messages]
            return chat_prompt_ids(server.tokenizer, conv, req.add_generation_prompt)
        return server.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


# ---- generation ----


def _add_generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        server.check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo is not supported")
        max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        params = _params(req, max_tokens, req.logprobs, server.sampling_defaults)
        streams = await server.start_all(req.prompts(), params)
        fmt = CompletionFormat(server, req)
        if req.stream:
            return _sse(fmt.chunks(streams))
        return await _unless_disconnected(raw, fmt.response(streams))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        server.check_model(req.model)
        try:
            ids = chat_prompt_ids(server.tokenizer, req.conversation())
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        max_tokens = req.max_completion_tokens
        max_tokens = req.max_tokens if max_tokens is None else max_tokens
        if max_tokens is None:  # as much as fits
            max_tokens = max(server.max_model_len - len(ids), 1)
        top = req.top_logprobs or 0
        params = _params(req, max_tokens, top if req.logprobs else None, server.sampling_defaults)
        streams = await server.start_all([ids], params)
        fmt = ChatFormat(server, req)
        if req.stream:
            return _sse(fmt.chunks(streams))
        return await _unless_disconnected(raw, fmt.response(streams))


async def _unless_disconnected(raw: Request, coro, poll: float = 0.1):
    """Await a whole (non-streamed) answer; if the client hangs up first, cancel it, which
    aborts its requests. (A streamed answer is cancelled by the server on disconnect.)"""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            raise ApiError(499, "client disconnected", "ClientDisconnected")


def _params(req: SamplingRequest, max_tokens: int, logprobs: int | None, defaults: dict):
    try:
        return req.sampling_params(max_tokens, logprobs, defaults)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _final(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; closing it aborts them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the reader
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _ending(c: CompletionOutput) -> dict:
    """How a choice ended: finish_reason, and vLLM's stop_reason (the stop string or token id)."""
    return dict(finish_reason=c.finish_reason, stop_reason=c.stop_reason)


class _Format:
    """Shared by the two response shapes: usage, choice indices, streamed token counts."""

    def __init__(self, server: Server, req: SamplingRequest):
        self.server, self.req = server, req
        self.model = req.model or server.model_name
        self.created = int(time.time())
        self.id = uuid.uuid4().hex
        self.sent: dict[int, int] = {}  # choice index -> tokens already streamed

    ID_PREFIX: str  # the response id's prefix
    OBJECT: str  # "object" of a whole response
    CHUNK_OBJECT: str  # "object" of a streamed chunk

    def body(self, choices, usage) -> dict:
        """A whole response: the envelope around its choices."""
        return self._envelope(self.OBJECT, choices, usage)

    def chunk_body(self, choices, usage=None) -> dict:
        """One server-sent event's data."""
        return self._envelope(self.CHUNK_OBJECT, choices, usage)

    def _envelope(self, obj: str, choices, usage) -> dict:
        id_ = f"{self.ID_PREFIX}-{self.id}"
        created, model = self.created, self.model
        return dict(id=id_, object=obj, created=created, model=model, choices=choices, usage=usage)

    def index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.req.n + c.index

    @staticmethod
    def usage(finals: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        gen = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return dict(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen)

    def new_tokens(self, index: int, c: CompletionOutput) -> tuple[list[int], list[dict]]:
        """The token ids (and their logprobs) of this choice not yet streamed."""
        start = self.sent.get(index, 0)
        self.sent[index] = len(c.token_ids)
        return c.token_ids[start:], (c.logprobs or [])[start:]

    def token_text(self, token_id: int) -> str:
        return self.server.tokenizer.decode([token_id], skip_special_tokens=False)

    async def response(self, streams: list[RequestStream]) -> dict:
        finals = await asyncio.gather(*[_final(s) for s in streams])
        choices = [self.choice(i, c) for i, o in enumerate(finals) for c in o.outputs]
        return self.body(choices, self.usage(finals))

    async def chunks(self, streams: list[RequestStream]) -> AsyncIterator[dict]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in _merged(streams):
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                chunk = self.delta_choice(i, c)
                if chunk is not None:
                    yield self.chunk_body([chunk])
        if self.req.include_usage:
            yield self.chunk_body([], self.usage(list(finals.values())))


class CompletionFormat(_Format):
    """``text_completion`` bodies and chunks."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def logprobs(self, ids: list[int], lps: list[dict], offset: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        top = [{self.token_text(t): v for t, v in lp.items()} for lp in lps]
        return dict(
            tokens=tokens,
            token_logprobs=[lp[t] for t, lp in zip(ids, lps, strict=True)],
            top_logprobs=top,
            text_offset=offsets,
        )

    def choice(self, i: int, c: CompletionOutput) -> dict:
        lps = self.logprobs(c.token_ids, c.logprobs or [], 0)
        index = self.index(i, c)
        return dict(index=index, text=c.text, logprobs=lps, **_ending(c))

    def delta_choice(self, i: int, c: CompletionOutput) -> dict | None:
        index = self.index(i, c)
        ids, lps = self.new_tokens(index, c)
        if not c.text_delta and not ids and c.finish_reason is None:
            return None
        offset = len(c.text) - len(c.text_delta)
        logprobs = self.logprobs(ids, lps, offset)
        return dict(index=index, text=c.text_delta, logprobs=logprobs, **_ending(c))


class ChatFormat(_Format):
    """``chat.completion`` bodies and ``chat.completion.chunk`` chunks."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def logprobs(self, ids: list[int], lps: list[dict]) -> dict | None:
        if not self.req.logprobs:
            return None
        content = []
        for t, lp in zip(ids, lps, strict=True):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.req.top_logprobs or 0]
            content.append(self.entry(t, lp[t]) | {"top_logprobs": [self.entry(*kv) for kv in top]})
        return {"content": content}

    def entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return dict(token=text, logprob=logprob, bytes=list(text.encode()))

    def choice(self, i: int, c: CompletionOutput) -> dict:
        message = {"role": "assistant", "content": c.text}
        lps = self.logprobs(c.token_ids, c.logprobs or [])
        index = self.index(i, c)
        return dict(index=index, message=message, logprobs=lps, **_ending(c))

    def delta_choice(self, i: int, c: CompletionOutput) -> dict | None:
        index = self.index(i, c)
        first = index not in self.sent
        ids, lps = self.new_tokens(index, c)
        if not first and not c.text_delta and not ids and c.finish_reason is None:
            return None
        delta = {"role": "assistant", "content": c.text_delta} if first else {}
        if not first:
            delta["content"] = c.text_delta
        logprobs = self.logprobs(ids, lps)
        return dict(index=index, delta=delta, logprobs=logprobs, **_ending(c))
