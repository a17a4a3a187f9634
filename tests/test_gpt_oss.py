"""gpt-oss: its config keys and refusals, the attention sinks in the NumPy backend's ops against
the reference's, its experts (router and product biases, the clamped SwiGLU) against the
reference's token-by-token loop, and the engine on its alternating sliding and full layers
(KV groups, chunks straddling the window, a prefix hit longer than the window)
against transformers' golden data; LoRA on its attention against the reference with the
adapter merged. The kernels' sinks: tests/test_cpu_kernels.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from engine import LoRARequest, SamplingParams
from engine.backends import cpu_ops, fast_ops, kv_groups, moe
from engine.frontend.llm import run_to_completion
from engine.lora.adapter import load_adapter
from engine.tools.random_lora import write_random_adapter
from model_loader.config import ModelConfig
from model_loader.moe import MoeSpec
from model_loader.weights import LayerWeights
from reference import kernel_ops
from reference.generate import generate as reference_generate
from reference.model import forward, silu
from reference.moe import clamped_swiglu, moe_mlp
from tests.test_families import FAMILY_DIR, golden, loaded
from tests.test_kv_groups import CHUNKED, drive, drive_golden
from tests.utils import make_engine

F32 = np.float32
CONFIG = json.loads((FAMILY_DIR / "gpt_oss" / "config.json").read_text())


# ---- config.json ----
def test_config_reads_the_experts_windows_and_rope():
    c = ModelConfig.from_hf_dict(CONFIG)
    assert c.family == "gpt_oss" and c.spec.sinks and c.qkv_bias
    assert c.layer_windows == (8, 0, 8)  # sliding, full, sliding
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size) == (4, 2, 32)
    assert m.renormalize and m.biases and m.sparse == (True,) * 3
    assert (m.swiglu_limit, m.swiglu_alpha) == (1.5, 1.702)
    assert c.rope.rope_type == "yarn" and not c.rope.truncate and c.rope.theta == 150000.0
    # the released configs' initial_context_length: the yarn scaling's original context
    assert ModelConfig.from_hf_dict(CONFIG | {"initial_context_length": 4096}).rope == c.rope


def test_config_defaults_as_transformers():
    """No layer_types: sliding first, then full, alternating; no rope_theta: 150000; no
    swiglu keys: limit 7, alpha 1.702."""
    d = {k: v for k, v in CONFIG.items() if k not in ("layer_types", "swiglu_limit")}
    d["rope_parameters"] = {k: v for k, v in d["rope_parameters"].items() if k != "rope_theta"}
    d["num_hidden_layers"] = 4
    c = ModelConfig.from_hf_dict(d)
    assert c.layer_windows == (8, 0, 8, 0) and c.rope.theta == 150000.0
    assert c.moe.swiglu_limit == 7.0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": False}, "attention_bias=False"),
        ({"experts_per_token": 3}, "experts_per_token"),
        ({"initial_context_length": 2048}, r"initial_context_length \(2048\) differs"),
        ({"swiglu_limit": 0}, "swiglu_limit must be a positive number"),
        ({"swiglu_alpha": "fast"}, "swiglu_alpha must be a positive number"),
        ({"sliding_window": None}, "needs sliding_window"),
        ({"num_local_experts": 1}, r"num_experts_per_tok \(2\) must be in \[1, num_experts"),
    ],
)
def test_config_refusals(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(CONFIG | change)


# ---- the attention sinks in the ops ----
def paged_case(rng, lens, hkv=2, group=3, hd=16, bs=4):
    """Random K/V pools holding sequences of ``lens`` tokens in shuffled blocks."""
    need = [-(-n // bs) for n in lens]
    ids = rng.permutation(sum(need) + 3).astype(np.int32)
    tables = np.zeros((len(lens), max(need)), np.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n], at = ids[at : at + n], at + n
    shape = (len(ids), bs, hkv, hd)
    k, v = rng.standard_normal(shape).astype(F32), rng.standard_normal(shape).astype(F32)
    return k, v, tables, hkv * group


@pytest.mark.parametrize("window", [0, 5])
def test_fast_ops_sinks_match_the_reference_ops(window):
    """The NumPy backend's decode and prefill attention with sinks (a sink far above the
    scores among them) against reference/kernel_ops's concatenated column."""
    rng = np.random.default_rng()
    lens = np.array([1, 9, 23, 4], np.int32)
    k, v, tables, heads = paged_case(rng, lens)
    sinks = (2 * rng.standard_normal(heads)).astype(F32)
    sinks[rng.integers(heads)] = 30.0
    q = rng.standard_normal((len(lens), heads, 16)).astype(F32)
    args = (k, v, tables, lens, 0.25, window, 0.0, sinks)
    want = kernel_ops.paged_attention_decode(q.astype(np.float64), *args)
    np.testing.assert_allclose(fast_ops.paged_attention_decode(q, *args), want, atol=2e-6)
    plain = kernel_ops.paged_attention_decode(q.astype(np.float64), *args[:-1])
    assert np.abs(want - plain).max() > 1e-2
    qsl = np.array([0, 1, 6, 23, 25], np.int32)
    q = rng.standard_normal((int(qsl[-1]), heads, 16)).astype(F32)
    args = (k, v, tables, qsl, lens, 0.25, window, 0.0, sinks)
    want = kernel_ops.paged_attention_prefill(q.astype(np.float64), *args)
    np.testing.assert_allclose(fast_ops.paged_attention_prefill(q, *args), want, atol=2e-6)


# ---- the experts ----
def random_gpt_oss_layer(rng, d=32, e=5, f=24):
    mats = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(F32)  # noqa: E731
    vec = lambda *s: (0.5 * rng.standard_normal(s)).astype(F32)  # noqa: E731
    return LayerWeights(
        *(None,) * 6,
        router=mats(e, d),
        e_gate=3 * mats(e, f, d),  # gates past the clamp's limit
        e_up=3 * mats(e, f, d),
        e_down=mats(e, d, f),
        router_bias=vec(e),
        e_gate_bias=vec(e, f),
        e_up_bias=vec(e, f),
        e_down_bias=vec(e, d),
    )


@pytest.mark.parametrize("ops", [fast_ops, cpu_ops], ids=["numpy", "cpu"])
def test_experts_with_biases_and_clamp_match_the_reference(ops):
    """Biases on the router and on every product, the clamped SwiGLU (limit 1.2: many values
    clamped), each token's two experts: the grouped products equal the token-by-token loop;
    without the router's bias the routing changes."""
    rng = np.random.default_rng()
    lw, spec = random_gpt_oss_layer(rng), MoeSpec(5, 2, 24, True, (True,), 0, True, 1.2, 1.702)
    packed = moe.pack_experts(lw, spec, lambda a: a, lambda m: np.ascontiguousarray(m, F32))
    x = rng.standard_normal((30, 32)).astype(F32)  # (T, D)
    got = moe.experts_forward(x, packed, ops, "silu")
    want = moe_mlp(x, lw, spec, silu)
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-4)
    gate = x @ lw.e_gate[0].T + lw.e_gate_bias[0]
    assert (gate > 1.2).any() and (np.abs(x @ lw.e_up[0].T + lw.e_up_bias[0]) > 1.2).any()
    lw.router_bias = np.zeros_like(lw.router_bias) + 5 * np.eye(5, dtype=F32)[0]
    assert np.abs(moe_mlp(x, lw, spec, silu) - want).max() > 1e-2


def test_clamped_swiglu_by_hand():
    gate = np.array([-3.0, 0.5, 9.0], F32)
    up = np.array([-9.0, 0.25, 2.0], F32)
    got = clamped_swiglu(gate, up, 1.702, 7.0)
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    want = [(-7 + 1) * -3 * sig(-3 * 1.702), 1.25 * 0.5 * sig(0.5 * 1.702), 3 * 7 * sig(7 * 1.702)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(
        moe.clamped_swiglu(np.concatenate([gate, up])[None], 1.702, 7.0)[0], want, rtol=1e-6
    )


# ---- the engine on the grouped KV cache ----
@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
def test_grouped_engine_matches_transformers(backend):
    """Three groups (full; two of window 8), 16-token chunks over 4-token blocks (chunks
    straddle the window), freed blocks NaN: transformers' tokens and logits (preemption:
    tests/test_kv_groups.py)."""
    engine, _ = drive_golden("gpt_oss", backend, **CHUNKED)
    assert engine.block_manager.num_groups == 3  # one full group, two sliding of one layer


@pytest.mark.parametrize("backend", ["cpu", "cuda-cpu"])
def test_prefix_hits_longer_than_the_window_equal_grouping_off(backend, monkeypatch):
    """Prompts sharing 40 tokens (five windows), run one after another with prefix caching:
    the later two hit 40 cached tokens, and the grouped engine gives the tokens and logits of
    the engine with one group."""
    rng = np.random.default_rng()
    vocab = loaded("gpt_oss").config.vocab_size
    base = rng.integers(1, vocab, 40).tolist()
    prompts = [base + rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(5, 30, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    args = dict(CHUNKED, enable_prefix_caching=True, num_gpu_blocks=96, max_num_seqs=1)
    grouped, engine, _ = drive("gpt_oss", backend, prompts, params, **args)
    assert engine.block_manager.num_groups == 3  # one full group, two sliding of one layer
    assert [o.num_cached_tokens >= 32 for o in grouped] == [False, True, True]  # one at a time
    monkeypatch.setattr(kv_groups, "GROUPING", False)
    plain, engine, _ = drive("gpt_oss", backend, prompts, params, poison=False, **args)
    assert engine.block_manager.num_groups == 1
    for a, b in zip(grouped, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(
            np.stack(a.outputs[0].step_logits), np.stack(b.outputs[0].step_logits), atol=1e-4
        )


# ---- LoRA on the attention of a mixture of experts ----
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def merged(weights, adapter_dir: Path, scale: float):
    """The checkpoint's weights with the adapter's B A added to each attention projection."""
    from safetensors.numpy import load_file

    t = load_file(str(adapter_dir / "adapter_model.safetensors"))
    layers = []
    for i, lw in enumerate(weights.layers):
        delta = {}
        for module, field in zip(ATTENTION, ("wq", "wk", "wv", "wo"), strict=True):
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            a, b = t[f"{key}.lora_A.weight"], t[f"{key}.lora_B.weight"]  # (r, in), (out, r)
            delta[field] = getattr(lw, field) + scale * (b @ a)
        layers.append(dataclasses.replace(lw, **delta))
    return dataclasses.replace(weights, layers=layers)


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
def test_lora_on_the_attention_matches_the_merged_reference(backend, tmp_path):
    """An adapter on q, k, v and o of every layer (rank 4, alpha 8: scale 2) beside the base
    model in one batch: each row's greedy tokens and logits are the reference's with the
    adapter merged into the weights (or without it)."""
    m = loaded("gpt_oss")
    path = write_random_adapter(tmp_path / "a", m.config, 4, 7, ATTENTION, alpha=8, b_scale=0.5)
    prompt = golden("gpt_oss")["cases"][1]["prompt_token_ids"]
    n = 8
    engine = make_engine(m, backend=backend, enable_lora=True, max_lora_rank=8, record_logits=True)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine.add_request("lora", prompt, params, lora_request=LoRARequest("a", 1, str(path)))
    engine.add_request("base", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, w in (("lora", merged(m.weights, path, 2.0)), ("base", m.weights)):
        want = reference_generate(w, m.config, prompt, n, mode="cached").token_ids
        got = done[rid].outputs[0]
        assert got.token_ids == want, rid
        first = forward(w, m.config, prompt)
        np.testing.assert_allclose(got.step_logits[0], first, atol=1e-4, rtol=0)
    assert done["lora"].outputs[0].token_ids != done["base"].outputs[0].token_ids


def test_lora_on_the_experts_is_refused_by_name(tmp_path):
    m = loaded("gpt_oss")
    bad = write_random_adapter(tmp_path / "b", m.config, 4, 7, ("q_proj", "gate_proj"))
    with pytest.raises(ValueError, match=r"layer 0 gate_proj: the layer's MLP is a mixture"):
        load_adapter(bad, m.config, 8)


# ---- the harmony format, chosen by the family ----
def test_a_gpt_oss_model_is_prompted_in_harmony(tmp_path):
    """The tiny gpt-oss with harmony's tokens added: the server (no --chat-format) and
    LLM.chat render its conversations in harmony, and the real model answers through them."""
    import httpx

    from engine import LLM
    from engine.frontend import harmony
    from engine.tools.live_server import MODEL, LiveServer
    from tests.test_harmony_server import ASK, with_harmony_tokens

    model = with_harmony_tokens(loaded("gpt_oss"))
    want = harmony.prompt_ids(model.tokenizer, ASK)
    with LiveServer(model, max_model_len=512, num_gpu_blocks=160) as s:
        body = {"model": MODEL, "messages": ASK}
        assert httpx.post(s.url + "/tokenize", json=body).json()["tokens"] == want
        r = httpx.post(s.url + "/v1/chat/completions", json=body | {"max_tokens": 6})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
    llm = LLM(loaded=model, max_model_len=512, num_gpu_blocks=160, backend="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.chat(ASK, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == want and len(out.outputs[0].token_ids) == 4
    llm.shutdown()


# ---- a checkpoint with MXFP4 experts (quantization_config mxfp4) ----
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)


def hf_mxfp4(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(..., R, C) float32 rows -> a checkpoint's (..., R, C/32, 16) blocks, (..., R, C/32)
    scales (gguf-py's MXFP4 rounding, its nibbles moved to the checkpoint's order: byte j of a
    block holds value 2j low, 2j + 1 high), and the values they stand for as transformers
    reads them, e2m1(code) * 2^(scale - 127)."""
    import gguf

    *lead, r, c = rows.shape
    q = gguf.quants.quantize(rows.reshape(-1, c), gguf.GGMLQuantizationType.MXFP4)
    q = q.reshape(-1, 17)  # GGUF: e, then value j low and j + 16 high
    codes = np.concatenate([q[:, 1:] & 15, q[:, 1:] >> 4], axis=1)  # (n, 32) in value order
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = np.ascontiguousarray(q[:, 0])  # (n,) (save_file writes a strided view wrongly)
    values = E2M1[codes] * np.exp2(scales.astype(np.float64) - 127)[:, None]
    shape = (*lead, r, c // 32)
    return blocks.reshape(*shape, 16), scales.reshape(shape), values.reshape(*lead, r, c)


def write_mxfp4_checkpoint(path: Path):
    """The tiny gpt-oss with its experts in MXFP4 as a released checkpoint stores them; ->
    the float weights the checkpoint stands for (the reference's)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = FAMILY_DIR / "gpt_oss"
    shutil.copytree(src, path)
    conf = json.loads((src / "config.json").read_text())
    conf["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (path / "config.json").write_text(json.dumps(conf))
    t = load_file(str(src / "model.safetensors"))
    m = loaded("gpt_oss")
    layers = []
    for i, lw in enumerate(m.weights.layers):
        pre = f"model.layers.{i}.mlp.experts."
        gu = t.pop(pre + "gate_up_proj").transpose(0, 2, 1)  # (E, 2F, D) outputs as rows
        dn = t.pop(pre + "down_proj").transpose(0, 2, 1)  # (E, D, F)
        t[pre + "gate_up_proj_blocks"], t[pre + "gate_up_proj_scales"], gu_v = hf_mxfp4(gu)
        t[pre + "down_proj_blocks"], t[pre + "down_proj_scales"], dn_v = hf_mxfp4(dn)
        values = dict(e_gate=gu_v[:, 0::2], e_up=gu_v[:, 1::2], e_down=dn_v)
        layers.append(dataclasses.replace(lw, **{k: v.astype(F32) for k, v in values.items()}))
    save_file(t, str(path / "model.safetensors"))
    return dataclasses.replace(m.weights, layers=layers), m.config


def test_an_mxfp4_checkpoint_keeps_its_experts_in_blocks(tmp_path):
    """quantization_config mxfp4: the experts' blocks repacked (kept as MXFP4 on the cpu and
    cuda-cpu backends, widened on numpy), the numpy and cuda-cpu backends' tokens and logits
    the reference's on the values the blocks stand for, the cpu backend's within its 8-bit
    activations."""
    from model_loader.load import load_model

    path = tmp_path / "mxfp4"
    want_w, cfg = write_mxfp4_checkpoint(path)
    m = load_model(str(path))
    assert m.config.quantization.method == "mxfp4"
    assert np.abs(want_w.layers[0].e_gate - loaded("gpt_oss").weights.layers[0].e_gate).max() > 0
    prompt = golden("gpt_oss")["cases"][2]["prompt_token_ids"]
    want = reference_generate(want_w, cfg, prompt, 8, mode="cached").token_ids
    first = forward(want_w, cfg, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for backend, atol in (("numpy", 1e-4), ("cuda-cpu", 1e-4), ("cpu", 0.1)):
        engine = make_engine(load_model(str(path)), backend=backend, record_logits=True)
        got = run_to_completion(engine, [prompt], params)[0].outputs[0]
        np.testing.assert_allclose(got.step_logits[0], first, atol=atol, rtol=0)
        if backend != "cpu":
            assert got.token_ids == want
        if backend == "cuda-cpu":  # moe_matmul reads the blocks
            assert next(lw.experts for lw in engine.backend.layers).fmt == "mxfp4"
        if backend == "cpu":
            ex = next(lw.experts for lw in engine.backend.layers)
            assert {w.kind for w in (*ex.gate_up, *ex.down)} == {"mxfp4"}


def test_mxfp4_is_read_for_gpt_oss_only(tmp_path):
    import shutil

    from model_loader.load import load_model

    shutil.copytree(FAMILY_DIR / "mixtral", tmp_path / "m")
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="mxfp4 is read for gpt_oss only, not mixtral"):
        load_model(str(tmp_path / "m"))
