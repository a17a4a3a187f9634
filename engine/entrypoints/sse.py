"""How a route ends: ``reply`` sends a request's answer as server-sent events when it streams
(OpenAI's ``data:`` chunks, or the named events of the Responses and Messages APIs) or as one
body, awaited unless the client hangs up; ``ReadOrLose`` aborts the requests of a client that
stops reading."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.entrypoints.middleware import (
    ApiError,
)
from engine.entrypoints.protocol import (
    error_body,
)
from engine.entrypoints.uvicorn_config import ABORT_CONNECTION
from engine.frontend.async_llm import EngineDeadError, RequestStream

log = logging.getLogger("engine.serve")


async def unless_disconnected(raw: Request, coro, poll: float = 0.1):
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


def sse(chunks: AsyncIterator[dict], streams, write_timeout: float) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except EngineDeadError as e:  # the status is sent: the stream ends with the error
            yield f"data: {json.dumps(error_body(str(e), 'ServiceUnavailableError', 503))}\n\n"
        yield "data: [DONE]\n\n"

    return ReadOrLose(events(), streams, write_timeout)


def sse_events(events: AsyncIterator[tuple[str, dict]], streams, write_timeout: float, error):
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

    return ReadOrLose(lines(), streams, write_timeout)


class ReadOrLose(StreamingResponse):
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


async def reply(
    raw: Request, limits, streams, stream: bool, fmt, events=None, error=None, body=None
):
    """A route's answer for its queued ``streams``: streamed, server-sent events of ``fmt``'s
    chunks (``events(chunks)``: named events instead, ``error(e)`` the event that ends a stream
    whose engine died); else ``fmt``'s whole body (``body(whole)``: translated), awaited unless
    the client hangs up first."""
    if stream:
        chunks = fmt.chunks(streams)
        if events is None:
            return sse(chunks, streams, limits.stream_write_timeout)
        return sse_events(events(chunks), streams, limits.stream_write_timeout, error)
    whole = await unless_disconnected(raw, fmt.response(streams))
    return whole if body is None else body(whole)
