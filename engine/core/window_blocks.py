"""Block arithmetic of a sliding window that every layer has (BlockManager's ``window``).

A query at position p sees keys p - window + 1 .. p; with ``bs``-token blocks, block i holds
positions i*bs .. i*bs + bs - 1. ``NO_BLOCK`` marks a page-table entry whose block no query
from then on sees (given back, or never taken): the backends pad their tables with it too, and
no attention kernel reads it.
"""

from __future__ import annotations

from engine.utils import cdiv

NO_BLOCK = -1


def first_visible_block(pos: int, window: int, bs: int) -> int:
    """The first block a query at ``pos`` (or later) can see: 0 without a window."""
    return max(0, pos - window + 1) // bs if window else 0


def peak_blocks(num_tokens: int, step_tokens: int, window: int, bs: int) -> int:
    """The most blocks a sequence of num_tokens tokens holds at once when a step computes at
    most step_tokens of them: all of them, or with a window those of the window before a step
    (block-aligned: one more) and the step's."""
    full = cdiv(num_tokens, bs)
    return min(full, cdiv(window - 1 + step_tokens, bs) + 1) if window else full


def window_prefix(blocks: list[int | None], window: int, bs: int) -> list[int]:
    """The longest prefix of a prompt's blocks (cached block ids, None where not cached) whose
    blocks the first token after it can see are all cached, as block ids with NO_BLOCK for the
    blocks before that window (they need not be cached: nothing reads them)."""
    best, run = 0, 0  # the longest valid prefix; where the current run of cached blocks began
    for i, block in enumerate(blocks):
        if block is None:
            run = i + 1
        elif run <= first_visible_block((i + 1) * bs, window, bs):
            best = i + 1
    first = first_visible_block(best * bs, window, bs)
    return [NO_BLOCK] * first + blocks[first:best]


def hidden_loads(num_hits: int, num_loads: int, window: int, bs: int) -> int:
    """Of the KV tiers' ``num_loads`` blocks after ``num_hits`` prefix blocks, how many lead
    before the window of the first token after them: not loaded (NO_BLOCK entries), and the
    hit blocks before them not taken either."""
    first = first_visible_block((num_hits + num_loads) * bs, window, bs)
    return max(0, first - num_hits) if num_loads else 0


def prefix_ok(blocks: list[int | None], window: int, bs: int) -> list[bool]:
    """For each prefix length k = 0 .. len(blocks): whether every block the first token after
    the first k blocks sees is cached (not None); without a window, every block before it."""
    ok, missing = [True], -1  # missing: the last uncached block so far
    for i, block in enumerate(blocks):
        if block is None:
            missing = i
        ok.append(missing < first_visible_block((i + 1) * bs, window, bs))
    return ok
