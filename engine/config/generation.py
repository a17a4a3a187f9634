"""Where a request's default sampling parameters come from (vLLM's flags of the same names).

    generation_config           auto: the model's generation_config.json; vllm (or ignore):
                                SamplingParams' own defaults; a directory: the
                                generation_config.json in it
    override_generation_config  a JSON object of generation-config keys (temperature, top_p,
                                top_k, min_p, repetition_penalty, max_new_tokens, do_sample)
                                laid over those defaults: '{"temperature": 0.2}'

Each request's own fields win over both. ``model_sampling_defaults`` in the frontend reads the
file; this module checks the flags' values at startup.
"""

from __future__ import annotations

import json
from pathlib import Path

from model_loader.load import GENERATION_KEYS

NAMED = ("auto", "vllm", "ignore")


def check_generation_config(value: str) -> str:
    """``value`` if it is one of NAMED or a directory; a ValueError naming it otherwise."""
    if value in NAMED or Path(value).is_dir():
        return value
    raise ValueError(
        f"EngineConfig: generation_config must be auto, vllm, ignore or a directory holding "
        f"generation_config.json, got {value!r}"
    )


def parse_override(value: str | dict | None) -> dict:
    """The override's generation-config keys as a dict ({} for None); a ValueError naming an
    unknown key or a value that is not a JSON object."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"EngineConfig: override_generation_config: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"EngineConfig: override_generation_config must be a JSON object, got {value!r}"
        )
    unknown = [k for k in value if k not in GENERATION_KEYS]
    if unknown:
        raise ValueError(
            f"EngineConfig: override_generation_config: unknown key {unknown[0]!r} (known: "
            f"{', '.join(GENERATION_KEYS)})"
        )
    return dict(value)
