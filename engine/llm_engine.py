"""The engine loop: requests in, one scheduled forward per ``step()``, outputs back.

add_request -> tokenize, validate, one Sequence per sample -> Scheduler.add (waiting queue)
step        -> Scheduler.schedule -> ModelRunner.execute (swaps, forward) -> Sampler.sample
            -> Scheduler.update (append tokens) -> detokenize, stop checks, finish -> outputs
            (a step whose rows are all plain greedy asks the backend for argmax ids instead of
            logits, so no (B, V) array reaches the host: ``_plain_greedy``)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterator

import numpy as np

from reference.loader import LoadedModel, default_model, load_model
from reference.tokenizer import IncrementalDetokenizer

from .backends import get_backend
from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampler import Sampler, edits_logits
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence

log = logging.getLogger("engine")
trace = logging.getLogger("engine.trace")  # the life of each request; off unless asked for
trace.setLevel(logging.WARNING)  # `--trace` (or a caller) sets it to INFO

MiB = 1 << 20


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


class _Request:
    """One request's state: its sequences (n samples) and what has been streamed of each."""

    def __init__(self, request_id, prompt, prompt_ids, params, seqs, tokenizer, gens, arrival):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs: list[Sequence] = seqs
        self.detoks = [IncrementalDetokenizer(tokenizer, prompt_ids) for _ in seqs]
        self.generators: list[np.random.Generator] = gens
        self.texts = [""] * len(seqs)
        self.emitted = [0] * len(seqs)  # characters of texts[i] already streamed
        self.logprobs: list[list] = [[] for _ in seqs]
        self.step_logits: list[list] = [[] for _ in seqs]
        self.errors: list[str | None] = [None] * len(seqs)
        self.truncated = [False] * len(seqs)  # text cut at a stop string
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.last_token_time: float | None = None
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self, record_logits: bool) -> RequestOutput:
        outs = []
        for i, seq in enumerate(self.seqs):
            text = self.texts[i]
            # while running, hold back a possible stop-string prefix so no emitted text is retracted
            ready = len(text) if seq.is_finished else max(len(text) - self.hold_back, 0)
            delta = text[self.emitted[i] : ready]
            self.emitted[i] = max(self.emitted[i], ready)
            outs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    logprobs=list(self.logprobs[i]) if self.params.logprobs is not None else None,
                    text_delta=delta,
                    step_logits=list(self.step_logits[i]) if record_logits else None,
                    error=self.errors[i],
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_ids),
            outputs=outs,
            finished=self.finished,
            metrics=dataclasses.replace(self.metrics, itl=list(self.metrics.itl)),
            num_cached_tokens=self.seqs[0].num_cached_tokens,
        )


class LLMEngine:
    """``LLMEngine(model, **engine_args)``: engine_args are ``EngineConfig`` fields.

    ``record_logits=True`` keeps every sampled row of logits (for ``engine.diff``); ``loaded``
    reuses an already loaded model (tests share one between engines).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        record_logits: bool = False,
        **engine_args,
    ):
        if config is None:
            config = make_config(model, **engine_args)
        if not config.model and loaded is None:
            name, why = default_model()
            log.info("model: %s (%s)", name, why)
            config = dataclasses.replace(config, model=name)
        self.loaded = loaded if loaded is not None else load_model(config.model)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.config = config.resolve(self.model_config)
        self.record_logits = record_logits
        self._setup()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> LLMEngine:
        return cls(config=config, **kwargs)

    # ---- startup ----
    def _setup(self) -> None:
        cfg, mc = self.config, self.model_config
        log.info(
            "model %s: %d layers, hidden %d, %d heads (%d KV), head dim %d, vocab %d",
            self.loaded.source, mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads,
            mc.num_key_value_heads, mc.head_dim, mc.vocab_size,
        )  # fmt: skip
        self.backend = get_backend(cfg.backend, mc, self.loaded.weights, cfg)
        if cfg.dtype == "auto" and self.backend.name in ("numpy", "cuda-cpu"):
            log.info(
                "dtype auto -> float32 on the %s backend (the checkpoint is %s; NumPy has no "
                "fast 16-bit matrix products)", self.backend.name, mc.torch_dtype,
            )  # fmt: skip
        num_blocks, num_cpu_blocks = self._size_pool()
        self.backend.allocate_kv_cache(num_blocks, num_cpu_blocks)
        self.block_manager = BlockManager(
            num_blocks, cfg.block_size, num_cpu_blocks, enable_caching=cfg.enable_prefix_caching
        )
        self.scheduler = Scheduler(cfg, self.block_manager)
        self.runner = ModelRunner(mc, cfg, self.backend)
        self.eos_token_ids = list(mc.eos_token_ids or self.tokenizer.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._counter = itertools.count()
        self._trace_tables: dict[int, int] = {}  # seq_id -> block table length last traced

    def _size_pool(self) -> tuple[int, int]:
        """(GPU-pool blocks, CPU swap blocks) from the memory budget; logs the arithmetic."""
        cfg, be = self.config, self.backend
        per_block = be.bytes_per_block
        weights = be.weights_bytes
        peak = be.profile_peak_bytes(
            cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs
        )
        on_device = be.name == "cuda"
        total = be.total_memory_bytes() if on_device else available_ram_bytes()
        budget = cfg.memory_budget_bytes or int(cfg.gpu_memory_utilization * total)
        memory = "GPU memory" if on_device else "available RAM"
        source = (
            "explicit"
            if cfg.memory_budget_bytes
            else f"{cfg.gpu_memory_utilization:.2f} x {memory}"
        )
        fit = max((budget - weights - peak) // per_block, 0)
        num_blocks = cfg.num_gpu_blocks or fit
        # no swap with prefix caching (EngineConfig refuses it): no CPU pool either
        num_cpu_blocks = 0 if cfg.enable_prefix_caching else cfg.swap_space_bytes // per_block
        where = "host memory" if be.name in ("numpy", "cuda-cpu") else "device memory"
        log.info(
            "memory budget %s (%s) - weights %s - activation peak %s (profile: %d tokens) = %s "
            "for the KV cache; %s per block of %d tokens -> %d blocks%s",
            _mib(budget), source, _mib(weights), _mib(peak),
            cfg.max_num_batched_tokens, _mib(budget - weights - peak), _mib(per_block),
            cfg.block_size, fit, f" (overridden: num_gpu_blocks={num_blocks})"
            if cfg.num_gpu_blocks else "",
        )  # fmt: skip
        log.info(
            "# GPU blocks: %d, # CPU blocks: %d  (the 'GPU' pool is %s on the %s backend; "
            "CPU blocks = swap_space %s GiB / block)",
            num_blocks, num_cpu_blocks, where, be.name, cfg.swap_space,
        )  # fmt: skip
        need = -(-cfg.max_model_len // cfg.block_size)
        if num_blocks < need:
            raise ValueError(
                f"KV cache too small: one sequence of max_model_len={cfg.max_model_len} tokens "
                f"needs {need} blocks ({_mib(need * per_block)}), the pool has {num_blocks} "
                f"({_mib(num_blocks * per_block)}); give more memory or lower max_model_len"
            )
        return num_blocks, num_cpu_blocks

    # ---- requests ----
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> list[int]:
        """Validate and queue one request (ValueError for bad input); returns its prompt ids."""
        if not isinstance(request_id, str) or request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is not a new string id")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, ids, params, arrival) for _ in range(params.n)]
        gens = [self._generator(params, i) for i in range(params.n)]
        req = _Request(request_id, text, ids, params, seqs, self.tokenizer, gens, arrival)
        self._requests[request_id] = req
        for seq in seqs:
            self.scheduler.add(seq)
        if trace.isEnabledFor(logging.INFO):
            trace.info("%s: tokenized into %d ids %s; queued (%d waiting)", request_id,
                       len(ids), ids[:16], len(self.scheduler.waiting))  # fmt: skip
        return ids

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple | np.ndarray):
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token id {bad[0]} is outside [0, {self.model_config.vocab_size})"
                )
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) > self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, more than max_model_len={self.config.max_model_len}"
            )
        return text, ids

    def _generator(self, params: SamplingParams, index: int) -> np.random.Generator:
        """Per-sequence RNG: the request's seed, else the engine seed and a request counter."""
        if params.seed is not None:
            return np.random.default_rng([params.seed % 2**64, index])
        return np.random.default_rng([self.config.seed % 2**64, next(self._counter), index])

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back at once. False if unknown."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        return True

    abort_request = abort  # vLLM's name

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One scheduled forward. Returns an output for every request that got a token, finished
        or was rejected in this step (finished requests are then forgotten)."""
        out = self.scheduler.schedule()
        touched: dict[str, _Request] = {}
        for seq, reason in self.scheduler.take_rejected():
            self._on_rejected(seq, reason, touched)
        if trace.isEnabledFor(logging.INFO):
            self._trace_schedule(out)
        if not out.is_empty:
            self._sample_and_update(out, touched)
        outputs = [req.output(self.record_logits) for req in touched.values()]
        for o in outputs:
            if o.finished:
                self._requests.pop(o.request_id, None)
        return outputs

    def _sample_and_update(self, out: SchedulerOutput, touched) -> None:
        """Run the step, pick one token for every sequence whose last token ran, append them."""
        rows, seqs = _rows_to_sample(out)
        if self._plain_greedy(seqs):  # the argmax where the logits are; only ids come back
            ids = self.runner.execute(out, greedy=True)[rows].tolist()  # (R,)
            extras = [(None, None)] * len(seqs)
        else:
            ids, extras = self._sample_on_host(out, rows, seqs)
        sampled = {s.seq_id: t for s, t in zip(seqs, ids, strict=True)}
        extra = {s.seq_id: e for s, e in zip(seqs, extras, strict=True)}
        now = time.monotonic()
        for seq in self.scheduler.update(out, sampled):
            lp, row = extra[seq.seq_id]
            self._on_token(seq, lp, row, now, touched)

    def _sample_on_host(self, out: SchedulerOutput, rows: list[int], seqs: list[Sequence]):
        """(B, V) logits to the host, the Sampler on the rows -> (ids, [(logprobs, logits row)])."""
        logits = self.runner.execute(out)  # (B, V)
        gens = [self._requests[s.request_id].generators[self._index(s)] for s in seqs]
        ids, lps = self.sampler.sample(logits[rows], seqs, gens)
        return ids, [(lp, logits[r]) for lp, r in zip(lps, rows, strict=True)]

    def _plain_greedy(self, seqs: list[Sequence]) -> bool:
        """Whether every row is an argmax of the raw logits: greedy, no penalty, no min_tokens
        ban still due, no logprobs, and the engine not recording logits."""
        if self.record_logits:
            return False
        return all(
            s.params.greedy and s.params.logprobs is None and not edits_logits(s) for s in seqs
        )

    def _index(self, seq: Sequence) -> int:
        return self._requests[seq.request_id].seqs.index(seq)

    def _on_token(self, seq: Sequence, logprob, logits_row, now: float, touched) -> None:
        req = self._requests[seq.request_id]
        touched[req.request_id] = req
        i = req.seqs.index(seq)
        if i == 0:  # latency metrics follow the first sample
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                if trace.isEnabledFor(logging.INFO):
                    ms = 1e3 * (now - req.metrics.arrival_time)
                    trace.info("%s: first token %d after %.1f ms", req.request_id,
                               seq.last_token_id, ms)  # fmt: skip
            else:
                req.metrics.itl.append(now - req.last_token_time)
            req.last_token_time = now
        if logprob is not None:
            req.logprobs[i].append(logprob)
        if self.record_logits:
            req.step_logits[i].append(np.array(logits_row, dtype=np.float32))
        before = len(req.texts[i])
        req.texts[i] += req.detoks[i].add(seq.last_token_id)
        reason = self._stop_reason(seq, req, i, before)
        if reason is not None:
            self._finish(seq, req, reason)

    def _stop_reason(self, seq: Sequence, req: _Request, i: int, before: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            token = seq.last_token_id
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                return "stop"
            text = req.texts[i]
            for s in p.stop:
                at = text.find(s, max(before - len(s) + 1, 0))
                if at >= 0:  # the stop string ends the text and is not part of it
                    req.texts[i] = text[:at]
                    req.truncated[i] = True
                    return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, req: _Request, reason: str) -> None:
        i = req.seqs.index(seq)
        if not req.truncated[i]:
            req.texts[i] += req.detoks[i].finish()  # flush a held-back partial character
        self.scheduler.finish(seq, reason)
        if req.finished:
            req.metrics.finish_time = time.monotonic()
        if trace.isEnabledFor(logging.INFO):
            trace.info("%s: finished (%s) after %d tokens; its blocks are back on the free queue "
                       "(%d free now)", req.request_id, reason, seq.num_output_tokens,
                       self.block_manager.num_free_blocks)  # fmt: skip

    def _on_rejected(self, seq: Sequence, reason: str, touched) -> None:
        req = self._requests.get(seq.request_id)
        if req is None:
            return
        touched[req.request_id] = req
        if seq.finish_reason == "abort":
            req.errors[req.seqs.index(seq)] = reason
        if req.finished:
            req.metrics.finish_time = time.monotonic()

    def _trace_schedule(self, out: SchedulerOutput) -> None:
        for seq, hits in out.prefix_hits:
            trace.info("%s: prefix cache hit: %d tokens (blocks %s)", seq.request_id,
                       len(hits) * self.config.block_size, hits)  # fmt: skip
        for seq in out.preempted:
            trace.info("%s: preempted (%s): blocks released, %d free now", seq.request_id,
                       self.config.preemption_mode, self.block_manager.num_free_blocks)  # fmt: skip
            self._trace_tables.pop(seq.seq_id, None)
        for seq, n in out.scheduled:
            known = self._trace_tables.get(seq.seq_id)
            if known is None:
                kind = "prefill" if seq.num_output_tokens == 0 else "resumed prefill"
                trace.info("%s: scheduled as %s of %d tokens with blocks %s (%d free)",
                           seq.request_id, kind, n, seq.block_table,
                           self.block_manager.num_free_blocks)  # fmt: skip
            elif len(seq.block_table) > known:
                trace.info("%s: new block %s at token %d (%d free)", seq.request_id,
                           seq.block_table[known:], seq.num_tokens,
                           self.block_manager.num_free_blocks)  # fmt: skip
            self._trace_tables[seq.seq_id] = len(seq.block_table)

    # ---- conveniences ----
    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Add one request and drive the engine until it ends, yielding its new text as it comes.
        (Other requests in the engine advance too; their outputs are not returned here.)"""
        rid = f"stream-{next(self._counter)}"
        self.add_request(rid, prompt, params)
        done = False
        while not done:
            for o in self.step():
                if o.request_id == rid:
                    done = o.finished
                    if o.outputs[0].text_delta:
                        yield o.outputs[0].text_delta
            if not self.has_unfinished_requests():
                break


def _rows_to_sample(out: SchedulerOutput) -> tuple[list[int], list[Sequence]]:
    """Batch rows (and their sequences) whose last token runs this step: those get a token; a
    chunk of a prefill that ends before the prompt does gets none."""
    rows, seqs = [], []
    for b, (seq, n) in enumerate(out.scheduled):
        if seq.num_computed_tokens + n == seq.num_tokens:
            rows.append(b)
            seqs.append(seq)
    return rows, seqs


def make_config(model: str | None, **engine_args) -> EngineConfig:
    """EngineConfig from keyword arguments; an unknown name is a ValueError naming it."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_args) - names)
    if unknown:
        raise ValueError(f"unknown engine argument {unknown[0]!r}")
    return EngineConfig(model=model or "", **engine_args)
