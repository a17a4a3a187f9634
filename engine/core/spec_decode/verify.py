"""Verification of a draft: greedy (exact, since greedy decoding is deterministic) and, for
sampled requests, rejection sampling (exact in distribution).

The target ran the sequence's last token and its k drafts in one forward; ``target[i]`` is the
argmax of the logits at query i (i = 0: after the last token, i = j: after draft j). Draft j is
kept while it equals ``target[j - 1]``; the first target argmax that disagrees, or the one after
the last kept draft, is the extra token. So a step yields between 1 and k + 1 tokens, every one
the token greedy decoding without speculation would have produced.
"""

from __future__ import annotations

import numpy as np


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """The tokens to append: the accepted drafts, then one target token. len(target) ==
    len(drafts) + 1."""
    assert len(target) == len(drafts) + 1, "one target argmax per query row"
    out = []
    for draft, want in zip(drafts, target, strict=False):
        if draft != want:
            break
        out.append(draft)
    out.append(target[len(out)])
    return out


class SpecStats:
    """Speculative decoding's counters (vLLM's names): drafts proposed, draft tokens, accepted
    tokens, and accepted tokens by draft position."""

    def __init__(self, config=None):
        k = config.num_speculative_tokens if config is not None else 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k  # [i]: drafts whose token i was accepted

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a speculated step yields per sequence: 1 + accepted drafts, on average."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def accept_sampled(probs, drafts: list[int], generator) -> list[int]:
    """Rejection sampling of an n-gram draft (its proposal q is one-hot), exact: the tokens
    have the distribution sequential sampling from ``probs`` gives.

    probs: (k+1, V) the target's distribution at each row (every sampling parameter applied,
    penalties counting the drafts before the row as output). Draft j is accepted when a uniform
    u < p_j(draft j) (= min(1, p/q); strict, so a token of probability 0 never is); on its
    rejection the token is drawn from normalize(max(p_j - q_j, 0)), p_j without the draft; when
    every draft is accepted one more is drawn from the last row. A row that is not a
    distribution (NaN) gives NO_TOKEN (-1) and ends the list."""
    out = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        if not np.isfinite(p).all():
            return [*out, -1]
        if generator.random() < p[draft]:
            out.append(int(draft))
            continue
        residual = p.copy()
        residual[draft] = 0.0
        return [*out, _draw(residual, generator)]
    p = probs[len(drafts)]
    return [*out, _draw(p, generator) if np.isfinite(p).all() else -1]


def _draw(p, generator) -> int:
    """Inverse CDF on an unnormalised non-negative row (the sampler's rule)."""
    cdf = np.cumsum(p, dtype=np.float64)
    u = generator.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(p) - 1))
