"""``AsyncLLM``: one ``LLMEngine`` driven by a background thread, many asyncio callers.

caller (event loop)                      engine thread
  generate(prompt, params) ---- add -->  commands queue -> LLMEngine.add_request (ValueError back)
  async for out in ... <-- queue.put --  LLMEngine.step -> outputs -> loop.call_soon_threadsafe
  cancel / break / disconnect -- abort ->  LLMEngine.abort (its blocks go back before the next step)

Only the engine thread touches the engine: adds and aborts travel as commands that run between
steps, so the scheduler never sees a change in the middle of a step. After every step the thread
hands a ``StepStats`` snapshot to the stat loggers (Prometheus metrics, the periodic log line).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from engine.core.messages import QueueFullError  # noqa: F401 - raised by add_request, caught by name here
from engine.frontend.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine.async")


class EngineDeadError(RuntimeError):
    """The engine thread has died: every request in flight, and every new one, gets this."""


@dataclasses.dataclass
class StepStats:
    """What the engine looked like after one step, and what the step produced."""

    now: float  # time.monotonic()
    num_running: int  # sequences
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of GPU blocks in use, 0..1
    prefix_cache_queries: int  # cumulative prompt tokens looked up
    prefix_cache_hits: int  # cumulative prompt tokens found
    num_preemptions: int  # cumulative
    prompt_tokens: int  # prompt tokens of requests whose first token came in this step
    generation_tokens: int  # tokens generated in this step (all samples)
    finished: list[RequestOutput]  # requests that ended in this step
    spec_decode: object = None  # the engine's SpecStats (cumulative), None without speculation
    tier_queries: int = 0  # cumulative prompt tokens looked up with KV tiers on
    tier_hits: int = 0  # of those, loaded from a tier
    kv_tiers: list | None = None  # CoreStats.kv_tiers: each tier's counters, None without
    lora_running: list[str] | None = None  # adapters of the running sequences (enable_lora)
    lora_waiting: list[str] | None = None
    max_loras: int = 0
    expert_tokens: list | None = None  # CoreStats.expert_tokens: a mixture's routing counts


def engine_snapshot(engine: LLMEngine, now: float) -> StepStats:
    """Queue sizes, KV usage and cache counters of an engine's core (no step counts yet)."""
    c = engine.core_stats()
    return StepStats(
        now=now,
        num_running=c.num_running,
        num_waiting=c.num_waiting,
        num_swapped=c.num_swapped,
        kv_cache_usage=c.kv_cache_usage,
        prefix_cache_queries=c.prefix_cache_queries,
        prefix_cache_hits=c.prefix_cache_hits,
        num_preemptions=c.num_preemptions,
        prompt_tokens=0,
        generation_tokens=0,
        finished=[],
        spec_decode=engine.spec_stats if engine.config.speculative is not None else None,
        tier_queries=c.tier_queries,
        tier_hits=c.tier_hits,
        kv_tiers=c.kv_tiers,
        lora_running=c.lora_running,
        lora_waiting=c.lora_waiting,
        max_loras=c.max_loras,
        expert_tokens=c.expert_tokens,
    )


class _Stream:
    """Where one request's outputs go: a queue on the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        """Thread-safe: from the engine thread onto the caller's loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody listens any more
            pass


class RequestStream:
    """One request's outputs, in order, ending with the finished one. Leaving the iteration
    early (break, cancel, an exception) aborts the request; so does ``abort()``."""

    def __init__(self, llm: AsyncLLM, request_id: str, stream: _Stream):
        self.llm = llm
        self.request_id = request_id
        self._stream = stream
        self.finished = False

    def abort(self) -> None:
        if not self.finished:
            self.llm.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out = await self._stream.queue.get()
                if isinstance(out, BaseException):
                    raise out
                self.finished = out.finished
                yield out
        finally:
            self.abort()


class AsyncLLM:
    """``AsyncLLM(engine)``; ``async for out in llm.generate(prompt, params): ...``.

    ``max_waiting_requests``: how many sequences may wait beyond the free run slots (the ones
    the next step can admit, ``max_num_seqs`` less those running or swapped); a request that
    would make more wait is a QueueFullError. 0: only what can run now is taken.
    ``stat_loggers``: callables run on the engine thread with each step's ``StepStats``.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int | None = None,
        stat_loggers: list[Callable[[StepStats], None]] | None = None,
    ):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers = list(stat_loggers or [])
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (fn, Future | None)
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopping = threading.Event()
        self.errored: BaseException | None = None
        # held while a caller queues a command and while the loop ends: a command is either
        # queued before the loop ends (and then answered by its drain) or refused
        self._gate = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) ----
    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
        lora_request=None,
    ) -> RequestStream:
        """Queue one request: ValueError for bad input, QueueFullError past
        max_waiting_requests. Iterate the returned stream for its outputs (``final_only``: the
        finished one alone; ``lora_request``: its adapter)."""
        rids = [request_id] if request_id else None
        (stream,) = await self.add_requests([prompt], params, rids, final_only, lora_request)
        return stream

    async def add_requests(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | None = None,
        request_ids: list[str] | None = None,
        final_only: bool = False,
        lora_request=None,
    ) -> list[RequestStream]:
        """Queue every prompt with the same params in one trip to the engine thread, or none:
        the first refusal (ValueError, QueueFullError) undoes the others and is raised.
        ``final_only``: each stream gets its finished output alone (no output is built per
        step: a caller that answers once, at the end); ``lora_request``: their adapter."""
        rids = request_ids or [uuid.uuid4().hex for _ in prompts]
        if len(rids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(rids)} request ids")
        loop = asyncio.get_running_loop()
        streams = [_Stream(loop) for _ in prompts]
        try:
            add = functools.partial(
                self._add_all, rids, prompts, streams, params, final_only, lora_request
            )
            await self._call(add)
        except asyncio.CancelledError:
            for rid in rids:  # the adds may still run: undo them
                self.abort(rid)
            raise
        return [RequestStream(self, rid, s) for rid, s in zip(rids, streams, strict=True)]

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` and yield its outputs until it finishes; leaving early aborts it."""
        async for out in await self.add_request(prompt, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe, non-blocking); unknown ids are ignored."""
        self._commands.put((lambda: self._abort(request_id), None))

    async def check_health(self) -> None:
        """Raise if the engine thread has died or stopped."""
        if self.errored is not None:
            raise EngineDeadError(f"engine loop died: {self.errored!r}")
        if not self._thread.is_alive():
            raise RuntimeError("engine loop is not running")
        try:
            self.engine.check_core()
        except RuntimeError as e:
            raise EngineDeadError(str(e)) from None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread (running requests end with it)."""
        with self._gate:
            self._stopping.set()
        self._commands.put((lambda: None, None))  # wake it
        self._thread.join(timeout)
        self.engine.shutdown()

    async def _call(self, fn: Callable):
        """Run fn on the engine thread between steps; its result or exception comes back."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._gate:
            if self.errored is not None:
                raise EngineDeadError(f"engine loop died: {self.errored!r}")
            if self._stopping.is_set():
                raise RuntimeError("the engine is shutting down")
            self._commands.put((fn, fut))
        try:
            return await asyncio.wrap_future(fut)
        finally:  # fut holds the exception whose traceback holds this frame: no cycle
            del fn, fut

    # ---- engine thread ----
    def _add_all(
        self,
        rids: list[str],
        prompts: list,
        streams: list[_Stream],
        params,
        final_only: bool,
        lora_request=None,
    ) -> None:
        """Add each prompt under its id and stream; on a refusal abort the ones added."""
        added = []
        try:
            for rid, prompt, stream in zip(rids, prompts, streams, strict=True):
                try:
                    self._add(rid, prompt, params, stream, final_only, lora_request)
                except ValueError as e:
                    if len(prompts) == 1:
                        raise
                    raise ValueError(f"prompt {len(added)}: {e}") from None
                added.append(rid)
        except BaseException:
            for rid in added:
                self._abort(rid)
            raise

    def _add(self, rid: str, prompt, params, stream: _Stream, final_only: bool, lora=None) -> None:
        limit = self.max_waiting_requests
        self.engine.add_request(
            rid, prompt, params, max_waiting=limit, final_only=final_only, lora_request=lora
        )
        self._streams[rid] = stream

    def _abort(self, rid: str) -> None:
        if self._streams.pop(rid, None) is not None:
            self.engine.abort(rid)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests()
                drained = self._drain_commands(block=not busy)
                if self.engine.has_unfinished_requests() and not self._stopping.is_set():
                    self._step()
                elif drained:  # aborts may have emptied the engine: the loggers hear of it
                    self._log_stats(engine_snapshot(self.engine, time.monotonic()))
                else:  # idle: a core process that died is found now, not at the next request
                    self.engine.check_core()
        except BaseException as e:  # noqa: BLE001 - every caller must hear of it
            log.exception("engine loop died")
            with self._gate:
                self.errored = e
            dead = f"engine loop died: {e!r}"
            for stream in self._streams.values():
                stream.put(EngineDeadError(dead))
            self._streams.clear()
            self._refuse_queued(lambda: EngineDeadError(dead))
        else:
            self._refuse_queued(lambda: RuntimeError("the engine is shutting down"))

    def _refuse_queued(self, error: Callable[[], BaseException]) -> None:
        """Answer every command still queued (the gate lets no new one in) with an error."""
        while (item := self._next_command(False)) is not None:
            fut = item[1]
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(error())

    def _drain_commands(self, block: bool) -> int:
        """Run the queued adds and aborts (how many); wait for one first when the engine is idle."""
        count = 0
        while (item := self._next_command(block and not count)) is not None:
            self._run_command(*item)
            count += 1
        # item is None again: a refused add's traceback reaches this frame (as its caller's),
        # which must not hold that add's future (the exception's owner) once it returns
        return count

    def _next_command(self, block: bool) -> tuple | None:
        try:
            return self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return None

    @staticmethod
    def _run_command(fn: Callable, fut: concurrent.futures.Future | None) -> None:
        if fut is None:
            fn()
            return
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except Exception as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)
            del fn, fut  # e's traceback holds this frame: no cycle back through fut to e

    def _step(self) -> None:
        outputs = self.engine.step()
        stats = engine_snapshot(self.engine, time.monotonic())
        stats.generation_tokens, stats.prompt_tokens = self.engine.output_processor.take_counts()
        for out in outputs:
            if out.finished:
                stats.finished.append(out)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)
        self._log_stats(stats)

    def _log_stats(self, stats: StepStats) -> None:
        for logger in self.stat_loggers:
            logger(stats)


class LoggingStatLogger:
    """Every ``interval`` seconds while requests are in flight, one INFO line: prompt and
    generation throughput, running / waiting / swapped, KV cache usage, prefix cache hit rate."""

    def __init__(self, interval: float = 5.0, logger: logging.Logger = log):
        self.interval = interval
        self.logger = logger
        self.last = time.monotonic()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def __call__(self, s: StepStats) -> None:
        self.prompt_tokens += s.prompt_tokens
        self.generation_tokens += s.generation_tokens
        elapsed = s.now - self.last
        idle = not (s.num_running or s.num_waiting or s.num_swapped or self.generation_tokens)
        if elapsed < self.interval or idle:
            return
        self.logger.info(format_stats_line(s, self.prompt_tokens, self.generation_tokens, elapsed))
        self.last, self.prompt_tokens, self.generation_tokens = s.now, 0, 0


def format_stats_line(s: StepStats, prompt: int, gen: int, elapsed: float) -> str:
    hit = 100 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
    line = (
        f"prompt throughput {prompt / elapsed:.1f} tok/s, "
        f"generation throughput {gen / elapsed:.1f} tok/s, "
        f"running {s.num_running}, waiting {s.num_waiting}, swapped {s.num_swapped} seqs, "
        f"KV cache usage {100 * s.kv_cache_usage:.1f}%, prefix cache hit rate {hit:.1f}%"
    )
    if s.kv_tiers is not None:
        tier = 100 * s.tier_hits / s.tier_queries if s.tier_queries else 0.0
        line += f", KV tier hit rate {tier:.1f}%"
    spec = s.spec_decode
    if spec is not None and spec.num_drafts:  # cumulative, since the engine started
        line += (
            f", spec decode acceptance {100 * spec.acceptance_rate:.1f}%, "
            f"mean acceptance length {spec.mean_acceptance_length:.2f}"
        )
    return line
