"""The cuda backend keeps a GGUF's k-quant matrices in their blocks (engine/backends/
cupy_blocks.py) on the emulated device (``cuda-cpu``): which matrices it keeps, the bytes it
counts and logs, and the greedy tokens and logits of a file of every type against the numpy
backend on the same file (which multiplies the dequantized float32 values)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine import LLMEngine
from engine import kernels as K
from engine.backends.cupy_blocks import DeviceBlocks
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
from tests.test_kquants import write_files
from tests.utils import SEED_PROMPTS, make_engine


@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kquants_cuda")
    model_dir = make_tiny_model(tmp / "tok", seed=1)
    K.build_all_cpu()
    return write_files(tmp, model_dir, np.random.default_rng())


def cuda_engine(loaded, **kw) -> LLMEngine:
    kw = {"num_gpu_blocks": 64, "max_model_len": 256, "swap_space": 0.01, **kw}
    return LLMEngine(loaded=loaded, model="test", backend="cuda-cpu", **kw)


def kinds(w) -> list[str]:
    return [kind for kind, _ in w.parts] if isinstance(w, DeviceBlocks) else [w.dtype.name]


def test_kept_matrices_are_the_files_bytes_and_counted(kquant_files, caplog):
    blocks, _ = kquant_files
    loaded = load_model(str(blocks))
    with caplog.at_level("INFO", logger="engine.backend"):
        be = cuda_engine(loaded).backend
    l0, l1 = be.layers
    assert kinds(l0.w_qkv) == ["q4_k", "q6_k"] and kinds(l0.w_down) == ["q6_k"]
    # Q5_K, Q5_1, MXFP4 are not read by the kernels: those matrices are widened as before
    assert kinds(l0.w_o) == kinds(l0.w_gate_up) == kinds(l1.w_qkv) == ["float32"]
    assert kinds(l1.w_o) == kinds(l1.w_gate_up) == ["q4_k"] and kinds(l1.w_down) == ["float32"]
    assert kinds(be.lm_head) == ["q6_k"] and kinds(be.embed) == ["float32"]
    (raw,) = [t for t in gguf.GGUFReader(str(blocks)).tensors if t.name == "output.weight"]
    np.testing.assert_array_equal(be.lm_head.parts[0][1], raw.data)
    kept = [w for w in (l0.w_qkv, l0.w_down, l1.w_o, l1.w_gate_up, be.lm_head)]
    plain = [be.embed, be.final_norm, l0.w_o, l0.w_gate_up, l1.w_qkv, l1.w_down]
    plain += [getattr(lw, n) for lw in be.layers for n in ("attn_norm", "mlp_norm")]
    assert be.weights_bytes == sum(w.nbytes for w in kept + plain)
    assert "weights resident, by format: float32 " in caplog.text and "q4_k" in caplog.text
    # a batch over eight rows widens one part at a time: the tile of the widest is budgeted
    widest = max(len(raw) for w in kept for _, raw in w.parts) * 256 * 4
    assert be._tile_bytes(8) == 0 and be._tile_bytes(9) == widest
    assert be.step_bytes(9, 1, 1) - be.step_bytes(8, 1, 1) > widest


def test_greedy_tokens_and_logits_equal_numpys(kquant_files, monkeypatch):
    """numpy multiplies the dequantized float32 values; cuda-cpu the blocks (the matvec kernel
    for decode steps, the widened tiles and cuBLAS for the prompts): the same tokens, and
    logits to float32 rounding."""
    blocks, _ = kquant_files
    loaded = load_model(str(blocks))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(engine):
        outs = run_to_completion(engine, SEED_PROMPTS[:3], greedy)
        return [(o.outputs[0].token_ids, np.stack(o.outputs[0].step_logits)) for o in outs]

    want = run(make_engine(loaded, backend="numpy", record_logits=True))
    engine = cuda_engine(loaded, record_logits=True)
    calls = {"gguf_matvec": 0, "gguf_dequantize": 0}
    for name in calls:  # both paths run: decode steps (and graph captures), the prompts' step
        fn = getattr(engine.backend.k, name)

        def counted(*args, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*args, **kw)

        monkeypatch.setattr(engine.backend.k, name, counted)
    got = run(engine)
    assert calls["gguf_matvec"] > 0 and calls["gguf_dequantize"] > 0, calls
    for (tg, g), (tw, w) in zip(got, want, strict=True):
        assert tg == tw
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


@pytest.mark.parametrize("M", [1, 5, 8, 9, 20])
def test_block_gemm_of_a_fused_matrix_is_its_parts_products(M, monkeypatch):
    """q | k | v of three formats: each part writes its columns, through the matvec kernel up to
    eight rows and through tiles of a few rows (TILE_BYTES made small) and cuBLAS above."""
    from engine.backends import cupy_blocks
    from engine.emulation.device import EmulatedDevice
    from tests.test_kernels_gguf import random_blocks, values

    monkeypatch.setattr(cupy_blocks, "TILE_BYTES", 7 * 512 * 4)  # 7 rows of a tile at a time
    rng = np.random.default_rng()
    dev = EmulatedDevice()
    parts = [("q4_k", 24), ("q6_k", 17), ("q8_0", 9)]
    raws = [random_blocks(rng, kind, n, 512) for kind, n in parts]
    w = np.concatenate([values(kind, r) for (kind, _), r in zip(parts, raws, strict=True)])
    with dev.active():
        blocks = DeviceBlocks(
            [(k, dev.upload(r)) for (k, _), r in zip(parts, raws, strict=True)], 512
        )
        x = rng.standard_normal((M, 512)).astype(np.float32)
        out = dev.upload(np.full((M, 50), np.nan, np.float32))
        cupy_blocks.BlockGemm(dev.gemm, dev.kernels, dev.empty)(dev.upload(x), blocks, out)
        got = dev.download(out)
    want = x.astype(np.float64) @ w.astype(np.float64).T  # (M, 50)
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    assert (np.abs(got - want) <= bound).all()
    assert blocks.tile_bytes(4) == 7 * 512 * 4
