"""The HTTP layer's own errors and checks, under the OpenAI routes: ``ApiError`` (an error answer
in OpenAI's shape), the API key's check and middleware, and the request body's size and time
limits (engine/entrypoints/limits.py) as a middleware that answers 413 / 408 before the body is
read whole.
"""

from __future__ import annotations

import asyncio
import hmac
import re

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from engine.entrypoints.messages_api import anthropic_error_body
from engine.entrypoints.protocol import error_body

API_KEY = re.compile(r"[!-~](?:[ -~]*[!-~])?")  # printable ASCII, no space at either end
OPEN_PATHS = ("/health",)  # what needs no API key (and /metrics, unless protect_metrics)
ANTHROPIC_PATHS = ("/v1/messages",)  # errors in Anthropic's shape


class ApiError(Exception):
    """An error answer: HTTP status, OpenAI error type, message, optional headers, and the
    request field it is about (OpenAI's ``param``), if one."""

    def __init__(
        self, status: int, message: str, type_: str = "BadRequestError", headers=None, param=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers
        self.param = param

    def response(self, path: str = "") -> JSONResponse:
        """The answer in OpenAI's error shape, or Anthropic's on its routes (``path``)."""
        if path.startswith(ANTHROPIC_PATHS):
            body = anthropic_error_body(self.status, self.message)
        else:
            body = error_body(self.message, self.type, self.status, self.param)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def check_api_key(api_key) -> None:
    """None (no key) or a key a client can send: an empty one must not switch auth off."""
    if api_key is not None and not (isinstance(api_key, str) and API_KEY.fullmatch(api_key)):
        raise ValueError(
            "the API key must be non-empty printable ASCII with no space at either end "
            "(unset it to serve without a key)"
        )


class ApiKeyMiddleware:
    """Every request without the key answers 401, except on the open paths: OpenAI's
    ``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>``. ``open_prefixes``:
    paths under these need no key either, nor ``/`` asked for as HTML (the web page and its
    files). (Plain ASGI: FastAPI's
    ``@app.middleware`` would hide a client's disconnect from the routes.)"""

    def __init__(self, app, api_key: str, open_paths=OPEN_PATHS, open_prefixes=()):
        self.app, self.open_paths = app, frozenset(open_paths)
        self.open_prefixes = tuple(open_prefixes)
        self.bearer, self.key = f"Bearer {api_key}".encode(), api_key.encode()

    def _open(self, path: str, headers: Headers) -> bool:
        if path in self.open_paths:
            return True
        if not self.open_prefixes:
            return False
        page = path == "/" and "text/html" in headers.get("accept", "")
        return page or path.startswith(self.open_prefixes)

    async def __call__(self, scope, receive, send):
        headers = Headers(scope=scope) if scope["type"] == "http" else None
        if headers is not None and not self._open(scope["path"], headers):
            bearer = headers.get("authorization", "").encode("latin-1")
            key = headers.get("x-api-key", "").encode("latin-1")
            ok = hmac.compare_digest(bearer, self.bearer) | hmac.compare_digest(key, self.key)
            if not ok:
                error = ApiError(401, "invalid or missing API key", "AuthenticationError")
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """A body over ``max_bytes`` answers 413: at once when its Content-Length says so, else as
    soon as that many bytes have come. One that has not fully come ``timeout`` seconds after the
    request head answers 408. Both close the connection. A client that disconnects before its
    body has come gets no answer and leaves no traceback in the log."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            error = self._too_large() if length.isdigit() else _closing(400, "bad Content-Length")
            await error.response(scope["path"])(scope, receive, send)
            return
        try:
            await self.app(scope, self._receive(receive), send)
        except ClientDisconnect:  # gone mid-body: nobody to answer, nothing to log
            return

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
