"""What one scheduled step runs: ``SchedulerOutput``, the object the scheduler hands the model
runner each step (who runs with how many tokens, decodes first; the block moves before the
forward; the preempted; the prefix hits and tier loads; the drafts), and ``StepBuilder``, a
step under construction (the token budget left)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sequence import Sequence


@dataclass
class SchedulerOutput:
    # (seq, num_new_tokens): the first num_decodes are decodes (1 token each), then prefills
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    num_decodes: int = 0
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu), first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu), second
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) GPU blocks
    preempted: list[Sequence] = field(default_factory=list)
    prefix_hits: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # cached blocks
    # KV tiers: blocks evicted from the cache whose bytes a tier still needs (block id, hash,
    # key, KV group), read before the forward; then (seq, pool block ids, arrays, KV group)
    # loaded from the tiers
    blocks_to_store: list[tuple] = field(default_factory=list)
    tier_loads: list[tuple[Sequence, list[int], list, int]] = field(default_factory=list)
    # speculative decoding: seq_id -> the draft tokens it runs after its last token (a row of
    # 1 + len(drafts) tokens among the prefills); the engine appends what verification accepts
    drafts: dict[int, list[int]] = field(default_factory=dict)
    needs_rows: bool | None = None  # model_runner.needs_rows' answer, once asked

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to copy: the step can be skipped."""
        return not (
            self.scheduled
            or self.blocks_to_store
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.blocks_to_copy
        )

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class StepBuilder:
    """One step under construction: the token budget left and what is scheduled so far."""

    budget: int
    decodes: list[tuple[Sequence, int]] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, is_decode: bool) -> None:
        (self.decodes if is_decode else self.prefills).append((seq, n))
        self.budget -= n
