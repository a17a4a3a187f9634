"""The engine core in a process of its own (``engine_core_process``): ``CoreClient`` is the
frontend's handle on it, ``run_core`` the process.

frontend (LLMEngine, AsyncLLM, the server)            core process (a fresh interpreter)
  CoreClient.add_request ---- Add ------------------>  EngineCore.add_request
  CoreClient.abort / finish_sample ---- Abort / Finish --->  EngineCore.abort / finish_sample
  CoreClient.step        <--- CoreOutputs ------------  EngineCore.step, while it has requests
  CoreClient.check_invariants -- Check --> <-- Ack ---  EngineCore.check_invariants (tests)

Two ZMQ sockets over ipc:// (a PUSH each way); every message is msgspec's msgpack, a kind frame
then the payload. Nothing the frontend sends waits for an answer: what the core would refuse is
checked before (a constraint compiled here too, the queue bound from the core's latest counters
and the adds sent since), and a request it still refuses ends at once, aborted with the reason.
The core steps as long as it has requests and sends each step's token-id deltas without waiting
for the frontend, which detokenizes step N while the core computes step N + 1; a stop string
the frontend finds comes back as a Finish (the core may have run a step past it: that token is
dropped). A core that dies (killed, an exception) is a RuntimeError in the frontend's next call
within POLL_S; the core exits when the frontend's process is gone.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core.messages import (
    CoreOutputs,
    CoreRequest,
    CoreStats,
    QueueFullError,
    SampleDelta,
    check_queue,
)
from engine.core.sequence import model_eos_ids
from engine.core.spec_decode import SpecStats

log = logging.getLogger("engine.core")
POLL_S = 0.05  # the frontend's wait for a message between liveness checks
IDLE_POLL_MS = 200  # the idle core's wait for a command between checks that its parent lives


class Add(msgspec.Struct, tag="add", array_like=True):
    request: CoreRequest


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class Finish(msgspec.Struct, tag="finish", array_like=True):
    request_id: str
    index: int
    num_tokens: int


class Check(msgspec.Struct, tag="check", array_like=True):
    """Run the core's invariant checks (tests): the Ack carries what failed."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = Add | Abort | Finish | Check | Shutdown


class Ack(msgspec.Struct, array_like=True):
    """A Check's answer: the invariant it found broken, if any, and the core's state once
    every command before it has run."""

    error: str | None
    stats: CoreStats


class Ready(msgspec.Struct, array_like=True):
    num_blocks: int
    num_cpu_blocks: int
    stats: CoreStats


class CoreClient:
    """``CoreClient(config, loaded)``: spawns the core process for ``config`` (resolved) and
    waits until it has loaded the model and planned its KV cache. ``loaded`` gives this side
    its tokenizer (for the structured-output compiler that validates constraints here)."""

    def __init__(self, config: EngineConfig, loaded):
        self.config, self.loaded = config, loaded
        self.spec_stats = SpecStats(config.speculative)
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        to_core, from_core = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(to_core)
        self._in = self._ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(from_core)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoders = {
            b"out": msgspec.msgpack.Decoder(CoreOutputs),
            b"ack": msgspec.msgpack.Decoder(Ack),
            b"ready": msgspec.msgpack.Decoder(Ready),
            b"dead": msgspec.msgpack.Decoder(str),
        }
        self._buffered: collections.deque[CoreOutputs] = collections.deque()
        self._num_sent_seqs = 0  # sequences of the adds sent (the core counts those it queued)
        self._compiler = None
        self.dead: str | None = None
        levels = [logging.getLogger(n).getEffectiveLevel() for n in ("engine", "engine.trace")]
        args = [to_core, from_core, str(os.getpid()), *map(str, levels)]
        # a fresh interpreter (not multiprocessing's spawn, which imports the caller's main
        # module again), the config on its stdin
        root = str(Path(__file__).resolve().parent.parent)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, "-m", "engine.frontend.core_client", *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
        self.proc.stdin.write(pickle.dumps(config))
        self.proc.stdin.close()
        # a client dropped or left at exit without shutdown(): the core goes too (it would also
        # see its parent gone), and the socket directory with it
        stop = msgspec.msgpack.encode(Shutdown())
        self._finalizer = weakref.finalize(
            self, _stop_core, self.proc, self._out, stop, self._ctx, self._dir
        )
        ready = self._wait(b"ready")
        self.num_blocks, self.num_cpu_blocks = ready.num_blocks, ready.num_cpu_blocks
        self._stats = ready.stats
        log.info("engine core process %d is ready (%d KV blocks)", self.proc.pid, self.num_blocks)

    @staticmethod
    def check_local(local: dict) -> None:
        """What lives in this process and cannot go to the core's: a ValueError naming it."""
        for name, value in local.items():
            if value not in (None, False):
                raise ValueError(f"engine_core_process: {name} works with the in-process core only")

    # ---- the frontend's calls ----
    def add_request(self, req: CoreRequest, max_waiting: int | None = None) -> None:
        """Check here what the core would refuse (a constraint that does not compile, the
        queue bound as of the core's latest counters and the adds sent since), then send
        it without waiting: the core reads it before its next step."""
        params = req.params
        if params.structured_outputs is not None:
            self.structured_compiler().compile(params.structured_outputs)
        if max_waiting is not None:
            st = self.stats()
            waiting = st.num_waiting + self._num_sent_seqs - st.num_added_seqs
            busy = st.num_running + st.num_swapped
            check_queue(params.n, max_waiting, waiting, busy, self.config.max_num_seqs)
        self._send(Add(req))
        self._num_sent_seqs += params.n

    def abort(self, request_id: str) -> bool:
        self._send(Abort(request_id))
        return True

    def finish_sample(self, request_id: str, index: int, num_tokens: int) -> None:
        self._send(Finish(request_id, index, num_tokens))

    def step(self) -> CoreOutputs | None:
        """The core's next step, or None when none came within POLL_S."""
        if self._buffered:
            return self._buffered.popleft()
        return self._receive(b"out", POLL_S)

    def stats(self) -> CoreStats:
        """As the core's latest message says (the outputs read to find it wait for step())."""
        while self._receive(b"stats", 0) is not None:
            pass
        return self._stats

    def check_invariants(self) -> None:
        """The core's invariant checks, run once every command sent before has run: the
        stats are then the core's after them."""
        self._send(Check())
        ack = self._wait(b"ack")
        self._stats = ack.stats
        if ack.error is not None:
            raise AssertionError(f"engine core: {ack.error}")

    def structured_compiler(self):
        """This side's compiler over the same tokenizer: constraints are refused here, before
        they travel (the core compiles its own)."""
        if self._compiler is None:
            from engine.core.structured import model_compiler

            self._compiler = model_compiler(self.loaded, model_eos_ids(self.loaded))
        return self._compiler

    def shutdown(self) -> None:
        """Ask the core to exit; kill it after 5 s."""
        self._finalizer()  # Shutdown, then a kill if need be

    # ---- messages ----
    def _send(self, command) -> None:
        self.check_alive()
        self._out.send(self._encode(command))

    def _wait(self, kind: bytes):
        """The next message of ``kind``; core outputs that come first are kept for step()."""
        while True:
            msg = self._receive(kind, POLL_S)
            if msg is not None:
                return msg

    def _receive(self, kind: bytes, timeout: float):
        """A message of ``kind`` within ``timeout`` (outputs of a step met first are kept), else
        None; a RuntimeError once the core is dead."""
        if self._in.poll(int(timeout * 1000)) == 0:
            self.check_alive()
            return None
        got, payload = self._in.recv_multipart()
        msg = self._decoders[got].decode(payload)
        if got == b"dead":
            self.dead = msg
            raise RuntimeError(f"the engine core failed: {msg}")
        if got == b"out":
            self._stats = msg.stats
            self._update_spec(msg.stats.spec_decode)
            if kind != b"out":
                self._buffered.append(msg)
                return msg if kind == b"stats" else None
        return msg

    def _update_spec(self, counters: list | None) -> None:
        if counters is not None:
            st = self.spec_stats
            st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, per_pos = counters
            st.accepted_per_pos = list(per_pos)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"the engine core failed: {self.dead}")
        code = self.proc.poll()
        if code is not None:
            why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            self.dead = f"the engine core process {self.proc.pid} died ({why})"
            raise RuntimeError(self.dead)


def _stop_core(proc: subprocess.Popen, out, stop: bytes, ctx, folder: str) -> None:
    """Ask a core that has not exited to stop (it then stops its workers and frees their
    shared memory), kill it if it has not within 5 s; close the sockets, remove their
    directory."""
    if proc.poll() is None:
        try:
            out.send(stop, zmq.NOBLOCK)
            proc.wait(5)
        except (zmq.ZMQError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(5)
    ctx.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)


# ---- the core process ----
def run_core(config: EngineConfig, to_core: str, from_core: str, parent: int, levels):
    """The core process: load the model, build the EngineCore, then serve its loop until a
    Shutdown or until the frontend's process is gone. A failure is sent as ``dead``."""
    from engine.core.engine_core import EngineCore
    from model_loader.load import load_model

    # Ctrl-C, and a SIGTERM sent to the whole process group or cgroup (timeout, systemd),
    # reach the core too: the frontend decides what stops (it finishes or aborts its requests,
    # then shuts the core down), so the core ignores both, as the rank workers ignore Ctrl-C
    _ignore_stop_signals()
    logging.basicConfig(level=levels[0], format="%(levelname)s %(name)s (core): %(message)s")
    logging.getLogger("engine.trace").setLevel(levels[1])  # the request trace, if it is on
    core = failed = None
    try:  # before any ZMQ context: tensor-parallel workers are forked from this process
        core = EngineCore(load_model(config.model), config)
    except BaseException:  # noqa: BLE001 - the frontend must hear of it
        failed = traceback.format_exc(limit=8).strip()
    _ignore_stop_signals()  # again: ray.init (the ray executor) installs its own handlers
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(to_core)
    outbox.connect(from_core)
    encode = msgspec.msgpack.Encoder().encode
    try:
        if failed is not None:
            raise RuntimeError(failed)
        plan = core.kv_plan
        ready = Ready(plan.num_blocks, plan.num_cpu_blocks, core.stats())
        outbox.send_multipart([b"ready", encode(ready)])
        CoreLoop(core, inbox, outbox, parent).run()
    except BaseException:  # noqa: BLE001 - the frontend must hear of it
        why = failed or traceback.format_exc(limit=8).strip()
        outbox.send_multipart([b"dead", encode(why)])
        time.sleep(0.2)  # let the message leave before the sockets close
        raise SystemExit(1) from None
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()
        if core is not None:
            core.shutdown()  # the KV tiers saved and closed
            getattr(core.backend, "shutdown", lambda: None)()  # tensor-parallel workers


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


class CoreLoop:
    """Commands between steps; a step whenever the core has requests, its outputs sent."""

    def __init__(self, core, inbox, outbox, parent: int):
        self.core, self.inbox, self.outbox, self.parent = core, inbox, outbox, parent
        self.decode = msgspec.msgpack.Decoder(Command).decode
        self.encode = msgspec.msgpack.Encoder().encode
        self.refused: list[SampleDelta] = []  # requests the core could not queue, as ends

    def run(self) -> None:
        core = self.core
        while True:
            handled = 0
            timeout = 0 if core.has_unfinished() else IDLE_POLL_MS
            while self.inbox.poll(0 if handled else timeout):
                if not self.handle(self.decode(self.inbox.recv())):
                    return
                handled += 1
            if os.getppid() != self.parent:
                log.warning("the frontend's process is gone: the engine core exits")
                return
            if core.has_unfinished():
                out = core.step()
                out.deltas[:0], self.refused = self.refused, []
                self.send(b"out", out)
            elif handled:  # aborts may have emptied it: the frontend hears the counters
                refused, self.refused = self.refused, []
                self.send(b"out", CoreOutputs(refused, time.monotonic(), core.stats()))

    def send(self, kind: bytes, msg) -> None:
        self.outbox.send_multipart([kind, self.encode(msg)])

    def handle(self, cmd) -> bool:
        """Run one command; False for Shutdown."""
        core = self.core
        if isinstance(cmd, Add):
            self._add(cmd.request)
        elif isinstance(cmd, Abort):
            core.abort(cmd.request_id)
        elif isinstance(cmd, Finish):
            core.finish_sample(cmd.request_id, cmd.index, cmd.num_tokens)
        elif isinstance(cmd, Check):
            try:
                core.check_invariants()
                broken = None
            except AssertionError as e:
                broken = str(e)
            self.send(b"ack", Ack(broken, core.stats()))
        else:
            return False
        return True

    def _add(self, req: CoreRequest) -> None:
        """Queue a request; one the core refuses (its frontend checked what it could) ends at
        once, each sample aborted with the reason, in the next outputs."""
        try:
            self.core.add_request(req)
        except (ValueError, QueueFullError) as e:
            self.core.num_added_seqs += req.params.n  # counted as queued, and ended
            why = f"refused by the engine core: {e}"
            for i in range(req.params.n):
                end = SampleDelta(req.request_id, i, [], finish_reason="abort", error=why)
                self.refused.append(end)


if __name__ == "__main__":
    to_core, from_core, parent, *levels = sys.argv[1:6]
    run_core(pickle.load(sys.stdin.buffer), to_core, from_core, int(parent), list(map(int, levels)))
