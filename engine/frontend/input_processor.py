"""Requests in: a prompt (text or token ids) -> checked token ids, before anything is queued.

Bad input is a one-line ValueError for that request only; the engine keeps running the others.
Text longer than ``max_prompt_chars`` is refused before it is tokenized (tokenizing megabytes
takes seconds), and token ids must be a flat sequence of integers inside the vocabulary. An
arrival time must be on ``time.monotonic()``'s clock; bad words become the token ids the sampler
bans; the token ids of ``logit_bias`` and ``allowed_token_ids`` must be in the vocabulary. The
model's generation_config.json gives the default sampling parameters.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from engine.sampling_params import generation_defaults, is_integer, is_real
from model_loader.load import read_generation_config

log = logging.getLogger("engine")


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """Characters a prompt of max_model_len tokens can have at most: one token covers at most as
    many characters as its vocabulary entry has (byte-level BPE spells each byte as one
    character; SentencePiece spells a space as one, and falls back to bytes). A tokenizer whose
    normaliser shrinks text could beat this; none of the supported ones does."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)  # {token string: id}
    return max_model_len * max(map(len, vocab), default=1)


def tokenize_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int, max_chars: int):
    """(prompt text or None, token ids), checked against the vocabulary and max_model_len;
    max_chars: the text length beyond which no tokenizing can fit (``max_prompt_chars``)."""
    if isinstance(prompt, str):
        text, ids = prompt, _encode(prompt, tokenizer, max_model_len, max_chars)
    elif isinstance(prompt, list | tuple | np.ndarray):
        text, ids = None, _token_ids(prompt, vocab_size, max_model_len)
    else:
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={max_model_len}")
    if len(ids) == max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens: max_model_len={max_model_len} leaves no room for "
            "an output token"
        )
    return text, ids


def _encode(text: str, tokenizer, max_model_len: int, max_chars: int) -> list[int]:
    if not text:
        raise ValueError("prompt is empty")
    if len(text) > max_chars:
        raise ValueError(
            f"prompt has {len(text)} characters, more than max_model_len={max_model_len} "
            f"tokens can hold ({max_chars})"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        why = f"a lone surrogate at character {e.start}"
        raise ValueError(f"prompt is not valid Unicode: {why}") from None
    return tokenizer.encode(text)


def _token_ids(prompt, vocab_size: int, max_model_len: int) -> list[int]:
    """A 1-D list, tuple or array of Python or NumPy integers in [0, vocab_size) -> plain ints."""
    if len(prompt) > max_model_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens, more than max_model_len={max_model_len}"
        )
    if isinstance(prompt, np.ndarray) and (prompt.ndim != 1 or prompt.dtype.kind not in "iu"):
        raise ValueError(
            f"prompt token ids must be a 1-D integer array, got {prompt.ndim}-D {prompt.dtype}"
        )
    for t in prompt:
        if not is_integer(t):
            raise ValueError(f"prompt token ids must be integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t} is outside [0, {vocab_size})")
    return [int(t) for t in prompt]


# arrival_time is on time.monotonic()'s clock; a value further ahead than this is another clock
# (time.time() is ~1.7e9 s, far beyond any monotonic reading)
ARRIVAL_SLACK_S = 60.0


def check_arrival_time(arrival_time) -> float:
    """arrival_time (None: now) as a float on time.monotonic()'s clock, else a ValueError."""
    now = time.monotonic()
    if arrival_time is None:
        return now
    if not is_real(arrival_time) or not np.isfinite(arrival_time):
        raise ValueError(f"arrival_time must be a finite number of seconds, got {arrival_time!r}")
    if arrival_time > now + ARRIVAL_SLACK_S:
        raise ValueError(
            f"arrival_time must be on time.monotonic()'s clock (now {now:.1f} s, at most "
            f"{ARRIVAL_SLACK_S:g} s ahead), got {arrival_time!r}"
        )
    return float(arrival_time)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word as tokenized alone and with a leading space (as it reads after
    another word); both spellings are banned."""
    out = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def check_token_ids(params, vocab_size: int) -> None:
    """Token ids in logit_bias and allowed_token_ids must be in the vocabulary."""
    for name, ids in (
        ("logit_bias", params.logit_bias),
        ("allowed_token_ids", params.allowed_token_ids),
    ):
        bad = [t for t in ids or () if t >= vocab_size]
        if bad:
            raise ValueError(
                f"SamplingParams: {name} has token id {bad[0]}, not below the vocab size "
                f"{vocab_size}"
            )


def model_sampling_defaults(config, loaded) -> dict:
    """The default SamplingParams fields of requests: the model's generation_config.json
    (generation_config 'auto'; a directory's with a path; none with 'vllm' or 'ignore'), then
    override_generation_config laid over it (engine/config/generation.py)."""
    source = config.generation_config
    if source == "auto":
        gen, where = loaded.generation_config, "the model's generation_config.json"
    elif source in ("vllm", "ignore"):
        gen, where = {}, ""
    else:
        gen, where = read_generation_config(Path(source)), f"{source}/generation_config.json"
    overrides = config.generation_overrides
    try:
        generation_defaults(overrides)
    except ValueError as e:
        raise ValueError(f"override_generation_config: {e}") from None
    merged = {**gen, **overrides}
    if "temperature" in overrides and "do_sample" not in overrides:
        merged.pop("do_sample", None)  # the file's greedy yields to an asked temperature
    try:
        defaults = generation_defaults(merged)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if defaults:
        froms = [where] * bool(gen) + ["--override-generation-config"] * bool(overrides)
        log.info(
            "default sampling parameters (from %s): %s (a request's own fields win)",
            " and ".join(froms),
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults


class FrontendState:
    """What the request checks read of an engine, set from its config and loaded model: the
    resolved config, the tokenizer, the prompt bound, the model's sampling defaults.
    ``LLMEngine`` has it, and so has an ingress in front of replicas that holds no engine."""

    def init_frontend(self, config, loaded) -> None:
        self.loaded = loaded
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        self.config = config.resolve(loaded.config)
        self.sampling_defaults = model_sampling_defaults(self.config, loaded)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.config.max_model_len)
