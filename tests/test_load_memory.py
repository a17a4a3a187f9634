"""Loading at about the kept weights' memory (engine/backends/numpy_backend.pack_weights): a
16-bit checkpoint's embedding table is kept in its own dtype, and gives the tokens and logits
of the same values stored as float32; packing a model into a quantized format allocates, at its
peak, the kept arrays plus a slice's worth of work, never a float32 copy of the LM head or the
table (tracemalloc counts NumPy's allocations; the checkpoint itself is mapped, not counted)."""

from __future__ import annotations

import shutil
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.backends import quant
from engine.backends.numpy_backend import pack_weights
from engine.llm import run_to_completion
from engine.sampling_params import SamplingParams
from reference.loader import load_model
from tests.tiny_model import make_tiny_model
from tests.utils import SEED_PROMPTS, make_engine

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"bf16": a random checkpoint in bfloat16, "f32": the same values in float32}, with a
    vocabulary large beside the layers, so the LM head and the table dominate the bytes."""
    root = tmp_path_factory.mktemp("load_memory")
    seed = int(np.random.default_rng().integers(1 << 30))
    src = make_tiny_model(root / "src", seed=seed, vocab_size=8192)
    tensors = {k: v.astype(BF16) for k, v in load_file(str(src / "model.safetensors")).items()}
    dirs = {}
    for name, dtype in (("bf16", BF16), ("f32", np.float32)):
        d = dirs[name] = root / name
        shutil.copytree(src, d)
        save_file({k: v.astype(dtype) for k, v in tensors.items()}, str(d / "model.safetensors"))
    return dirs


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_a_bf16_table_is_kept_in_bf16_with_the_float32_checkpoints_tokens(checkpoints, backend):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engines = {
        name: make_engine(load_model(str(d)), backend=backend, record_logits=True)
        for name, d in checkpoints.items()
    }
    assert engines["bf16"].backend.embed.dtype == BF16
    assert engines["f32"].backend.embed.dtype == np.float32
    np.testing.assert_array_equal(
        engines["bf16"].backend.embed.astype(np.float32), engines["f32"].backend.embed
    )
    a, b = (run_to_completion(engines[n], SEED_PROMPTS, greedy) for n in ("f32", "bf16"))
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        got, want = (np.stack(o.outputs[0].step_logits) for o in (y, x))
        np.testing.assert_array_equal(got, want)


def test_packing_into_q8_0_peaks_at_the_kept_arrays_and_a_slice(checkpoints, monkeypatch):
    """The work beyond the kept arrays stays under a quarter of a float32 LM head (before: the
    head and the table were each widened whole, the work at least one whole head)."""
    monkeypatch.setattr(quant, "COLUMNS_AT_ONCE", 256)
    weights = load_model(str(checkpoints["bf16"])).weights
    store = lambda w: quant.quantize(w, "q8_0")  # noqa: E731
    tracemalloc.start()
    try:
        layers, rest = pack_weights(weights, np.dtype(np.float32), 0.0, store, store)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    head_f32 = 4 * weights.lm_head.size
    assert rest["lm_head"].kind == "q8_0" and rest["embed"].dtype == BF16
    work = peak - kept
    assert 0 < work < head_f32 / 4, f"packing took {work:,} bytes beyond the kept {kept:,}"
    # the kept bytes are what was packed: a bf16 table, Q8_0 blocks (34 bytes per 32 weights)
    blocks = sum(getattr(lw, n).data.nbytes + getattr(lw, n).scales.nbytes
                 for lw in layers for n in ("w_qkv", "w_o", "w_gate_up", "w_down"))  # fmt: skip
    assert kept >= rest["embed"].nbytes + blocks + rest["lm_head"].data.nbytes
