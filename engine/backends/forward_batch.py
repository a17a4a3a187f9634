"""The contract between the engine and its backends: one step's flattened batch.

KV-cache layout (every backend, every kernel):
    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache[l, 0] is layer l's K cache, kv_cache[l, 1] its V cache, each
    (num_blocks, block_size, num_kv_heads, head_dim), contiguous.
    A token's slot is ``block_id * block_size + offset``; its K row lives at
    k_cache[slot // block_size, slot % block_size]  -> (num_kv_heads, head_dim).

Batch layout: B sequences, T tokens in all, no padding. The first ``num_decodes`` sequences are
decodes (exactly one query token each); the rest are prefills (one or more query tokens, which may
start part-way through the sequence when some of its tokens are already cached).

KV groups (a model whose layers attend differently, engine/backends/kv_groups.py): the cache is
(G, 2, num_blocks, ...) and each group has its own page tables and slots; ``block_tables`` and
``slot_mapping`` are group 0's, ``group_tables`` and ``group_slots`` the others', and
``for_layer`` gives a layer its slot and the batch as its group's tables see it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass
class ForwardBatch:
    token_ids: np.ndarray  # (T,) int32: the new tokens of every sequence, sequence after sequence
    positions: np.ndarray  # (T,) int32: each token's position in its sequence
    slot_mapping: np.ndarray  # (T,) int32: cache slot each token's K/V is written to; <0 = skip
    block_tables: np.ndarray  # (B, max_blocks) int32: each sequence's page table, padded with -1
    context_lens: np.ndarray  # (B,) int32: tokens in the cache once this step's are written
    query_start_loc: np.ndarray  # (B+1,) int32: sequence b's tokens are [qsl[b], qsl[b+1])
    num_decodes: int  # sequences 0..num_decodes-1 are single-token decodes
    # async scheduling: (T,) int32 row of the previous step's greedy ids that holds each token
    # (its token_ids entry is a placeholder); -1: token_ids holds the token. None: no such rows
    prev_rows: np.ndarray | None = None
    # speculative decoding: (R,) int32 rows whose logits are needed, ascending (every row of a
    # speculated run, the last row of the others); None: logits_indices
    sample_rows: np.ndarray | None = None
    # LoRA: (T,) int32 the adapter slot of each token's sequence, -1 for the base model; None:
    # every row is the base model's
    lora_slots: np.ndarray | None = None
    # KV groups: layer -> (group, slot) (a KVGroups); None: one group, layer l in slot l
    kv_groups: object = None
    group_tables: tuple = ()  # per group after the first: (B, max_blocks) int32 page tables
    group_slots: tuple = ()  # per group after the first: (T,) int32 cache slots
    _views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def for_layer(self, layer: int) -> tuple[int, ForwardBatch]:
        """(the KV slot layer ``layer`` reads and writes, the batch with its group's page
        tables and slots): (layer, self) without groups."""
        groups = self.kv_groups
        if groups is None:
            return layer, self
        g = groups.layer_group[layer]
        view = self if g == 0 else self._views.get(g)
        if view is None:
            view = self._views[g] = replace(
                self,
                block_tables=self.group_tables[g - 1],
                slot_mapping=self.group_slots[g - 1],
                kv_groups=None,
                group_tables=(),
                group_slots=(),
            )
        return groups.layer_slot[layer], view

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def logits_indices(self) -> np.ndarray:
        """(B,) the row of each sequence's last token: the only row whose logits are sampled."""
        return self.query_start_loc[1:] - 1

    @property
    def output_rows(self) -> np.ndarray:
        """(R,) the rows a backend returns logits (or ids) for: sample_rows, else one per
        sequence."""
        return self.logits_indices if self.sample_rows is None else self.sample_rows

    def validate(self, num_blocks: int, block_size: int) -> None:
        """Internal consistency; an assert, since the engine builds these, not the user."""
        T, B = self.num_tokens, self.num_seqs
        assert self.positions.shape == (T,) and self.slot_mapping.shape == (T,)
        assert self.query_start_loc.shape == (B + 1,) and self.query_start_loc[-1] == T
        q_lens = np.diff(self.query_start_loc)
        assert np.all(q_lens >= 1) and np.all(q_lens[: self.num_decodes] == 1)
        assert np.all(self.context_lens >= q_lens)
        assert self.block_tables.shape[0] == B
        assert np.all(self.block_tables < num_blocks)
        assert np.all(self.slot_mapping < num_blocks * block_size)
        for tables, slots in zip(self.group_tables, self.group_slots, strict=True):
            assert tables.shape == self.block_tables.shape and slots.shape == (T,)
            assert np.all(tables < num_blocks) and np.all(slots < num_blocks * block_size)


def token_slots(qsl: np.ndarray, context_lens: np.ndarray, tables: np.ndarray, block_size: int):
    """((T,) position, (T,) cache slot) of every token of a flat batch: its sequence's start
    (context_lens - q_len) plus its index within the run, and where its page table puts it."""
    q_lens = np.diff(qsl)  # (B,)
    if qsl[-1] == len(q_lens):
        positions = context_lens - 1  # (T,) one token per sequence
    else:
        first = np.repeat(context_lens - q_lens - qsl[:-1], q_lens)  # (T,) start - run offset
        positions = np.arange(qsl[-1], dtype=np.int32) + first  # (T,)
    rows = np.repeat(np.arange(len(q_lens)), q_lens)  # (T,) sequence of each token
    slots = tables[rows, positions // block_size] * block_size + positions % block_size  # (T,)
    return positions.astype(np.int32), slots.astype(np.int32)


def group_slots(b: ForwardBatch, tables: np.ndarray, block_size: int) -> np.ndarray:
    """(T,) int32 each token's cache slot in another group's page tables (B, max_blocks)."""
    rows = np.repeat(np.arange(b.num_seqs), np.diff(b.query_start_loc))  # (T,)
    pos = b.positions  # (T,)
    return (tables[rows, pos // block_size] * block_size + pos % block_size).astype(np.int32)


def flat_batch(
    tokens: list[int],
    q_lens: np.ndarray,
    context_lens: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    num_decodes: int,
    row_counts: list[int] | None = None,
) -> ForwardBatch:
    """The ForwardBatch of B runs, decodes first: run b's q_lens[b] tokens (of ``tokens``, run
    after run) are the last of its first context_lens[b]; tables (B, width): the page tables
    that cover them. row_counts: rows of run b whose logits come back (its last
    ``row_counts[b]``); None: one per run."""
    qsl = np.zeros(len(q_lens) + 1, dtype=np.int32)  # (B+1,)
    np.cumsum(q_lens, out=qsl[1:])
    positions, slot_mapping = token_slots(qsl, context_lens, tables, block_size)  # (T,), (T,)
    sample_rows = None
    if row_counts is not None:
        ends = qsl[1:].tolist()
        rows = (range(e - c, e) for e, c in zip(ends, row_counts, strict=True))
        sample_rows = np.fromiter((r for rs in rows for r in rs), np.int32)  # (R,)
    return ForwardBatch(
        token_ids=np.asarray(tokens, dtype=np.int32),
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=tables,
        context_lens=context_lens.astype(np.int32),
        query_start_loc=qsl,
        num_decodes=num_decodes,
        sample_rows=sample_rows,
    )
