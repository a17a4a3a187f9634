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
from engine.backends.packed_weights import pack_weights
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
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


def one_layout(monkeypatch, layout: str = "plain") -> None:
    """Every shape takes ``layout`` on the cpu backend: two engines of one test then sum in the
    same order (left to its timings, a busy machine can give them different layouts, whose
    logits differ in the last bits)."""
    from engine.backends import cpu_tuning

    def choose(matrices: dict) -> dict:
        times = {name: [1.0] * len(cpu_tuning.ROWS) for name in ("panels", "plain", "numpy")}
        return {shape: cpu_tuning.Choice(layout, times) for shape in matrices}

    monkeypatch.setattr(cpu_tuning, "choose", choose)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_a_bf16_table_is_kept_in_bf16_with_the_float32_checkpoints_tokens(
    checkpoints, backend, monkeypatch
):
    one_layout(monkeypatch)
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
    from model_loader.weights import LazyLayers

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


def _gguf_of(src, path, qtype):
    """src (a Hugging Face directory) written as a llama GGUF with its matrices in qtype."""
    from tests.test_loaders import write_gguf

    cfg = json.loads((src / "config.json").read_text())
    return write_gguf(path, cfg, load_file(str(src / "model.safetensors")), src, qtype)


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0", "Q4_1"])
def block_gguf(request, tmp_path_factory):
    """(kind, a GGUF of a random tiny model, untied, every matrix in that block format)."""
    from gguf import GGMLQuantizationType as Q

    root = tmp_path_factory.mktemp(f"blocks_{request.param}")
    seed = int(np.random.default_rng().integers(1 << 30))
    src = make_tiny_model(root / "src", seed=seed)
    return request.param.lower(), _gguf_of(src, root / "m.gguf", Q[request.param])


def test_a_gguf_table_and_head_stay_in_blocks_and_read_as_their_dequantized_values(block_gguf):
    """The table and the LM head load as BlockMatrix (views of the file); rows gathered, the
    whole matrix, column slices of the transpose and the engine's own dequantization of the
    split blocks all equal the tensor dequantized whole, as it was loaded before."""
    import gguf

    from model_loader.gguf_file import BlockMatrix, dequantize_tensor

    kind, path = block_gguf
    w = load_model(str(path)).weights
    assert isinstance(w.embed, BlockMatrix) and isinstance(w.lm_head, BlockMatrix)
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    rng = np.random.default_rng()
    for m, name in ((w.embed, "token_embd.weight"), (w.lm_head, "output.weight")):
        dense = dequantize_tensor(stored[name])  # (V, D) float32
        assert m.kind == kind and m.shape == dense.shape and m.nbytes < dense.nbytes / 3
        ids = rng.integers(0, len(dense), 40)
        np.testing.assert_array_equal(m[ids], dense[ids])
        np.testing.assert_array_equal(np.asarray(m), dense)
        a, b = sorted(rng.integers(0, len(dense), 2))
        np.testing.assert_array_equal(m.T[:, a : b + 1], dense.T[:, a : b + 1])
        np.testing.assert_array_equal(quant.dequantize_blocks(kind, *m.blocks()), dense.T)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_an_engine_on_a_gguf_in_blocks_gives_the_widened_tables_tokens(block_gguf, backend):
    """An engine whose table and head stay a GGUF's blocks gives the greedy tokens and logits,
    bit for bit, of the same engine given them widened to float32 arrays; where the head's
    format is the file's (q8_0, the cpu backend's default for a Q8_0 GGUF) it keeps the
    file's bytes, which are what quantizing the widened head gives."""
    import dataclasses

    kind, path = block_gguf
    loaded = load_model(str(path))
    widened = dataclasses.replace(
        loaded,
        weights=dataclasses.replace(
            loaded.weights,
            embed=np.asarray(loaded.weights.embed),
            lm_head=np.asarray(loaded.weights.lm_head),
        ),
    )
    args = dict(backend=backend, record_logits=True)
    if backend == "cpu" and kind != "q8_0":
        args["quantization"] = kind  # (a Q8_0 file is run as q8_0 without the flag)
    engines = [make_engine(m, **args) for m in (loaded, widened)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a, b = (run_to_completion(e, SEED_PROMPTS, greedy) for e in engines)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        np.testing.assert_array_equal(
            np.stack(x.outputs[0].step_logits), np.stack(y.outputs[0].step_logits)
        )
    head = engines[0].backend.lm_head
    if backend == "cpu" and kind == "q8_0":
        again = quant.quantize(np.asarray(loaded.weights.lm_head).T, "q8_0")
        np.testing.assert_array_equal(head.data, again.data)
        np.testing.assert_array_equal(head.scales, again.scales)


def test_packing_a_q8_0_gguf_never_widens_its_table_or_head(checkpoints, tmp_path):
    """Loading and packing a Q8_0 GGUF whose table and head dominate its bytes allocates the
    kept arrays and a layer's work: no float32 table or head (each 2 MB here) exists at any
    point, and the table is kept as the file's blocks."""
    from gguf import GGMLQuantizationType as Q

    from model_loader.gguf_file import BlockMatrix

    path = _gguf_of(checkpoints["f32"], tmp_path / "m.gguf", Q.Q8_0)
    store = lambda w: quant.quantize(w, "q8_0")  # noqa: E731
    tracemalloc.start()
    try:
        weights = load_model(str(path)).weights
        read = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        layers, rest = pack_weights(weights, np.dtype(np.float32), 0.0, store, store)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    head_f32 = 4 * rest["lm_head"].shape[0] * rest["lm_head"].shape[1]
    assert isinstance(rest["embed"], BlockMatrix) and rest["lm_head"].kind == "q8_0"
    assert read < head_f32 / 2, f"loading kept {read:,} bytes"  # the metadata, the tokenizer's
    assert kept - read < head_f32, f"{kept:,} bytes kept"  # the head's and the layers' blocks
    assert peak - kept < head_f32 / 4, f"packing peaked at {peak - kept:,} bytes beyond"
