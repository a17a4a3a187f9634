"""The HTTP API over one ``AsyncLLM`` (FastAPI): ``build_app(llm, name)`` and its routes.

Here:        POST /v1/completions, /v1/chat/completions   (``stream: true``: server-sent events)
             GET  /health, /v1/models, /tokenizer_info, /metrics    POST /tokenize, /detokenize
Beside it:   /v1/messages, /v1/messages/count_tokens         messages_routes.py (Anthropic)
             /v1/responses, GET/DELETE /v1/responses/{id}    responses_routes.py
             /v1/embeddings, /pooling, /v2/embed, /classify,
             /score, /rerank                                 embeddings_routes.py (pooling)
             /v1/load_lora_adapter, /v1/unload_lora_adapter  lora_routes.py
             GET /, /docs, /openapi.json                     index_routes.py, here
             GET / (a browser), /web/*, /v1/engine/events    web_routes.py (the web page)
The shared state and checks are ``server_state.Server``; ``sse.reply`` ends a route as a stream
or a body.

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

import contextlib
import functools
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from engine.entrypoints.embeddings_api import (
    ClassifyRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from engine.entrypoints.embeddings_routes import add_embeddings_routes
from engine.entrypoints.index_routes import add_index_routes
from engine.entrypoints.limits import ServerLimits
from engine.entrypoints.lora_routes import add_lora_routes
from engine.entrypoints.messages_api import (
    CountTokensRequest,
    MessagesRequest,
)
from engine.entrypoints.messages_routes import add_messages_routes
from engine.entrypoints.middleware import (
    OPEN_PATHS,
    ApiError,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    check_api_key,
)
from engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.entrypoints.reasoning import check_parser
from engine.entrypoints.responses import CompletionFormat
from engine.entrypoints.responses_api import (
    ResponsesRequest,
)
from engine.entrypoints.responses_routes import add_responses_routes
from engine.entrypoints.server_state import Server, call, start_chat, validation_message
from engine.entrypoints.sse import reply
from engine.entrypoints.tokenize_routes import (
    detokenize_body,
    json_response,
    tokenize_body,
    tokenizer_info_body,
)
from engine.entrypoints.tool_parsers import make_parser
from engine.entrypoints.web_routes import PAGE_PREFIX, add_web_routes
from engine.frontend.async_llm import AsyncLLM

CHAT_FORMATS = ("harmony", "template")  # --chat-format
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
log = logging.getLogger("engine.serve")


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
    web_ui: bool = True,
    chat_format: str | None = None,
) -> FastAPI:
    """The FastAPI app; ``app.state.server`` holds the shared state. With ``api_key`` every
    route but /health (and /metrics, unless ``protect_metrics``) needs it. ``lora_modules``:
    (name, path) adapters served as models of their own; ``runtime_lora``: the routes that
    load and unload them while it runs; ``web_ui``: the web page at / and its live view's
    events (engine/entrypoints/web_routes.py)."""
    check_api_key(api_key)
    server = Server(llm, model_name, api_key, aliases, limits)
    if chat_format is not None:  # --chat-format: harmony or template (else: the model's family)
        if chat_format not in CHAT_FORMATS:
            raise ValueError(
                f"chat format must be one of {', '.join(CHAT_FORMATS)}, got {chat_format!r}"
            )
        server.set_format(chat_format == "harmony")
    if tool_parser is not None:
        make_parser(tool_parser)  # a ValueError names an unknown one
        server.tool_parser = tool_parser
    if reasoning_parser is not None:
        server.reasoning_parser = check_parser(reasoning_parser)
    how = "given" if tool_parser is not None else "from the chat format"
    log.info("chat format: %s", "harmony" if server.harmony else "the chat template")
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
        page = (PAGE_PREFIX,) if web_ui else ()
        app.add_middleware(
            ApiKeyMiddleware, api_key=api_key, open_paths=open_paths, open_prefixes=page
        )
    _add_info_routes(app, server)
    _add_generation_routes(app, server)
    add_messages_routes(app, server)
    add_responses_routes(app, server)
    add_embeddings_routes(app, server)
    if runtime_lora:
        add_lora_routes(app, server)
    page = add_web_routes(app, server) if web_ui else None  # the web page and its events
    add_index_routes(app, server.model_name, page)  # GET / and an offline /docs
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
        return ApiError(400, validation_message(exc.errors())).response(request.url.path)

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
        named = call(req.constraint)
        constraint = named[1] if named else None
        # echo with logprobs needs the prompt's: as many as logprobs, or prompt_logprobs asks
        wanted = [req.prompt_logprobs, req.logprobs if req.echo else None]
        prompt_lps = max((k for k in wanted if k is not None), default=None)
        given = 1 if echo_only else max_tokens  # the engine makes one token at least
        defaults = server.sampling_defaults
        args = (given, req.logprobs, defaults, constraint, prompt_lps)
        params = await server.run(size, call, req.sampling_params, *args)  # checks logit_bias
        prompts = await server.run(size, server.prompt_ids, req)
        server.check_room(prompts, None if echo_only else req.max_tokens, "max_tokens")
        await server.compile(named)
        streams = await server.start(prompts, params, req.stream, req.model)
        texts = await server.run(size, server.prompt_texts, req, prompts) if req.echo else None
        fmt = CompletionFormat(
            server.tokenizer, req.model or server.model_name, req, texts, echo_only
        )
        return await reply(raw, server.limits, streams, req.stream, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        req, size = await server.parse(raw, ChatCompletionRequest)
        streams, fmt, _ = await start_chat(server, req, size)
        return await reply(raw, server.limits, streams, req.stream, fmt)
