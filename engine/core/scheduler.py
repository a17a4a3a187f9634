"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each ``schedule()`` builds one step: first one decode token for every running sequence (decode
priority; a sequence that needs a block and finds none preempts the most recently arrived running
sequence), then swapped-out sequences come back, then waiting prompts are admitted first come,
first served while blocks, ``max_num_seqs`` and the token budget allow. ``update()`` records what
the step computed and appends each sampled token. Finished sequences give their blocks back at
once, so waiting prompts join the very next step.

With prefix caching, blocks are registered in the cache as they are allocated for the tokens a
step computes, so a prompt admitted later in the same step shares the full blocks of a prefix that
an earlier one computes in it. Such blocks are always computed by that step's forward: a sequence
is preempted only inside ``schedule()``, before any prompt is admitted and never once it is
scheduled, and a sequence finished (aborted) between ``schedule()`` and ``update()`` keeps its
blocks until ``update()``, so the forward still writes them.

Sliding windows (every layer's, or each sliding KV group's): each step starts by giving back
the running sequences' blocks no later query sees (``BlockManager.slide``).

Async scheduling: ``advance()`` replaces ``update()`` once a step is launched (its inputs, page
tables included, are on the device). It leaves each sampling sequence a pending last token, so
``schedule()`` plans the next step before the last one's ids are known; from then on the launched
step's sequences may be preempted or freed, since every later use of their blocks is queued on the
device after that step.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.messages import check_queue
from engine.core.scheduler_output import SchedulerOutput, StepBuilder
from engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from engine.core.tier_prefix import TierPrefix, tier_prefix

logger = logging.getLogger("engine.scheduler")


def _arrival_key(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival_time, seq.seq_id)


class Scheduler:
    """``lora``: the LoRAManager (``enable_lora``), which gives a sequence its adapter's slot
    at admission; None without adapters."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, lora=None):
        if not config.is_resolved:
            raise ValueError("Scheduler: config must be resolved first (EngineConfig.resolve)")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()  # FCFS; recompute-preempted seqs at the front
        self.running: list[Sequence] = []  # oldest arrival first
        self.swapped: list[Sequence] = []  # oldest arrival first
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admissions
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self.tier_queries = 0  # prompt tokens looked up with KV tiers on (first admissions)
        self.tier_hits = 0  # of those, tokens loaded from the tiers
        self._rejected: list[tuple[Sequence, str]] = []
        self._in_flight: dict[int, int] = {}  # seq_id -> tokens of the step not yet updated
        self._releasing: list[Sequence] = []  # finished in flight: blocks freed after the step
        self.lora = lora
        # KV tiers: seq_id -> {(group, block index): the tiers' block or None} while it waits
        # at the head of the queue, so a prompt that does not fit yet is not read again
        self._tier_fetch: dict[int, dict] = {}
        self._drafts: dict[int, list[int]] = {}  # this step's drafts (``schedule``), by seq id

    # -- queues ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def live_seqs(self) -> list[Sequence]:
        return list(self.running) + list(self.swapped) + list(self.waiting)

    def take_rejected(self) -> list[tuple[Sequence, str]]:
        """Sequences finished because they can never run, with a one-line reason; clears them."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq FINISHED and put its blocks back on the free queue now."""
        if seq.is_finished:
            return
        queue = {
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.WAITING: self.waiting,
            SequenceStatus.SWAPPED: self.swapped,
        }[seq.status]
        if seq in queue:
            queue.remove(seq)
        if seq.seq_id in self._in_flight:  # the step's forward still writes its blocks
            self._releasing.append(seq)
        else:
            self.block_manager.free(seq)
        self._tier_fetch.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of request_id, wherever it is; False if none was live."""
        seqs = [s for s in self.live_seqs() if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return bool(seqs)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """The next step. ``drafts``: speculative decoding's proposals for running decodes, by
        seq id; the scheduler takes (removes) those it considers, running each that fits as one
        run of rows (``SchedulerOutput.drafts``)."""
        out = SchedulerOutput()
        step = StepBuilder(budget=self.config.max_num_batched_tokens)
        self._drafts = {} if drafts is None else drafts
        if self.block_manager.slides:  # sliding windows: blocks no later query sees go back
            for seq in self.running:
                self.block_manager.slide(seq)
        self._schedule_running(step, out)
        if not out.preempted:  # no room was found for running seqs: admit nobody new
            self._schedule_swapped(step, out)
            if not self.swapped:
                self._schedule_waiting(step, out)
        out.scheduled = step.decodes + step.prefills
        out.num_decodes = len(step.decodes)
        out.blocks_to_store = self.block_manager.take_evicted()
        self._in_flight = {seq.seq_id: n for seq, n in out.scheduled}
        return out

    def check_queue(self, n: int, limit: int) -> None:
        """QueueFullError if n more sequences would leave more than ``limit`` waiting beyond the
        run slots the next step can fill."""
        busy = len(self.running) + len(self.swapped)
        check_queue(n, limit, len(self.waiting), busy, self.config.max_num_seqs)

    def update(self, output: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """After the forward: count the computed tokens; append each sampled token that is due.

        A sequence takes its sampled token only once all its tokens are computed (a chunk of a
        prefill samples nothing). Returns the sequences that got a new token.
        """
        grown, running, drafts = [], SequenceStatus.RUNNING, output.drafts
        for seq, n in output.scheduled:
            if seq.status is not running:  # finished or aborted since schedule()
                continue
            if drafts and seq.seq_id in drafts:  # speculated: the engine appends what is accepted
                continue
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            assert computed <= seq.num_tokens, f"{seq} computed past its end"
            if computed == seq.num_tokens:
                token = sampled.get(seq.seq_id)
                if token is not None:
                    seq.append_token(token)
                    grown.append(seq)
        self._end_step()
        return grown

    def accept(self, seq: Sequence, token: int) -> None:
        """Speculative decoding: append one verified token to seq; every token before it is
        computed (its last token and the drafts accepted so far), the rest roll back."""
        seq.append_token(token)
        seq.num_computed_tokens = seq.num_tokens - 1

    def end_speculation(self, seq: Sequence) -> None:
        """After seq's verified tokens: the lookahead blocks past them go back (a finished seq
        already gave every block back)."""
        if seq.status == SequenceStatus.RUNNING:
            self.block_manager.trim(seq)

    def advance(self, output: SchedulerOutput) -> None:
        """Async scheduling, once the step is launched (its inputs are on the device): count the
        computed tokens and give each sequence that samples a PENDING_TOKEN, resolved when the
        step's ids are read (``Sequence.resolve_pending``). The next step is scheduled as if
        every such sequence had its token."""
        for seq, n in output.scheduled:
            if seq.status != SequenceStatus.RUNNING:  # finished since schedule()
                continue
            seq.num_computed_tokens += n
            assert seq.num_computed_tokens <= seq.num_tokens, f"{seq} computed past its end"
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(PENDING_TOKEN)
        self._end_step()

    def _end_step(self) -> None:
        """The step has run: sequences finished while it was in flight give their blocks back."""
        for seq in self._releasing:
            self.block_manager.free(seq)
        self._releasing = []
        self._in_flight = {}

    def _schedule_running(self, step: StepBuilder, out: SchedulerOutput) -> None:
        """One decode token (or the next prefill chunk) per running seq, oldest first.

        NOTE: admission is strictly FCFS, so a seq still mid-prefill (chunked) is always the
        newest running one: every decode is scheduled before it takes the rest of the budget.
        """
        i = self._plain_decodes(step)  # the common case, in one tight loop
        while i < len(self.running):
            seq = self.running[i]
            if self._drafts.get(seq.seq_id) and self._speculate(
                seq, step, out, len(self.running) - i - 1
            ):
                i += 1
                continue
            if self._plain_decode(seq, step):
                i += 1
                continue
            is_decode = seq.num_uncomputed_tokens == 1
            if self._reject_if_hopeless(seq):
                continue
            n = self._chunk(seq, step.budget)
            if n == 0:
                i += 1
                continue
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]  # the most recently arrived running seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self._allocate(seq, n)
            step.add(seq, n, is_decode)
            i += 1

    def _plain_decodes(self, step: StepBuilder) -> int:
        """``_plain_decode`` for the running seqs from the oldest on, as long as each is one (no
        drafts either): the index of the first that is not. The same decisions, in one loop."""
        bm, limit, bs = self.block_manager, self.config.max_model_len, self.block_manager.block_size
        cache = bm.cache_full_blocks if bm.enable_caching else None  # a no-op without caching
        decodes, budget, i = step.decodes, step.budget, 0
        drafts = self._drafts
        for seq in self.running:
            n = seq.num_tokens
            if (
                (drafts and drafts.get(seq.seq_id))
                or n - seq.num_computed_tokens != 1
                or n > limit
                or budget < 1
                or len(seq.block_table) * bs < n
            ):
                break
            if cache is not None:
                cache(seq, n)
            decodes.append((seq, 1))
            budget -= 1
            i += 1
        step.budget = budget
        return i

    def _plain_decode(self, seq: Sequence, step: StepBuilder) -> bool:
        """Schedule seq's decode token if it needs nothing else: a budget token, no new block,
        no length limit reached (what the full path decides for it then); else False."""
        n = seq.num_tokens
        if (
            n - seq.num_computed_tokens != 1
            or n > self.config.max_model_len
            or step.budget < 1
            or len(seq.block_table) * self.block_manager.block_size < n
        ):
            return False
        self.block_manager.cache_full_blocks(seq, n)
        step.decodes.append((seq, 1))
        step.budget -= 1
        return True

    def _speculate(self, seq: Sequence, step: StepBuilder, out: SchedulerOutput, later: int):
        """Schedule seq's last token and its drafts (taken from this step's) as one row, if the
        budget and the pool allow it without taking a block (a KV group's each) that the
        ``later`` running sequences may need now (speculation never preempts); else False."""
        drafts = self._drafts.pop(seq.seq_id)
        n = min(1 + len(drafts), step.budget)
        bm = self.block_manager
        if seq.num_uncomputed_tokens != 1 or n < 2 or seq.num_tokens > self.config.max_model_len:
            return False
        need, free = bm.blocks_needed(seq, n), bm.num_free_blocks
        if need > free or (need > bm.blocks_needed(seq, 1) and free - need < later * bm.num_groups):
            return False  # the plain path decides (and preempts if it must)
        self._allocate(seq, n)
        step.add(seq, n, is_decode=False)
        out.drafts[seq.seq_id] = drafts[: n - 1]
        return True

    def _schedule_swapped(self, step: StepBuilder, out: SchedulerOutput) -> None:
        """Swap preempted seqs back in, oldest first, before any new prefill."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if self._reject_if_hopeless(seq):
                continue
            n = self._chunk(seq, step.budget)
            if n == 0 or not self.block_manager.can_swap_in(seq, n):
                return
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(seq))
            self._allocate(seq, n)
            self._start_running(seq)
            step.add(seq, n, is_decode=seq.num_uncomputed_tokens == 1)

    def _schedule_waiting(self, step: StepBuilder, out: SchedulerOutput) -> None:
        """Admit waiting prompts first come, first served, while they fit; with prefix caching
        each starts with its cached prefix blocks, and only the rest counts against the budget."""
        bm = self.block_manager
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._reject_if_hopeless(seq):
                continue
            if seq.lora_id is not None and not self._lora_slot(seq):
                return  # every adapter slot is in use: it waits for one
            # [] without prefix caching; a prompt that needs every row computed runs whole
            whole = runs_whole(seq)
            hits = bm.cached_prefix(seq) if not whole else []
            tier = self._tier_prefix(seq, hits) if bm.connector and not whole else None
            loaded = tier.num_blocks * bm.block_size if tier else 0  # tokens past the pool's
            n = self._chunk(seq, step.budget, skip=len(hits) * bm.block_size + loaded)
            fits = tier.fits(bm, seq, n) if tier else bm.can_allocate(seq, n, hits)
            if n == 0 or not fits:
                return
            self.waiting.popleft()
            self._take_prefix(seq, hits, out, loaded, tier and tier.taken)
            if loaded:  # the tiers' blocks: fresh ones, written before the step's forward
                out.tier_loads += [(seq, *load) for load in bm.extend_tables(seq, tier.rows)]
            self._allocate(seq, n)
            self._start_running(seq)
            step.add(seq, n, is_decode=False)

    def _allocate(self, seq: Sequence, n: int) -> None:
        """Blocks for n more tokens of seq; with prefix caching the blocks this step fills are
        registered now, so a prompt admitted later in the step can share them."""
        self.block_manager.allocate(seq, n)
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)

    def _lora_slot(self, seq: Sequence) -> bool:
        """seq's adapter in a slot (its own, a free one, or one no running or swapped sequence
        uses); False when there is none."""
        seq.lora_slot = self.lora.slot_for(seq.lora_id, self._busy_slots)
        return seq.lora_slot is not None

    def _busy_slots(self) -> set[int]:
        return {s.lora_slot for s in self.running + self.swapped if s.lora_id is not None}

    def _tier_prefix(self, seq: Sequence, hits: list) -> TierPrefix:
        """The tiers' part of seq's prefix after its pool hits (read once while it waits)."""
        memo = self._tier_fetch.setdefault(seq.seq_id, {})
        return tier_prefix(self.block_manager, seq, hits, memo)

    def _take_prefix(self, seq, hits: list[int], out, loaded: int = 0, taken=None) -> None:
        """seq starts with the cached blocks ``hits``: their tokens count as computed.
        ``loaded``: tokens after them that come from the KV tiers (counted as cached);
        ``taken``: the blocks it takes (sliding windows: NO_BLOCK before a window, which may
        reach into the tiers' blocks), ``hits`` by default."""
        self._tier_fetch.pop(seq.seq_id, None)
        if not self.config.enable_prefix_caching:
            return
        hit_tokens = len(hits) * self.block_manager.block_size
        if seq.num_cached_tokens is None:  # first admission: the hit-rate statistics
            seq.num_cached_tokens = hit_tokens + loaded
            self.prefix_cache_queries += seq.num_prompt_tokens
            self.prefix_cache_hits += hit_tokens
            if self.block_manager.connector is not None:
                self.tier_queries += seq.num_prompt_tokens
                self.tier_hits += loaded
        taken = hits if taken is None else taken
        if taken:
            self.block_manager.take_cached(seq, taken)
            seq.num_computed_tokens = len(taken) * self.block_manager.block_size
            out.prefix_hits.append((seq, list(taken)))

    # -- helpers --------------------------------------------------------------------------------

    def _chunk(self, seq: Sequence, budget: int, skip: int = 0) -> int:
        """Tokens of seq to run now: all uncomputed ones (less ``skip``, found in the prefix
        cache), or (chunked prefill) what the budget allows; 0 when it has to wait."""
        n = seq.num_uncomputed_tokens - skip
        if n <= budget:
            return n
        return max(budget, 0) if self.config.enable_chunked_prefill else 0

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_arrival_key)

    def _hopeless_reason(self, seq: Sequence) -> str | None:
        """Why seq can never run in this engine, or None."""
        max_len = self.config.max_model_len
        if seq.num_tokens > max_len:
            return f"{seq.num_tokens} tokens exceed max_model_len={max_len}"
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and seq.num_uncomputed_tokens > budget:
            return f"{seq.num_uncomputed_tokens} tokens exceed max_num_batched_tokens={budget}"
        step = seq.num_uncomputed_tokens
        if self.config.enable_chunked_prefill:
            step = min(step, budget)
        need = self.block_manager.peak_blocks(seq.num_tokens, step)
        if need > self.block_manager.num_blocks:
            return (
                f"{seq.num_tokens} tokens need {need} KV blocks but the pool has only "
                f"{self.block_manager.num_blocks} (block_size={self.block_manager.block_size})"
            )
        return None

    def _reject_if_hopeless(self, seq: Sequence) -> bool:
        reason = self._hopeless_reason(seq)
        if reason is None:
            return False
        # A prompt that is too long is an error; a sequence that grew too long simply ends.
        grew_too_long = seq.num_output_tokens and seq.num_tokens > self.config.max_model_len
        finish_reason = "length" if grew_too_long else "abort"
        message = f"request {seq.request_id!r} rejected: {reason}"
        logger.warning(message)
        self.finish(seq, finish_reason)
        self._rejected.append((seq, message))
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take seq off the running queue to free its blocks: swap it out or drop its cache."""
        assert seq.seq_id not in self._in_flight, f"{seq} is preempted while its step runs"
        bm = self.block_manager
        self.running.remove(seq)
        num_blocks = len(seq.block_table)
        mode = self.config.preemption_mode
        if mode == "swap" and bm.can_swap_out(seq):
            out.blocks_to_swap_out.extend(bm.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_arrival_key)
        else:
            if mode == "swap":
                mode = "recompute (no free CPU blocks for swap)"
            bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
        logger.warning(
            "request %r (seq %d) preempted by %s: not enough KV cache blocks; %d blocks released, "
            "%d free, %d running, %d swapped; total preemptions %d",
            seq.request_id,
            seq.seq_id,
            mode,
            num_blocks,
            bm.num_free_blocks,
            len(self.running),
            len(self.swapped),
            self.num_preemptions,
        )

    # -- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Block invariants over every live seq, plus queue/status agreement (AssertionError)."""
        bm = self.block_manager
        bm.check_invariants(self.live_seqs(), self._in_flight, self._releasing)
        for queue, status in (
            (self.running, SequenceStatus.RUNNING),
            (self.waiting, SequenceStatus.WAITING),
            (self.swapped, SequenceStatus.SWAPPED),
        ):
            for seq in queue:
                if seq.status != status:
                    raise AssertionError(f"{seq} is in the {status.name} queue")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs")
        if self.running != sorted(self.running, key=_arrival_key):
            raise AssertionError("running queue is not in arrival order")


def runs_whole(seq: Sequence) -> bool:
    """Whether every prompt row must be computed, none taken from a cache: its prompt logprobs
    are asked, or it is pooled over its rows (mean, cls; last pooling and scores need only the
    last row, which is always computed)."""
    p = seq.params
    pooled = (
        p.pooling is not None and p.pooling.task == "embed" and p.pooling.pooling_type != "last"
    )
    return p.prompt_logprobs is not None or pooled
