"""Next-token sampling on the host, vectorised over the batch.

Order of operations for one row of logits (V,):
  1. penalties: repetition (tokens in prompt or output: divide a positive logit, multiply a
     negative one), frequency (minus ``f * count`` in the output), presence (minus ``p`` once);
  2. logit_bias added; then bans: tokens outside allowed_token_ids, the last token of a bad word
     whose other tokens end the output, tokens the request's grammar does not allow next
     (structured output), and EOS and stop_token_ids until the sequence has ``min_tokens``
     outputs;
  3. greedy rows (temperature 0): argmax, done;
  4. otherwise probs = softmax(logits / temperature), then min_p (drop p < min_p * max p), top_k
     (keep the k most likely), top_p (keep the smallest most-likely set whose mass reaches top_p,
     measured after the earlier filters and renormalised), renormalise;
  5. draw by inverse CDF with ONE uniform from the sequence's own ``numpy.random.Generator``, so a
     seeded sequence draws the same numbers whatever else shares the batch.
Guards: the most likely token always survives the filters, and a row with nothing to pick (all
banned, or NaN from the model) gets ``NO_TOKEN`` instead of a token: the engine aborts that
sequence with an error rather than emit token 0.
Logprobs (top-N per token, plus the chosen token) are the model's raw log-softmax, as in vLLM.
"""

from __future__ import annotations

import numpy as np

from engine.sampling_params import SamplingParams

NO_TOKEN = -1  # the id of a row that had no token to pick
F32_MAX = np.finfo(np.float32).max


def log_softmax(x: np.ndarray) -> np.ndarray:
    # x: (..., V) -> (..., V) float32
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def apply_penalties(row: np.ndarray, p: SamplingParams, prompt_ids, output_ids) -> None:
    """Penalties in place on one row (V,) of logits."""
    v = row.shape[0]
    counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=v)[:v]  # (V,)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[np.asarray(prompt_ids, dtype=np.int64)] = True  # (V,) bool
        rp = np.float32(p.repetition_penalty)
        row[seen] = np.where(row[seen] > 0, row[seen] / rp, row[seen] * rp)
    if p.frequency_penalty:
        row -= np.float32(p.frequency_penalty) * counts
    if p.presence_penalty:
        row -= np.float32(p.presence_penalty) * (counts > 0)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def edits_logits(seq) -> bool:
    """Whether steps 1-2 change this sequence's row (a penalty, a bias, a ban, a grammar, or
    min_tokens still due)."""
    p = seq.params
    return _has_penalty(p) or p.restricts_tokens or seq.num_output_tokens < p.min_tokens


def bad_word_bans(output_ids: list[int], bad_words_ids: list[list[int]]) -> list[int]:
    """The tokens that would complete a bad word now: its last token, where the output ends
    with the word's other tokens (a one-token word is always banned)."""
    bans = []
    for word in bad_words_ids:
        head = word[:-1]
        if not head or output_ids[-len(head) :] == head:
            bans.append(word[-1])
    return bans


def always_plain_greedy(p: SamplingParams) -> bool:
    """Whether every row of a request is plain greedy, whatever its state: greedy, no
    penalty, no restriction, no min_tokens, no logprobs of any kind."""
    plain = p.greedy and p.logprobs is None and p.prompt_logprobs is None and not p.min_tokens
    return plain and not _has_penalty(p) and not p.restricts_tokens


def plain_greedy(seq) -> bool:
    """Whether seq's row is an argmax of the raw logits: greedy, no penalty, no min_tokens ban
    still due, no logprobs of its tokens or of the prompt it is running (the backend can take
    the argmax and send back only the id)."""
    if seq.always_plain:
        return True
    p = seq.params
    prompt_rows = p.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens
    return p.greedy and p.logprobs is None and not prompt_rows and not edits_logits(seq)


def rows_to_sample(scheduled) -> tuple[list[int], list]:
    """Batch rows (and their sequences) of the scheduled (seq, num_new_tokens) pairs whose last
    token runs this step: those get a token; a prefill chunk that ends before the prompt does
    gets none."""
    rows, seqs = [], []
    for b, (seq, n) in enumerate(scheduled):
        if seq.num_computed_tokens + n == seq.num_tokens:
            rows.append(b)
            seqs.append(seq)
    return rows, seqs


def filter_probs(probs: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """min_p, top_k, top_p in place on probs (R, V), then renormalised rows."""
    min_p = np.array([p.min_p for p in params], dtype=np.float32)  # (R,)
    if min_p.any():
        probs[probs < (min_p * probs.max(axis=1))[:, None]] = 0.0
    for r, p in enumerate(params):
        if p.top_k > 0 and p.top_k < probs.shape[1]:
            kth = np.partition(probs[r], -p.top_k)[-p.top_k]
            probs[r, probs[r] < kth] = 0.0
    top_p_rows = [r for r, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        sub = probs[top_p_rows]  # (R', V)
        sub /= sub.sum(axis=1, keepdims=True)
        order = np.argsort(-sub, axis=1, kind="stable")  # (R', V) most likely first
        sorted_p = np.take_along_axis(sub, order, axis=1)  # (R', V)
        mass_before = np.cumsum(sorted_p, axis=1) - sorted_p  # (R', V)
        top_p = np.array([params[r].top_p for r in top_p_rows], dtype=np.float32)[:, None]
        drop_sorted = mass_before >= top_p  # (R', V)
        drop_sorted[:, 0] = False  # the most likely token stays, whatever top_p rounds to
        drop = np.empty_like(mass_before, dtype=bool)  # (R', V) back in vocab order
        np.put_along_axis(drop, order, drop_sorted, axis=1)
        sub[drop] = 0.0
        probs[top_p_rows] = sub
    probs /= probs.sum(axis=1, keepdims=True)
    return probs


def sampling_probs(logits: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """(R, V) processed logits of non-greedy rows -> (R, V) the distribution each row draws from."""
    with np.errstate(invalid="ignore", over="ignore"):
        temps = np.array([p.temperature for p in params], dtype=np.float32)[:, None]  # (R, 1)
        x = np.where(np.isneginf(logits), -np.inf, logits / temps)  # banned stays banned
        np.minimum(x, F32_MAX, out=x)  # +inf (a huge penalty quotient) -> the largest float
        x -= x.max(axis=1, keepdims=True)  # a row of only -inf or NaN becomes NaN
    probs = np.exp(x)
    with np.errstate(invalid="ignore"):
        probs /= probs.sum(axis=1, keepdims=True)
        return filter_probs(probs, params)


def draw(probs: np.ndarray, generators: list[np.random.Generator]) -> np.ndarray:
    """Inverse CDF: one uniform per row from that row's generator. probs (R, V) -> (R,) ids."""
    cdf = np.cumsum(probs, axis=1)  # (R, V)
    u = np.array([g.random() for g in generators])[:, None] * cdf[:, -1:]  # (R, 1)
    ids = (cdf <= u).sum(axis=1)  # first index whose cdf exceeds u
    return np.minimum(ids, probs.shape[1] - 1)


class Sampler:
    """Picks one token per row; ``sample`` returns (token ids, logprobs dicts or None).
    ``structured``: a function that makes the engine's StructuredOutputCompiler, called when
    the first request needs it (``structured_compiler``)."""

    def __init__(self, eos_token_ids=(), structured=None):
        self.eos_token_ids = list(eos_token_ids)
        self._make_compiler = structured
        self._compiler = None

    def structured_compiler(self):
        """The structured-output compiler, built on first use."""
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    def process(self, logits: np.ndarray, seqs) -> np.ndarray:
        """Steps 1-2: penalties, bias and bans on a copy of logits (B, V); logits itself when no
        row needs any (the caller only reads the result)."""
        if not any(edits_logits(s) for s in seqs):
            return np.asarray(logits, dtype=np.float32)  # nothing to change: no (B, V) copy
        x = np.array(logits, dtype=np.float32)  # (B, V) copy
        v = x.shape[1]
        for b, seq in enumerate(seqs):
            p = seq.params
            if _has_penalty(p):
                with np.errstate(over="ignore"):  # an overflow is +inf, clipped when sampling
                    apply_penalties(x[b], p, seq.prompt_token_ids, seq.output_token_ids)
            if p.logit_bias:
                ids = np.fromiter(p.logit_bias, np.int64)
                x[b, ids] += np.fromiter(p.logit_bias.values(), np.float32)
            if p.allowed_token_ids:
                keep = np.zeros(v, dtype=bool)
                keep[p.allowed_token_ids] = True
                x[b, ~keep] = -np.inf
            if seq.bad_words_ids:
                x[b, bad_word_bans(seq.output_token_ids, seq.bad_words_ids)] = -np.inf
            if seq.num_output_tokens < p.min_tokens:
                banned = [t for t in [*self.eos_token_ids, *p.stop_token_ids] if t < v]
                x[b, banned] = -np.inf
        self._apply_grammars(x, seqs)
        return x

    def _apply_grammars(self, x: np.ndarray, seqs) -> None:
        """Tokens that structured-output rows' grammars do not allow next -> -inf, the masks of
        every such row filled in one call (llguidance's threads)."""
        # a grammar waiting for a reasoning model's thinking to end masks nothing yet
        rows = [b for b, s in enumerate(seqs) if s.matcher is not None and s.matcher.active]
        if not rows:
            return
        from engine.core.structured import allocate_bitmask, apply_bitmask

        mask = allocate_bitmask(len(rows), x.shape[1])  # (R, W) int32
        self._compiler.fill_bitmasks([seqs[b].matcher for b in rows], mask)
        apply_bitmask(x, mask, np.asarray(rows))

    def sample(self, logits: np.ndarray, seqs, generators):
        """logits (B, V) for seqs[b] (with ``params``, prompt and output ids) -> ((B,) ids, list
        of {token_id: logprob} or None per row)."""
        x = self.process(logits, seqs)
        ids = np.argmax(x, axis=1)  # (B,) greedy for every row; random rows overwrite below
        picked = x[np.arange(len(ids)), ids]  # (B,) the argmax's logit
        ids[np.isnan(picked) | np.isneginf(picked)] = NO_TOKEN  # NaN, or everything banned
        rand = [b for b, s in enumerate(seqs) if not s.params.greedy]
        if rand:
            probs = sampling_probs(x[rand], [seqs[b].params for b in rand])  # (R, V)
            drawn = draw(np.nan_to_num(probs), [generators[b] for b in rand])  # (R,)
            ok = np.isfinite(probs).all(axis=1)  # (R,) a NaN row has nothing to draw from
            ids[rand] = np.where(ok, drawn, NO_TOKEN)
        return ids.tolist(), self.logprobs(logits, seqs, ids)

    @staticmethod
    def logprobs(logits: np.ndarray, seqs, ids: np.ndarray):
        """Per row: {token: logprob} of the top ``params.logprobs`` tokens and the chosen one
        (the raw log-softmax), or None where no logprobs were asked or nothing was chosen."""
        out = []
        for b, seq in enumerate(seqs):
            n = seq.params.logprobs
            if n is None or ids[b] == NO_TOKEN:
                out.append(None)
                continue
            out.append(top_logprobs(logits[b], int(ids[b]), n))
        return out


def top_logprobs(row: np.ndarray, token: int, n: int) -> dict[int, float]:
    """{token: logprob} of the n most likely tokens of one row (V,) of raw logits, most likely
    first, and of ``token`` (the raw log-softmax)."""
    lp = log_softmax(row.astype(np.float32))  # (V,)
    top = np.argpartition(-lp, min(n, lp.shape[0] - 1))[:n]
    top = top[np.argsort(-lp[top], kind="stable")]
    entry = {int(t): float(lp[t]) for t in top}
    entry[token] = float(lp[token])
    return entry
