"""How to pick each next token, and when to stop: vLLM's ``SamplingParams`` names and ranges."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import is_int, is_number

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)


def _bad(name: str, value, expected: str) -> ValueError:
    return ValueError(f"SamplingParams: {name} must be {expected}, got {value!r}")


@dataclass
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
    stop: list[str] | str | None = None  # strings that end generation (not part of the output)
    stop_token_ids: list[int] | None = None  # token ids that end generation
    ignore_eos: bool = False  # keep generating past EOS
    seed: int | None = None  # per-request seed: same output whatever else is in the batch
    logprobs: int | None = None  # return the top-N log-probabilities per generated token

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_counts()
        self._check_floats()
        self._check_stops()

    def _check_counts(self):
        if not is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"an integer in [0, {self.max_tokens}]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "an integer >= 1, or 0 / -1 for off")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise _bad("logprobs", self.logprobs, "an integer >= 0 or None")
        if self.seed is not None and not is_int(self.seed):
            raise _bad("seed", self.seed, "an integer or None")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "True or False")

    def _check_floats(self):
        checks = (
            ("temperature", lambda v: v >= 0, ">= 0"),
            ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("repetition_penalty", lambda v: v > 0, "> 0"),
        )
        for name, ok, expected in checks:
            value = getattr(self, name)
            if not is_number(value) or value != value or not ok(value):  # value != value: NaN
                raise _bad(name, value, expected)
            setattr(self, name, float(value))

    def _check_stops(self):
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", s, "a non-empty string")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise _bad("stop_token_ids", t, "a non-negative integer")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 (or below vLLM's epsilon)."""
        return self.temperature < SAMPLING_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
