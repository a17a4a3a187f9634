"""One scheduler step -> the flat arrays of ``ForwardBatch`` -> the backend's forward -> the
step's tokens (``RunnerOutput``).

``execute`` decides which rows of the forward come back (each sequence's last, every row of a
speculated run or of a prompt chunk whose logprobs are asked), asks the backend for argmax ids
alone when every row is plain greedy, else for logits, and samples (penalties, bans, grammar
masks: ``Sampler``) or verifies drafts (``spec_step.verify``). The page tables persist between
steps (``BlockTables``): each sequence keeps a row of one array, written only when its table
grows or is replaced, so a decode step costs O(batch), not O(blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.backends.base import greedy_ids
from engine.backends.forward_batch import ForwardBatch, flat_batch, group_slots
from engine.core.async_step import InFlight
from engine.core.sampler import Sampler, plain_greedy, rows_to_sample, top_logprobs
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.spec_step import Accepted, verify
from engine.utils import cdiv
from model_loader.config import ModelConfig


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


def plain_decodes(output: SchedulerOutput) -> bool:
    """Whether every scheduled row is a decode of an always plain greedy sequence: each one
    samples, an argmax of the raw logits, and no other row comes back."""
    if output.num_decodes != len(output.scheduled) or output.drafts:
        return False
    return all(seq.always_plain for seq, _ in output.scheduled)


class BlockTables:
    """Page tables as rows of one (rows, max_blocks) int32 array, -1 padded. A sequence keeps its
    row while it runs; a row is rewritten only where its sequence's table grew (blocks are only
    appended) or was replaced (freed, swapped, taken from the prefix cache). When every row is
    taken, the rows of sequences no longer scheduled are dropped. ``group`` > 0: the page tables
    of that KV group (``Sequence.group_tables``), not group 0's (``Sequence.block_table``)."""

    def __init__(self, num_rows: int, max_blocks: int, group: int = 0):
        self.group = group
        self.table = np.full((num_rows, max_blocks), -1, dtype=np.int32)  # (R, max_blocks)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.src: list[list[int] | None] = [None] * num_rows  # the table each row copies
        self.lens = [0] * num_rows  # blocks of src in the row

    def rows(self, seqs) -> np.ndarray:
        """(B,) the row of each sequence, its page table synced into it."""
        if len(self.row_of) + len(seqs) > len(self.src):
            self._drop_all_but(seqs)
        row_of, src, lens, rows, g = self.row_of, self.src, self.lens, [], self.group
        for seq in seqs:
            row = row_of.get(seq.seq_id)
            table = seq.group_tables[g - 1] if g else seq.block_table
            if row is not None and src[row] is table and lens[row] == len(table):
                rows.append(row)  # in sync: the common case (a decode in its last block)
            else:
                rows.append(self._sync(seq))
        return np.asarray(rows, dtype=np.intp)

    def _sync(self, seq) -> int:
        row = self.row_of.get(seq.seq_id)
        if row is None:
            row = self.row_of[seq.seq_id] = len(self.row_of)
        table = seq.group_tables[self.group - 1] if self.group else seq.block_table
        done = self.lens[row]
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


@dataclass
class RunnerOutput:
    """One step's tokens. ``seqs[i]`` (a sequence whose last token ran, not speculated) sampled
    ``ids[i]`` (NO_TOKEN: its row had nothing to pick); ``extras[i]``: its (logprobs or None,
    logits row) where logits came back; ``prompt_logprobs``: (seq, entries its
    ``prompt_logprobs`` grows by); ``accepted``: each speculated run's verified tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    extras: list[tuple] | None = None
    prompt_logprobs: list[tuple[Sequence, list]] = field(default_factory=list)
    accepted: list[Accepted] = field(default_factory=list)


class ModelRunner:
    """``backend`` runs the forwards; ``sampler`` picks the tokens; ``record_logits`` asks for
    the logits of every sampled row (so no step takes the argmax-only path). Each feature's
    collaborator, None where it is off: ``lora`` the LoRAManager (rows carry their adapter's
    slot), ``connector`` the KV tiers (engine/kv_offload). (``runner="pooling"``: its
    subclass ``PoolingRunner``, engine/core/pooling_runner.py.)"""

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config,
        backend,
        sampler: Sampler,
        record_logits: bool,
        *,
        lora=None,
        connector=None,
        kv_groups=None,
    ):
        self.model_config = model_config
        self.block_size = engine_config.block_size
        self.backend = backend
        self.sampler = sampler
        self.record_logits = record_logits
        self.connector = connector
        self.lora = lora
        max_blocks = cdiv(engine_config.max_model_len, self.block_size)
        self.block_tables = BlockTables(2 * engine_config.max_num_seqs, max_blocks)
        # KV groups (a grouped model's KVGroups, else None): the other groups' page tables
        self.kv_groups = kv_groups
        n = kv_groups.num_groups if kv_groups is not None else 1
        rows = 2 * engine_config.max_num_seqs
        self.group_block_tables = [BlockTables(rows, max_blocks, g) for g in range(1, n)]

    def prepare(self, output: SchedulerOutput) -> ForwardBatch:
        """Flatten the scheduled (seq, num_new_tokens) pairs, decodes first, into one batch."""
        nd = output.num_decodes
        seqs = [seq for seq, _ in output.scheduled]
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, len(seqs))  # (B,)
        tokens = [seq.last_token_id for seq in seqs[:nd]]  # decode: its last token alone
        drafts = output.drafts
        for (seq, n), start in zip(output.scheduled[nd:], starts[nd:].tolist(), strict=True):
            tokens.extend(seq.token_ids[start : start + n])
            tokens.extend(drafts.get(seq.seq_id, ()))  # a speculated run: last token, drafts
        q_lens = np.ones(len(seqs), dtype=np.int32)  # (B,)
        q_lens[nd:] = [n for _, n in output.scheduled[nd:]]
        context_lens = starts + q_lens  # (B,)
        tables = self._block_tables(seqs, context_lens)  # (B, max_blocks)
        counts = output_row_counts(output) if needs_rows(output) else None
        batch = flat_batch(tokens, q_lens, context_lens, tables, self.block_size, nd, counts)
        if self.lora is not None and any(s.lora_id is not None for s in seqs):
            slots = [-1 if s.lora_id is None else s.lora_slot for s in seqs]  # (B,)
            batch.lora_slots = np.repeat(np.asarray(slots, np.int32), q_lens)  # (T,)
        if self.kv_groups is not None:
            self._add_groups(batch, seqs, context_lens)
        return batch

    def _add_groups(self, batch: ForwardBatch, seqs, context_lens: np.ndarray) -> None:
        """The other KV groups' page tables and slots, and the layer -> (group, slot) map."""
        tables = [self._block_tables(seqs, context_lens, bt) for bt in self.group_block_tables]
        batch.kv_groups = self.kv_groups
        batch.group_tables = tuple(tables)  # (B, max_blocks) each
        batch.group_slots = tuple(group_slots(batch, t, self.block_size) for t in tables)

    def _block_tables(self, seqs, context_lens: np.ndarray, bt: BlockTables | None = None):
        """(B, max_blocks) each sequence's blocks that hold its first context_lens tokens, -1
        padded; max_blocks is the most any of them needs. ``bt``: another KV group's."""
        bt = self.block_tables if bt is None else bt
        needed = (context_lens + self.block_size - 1) // self.block_size  # (B,)
        tables = bt.table[bt.rows(seqs), : needed.max()]
        tables[np.arange(tables.shape[1]) >= needed[:, None]] = -1
        return tables

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Swaps and copies, the forward, then a token for every sequence whose last token ran
        (and the verified tokens of each speculated run)."""
        if output.drafts:
            return self._execute_speculated(output)
        if output.is_empty:
            return RunnerOutput()
        if not self.record_logits and plain_decodes(output):  # the common case, in one pass
            seqs = [seq for seq, _ in output.scheduled]
            return RunnerOutput(seqs, self.forward(output, greedy=True).tolist())  # (B,) ids
        rows, seqs = rows_to_sample(output.scheduled)
        prompt = []
        if needs_rows(output):  # prompt chunks whose logprobs are asked: all their rows come back
            every = self.forward(output)  # (R, V)
            counts = output_row_counts(output)  # (B,)
            prompt = prompt_logprobs(output, every, counts)
            logits = every[np.cumsum(counts) - 1]  # (B, V) each one's last row
        elif not self.record_logits and all(plain_greedy(s) for s in seqs):
            # the argmax where the logits are; only ids come back
            greedy = self.forward(output, greedy=True)  # (B,)
            ids = (greedy if len(rows) == len(greedy) else greedy[rows]).tolist()  # (R,)
            return RunnerOutput(seqs, ids)
        else:
            logits = self.forward(output)  # (B, V)
        gens = [s.generator for s in seqs]
        ids, lps = self.sampler.sample(logits[rows], seqs, gens)
        extras = [(lp, logits[r]) for lp, r in zip(lps, rows, strict=True)]
        return RunnerOutput(seqs, ids, extras, prompt)

    def _execute_speculated(self, output: SchedulerOutput) -> RunnerOutput:
        """A step with speculated rows: a run's rows are the target after its last token and
        after each draft. When every sequence is plain greedy only their argmax comes back;
        else the logits, and the other sequences sample as in a plain step."""
        if all(plain_greedy(seq) for seq, _ in output.scheduled):
            ids, logits = self.forward(output, greedy=True).tolist(), None  # (R,)
        else:
            logits = self.forward(output)  # (R, V)
            ids = greedy_ids(logits).tolist()
        counts = output_row_counts(output)  # (B,) rows of logits (or ids) of each sequence
        runs, plain_seqs, plain_rows, r = [], [], [], 0
        for (seq, n), count in zip(output.scheduled, counts, strict=True):
            drafts = output.drafts.get(seq.seq_id)
            if drafts is not None:
                runs.append((seq, r, n, drafts))
            elif seq.num_computed_tokens + n == seq.num_tokens:  # its last token ran: it samples
                plain_seqs.append(seq)
                plain_rows.append(r + count - 1)
            r += count
        accepted = verify(runs, logits, ids, self.sampler)
        prompt = [] if logits is None else prompt_logprobs(output, logits, counts)
        plain_ids, extras = [ids[i] for i in plain_rows], None
        if logits is not None and plain_seqs:
            gens = [s.generator for s in plain_seqs]
            plain_ids, lps = self.sampler.sample(logits[plain_rows], plain_seqs, gens)
            extras = [(lp, logits[i]) for lp, i in zip(lps, plain_rows, strict=True)]
        return RunnerOutput(plain_seqs, plain_ids, extras, prompt, accepted)

    def forward(self, output: SchedulerOutput, greedy: bool = False) -> np.ndarray:
        """Swaps and copies first, then the forward: (R, V) float32 logits of the rows that come
        back (``needs_rows``), or with ``greedy`` the (R,) int32 argmax of each, the logits left
        on the backend."""
        self._move_blocks(output)
        if not output.scheduled:
            shape = (0,) if greedy else (0, self.model_config.vocab_size)
            return np.zeros(shape, dtype=np.int32 if greedy else np.float32)
        batch = self.prepare(output)
        return self.backend.forward_greedy(batch) if greedy else self.backend.forward(batch)

    def launch(self, output: SchedulerOutput, prev: InFlight | None) -> InFlight:
        """Async scheduling: launch the decodes of ``output`` (every one plain greedy), each
        taking its token from ``prev``'s ids where it has a row there; not waited for."""
        batch, seqs = self.prepare(output), [seq for seq, _ in output.scheduled]
        if prev is not None:
            batch.prev_rows = np.fromiter(  # (B,) each decode's row in prev's ids, or -1
                (prev.rows.get(s.seq_id, -1) for s in seqs), np.int32, len(seqs)
            )
        handle = self.backend.launch_greedy(batch, None if prev is None else prev.handle)
        return InFlight(seqs, handle, {s.seq_id: b for b, s in enumerate(seqs)})

    def _move_blocks(self, output: SchedulerOutput) -> None:
        be = self.backend
        if output.blocks_to_store:  # before anything writes the evicted blocks
            self.connector.save_pool_blocks(be, output.blocks_to_store)
        for _, ids, loads, group in output.tier_loads:
            be.write_blocks(ids, np.stack(loads, axis=2), [group] * len(ids))  # (L, 2, n, ...)
        if output.blocks_to_swap_out:
            be.swap_out(output.blocks_to_swap_out)
        if output.blocks_to_swap_in:
            be.swap_in(output.blocks_to_swap_in)
        if output.blocks_to_copy:
            be.copy_blocks(output.blocks_to_copy)


def prompt_logprobs(output: SchedulerOutput, logits: np.ndarray, counts) -> list:
    """(seq, entries) for each prompt chunk whose logprobs are asked: the logprobs of the prompt
    tokens its rows predict (row q predicts token q + 1; the first prompt token has none, a
    None). Positions already recorded (a prompt run again after a recompute preemption) are
    skipped."""
    out, r = [], 0
    for (seq, n), count in zip(output.scheduled, counts, strict=True):
        if wants_prompt_rows(seq):
            entries = [] if seq.prompt_logprobs else [None]
            size = len(seq.prompt_logprobs) + len(entries)
            start, k = seq.num_computed_tokens, seq.params.prompt_logprobs
            for q in range(start, start + n):
                nxt = q + 1
                if size == nxt < seq.num_prompt_tokens:
                    token = seq.prompt_token_ids[nxt]
                    entries.append(top_logprobs(logits[r + q - start], token, k))
                    size += 1
            out.append((seq, entries))
        r += count
    return out
