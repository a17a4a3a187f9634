"""The runner of a pooling engine (``runner="pooling"``, chosen at start): every step is
prefills, whose rows' final-normed hidden states (``Backend.hidden_states``, no LM head) each
sequence's ``Pooler`` adds up (the last row, the first, or a float64 sum); a prompt whose last
chunk ran comes back with its vector, or, for a score or a class, its last row through a head
(the LM head's yes/no log-odds, or a classifier's score head) and the activation. Nothing is
sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.core.model_runner import ModelRunner
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence
from engine.pooling_params import Pooler, classifier_activation


@dataclass
class PooledOutput:
    """One pooling step's finished prompts: (seq, its vector) each."""

    pooled: list[tuple[Sequence, np.ndarray]] = field(default_factory=list)


class PoolingRunner(ModelRunner):
    """A ModelRunner that pools instead of sampling; ``classifier``: a sequence classifier's
    (L, D) float64 score head, or None. Each prompt's pooling so far is kept here by seq id
    until its last chunk runs (``forget`` drops it when the sequence ends before that)."""

    def __init__(self, *args, classifier: np.ndarray | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.poolers: dict[int, Pooler] = {}  # seq_id -> its prompt's pooling so far
        self.classifier = classifier  # (L, D) float64
        self.problem_type = self.model_config.problem_type

    def execute(self, output: SchedulerOutput) -> PooledOutput:
        """A pooling step: every row's hidden states, each sequence's chunk added to its pooler
        (engine/pooling_params.py); a sequence whose prompt is done comes back with its vector."""
        if output.is_empty:
            return PooledOutput()
        self._move_blocks(output)
        batch = self.prepare(output)
        hidden = self.backend.hidden_states(batch)  # (T, D)
        qsl, pooled, scored = batch.query_start_loc, [], []
        for b, (seq, n) in enumerate(output.scheduled):
            pooler = self.poolers.get(seq.seq_id)
            if pooler is None:
                pooler = self.poolers[seq.seq_id] = Pooler(seq.params.pooling)
            start = seq.num_computed_tokens
            pooler.add(hidden[qsl[b] : qsl[b + 1]], first=start == 0)
            if start + n != seq.num_tokens:
                continue
            del self.poolers[seq.seq_id]  # its prompt is done
            if seq.params.pooling.task != "embed":
                scored.append((seq, qsl[b + 1] - 1))
            else:
                pooled.append((seq, pooler.result(seq.num_tokens)))
        if scored:  # the last row of each done prompt: a head's logits
            last = hidden[[r for _, r in scored]]  # (S, D)
            for (seq, _), v in zip(scored, self._head(last, scored), strict=True):
                pooled.append((seq, v))
        return PooledOutput(pooled)

    def _head(self, last: np.ndarray, scored: list) -> list[np.ndarray]:
        """Each scored prompt's (S, D) last row through its head: the LM head's yes/no log-odds
        (a reranker by tokens), else the classifier's (L,) logits; activated unless asked not."""
        lm_rows = [i for i, (seq, _) in enumerate(scored) if seq.params.pooling.score_tokens]
        lm = {}  # row -> its (V,) LM head logits
        if lm_rows:
            lm = dict(zip(lm_rows, self.backend.head_logits(last[lm_rows]), strict=True))
        out = []
        for i, (seq, _) in enumerate(scored):
            p = seq.params.pooling
            if p.score_tokens is not None:
                yes, no = p.score_tokens
                logits = np.array([float(lm[i][yes]) - float(lm[i][no])])  # (1,) log-odds
            else:
                logits = self.classifier @ last[i].astype(np.float64)  # (L,)
            out.append(classifier_activation(logits, self.problem_type) if p.activation else logits)
        return out

    def forget(self, seq_id: int) -> None:
        """A sequence ended: its pooling so far (a prompt aborted between chunks) goes."""
        self.poolers.pop(seq_id, None)
