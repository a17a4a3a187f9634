"""The OpenAI-compatible HTTP API over one ``AsyncLLM`` (FastAPI): ``build_app(llm, name)``.

POST /v1/completions, /v1/chat/completions   (``stream: true``: server-sent events, ``[DONE]``)
GET  /v1/models, /health, /metrics            POST /tokenize, /detokenize

A request body is read within its limits (size, time; engine/entrypoints/limits.py), parsed by
its pydantic model (engine/entrypoints/protocol.py), checked against the bounds, tokenized (in a
worker thread when it is large, so the event loop keeps answering), turned into a
``SamplingParams`` and handed to ``AsyncLLM.add_requests``. Every refusal on the way is an error
in OpenAI's shape (400 bad input, 401 no key, 408 slow body, 413 large body, 503 queue full) and
the server keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from engine.async_llm import AsyncLLM, QueueFullError, RequestStream
from engine.chat import chat_prompt_ids
from engine.input_processor import tokenize_prompt
from engine.outputs import CompletionOutput, RequestOutput

from .limits import KiB, ServerLimits, check_sampling_bounds, parse_json_body
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
HEAVY_BYTES = 16 * KiB  # bodies from this size are parsed and tokenized in a worker thread
TEXT_WORKERS = 2  # worker threads for those: big requests wait for each other, not the loop
OPEN_PATHS = ("/health",)  # what needs no API key (and /metrics, unless protect_metrics)
API_KEY = re.compile(r"[!-~](?:[ -~]*[!-~])?")  # printable ASCII, no space at either end


class ApiError(Exception):
    """An error answer: HTTP status, OpenAI error type, message, optional headers."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.status)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


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
        self.workers = concurrent.futures.ThreadPoolExecutor(TEXT_WORKERS, "pagedllm-text")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise ApiError(400, f"model {name!r} is not served here (try {self.model_name!r})")

    def check_bounds(self, req: SamplingRequest, logprobs: tuple[str, int | None]) -> None:
        try:
            check_sampling_bounds(req, self.limits, logprobs)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

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
        return await self.run(len(body), _parse, body, model), len(body)

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

    def chat_ids(self, conversation: list[dict], add_generation_prompt=True, max_chars=None):
        try:
            return chat_prompt_ids(self.tokenizer, conversation, add_generation_prompt, max_chars)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def start(self, prompts, params) -> list[RequestStream]:
        """Queue every prompt, or none; bad input -> 400, a full queue -> 503 with Retry-After."""
        try:
            return await self.llm.add_requests(prompts, params)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except QueueFullError as e:
            raise ApiError(503, str(e), "ServiceUnavailableError", {"Retry-After": "1"}) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "ServiceUnavailableError") from None


def _parse(body: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate(parse_json_body(body))
    except ValidationError as e:
        raise ApiError(400, _validation_message(e.errors())) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def check_api_key(api_key) -> None:
    """None (no key) or a key a client can send: an empty one must not switch auth off."""
    if api_key is not None and not (isinstance(api_key, str) and API_KEY.fullmatch(api_key)):
        raise ValueError(
            "the API key must be non-empty printable ASCII with no space at either end "
            "(unset it to serve without a key)"
        )


def build_app(
    llm: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    aliases=(),
    limits: ServerLimits | None = None,
    protect_metrics: bool = False,
) -> FastAPI:
    """The FastAPI app; ``app.state.server`` holds the shared state. With ``api_key`` every
    route but /health (and /metrics, unless ``protect_metrics``) needs it."""
    check_api_key(api_key)
    server = Server(llm, model_name, api_key, aliases, limits)
    app = FastAPI(title="pagedllm", version="0.1.0", lifespan=_lifespan(server))
    app.state.server = server
    _add_error_handlers(app)
    lim = server.limits
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=lim.max_request_bytes, timeout=lim.request_body_timeout
    )
    if api_key is not None:
        open_paths = OPEN_PATHS if protect_metrics else (*OPEN_PATHS, "/metrics")
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    _add_info_routes(app, server)
    _add_generation_routes(app, server)
    return app


def _lifespan(server: Server):
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        server.workers.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        return ApiError(400, _validation_message(exc.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return ApiError(exc.status_code, str(exc.detail), "HTTPError", exc.headers).response()


def _validation_message(errors: list[dict]) -> str:
    """pydantic's first complaint in one line: ``field: message``."""
    if not errors:
        return "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"{where or 'body'}: {first.get('msg')}"


class ApiKeyMiddleware:
    """Every request without ``Authorization: Bearer <key>`` answers 401, except on the open
    paths. (Plain ASGI: FastAPI's ``@app.middleware`` would hide a client's disconnect from the
    routes.)"""

    def __init__(self, app, api_key: str, open_paths=OPEN_PATHS):
        self.app, self.open_paths = app, frozenset(open_paths)
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = Headers(scope=scope).get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "invalid or missing API key", "AuthenticationError")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """A body over ``max_bytes`` answers 413: at once when its Content-Length says so, else as
    soon as that many bytes have come. One that has not fully come ``timeout`` seconds after the
    request head answers 408. Both close the connection."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            error = self._too_large() if length.isdigit() else _closing(400, "bad Content-Length")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, self._receive(receive), send)

    def _too_large(self) -> ApiError:
        return _closing(413, f"request body over {self.max_bytes} bytes (--max-request-bytes)")

    def _receive(self, receive):
        """receive, counting the body's bytes against max_bytes and its time against timeout."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        state = {"bytes": 0, "done": False}

        async def limited():
            if state["done"]:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                why = f"request body not received within {self.timeout:g} s"
                raise _closing(408, f"{why} (--request-body-timeout)") from None
            if message["type"] == "http.request":
                state["bytes"] += len(message.get("body", b""))
                if state["bytes"] > self.max_bytes:
                    raise self._too_large()
                state["done"] = not message.get("more_body", False)
            else:
                state["done"] = True
            return message

        return limited


def _closing(status: int, message: str) -> ApiError:
    return ApiError(status, message, "BadRequestError", {"Connection": "close"})


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
    async def tokenize(raw: Request):
        req, size = await server.parse(raw, TokenizeRequest)
        server.check_model(req.model)
        return _json(await server.run(size, _tokenize, server, req))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req, size = await server.parse(raw, DetokenizeRequest)
        server.check_model(req.model)
        return _json(await server.run(size, _detokenize, server, req.tokens))


def _json(body: str) -> Response:
    return Response(body, media_type="application/json")


def _tokenize(server: Server, req: TokenizeRequest) -> str:
    """The /tokenize answer, as JSON text (a list of millions of ids is slow to encode)."""
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages")
    if req.messages is not None:
        try:
            conv = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        tokens = server.chat_ids(conv, req.add_generation_prompt)
    else:
        tokens = server.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    rest = json.dumps({"count": len(tokens), "max_model_len": server.max_model_len})
    return f'{{"tokens": {_int_list_json(tokens)}, {rest[1:]}'


def _int_list_json(ids: list[int], chunk: int = 1 << 16) -> str:
    """``json.dumps(ids)`` in pieces: one call over millions of ids holds the GIL for seconds,
    between pieces the event loop's thread gets its turn."""
    pieces = (",".join(map(str, ids[i : i + chunk])) for i in range(0, len(ids), chunk))
    return f"[{','.join(pieces)}]"


def _detokenize(server: Server, tokens: list[int]) -> str:
    vocab = server.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside [0, {vocab})")
    return json.dumps({"prompt": server.tokenizer.decode(tokens)}, ensure_ascii=False)


# ---- generation ----


def _add_generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(raw: Request):
        req, size = await server.parse(raw, CompletionRequest)
        server.check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo is not supported")
        server.check_bounds(req, ("logprobs", req.logprobs))
        max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        params = _params(req, max_tokens, req.logprobs, server.sampling_defaults)
        prompts = await server.run(size, server.prompt_ids, req)
        streams = await server.start(prompts, params)
        fmt = CompletionFormat(server, req)
        if req.stream:
            return _sse(fmt.chunks(streams))
        return await _unless_disconnected(raw, fmt.response(streams))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        req, size = await server.parse(raw, ChatCompletionRequest)
        server.check_model(req.model)
        top = (req.top_logprobs or 0) if req.logprobs else None
        server.check_bounds(req, ("top_logprobs", top))
        max_tokens = req.max_completion_tokens
        max_tokens = req.max_tokens if max_tokens is None else max_tokens
        # every field is checked before the template runs; unset, max_tokens is what fits
        given = server.max_model_len if max_tokens is None else max_tokens
        params = _params(req, given, top, server.sampling_defaults)
        try:
            conv = req.conversation()
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        ids = await server.run(size, server.chat_ids, conv, True, server.max_prompt_chars)
        if max_tokens is None:
            fits = max(server.max_model_len - len(ids), 1)
            params = _replace(params, max_tokens=fits)
        streams = await server.start([ids], params)
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


def _replace(params, **changes):
    try:
        return dataclasses.replace(params, **changes)
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
