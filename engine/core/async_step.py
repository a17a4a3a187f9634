"""Async scheduling's part of a step: which steps may run without being waited for, and reading
a launched step's ids back into its sequences.

A step of plain-greedy decodes alone (no blocks to move, nobody preempted) is launched by the
model runner (``ModelRunner.launch``) and left in flight; its sequences take a
``PENDING_TOKEN`` so the next step can be scheduled at once. ``collect`` later puts the step's
ids in place of the pending tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.sampler import NO_TOKEN, plain_greedy
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import PENDING_TOKEN, Sequence


@dataclass
class InFlight:
    """A launched step of decodes whose ids are not read yet."""

    seqs: list[Sequence]  # row b of the step's ids is seqs[b]'s token
    handle: object  # the backend's GreedyIds
    rows: dict[int, int]  # seq_id -> its row


def can_overlap(config, record_logits: bool, out: SchedulerOutput) -> bool:
    """Whether the step can be launched without waiting: decodes alone, every one plain greedy,
    no blocks to move, nobody preempted, no logits to record, no speculation."""
    return (
        config.async_scheduling
        and config.speculative is None  # speculated steps run synchronously
        and not record_logits
        and bool(out.scheduled)
        and out.num_decodes == len(out.scheduled)
        and not (out.preempted or out.blocks_to_swap_out or out.blocks_to_swap_in)
        and not (out.blocks_to_copy or out.blocks_to_store or out.tier_loads)
        and all(plain_greedy(seq) for seq, _ in out.scheduled)
    )


def collect(flight: InFlight) -> tuple[list[Sequence], list[Sequence]]:
    """The step's ids in place of the pending tokens -> (the sequences that took a token, those
    whose row had none to pick). A sequence finished since (stopped at the step before,
    aborted) takes nothing: its row was an extra token, dropped here."""
    ids = flight.handle.result().tolist()  # (B,)
    grown, failed = [], []
    for seq, t in zip(flight.seqs, ids, strict=True):
        if seq.is_finished or seq.last_token_id != PENDING_TOKEN:
            continue
        if t == NO_TOKEN:
            seq.drop_pending()
            failed.append(seq)
        else:
            seq.resolve_pending(t)
            grown.append(seq)
    return grown, failed
