"""OpenAI's Responses API routes: ``POST /v1/responses`` run as a chat completion
(engine/entrypoints/responses_api.py), continued from a stored response by
``previous_response_id``; ``GET`` and ``DELETE /v1/responses/{id}`` read and drop stored ones."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from engine.entrypoints.middleware import (
    ApiError,
)
from engine.entrypoints.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    as_chat_message,
    output_items,
    response_body,
)
from engine.entrypoints.server_state import Server, call, openai_error, start_chat, validated_chat
from engine.entrypoints.sse import reply


def add_responses_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/responses")
    async def responses(raw: Request):
        """OpenAI's Responses API, run as a chat completion (responses_api.py)."""
        rreq, size = await server.parse(raw, ResponsesRequest)
        call(rreq.check_supported)
        history = _previous(server, rreq.previous_response_id)
        body = call(rreq.chat, history)
        if not server.harmony:  # reasoning.effort is for a harmony model only
            body.pop("reasoning_effort", None)
        req = validated_chat(body)
        streams, fmt, _ = await start_chat(server, req, size)
        rid, created = f"resp_{uuid.uuid4().hex}", time.time()
        conversation = history + rreq.messages()

        def keep(body: dict) -> None:
            if rreq.store:
                server.responses.put(body, [*conversation, as_chat_message(body["output"])])

        def whole(chat: dict) -> dict:
            choice = chat["choices"][0]
            status = "incomplete" if choice["finish_reason"] == "length" else "completed"
            output = output_items(choice["message"], status)
            reason = choice["finish_reason"]
            body = response_body(rreq, rid, created, output, reason, chat["usage"])
            keep(body)
            return body

        events = ResponseEvents(rreq, rid, created, keep).events
        return await reply(
            raw, server.limits, streams, req.stream, fmt, events, openai_error, whole
        )

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
