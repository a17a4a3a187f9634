"""The soak's request mix (scripts/soak_server.py, and its fast version in the suite): plain
and streamed completions and chats, prompts as token ids, requests refused for their length or
their parameters, big bodies to /tokenize, and streams the client leaves after two chunks."""

from __future__ import annotations

import collections
import random

import httpx


def one_request(i: int, rng: random.Random) -> tuple[str, str, dict, bool]:
    """(method, path, body, leave_early) of the i-th request."""
    kind = i % 8
    words = " ".join(rng.choice(["hi", "there", "fox", "summer", "day"]) for _ in range(20))
    if kind == 0:
        return "POST", "/v1/completions", {"model": "m", "prompt": words, "max_tokens": 16}, False
    if kind == 1:
        body = {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": 16}
        return "POST", "/v1/chat/completions", body | {"stream": True}, False
    if kind == 2:
        body = {"model": "m", "prompt": [rng.randrange(3, 300) for _ in range(30)]}
        return (
            "POST",
            "/v1/completions",
            body | {"max_tokens": 8, "n": 2, "temperature": 0.8},
            False,
        )
    if kind == 3:  # refused: longer than max_model_len
        return (
            "POST",
            "/v1/completions",
            {"model": "m", "prompt": words * 200, "max_tokens": 4},
            False,
        )
    if kind == 4:  # refused: a bad parameter
        return "POST", "/v1/completions", {"model": "m", "prompt": words, "top_p": 7}, False
    if kind == 5:  # a big body (near --max-tokenize-chars)
        return "POST", "/tokenize", {"model": "m", "prompt": "summer day " * 23_000}, False
    if kind == 6:  # a stream the client leaves
        body = {"model": "m", "prompt": words, "max_tokens": 64, "stream": True}
        return "POST", "/v1/completions", body, True
    body = {"model": "m", "prompt": words, "max_tokens": 8, "stop": ["fox", "day"], "logprobs": 2}
    return "POST", "/v1/completions", body, False


async def send(client: httpx.AsyncClient, req, codes: collections.Counter) -> None:
    method, path, body, leave = req
    try:
        if body.get("stream"):
            async with client.stream(method, path, json=body) as r:
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if leave and n >= 2:
                        break
                codes[r.status_code] += 1
        else:
            r = await client.request(method, path, json=body)
            codes[r.status_code] += 1
    except httpx.HTTPError as e:
        codes[type(e).__name__] += 1
