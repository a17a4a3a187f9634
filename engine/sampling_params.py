"""How to pick each next token, and when to stop: vLLM's ``SamplingParams`` names and ranges.

Frozen: every field is checked once, at construction, and cannot change afterwards (a request
keeps the params it was checked with). Integer fields take Python or NumPy integers (not bool),
float fields Python or NumPy reals; both are stored as plain Python ``int`` / ``float``. The
ranges keep the sampler's float32 arithmetic finite: no temperature that overflows, no top_p that
rounds to 0, no repetition penalty that divides a logit into infinity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.pooling_params import PoolingParams
from engine.structured_params import StructuredOutputsParams

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform to float32 precision anyway
MIN_TOP_P = 1e-6  # well above float32's smallest normal, so top_p never rounds to 0
PENALTY_RANGE = (0.01, 100.0)  # repetition_penalty: a logit divided by it stays finite
MAX_LOGPROBS = 20  # top-N log-probabilities per token at most (vLLM's max_logprobs default)
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as in OpenAI's API (-100 bans, +100 all but forces)


def _bad(name: str, value, expected: str) -> ValueError:
    return ValueError(f"SamplingParams: {name} must be {expected}, got {value!r}")


def is_integer(value) -> bool:
    """A Python or NumPy integer; bool (Python or NumPy) is not one."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A Python or NumPy int or float; bool is not one."""
    return is_integer(value) or isinstance(value, float | np.floating)


def as_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """value as a plain int in [low, high] (None: unbounded), else a ValueError naming name."""
    if not is_integer(value) or (low is not None and value < low):
        raise _bad(name, value, _int_range(low, high))
    if high is not None and value > high:
        raise _bad(name, value, _int_range(low, high))
    return int(value)


def _int_range(low, high) -> str:
    if high is None:
        return "an integer" if low is None else f"an integer >= {low}"
    return f"an integer in [{low}, {high}]"


def int_list(name: str, values) -> list[int]:
    """A list, tuple or 1-D array of non-negative integers -> list of plain ints."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise _bad(name, values, "a list of non-negative integers")
        values = list(values)
    if not isinstance(values, list | tuple):
        raise _bad(name, values, "a list of non-negative integers")
    return [as_int(name, v, 0) for v in values]


def _logit_bias(value) -> dict[int, float]:
    """{token id: bias in [-100, 100]}; keys may be integer strings (JSON object keys)."""
    if not isinstance(value, dict):
        raise _bad("logit_bias", value, "a dict of token id -> bias")
    out = {}
    for key, bias in value.items():
        tid = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not is_integer(tid) or tid < 0:
            raise _bad("logit_bias", key, "keyed by non-negative token ids")
        ok = is_real(bias) and math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS
        if not ok:
            raise _bad("logit_bias", bias, f"a bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        out[int(tid)] = float(bias)
    return out


def _words(name: str, value) -> list[str]:
    if not isinstance(value, list | tuple) or not all(isinstance(w, str) and w for w in value):
        raise _bad(name, value, "a list of non-empty strings")
    return list(value)


def _stop_list(value) -> list[str]:
    """None, a string or a list of strings -> list of non-empty strings."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", value, "a non-empty string or a list of non-empty strings")
    return list(stops)


# name -> (low, high, how the range reads); both ends included
FLOAT_RANGES = {
    "temperature": (0.0, MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
    "top_p": (MIN_TOP_P, 1.0, f"in [{MIN_TOP_P:g}, 1]"),
    "min_p": (0.0, 1.0, "in [0, 1]"),
    "presence_penalty": (-2.0, 2.0, "in [-2, 2]"),
    "frequency_penalty": (-2.0, 2.0, "in [-2, 2]"),
    "repetition_penalty": (*PENALTY_RANGE, "in [{:g}, {:g}]".format(*PENALTY_RANGE)),
}


def as_float(name: str, value) -> float:
    """value as a plain float in FLOAT_RANGES[name], else a ValueError naming name."""
    low, high, expected = FLOAT_RANGES[name]
    if not is_real(value) or not math.isfinite(value) or not low <= value <= high:
        raise _bad(name, value, f"a finite number {expected}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much mass
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely)
    presence_penalty: float = 0.0  # subtract once per token already generated
    frequency_penalty: float = 0.0  # subtract per occurrence in the generated text
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    max_tokens: int = 16  # tokens to generate at most
    min_tokens: int = 0  # tokens before EOS / stop_token_ids may end the sequence
    stop: list[str] | str | None = None  # strings that end generation (cut from the output)
    stop_token_ids: list[int] | None = None  # token ids that end generation
    ignore_eos: bool = False  # keep generating past EOS
    seed: int | None = None  # per-request seed: same output whatever else is in the batch
    logprobs: int | None = None  # return the top-N log-probabilities per generated token
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text in it
    skip_special_tokens: bool = True  # leave special tokens out of the detokenized text
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    bad_words: list[str] | None = None  # words never generated (their last token is banned
    #   where the output so far ends with the rest of the word)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match
    prompt_logprobs: int | None = None  # top-N log-probabilities of each prompt token (its own
    #   always included; the first token has none); such a prompt skips the prefix cache
    pooling: PoolingParams | None = None  # a pooling engine's request: the prompt's vector,
    #   no tokens (engine/pooling_params.py)

    def __post_init__(self):
        for name, value in self._checked().items():
            object.__setattr__(self, name, value)  # frozen: only here

    def _checked(self) -> dict:
        """Every field checked and normalised (plain Python types, stop lists as lists)."""
        out = {name: as_float(name, getattr(self, name)) for name in FLOAT_RANGES}
        out["n"] = as_int("n", self.n, 1)
        out["max_tokens"] = as_int("max_tokens", self.max_tokens, 1)
        out["min_tokens"] = as_int("min_tokens", self.min_tokens, 0, out["max_tokens"])
        out["top_k"] = as_int("top_k", self.top_k, -1)
        if self.logprobs is not None:
            out["logprobs"] = as_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = as_int(
                "prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS
            )
        if self.seed is not None:
            out["seed"] = as_int("seed", self.seed)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False")
        out["stop"] = [] if self.stop is None else _stop_list(self.stop)
        ids = self.stop_token_ids
        out["stop_token_ids"] = [] if ids is None else int_list("stop_token_ids", ids)
        if self.logit_bias is not None:
            out["logit_bias"] = _logit_bias(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            out["allowed_token_ids"] = int_list("allowed_token_ids", self.allowed_token_ids)
            if not out["allowed_token_ids"]:
                raise _bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list")
        if self.bad_words is not None:
            out["bad_words"] = _words("bad_words", self.bad_words) or None
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise _bad("structured_outputs", so, "a StructuredOutputsParams")
        if self.pooling is not None and not isinstance(self.pooling, PoolingParams):
            raise _bad("pooling", self.pooling, "a PoolingParams")
        return out

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 (or below vLLM's epsilon)."""
        return self.temperature < SAMPLING_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def restricts_tokens(self) -> bool:
        """Whether the sampler changes which tokens can come or how likely they are beyond
        penalties: a logit bias, allowed ids, bad words, a grammar."""
        return bool(
            self.logit_bias or self.allowed_token_ids or self.bad_words or self.structured_outputs
        )


def generation_defaults(gen: dict) -> dict:
    """SamplingParams keyword defaults from a model's generation_config.json sampling keys
    (``model_loader.load.read_generation_config``): ``do_sample: false`` means greedy, as in
    transformers; ``max_new_tokens`` is ``max_tokens``."""
    if gen.get("do_sample") is False:
        out = {"temperature": 0.0}
    else:
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        out = {k: gen[k] for k in keys if k in gen}
    if "max_new_tokens" in gen:
        out["max_tokens"] = gen["max_new_tokens"]
    if out:
        SamplingParams(**out)  # a value out of range is the checkpoint's error: say so now
    return out
