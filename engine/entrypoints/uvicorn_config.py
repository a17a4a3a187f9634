"""uvicorn's settings from ``ServerLimits``, and the one guard uvicorn lacks: a time limit on the
request head, so a client that sends half a request (slowloris) loses its connection.

uvicorn closes a keep-alive connection that stays idle (``timeout_keep_alive``), bounds a head's
size (``h11_max_incomplete_event_size``) and answers 503 past ``limit_concurrency`` connections
or requests, but it waits for the rest of a started head for ever. ``HeadTimeoutProtocol`` (its
h11 protocol) arms a timer when a connection opens and when bytes of a new request arrive, and
closes the connection if the head is not complete when it fires.

It also gives each request's ASGI scope an extension, ``scope["extensions"][ABORT_CONNECTION]``:
a callable that drops the connection at once, unsent bytes and all. A stream whose client
stopped reading needs it: a plain close would wait for those bytes to drain, for ever.
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.entrypoints.limits import ServerLimits

DEFAULT_HEAD_TIMEOUT = ServerLimits.request_header_timeout
ABORT_CONNECTION = "pagedllm.abort_connection"


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol; a request head must be complete ``head_timeout`` seconds after
    its connection opened or its first byte came."""

    def __init__(self, config: uvicorn.Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.head_timeout = getattr(config, "request_header_timeout", DEFAULT_HEAD_TIMEOUT)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._timed_cycle = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests() and self._head_timer is None:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:  # its app has not run yet
            self.cycle.scope.setdefault("extensions", {})[ABORT_CONNECTION] = self.transport.abort
        if self._head_timer is not None and self.cycle is not self._timed_cycle:
            self._disarm()  # a whole head came: the request runs

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._timed_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.logger.debug("closed a connection: no request head in %gs", self.head_timeout)
            self.transport.close()


def uvicorn_config(app, limits: ServerLimits, **kwargs) -> uvicorn.Config:
    """A uvicorn.Config for app with the connection limits; kwargs: the other settings."""
    config = uvicorn.Config(
        app,
        http=HeadTimeoutProtocol,
        timeout_keep_alive=limits.timeout_keep_alive,
        limit_concurrency=limits.limit_concurrency,
        h11_max_incomplete_event_size=limits.h11_max_incomplete_event_size,
        **kwargs,
    )
    config.request_header_timeout = limits.request_header_timeout  # read by the protocol
    return config
