"""The engine's steps as they happen, for the web page's live view (``GET /v1/engine/events``).

engine thread                                   event loop (one generator per client)
  EngineCore.step -> LiveTap.on_schedule  (the step's batch, as ids and counts)
  AsyncLLM stat loggers -> LiveTap.__call__ (the pool and queues, at most every
      BUILD_INTERVAL_S, and whenever the engine goes idle) -- call_soon_threadsafe -->
                                                 LiveClient.put: a bounded queue, oldest dropped
                                                 events(): one coalesced frame per
                                                 MIN_INTERVAL_S at most

The tap hooks the engine (``core.recorder`` and ``AsyncLLM.stat_loggers``) only while a client
listens: with nobody subscribed the engine runs no code of it. A slow client never slows the
engine: its queue drops the oldest frames and says how many. Frames carry request ids, sequence
ids, block ids and counts, never a prompt or an output's text.

The tap reads the scheduler and the block pool, so it needs the engine core in this process:
with ``--engine-core-process`` (or replicas behind the server) ``unavailable`` says why, and the
stream sends that one ``hello`` event and ends.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time

from engine.core.sequence import SequenceStatus

MIN_INTERVAL_S = 0.1  # per client: at most 10 frames a second
BUILD_INTERVAL_S = 0.05  # the engine thread's snapshots: at most 20 a second (and at idle)
CLIENT_QUEUE = 8  # frames a client may have waiting; the oldest go first
MAX_STEPS = 64  # step summaries one frame carries (the latest)
STATE = {
    SequenceStatus.WAITING: "W",
    SequenceStatus.RUNNING: "R",
    SequenceStatus.SWAPPED: "S",
    SequenceStatus.FINISHED: "F",
}


def unavailable(llm) -> str | None:
    """Why the live view cannot see this server's engine (None: it can)."""
    engine = llm.engine
    config = getattr(engine, "config", None)
    if config is not None and getattr(config, "engine_core_process", False):
        return "the engine core runs in a process of its own (--engine-core-process)"
    if not hasattr(getattr(engine, "core", None), "recorder"):
        return "the engines are replicas behind this server (--data-parallel-size)"
    return None


def step_summary(out, number: int) -> dict:
    """One scheduled step as ids and counts: rows [seq id, tokens, kind] (d decode, p prefill,
    s speculated), preemptions [seq id, swap or recompute], prefix hits [seq id, blocks] and
    drafts [seq id, draft tokens]."""
    rows = [
        [s.seq_id, n, "d" if j < out.num_decodes else "s" if s.seq_id in out.drafts else "p"]
        for j, (s, n) in enumerate(out.scheduled)
    ]
    step = {"n": number, "run": rows}
    if out.preempted:
        swapped = SequenceStatus.SWAPPED
        step["pre"] = [[s.seq_id, "s" if s.status == swapped else "r"] for s in out.preempted]
    if out.prefix_hits:
        step["hit"] = [[s.seq_id, len(hits)] for s, hits in out.prefix_hits]
    if out.drafts:
        step["spec"] = [[sid, len(d)] for sid, d in out.drafts.items()]
    return step


def meta(engine) -> dict:
    """What the page draws once: the pool's sizes and the scheduler's limits."""
    cfg, bm = engine.config, engine.block_manager
    sc, moe = cfg.speculative, engine.backend.cfg.moe
    groups = getattr(engine, "kv_groups", None)  # per KV group its window (0: full attention)
    return {
        "available": True,
        "model": cfg.model,
        "backend": engine.backend.name,
        "num_blocks": bm.num_blocks,
        "num_cpu_blocks": bm.num_cpu_blocks,
        "block_size": bm.block_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "prefix_caching": bm.enable_caching,
        "speculative": None
        if sc is None
        else {"method": sc.method, "k": sc.num_speculative_tokens},
        "experts": None if moe is None else {"num": moe.num_experts, "top_k": moe.top_k},
        "kv_groups": list(groups.windows) if groups is not None and groups.grouped else None,
    }


def pool_state(engine) -> dict:
    """The pool and the queues now: every live sequence [seq id, request id, state, prompt
    tokens, output tokens, block table, CPU table, each later KV group's table, and CPU table
    (-1 where a sliding group gave a block back)], the free count and the free blocks that
    still hold cached prefixes (``cfree``); a mixture of experts' router counts (``experts``:
    per sparse layer [layer, rows routed to each expert so far])."""
    sched, bm = engine.scheduler, engine.block_manager
    seqs = [
        [s.seq_id, s.request_id, STATE[s.status], s.num_prompt_tokens, s.num_output_tokens,
         list(s.block_table), list(s.cpu_block_table), [list(t) for t in s.group_tables],
         [list(t) for t in s.cpu_group_tables]]
        for s in sched.live_seqs()
    ]  # fmt: skip
    state = {
        "free": bm.num_free_blocks,
        "seqs": seqs,
        "running": [s.seq_id for s in sched.running],
        "waiting": [s.seq_id for s in sched.waiting],
        "swapped": [s.seq_id for s in sched.swapped],
    }
    if bm.enable_caching:
        state["cfree"] = sorted(b for b in bm.block_hash if bm.ref_counts[b] == 0)
    if engine.config.speculative is not None:
        st = engine.spec_stats
        state["spec"] = [st.num_draft_tokens, st.num_accepted_tokens]
    experts = engine.backend.expert_tokens()  # a mixture: [layer, rows per expert so far]
    if experts is not None:
        state["experts"] = experts
    return state


class LiveClient:
    """One listener's frames: at most CLIENT_QUEUE wait, the oldest dropped (and counted)."""

    def __init__(self):
        self.frames: collections.deque[dict] = collections.deque(maxlen=CLIENT_QUEUE)
        self.dropped = 0
        self.ready = asyncio.Event()

    def put(self, frame: dict) -> None:
        if len(self.frames) == self.frames.maxlen:
            self.dropped += 1
        self.frames.append(frame)
        self.ready.set()

    def take(self) -> dict:
        """The frames waiting as one: the latest state, every step summary they carry (the
        last MAX_STEPS) and how many frames were dropped since the last take."""
        frames = list(self.frames)
        self.frames.clear()
        self.ready.clear()
        steps = [s for f in frames for s in f["steps"]][-MAX_STEPS:]
        out = frames[-1] | {"steps": steps, "dropped": self.dropped}
        self.dropped = 0
        return out


class LiveTap:
    """The engine's steps for every subscribed ``LiveClient``; ``events(client)`` is one
    client's server-sent event stream."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.engine
        self.why = unavailable(llm)
        self.clients: set[LiveClient] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.t0 = time.monotonic()
        self.count = 0  # steps seen while subscribed
        self.steps: list[dict] = []  # summaries since the last snapshot (engine thread)
        self.last = 0.0  # when the last snapshot was built

    # -- event loop ---------------------------------------------------------------------------

    def subscribe(self) -> LiveClient:
        client = LiveClient()
        if not self.clients:
            self._attach()
        self.clients.add(client)
        return client

    def unsubscribe(self, client: LiveClient) -> None:
        self.clients.discard(client)
        if not self.clients:
            self._detach()

    def _attach(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.steps, self.last = [], 0.0
        self.engine.core.recorder = self
        self.llm.stat_loggers = [*self.llm.stat_loggers, self]  # a new list: the thread reads it

    def _detach(self) -> None:
        if self.engine.core.recorder is self:
            self.engine.core.recorder = None
        self.llm.stat_loggers = [x for x in self.llm.stat_loggers if x is not self]

    def _publish(self, frame: dict) -> None:
        for client in self.clients:
            client.put(frame)

    async def events(self):
        """One client's stream: ``hello`` (the pool's sizes, or why there is no live view),
        then a ``frame`` each time the engine moved, at most one per MIN_INTERVAL_S."""
        if self.why is not None:
            yield _event("hello", {"available": False, "why": self.why})
            return
        client = self.subscribe()
        try:
            yield _event("hello", meta(self.engine))
            last = -MIN_INTERVAL_S
            while True:
                await client.ready.wait()
                wait = last + MIN_INTERVAL_S - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                last = time.monotonic()
                yield _event("frame", client.take())
        finally:
            self.unsubscribe(client)

    def _ms(self) -> float:
        return round(1e3 * (time.monotonic() - self.t0), 1)

    # -- engine thread ------------------------------------------------------------------------

    def on_schedule(self, out) -> None:
        """The step just scheduled (called by ``EngineCore.step`` while a client listens)."""
        self.count += 1
        self.steps.append(step_summary(out, self.count))
        if len(self.steps) > MAX_STEPS:
            del self.steps[0]

    def __call__(self, stats) -> None:
        """After each step (a stat logger): a snapshot when BUILD_INTERVAL_S has passed since
        the last, or when the engine is idle (its last state must reach the page)."""
        idle = not (stats.num_running or stats.num_waiting or stats.num_swapped)
        if not idle and stats.now - self.last < BUILD_INTERVAL_S:
            return
        self.last = stats.now
        frame = pool_state(self.engine) | {"step": self.count, "t": self._ms()}
        frame["steps"], self.steps = self.steps, []
        try:
            self.loop.call_soon_threadsafe(self._publish, frame)
        except RuntimeError:  # the loop is closed: the server is stopping
            pass


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
