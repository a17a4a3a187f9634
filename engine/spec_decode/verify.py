"""Greedy verification of a draft: exact, since greedy decoding is deterministic.

The target ran the sequence's last token and its k drafts in one forward; ``target[i]`` is the
argmax of the logits at query i (i = 0: after the last token, i = j: after draft j). Draft j is
kept while it equals ``target[j - 1]``; the first target argmax that disagrees, or the one after
the last kept draft, is the extra token. So a step yields between 1 and k + 1 tokens, every one
the token greedy decoding without speculation would have produced.
"""

from __future__ import annotations


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
