"""AsyncLLM: one engine thread, many asyncio callers; cancelling a caller aborts its request."""

import asyncio
import logging
import threading
import time

import pytest

from engine.frontend.async_llm import AsyncLLM, EngineDeadError, LoggingStatLogger, QueueFullError
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from tests.utils import SEED_PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(params=[False, True], ids=["sync-steps", "async-scheduling"])
def allm(tiny, request):
    llm = AsyncLLM(make_engine(tiny, async_scheduling=request.param))
    yield llm
    llm.shutdown()


async def _final(llm, prompt, params):
    last = None
    async for out in llm.generate(prompt, params):
        last = out
    return last


def test_concurrent_requests_match_the_sync_engine(tiny, allm):
    async def main():
        return await asyncio.gather(*[_final(allm, p, GREEDY) for p in SEED_PROMPTS * 4])

    outs = asyncio.run(main())
    want = run_to_completion(make_engine(tiny), SEED_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want] * 4
    assert all(o.finished for o in outs)


def test_cancelling_a_consumer_frees_its_blocks(allm):
    bm = allm.engine.block_manager
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        task = asyncio.create_task(_final(allm, "hello there", long))
        while bm.num_free_blocks == bm.num_blocks:  # wait until it holds blocks
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):
            if bm.num_free_blocks == bm.num_blocks and allm.num_unfinished == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert bm.num_free_blocks == bm.num_blocks
    assert not allm.engine.has_unfinished_requests()


def test_bad_input_and_full_queue_raise_at_add(tiny, allm):
    llm = AsyncLLM(make_engine(tiny, max_num_seqs=2), max_waiting_requests=0)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await allm.add_request([1] * 300, GREEDY)
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        await llm.add_request("hi", long)  # two free run slots take two sequences
        await llm.add_request("hi", long)
        with pytest.raises(QueueFullError, match="at most 0 may wait"):
            await llm.add_request("hi", GREEDY)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def test_final_only_streams_get_one_output_with_the_streamed_tokens_and_all_are_counted(tiny, allm):
    """A request added final_only gets its finished output alone, equal to a streamed
    request's last; the step counters still count every token of both kinds as it comes."""
    counted = {"generation": 0, "prompt": 0}

    def count(stats):
        counted["generation"] += stats.generation_tokens
        counted["prompt"] += stats.prompt_tokens

    allm.stat_loggers.append(count)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, n=2, ignore_eos=True)

    async def outputs(final_only):
        stream = await allm.add_request(SEED_PROMPTS[1], params, final_only=final_only)
        return [out async for out in stream]

    async def main():
        return await asyncio.gather(outputs(True), outputs(False))

    final, streamed = asyncio.run(main())
    deadline = time.monotonic() + 10  # the last step's counts are logged after its outputs go
    while counted["generation"] < 2 * 2 * 12 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(final) == 1 and final[0].finished and len(streamed) > 1
    for a, b in zip(final[0].outputs, streamed[-1].outputs, strict=True):
        assert (a.token_ids, a.text) == (b.token_ids, b.text) and len(a.token_ids) == 12
    assert counted["generation"] == 2 * 2 * 12  # two requests of two samples
    assert counted["prompt"] == 2 * len(final[0].prompt_token_ids)


def test_stats_log_line(allm, caplog):
    allm.stat_loggers.append(LoggingStatLogger(interval=0.0))
    with caplog.at_level(logging.INFO, logger="engine.async"):
        asyncio.run(_final(allm, "hi my name is", GREEDY))
    line = next(r.message for r in caplog.records if "throughput" in r.message)
    assert "running" in line and "KV cache usage" in line and "prefix cache hit rate" in line


def test_a_request_queued_as_the_engine_dies_is_refused_not_left_waiting(tiny):
    """An add queued while the engine thread is in the step that kills it: the thread must
    answer it (EngineDeadError) as it dies, or its caller would wait for ever."""
    in_step, release = threading.Event(), threading.Event()

    def die(_stats):
        in_step.set()
        release.wait(5)
        raise RuntimeError("boom")

    llm = AsyncLLM(make_engine(tiny), stat_loggers=[die])

    async def run():
        first = asyncio.ensure_future(_final(llm, "hi", GREEDY))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 5)
        second = asyncio.ensure_future(llm.add_requests(["hello"], GREEDY))  # queued now
        await asyncio.sleep(0.1)
        release.set()
        for task in (first, second):
            with pytest.raises(EngineDeadError, match="engine loop died: RuntimeError"):
                await asyncio.wait_for(task, 5)

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
