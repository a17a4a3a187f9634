"""The emulated NCCL between forked rank processes: the sums and gathers of NumPy, the same bits
on every rank, and each of NCCL's rules broken on purpose (every rank raises, none hangs)."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import ml_dtypes
import numpy as np
import pytest

from engine.devices.nccl import NCCL_BFLOAT16, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_SUM
from engine.emulation import nccl as nccl_emu
from engine.emulation import runtime as emulated
from engine.emulation.device import EmulatedDevice

LIB = nccl_emu.EMULATED_NCCL
TYPES = {np.float32: NCCL_FLOAT32, np.float16: NCCL_FLOAT16, ml_dtypes.bfloat16: NCCL_BFLOAT16}


OPENED: list = []  # a rank's communicators, destroyed when its scenario ends


def _child(fn, world, uid, rank, seed, out):
    LIB.timeout = 1.0
    try:
        out.put((rank, "ok", fn(world, uid, rank, np.random.default_rng(seed + rank))))
    except Exception as e:  # noqa: BLE001 - the test reads it
        out.put((rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    finally:
        for comm in OPENED:
            if comm.shm is not None:
                comm.shm.close()


def run_ranks(fn, world: int = 2, skip: int | None = None, seed: int | None = None) -> dict:
    """fn(world, uid, rank, rng) in a forked process per rank (but ``skip``) -> rank: (status,
    value), within 20 s."""
    seed = int(np.random.default_rng().integers(1 << 30)) if seed is None else seed
    ctx, uid = mp.get_context("fork"), LIB.get_unique_id()
    out = ctx.Queue()
    ranks = [r for r in range(world) if r != skip]
    procs = [ctx.Process(target=_child, args=(fn, world, uid, r, seed, out)) for r in ranks]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in ranks:
            rank, status, value = out.get(timeout=20)
            got[rank] = (status, value)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return got


def _comm(world, uid, rank):
    OPENED.append(LIB.NcclCommunicator(world, uid, rank))
    return OPENED[-1]


def _all_reduce(comm, x: np.ndarray, stream: int = 0) -> np.ndarray:
    out = np.empty_like(x)
    comm.allReduce(x.ctypes.data, out.ctypes.data, x.size, TYPES[x.dtype.type], NCCL_SUM, stream)
    return out


def _inputs(rng, rank):
    x32 = rng.standard_normal((37, 11)).astype(np.float32)
    x16 = rng.standard_normal(300).astype(np.float16)
    xbf = rng.standard_normal(129).astype(ml_dtypes.bfloat16)
    big = rng.standard_normal(300_000).astype(np.float32)  # two pieces of a 1 MiB slot
    return x32, x16, xbf, big


def _collectives(world, uid, rank, rng):
    comm = _comm(world, uid, rank)
    results = [_all_reduce(comm, x) for x in _inputs(rng, rank)]
    g = rng.standard_normal((5, 3)).astype(np.float32)
    gathered = np.empty((world, 5, 3), np.float32)
    comm.allGather(g.ctypes.data, gathered.ctypes.data, g.size, NCCL_FLOAT32, 0)
    place = np.zeros((world, 4), np.float16)  # in place: each rank's slice of the output
    place[rank] = rank + 1
    send = place[rank : rank + 1]
    comm.allGather(send.ctypes.data, place.ctypes.data, 4, NCCL_FLOAT16, 0)
    comm.destroy()
    return results, gathered, place


def test_sums_and_gathers_are_numpys_with_the_same_bits_on_every_rank():
    seed = int(np.random.default_rng().integers(1 << 30))
    got = run_ranks(_collectives, world=3, seed=seed)
    inputs = [_inputs(np.random.default_rng(seed + r), r) for r in range(3)]
    gathers = []
    for r in range(3):
        rng = np.random.default_rng(seed + r)
        _inputs(rng, r)
        gathers.append(rng.standard_normal((5, 3)).astype(np.float32))
    for r in range(3):
        status, (sums, gathered, place) = got[r]
        assert status == "ok"
        for i, s in enumerate(sums):
            parts = [inputs[q][i].astype(np.float32) for q in range(3)]
            want = ((parts[0] + parts[1]) + parts[2]).astype(s.dtype)  # float32, rank order
            np.testing.assert_array_equal(s, want)
            np.testing.assert_array_equal(s, got[0][1][0][i])  # every rank: the same bits
        np.testing.assert_array_equal(gathered, np.stack(gathers))
        np.testing.assert_array_equal(place, np.repeat(np.arange(1, 4)[:, None], 4, 1))


def _mismatch(kind):
    def fn(world, uid, rank, rng):
        comm = _comm(world, uid, rank)
        x = rng.standard_normal(64).astype(np.float32)
        _all_reduce(comm, x)  # call 1 agrees
        if rank == 1 and kind == "count":
            x = x[:63].copy()
        if rank == 1 and kind == "dtype":
            x = x.astype(np.float16)
        if rank == 1 and kind == "order":
            out = np.empty((world, 64), np.float32)
            comm.allGather(x.ctypes.data, out.ctypes.data, 64, NCCL_FLOAT32, 0)
            return None
        _all_reduce(comm, x)
        return None

    return fn


@pytest.mark.parametrize(
    "kind, said",
    [
        ("count", "call 2: allReduce(count=64, float32, sum); rank 1: call 2: allReduce(count=63"),
        ("dtype", "rank 1: call 2: allReduce(count=64, float16, sum)"),
        ("order", "rank 0: call 2: allReduce(count=64, float32, sum); rank 1: call 2: allGather("),
    ],
)  # fmt: skip
def test_ranks_that_call_different_collectives_all_raise(kind, said):
    got = run_ranks(_mismatch(kind))
    for rank in (0, 1):
        status, message = got[rank]
        assert status == "EmuNcclError", message
        assert "NCCL rule broken: every rank must make the same collectives" in message
        assert said in message


def _group(world, uid, rank, rng):
    comm = _comm(world, uid, rank)
    x = np.full(8, rank + 1.0, np.float32)
    LIB.groupStart()
    comm.allReduce(x.ctypes.data, x.ctypes.data, 8, NCCL_FLOAT32, NCCL_SUM, 0)
    inside = x.copy()  # not yet: a group's collectives run at its end
    LIB.groupEnd()
    after = x.copy()
    try:
        LIB.groupEnd()
    except nccl_emu.EmuNcclError as e:
        return inside, after, str(e)
    return inside, after, None


def test_a_group_runs_at_its_end_and_an_unmatched_end_is_refused():
    got = run_ranks(_group)
    for rank in (0, 1):
        inside, after, unmatched = got[rank][1]
        np.testing.assert_array_equal(inside, rank + 1.0)  # stale inside the group
        np.testing.assert_array_equal(after, 3.0)
        assert unmatched == "ncclInvalidUsage: ncclGroupEnd without a ncclGroupStart"


def _capture_rules(world, uid, rank, rng):
    comm = _comm(world, uid, rank)
    stream, other = emulated.EmuStream(), emulated.EmuStream()
    x = np.ones(4, np.float32)
    refusals = []
    with stream:
        stream.begin_capture()
        for call in (
            lambda: _all_reduce(comm, x, other.ptr),  # another stream than the capturing one
            lambda: LIB.NcclCommunicator(world, LIB.get_unique_id(), rank),
            lambda: comm.destroy(),
        ):
            try:
                call()
            except (emulated.EmuCudaError, nccl_emu.EmuNcclError) as e:
                refusals.append(str(e))
        LIB.groupStart()
        comm.allReduce(x.ctypes.data, x.ctypes.data, 4, NCCL_FLOAT32, NCCL_SUM, stream.ptr)
        stream.end_capture()
    try:
        LIB.groupEnd()  # after its capture ended: not in the graph
    except nccl_emu.EmuNcclError as e:
        refusals.append(str(e))
    return refusals


def test_collectives_keep_to_the_capturing_stream_and_its_capture():
    got = run_ranks(_capture_rules)
    for rank in (0, 1):
        status, refusals = got[rank]
        assert status == "ok", refusals
        assert len(refusals) == 4, refusals
        assert "ncclAllReduce during stream capture on another stream" in refusals[0]
        assert refusals[1] == "ncclCommInitRank while a stream captures a CUDA graph"
        assert refusals[2] == "ncclCommDestroy while a stream captures a CUDA graph"
        assert (
            "ncclGroupEnd after the capture its ncclAllReduce was queued in had ended"
            in (refusals[3])
        )


def _graph(fresh_buffer: bool):
    def fn(world, uid, rank, rng):
        dev = EmulatedDevice()
        comm = _comm(world, uid, rank)
        buf = dev.upload(np.full(6, rank + 1.0, np.float32))
        copies = []

        def step():
            if fresh_buffer:  # a copy the step keeps: a new address each call
                copies.append(np.array(buf))
            x = copies[-1] if fresh_buffer else buf
            comm.allReduce(dev.ptr(x), dev.ptr(x), 6, NCCL_FLOAT32, NCCL_SUM, dev.stream.ptr)
            return buf

        graph = dev.capture(step)  # the warm-up and the capture each sum once
        logged = [e[0] for e in dev.stream.log]
        graph()
        return logged, buf.copy()

    return fn


def test_a_graph_captures_its_collectives_and_its_replay_must_make_them_again():
    got = run_ranks(_graph(False))
    for rank in (0, 1):
        logged, buf = got[rank][1]
        assert logged == ["ncclAllReduce"]
        np.testing.assert_array_equal(buf, 3.0 * 2 * 2)  # summed, then doubled twice
    got = run_ranks(_graph(True))
    for rank in (0, 1):
        status, message = got[rank]
        assert status == "RuntimeError" and "graph replay differs from its capture" in message


def _lonely(world, uid, rank, rng):
    comm = _comm(world, uid, rank)
    return _all_reduce(comm, np.ones(4, np.float32))


def test_a_missing_rank_is_an_error_within_the_timeout_not_a_hang():
    start = time.monotonic()
    got = run_ranks(_lonely, world=3, skip=2)  # rank 2 never joins
    assert time.monotonic() - start < 10
    for rank in (0, 1):
        status, message = got[rank]
        assert status == "EmuNcclError"
        assert "another tensor-parallel rank did not reach the collective within 1 s" in message


def _sizes(world, uid, rank, rng):
    return _comm(world + rank, uid, rank)  # rank 1 says 3 ranks, rank 0 two


def test_ranks_that_disagree_on_the_size_are_refused():
    got = run_ranks(_sizes)
    assert got[1][0] == "EmuNcclError"
    assert "rank 1 was given 3 ranks, rank 0 another count" in got[1][1]
    assert got[0][0] == "EmuNcclError"  # rank 0 waits for a rank 1 of its own in vain


def test_a_rank_that_finds_the_block_still_empty_waits_for_its_size():
    """Rank 0 makes the block and then gives it its size: a rank that opens it in between finds
    an empty block, and must wait, not take it for a communicator of another size."""
    import os
    import threading

    from engine.devices.comm import ShmComm
    from engine.emulation.nccl import SLOT_BYTES, EmulatedNcclCommunicator

    name = f"emunccl-test-{os.getpid()}"
    os.close(os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600))  # made, no size yet
    made = []

    def rank0():
        time.sleep(0.2)
        os.unlink(f"/dev/shm/{name}")
        made.append(ShmComm(2, SLOT_BYTES, 5.0, name=name).attach(0))

    thread = threading.Thread(target=rank0)
    thread.start()
    try:
        comm = EmulatedNcclCommunicator._open(name, 2, 1, timeout=5.0)
        assert comm.rank == 1 and comm.world == 2
        comm.close()
    finally:
        thread.join()
        for c in made:
            c._owner = True  # rank 0's: its close removes the block
            c.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
