"""The OpenAI-compatible HTTP API over one ``AsyncLLM`` (FastAPI): ``build_app(llm, name)``.

POST /v1/completions, /v1/chat/completions   (``stream: true``: server-sent events, ``[DONE]``)
GET  /v1/models, /health, /metrics, /tokenizer_info      POST /tokenize, /detokenize

A request body is read within its limits (size, time; engine/entrypoints/limits.py), parsed by
its pydantic model (engine/entrypoints/protocol.py), checked for fields this server does not
implement and against the bounds, tokenized (in a worker thread when it is large, so the event
loop keeps answering), turned into a ``SamplingParams`` (with a constraint on the output from
``response_format``, ``structured_outputs``, a ``guided_*`` field or ``tool_choice``, compiled in
a worker thread before the request is queued) and handed to ``AsyncLLM.add_requests``; the
outputs become response bodies or chunks in engine/entrypoints/responses.py. Every refusal on
the way is an error in OpenAI's shape (400 bad input, 401 no key, 408 slow body, 413 large body,
503 queue full) and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from engine.core.structured import StructuredOutputsParams
from engine.entrypoints.embeddings_api import (
    ClassifyRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    classify_body,
    cohere_body,
    cohere_prompt_name,
    embeddings_body,
    input_ids,
    pooling_body,
    rerank_body,
    score_body,
)
from engine.entrypoints.index_routes import add_index_routes
from engine.entrypoints.limits import KiB, ServerLimits, check_sampling_bounds, parse_json_body
from engine.entrypoints.lora_routes import ServedAdapters, add_lora_routes
from engine.entrypoints.messages_api import (
    CountTokensRequest,
    MessageEvents,
    MessagesRequest,
    anthropic_error_body,
    message_body,
)
from engine.entrypoints.middleware import (
    OPEN_PATHS,
    ApiError,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    check_api_key,
)
from engine.entrypoints.prometheus import PrometheusStatLogger
from engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    UnsupportedField,
    error_body,
)
from engine.entrypoints.reasoning import check_parser, grammar_bounds, prompt_state
from engine.entrypoints.responses import ChatFormat, CompletionFormat, final_output
from engine.entrypoints.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    as_chat_message,
    output_items,
    response_body,
)
from engine.entrypoints.tokenize_routes import (
    detokenize_body,
    json_response,
    tokenize_body,
    tokenizer_info_body,
)
from engine.entrypoints.tool_parsers import make_parser, parser_for_template
from engine.entrypoints.uvicorn_config import ABORT_CONNECTION
from engine.frontend.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestStream
from engine.frontend.chat import chat_prompt_ids
from engine.frontend.input_processor import tokenize_prompt
from engine.lora.request import LoRARequest
from engine.pooling_params import PoolingParams, prompt_before, score_pooling, score_prompt
from engine.sampling_params import SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
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
        self.tool_parser = parser_for_template(getattr(self.tokenizer, "chat_template", None))
        self._compiler_lock = threading.Lock()  # the engine's grammar compiler is built once

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
        self, conversation: list[dict], add_generation_prompt, max_chars, tools, *why, kw=None
    ):
        try:
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
        raise ApiError(400, _validation_message(e.errors())) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def build_app(
    llm: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    aliases=(),
    limits: ServerLimits | None = None,
    protect_metrics: bool = False,
    lora_modules=(),
    runtime_lora: bool = False,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app; ``app.state.server`` holds the shared state. With ``api_key`` every
    route but /health (and /metrics, unless ``protect_metrics``) needs it. ``lora_modules``:
    (name, path) adapters served as models of their own; ``runtime_lora``: the routes that
    load and unload them while it runs."""
    check_api_key(api_key)
    server = Server(llm, model_name, api_key, aliases, limits)
    if tool_parser is not None:
        make_parser(tool_parser)  # a ValueError names an unknown one
        server.tool_parser = tool_parser
    if reasoning_parser is not None:
        server.reasoning_parser = check_parser(reasoning_parser)
    how = "given" if tool_parser is not None else "from the chat template"
    thinking = server.reasoning_parser or "none (every output is the answer)"
    log.info("tool-call parser: %s (%s); reasoning parser: %s", server.tool_parser, how, thinking)
    for name, path in lora_modules:
        server.adapters.add(name, path)
    app = FastAPI(
        title="pagedllm", version="0.1.0", lifespan=_lifespan(server), docs_url=None,
        redoc_url=None,
    )  # fmt: skip
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
    _add_responses_routes(app, server)
    _add_embeddings_routes(app, server)
    if runtime_lora:
        add_lora_routes(app, server)
    add_index_routes(app, server.model_name)  # GET / and an offline /docs
    app.openapi = functools.partial(_openapi, app)
    return app


# the request models of the routes that parse their own bodies (Server.parse): FastAPI cannot
# see them, so /openapi.json (and /docs) get them here
BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/pooling": EmbeddingRequest,
    "/v2/embed": CohereEmbedRequest,
    "/rerank": RerankRequest,
    "/score": ScoreRequest,
    "/classify": ClassifyRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's OpenAPI document with each route's request body schema from BODIES."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            content = {"application/json": {"schema": ref}}
            doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
        app.openapi_schema = doc
    return app.openapi_schema


def _lifespan(server: Server):
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        server.workers.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return ApiError(400, _validation_message(exc.errors())).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        path = request.url.path
        where = f"{request.method} {path}"
        if exc.status_code == 404:  # no such route: say which, in OpenAI's shape
            return ApiError(404, f"{where}: no such route", "NotFoundError").response(path)
        if exc.status_code == 405:
            allow = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow", "others")
            message = f"{where}: the route takes {allow}"
            return ApiError(405, message, "MethodNotAllowed", exc.headers).response(path)
        error = ApiError(exc.status_code, str(exc.detail), "HTTPError", exc.headers)
        return error.response(path)


def _validation_message(errors: list[dict]) -> str:
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
        loras = server.adapters.cards(server.model_name, server.max_model_len)
        return {"object": "list", "data": [card, *loras]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_info_body(server.tokenizer, server.max_model_len)

    @app.get("/metrics")
    async def metrics():
        body = await server.render_metrics()
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        req, size = await server.parse(raw, TokenizeRequest)
        server.check_model(req.model)
        return json_response(await server.run(size, tokenize_body, server, req))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req, size = await server.parse(raw, DetokenizeRequest)
        server.check_model(req.model)
        return json_response(await server.run(size, detokenize_body, server, req.tokens))


def _add_generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(raw: Request):
        req, size = await server.parse(raw, CompletionRequest)
        server.check_request(req, ("logprobs", req.logprobs))
        max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        echo_only = req.echo and max_tokens == 0  # the prompt alone: see CompletionFormat
        if echo_only and req.min_tokens:
            raise ApiError(400, f"min_tokens must be 0 with max_tokens 0, got {req.min_tokens}")
        named = _call(req.constraint)
        constraint = named[1] if named else None
        # echo with logprobs needs the prompt's: as many as logprobs, or prompt_logprobs asks
        wanted = [req.prompt_logprobs, req.logprobs if req.echo else None]
        prompt_lps = max((k for k in wanted if k is not None), default=None)
        given = 1 if echo_only else max_tokens  # the engine makes one token at least
        defaults = server.sampling_defaults
        args = (given, req.logprobs, defaults, constraint, prompt_lps)
        params = await server.run(size, _call, req.sampling_params, *args)  # checks logit_bias
        prompts = await server.run(size, server.prompt_ids, req)
        server.check_room(prompts, None if echo_only else req.max_tokens, "max_tokens")
        await server.compile(named)
        streams = await server.start(prompts, params, req.stream, req.model)
        texts = await server.run(size, server.prompt_texts, req, prompts) if req.echo else None
        fmt = CompletionFormat(
            server.tokenizer, req.model or server.model_name, req, texts, echo_only
        )
        if req.stream:
            return _sse(fmt.chunks(streams), streams, server.limits.stream_write_timeout)
        return await _unless_disconnected(raw, fmt.response(streams))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        req, size = await server.parse(raw, ChatCompletionRequest)
        streams, fmt, _ = await start_chat(server, req, size)
        if req.stream:
            return _sse(fmt.chunks(streams), streams, server.limits.stream_write_timeout)
        return await _unless_disconnected(raw, fmt.response(streams))

    @app.post("/v1/messages")
    async def messages(raw: Request):
        """Anthropic's Messages API, run as a chat completion (messages_api.py)."""
        areq, size = await server.parse(raw, MessagesRequest)
        req = _as_chat(server, areq)
        streams, fmt, ids = await start_chat(server, req, size)
        if req.stream:
            events = MessageEvents(areq.model, len(ids)).events(fmt.chunks(streams))
            timeout = server.limits.stream_write_timeout
            return _sse_events(events, streams, timeout, _anthropic_error)
        body = await _unless_disconnected(raw, fmt.response(streams))
        return message_body(body, areq.model)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw: Request):
        """The prompt's tokens as /v1/messages would template it (system, messages, tools)."""
        areq, size = await server.parse(raw, CountTokensRequest)
        req = _as_chat(server, areq)
        server.check_model(req.model)
        ids = await server.run(size, chat_request_ids, server, req)
        return {"input_tokens": len(ids)}


def _add_embeddings_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(raw: Request):
        """OpenAI's embeddings over the pooling runner (embeddings_api.py)."""
        req, size = await server.parse(raw, EmbeddingRequest)
        vectors, tokens = await _embed(raw, server, req, size, req.dimensions, "/v1/embeddings")
        model = req.model or server.model_name
        return embeddings_body(model, vectors, tokens, req.encoding_format)

    @app.post("/pooling")
    async def pooling(raw: Request):
        """vLLM's /pooling: each input's pooled vector (embeddings_api.py)."""
        req, size = await server.parse(raw, EmbeddingRequest)
        vectors, tokens = await _embed(raw, server, req, size, req.dimensions, "/pooling")
        return pooling_body(req.model or server.model_name, vectors, tokens)

    @app.post("/v2/embed")
    async def cohere_embed(raw: Request):
        """Cohere's /v2/embed (embeddings_api.py)."""
        creq, size = await server.parse(raw, CohereEmbedRequest)
        _call(creq.check)
        name = cohere_prompt_name(creq.input_type, server.llm.engine.prompts)
        req = EmbeddingRequest(model=creq.model, input=creq.texts, prompt_name=name)
        dims = creq.output_dimension
        vectors, tokens = await _embed(raw, server, req, size, dims, "/v2/embed")
        return cohere_body(creq.model or server.model_name, creq, vectors, tokens)

    @app.post("/classify")
    async def classify(raw: Request):
        """A sequence classifier's label probabilities per input (embeddings_api.py)."""
        creq, size = await server.parse(raw, ClassifyRequest)
        _check_pooling(server, creq.model, "/classify")
        req = _call(creq.embedding_request)
        ids = await _input_ids(server, req, size)
        pooling = PoolingParams(task="classify", activation=creq.use_activation)
        rows = await _pooled(raw, server, req.model, ids, pooling)
        tokens, labels = sum(len(x) for x in ids), server.llm.engine.model_config.labels
        return classify_body(creq.model or server.model_name, labels, rows, tokens)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(raw: Request):
        """The documents by a reranker's score (embeddings_api.py)."""
        req, size = await server.parse(raw, RerankRequest)
        scores, tokens = await _score(raw, server, req, req.query, req.documents, size, "/rerank")
        return rerank_body(req.model or server.model_name, req, scores, tokens)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(raw: Request):
        """text_1 against each of text_2 (embeddings_api.py)."""
        req, size = await server.parse(raw, ScoreRequest)
        docs = req.documents()
        scores, tokens = await _score(raw, server, req, req.text_1, docs, size, "/score")
        return score_body(req.model or server.model_name, scores, tokens)


async def _embed(raw, server: Server, req: EmbeddingRequest, size: int, dims, route: str):
    """(each input's vector, the inputs' tokens) through the pooling runner."""
    _check_pooling(server, req.model, route)
    engine = server.llm.engine
    before = _call(prompt_before, engine.prompts, req.prompt_name, engine.default_prompt_name)
    ids = await _input_ids(server, req, size, before)
    pooling = engine.pooling_defaults
    if dims is not None:
        pooling = _call(dataclasses.replace, pooling, dimensions=dims)
    return await _pooled(raw, server, req.model, ids, pooling), sum(len(x) for x in ids)


async def _score(raw, server: Server, req, query: str, docs: list[str], size: int, route: str):
    """(each document's score, the prompts' tokens): its pair in the reranker's prompt, the
    model's P(yes) against P(no) next, or a one-label classifier's sigmoid (the pooling
    runner's score task)."""
    _check_pooling(server, req.model, route)
    if req.score_tokens is not None and len(req.score_tokens) != 2:
        raise ApiError(400, "score_tokens: two token ids (yes, no)")
    ids = tuple(req.score_tokens) if req.score_tokens else None
    labels = server.llm.engine.model_config.num_labels
    pooling = _call(score_pooling, ids, labels, server.tokenizer)
    texts = [_call(score_prompt, query, d, req.template, req.instruction) for d in docs]
    prompts = [(await _input_ids(server, EmbeddingRequest(input=t), size))[0] for t in texts]
    vectors = await _pooled(raw, server, req.model, prompts, pooling)
    return [v[0] for v in vectors], sum(len(p) for p in prompts)


def _check_pooling(server: Server, model: str | None, route: str) -> None:
    """A served model, on a server that pools (--runner pooling)."""
    server.check_model(model)
    if server.llm.engine.config.runner != "pooling":
        raise ApiError(400, f"{route} needs a server started with --runner pooling (this one "
                            "generates)")  # fmt: skip


async def _input_ids(server: Server, req: EmbeddingRequest, size: int, prompt: str = ""):
    """Each input's token ids, checked (embeddings_api.input_ids), in a worker when large;
    ``prompt`` before each text."""
    args = (server.tokenizer, server.vocab_size, server.max_model_len, server.max_prompt_chars)
    return await server.run(size, _call, input_ids, req, *args, prompt)


async def _pooled(raw, server: Server, model, prompts: list, pooling: PoolingParams) -> list:
    """Each prompt's pooled output (a vector; a score's one value), queued together."""
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    streams = await server.start(prompts, params, False, model)
    whole = asyncio.gather(*[final_output(s) for s in streams])
    finals = await _unless_disconnected(raw, whole)
    for o in finals:
        if o.outputs[0].error:
            raise ApiError(500, f"pooling failed: {o.outputs[0].error}", "InternalError")
    return [o.embedding for o in finals]


def _add_responses_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/responses")
    async def responses(raw: Request):
        """OpenAI's Responses API, run as a chat completion (responses_api.py)."""
        rreq, size = await server.parse(raw, ResponsesRequest)
        _call(rreq.check_supported)
        history = _previous(server, rreq.previous_response_id)
        req = _validated_chat(_call(rreq.chat, history))
        streams, fmt, _ = await start_chat(server, req, size)
        rid, created = f"resp_{uuid.uuid4().hex}", time.time()
        conversation = history + rreq.messages()

        def keep(body: dict) -> None:
            if rreq.store:
                server.responses.put(body, [*conversation, as_chat_message(body["output"])])

        if req.stream:
            events = ResponseEvents(rreq, rid, created, keep).events(fmt.chunks(streams))
            return _sse_events(events, streams, server.limits.stream_write_timeout, _openai_error)
        chat = await _unless_disconnected(raw, fmt.response(streams))
        choice = chat["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = output_items(choice["message"], status)
        body = response_body(rreq, rid, created, output, choice["finish_reason"], chat["usage"])
        keep(body)
        return body

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return _stored(server, response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        _stored(server, response_id)
        server.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _stored(server: Server, response_id: str, field: str | None = None):
    found = server.responses.get(response_id)
    if found is None:
        where = f"{field}: " if field else ""
        ttl = server.limits.responses_ttl
        raise ApiError(
            404,
            f"{where}no stored response {response_id!r} (responses made with store: true are "
            f"kept {ttl:g} s, the last {server.limits.responses_store})",
            "NotFoundError",
            param=field,
        )
    return found


def _previous(server: Server, response_id: str | None) -> list[dict]:
    """The conversation a stored response ended (previous_response_id), or none."""
    if response_id is None:
        return []
    return list(_stored(server, response_id, "previous_response_id")[1])


def _validated_chat(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise ApiError(400, _validation_message(e.errors())) from None


def _openai_error(e: Exception) -> tuple[str, dict]:
    return "error", {"type": "error", "code": "503", "message": str(e), "param": None}


def _anthropic_error(e: Exception) -> tuple[str, dict]:
    return "error", anthropic_error_body(503, str(e))


def _as_chat(server: Server, areq: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request runs as; 400 for what it cannot be."""
    _call(areq.check_supported, server.reasoning_parser is not None)
    return _validated_chat(_call(areq.chat))


async def start_chat(server: Server, req: ChatCompletionRequest, size: int):
    """A chat request checked, templated and queued: (its streams, the ChatFormat that turns
    them into bodies or chunks, the prompt's ids). Every field is checked before the template
    runs."""
    top = (req.top_logprobs or 0) if req.logprobs else None
    server.check_request(req, ("top_logprobs", top))
    mode = _call(req.tool_mode, server.tool_parser)
    named = _call(req.constraint, mode)
    constraint = named[1] if named else None
    max_tokens = req.max_completion_tokens
    max_tokens = req.max_tokens if max_tokens is None else max_tokens
    given = server.max_model_len if max_tokens is None else max_tokens  # unset: what fits
    args = (given, top, server.sampling_defaults, constraint, req.prompt_logprobs)
    params = await server.run(size, _call, req.sampling_params, *args)
    ids = await server.run(size, chat_request_ids, server, req)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    server.check_room([ids], max_tokens, field)
    if max_tokens is None:
        fits = max(server.max_model_len - len(ids), 1)
        params = _call(dataclasses.replace, params, max_tokens=fits)
    reasoning = None
    if server.reasoning_parser is not None:
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
    return streams, ChatFormat(server.tokenizer, model, req, mode, reasoning), ids


def chat_request_ids(server: Server, req: ChatCompletionRequest) -> list[int]:
    """The chat request's prompt: its conversation and tools through the chat template."""
    conv = _call(req.conversation)
    tools, agp = req.template_tools(), req.add_generation_prompt
    return server.chat_ids(conv, agp, server.max_prompt_chars, tools, kw=req.chat_template_kwargs)


async def _unless_disconnected(raw: Request, coro, poll: float = 0.1):
    """Await a whole (non-streamed) answer; if the client hangs up first, cancel it, which
    aborts its requests. (A streamed answer is cancelled by the server on disconnect.)"""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll)
        if done:
            try:
                return task.result()
            except EngineDeadError as e:
                raise ApiError(503, str(e), "ServiceUnavailableError") from None
        if await raw.is_disconnected():
            task.cancel()
            raise ApiError(499, "client disconnected", "ClientDisconnected")


def _call(fn, *args, **kwargs):
    """fn(*args, **kwargs), its ValueError a 400."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _sse(chunks: AsyncIterator[dict], streams, write_timeout: float) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except EngineDeadError as e:  # the status is sent: the stream ends with the error
            yield f"data: {json.dumps(error_body(str(e), 'ServiceUnavailableError', 503))}\n\n"
        yield "data: [DONE]\n\n"

    return _ReadOrLose(events(), streams, write_timeout)


def _sse_events(events: AsyncIterator[tuple[str, dict]], streams, write_timeout: float, error):
    """Named server-sent events (``event: name``, then ``data: {json}``): Anthropic's and the
    Responses API's streams; an engine that dies mid-stream ends it with ``error(e)``'s event."""

    def line(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def lines():
        try:
            async for name, data in events:
                yield line(name, data)
        except EngineDeadError as e:
            yield line(*error(e))

    return _ReadOrLose(lines(), streams, write_timeout)


class _ReadOrLose(StreamingResponse):
    """A server-sent event stream whose client must keep reading. A client that stops (its
    socket's buffers full, uvicorn's send waiting to drain) would hold the requests' blocks
    until max_tokens; a chunk that waits ``write_timeout`` seconds aborts them instead and drops
    the connection (uvicorn_config.ABORT_CONNECTION; a server without it closes the connection
    of an unfinished response itself)."""

    def __init__(self, events, streams: list[RequestStream], write_timeout: float):
        super().__init__(events, media_type="text/event-stream")
        self.streams, self.write_timeout = streams, write_timeout
        self.drop = None

    async def __call__(self, scope, receive, send) -> None:
        self.drop = scope.get("extensions", {}).get(ABORT_CONNECTION)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send) -> None:
        async def timed(message):
            async with asyncio.timeout(self.write_timeout):
                await send(message)

        try:
            await super().stream_response(timed)
        except TimeoutError:
            ids = ", ".join(s.request_id for s in self.streams)
            log.warning(
                "a client read nothing for %.3g s (--stream-write-timeout): aborted %s",
                self.write_timeout,
                ids,
            )
            for s in self.streams:
                s.abort()
            await self.body_iterator.aclose()
            if self.drop is not None:
                self.drop()
