"""One scheduler step -> the flat arrays of ``ForwardBatch`` -> the backend's forward -> logits
(or, for an all-greedy step, the backend's greedy ids).

The page tables persist between steps (``BlockTables``): each sequence keeps a row of one array,
written only when its table grows or is replaced, so a decode step costs O(batch), not O(blocks).
"""

from __future__ import annotations

import numpy as np

from reference.config import ModelConfig

from .forward_batch import ForwardBatch, token_slots
from .scheduler import SchedulerOutput
from .utils import cdiv


def wants_prompt_rows(seq) -> bool:
    """Whether seq's scheduled tokens are prompt tokens whose log-probabilities are asked."""
    return (
        seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens
    )


def output_row_counts(output: SchedulerOutput) -> list[int]:
    """Rows of logits each scheduled sequence gets back: all of a speculated run's and of a
    prompt chunk whose logprobs are asked, else one (its last)."""
    return [
        n if seq.seq_id in output.drafts or wants_prompt_rows(seq) else 1
        for seq, n in output.scheduled
    ]


def needs_rows(output: SchedulerOutput) -> bool:
    """Whether any sequence gets back more than its last row (asked once per step: the
    answer is kept on the output)."""
    if output.needs_rows is None:
        output.needs_rows = bool(output.drafts) or any(
            not s.always_plain and wants_prompt_rows(s) for s, _ in output.scheduled
        )
    return output.needs_rows


class BlockTables:
    """Page tables as rows of one (rows, max_blocks) int32 array, -1 padded. A sequence keeps its
    row while it runs; a row is rewritten only where its sequence's table grew (blocks are only
    appended) or was replaced (freed, swapped, taken from the prefix cache). When every row is
    taken, the rows of sequences no longer scheduled are dropped."""

    def __init__(self, num_rows: int, max_blocks: int):
        self.table = np.full((num_rows, max_blocks), -1, dtype=np.int32)  # (R, max_blocks)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.src: list[list[int] | None] = [None] * num_rows  # the table each row copies
        self.lens = [0] * num_rows  # blocks of src in the row

    def rows(self, seqs) -> np.ndarray:
        """(B,) the row of each sequence, its page table synced into it."""
        if len(self.row_of) + len(seqs) > len(self.src):
            self._drop_all_but(seqs)
        rows = [self._sync(seq) for seq in seqs]
        return np.asarray(rows, dtype=np.intp)

    def _sync(self, seq) -> int:
        row = self.row_of.get(seq.seq_id)
        if row is None:
            row = self.row_of[seq.seq_id] = len(self.row_of)
        table, done = seq.block_table, self.lens[row]
        if self.src[row] is not table or done > len(table):  # replaced: the whole row again
            self.src[row], done = table, 0
            self.table[row] = -1
        if done < len(table):
            self.table[row, done : len(table)] = table[done:]
            self.lens[row] = len(table)
        return row

    def _drop_all_but(self, seqs) -> None:
        """Keep only the rows of ``seqs`` (renumbered), so the next ones fit."""
        keep = [s.seq_id for s in seqs if s.seq_id in self.row_of]
        old = [self.row_of[k] for k in keep]
        self.table[: len(old)] = self.table[old]
        self.src = [self.src[r] for r in old] + [None] * (len(self.src) - len(old))
        self.lens = [self.lens[r] for r in old] + [0] * (len(self.lens) - len(old))
        self.row_of = {k: i for i, k in enumerate(keep)}


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config, backend):
        self.model_config = model_config
        self.block_size = engine_config.block_size
        self.backend = backend
        max_blocks = cdiv(engine_config.max_model_len, self.block_size)
        self.block_tables = BlockTables(2 * engine_config.max_num_seqs, max_blocks)

    def prepare(self, output: SchedulerOutput) -> ForwardBatch:
        """Flatten the scheduled (seq, num_new_tokens) pairs, decodes first, into one batch."""
        bs, nd = self.block_size, output.num_decodes
        seqs = [seq for seq, _ in output.scheduled]
        starts = [seq.num_computed_tokens for seq in seqs]  # tokens already in the cache
        tokens = [seq.last_token_id for seq in seqs[:nd]]  # decode: its last token alone
        drafts = output.drafts
        for (seq, n), start in zip(output.scheduled[nd:], starts[nd:], strict=True):
            tokens.extend(seq.token_ids[start : start + n])
            tokens.extend(drafts.get(seq.seq_id, ()))  # a speculated run: last token, drafts
        q_lens = np.ones(len(seqs), dtype=np.int32)  # (B,)
        q_lens[nd:] = [n for _, n in output.scheduled[nd:]]
        context_lens = np.asarray(starts, dtype=np.int32) + q_lens  # (B,)
        qsl = np.zeros(len(seqs) + 1, dtype=np.int32)  # (B+1,)
        np.cumsum(q_lens, out=qsl[1:])
        block_tables = self._block_tables(seqs, context_lens)  # (B, max_blocks)
        positions, slot_mapping = token_slots(qsl, context_lens, block_tables, bs)  # (T,), (T,)
        return ForwardBatch(
            token_ids=np.asarray(tokens, dtype=np.int32),
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=qsl,
            num_decodes=nd,
            sample_rows=self._sample_rows(output, qsl) if needs_rows(output) else None,
        )

    @staticmethod
    def _sample_rows(output: SchedulerOutput, qsl: np.ndarray) -> np.ndarray:
        """(R,) every row of a speculated run (each verifies a draft) and of a prompt chunk whose
        logprobs are asked, the last of the rest."""
        counts = output_row_counts(output)
        rows = [range(qsl[b + 1] - c, qsl[b + 1]) for b, c in enumerate(counts)]
        return np.fromiter((r for rs in rows for r in rs), np.int32)

    def _block_tables(self, seqs, context_lens: np.ndarray) -> np.ndarray:
        """(B, max_blocks) each sequence's blocks that hold its first context_lens tokens, -1
        padded; max_blocks is the most any of them needs."""
        needed = (context_lens + self.block_size - 1) // self.block_size  # (B,)
        tables = self.block_tables.table[self.block_tables.rows(seqs), : needed.max()]
        tables[np.arange(tables.shape[1]) >= needed[:, None]] = -1
        return tables

    def execute(self, output: SchedulerOutput, greedy: bool = False) -> np.ndarray:
        """Swaps and copies first, then the forward: (B, V) float32 logits (B = scheduled), or
        with ``greedy`` the (B,) int32 argmax of each row, the logits left on the backend."""
        self._move_blocks(output)
        if not output.scheduled:
            shape = (0,) if greedy else (0, self.model_config.vocab_size)
            return np.zeros(shape, dtype=np.int32 if greedy else np.float32)
        batch = self.prepare(output)
        return self.backend.forward_greedy(batch) if greedy else self.backend.forward(batch)

    def _move_blocks(self, output: SchedulerOutput) -> None:
        be = self.backend
        if output.blocks_to_swap_out:
            be.swap_out(output.blocks_to_swap_out)
        if output.blocks_to_swap_in:
            be.swap_in(output.blocks_to_swap_in)
        if output.blocks_to_copy:
            be.copy_blocks(output.blocks_to_copy)
