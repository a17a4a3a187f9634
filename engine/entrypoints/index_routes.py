"""What a person finds at the server's root: ``GET /`` is the web page for a browser (when the
server has it: engine/entrypoints/web_routes.py), else names the model and the routes to try,
and ``GET /docs`` lists every route with the OpenAPI schema beside it, as a page that loads
nothing from elsewhere (FastAPI's Swagger page fetches its scripts from a CDN, so it is blank on
a machine without internet). docs/server.md describes each route."""

from __future__ import annotations

import html

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

START_HERE = {
    "/v1/models": "the served model and its adapters",
    "/v1/chat/completions": "OpenAI chat completions (POST)",
    "/v1/completions": "OpenAI completions (POST)",
    "/v1/responses": "OpenAI Responses (POST)",
    "/v1/messages": "Anthropic Messages (POST)",
    "/health": "200 while the engine serves",
    "/metrics": "Prometheus metrics",
    "/docs": "every route, and /openapi.json",
}


def add_index_routes(app: FastAPI, model_name: str, page=None) -> None:
    """GET / (``page()`` for a browser, when given) and GET /docs."""

    @app.get("/", include_in_schema=False)
    async def index(request: Request):
        if page is not None and "text/html" in request.headers.get("accept", ""):
            return page()
        served = {p for r in app.routes for p in [getattr(r, "path", None)] if p}
        routes = {path: what for path, what in START_HERE.items() if path in served}
        return {"server": "pagedllm", "model": model_name, "routes": routes}

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return HTMLResponse(_page(app, model_name))


def _page(app: FastAPI, model_name: str) -> str:
    """An HTML list of the app's routes (method, path, the handler's first docstring line)."""
    rows = []
    for r in sorted(app.routes, key=lambda r: getattr(r, "path", "")):
        methods = sorted(m for m in getattr(r, "methods", ()) or () if m != "HEAD")
        doc = (getattr(getattr(r, "endpoint", None), "__doc__", None) or "").strip()
        doc = doc.split("\n")[0]
        if methods:
            cells = (" ".join(methods), r.path, doc)
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return (
        f"<!doctype html><meta charset=utf-8><title>pagedllm: {html.escape(model_name)}</title>"
        "<style>body{font:15px sans-serif;margin:2em}td{padding:2px 12px 2px 0}</style>"
        f"<h1>pagedllm serving {html.escape(model_name)}</h1>"
        '<p>The machine-readable schema is <a href="/openapi.json">/openapi.json</a>; '
        "docs/server.md in the source describes every route.</p>"
        f"<table><tr><th>method</th><th>path</th><th></th></tr>{''.join(rows)}</table>"
    )
