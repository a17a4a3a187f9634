"""The GPU backend's code on the CPU: ``CupyBackend`` over ``EmulatedDevice`` (NumPy memory, the
kernels' CPU builds, emulated cuBLAS, graphs replayed under the capture rules) against the
reference; the cuBLAS argument plan replayed in NumPy; the RawModule options through NVRTC."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from engine import LLMEngine, SamplingParams
from engine.backends import cupy_backend as CB
from engine.backends.base import resolve_kv_dtype
from engine.backends.cuda_graphs import graph_batch_sizes
from engine.backends.cupy_step import pack_inputs, split_inputs
from engine.backends.forward_batch import ForwardBatch
from engine.config import EngineConfig
from engine.devices.device import (
    CUPY_ADDED_OPTIONS,
    BlockReplay,
    CaptureAllocationError,
    rawmodule_options,
)
from engine.emulation.device import EmulatedDevice
from engine.frontend.llm import run_to_completion
from engine.kernels import KernelBuildError, define_sets, kernel_names, read_source
from engine.kernels.gemm import (
    CUBLAS_OP_N,
    CUBLAS_OP_T,
    CUDA_R_16BF,
    CUDA_R_32F,
    check_gemm,
    gemm_plan,
)
from engine.utils import cdiv
from reference.generate import generate as reference_generate
from reference.model import forward as reference_forward
from tests.spies import CallCounter, count_forwards

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


def make_backend(loaded, model_config=None, **kw) -> CB.CupyBackend:
    mc = model_config or loaded.config
    kw = {"max_model_len": 256, "max_num_seqs": 4, **kw}
    cfg = EngineConfig(**kw).resolve(mc)
    return CB.CupyBackend(mc, loaded.weights, cfg, device=EmulatedDevice())


def emulated_engine(loaded, **kw) -> LLMEngine:
    """The engine on backend ``cuda-cpu``: CupyBackend on the emulated device."""
    kw = {"num_gpu_blocks": 48, "max_model_len": 256, "swap_space": 0.01, **kw}
    engine = LLMEngine(loaded=loaded, model="test", backend="cuda-cpu", **kw)
    assert isinstance(engine.backend.device, EmulatedDevice)
    return engine


# ---- greedy equals the reference, through the engine ----


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_engine_greedy_equals_reference(tiny, eager):
    engine = emulated_engine(tiny, max_num_seqs=4, enforce_eager=eager)
    be = engine.backend
    assert sorted(be.graphs) == ([] if eager else [1, 2, 4])
    be.graphs = {g: CallCounter(fn) for g, fn in be.graphs.items()}
    count_forwards(be)
    lengths = [6, 10, 14]  # the decode batch shrinks 3 -> 2 -> 1: padded to 4, then exact
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = run_to_completion(engine, PROMPTS, params, check_invariants=True)
    for prompt, n, out in zip(PROMPTS, lengths, outs, strict=True):
        ids = tiny.tokenizer.encode(prompt)
        assert out.token_ids == reference_generate(tiny.weights, tiny.config, ids, n).token_ids
    assert (be.forward.calls, be.forward_greedy.calls) == (0, 14)  # ids only, every step
    if not eager:
        assert {g: c.calls for g, c in be.graphs.items()} == {4: 5, 2: 4, 1: 4}


# ---- the padded graph path ----


def decode_batch(rng, B: int, num_blocks: int, block_size: int) -> ForwardBatch:
    """B decodes with fresh random contexts and distinct blocks."""
    lens = rng.integers(2, 40, size=B).astype(np.int32)  # (B,) context lengths
    need = cdiv(lens, block_size)
    blocks = rng.permutation(num_blocks)[: need.sum()].astype(np.int32)
    tables = np.full((B, need.max()), -1, np.int32)
    starts = np.concatenate([[0], np.cumsum(need)])
    for b in range(B):
        tables[b, : need[b]] = blocks[starts[b] : starts[b + 1]]
    pos = lens - 1
    slots = tables[np.arange(B), pos // block_size] * block_size + pos % block_size
    return ForwardBatch(
        token_ids=rng.integers(3, 300, size=B).astype(np.int32),
        positions=pos,
        slot_mapping=slots.astype(np.int32),
        block_tables=tables,
        context_lens=lens,
        query_start_loc=np.arange(B + 1, dtype=np.int32),
        num_decodes=B,
    )


def test_padded_graph_replay_matches_eager_and_writes_only_real_slots(tiny):
    rng = np.random.default_rng(7)
    longer = dataclasses.replace(tiny.config, max_position_embeddings=1024)
    be = make_backend(tiny, longer, max_num_seqs=8, max_model_len=600)  # graphs: 2 partitions
    be.allocate_kv_cache(40)
    be.kv_cache[...] = rng.standard_normal(be.kv_cache.shape).astype(np.float32)
    batch = decode_batch(rng, 5, 40, be.block_size)  # replays the graph of 8: 3 padding rows
    before = be.kv_cache.copy()
    logits = be.forward(batch)
    after_graph = be.kv_cache.copy()
    be.kv_cache[...] = before
    be.graphs = {}  # eager now
    eager = be.forward(batch)
    np.testing.assert_allclose(logits, eager, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after_graph, be.kv_cache, rtol=1e-5, atol=1e-6)  # same writes
    changed = np.any(after_graph != before, axis=(0, 1, 4, 5))  # (N, bs)
    slots = batch.slot_mapping
    expect = np.zeros_like(changed)
    expect[slots // be.block_size, slots % be.block_size] = True
    np.testing.assert_array_equal(changed, expect)  # padding rows wrote nothing


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_forward_greedy_is_the_first_argmax_of_forward(tiny, graphs):
    rng = np.random.default_rng()
    be = make_backend(tiny, max_num_seqs=8, enforce_eager=not graphs)
    be.allocate_kv_cache(40)
    be.kv_cache[...] = rng.standard_normal(be.kv_cache.shape).astype(np.float32)
    batch = decode_batch(rng, 5, 40, be.block_size)  # with graphs: the graph of 8, padded
    assert sorted(be.graphs) == ([1, 2, 4, 8] if graphs else [])
    if graphs:
        be.graphs[8] = CallCounter(be.graphs[8])
    argmax_launches = []  # the stream's state at each sample_greedy launch
    sample_greedy = be.k.sample_greedy
    be.k.sample_greedy = lambda *a: (
        argmax_launches.append(be.device.stream.status),
        sample_greedy(*a),
    )
    ids = be.forward_greedy(batch)  # (B,) int32
    logits = be.forward(batch)  # (B, V): the same step again, same cache writes
    assert ids.dtype == np.int32 and ids.shape == (5,)
    np.testing.assert_array_equal(ids, np.argmax(logits, axis=1))
    assert not graphs or be.graphs[8].calls == 2
    # with graphs the argmax is part of the replay (both steps), with no launch after it
    assert argmax_launches == (["replaying"] * 2 if graphs else [None])


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert graph_batch_sizes(256)[-3:] == [192, 224, 256]


# ---- dtypes ----


def test_bfloat16_prefill_logits_close_to_reference(tiny):
    be = make_backend(tiny, dtype="bfloat16", enforce_eager=True)
    assert be.dtype == np.dtype(ml_dtypes.bfloat16) and be.embed.dtype == be.dtype
    be.allocate_kv_cache(16)
    ids = np.asarray(tiny.tokenizer.encode(PROMPTS[1]), np.int32)
    n = len(ids)
    batch = ForwardBatch(
        ids,
        np.arange(n, dtype=np.int32),
        np.arange(n, dtype=np.int32) + 16,
        np.array([[1, 2, 3]], np.int32),
        np.array([n], np.int32),
        np.array([0, n], np.int32),
        0,
    )
    got = be.forward(batch)[0]  # (V,)
    w32 = tiny.weights.astype(ml_dtypes.bfloat16).astype(np.float32)
    want = reference_forward(w32, tiny.config, ids)  # (V,)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert np.abs(got - want).max() > 0  # bf16 activations: not the float32 numbers


def test_dtype_auto_keeps_the_checkpoint_dtype_on_a_gpu_and_float32_on_the_host(tiny):
    bf16 = dataclasses.replace(tiny.config, torch_dtype="bfloat16")
    assert resolve_kv_dtype("auto", bf16, on_gpu=True) == "bfloat16"
    assert resolve_kv_dtype("auto", bf16, on_gpu=False) == "float32"
    assert resolve_kv_dtype("float16", bf16, on_gpu=False) == "float16"
    with pytest.raises(ValueError, match="dtype"):
        resolve_kv_dtype("int8", bf16, on_gpu=True)


# ---- cache operations ----


def test_swap_out_in_and_copy_blocks_move_exact_blocks(tiny):
    rng = np.random.default_rng(3)
    be = make_backend(tiny, enforce_eager=True)
    be.allocate_kv_cache(10, 6)
    be.kv_cache[...] = rng.standard_normal(be.kv_cache.shape).astype(np.float32)
    original = be.kv_cache.copy()
    be.swap_out([(7, 0), (2, 5)])
    np.testing.assert_array_equal(be.cpu_cache[:, :, [0, 5]], original[:, :, [7, 2]])
    be.kv_cache[:, :, [7, 2]] = 0
    be.swap_in([(5, 4), (0, 9)])
    np.testing.assert_array_equal(be.kv_cache[:, :, [4, 9]], original[:, :, [2, 7]])
    be.copy_blocks([(1, 3)])
    np.testing.assert_array_equal(be.kv_cache[:, :, 3], original[:, :, 1])
    with pytest.raises(ValueError, match="both a source and a destination"):
        be.copy_blocks([(1, 3), (3, 6)])


# ---- memory accounting ----


def test_step_bytes_counts_the_workspace_and_inputs(tiny):
    be = make_backend(tiny)
    T, B = 37, 5
    ws = be._workspace(T, B)
    arrays = sum(a.nbytes for a in vars(ws).values() if a is not None)
    M = cdiv(be.max_model_len, be.block_size)
    inputs = 4 * (4 * T + 3 * B + 1 + B * M)
    assert be.step_bytes(T, B, 1) == arrays + inputs + 512 * 18
    c = tiny.config
    partials = B * c.num_attention_heads * 3 * (c.head_dim + 2) * 4
    assert be.step_bytes(T, B, 3, 2) - be.step_bytes(T, B, 1, 2) == 2 * partials


def test_pack_and_split_inputs_round_trip():
    rng = np.random.default_rng(1)
    b = decode_batch(rng, 3, 20, 16)
    prefill = ForwardBatch(
        token_ids=np.concatenate([b.token_ids, [5, 6, 7, 8]]).astype(np.int32),
        positions=np.concatenate([b.positions, [0, 1, 0, 1]]).astype(np.int32),
        slot_mapping=np.concatenate([b.slot_mapping, [-1] * 4]).astype(np.int32),
        block_tables=np.vstack([b.block_tables, b.block_tables[:2]]),
        context_lens=np.concatenate([b.context_lens, [2, 2]]).astype(np.int32),
        query_start_loc=np.array([0, 1, 2, 3, 5, 7], np.int32),
        num_decodes=3,
    )
    v = split_inputs(pack_inputs(prefill), 7, 5, 3, prefill.block_tables.shape[1])
    np.testing.assert_array_equal(v.token_ids, prefill.token_ids)
    np.testing.assert_array_equal(v.positions, prefill.positions)
    np.testing.assert_array_equal(v.slot_mapping, prefill.slot_mapping)
    np.testing.assert_array_equal(v.context_lens, prefill.context_lens)
    np.testing.assert_array_equal(v.block_tables, prefill.block_tables)
    np.testing.assert_array_equal(v.prefill_qsl, [0, 2, 4])
    np.testing.assert_array_equal(v.rows, [0, 1, 2, 4, 6])


# ---- cuBLAS arguments, proven on the CPU ----


def colmajor_gemm(plan, a: np.ndarray, b: np.ndarray, c_size: int) -> np.ndarray:
    """What cuBLAS computes for ``plan`` over flat buffers a, b: C (m, n) column-major, flat."""

    def operand(buf, trans, rows, cols, ld):  # op(X) is (rows, cols)
        stored = (cols, rows) if trans == CUBLAS_OP_T else (rows, cols)
        x = buf[: ld * stored[1]].reshape(stored[1], ld)[:, : stored[0]].T  # column-major read
        return x.T if trans == CUBLAS_OP_T else x

    op_a = operand(a, plan.transa, plan.m, plan.k, plan.lda)  # (m, k)
    op_b = operand(b, plan.transb, plan.k, plan.n, plan.ldb)  # (k, n)
    c = np.zeros(c_size, np.float64)
    c[: plan.ldc * plan.n].reshape(plan.n, plan.ldc)[:, : plan.m] = (op_a @ op_b).T
    return c


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_gemm_plan_replayed_in_numpy_is_x_times_w_transposed(dtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 24)).astype(dtype)  # (M, K)
    w = rng.standard_normal((11, 24)).astype(dtype)  # (N, K)
    out = np.empty((5, 11), np.float32)  # (M, N)
    plan = gemm_plan(x, w, out)
    assert (plan.transa, plan.transb) == (CUBLAS_OP_T, CUBLAS_OP_N)
    want_type = CUDA_R_32F if dtype == np.float32 else CUDA_R_16BF
    assert (plan.a_type, plan.b_type, plan.c_type) == (want_type, want_type, CUDA_R_32F)
    flat = colmajor_gemm(plan, w.astype(np.float64).ravel(), x.astype(np.float64).ravel(), 55)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(flat.reshape(5, 11), want, rtol=1e-12)
    dev = EmulatedDevice()  # cuBLAS emulated on the arrays' raw memory, the plan as given
    x_d, w_d, out_d = dev.upload(x), dev.upload(w), dev.empty(out.shape, out.dtype)
    dev.gemm(x_d, w_d, out_d)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(out_d, want, rtol=tol, atol=tol)


def test_gemm_rejects_bad_shapes():
    x, w = np.ones((4, 8), np.float32), np.ones((6, 8), np.float32)
    with pytest.raises(ValueError, match="gemm"):
        check_gemm(x, w, np.empty((4, 5), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        check_gemm(x, np.ones((8, 6), np.float32).T, np.empty((4, 6), np.float32))
    with pytest.raises(ValueError, match="share a dtype"):
        check_gemm(x, w.astype(np.float16), np.empty((4, 6), np.float32))
    x16, w16 = x.astype(np.float16), w.astype(np.float16)
    with pytest.raises(ValueError, match="out must be float16 or float32"):
        gemm_plan(x16, w16, np.empty((4, 6), ml_dtypes.bfloat16))  # no such gemmEx
    assert gemm_plan(x16, w16, np.empty((4, 6), np.float32)).c_type == CUDA_R_32F


# ---- graph capture's allocations ----


def test_block_replay_hands_the_capture_the_warm_up_blocks_in_order():
    made = []

    def malloc(size):  # a fresh, distinct block per call
        made.append(object())
        return made[-1]

    blocks = BlockReplay(malloc)
    sizes = [512, 4096, 512, 1024]  # what one warm-up run asked for
    warm = [blocks.record(n) for n in sizes]
    assert len(set(map(id, warm))) == 4
    captured = [blocks.replay(n) for n in sizes]
    assert captured == warm and len(made) == 4  # the same blocks, nothing allocated
    assert [b for _, b in blocks.handed] == warm
    with pytest.raises(CaptureAllocationError, match="512 bytes where the warm-up allocated no"):
        blocks.replay(512)  # more than the warm-up asked for
    blocks.record(2048)
    with pytest.raises(CaptureAllocationError, match="1024 bytes where the warm-up allocated 2048"):
        blocks.replay(1024)
    assert len(made) == 5  # a failed replay allocates nothing
    blocks.release()
    assert not blocks.blocks


# ---- the GPU path's pieces that a CPU can check ----


def cupy_assembled_options(defines=()) -> tuple[str, ...]:
    """Our options as CuPy's RawModule hands them to NVRTC: CuPy puts its bundled CCCL include
    folders first and appends its own headers and CUDA's (the same call CuPy makes)."""
    from cupy._core import core

    assemble = getattr(core, "assemble_cupy_compiler_options", None)
    options = rawmodule_options(defines)
    return assemble(options) if assemble else options


def nvrtc_compile(build: tuple) -> None:
    """cuda_src/<name>.cu with exactly the options the RawModule path uses, for sm_90."""
    from cupy.cuda import nvrtc

    name, defines = build
    options = [*cupy_assembled_options(defines), *CUPY_ADDED_OPTIONS, "-arch=sm_90"]
    prog = nvrtc.createProgram(read_source(name), f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, options)
    except nvrtc.NVRTCError as exc:
        raise KernelBuildError(f"{name}.cu:\n{nvrtc.getProgramLog(prog)}") from exc
    finally:
        nvrtc.destroyProgram(prog)


def test_rawmodule_options_compile_every_kernel_with_nvrtc():
    """Every file, a file with compile-time constants with one of its define sets (the
    per-set builds are checked in test_kernels_compile.py)."""
    builds = [(name, define_sets(name)[0]) for name in kernel_names()]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(nvrtc_compile, builds))


def test_import_needs_no_gpu_and_cuda_backend_says_so():
    code = (
        "import engine.backends.cupy_backend as m, engine.devices.device as d; print(d.gpu_count())"
    )
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0"


def test_cuda_backend_without_gpu_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.setattr("engine.devices.device.gpu_status", lambda: (0, "no driver here"))
    cfg = EngineConfig(max_model_len=64).resolve(tiny.config)
    with pytest.raises(ValueError, match=r"needs a GPU .*\(no driver here\)"):
        CB.cuda_backend(tiny.config, tiny.weights, cfg)
