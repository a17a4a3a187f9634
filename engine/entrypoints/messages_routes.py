"""Anthropic's Messages API routes, ``POST /v1/messages`` and ``/v1/messages/count_tokens``: each
request translated to a chat completion (engine/entrypoints/messages_api.py), run, and its
answer or stream translated back."""

from __future__ import annotations

import functools

from fastapi import FastAPI, Request

from engine.entrypoints.messages_api import (
    CountTokensRequest,
    MessageEvents,
    MessagesRequest,
    anthropic_error_body,
    message_body,
)
from engine.entrypoints.protocol import (
    ChatCompletionRequest,
)
from engine.entrypoints.server_state import (
    Server,
    call,
    chat_request_ids,
    start_chat,
    validated_chat,
)
from engine.entrypoints.sse import reply


def add_messages_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/messages")
    async def messages(raw: Request):
        """Anthropic's Messages API, run as a chat completion (messages_api.py)."""
        areq, size = await server.parse(raw, MessagesRequest)
        req = _as_chat(server, areq)
        streams, fmt, ids = await start_chat(server, req, size)
        events = MessageEvents(areq.model, len(ids)).events
        body = functools.partial(message_body, model=areq.model)
        return await reply(
            raw, server.limits, streams, req.stream, fmt, events, _anthropic_error, body
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw: Request):
        """The prompt's tokens as /v1/messages would template it (system, messages, tools)."""
        areq, size = await server.parse(raw, CountTokensRequest)
        req = _as_chat(server, areq)
        server.check_model(req.model)
        ids = await server.run(size, chat_request_ids, server, req)
        return {"input_tokens": len(ids)}


def _anthropic_error(e: Exception) -> tuple[str, dict]:
    return "error", anthropic_error_body(503, str(e))


def _as_chat(server: Server, areq: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request runs as; 400 for what it cannot be."""
    call(areq.check_supported, server.reasoning_parser is not None)
    body = call(areq.chat)
    if not server.harmony:  # thinking's effort is for a harmony model only
        body.pop("reasoning_effort", None)
    return validated_chat(body)
