"""What one HTTP request may cost, checked before any work is done for it.

``ServerLimits`` holds every bound with its default and its help; ``add_limit_args`` makes one
flag per field (``max_request_bytes`` -> ``--max-request-bytes``) and ``limits_from_args`` reads
them back. The body's bounds (size, time to arrive) are enforced by the app's middleware, the
connection's by uvicorn (engine/entrypoints/uvicorn_config.py), the rest here:

- ``parse_json_body``: the body must hold a bounded number of JSON items (counted before it is
  parsed), be UTF-8 JSON whose strings are valid Unicode (no lone surrogate, which JSON's
  ``\\ud800`` escape can write and no tokenizer can read), and a bounded number of prompts,
  messages, content parts and tools (counted before they are validated);
- ``check_sampling_bounds``: ``n``, ``logprobs`` and the stop conditions, whose cost grows with
  their size for as long as the request runs.

A refusal is a ValueError whose message names the field, and the flag when a bound was passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field

from engine.sampling_params import MAX_LOGPROBS

KiB, MiB = 1 << 10, 1 << 20
# an object member ("key": value) takes about this many array elements' time to parse and
# validate (measured: 131,000 members 85-107 ms to parse, 131,000 ints 10-19 ms)
MEMBER_WEIGHT = 4
# only a \\uD800-\\uDFFF escape can put a surrogate into a string parsed from UTF-8 JSON
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def limit(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerLimits:
    # the body (the app's middleware)
    max_request_bytes: int = limit(
        16 * MiB, "bytes a request body may have; a larger one is 413, before it is read"
    )
    max_json_items: int = limit(
        131_072,
        "JSON items a body may have, counted before it is parsed as its commas, opening "
        f"brackets and {MEMBER_WEIGHT} x its colons (strings' too; an object member costs "
        "about that many array elements to parse): parsing holds the interpreter lock, and "
        "every other request waits",
    )
    request_body_timeout: float = limit(
        60.0, "seconds a request body may take to arrive once its head has; later it is 408"
    )
    # the connection (uvicorn)
    request_header_timeout: float = limit(
        10.0, "seconds a connection may take to send a whole request head; then it is closed"
    )
    timeout_keep_alive: float = limit(5.0, "seconds an idle keep-alive connection stays open")
    stream_write_timeout: float = limit(
        30.0,
        "seconds one chunk of a stream may wait for its client to read; a client that stops "
        "reading for longer has its requests aborted and its connection closed",
    )
    limit_concurrency: int = limit(
        1024, "open connections (or running requests) past which a new request is 503"
    )
    h11_max_incomplete_event_size: int = limit(
        16 * KiB, "bytes a request head may have; a larger one is 400"
    )
    # the sampling fields
    max_n: int = limit(128, "choices a request may ask for (n)")
    max_prompts: int = limit(2048, "prompts a /v1/completions batch may have")
    max_tokenize_chars: int = limit(
        256 * KiB,
        "characters /tokenize may be given (a prompt, or a rendered conversation); turning "
        "the ids into a list holds the interpreter lock, for up to 4 ids a character",
    )
    max_logprobs: int = limit(
        MAX_LOGPROBS, f"log-probabilities per token (logprobs, top_logprobs), {MAX_LOGPROBS} max"
    )
    max_stop_strings: int = limit(64, "stop strings a request may give")
    max_stop_chars: int = limit(4096, "characters all of a request's stop strings may have")
    max_stop_token_ids: int = limit(1024, "stop_token_ids a request may give")
    # the chat fields, checked before they are validated (several microseconds each)
    max_messages: int = limit(
        1024, "messages a chat request may have, and content parts in all of them together"
    )
    max_tools: int = limit(128, "tools a chat request may offer")
    # /v1/responses
    responses_store: int = limit(
        1000,
        "responses /v1/responses keeps in memory (store: true) for previous_response_id and GET, "
        "the oldest dropped first",
    )
    responses_ttl: float = limit(3600.0, "seconds a stored response is kept")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = _TYPES[f.name]
            good = isinstance(value, int if kind is int else int | float)
            if isinstance(value, bool) or not good or not math.isfinite(value) or value <= 0:
                what = "integer" if kind is int else "number"
                raise ValueError(f"ServerLimits: {f.name} must be a positive {what}, got {value!r}")
        if self.max_logprobs > MAX_LOGPROBS:
            got = self.max_logprobs
            raise ValueError(f"ServerLimits: max_logprobs must be <= {MAX_LOGPROBS}, got {got}")


_TYPES = typing.get_type_hints(ServerLimits)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_limit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per ServerLimits field, with its default in the help."""
    group = parser.add_argument_group("limits", "what one request may cost (ServerLimits)")
    for f in dataclasses.fields(ServerLimits):
        help_ = f"{f.metadata['help']} (default: {f.default})"
        group.add_argument(flag_name(f.name), type=_TYPES[f.name], dest=f.name, help=help_)
    return parser


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The checked limits of the parsed flags; a bad value is a ValueError naming the flag."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServerLimits)}
    try:
        return ServerLimits(**{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        name = re.match(r"ServerLimits: (\w+)", str(e)).group(1)
        raise ValueError(f"{flag_name(name)}: {str(e).removeprefix('ServerLimits: ')}") from None


# ---- the body ----


def parse_json_body(body: bytes, limits: ServerLimits):
    """The JSON value of a request body; a ValueError for one of more than max_json_items
    items, or that is not UTF-8 (JSON's own encoding: a UTF-16 body is refused, not guessed),
    not JSON, or holds a lone surrogate, or more prompts, messages, content parts or tools
    than the limits allow."""
    items = body.count(b",") + body.count(b"[") + body.count(b"{")  # >= items; fast, in C
    items += MEMBER_WEIGHT * body.count(b":")
    if items > limits.max_json_items:
        raise ValueError(
            f"body has up to {items} JSON items (commas, opening brackets and "
            f"{MEMBER_WEIGHT} x colons), more than {limits.max_json_items} (--max-json-items)"
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"body is not UTF-8: byte {body[e.start]:#04x} at offset {e.start}"
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer of too many digits, deep nesting
        raise ValueError(f"malformed JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(text):
        _check_strings(value)
    if isinstance(value, dict):
        _check_sizes(value, limits)
    return value


def _check_sizes(body: dict, limits: ServerLimits) -> None:
    """A batch's prompts, messages, their content parts and tools against the limits, before
    pydantic validates each (one long call that holds the interpreter lock)."""
    prompt, messages, tools = body.get("prompt"), body.get("messages"), body.get("tools")
    batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str)
    if batch and len(prompt) > limits.max_prompts:
        raise ValueError(
            f"prompt: a batch of {len(prompt)}, more than {limits.max_prompts} (--max-prompts)"
        )
    if isinstance(messages, list):
        contents = (m.get("content") for m in messages if isinstance(m, dict))
        parts = sum(len(c) for c in contents if isinstance(c, list))
        for what, n in (("messages", len(messages)), ("content parts", parts)):
            if n > limits.max_messages:
                raise ValueError(f"{what}: {n}, more than {limits.max_messages} (--max-messages)")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise ValueError(f"tools: {len(tools)}, more than {limits.max_tools} (--max-tools)")


def _check_strings(value) -> None:
    """ValueError naming the first string (or key) with a lone surrogate: ``messages.0.content``."""
    stack = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            _check_text(v, path)
        elif isinstance(v, dict):
            for k, item in v.items():
                _check_text(k, path)
                stack.append(((*path, k), item))
        elif isinstance(v, list):
            stack.extend(((*path, i), item) for i, item in enumerate(v))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = ".".join(map(str, path)) or "body"
        raise ValueError(
            f"{where}: not valid Unicode (a lone surrogate at character {e.start})"
        ) from None


# ---- the sampling fields ----


def check_sampling_bounds(req, limits: ServerLimits, logprobs: tuple[str, int | None]) -> None:
    """n, the stop strings and stop token ids, (field name, value) of the log-probabilities
    asked for and prompt_logprobs, against the limits."""
    if req.n > limits.max_n:
        raise ValueError(f"n must be at most {limits.max_n} (--max-n), got {req.n}")
    for name, top in (logprobs, ("prompt_logprobs", getattr(req, "prompt_logprobs", None))):
        if top is not None and top > limits.max_logprobs:
            raise ValueError(
                f"{name} must be at most {limits.max_logprobs} (--max-logprobs), got {top}"
            )
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > limits.max_stop_strings:
        raise ValueError(
            f"stop has {len(stops)} strings, more than {limits.max_stop_strings} "
            "(--max-stop-strings)"
        )
    chars = sum(map(len, stops))
    if chars > limits.max_stop_chars:
        raise ValueError(
            f"stop has {chars} characters, more than {limits.max_stop_chars} (--max-stop-chars)"
        )
    ids = req.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise ValueError(
            f"stop_token_ids has {len(ids)} ids, more than {limits.max_stop_token_ids} "
            "(--max-stop-token-ids)"
        )
