"""The web page: ``GET /`` for a browser (``Accept: text/html``) is a chat page over this
server's own API, with a second view that draws the engine live; its files are under ``/web/``
(engine/entrypoints/web/, and the pool drawing it shares with the run replay,
engine/frontend/pool_view.js). ``GET /v1/engine/events`` streams the live view's frames
(engine/entrypoints/live_events.py).

The page and its files need no API key (they hold no data); everything they fetch does. Each is
served with ``CSP``: scripts and styles from this server only, no inline script, no frame, no
other host. ``--disable-web-ui`` leaves these routes out (404)."""

from __future__ import annotations

import json
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.entrypoints.live_events import LiveTap
from engine.entrypoints.middleware import ApiError

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
PAGE_PREFIX = "/web/"  # the page's files (no key needed)
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"}


def static_files() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, media type): the page's files and the shared pool drawing."""
    files = {}
    web = resources.files("engine.entrypoints").joinpath("web")
    for entry in web.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if suffix in TYPES:
            files[entry.name] = (entry.read_bytes(), TYPES[suffix])
    shared = resources.files("engine.frontend").joinpath("pool_view.js")
    files["pool_view.js"] = (shared.read_bytes(), TYPES[".js"])
    return files


def wants_page(request: Request) -> bool:
    """A browser's request for / (it accepts HTML), not an API client's."""
    return "text/html" in request.headers.get("accept", "")


def add_web_routes(app: FastAPI, server):
    """/web/{name}, /web/config.json and /v1/engine/events; returns ``page()``, the answer
    index_routes.py gives a browser at GET /."""
    files = static_files()
    tap = LiveTap(server.llm)

    @app.get(PAGE_PREFIX + "config.json", include_in_schema=False)
    async def config():
        """What the page needs before it asks for anything: whether there is a key."""
        body = {"model": server.model_name, "auth": server.api_key is not None}
        body["live"] = tap.why is None
        body["live_why"] = tap.why
        return Response(json.dumps(body), media_type="application/json", headers=HEADERS)

    @app.get(PAGE_PREFIX + "{name}", include_in_schema=False)
    async def static(name: str):
        if name not in files:
            raise ApiError(404, f"GET {PAGE_PREFIX}{name}: no such file", "NotFoundError")
        body, media = files[name]
        return Response(body, media_type=media, headers=HEADERS)

    @app.get("/v1/engine/events")
    async def engine_events():
        """The engine's steps as server-sent events: the live view's frames."""
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(tap.events(), media_type="text/event-stream", headers=headers)

    app.state.live_tap = tap  # the tests watch its hooks

    def page() -> Response:
        return Response(files["index.html"][0], media_type=TYPES[".html"], headers=HEADERS)

    return page
