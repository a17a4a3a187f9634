"""One scheduler step -> the flat arrays of ``ForwardBatch`` -> the backend's forward -> logits
(or, for an all-greedy step, the backend's greedy ids)."""

from __future__ import annotations

import numpy as np

from reference.config import ModelConfig

from .forward_batch import ForwardBatch
from .scheduler import SchedulerOutput
from .utils import cdiv


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config, backend):
        self.model_config = model_config
        self.block_size = engine_config.block_size
        self.backend = backend

    def prepare(self, output: SchedulerOutput) -> ForwardBatch:
        """Flatten the scheduled (seq, num_new_tokens) pairs, decodes first, into one batch."""
        bs = self.block_size
        tokens, starts, q_lens, tables = [], [], [], []
        for seq, n in output.scheduled:
            start = seq.num_computed_tokens  # tokens already in the cache
            if n == 1 and start == seq.num_tokens - 1:
                tokens.append(seq.last_token_id)  # decode: no copy of the whole sequence
            else:
                tokens.extend(seq.token_ids[start : start + n])
            starts.append(start)
            q_lens.append(n)
            tables.append(seq.block_table[: cdiv(start + n, bs)])
        q_lens_a = np.asarray(q_lens, dtype=np.int32)  # (B,)
        context_lens = np.asarray(starts, dtype=np.int32) + q_lens_a  # (B,)
        qsl = np.zeros(len(q_lens) + 1, dtype=np.int32)  # (B+1,)
        np.cumsum(q_lens_a, out=qsl[1:])
        block_tables = np.full((len(tables), max(map(len, tables))), -1, dtype=np.int32)
        for b, table in enumerate(tables):
            block_tables[b, : len(table)] = table  # (B, max_blocks), -1 padded
        # position of each token: its sequence's start + its index within the run
        positions = (np.arange(qsl[-1], dtype=np.int32) - np.repeat(qsl[:-1], q_lens_a)) + (
            np.repeat(context_lens - q_lens_a, q_lens_a)
        )  # (T,)
        rows = np.repeat(np.arange(len(tables)), q_lens_a)  # (T,) sequence of each token
        slot_mapping = block_tables[rows, positions // bs] * bs + positions % bs  # (T,)
        return ForwardBatch(
            token_ids=np.asarray(tokens, dtype=np.int32),
            positions=positions.astype(np.int32),
            slot_mapping=slot_mapping.astype(np.int32),
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=qsl,
            num_decodes=output.num_decodes,
        )

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
