"""Loading at about the kept weights' memory (engine/backends/numpy_backend.pack_weights): a
16-bit checkpoint's embedding table is kept in its own dtype, and gives the tokens and logits
of the same values stored as float32; packing a model into a quantized format allocates, at its
peak, the kept arrays plus a slice's worth of work, never a float32 copy of the LM head or the
table (tracemalloc counts NumPy's allocations; the checkpoint itself is mapped, not counted)."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory):
    """A Q8_0 GGUF of a random 16-layer model whose layers outweigh its table and head."""
    from gguf import GGMLQuantizationType as Q

    from tests.test_loaders import write_gguf

    root = tmp_path_factory.mktemp("load_memory_gguf")
    seed = int(np.random.default_rng().integers(1 << 30))
    src = make_tiny_model(root / "src", seed=seed, num_hidden_layers=16, intermediate_size=512)
    cfg = {**json.loads((src / "config.json").read_text())}
    tensors = load_file(str(src / "model.safetensors"))
    return src, write_gguf(root / "m.gguf", cfg, tensors, src, Q.Q8_0)


def test_a_gguf_is_dequantized_a_layer_at_a_time(q8_0_gguf):
    """read_gguf dequantizes no layer up front; packing takes each layer as it goes and lets it
    go, so what stays is the packed arrays and the work is a layer's (a slice's temporaries
    included), not the whole file's float32 values; a layer asked for again comes back the
    same."""
    from reference.weights import LazyLayers

    _, path = q8_0_gguf
    tracemalloc.start()
    try:
        weights = load_model(str(path)).weights
        assert isinstance(weights.layers, LazyLayers)
        read = tracemalloc.get_traced_memory()[0]
        first = [a.copy() for a in (weights.layers[3].wq, weights.layers[3].w_down)]
        layer = sum(a.nbytes for a in vars(weights.layers[3]).values() if a is not None)
        weights.layers.release(3)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        store = lambda w: quant.quantize(w, "q8_0")  # noqa: E731
        layers, rest = pack_weights(weights, np.dtype(np.float32), 0.0, store, store)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    all_layers = layer * len(layers)  # the file's layers in float32
    packed = sum(a.nbytes for lw in layers for a in vars(lw).values() if a is not None)
    packed += rest["lm_head"].nbytes + rest["final_norm"].nbytes
    assert read < all_layers / 4, f"read_gguf allocated {read:,} bytes"
    assert kept - base - packed < 2 * layer, f"{kept - base - packed:,} bytes stayed"
    assert peak - kept < min(8 * layer, all_layers / 2), f"packing took {peak - kept:,}"
    np.testing.assert_array_equal(weights.layers[3].wq, first[0])  # made again, the same
    np.testing.assert_array_equal(weights.layers[3].w_down, first[1])
    assert len(layers) == 16 and layers[3].w_qkv.kind == "q8_0"
