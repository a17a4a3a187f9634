"""The life of each request as log lines on ``engine.trace`` (off unless asked for).

``python -m engine.generate --trace`` (or a caller) sets the logger to INFO. Each function returns
at once when tracing is off, so the engine calls them unconditionally.
"""

from __future__ import annotations

import logging

trace = logging.getLogger("engine.trace")
trace.setLevel(logging.WARNING)  # `--trace` (or a caller) sets it to INFO


def on() -> bool:
    return trace.isEnabledFor(logging.INFO)


def queued(request_id: str, ids: list[int], num_waiting: int) -> None:
    if on():
        trace.info(
            "%s: tokenized into %d ids %s; queued (%d waiting)",
            request_id,
            len(ids),
            ids[:16],
            num_waiting,
        )


def first_token(request_id: str, token: int, ms: float) -> None:
    if on():
        trace.info("%s: first token %d after %.1f ms", request_id, token, ms)


def finished(request_id: str, reason: str, num_tokens: int, num_free: int) -> None:
    if on():
        trace.info(
            "%s: finished (%s) after %d tokens; its blocks are back on the free queue "
            "(%d free now)",
            request_id,
            reason,
            num_tokens,
            num_free,
        )


class ScheduleTracer:
    """Logs prefix hits, preemptions, prefills and new blocks of each scheduled step; remembers
    how much of each live sequence's block table it has already shown (finished sequences are
    dropped every step, and everything while tracing is off)."""

    def __init__(self, block_manager, block_size: int, preemption_mode: str):
        self.block_manager = block_manager
        self.block_size = block_size
        self.preemption_mode = preemption_mode
        self.tables: dict[int, tuple] = {}  # seq_id -> (Sequence, length of its table last traced)

    def __call__(self, out) -> None:  # out: the step's SchedulerOutput
        if not on():
            self.tables.clear()
            return
        self._forget_finished()
        for seq, hits in out.prefix_hits:
            tokens = len(hits) * self.block_size
            trace.info("%s: prefix cache hit: %d tokens (blocks %s)", seq.request_id, tokens, hits)
        for seq, ids, _, group in out.tier_loads:  # a grouped model: a line per KV group
            tokens, where = len(ids) * self.block_size, f" of KV group {group}" if group else ""
            trace.info(
                "%s: KV tier hit: %d tokens loaded (blocks %s%s)",
                seq.request_id,
                tokens,
                ids,
                where,
            )
        if out.blocks_to_store:
            trace.info("KV tiers: %d evicted blocks stored", len(out.blocks_to_store))
        for seq in out.preempted:
            trace.info(
                "%s: preempted (%s): blocks released, %d free now",
                seq.request_id,
                self.preemption_mode,
                self.block_manager.num_free_blocks,
            )
            self.tables.pop(seq.seq_id, None)
        for seq, n in out.scheduled:
            self._scheduled(seq, n)

    def _forget_finished(self) -> None:
        """Drop the sequences that finished (or were aborted) since the last step."""
        done = [sid for sid, (seq, _) in self.tables.items() if seq.is_finished]
        for sid in done:
            del self.tables[sid]

    def _scheduled(self, seq, n: int) -> None:
        known = self.tables.get(seq.seq_id, (seq, None))[1]
        free = self.block_manager.num_free_blocks
        if known is None:
            kind = "prefill" if seq.num_output_tokens == 0 else "resumed prefill"
            trace.info(
                "%s: scheduled as %s of %d tokens with blocks %s (%d free)",
                seq.request_id,
                kind,
                n,
                seq.block_table,
                free,
            )
        elif len(seq.block_table) > known:
            trace.info(
                "%s: new block %s at token %d (%d free)",
                seq.request_id,
                seq.block_table[known:],
                seq.num_tokens,
                free,
            )
        self.tables[seq.seq_id] = (seq, len(seq.block_table))
