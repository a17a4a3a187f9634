"""The kernels, the gemm and the engine through CuPy on a real GPU (marker ``gpu``).

Skipped where CuPy sees no device; scripts/gpu_check.sh runs them on the GPU machine. Each kernel
is checked against its NumPy twin (reference.kernel_ops) on fresh random inputs, outputs
poisoned with NaN first; the engine's greedy tokens against the reference, taken on the device
(only ids come back) unless a row needs the host sampler.
"""

from __future__ import annotations

import base64

import ml_dtypes
import numpy as np
import pytest

from engine import LLMEngine, SamplingParams
from engine.backends.forward_batch import ForwardBatch
from engine.emulation import kernel_ops as C
from engine.frontend.llm import run_to_completion
from engine.kernels import PARTITION_SIZE
from engine.kernels import gemm as G
from engine.kernels.launch import lora_tiles
from engine.utils import cdiv
from reference import kernel_ops as N
from reference.generate import generate as reference_generate
from reference.model import forward as reference_forward
from tests.gpu_target import BACKEND, EMULATE
from tests.spies import CallCounter, count_forwards

pytestmark = pytest.mark.gpu  # skipped without a GPU, or failed with REQUIRE_GPU=1 (conftest)

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
IDS = ["f32", "f16", "bf16"]
# attention on the emulated device: float32 only (tests/test_kernels.py runs the same CPU builds
# in every dtype); on a GPU every dtype
ATTN_DTYPES, ATTN_IDS = (DTYPES[:1], IDS[:1]) if EMULATE else (DTYPES, IDS)
TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}
PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


@pytest.fixture
def dev(gpu_device):
    """The device with its stream current: the kernels launch where download() waits."""
    with gpu_device.active():
        yield gpu_device


@pytest.fixture
def rng():
    return np.random.default_rng()


def randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale + 0.1).astype(dtype)


def close(got, want, dtype):
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any(), "an output was never written"
    tol = TOL[np.dtype(dtype).name]
    np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=tol, atol=tol)


def poisoned(dev, shape, dtype):
    return dev.upload(np.full(shape, np.nan, dtype))


# ---- kernels ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(17, 256, 320), (1100, 100, 37)], ids=["vec", "odd"])
def test_row_kernels(dev, dtype, shape, rng):
    (T, D, F), V = shape, 1000
    x, res, w = randn(rng, (T, D), dtype), randn(rng, (T, D), dtype), randn(rng, (D,), dtype)
    k, up = dev.kernels, dev.upload
    out = poisoned(dev, (T, D), dtype)
    k.rms_norm(out, up(x), up(w), 1e-5)
    close(dev.download(out), N.rms_norm(x, w, 1e-5), dtype)
    res_d, out = up(res), poisoned(dev, (T, D), dtype)
    k.fused_add_rms_norm(out, res_d, up(x), up(w), 1e-5)
    want_out, want_res = N.fused_add_rms_norm(x, res, w, 1e-5)
    close(dev.download(out), want_out, dtype)
    close(dev.download(res_d), want_res, dtype)
    table, ids = randn(rng, (V, D), dtype), rng.integers(0, V, T).astype(np.int32)
    out = poisoned(dev, (T, D), dtype)
    k.embedding(out, up(ids), up(table))
    close(dev.download(out), N.embedding(ids, table), dtype)
    gu, out = randn(rng, (T, 2 * F), dtype), poisoned(dev, (T, F), dtype)
    k.silu_and_mul(out, up(gu))
    close(dev.download(out), N.silu_and_mul(gu), dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rotary_cache(dev, dtype, head_dim, rng):
    T, H, Hkv, blocks, bs = 130, 8, 2, 20, 16
    qkv = randn(rng, (T, (H + 2 * Hkv) * head_dim), dtype)
    pos = rng.integers(0, 2000, T).astype(np.int32)
    slots = rng.permutation(blocks * bs)[:T].astype(np.int32)
    slots[rng.random(T) < 0.2] = -1  # padding rows
    kc, vc = (randn(rng, (blocks, bs, Hkv, head_dim), dtype) for _ in range(2))
    up, q_d, kc_d, vc_d = (
        dev.upload,
        poisoned(dev, (T, H, head_dim), dtype),
        *map(dev.upload, (kc, vc)),
    )
    table = up(C.rope_table(2048, head_dim, 1e4))
    dev.kernels.rotary_cache(q_d, kc_d, vc_d, up(qkv), up(pos), up(slots), table)
    want_q = N.rotary_cache(qkv, pos, 1e4, kc, vc, slots, H)
    close(dev.download(q_d), want_q, dtype)
    close(dev.download(kc_d), kc, dtype)
    np.testing.assert_array_equal(dev.download(vc_d), vc)


def paged_case(rng, dtype, lengths, H, Hkv, hd, bs=16, num_blocks=80):
    caches = [randn(rng, (num_blocks, bs, Hkv, hd), dtype) for _ in range(2)]
    need = [cdiv(n, bs) for n in lengths]
    ids = rng.permutation(num_blocks)[: sum(need)]
    tables = np.full((len(lengths), max(need) + 1), -1, np.int32)
    starts = np.concatenate([[0], np.cumsum(need)])
    for b, n in enumerate(need):
        tables[b, :n] = ids[starts[b] : starts[b] + n]
    return caches, tables, np.asarray(lengths, np.int32)


@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (32, 4)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=ATTN_IDS)
def test_paged_attention(dev, dtype, heads, rng):
    (H, Hkv), hd = heads, 64
    lengths = [1, 15, 16, 17, 130, 600]  # 600: the partitioned decode path
    (kc, vc), tables, lens = paged_case(rng, dtype, lengths, H, Hkv, hd, num_blocks=120)
    up, scale = dev.upload, hd**-0.5
    q = randn(rng, (len(lengths), H, hd), dtype)
    for partition in (None, 64, PARTITION_SIZE):  # None: split for the device's SM count
        out = poisoned(dev, q.shape, dtype)
        dev.kernels.paged_attention_decode(
            out, up(q), up(kc), up(vc), up(tables), up(lens), scale, 600, partition
        )
        close(dev.download(out), N.paged_attention_decode(q, kc, vc, tables, lens, scale), dtype)
    q_lens = np.minimum(lens, [1, 15, 3, 17, 40, 100])  # part of each context already cached
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    qp = randn(rng, (int(qsl[-1]), H, hd), dtype)
    out = poisoned(dev, qp.shape, dtype)
    dev.kernels.paged_attention_prefill(
        out, up(qp), up(kc), up(vc), up(tables), up(qsl), up(lens), scale
    )
    want = N.paged_attention_prefill(qp, kc, vc, tables, qsl, lens, scale)
    close(dev.download(out), want, dtype)


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=ATTN_IDS)
def test_paged_attention_with_sinks(dev, dtype, window, rng):
    """gpt-oss's sinks (one more logit per head, its share dropped) in the decode kernel (one
    partition and several: the reduce kernel's sum) and the prefill kernel, a window or none,
    against the reference's concatenated column; a sink far above the scores among them."""
    (H, Hkv), hd = (16, 4), 64
    lengths = [1, 17, 130, 600]
    (kc, vc), tables, lens = paged_case(rng, dtype, lengths, H, Hkv, hd, num_blocks=80)
    up, scale = dev.upload, hd**-0.5
    sinks = (2 * rng.standard_normal(H)).astype(np.float32)
    sinks[rng.integers(H)] = 30.0
    q = randn(rng, (len(lengths), H, hd), dtype)
    want = N.paged_attention_decode(q, kc, vc, tables, lens, scale, window, 0.0, sinks)
    for partition in (None, 64, PARTITION_SIZE):
        out = poisoned(dev, q.shape, dtype)
        dev.kernels.paged_attention_decode(
            out, up(q), up(kc), up(vc), up(tables), up(lens), scale, 600, partition,
            window=window, sinks=up(sinks),
        )  # fmt: skip
        close(dev.download(out), want, dtype)
    q_lens = np.minimum(lens, [1, 17, 40, 100])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    qp = randn(rng, (int(qsl[-1]), H, hd), dtype)
    out = poisoned(dev, qp.shape, dtype)
    dev.kernels.paged_attention_prefill(
        out, up(qp), up(kc), up(vc), up(tables), up(qsl), up(lens), scale, window,
        sinks=up(sinks),
    )  # fmt: skip
    want = N.paged_attention_prefill(qp, kc, vc, tables, qsl, lens, scale, window, 0.0, sinks)
    close(dev.download(out), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_block_copies(dev, dtype, rng):
    pool = randn(rng, (3, 2, 12, 16, 2, 32), dtype)
    blocks = rng.permutation(12)
    pairs = np.stack([blocks[:4], blocks[4:8]], axis=1).astype(np.int32)
    pool_d = dev.upload(pool)
    dev.kernels.copy_blocks(pool_d, pool_d, dev.upload(pairs))
    N.copy_blocks(pool, pool, pairs)
    np.testing.assert_array_equal(dev.download(pool_d), pool)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_sampling(dev, dtype, rng):
    B, V = 12, 32000
    logits = randn(rng, (B, V), dtype, scale=2.0)
    out = dev.upload(np.full(B, -1, np.int32))
    dev.kernels.sample_greedy(out, dev.upload(logits))
    np.testing.assert_array_equal(dev.download(out), np.argmax(logits.astype(np.float32), 1))


# ---- gemm -------------------------------------------------------------------------------------


@pytest.mark.skipif(EMULATE, reason="CuPy's cuBLAS module needs the real library")
def test_cublas_constants_match_cupy():
    from cupy.cuda import cublas
    from cupy_backends.cuda.api import runtime

    assert (G.CUDA_R_32F, G.CUDA_R_16F, G.CUDA_R_16BF) == (
        runtime.CUDA_R_32F,
        runtime.CUDA_R_16F,
        runtime.CUDA_R_16BF,
    )
    assert (G.CUBLAS_OP_N, G.CUBLAS_OP_T) == (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
    assert G.CUBLAS_COMPUTE_32F == cublas.CUBLAS_COMPUTE_32F
    assert G.CUBLAS_GEMM_DEFAULT == cublas.CUBLAS_GEMM_DEFAULT


def test_own_cublas_handle(dev):
    assert dev.cublas.version() >= 12000  # the library answers on the engine's handle


@pytest.mark.parametrize("out_f32", [False, True], ids=["same", "f32-out"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gemm(dev, dtype, out_f32, rng):
    x, w = randn(rng, (37, 320), dtype, 0.2), randn(rng, (200, 320), dtype, 0.2)
    out_dtype = np.float32 if out_f32 else dtype
    out = poisoned(dev, (37, 200), out_dtype)
    dev.gemm(dev.upload(x), dev.upload(w), out)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    close(dev.download(out), want, out_dtype)


def test_bf16_gemm_on_uint16_storage(dev, rng):
    x = randn(rng, (8, 64), ml_dtypes.bfloat16)
    w = randn(rng, (16, 64), ml_dtypes.bfloat16)
    out = dev.empty((8, 16), np.float32)
    dev.gemm(dev.upload(x.view(np.uint16)), dev.upload(w.view(np.uint16)), out)
    close(dev.download(out), x.astype(np.float32) @ w.astype(np.float32).T, ml_dtypes.bfloat16)


# ---- device services --------------------------------------------------------------------------


def test_measure_peak_counts_live_blocks(dev):
    def two_live():
        a = dev.empty((1 << 20,), np.uint8)
        b = dev.empty((2 << 20,), np.uint8)
        return a.size + b.size

    assert dev.measure_peak(two_live) == 3 << 20


# ---- the engine -------------------------------------------------------------------------------


def gpu_engine(loaded, **kw) -> LLMEngine:
    """An engine on the ``cuda`` backend (emulated: ``cuda-cpu``), built by the engine's own
    backend factory."""
    kw = {"backend": BACKEND, "num_gpu_blocks": 48, "max_model_len": 256, "swap_space": 0.01, **kw}
    return LLMEngine(loaded=loaded, model="test", **kw)


def run_engine(engine, params) -> list:
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(params))]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_engine_greedy_equals_reference(tiny, eager):
    engine = gpu_engine(tiny, max_num_seqs=4, enforce_eager=eager)
    assert bool(engine.backend.graphs) != eager
    count_forwards(engine.backend)
    lengths = [6, 10, 14]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = run_engine(engine, params)
    for prompt, n, out in zip(PROMPTS, lengths, outs, strict=True):
        ids = tiny.tokenizer.encode(prompt)
        assert out.token_ids == reference_generate(tiny.weights, tiny.config, ids, n).token_ids
    be = engine.backend  # every step greedy: ids come back, never (B, V) logits
    assert (be.forward.calls, be.forward_greedy.calls) == (0, 14)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_async_scheduling_greedy_equals_reference(tiny, eager):
    """Async scheduling: each decode step is queued before the last one's ids are read, its
    tokens gathered on the device from them; the tokens are still the reference's, and a
    request that stops (its stop token) drops the extra token computed after it."""
    engine = gpu_engine(tiny, max_num_seqs=4, enforce_eager=eager, async_scheduling=True)
    be, launches = engine.backend, []
    launch = be.launch_greedy
    be.launch_greedy = lambda batch, prev=None: launches.append(prev) or launch(batch, prev)
    lengths = [6, 10, 14]
    want = [
        reference_generate(tiny.weights, tiny.config, tiny.tokenizer.encode(p), n).token_ids
        for p, n in zip(PROMPTS, lengths, strict=True)
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    params[2] = SamplingParams(
        temperature=0.0, max_tokens=14, ignore_eos=True, stop_token_ids=[want[2][8]]
    )
    outs = run_engine(engine, params)
    stop = want[2].index(want[2][8]) + 1
    assert [o.token_ids for o in outs] == [want[0], want[1], want[2][:stop]]
    assert outs[2].finish_reason == "stop"
    assert sum(p is not None for p in launches) >= 8  # steps that took the last step's ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_engine_mixed_batch_device_greedy_and_host_sampling(tiny):
    """Greedy next to a seeded draw and a logprobs row: the tokens of an engine that samples
    every step on the host (record_logits); the device path once those rows end."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=5, ignore_eos=True),
    ]
    engine = gpu_engine(tiny, max_num_seqs=4)
    count_forwards(engine.backend)
    outs = run_engine(engine, params)
    want = run_engine(gpu_engine(tiny, max_num_seqs=4, record_logits=True), params)
    assert (engine.backend.forward.calls, engine.backend.forward_greedy.calls) == (5, 5)
    for out, ref in zip(outs, want, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs
    ids = tiny.tokenizer.encode(PROMPTS[0])
    assert outs[0].token_ids == reference_generate(tiny.weights, tiny.config, ids, 10).token_ids


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_forward_greedy_is_the_first_argmax_of_forward(tiny, eager, rng):
    be = gpu_engine(tiny, max_num_seqs=8, enforce_eager=eager).backend
    B, bs = 5, be.block_size  # with graphs: the graph of 8 replays, 3 padding rows
    lens = rng.integers(2, 40, B).astype(np.int32)  # (B,) context lengths
    tables = (np.arange(B * 3, dtype=np.int32).reshape(B, 3) + 1)[rng.permutation(B)]  # (B, 3)
    pos = lens - 1
    with be.device.active():  # fresh random KV, written in place (the graphs hold its pointer)
        be.kv_cache[...] = be.device.upload(randn(rng, be.kv_cache.shape, be.dtype))
    batch = ForwardBatch(
        token_ids=rng.integers(3, tiny.config.vocab_size, B).astype(np.int32),
        positions=pos,
        slot_mapping=(tables[np.arange(B), pos // bs] * bs + pos % bs).astype(np.int32),
        block_tables=tables,
        context_lens=lens,
        query_start_loc=np.arange(B + 1, dtype=np.int32),
        num_decodes=B,
    )
    if not eager:
        be.graphs[8] = CallCounter(be.graphs[8])
    ids = be.forward_greedy(batch)  # (B,) int32
    logits = be.forward(batch)  # (B, V): the same step again, the same cache writes
    assert ids.dtype == np.int32 and ids.shape == (B,)
    np.testing.assert_array_equal(ids, np.argmax(logits, axis=1))
    assert eager or be.graphs[8].calls == 2


def test_engine_swap_preemption(tiny):
    engine = gpu_engine(
        tiny,
        num_gpu_blocks=5,
        max_model_len=64,
        preemption_mode="swap",
        swap_space=0.001,
        max_num_seqs=4,
    )
    swapped = []
    swap_out = engine.backend.swap_out
    engine.backend.swap_out = lambda pairs: (swapped.extend(pairs), swap_out(pairs))
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3
    outs = run_to_completion(engine, PROMPTS, params, check_invariants=True)
    assert swapped  # blocks went to the CPU pool and came back
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tiny.tokenizer.encode(prompt)
        assert out.token_ids == reference_generate(tiny.weights, tiny.config, ids, 24).token_ids


def test_bf16_backend_logits_close_to_reference(tiny):
    engine = gpu_engine(tiny, dtype="bfloat16", record_logits=True)
    ids = tiny.tokenizer.encode(PROMPTS[1])
    engine.add_request("0", ids, SamplingParams(temperature=0.0, max_tokens=1))
    (out,) = [o for o in engine.step() if o.finished]
    got = out.outputs[0].step_logits[0]
    w32 = tiny.weights.astype(ml_dtypes.bfloat16).astype(np.float32)
    want = reference_forward(w32, tiny.config, ids)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.parametrize(
    "name",
    ["llama3", "qwen2_swa", "qwen2_yarn", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]
    + ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"],
)
def test_families_match_transformers_on_the_device(name):
    """Each family's tiny checkpoint (float32) against transformers' golden tokens and logits,
    with decode graphs: bias and q/k norm in rotary_cache, windows, GELU, (1 + w) norms,
    (Gemma 2 and 3, Qwen2 with sliding layers, gpt-oss) the KV groups' page tables and slots,
    and the mixtures' expert kernels (gpt-oss: sinks, biases, the clamped SwiGLU)."""
    from tests.test_families import check_outputs, engine_outputs

    check_outputs(name, *engine_outputs(name, BACKEND, num_gpu_blocks=64, dtype="float32"))


def test_speculative_decoding_on_the_device(tiny):
    """Speculated rows (1 + k query tokens, every row's logits gathered) on the device backend:
    greedy tokens identical with speculation on and off."""
    from tests.test_spec_decode import check_same, repetitive_prompts

    # emulated: shorter (tests/test_spec_decode.py runs the same on cuda-cpu); 8 fresh prompts,
    # so that some draft is accepted (with 4, about one draw in ten had none: the check below)
    prompts = repetitive_prompts(np.random.default_rng(), 8, 320)
    params = SamplingParams(temperature=0.0, max_tokens=24 if EMULATE else 48, ignore_eos=True)
    check_same(tiny, prompts, params, backend=BACKEND, num_gpu_blocks=64, dtype="float32")


def test_draft_model_on_the_device(tiny):
    """A draft model (here the target itself) on the device backend: a second backend with its
    own pool; every draft accepted, greedy tokens identical with speculation on and off."""
    from tests.test_spec_decode import DRAFT, check_same

    rng = np.random.default_rng()
    n = 3 if EMULATE else 6  # emulated: fewer (tests/test_spec_decode.py has it on cuda-cpu)
    prompts = [rng.integers(3, 320, int(rng.integers(3, 30))).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True)
    args = dict(backend=BACKEND, num_gpu_blocks=64, dtype="float32", draft_loaded=tiny)
    stats = check_same(tiny, prompts, params, spec=DRAFT, **args)
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == 5.0


def test_kv_tiers_move_blocks_through_the_device(tiny, tmp_path):
    """The KV tiers' copies out of and into the device pool (read_blocks, write_blocks): blocks
    evicted from a small pool stored in host memory and on disk, loaded back for later prompts,
    the greedy tokens those of the same backend without tiers; a second engine on the disk
    directory loads every prompt's prefix from it."""
    from tests.test_kv_tiers import PARAMS, SMALL, workload
    from tests.test_prefix_caching import run_staggered

    prompts = workload(tiny.tokenizer)
    args = dict(SMALL, backend=BACKEND, dtype="float32")
    plain = run_staggered(LLMEngine(loaded=tiny, model="tiny", **args), prompts, PARAMS)
    tiers = dict(args, enable_prefix_caching=True, num_gpu_blocks=25, kv_cache_dir=str(tmp_path))
    engine = LLMEngine(loaded=tiny, model="tiny", kv_offload_bytes=1 << 24, **tiers)
    outs = run_staggered(engine, prompts, PARAMS)
    engine.shutdown()
    assert engine.scheduler.tier_hits > 0
    want = [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in outs] == want
    again = LLMEngine(loaded=tiny, model="tiny", **tiers)
    warm = run_staggered(again, prompts, PARAMS)
    again.shutdown()
    assert all(o.num_cached_tokens > 0 for o in warm)
    assert [o.outputs[0].token_ids for o in warm] == want


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_lora_kernels(dev, dtype, rng):
    """lora_shrink + lora_expand on the device: each adapter's rows get x A^T B, over a tile of
    rows of one adapter and base rows left alone, against float64."""
    from tests.test_kernels_lora import TOL as LORA_TOL
    from tests.test_kernels_lora import expected, problem

    x, a, b, y, slots, ends = problem(rng, dtype)
    order, tiles = lora_tiles(slots)
    out = dev.upload(y)
    args = [dev.upload(v) for v in (x, a, b, order, tiles, ends)]
    dev.kernels.lora(out, *args[:3], *args[3:])
    got, want, base = dev.download(out), expected(x, a, b, y, slots, ends), slots < 0
    assert np.array_equal(got[base].view(np.uint8), y[base].view(np.uint8))
    err = np.abs(got[~base].astype(np.float64) - want[~base]).max()
    assert err <= LORA_TOL[dtype] * np.abs(want[~base]).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_expert_kernels(dev, dtype, rng):
    """moe_route, moe_align, moe_matmul (the dtype's weights and MXFP4 blocks) and moe_combine
    on the device: a layer of experts against NumPy's routing and float64 products."""
    from engine.backends import moe
    from model_loader import mxfp4
    from tests.test_kernels_moe import TOL as MOE_TOL
    from tests.test_kernels_moe import expert_products, random_mxfp4

    T, E_, k, D, N = 40, 8, 2, 96, 136
    h = randn(rng, (T, D), dtype)
    router = randn(rng, (E_, D), np.float32)
    ids, w = dev.upload(np.zeros((T, k), np.int32)), dev.upload(np.zeros((T, k), np.float32))
    dev.kernels.moe_route(ids, w, dev.upload(h), dev.upload(router), k, True)
    want_ids, want_w = moe.route(h.astype(np.float32), router.T.copy(), k, True)
    host_ids = dev.download(ids)
    assert (host_ids == want_ids).mean() > 0.95  # a near tie may order differently in float32
    order = [dev.upload(np.zeros(T * k, np.int32)) for _ in range(2)]
    offsets, totals = dev.upload(np.zeros(E_ + 1, np.int32)), dev.upload(np.zeros(E_, np.uint64))
    dev.kernels.moe_align(*order, offsets, totals, ids, dev.upload(np.arange(T, dtype=np.int32)))
    sorted_pairs, inverse, offs = (
        dev.download(order[0]),
        dev.download(order[1]),
        dev.download(offsets),
    )
    np.testing.assert_array_equal(dev.download(totals), np.bincount(host_ids.ravel(), minlength=E_))
    weights = {"dtype": randn(rng, (E_, N, D), dtype, 0.1), "mxfp4": random_mxfp4(rng, E_, N, D)}
    for fmt, wt in weights.items():
        values = (
            wt if fmt == "dtype" else mxfp4.dequantize_blocks(wt.reshape(-1, 17)).reshape(E_, N, D)
        )
        out = poisoned(dev, (T * k, N), np.float32)
        dev.kernels.moe_matmul(out, dev.upload(h), dev.upload(wt), order[0], offsets, k, fmt=fmt)
        want = expert_products(h, values, host_ids, sorted_pairs, offs, k)
        assert np.abs(dev.download(out) - want).max() <= MOE_TOL[dtype] * np.abs(want).max(), fmt
    y = rng.standard_normal((T * k, D)).astype(np.float32)
    out = poisoned(dev, (T, D), dtype)
    dev.kernels.moe_combine(out, dev.upload(y), w, order[1])
    want = np.einsum("tk,tkd->td", dev.download(w), y[inverse].reshape(T, k, D))
    got = dev.download(out).astype(np.float64)
    assert np.abs(got - want).max() <= MOE_TOL[dtype] * np.abs(want).max()


def test_lora_adapters_on_the_device():
    """Three PEFT adapters and the base model in one batch on the device backend: PEFT's tokens,
    its last logits within float32 rounding (the golden data of tests/test_lora.py)."""
    from tests.test_families import loaded
    from tests.test_lora import ATOL, golden, lora, run

    cases = golden("qwen2")["cases"]
    engine = LLMEngine(
        loaded=loaded("qwen2"), model="qwen2", backend=BACKEND, dtype="float32",
        record_logits=True, enable_lora=True, max_loras=3, max_lora_rank=64,
    )  # fmt: skip
    prompts = [c["prompt_token_ids"] for c in cases]
    outs = run(engine, prompts, [lora("qwen2", c["adapter"]) for c in cases], 8)
    for case, out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == case["token_ids"], case["adapter"]
        want = np.frombuffer(base64.b64decode(case["logits"]), dtype="<f4")
        np.testing.assert_allclose(out.outputs[0].step_logits[0], want, atol=ATOL, rtol=0)


def test_pooling_on_the_device(tmp_path):
    """The pooling runner on the device backend: sentence-transformers' golden embeddings of
    the tiny llama checkpoint (last and mean pooling), the reranker's golden scores, and a
    sequence classifier's golden logits (transformers')."""
    from engine import LLM
    from tests.test_pooling import DATA, classify_golden, pools_and_scores_as_golden

    pools_and_scores_as_golden(dict(backend=BACKEND), tmp_path)
    ref = classify_golden()["cls_qwen3"]
    llm = LLM(model=str(DATA / "cls_qwen3"), runner="pooling", backend=BACKEND,
              dtype="float32", num_gpu_blocks=64)  # fmt: skip
    outs = llm.classify(ref["texts"], activation=False, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.probs for o in outs], ref["logits"], atol=1e-4, rtol=0)
