"""``speculative_config``: a dict (or its JSON text) with vLLM's keys, checked at startup.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5, "disable_by_batch_size": 16}
    {"method": "draft_model", "model": "path/or/name", "num_speculative_tokens": 4}

``ngram`` and ``draft_model`` are implemented (a ``model`` with no ``method`` is a draft model,
as in vLLM); every other method is refused by name, as is any key the method does not read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: draft tokens per sequence per step, at most
    prompt_lookup_min: int = 2  # shortest n-gram matched
    prompt_lookup_max: int = 4  # longest n-gram matched (tried first)
    disable_by_batch_size: int | None = None  # no drafts in a step with more running sequences
    model: str | None = None  # draft_model: the draft's checkpoint (a path or a known name)

    def __post_init__(self):
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config: method 'draft_model' needs a 'model' (a path)")
        k, lo, hi = self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max
        _int("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        _int("prompt_lookup_min", lo, 1, None)
        _int("prompt_lookup_max", hi, lo, None, f"an integer >= prompt_lookup_min ({lo})")
        if self.disable_by_batch_size is not None:
            _int("disable_by_batch_size", self.disable_by_batch_size, 1, None)


def _int(name, value, low, high, expected=None) -> None:
    bad = not isinstance(value, int) or isinstance(value, bool) or value < low
    if bad or (high is not None and value > high):
        want = expected or (f"an integer in [{low}, {high}]" if high else f"an integer >= {low}")
        raise ValueError(f"speculative_config: {name} must be {want}, got {value!r}")


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict or its JSON text -> SpeculativeConfig (or None)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    d = dict(value)
    method = d.pop("method", "draft_model" if "model" in d else None)
    if method in NOT_YET:
        raise ValueError(
            f"speculative_config: method {method!r} is not implemented (only {', '.join(METHODS)})"
        )
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {METHODS}, got {method!r}")
    known = {"num_speculative_tokens", "disable_by_batch_size"}
    known |= {"model"} if method == "draft_model" else {"prompt_lookup_min", "prompt_lookup_max"}
    extra = sorted(set(d) - known)
    if extra:
        raise ValueError(f"speculative_config: key {extra[0]!r} is not read (method {method!r})")
    # one bound given: the other is the same (vLLM's rule)
    if "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
        d["prompt_lookup_min"] = d["prompt_lookup_max"]
    if "prompt_lookup_min" in d and "prompt_lookup_max" not in d:
        d["prompt_lookup_max"] = d["prompt_lookup_min"]
    return SpeculativeConfig(method=method, **d)
