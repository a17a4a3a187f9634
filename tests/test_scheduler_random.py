"""Random workloads (hypothesis) driving the scheduler with a fake paged "model".

The fake model keeps a real paged cache of token ids: (num_blocks, block_size) for the GPU pool and
(num_cpu_blocks, block_size) for the CPU pool. Every step it runs the swaps, writes each scheduled
token into its slot through the seq's block table, reads the whole context back through the table,
and checks it equals the seq's true token ids: any block shared, reused too early, swapped to the
wrong place or lost shows up as a wrong context. The sampled token is a hash of the context, so it
is the same whatever else is in the batch, and after a recompute preemption.

Prompts share prefixes (a prefix of one of two base prompts, then their own tokens). With prefix
caching on, every cached hash must also match the token ids the fake cache holds in its block.
Batches arrive together, so later prompts share blocks that an earlier one computes in the same
step; some are aborted between schedule and update (their blocks go back after the step).
"""

import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager, hash_block
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 48


def next_token(context: list[int]) -> int:
    """A deterministic "model": the next token depends only on the context."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 + len(context)) % 1000


class FakePagedModel:
    def __init__(self, num_blocks: int, num_cpu_blocks: int, block_size: int):
        self.bs = block_size
        self.gpu = np.full((num_blocks, block_size), -1, dtype=np.int64)  # (N, bs) token ids
        self.cpu = np.full((max(num_cpu_blocks, 1), block_size), -1, dtype=np.int64)  # (M, bs)

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        """Swaps, then every scheduled token written, then every context read: like a backend,
        which writes a step's K/V in each layer before attention reads the cache."""
        for gpu, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = self.gpu[gpu]
            self.gpu[gpu] = -1  # a freed block's old contents must never be read again
        for cpu, gpu in out.blocks_to_swap_in:
            self.gpu[gpu] = self.cpu[cpu]
            self.cpu[cpu] = -1
        for seq, n in out.scheduled:
            self._write(seq, n)
        return {seq.seq_id: self._read(seq, n) for seq, n in out.scheduled}

    def _slots(self, seq: Sequence, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(start, end)  # (end - start,)
        return np.asarray(seq.block_table)[pos // self.bs], pos % self.bs

    def _write(self, seq: Sequence, n: int) -> None:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        self.gpu[self._slots(seq, start, end)] = seq.token_ids[start:end]

    def _read(self, seq: Sequence, n: int) -> int:
        end = seq.num_computed_tokens + n
        tokens = seq.token_ids[:end]
        context = self.gpu[self._slots(seq, 0, end)].tolist()  # (end,) read through the table
        assert context == tokens, f"{seq}: cache holds {context} not {tokens}"
        return next_token(context)


@dataclass
class Req:
    arrival_step: int
    prompt_len: int
    max_tokens: int
    abort_step: int | None
    shared_len: int = 0  # leading tokens taken from base prompt `base`
    base: int = 0
    abort_mid: int | None = None  # a step to abort in, between schedule and update


requests = st.lists(
    st.builds(
        Req,
        arrival_step=st.integers(0, 12),
        prompt_len=st.integers(1, 52),
        max_tokens=st.integers(1, 24),
        abort_step=st.none() | st.integers(0, 40),
        shared_len=st.integers(0, 52),
        base=st.integers(0, 1),
    ),
    min_size=1,
    max_size=10,
)


batches = st.lists(
    st.builds(
        Req,
        arrival_step=st.integers(0, 1),
        prompt_len=st.integers(1, 40),
        max_tokens=st.integers(1, 12),
        abort_step=st.none(),
        shared_len=st.integers(8, 40),
        base=st.integers(0, 1),
        abort_mid=st.none() | st.integers(0, 20),
    ),
    min_size=2,
    max_size=8,
)


modes = st.sampled_from(["recompute", "swap"])


@st.composite
def engines(draw, prefix_caching: bool = False):
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 64)) if chunked else MAX_MODEL_LEN
    config = EngineConfig(
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        preemption_mode="recompute" if prefix_caching else draw(modes),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix_caching,
    )
    tokens_in_pool = draw(st.integers(8, 3 * MAX_MODEL_LEN))  # below one max-length seq, often
    num_blocks = max(2, tokens_in_pool // config.block_size)
    num_cpu_blocks = 0 if prefix_caching else draw(st.integers(0, 12))
    return config, num_blocks, num_cpu_blocks


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """What one step may schedule: decodes first, within the limits, with room in the tables."""
    cfg, bm = sched.config, sched.block_manager
    assert all(n == 1 for _, n in out.scheduled[: out.num_decodes])
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert len({seq.seq_id for seq, _ in out.scheduled}) == len(out.scheduled)
    for seq, n in out.scheduled:
        assert seq.status == SequenceStatus.RUNNING and n >= 1
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
        assert cfg.enable_chunked_prefill or seq.num_computed_tokens + n == seq.num_tokens


def check_cached_contents(bm: BlockManager, model: FakePagedModel) -> None:
    """Every hash in the cache map names a block whose tokens (in the fake cache) hash to it."""
    for h, block in bm.cached.items():
        parent, _ = bm.block_keys[block]
        assert hash_block(parent, model.gpu[block].tolist()) == h, f"block {block} was changed"


def make_seqs(reqs: list[Req], rng: random.Random) -> list[Sequence]:
    bases = [[rng.randrange(1000) for _ in range(MAX_MODEL_LEN)] for _ in range(2)]
    seqs = []
    for i, r in enumerate(reqs):
        shared = min(r.shared_len, r.prompt_len)
        own = [rng.randrange(1000) for _ in range(r.prompt_len - shared)]
        params = SamplingParams(max_tokens=r.max_tokens)
        seqs.append(Sequence(f"r{i}", bases[r.base][:shared] + own, params, float(i)))
    return seqs


def run_workload(config, num_blocks, num_cpu_blocks, reqs, seed):
    bm = BlockManager(num_blocks, config.block_size, num_cpu_blocks, config.enable_prefix_caching)
    sched = Scheduler(config, bm)
    model = FakePagedModel(num_blocks, num_cpu_blocks, config.block_size)
    seqs = make_seqs(reqs, random.Random(seed))
    rejected = {}
    bound = 12 + 4 * sum(r.prompt_len + r.max_tokens for r in reqs) * (1 + len(reqs))
    for step in range(bound):
        for seq, r in zip(seqs, reqs, strict=True):
            if r.arrival_step == step:
                sched.add(seq)
            if r.abort_step == step and r.arrival_step <= step:
                sched.abort(seq.request_id)
        if step > max(r.arrival_step for r in reqs) and not sched.has_unfinished():
            break
        out = sched.schedule()
        check_output(sched, out)
        sched.check_invariants()
        for seq, r in zip(seqs, reqs, strict=True):
            if r.abort_mid == step and sched.abort(seq.request_id):
                sched.check_invariants()  # its blocks stay until the step has run
        for seq in sched.update(out, model.execute(out)):
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= MAX_MODEL_LEN:
                sched.finish(seq, "length")
        rejected.update({seq.seq_id: reason for seq, reason in sched.take_rejected()})
        sched.check_invariants()
        check_cached_contents(bm, model)
    else:
        raise AssertionError(f"workload did not finish in {bound} steps")
    return sched, seqs, rejected


def check_outcome(sched, seqs, reqs, rejected):
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
    for seq, r in zip(seqs, reqs, strict=True):
        assert seq.is_finished and seq.block_table == [] and seq.cpu_block_table == []
        context = list(seq.prompt_token_ids)
        for token in seq.output_token_ids:  # the same tokens however the seq was batched
            assert token == next_token(context)
            context.append(token)
        if seq.seq_id in rejected:
            too_long = seq.num_tokens > MAX_MODEL_LEN
            assert too_long or bm.blocks_for_tokens(seq.num_tokens) > bm.num_blocks
        elif seq.finish_reason == "length":
            assert seq.num_output_tokens == r.max_tokens or seq.num_tokens >= MAX_MODEL_LEN
        else:
            assert seq.finish_reason == "abort"
            assert r.abort_step is not None or r.abort_mid is not None


@settings(max_examples=200, deadline=None)
@given(engine=engines(), reqs=requests, seed=st.integers(0, 2**16))
def test_random_workloads_keep_invariants_and_finish(engine, reqs, seed):
    config, num_blocks, num_cpu_blocks = engine
    sched, seqs, rejected = run_workload(config, num_blocks, num_cpu_blocks, reqs, seed)
    check_outcome(sched, seqs, reqs, rejected)


@settings(max_examples=150, deadline=None)
@given(engine=engines(prefix_caching=True), reqs=requests, seed=st.integers(0, 2**16))
def test_random_workloads_with_prefix_caching(engine, reqs, seed):
    config, num_blocks, _ = engine
    sched, seqs, rejected = run_workload(config, num_blocks, 0, reqs, seed)
    check_outcome(sched, seqs, reqs, rejected)


@settings(max_examples=150, deadline=None)
@given(engine=engines(prefix_caching=True), reqs=batches, seed=st.integers(0, 2**16))
def test_random_batches_share_blocks_within_a_step(engine, reqs, seed):
    """Prompts with long shared prefixes arriving together: same-step sharing under preemption,
    chunked prefill and aborts in flight keeps the invariants and every token."""
    config, num_blocks, _ = engine
    sched, seqs, rejected = run_workload(config, num_blocks, 0, reqs, seed)
    check_outcome(sched, seqs, reqs, rejected)


@settings(max_examples=50, deadline=None)
@given(engine=engines(), reqs=batches, seed=st.integers(0, 2**16))
def test_random_batches_without_caching_abort_in_flight(engine, reqs, seed):
    config, num_blocks, num_cpu_blocks = engine
    sched, seqs, rejected = run_workload(config, num_blocks, num_cpu_blocks, reqs, seed)
    check_outcome(sched, seqs, reqs, rejected)


@pytest.mark.parametrize("chunked", [False, True])
def test_shared_prefixes_hit_the_cache(chunked):
    """A fixed workload where later prompts share 20-40 tokens with earlier ones: hits happen,
    and the tokens equal those of the same workload without the cache."""
    fields = dict(block_size=4, max_model_len=MAX_MODEL_LEN, max_num_seqs=3)
    fields.update(enable_chunked_prefill=chunked, max_num_batched_tokens=24 if chunked else 48)
    reqs = [Req(i, 30 + i, 10, None, shared_len=20 + 5 * i, base=i % 2) for i in range(6)]
    outcomes = []
    for caching in (False, True):
        config = EngineConfig(**fields, enable_prefix_caching=caching)
        sched, seqs, rejected = run_workload(config, 24, 0, reqs, seed=5)
        check_outcome(sched, seqs, reqs, rejected)
        outcomes.append([s.output_token_ids for s in seqs])
    assert outcomes[0] == outcomes[1] and not rejected and sched.num_preemptions > 0
    assert sched.prefix_cache_hits >= 4 * 16
