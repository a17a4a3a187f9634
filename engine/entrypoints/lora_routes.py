"""The server's LoRA adapters: each served adapter is a model name of its own (``--lora-modules
name=path``); a request's ``model`` chooses it. With ``--allow-runtime-lora-updating``, vLLM's
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and remove names while the
server runs (behind ``--api-key`` like every route)."""

from __future__ import annotations

import asyncio
import itertools
import time

from fastapi import FastAPI, Request

from engine.entrypoints.middleware import ApiError
from engine.lora.adapter import load_adapter
from engine.lora.request import LoRARequest


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """``name=path`` items -> (name, path) pairs; a ValueError names a bad one."""
    pairs = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {spec!r} is not name=path")
        pairs.append((name, path))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name is given twice in {names}")
    return pairs


class ServedAdapters:
    """Adapter name -> its LoRARequest; ids are handed out in order and never reused."""

    def __init__(self, engine, base_names: set[str]):
        self.engine, self.base_names = engine, base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name``, read and checked against the model now (a
        ValueError names what does not fit)."""
        cfg = self.engine.config
        if not cfg.enable_lora:
            raise ValueError("LoRA adapters need the server started with --enable-lora")
        if name in self.by_name or name in self.base_names:
            raise ValueError(f"the name {name!r} is already served")
        load_adapter(path, self.engine.model_config, cfg.max_lora_rank, name)  # its checks
        req = LoRARequest(name, next(self._ids), path)
        self.by_name[name] = req
        return req

    def remove(self, name: str) -> None:
        """Stop serving ``name``; requests already running with it finish."""
        if self.by_name.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")

    def cards(self, parent: str, max_model_len: int) -> list[dict]:
        return [
            dict(
                id=name,
                object="model",
                created=int(time.time()),
                owned_by="pagedllm",
                root=req.lora_path,
                parent=parent,
                max_model_len=max_model_len,
            )  # fmt: skip
            for name, req in self.by_name.items()
        ]


def add_lora_routes(app: FastAPI, server) -> None:
    """POST /v1/load_lora_adapter {lora_name, lora_path}, /v1/unload_lora_adapter {lora_name}."""

    @app.post("/v1/load_lora_adapter")
    async def load(raw: Request):
        name, path = _fields(await _body(raw), ("lora_name", "lora_path"))
        loop = asyncio.get_running_loop()
        try:  # reading and checking the adapter: off the event loop
            await loop.run_in_executor(server.workers, server.adapters.add, name, path)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload(raw: Request):
        (name,) = _fields(await _body(raw), ("lora_name",))
        server.adapters.remove(name)
        return f"Success: LoRA adapter '{name}' removed successfully."


async def _body(raw: Request) -> dict:
    try:
        body = await raw.json()
    except ValueError:
        raise ApiError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _fields(body: dict, names: tuple[str, ...]) -> list[str]:
    """The body's string fields ``names``; a missing one, or any other field (vLLM's
    ``load_inplace`` among them: not implemented), is a 400 naming it."""
    other = sorted(set(body) - set(names))
    if other:
        raise ApiError(400, f"{other[0]} is not supported here (fields: {', '.join(names)})",
                       param=other[0])  # fmt: skip
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise ApiError(400, f"{name} must be a non-empty string", param=name)
        values.append(value)
    return values
