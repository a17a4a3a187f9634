"""The frontend's per-request state: detokenizing, stop strings, and the ``RequestOutput``s.

The engine core (engine/core/engine_core.py) sends each step's news as ``SampleDelta``s: new token
ids, and how a sample ended when the core ended it (EOS, a stop token id, the length limits, an
error). ``process`` appends the ids, looks for stop strings in their text (a sample one ends, whose
core sequence still runs, is handed back for the core to finish), and ``outputs()`` builds one
``RequestOutput`` per request touched, or with ``stream=False`` per request finished, and forgets
the finished ones.

Text is detokenized when it is read: every token at once for a sample with stop strings (they are
looked for in the text added, by ``str.find`` for a few, an automaton for more:
engine/frontend/stop_strings.py), otherwise when an output is built. Either way the detokenizer
sees the same ids in the same order, so the text and the streamed deltas are the same; a caller
that does not stream pays for detokenizing once per request, not once per step.

A "plain" request (one sample, no stop strings, no logprobs of either kind, no logits rows) takes
short paths while it runs, the common case of a streaming step: ``_take_plain`` appends a delta
of one token and its latency, ``RequestState.plain_output`` builds its output directly (the same
output ``output`` builds: with nothing held back, the new text is the delta).
"""

from __future__ import annotations

import time

import numpy as np

from engine import tracing
from engine.core.messages import SampleDelta
from engine.frontend.stop_strings import StopStrings
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from model_loader.tokenizer import IncrementalDetokenizer

FEW_STOPS = 8  # up to this many stop strings, str.find each; more: one automaton for them all


class SampleState:
    """One of a request's n samples: its tokens, its text and what was streamed."""

    __slots__ = (
        *("index", "token_ids", "finish_reason", "detok", "text", "detokenized", "emitted"),
        *("logprobs", "step_logits", "error", "truncated", "stop_reason", "stops", "stop_node"),
        "stop_hit",
    )

    def __init__(self, index, detok, stops: StopStrings | None = None):
        self.index = index  # CompletionOutput.index
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.detok: IncrementalDetokenizer = detok
        self.text = ""  # of the first ``detokenized`` output ids (``sync_text`` catches up)
        self.detokenized = 0
        self.emitted = 0  # characters of text already streamed
        self.logprobs: list[dict[int, float]] = []
        self.step_logits: list[np.ndarray] = []  # (V,) float32 per token, with record_logits
        self.error: str | None = None
        self.truncated = False  # text cut at a stop string
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.stops = stops  # the request's automaton, with more than FEW_STOPS stop strings
        self.stop_node = 0  # where this sample's text has taken it
        self.stop_hit: tuple[int, int] | None = None  # (start, stop index) in the text last added

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def sync_text(self) -> None:
        """Detokenize the output ids not yet in text."""
        ids, done = self.token_ids, self.detokenized
        if done == len(ids) - 1:  # a decode step's one new id: the common case
            self.text += self.detok.add(ids[done])
            self.detokenized = len(ids)
        elif done < len(ids):
            self.text += "".join(map(self.detok.add, ids[done:]))
            self.detokenized = len(ids)

    def scan_stops(self, before: int) -> None:
        """Run the automaton over the text added since ``before`` (a no-op without one)."""
        if self.stops is not None:
            self.stop_node, self.stop_hit = self.stops.scan(self.stop_node, self.text, before)

    def flush_text(self) -> None:
        """The sample ended: every id into text, then what the detokenizer still holds back."""
        if self.truncated:  # cut at a stop string: every id is in, nothing more to add
            return
        ids = self.token_ids
        self.text += self.detok.add_last(ids[self.detokenized :])
        self.detokenized = len(ids)

    def completion(self, want_logprobs: bool, hold_back: int, record_logits: bool):
        """The CompletionOutput so far (a snapshot of the lists: they only grow), with the text
        that is new since the previous one."""
        self.sync_text()
        # while running, hold back a possible stop-string prefix so no emitted text is retracted
        text, emitted = self.text, self.emitted
        ready = len(text) if self.finish_reason is not None else max(len(text) - hold_back, 0)
        if ready > emitted:
            delta, self.emitted = text[emitted:ready], ready
        else:
            delta = ""
        lists = (
            self.token_ids,
            self.logprobs if want_logprobs else None,
            self.step_logits if record_logits else None,
            len(self.token_ids),
        )
        return CompletionOutput.snapshot(
            self.index, text, delta, self.finish_reason, self.stop_reason, self.error, lists
        )


class RequestTimes:
    """A request's moments on ``time.monotonic()``'s clock; reported on the wall clock."""

    __slots__ = ("arrival", "wall_offset", "first_token", "last_token", "finish", "itl")

    def __init__(self, arrival: float, wall_offset: float):
        self.arrival = arrival
        self.wall_offset = wall_offset  # time.time() - time.monotonic(), fixed per engine
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finish: float | None = None
        self.itl: list[float] = []

    def moments(self) -> tuple:
        """What ``RequestMetrics.from_moments`` reads, as things stand (O(1): itl only grows)."""
        itl = self.itl
        return (self.arrival, self.first_token, self.finish, itl, len(itl), self.wall_offset)


class RequestState:
    """One request: its samples, prompt and latency metrics."""

    __slots__ = (
        *("request_id", "plain", "final_only", "core_id", "prompt", "prompt_ids", "params"),
        *("samples", "times", "hold_back", "num_cached_tokens", "prompt_logprobs", "embedding"),
    )

    def __init__(
        self,
        request_id,
        prompt,
        prompt_ids,
        params,
        samples,
        times,
        core_id=None,
        final_only=False,
        plain=False,
    ):
        self.request_id = request_id
        # one sample that needs only its tokens and text (no stop strings, logprobs or logits
        # rows): its running steps take the short paths (``OutputProcessor._take_plain``,
        # ``plain_output``)
        self.plain = plain
        self.final_only = final_only  # no output until it finishes (its caller reads that alone)
        self.core_id = request_id if core_id is None else core_id  # its id in the core
        self.prompt: str | None = prompt
        self.prompt_ids: list[int] = list(prompt_ids)  # its own: outputs share it, unchanged
        self.params: SamplingParams = params
        self.samples: list[SampleState] = samples
        self.times = times
        self.hold_back = _hold_back(params)
        self.num_cached_tokens: int | None = None  # the first sample's
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # once complete
        self.embedding: list[float] | None = None  # the pooling runner's vector

    @property
    def finished(self) -> bool:
        samples = self.samples
        if len(samples) == 1:
            return samples[0].finish_reason is not None
        return all(s.finished for s in samples)

    def on_token_time(self, token: int, now: float) -> bool:
        """Latency metrics follow the first sample: time to first token, then inter-token gaps.
        True for the request's first token."""
        times, first = self.times, self.times.first_token is None
        if first:
            times.first_token = now
            tracing.first_token(self.request_id, token, 1e3 * (now - times.arrival))
        else:
            times.itl.append(now - times.last_token)
        times.last_token = now
        return first

    def plain_output(self) -> RequestOutput:
        """``output`` for a plain request that runs: the same output, built directly."""
        sample, times = self.samples[0], self.times
        ids, done = sample.token_ids, sample.detokenized
        n, add = len(ids), sample.detok.add
        delta = add(ids[done]) if done == n - 1 else "".join(map(add, ids[done:]))
        sample.detokenized, text = n, sample.text
        if delta:  # no stop strings: nothing is held back, the new text is the delta
            text = sample.text = text + delta
            sample.emitted = len(text)
        itl = times.itl
        moments = (times.arrival, times.first_token, None, itl, len(itl), times.wall_offset)
        comp = CompletionOutput.snapshot(0, text, delta, None, None, None, (ids, None, None, n))
        extras = (self.num_cached_tokens, self.prompt_logprobs, self.embedding)
        return RequestOutput.snapshot(
            self.request_id, self.prompt, self.prompt_ids, [comp], False, moments, extras
        )

    def output(self, record_logits: bool, finished: bool) -> RequestOutput:
        want_logprobs, hold_back = self.params.logprobs is not None, self.hold_back
        outs = [s.completion(want_logprobs, hold_back, record_logits) for s in self.samples]
        extras = (self.num_cached_tokens, self.prompt_logprobs, self.embedding)
        moments = self.times.moments()
        return RequestOutput.snapshot(
            self.request_id, self.prompt, self.prompt_ids, outs, finished, moments, extras
        )


def _hold_back(params: SamplingParams) -> int:
    """Characters a running sample keeps back from its stream: a possible stop-string prefix,
    which may still be cut from the text (none when stop strings stay in the output)."""
    if params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in params.stop), default=1) - 1


def _first_stop(text: str, stops: list[str], before: int) -> tuple[int, str] | None:
    """Where the earliest stop string in text starts, and which one, among matches that end past
    ``before`` (the text checked at earlier tokens); None if none. The list order does not
    matter (at equal starts the first listed wins)."""
    hits = [(text.find(s, max(before - len(s) + 1, 0)), s) for s in stops]
    return min(((at, s) for at, s in hits if at >= 0), key=lambda h: h[0], default=None)


def _stop_hit(sample: SampleState, stops: list[str], before: int) -> tuple[int, str] | None:
    """The earliest stop string in the text added since ``before``: (where it starts, which)."""
    if len(stops) <= FEW_STOPS:
        return _first_stop(sample.text, stops, before)
    if sample.stop_hit is None:
        return None
    at, index = sample.stop_hit
    return at, stops[index]


def _is_plain(params: SamplingParams, record_logits: bool) -> bool:
    """Whether a request's steps can take the short paths: one sample, no stop strings (no
    text held back), no logprobs of either kind, no logits rows."""
    return (
        params.n == 1
        and not params.stop
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not record_logits
    )


class OutputProcessor:
    """Every live request's state; turns the core's token-id deltas into text, stop-string
    decisions and outputs."""

    def __init__(self, tokenizer, record_logits: bool = False):
        self.tokenizer = tokenizer
        getattr(tokenizer, "byte_tables", None)  # built now (once per tokenizer), not per request
        self.record_logits = record_logits
        self.wall_offset = time.time() - time.monotonic()  # reported times are wall clock
        self.requests: dict[str, RequestState] = {}
        self.by_core_id: dict[str, RequestState] = {}  # the same requests, by their core ids
        self._touched: dict[str, RequestState] = {}  # requests with news in this step
        self._ended: dict[str, RequestState] = {}  # requests with a sample that ended in it
        # output tokens taken, and prompt tokens of the requests whose first token came, since
        # the last ``take_counts``: the throughput counters, whether or not outputs are built
        self.new_tokens = self.new_prompt_tokens = 0

    def take_counts(self) -> tuple[int, int]:
        """(output tokens, prompt tokens) counted since the last call; the counts restart."""
        counts = self.new_tokens, self.new_prompt_tokens
        self.new_tokens = self.new_prompt_tokens = 0
        return counts

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(
        self,
        request_id,
        prompt,
        prompt_ids,
        params: SamplingParams,
        arrival,
        core_id=None,
        final_only=False,
    ):
        """Start the state of one request: one sample per sequence, each with its detokenizer.
        ``core_id``: the request's id in the core's deltas (default: request_id);
        ``final_only``: ``outputs`` gives it one output, when it has finished."""
        stops = StopStrings(params.stop) if len(params.stop) > FEW_STOPS else None
        samples = [
            SampleState(i, self._detokenizer(prompt_ids, params), stops) for i in range(params.n)
        ]
        times = RequestTimes(arrival, self.wall_offset)
        plain = _is_plain(params, self.record_logits)
        req = RequestState(
            request_id, prompt, prompt_ids, params, samples, times, core_id, final_only, plain
        )
        self.requests[request_id] = self.by_core_id[req.core_id] = req

    def _detokenizer(self, prompt_ids, params: SamplingParams) -> IncrementalDetokenizer:
        skip = params.skip_special_tokens
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=skip)

    def abort(self, request_id: str) -> str | None:
        """Forget a request (no output follows); its core id, None if unknown."""
        self._touched.pop(request_id, None)
        self._ended.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        del self.by_core_id[req.core_id]
        return req.core_id

    def process(self, deltas: list[SampleDelta], now: float) -> list[tuple[str, int, int]]:
        """Take one core step's deltas; (core id, sample index, output tokens kept) for every
        sample a stop string ended that the core still runs (it must finish them). A delta
        whose core id is not a live request's (aborted, or an earlier request of the same id
        that a core process ran on) is dropped."""
        stopped, get, take_plain = [], self.by_core_id.get, self._take_plain
        for d in deltas:
            req = get(d.request_id)
            if req is None:
                continue  # aborted
            if req.plain and take_plain(req, d, now):
                continue  # a running plain sample's next token(s): the common case
            sample = req.samples[d.index]
            if sample.finished:
                continue  # ended by a stop string since the core sent it
            if self._process_delta(req, sample, d, now) and d.finish_reason is None:
                stopped.append((d.request_id, d.index, len(sample.token_ids)))
        return stopped

    def _take_plain(self, req: RequestState, d: SampleDelta, now: float) -> bool:
        """A running plain request's delta of one token alone, after its first: append it and
        its latency (what ``_process_delta`` does for it). False for any other delta."""
        times, ids = req.times, d.token_ids
        last = times.last_token
        if len(ids) != 1 or last is None or d.finish_reason is not None:
            return False
        sample = req.samples[0]
        if d.num_cached_tokens is not None or sample.finish_reason is not None:
            return False
        sample.token_ids.append(ids[0])
        times.itl.append(now - last)
        times.last_token = now
        self.new_tokens += 1
        self._touched[req.request_id] = req
        return True

    def _process_delta(self, req: RequestState, sample: SampleState, d: SampleDelta, now):
        """Add the delta's tokens one by one, each through the stop strings; True if one ended
        the sample (the tokens after it are dropped). Otherwise the core's end is the sample's."""
        self._touched[req.request_id] = req
        if d.index == 0 and d.num_cached_tokens is not None:
            req.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            req.prompt_logprobs = d.prompt_logprobs
        if d.embedding is not None:  # a pooled prompt: counted as generation's prompts are
            req.embedding = d.embedding
            self.new_prompt_tokens += len(req.prompt_ids)
        sample.logprobs += d.logprobs or ()
        sample.step_logits += d.logits or ()
        hit = self._add_tokens(req, sample, d, now)
        if hit is not None:
            kept = len(sample.token_ids)
            del sample.logprobs[kept:], sample.step_logits[kept:]
        elif d.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = d.finish_reason, d.stop_reason
            sample.error = d.error
            if d.finish_reason != "abort":
                sample.flush_text()
        if sample.finished:
            self._ended[req.request_id] = req
        return hit is not None

    def _add_tokens(self, req: RequestState, sample: SampleState, d: SampleDelta, now):
        """Append d's tokens; with stop strings, detokenize each and look for them once
        min_tokens are out (not on a last token the core ended otherwise: EOS, a stop token id
        and a refused token come first). The stop string that ended the sample, else None."""
        p, last = req.params, len(d.token_ids) - 1
        for k, token in enumerate(d.token_ids):
            sample.token_ids.append(token)
            self.new_tokens += 1
            if d.index == 0 and req.on_token_time(token, now):
                self.new_prompt_tokens += len(req.prompt_ids)
            if not p.stop or (k == last and d.finish_reason in ("stop", "abort")):
                continue
            before = len(sample.text)
            sample.sync_text()
            sample.scan_stops(before)  # every token, min_tokens or not: it keeps its place
            if len(sample.token_ids) < p.min_tokens:
                continue
            hit = _stop_hit(sample, p.stop, before)
            if hit is not None:
                at, stop = hit
                end = at + len(stop) if p.include_stop_str_in_output else at
                sample.text = sample.text[:end]
                sample.truncated = True
                sample.finish_reason, sample.stop_reason = "stop", stop
                return stop
        return None

    def outputs(self, stream: bool = True) -> list[RequestOutput]:
        """One output per request touched since the last call (``stream=False``, or a request
        added ``final_only``: per request that finished since then); finished requests are
        forgotten."""
        touched, self._touched = self._touched, {}
        ended, self._ended = self._ended, {}
        outputs = []
        for req in (touched if stream else ended).values():
            if req.plain and stream and not req.final_only and req.samples[0].finish_reason is None:
                outputs.append(req.plain_output())  # a running plain request: the common case
                continue
            finished = req.finished
            if finished:
                if req.times.finish is None:
                    req.times.finish = time.monotonic()
                self.requests.pop(req.request_id, None)
                self.by_core_id.pop(req.core_id, None)
            if finished or (stream and not req.final_only):
                outputs.append(req.output(self.record_logits, finished))
        return outputs
