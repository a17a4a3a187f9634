"""Step 3 of the engine core's loop: a step's tokens into their sequences. Each sampled token
is appended through the scheduler's accounting, each speculated run's accepted tokens one at a
time; prompt logprobs, logprobs and logits rows wait for the next delta; grammars advance; the
stop checks on ids (EOS, stop token ids, max_tokens, max_model_len, a finished grammar) end
what they end, whose blocks go back at once, and whose state in the features that keep one per
sequence (``owners``: speculation's drafts and back-off, a pooling prompt's pooler) is dropped.
``touched`` collects every sequence with news in the step, for step 4's deltas.
"""

from __future__ import annotations

import numpy as np

from engine import tracing
from engine.core.async_step import InFlight, collect
from engine.core.messages import SampleDelta, deltas
from engine.core.model_runner import RunnerOutput
from engine.core.pooling_runner import PooledOutput
from engine.core.sampler import NO_TOKEN
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.core.spec_step import Accepted, Speculator


class Updater:
    """``requests``: the core's book of live requests (request id -> its sequences), from
    which a request whose every sequence finished is dropped; ``record_logits``: each token's
    logits row goes with its delta; ``owners``: what keeps state per sequence, each told
    ``forget(seq_id)`` when a sequence ends."""

    def __init__(
        self,
        scheduler: Scheduler,
        spec: Speculator,
        requests: dict[str, list[Sequence]],
        eos_token_ids: list[int],
        record_logits: bool,
        owners: tuple = (),
    ):
        self.scheduler, self.spec, self.requests = scheduler, spec, requests
        self.eos_token_ids, self.record_logits = eos_token_ids, record_logits
        self.owners = owners
        self.touched: dict[int, Sequence] = {}  # seq_id -> sequence with news in this step
        self.vectors: dict[int, np.ndarray] = {}  # seq_id -> a pooled prompt's vector

    def deltas(self) -> list[SampleDelta]:
        """A delta for each sequence with news since the last call."""
        touched, self.touched = self.touched, {}
        vectors, self.vectors = self.vectors, {}
        return deltas(touched.values(), vectors)

    def forget(self, seq: Sequence) -> None:
        """seq ended: the state the features kept for it goes."""
        for owner in self.owners:
            owner.forget(seq.seq_id)

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        """The step's tokens into their sequences: prompt logprobs, each sampled token (through
        the scheduler's accounting), each speculated run's accepted tokens; stop checks."""
        for seq, entries in result.prompt_logprobs:
            seq.prompt_logprobs.extend(entries)
        seqs, ids, extras = result.seqs, result.ids, result.extras
        if NO_TOKEN in ids:
            self._abort_unsampled(seqs, ids)
        sampled = {s.seq_id: t for s, t in zip(seqs, ids, strict=True) if t != NO_TOKEN}
        extra = {} if extras is None else {s.seq_id: e for s, e in zip(seqs, extras, strict=True)}
        self._process_tokens(self.scheduler.update(out, sampled), extra)
        if result.accepted:
            self._accept_all(result.accepted)

    def update_pooled(self, out: SchedulerOutput, result: PooledOutput) -> None:
        """A pooling step's prompts: each one whose vector came back ends with it."""
        self.scheduler.update(out, {})
        for seq, vector in result.pooled:
            self.vectors[seq.seq_id] = vector
            self.touched[seq.seq_id] = seq
            self.finish(seq, "stop")

    def _process_tokens(self, grown: list[Sequence], extra: dict) -> None:
        """Stop checks on each sequence's new last token; the stopped ones finish. Its
        logprobs (and logits row) wait for the next delta."""
        touched, record = self.touched, self.record_logits
        for seq in grown:
            if seq.matcher is not None and not self._advance_grammar(seq):
                continue
            touched[seq.seq_id] = seq
            if extra:
                logprob, logits_row = extra.get(seq.seq_id, (None, None))
                if logprob is not None:
                    seq.new_logprobs.append(logprob)
                if record:
                    seq.new_logits.append(np.array(logits_row, dtype=np.float32))
            # most tokens end nothing: the full checks only where one could
            if (
                seq.last_token_id in seq.stop_ids
                or seq.num_tokens >= seq.max_num_tokens
                or seq.matcher is not None
            ):
                reason = seq.check_stop(self.eos_token_ids)
                if reason is not None:
                    self.finish(seq, reason)

    def _advance_grammar(self, seq: Sequence) -> bool:
        """Feed seq's new token to its grammar; a token it refuses (or a matcher error) ends
        the sequence as an error, never as unconstrained text."""
        if seq.matcher.accept(seq.last_token_id):
            return True
        why = seq.matcher.error or f"token {seq.last_token_id} is not allowed by the grammar"
        self._fail(seq, f"structured output: {why}")
        return False

    def _abort_unsampled(self, seqs, ids) -> None:
        """Sequences whose row had no token to pick (NaN or all banned) end as an error."""
        for seq, t in zip(seqs, ids, strict=True):
            if t == NO_TOKEN:
                self._fail(seq, "sampling failed: no finite logit to pick a token from")

    def _fail(self, seq: Sequence, why: str) -> None:
        seq.error = why
        self.touched[seq.seq_id] = seq
        self.finish(seq, "abort")  # its blocks go back now

    def _accept_all(self, accepted: list[Accepted]) -> None:
        """Each speculated sequence's verified tokens, one by one: it stops at the first token
        that ends it (EOS, a stop id or string, max_tokens); the rest are dropped."""
        self.spec.record(accepted)
        for a in accepted:
            seq = a.seq
            for token, logprob in a.tokens:
                if seq.is_finished:
                    break
                if token == NO_TOKEN:
                    self._abort_unsampled([seq], [NO_TOKEN])
                    break
                self.scheduler.accept(seq, token)
                self._process_tokens([seq], {seq.seq_id: (logprob, None)})
            self.scheduler.end_speculation(seq)

    def process_flight(self, flight: InFlight) -> None:
        """Async scheduling: the launched step's ids read back and processed."""
        grown, failed = collect(flight)
        if failed:
            self._abort_unsampled(failed, [NO_TOKEN] * len(failed))
        self._process_tokens(grown, {})

    def rejected(self, rejected: list[tuple[Sequence, str]]) -> None:
        """Sequences the scheduler finished because they can never run; an abort keeps why."""
        for seq, reason in rejected:
            if seq.request_id not in self.requests:
                continue
            if seq.finish_reason == "abort":
                seq.error = reason
            self.forget(seq)
            self.touched[seq.seq_id] = seq
            self._forget_if_done(seq.request_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)  # its blocks go back to the free queue now
        self.forget(seq)
        free = self.scheduler.block_manager.num_free_blocks
        tracing.finished(seq.request_id, reason, seq.num_output_tokens, free)
        self._forget_if_done(seq.request_id)

    def _forget_if_done(self, request_id: str) -> None:
        """A request whose every sequence has finished is no longer the core's."""
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]
