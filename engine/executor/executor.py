"""The ``mp`` executor: one worker process per rank on this host, behind the engine's
``Backend`` interface.

Ranks form a grid: ``pipeline_parallel_size`` stages of ``tensor_parallel_size`` ranks each,
rank = stage x tensor_parallel_size + its index in the stage. The engine (scheduler, block
manager, model runner, sampler) stays in its own process and sees one backend. Each of its
calls (``allocate_kv_cache``, the block moves, ``forward``, ``forward_greedy``) goes to every
rank over its pipe; the ranks of a stage meet in their shared-memory collectives (comm.py),
each stage hands its hidden state to the next over a pipe, and the engine takes the answer of
the last stage's first rank (``output_rank``). Workers are forked, so they start from the
weights this process loaded and keep only their cut.

A worker that raises answers with the error, a worker that dies closes its pipe: either way
the call raises a RuntimeError naming the rank, within ``timeout`` seconds, and every worker is
stopped (a dead rank also breaks the others' barrier, so none of them hangs).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time
import traceback
import weakref

import numpy as np

from engine.backends.base import Backend, resolve_kv_dtype
from engine.devices.comm import ShmComm
from engine.emulation.nccl import remove_block
from engine.executor.sharding import (
    Shard,
    Stage,
    check_pipeline_parallel,
    check_tensor_parallel,
    cut_slots,
    gather_slots,
    shard_lora,
)
from engine.utils import mib
from model_loader.config import ModelConfig

log = logging.getLogger("engine")
# Starting a rank (a process, its imports, its share of the weights) waits this long: a busy
# machine can take minutes, and a rank that dies meanwhile is reported at once anyway.
START_TIMEOUT = 600.0
EVERY_RANK = ("sizes", "profile_peak_bytes", "comm_stats", "pid", "unique_id", "join")
EVERY_RANK += ("device_memory", "read_blocks")  # answered by every rank


class Worker:
    """One rank: its cut of the model (its stage's layers, its shard of them) and the calls
    the engine makes on it. ``call`` answers the output rank's result, and every rank's for
    EVERY_RANK's calls; an exception propagates to the loop that runs the worker."""

    def __init__(self, rank: int, plan: dict, cfg, weights, engine_config):
        from threadpoolctl import threadpool_limits

        # the ranks share this host's cores: BLAS threads that outnumber them spin against each
        # other between products (SmolLM2 at TP 3 on 2 cores: 2.2 s a step, 0.17 s with 1)
        threadpool_limits(max(1, (os.cpu_count() or 1) // plan["world"]))
        tp = plan["tp"]
        self.stage, self.index = stage, index = divmod(rank, tp)
        shard, layers = Shard.of(cfg, index, tp), Stage.of(cfg, stage, plan["pp"])
        self.kv_part = (layers.layers, shard.kv_heads)  # its cut of a whole KV block
        self.groups = None  # a grouped model's KVGroups (the engine's: every layer's)
        self.cut = (shard, layers, cfg)  # for its cut of a LoRA adapter
        self.answers = rank == plan["output_rank"]
        if plan["backend"] != "numpy":  # the GPU backend's ranks: NCCL, joined by ``join``
            self.comm = None
            self.backend = _rank_cupy(plan["backend"], cfg, weights, engine_config, shard)
            return
        from engine.executor.rank_numpy import RankNumpyBackend

        self.comm = plan["comms"][stage].attach(index)
        prev = plan["links"].get((stage - 1, index))  # (receive end, send end) of a pipe
        nxt = plan["links"].get((stage, index))
        self.backend = RankNumpyBackend(
            cfg, weights, engine_config, shard, layers, self.comm, prev and prev[0], nxt and nxt[1]
        )

    def close(self) -> None:
        """Leave the NCCL communicator (the first rank's emulated one removes its block)."""
        comm = getattr(self.backend, "comm", None)
        if self.comm is None and comm is not None:
            comm.close()

    def call(self, name: str, args: tuple):
        if name == "sizes":
            result = (self.backend.weights_bytes, self.backend.bytes_per_block)
        elif name == "comm_stats":
            comm = self.comm or self.backend.comm
            result = (comm.calls, getattr(comm, "seconds", float("nan")))
        elif name == "unique_id":  # NCCL's: made by the first rank of each stage
            result = self.backend.unique_id() if self.index == 0 else None
        elif name == "join":
            result = self.backend.join(args[0][self.stage])
        elif name == "device_memory":  # (which device, its bytes)
            result = (self.backend.device.name, self.backend.total_memory_bytes())
        elif name == "pid":
            result = os.getpid()
        elif name == "read_blocks":  # its cut of the blocks, with where the cut starts
            layers, heads = self.kv_part
            result = (layers.start, heads.start, self.backend.read_blocks(*args))
        elif name == "write_blocks":  # whole blocks: it writes its cut
            (layers, heads), (ids, data, groups) = self.kv_part, args
            cut = data[:, :, :, :, heads.start : heads.stop]
            if self.groups is None:
                cut = cut[layers.start : layers.stop]
            else:  # its stage's slots of each block's group
                cut = cut_slots(self.groups, layers, cut, groups)
            result = self.backend.write_blocks(ids, cut)
        elif name == "use_kv_groups":
            self.groups = args[0]
            result = self.backend.use_kv_groups(*args)
        elif name == "block_dtype":
            result = self.backend.block_dtype
        elif name == "set_lora":  # a whole adapter: it keeps its cut
            slot, weights = args
            result = self.backend.set_lora(slot, shard_lora(weights, *self.cut))
        else:
            result = getattr(self.backend, name)(*args)
        # the output rank's logits stand for all (its stage's ranks have the same bits)
        return result if self.answers or name in EVERY_RANK else None


def _rank_cupy(backend: str, cfg, weights, engine_config, shard: Shard):
    """A GPU-backend rank: on the emulated device (``cuda-cpu``), or on GPU ``rank % GPUs``
    (several ranks may share one: NCCL_MULTI_RANK_GPU_ENABLE=1 with NCCL >= 2.30)."""
    from engine.devices.device import CupyDevice, gpu_count
    from engine.emulation.device import EmulatedDevice
    from engine.executor.rank_cupy import RankCupyBackend

    if backend == "cuda-cpu":
        device = EmulatedDevice()
    else:
        device = CupyDevice(shard.rank % max(gpu_count(), 1))
    return RankCupyBackend(cfg, weights, engine_config, shard, device)


def _worker(rank: int, plan: dict, cfg, weights, engine_config, conn) -> None:
    """A forked rank's loop: build its Worker, then run each call the engine sends until it
    closes; an error goes back as the answer. Ctrl-C reaches the whole process group: the
    engine's process decides what stops, so the workers ignore it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(rank, plan, cfg, weights, engine_config)
        del weights
    except Exception as e:  # noqa: BLE001 - sent to the engine, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            name, args = conn.recv()
        except EOFError:  # the engine is gone
            name = "stop"
        if name == "stop":
            worker.close()
            return
        try:
            conn.send(("ok", worker.call(name, args)))
        except Exception as e:  # noqa: BLE001
            log.debug("rank %d: %s", rank, traceback.format_exc())
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Executor(Backend):
    """``tensor_parallel_size x pipeline_parallel_size`` NumPy ranks behind one Backend: every
    call runs on every rank (``_call``, over the subclass's channel). The sizes the memory plan
    reads are the ranks' sums (they share this host's RAM)."""

    supports_kv_groups = True  # every rank runs them (a pipeline stage its layers' groups)

    def _plan(self, cfg: ModelConfig, engine_config, timeout: float, backend: str) -> int:
        """Check the sizes and set what every executor knows; the shared-memory slot bytes.
        ``backend``: the ranks' (numpy, cuda or cuda-cpu)."""
        tp, pp = engine_config.tensor_parallel_size, engine_config.pipeline_parallel_size
        check_tensor_parallel(cfg, tp)
        check_pipeline_parallel(cfg, pp)
        self.cfg, self.tp, self.pp, self.world = cfg, tp, pp, engine_config.world_size
        self.timeout = timeout
        self.rank_backend, self.name = backend, f"{backend}-{self.kind}"
        self.block_size = engine_config.block_size
        self.kv_dtype = resolve_kv_dtype(engine_config.dtype, cfg, on_gpu=backend == "cuda")
        self.output_rank = (pp - 1) * tp
        self.nccl_version = None
        self.nccl_ids: list = []  # the emulated NCCL's unique ids, once the ranks made them
        return engine_config.max_num_batched_tokens * cfg.hidden_size * 4  # (T, D) float32

    def _started(self) -> None:
        if self.rank_backend != "numpy":  # NCCL: each stage's first rank makes the unique id
            ids = self._call("unique_id", all_ranks=True)
            if self.rank_backend == "cuda-cpu":  # the emulated NCCL's blocks, for _stop
                self.nccl_ids.extend(ids[:: self.tp])
            versions = self._call("join", ids[:: self.tp], all_ranks=True)
            self.nccl_version = versions[0]
            log.info("NCCL %s: %d ranks joined", self.nccl_version, self.world)
        self.rank_sizes = self._call("sizes", all_ranks=True)  # [(weights, per block)] per rank
        self.pids = self._call("pid", all_ranks=True)
        for rank, (w, per_block) in enumerate(self.rank_sizes):
            self._log_rank(rank, w, per_block)

    def _where(self, rank: int) -> str:
        stage, index = divmod(rank, self.tp)
        return f"worker rank {rank} (stage {stage}, tensor-parallel rank {index})"

    def _log_rank(self, rank: int, weights: int, per_block: int) -> None:
        stage, index = divmod(rank, self.tp)
        s, layers = Shard.of(self.cfg, index, self.tp), Stage.of(self.cfg, stage, self.pp).layers
        log.info(
            "rank %d/%d (pid %d): stage %d layers %d-%d, query heads %d-%d, KV heads %d-%d, "
            "MLP units %d-%d, vocabulary %d-%d; weights %s, %d KV bytes per block",
            rank,
            self.world,
            self.pids[rank],
            stage,
            layers.start,
            layers.stop - 1,
            s.q_heads.start,
            s.q_heads.stop - 1,
            s.kv_heads.start,
            s.kv_heads.stop - 1,
            s.ffn.start,
            s.ffn.stop - 1,
            s.vocab.start,
            s.vocab.stop - 1,
            mib(weights),
            per_block,
        )

    # ---- what the memory plan reads: every rank's, summed ----
    @property
    def weights_bytes(self) -> int:
        return sum(w for w, _ in self.rank_sizes)

    @property
    def bytes_per_block(self) -> int:
        return sum(b for _, b in self.rank_sizes)

    def total_memory_bytes(self) -> int:
        """The memory of the ranks' devices, each device once (ranks may share one)."""
        return sum(dict(self._call("device_memory", all_ranks=True)).values())

    def profile_peak_bytes(self, num_tokens: int, max_seq_len: int, num_seqs: int) -> int:
        peaks = self._call("profile_peak_bytes", num_tokens, max_seq_len, num_seqs, all_ranks=True)
        return sum(peaks)

    # ---- the calls every rank runs ----
    def use_kv_groups(self, groups) -> None:
        """Every rank's pool in the groups' slots (a stage's, ``KVGroups.stage``); the sizes
        the memory plan reads are asked again."""
        super().use_kv_groups(groups)
        self._call("use_kv_groups", groups)
        self.rank_sizes = self._call("sizes", all_ranks=True)

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self._call("allocate_kv_cache", num_blocks, num_cpu_blocks)

    def swap_out(self, pairs) -> None:
        self._call("swap_out", np.asarray(pairs))

    def swap_in(self, pairs) -> None:
        self._call("swap_in", np.asarray(pairs))

    def copy_blocks(self, pairs) -> None:
        if len(pairs):
            self._call("copy_blocks", np.asarray(pairs))

    # ---- the KV tiers: whole blocks, gathered from the ranks' cuts ----
    @property
    def block_dtype(self) -> np.dtype:
        return self._call("block_dtype")

    def read_blocks(self, ids, groups=None) -> np.ndarray:
        """(L, 2, n, bs, Hkv, hd): each stage's layers, each shard's KV heads once (ranks that
        share a head, where tensor_parallel_size exceeds the KV heads, hold the same bytes); a
        grouped pool's (G, 2, ...), each block's slots from the stages that hold them
        (``groups``: each block's KV group)."""
        cuts: dict[int, dict[int, np.ndarray]] = {}
        for layer, head, part in self._call("read_blocks", np.asarray(ids), all_ranks=True):
            cuts.setdefault(layer, {})[head] = part  # (L_stage, 2, n, bs, Hkv_rank, hd)
        stages = [
            np.concatenate([h[k] for k in sorted(h)], axis=4) for _, h in sorted(cuts.items())
        ]
        if self.kv_groups is None or self.pp == 1:
            return np.concatenate(stages, axis=0)
        layers = [Stage.of(self.cfg, s, self.pp).layers for s in range(self.pp)]
        return gather_slots(self.kv_groups, list(zip(layers, stages, strict=True)), groups)

    def write_blocks(self, ids, data: np.ndarray, groups=None) -> None:
        groups = None if groups is None else np.asarray(groups)
        self._call("write_blocks", np.asarray(ids), data, groups)

    def set_lora(self, slot: int, weights) -> None:
        """Every rank keeps its cut of the adapter in ``slot`` (sharding.py ``shard_lora``)."""
        self._call("set_lora", slot, weights)

    def forward(self, batch) -> np.ndarray:
        return self._call("forward", batch)

    def forward_greedy(self, batch) -> np.ndarray:
        return self._call("forward_greedy", batch)

    def hidden_states(self, batch) -> np.ndarray:
        """The pooling runner's rows (every rank runs the layers' collectives)."""
        return self._call("hidden_states", batch)

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """A reranker's logits (every rank multiplies its vocabulary slice; they gather)."""
        return self._call("head_logits", h)

    def comm_stats(self) -> list[tuple[int, float]]:
        """(collectives, seconds in them) of each rank since it started (its stage's)."""
        return self._call("comm_stats", all_ranks=True)

    def shutdown(self) -> None:
        self._finalizer()


class MultiprocExecutor(Executor):
    """The ranks as forked worker processes, a pipe each."""

    kind = "mp"

    def __init__(
        self, cfg: ModelConfig, weights, engine_config, backend="numpy", timeout: float = 60.0
    ):
        slot = self._plan(cfg, engine_config, timeout, backend)
        # a GPU is unusable in a process forked after CUDA started (asking how many GPUs there
        # are starts it): the cuda backend's ranks start afresh, their weights pickled to them
        ctx = mp.get_context("spawn" if backend == "cuda" else "fork")
        tp, pp = self.tp, self.pp
        self.comms = [ShmComm(tp, slot, timeout) for _ in range(pp)] if backend == "numpy" else []
        links = {(s, i): ctx.Pipe(duplex=False) for s in range(pp - 1) for i in range(tp)}
        plan = dict(tp=tp, pp=pp, world=self.world, comms=self.comms, links=links)
        plan["backend"] = backend
        plan["output_rank"] = self.output_rank
        self.procs, self.conns = [], []
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            args = (rank, plan, cfg, weights, engine_config, child)
            proc = ctx.Process(target=_worker, args=args, name=f"rank-{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        for recv_end, send_end in links.values():  # the workers hold them now
            recv_end.close()
            send_end.close()
        self._finalizer = weakref.finalize(
            self, _stop, self.procs, self.conns, self.comms, self.nccl_ids
        )
        self._gather("starting", START_TIMEOUT)
        self._started()

    # ---- the channel ----
    def _call(self, name: str, *args, all_ranks: bool = False):
        """Run ``name(*args)`` on every rank: the output rank's result (every rank's, in rank
        order, with all_ranks)."""
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((name, args))
            except (BrokenPipeError, OSError):
                self._fail(rank, self._gone(rank))
        results = self._gather(name)
        return results if all_ranks else results[self.output_rank]

    def _gather(self, what: str, timeout: float | None = None) -> list:
        """Each rank's answer, in rank order; RuntimeError for an error, a death (whichever rank
        dies: the others wait in a collective for it) or no answer in ``timeout`` seconds (the
        executor's own by default)."""
        results: dict[int, object] = {}
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(results) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                late = min(set(range(self.world)) - set(results))
                self._fail(late, f"no answer to {what} in {timeout:g} s")
            waiting = [c for r, c in enumerate(self.conns) if r not in results]
            ready = mp.connection.wait([*waiting, *sentinels], min(left, 1.0))
            for rank, conn in enumerate(self.conns):
                if rank not in results and conn in ready:
                    results[rank] = self._recv(rank)
            for sentinel in ready:
                rank = sentinels.get(sentinel)
                if rank is not None and rank not in results and not self.conns[rank].poll(0):
                    self._fail(rank, self._gone(rank))
        return [results[r] for r in range(self.world)]

    def _recv(self, rank: int):
        try:
            status, value = self.conns[rank].recv()
        except (EOFError, OSError):  # closed, or reset by a killed worker
            self._fail(rank, self._gone(rank))
        if status == "error":
            self._fail(rank, value)
        return value

    def _gone(self, rank: int) -> str:
        """Why a rank's pipe closed: its exit code (a process's pipes close as it exits, a
        moment before it can be reaped: wait for that)."""
        self.procs[rank].join(1)
        code = self.procs[rank].exitcode
        return "its pipe is closed" if code is None else f"it died (exit code {code})"

    def _fail(self, rank: int, why: str):
        for proc in self.procs:  # the others may wait in a collective for the failed one
            proc.kill()
        self._finalizer()
        raise RuntimeError(f"{self._where(rank)}: {why}")


def _stop(procs, conns, comms: list[ShmComm], nccl_ids: list) -> None:
    """Stop every worker (politely, then not) and remove the shared blocks (the emulated
    NCCL's too: a first rank that was killed cannot)."""
    for conn in conns:
        try:
            conn.send(("stop", ()))
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join(2)
    for conn in conns:
        conn.close()
    for comm in comms:
        comm.close()
    for commId in nccl_ids:
        remove_block(commId)
