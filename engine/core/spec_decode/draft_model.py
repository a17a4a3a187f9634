"""A draft model: a smaller model with the target's vocabulary guesses k tokens per sequence by
k greedy steps over its own paged KV cache.

The draft has its own block pool (sized by the memory plan next to the target's) and, for each
running sequence, its own page table and the number of the sequence's tokens whose K/V it holds
(``valid``). A proposal

1. catches the draft up: one forward over the tokens it has not seen (the whole prompt the first
   time, afterwards what the last step appended beyond the drafts it already wrote), whose last
   row gives draft 1;
2. runs k - 1 single-token steps, each feeding the draft before and giving the next.

Drafts 1..k-1 leave their K/V in the draft's pool. The next proposal compares them with the
tokens the sequence really took: the accepted ones are kept, and the catch-up overwrites the
rest. Its drafts are greedy (a one-hot proposal), so verification is the same as for n-gram
drafts and exact for sampled requests too.

A sequence gets no draft when the pool has no room for it (its tokens are not shared between
sequences as the target's prefix-cached blocks are) or when its catch-up is cut by the step's
token budget (it continues next step). Sequences that leave the running set give their blocks
back at the next proposal.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine.backends.forward_batch import ForwardBatch, flat_batch
from engine.utils import cdiv


@dataclass
class _DraftSeq:
    """What the draft's pool holds of one sequence."""

    table: list[int] = field(default_factory=list)  # its draft blocks
    valid: int = 0  # tokens whose K/V are in the draft's pool and known right
    written: list[int] = field(default_factory=list)  # drafts fed at positions valid, valid+1..


class DraftModel:
    """Greedy proposals from ``backend`` (the draft model's), over ``num_blocks`` blocks of
    ``block_size`` tokens; catch-up forwards take at most ``max_tokens`` tokens."""

    def __init__(self, backend, num_blocks: int, block_size: int, max_tokens: int):
        self.backend = backend
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.seqs: dict[int, _DraftSeq] = {}  # seq_id -> its state

    def release_except(self, seq_ids) -> None:
        """Give back the blocks of every sequence not in ``seq_ids`` (finished, preempted)."""
        keep = set(seq_ids)
        for sid in [s for s in self.seqs if s not in keep]:
            self.free.extend(self.seqs.pop(sid).table)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def propose(self, seqs, rooms: list[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` greedy draft tokens for each of ``seqs`` (each has its last token
        not yet computed by the target), [] where there is none."""
        drafts: list[list[int]] = [[] for _ in seqs]
        ready = self._catch_up(seqs, rooms, drafts)  # indices whose draft 1 is in drafts
        for j in range(1, max((rooms[i] for i in ready), default=0)):
            ready = [i for i in ready if rooms[i] > j]
            if not ready:
                break
            ids = self._decode([seqs[i] for i in ready], [drafts[i][-1] for i in ready], j)
            for i, t in zip(ready, ids.tolist(), strict=True):
                drafts[i].append(t)
            ready = [i for i in ready if drafts[i][-1] >= 0]
        for i, seq in enumerate(seqs):
            d = drafts[i]
            if d and d[-1] < 0:  # a row with nothing to pick: the draft ends before it
                del d[-1]
            if seq.seq_id in self.seqs:
                self.seqs[seq.seq_id].written = d[: rooms[i] - 1]
        return drafts

    def _catch_up(self, seqs, rooms, drafts) -> list[int]:
        """One forward over each sequence's unseen tokens (within the token budget and the
        pool); draft 1 of the sequences that got to their last token. Returns their indices."""
        rows, budget = [], self.max_tokens
        for i, seq in enumerate(seqs):
            st = self.seqs.setdefault(seq.seq_id, _DraftSeq())
            st.valid = self._still_valid(st, seq.token_ids)
            n = min(seq.num_tokens - st.valid, budget)
            if n < 1 or not self._reserve(st, st.valid + n + rooms[i] - 1):
                continue
            rows.append((i, st, n))
            budget -= n
        if not rows:
            return []
        rows.sort(key=lambda r: r[2] != 1)  # single-token rows first: the batch's decodes
        batch = self._batch([(seqs[i], st.valid, n) for i, st, n in rows])
        ids = self.backend.forward_greedy(batch).tolist()  # (B,)
        ready = []
        for (i, st, n), t in zip(rows, ids, strict=True):
            st.valid += n
            st.written = []
            if st.valid == seqs[i].num_tokens and t >= 0:
                drafts[i].append(t)
                ready.append(i)
        return sorted(ready)

    @staticmethod
    def _still_valid(st: _DraftSeq, token_ids: list[int]) -> int:
        """Tokens of the sequence whose draft K/V are right: the ones known, then the written
        drafts that the sequence really took; at least its last token is left to feed."""
        valid = min(st.valid, len(token_ids) - 1)
        for t in st.written:
            if valid >= len(token_ids) - 1 or token_ids[valid] != t:
                break
            valid += 1
        return valid

    def _reserve(self, st: _DraftSeq, num_slots: int) -> bool:
        """Blocks for the sequence's first ``num_slots`` positions, if the pool has them."""
        need = cdiv(max(num_slots, 1), self.block_size) - len(st.table)
        if need > len(self.free):
            return False
        st.table.extend(self.free.popleft() for _ in range(max(need, 0)))
        return True

    def _decode(self, seqs, tokens: list[int], j: int) -> np.ndarray:
        """(B,) the draft's next token after feeding ``tokens`` (draft j of each sequence)."""
        return self.backend.forward_greedy(
            self._batch([(s, s.num_tokens + j - 1, 1) for s in seqs], tokens)
        )

    def _batch(self, rows, tokens: list[int] | None = None) -> ForwardBatch:
        """A forward over (seq, start, n) rows: the sequence's tokens [start, start + n), or
        with ``tokens`` one given token per row at position start. Single-token rows first."""
        if tokens is None:
            tokens = [t for s, a, n in rows for t in s.token_ids[a : a + n]]
        q_lens = np.array([n for _, _, n in rows], dtype=np.int32)  # (B,)
        starts = np.array([a for _, a, _ in rows], dtype=np.int32)  # (B,)
        context_lens = starts + q_lens  # (B,)
        tables = self._tables([s for s, _, _ in rows], context_lens)  # (B, width)
        nd = int(np.sum(q_lens == 1))  # they come first
        return flat_batch(tokens, q_lens, context_lens, tables, self.block_size, nd)

    def _tables(self, seqs, context_lens: np.ndarray) -> np.ndarray:
        """(B, width) each sequence's draft blocks, -1 padded, as wide as the longest needs."""
        width = int(cdiv(context_lens.max(), self.block_size))
        tables = np.full((len(seqs), width), -1, dtype=np.int32)  # (B, width)
        for b, s in enumerate(seqs):
            t = self.seqs[s.seq_id].table[:width]
            tables[b, : len(t)] = t
        return tables

    def check_invariants(self) -> None:
        """Every block is free or in exactly one sequence's table."""
        held = [b for st in self.seqs.values() for b in st.table]
        assert len(held) == len(set(held)), "a draft block in two tables"
        assert sorted(held + list(self.free)) == list(range(self.num_blocks)), "draft blocks lost"
