"""Speculative decoding's part of a step, around the engine core's loop.

Before the schedule, ``Speculator.propose`` gives each running decode its drafts
(``Speculator.drafts``, by seq id: n-gram prompt lookup or a draft model), which the scheduler
takes (``Scheduler.schedule(drafts)``). It runs each speculated sequence's last token and drafts
as one run of rows; the model runner verifies them (``verify``: greedy acceptance, or rejection
sampling against the distribution the sampler would draw from) and returns each run's tokens as
an ``Accepted``. The core appends them one at a time through its stop checks, and
``Speculator.record`` counts them and backs a sequence off after a wholly rejected draft (its
back-off kept in the speculator, by seq id, until the sequence ends: ``forget``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from engine.core.sampler import plain_greedy, sampling_probs
from engine.core.sequence import Sequence
from engine.core.spec_decode import (
    DraftModel,
    SpecStats,
    accept_greedy,
    accept_sampled,
    propose_ngram,
)
from model_loader.load import LoadedModel, load_model

log = logging.getLogger("engine")
MAX_SPEC_BACKOFF = 16  # steps without drafts at most, after repeated rejections


@dataclass
class Accepted:
    """A speculated run's verified tokens: its accepted drafts and one more, each with its
    logprobs (None where none were asked)."""

    seq: Sequence
    num_drafts: int
    tokens: list[tuple[int, dict[int, float] | None]]


class DraftPrefix:
    """A sequence as it would be after the first drafts: what the sampler's penalties and
    min_tokens ban read for one row of a speculated run."""

    def __init__(self, seq: Sequence, drafts: list[int]):
        self.params = seq.params
        self.prompt_token_ids = seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + drafts
        self.num_output_tokens = len(self.output_token_ids)
        self.bad_words_ids = seq.bad_words_ids
        assert seq.matcher is None, "structured-output requests do not speculate"
        self.matcher = None
        self.always_plain = False


def backoff(state: tuple[int, int] | None, num_accepted: int) -> tuple[int, int] | None:
    """A sequence's (wait, backoff) after a verified draft (None: (0, 1), the state of one
    that never failed). After a wholly rejected draft it decodes plainly for ``backoff`` steps,
    the wait doubling (up to MAX_SPEC_BACKOFF) while its drafts keep failing; an accepted draft
    token resets it. Prompt lookup on text that does not repeat costs a verify row per step."""
    if num_accepted:
        return None  # (its wait is 0: it drafted)
    _, wait = state or (0, 1)
    return wait, min(2 * wait, MAX_SPEC_BACKOFF)


def spec_counters(stats: SpecStats) -> list:
    """SpecStats as [drafts, draft tokens, accepted tokens, accepted by draft position]."""
    return [
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.accepted_per_pos,
    ]


def check_draft(draft: LoadedModel, target: LoadedModel, max_model_len: int) -> None:
    """A ValueError naming what makes ``draft`` unfit to propose for ``target``."""
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise ValueError(f"speculative_config: the draft's vocab_size {dv} != the target's {tv}")
    dt, tt = draft.tokenizer.backend.get_vocab(), target.tokenizer.backend.get_vocab()
    if dt != tt:
        differ = len(set(dt.items()) ^ set(tt.items()))
        raise ValueError(
            f"speculative_config: the draft model's tokenizer is not the target's "
            f"({differ} token <-> id pairs differ)"
        )
    dmax = draft.config.max_position_embeddings
    if dmax < max_model_len:
        raise ValueError(
            f"speculative_config: the draft model's max_position_embeddings {dmax} < "
            f"max_model_len {max_model_len}; lower max_model_len"
        )


def draft_backend(config, target: LoadedModel, draft: LoadedModel | None, backend_factory):
    """The draft model's backend (method draft_model; ``draft``, else loaded from the config),
    checked against the target: the same vocabulary, room for max_model_len tokens; else None."""
    sc = config.speculative
    if sc is None or sc.method != "draft_model":
        return None
    draft = draft or load_model(sc.model)
    check_draft(draft, target, config.max_model_len)
    log.info("draft model %s: %s", draft.source, draft.config.summary())
    return backend_factory(draft.config, draft.weights, config)


class Speculator:
    """Drafts for the running decodes, and the counters of what verification accepted.
    ``config``: the engine's (``speculative`` None: nothing is proposed); ``draft``: the draft
    model's backend (``draft_backend``), given a pool of ``num_draft_blocks``, or None for
    prompt lookup. Its state per sequence, by seq id, dropped by ``forget`` when the sequence
    ends: ``drafts`` (the drafts proposed for its next step, taken by the scheduler) and its
    back-off after rejected drafts."""

    def __init__(self, config, draft=None, num_draft_blocks: int = 0):
        self.config = config.speculative
        self.drafts: dict[int, list[int]] = {}  # seq_id -> drafts for the next step (not [])
        self.backoffs: dict[int, tuple[int, int]] = {}  # seq_id -> (steps to wait, next wait)
        self.drafter = None
        if draft is not None:
            draft.allocate_kv_cache(num_draft_blocks)
            bs, budget = config.block_size, config.max_num_batched_tokens
            self.drafter = DraftModel(draft, num_draft_blocks, bs, budget)
        self.stats = SpecStats(config.speculative)
        if config.speculative is not None:
            log.info("speculative decoding: %s", config.speculative)
            if config.async_scheduling:
                log.info("async scheduling overlaps no step while speculative decoding is on")

    def propose(self, running: list[Sequence]) -> None:
        """Drafts (``drafts``) for each running decode (greedy or sampled), cut so that no step
        can pass max_tokens or max_model_len (``seq.max_num_tokens``); none above
        disable_by_batch_size."""
        sc = self.config
        if sc.disable_by_batch_size is not None and len(running) > sc.disable_by_batch_size:
            return
        seqs, rooms, backoffs = [], [], self.backoffs
        for seq in running:
            self.drafts.pop(seq.seq_id, None)  # none left from a step that preempted it
            room = min(sc.num_speculative_tokens, seq.max_num_tokens - seq.num_tokens - 1)
            if room < 1 or seq.num_uncomputed_tokens != 1 or seq.matcher is not None:
                continue  # (a structured-output request decodes plainly)
            wait, next_wait = backoffs.get(seq.seq_id, (0, 1))
            if wait:  # its last drafts were all rejected: plain decodes for a while
                backoffs[seq.seq_id] = (wait - 1, next_wait)
                continue
            seqs.append(seq)
            rooms.append(room)
        if self.drafter is not None:
            drafts = self.drafter.propose(seqs, rooms) if seqs else []
        else:
            n_min, n_max = sc.prompt_lookup_min, sc.prompt_lookup_max
            pairs = zip(seqs, rooms, strict=True)
            drafts = [propose_ngram(s.token_ids, r, n_min, n_max) for s, r in pairs]
        for seq, d in zip(seqs, drafts, strict=True):
            if d:
                self.drafts[seq.seq_id] = d

    def record(self, accepted: list[Accepted]) -> None:
        """Count each verified run; back off the sequences whose drafts all failed."""
        for a in accepted:
            state = backoff(self.backoffs.pop(a.seq.seq_id, None), len(a.tokens) - 1)
            if state is not None:
                self.backoffs[a.seq.seq_id] = state
            self.stats.record(a.num_drafts, len(a.tokens) - 1)

    def forget(self, seq_id: int) -> None:
        """A sequence ended: its drafts and back-off go."""
        self.drafts.pop(seq_id, None)
        self.backoffs.pop(seq_id, None)

    def release(self, running: list[Sequence]) -> None:
        """The draft model's blocks of sequences no longer running go back."""
        if self.drafter is not None:
            self.drafter.release_except(seq.seq_id for seq in running)

    def check_invariants(self) -> None:
        if self.drafter is not None:
            self.drafter.check_invariants()


def verify(runs, logits: np.ndarray | None, ids: list[int], sampler) -> list[Accepted]:
    """Each speculated run's tokens. runs: (seq, first row, rows, drafts); ids: each row's
    argmax; logits (R, V), or None when every row is plain greedy (the argmax is all there is).
    A sampled (or penalised) run is verified by rejection sampling, the others greedily."""
    sampled = {} if logits is None else _verify_sampled(runs, logits, sampler)
    accepted = []
    for seq, r, n, drafts in runs:
        tokens = sampled.get(seq.seq_id) or accept_greedy(drafts, ids[r : r + n])
        lps = [None] * len(tokens)
        if seq.params.logprobs is not None:  # each token's from the row that chose it
            rows = logits[r : r + len(tokens)]
            lps = sampler.logprobs(rows, [seq] * len(tokens), np.array(tokens))
        accepted.append(Accepted(seq, len(drafts), list(zip(tokens, lps, strict=True))))
    return accepted


def _verify_sampled(runs, logits: np.ndarray, sampler) -> dict:
    """seq_id -> tokens, by rejection sampling, for every run that is not plain greedy; the
    sampler's processing and the distributions of all their rows are made in one call each."""
    runs = [run for run in runs if not plain_greedy(run[0])]
    if not runs:
        return {}
    rows = [r + j for _, r, n, _ in runs for j in range(n)]
    views = [DraftPrefix(seq, d[:j]) for seq, _, n, d in runs for j in range(n)]
    probs = target_probs(sampler, logits[rows], views)  # (rows, V)
    tokens, a = {}, 0
    for seq, _, n, drafts in runs:
        tokens[seq.seq_id] = accept_sampled(probs[a : a + n], drafts, seq.generator)
        a += n
    return tokens


def target_probs(sampler, rows: np.ndarray, views: list[DraftPrefix]) -> np.ndarray:
    """(N, V) the distribution each view's next token has at its row, as the sampler would
    make it, the view's drafts counted as output (penalties, min_tokens); greedy rows
    one-hot at their argmax; a row with nothing to pick NaN."""
    x = sampler.process(rows, views)  # (N, V)
    greedy = np.array([v.params.greedy for v in views])  # (N,)
    probs = np.zeros_like(x)
    if not greedy.all():
        probs[~greedy] = sampling_probs(
            x[~greedy], [v.params for v in views if not v.params.greedy]
        )
    g = np.flatnonzero(greedy)
    best = np.argmax(x[g], axis=1)  # (G,)
    probs[g, best] = 1.0
    picked = x[g, best]
    probs[g[np.isnan(picked) | np.isneginf(picked)]] = np.nan
    return probs
