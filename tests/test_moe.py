"""Mixtures of experts: the engine's routing and grouped expert products
(engine/backends/moe.py) against the reference's token-by-token ones (reference/moe.py) and
hand-computed values; config.json's expert keys; the checkpoints' two layouts of experts; a
batch's prompts routed apart; the refusals."""

from __future__ import annotations

import shutil
from functools import cache

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine import SamplingParams
from engine.backends import cpu_ops, fast_ops, moe
from engine.frontend.llm import run_to_completion
from model_loader.config import ModelConfig
from model_loader.hf_weights import read_safetensors
from model_loader.load import load_model
from model_loader.moe import MoeSpec
from model_loader.weights import LayerWeights
from reference.model import forward, silu
from reference.moe import moe_mlp, route_token
from tests.test_families import FAMILY_DIR
from tests.utils import make_engine

F32 = np.float32


def random_layer(rng, d=32, e=6, f=24, fs=0):
    """A sparse layer's router and experts (and a shared expert of width fs), fresh values."""
    mats = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(F32)  # noqa: E731
    experts = dict(e_gate=mats(e, f, d), e_up=mats(e, f, d), e_down=mats(e, d, f))
    if fs:
        experts |= dict(s_gate=mats(fs, d), s_up=mats(fs, d), s_down=mats(d, fs))
        experts |= dict(s_logit=3 * mats(1, d))  # gates spread over (0, 1)
    return LayerWeights(*(None,) * 6, router=mats(e, d), **experts)


def softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits.astype(np.float64) - logits.max())
    return z / z.sum()


def test_routing_ties_go_to_the_lower_index():
    """Experts 1, 3 and 4 have the same router row, raised above the rest: every token's
    logits tie there, and top-2 takes 1 then 3, top-1 takes 1 (torch.topk's order)."""
    rng = np.random.default_rng()
    d, e, t = 16, 6, 9
    h = rng.standard_normal((t, d)).astype(F32)  # (T, D)
    router = rng.standard_normal((e, d)).astype(F32)  # (E, D)
    router[[3, 4]] = router[1]
    h[:, 0] = 10.0  # a shared direction...
    router[[1, 3, 4], 0] = 5.0  # ...that only the tied experts follow: they are on top
    for k, want_ids in ((1, [1]), (2, [1, 3]), (3, [1, 3, 4])):
        ids, w = moe.route(h, np.ascontiguousarray(router.T), k, renormalize=False)
        assert (ids == want_ids).all(), (k, ids)
        logits = h @ router.T  # (T, E)
        for row in range(t):
            assert logits[row, 1] == logits[row, 3] == logits[row, 4]
            p = softmax64(logits[row])
            np.testing.assert_allclose(w[row], p[want_ids], rtol=1e-5)
            assert route_token(logits[row], k, False)[0][0] == 1


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_a_token_by_token_computation(renormalize):
    rng = np.random.default_rng()
    h = rng.standard_normal((23, 16)).astype(F32)
    router = rng.standard_normal((8, 16)).astype(F32)
    ids, w = moe.route(h, np.ascontiguousarray(router.T), 3, renormalize)
    logits = h @ router.T
    for row in range(len(h)):
        p = softmax64(logits[row])
        want = np.argsort(-p, kind="stable")[:3]
        assert ids[row].tolist() == want.tolist()
        want_w = p[want] / (p[want].sum() if renormalize else 1.0)
        np.testing.assert_allclose(w[row], want_w, rtol=1e-5)
        got = route_token(logits[row], 3, renormalize)
        assert [i for i, _ in got] == want.tolist()


def test_group_buckets_the_pairs_by_expert():
    rng = np.random.default_rng()
    e, k, t = 7, 2, 30
    ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)])  # (T, k)
    order, counts, offsets = moe.group(ids, e)
    for x in range(e):
        pairs = order[offsets[x] : offsets[x + 1]]
        want = [p for p in range(t * k) if ids.reshape(-1)[p] == x]  # ascending pair index
        assert pairs.tolist() == want and counts[x] == len(want)
    assert offsets[-1] == t * k


class CountingOps:
    """ops whose matmul counts how often each weight matrix is read."""

    def __init__(self, ops):
        self.ops, self.reads = ops, {}

    def matmul(self, x, w):
        self.reads[id(w)] = self.reads.get(id(w), 0) + 1
        return self.ops.matmul(x, w)

    def act_and_mul(self, gate_up, act):
        return self.ops.act_and_mul(gate_up, act)


@pytest.mark.parametrize("ops", [fast_ops, cpu_ops], ids=["numpy", "cpu"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shared", [0, 40], ids=["routed", "shared-expert"])
def test_grouped_products_match_the_reference(ops, renormalize, shared):
    """Many tokens, few experts: each chosen expert's matrices read once, the sums as the
    reference's token-by-token loop (Qwen2-MoE's gated shared expert added, read once)."""
    rng = np.random.default_rng()
    lw, t = random_layer(rng, fs=shared), 40
    spec = MoeSpec(6, 2, 24, renormalize, (True,), shared)
    packed = moe.pack_experts(lw, spec, lambda a: a, lambda m: np.ascontiguousarray(m, F32))
    x = rng.standard_normal((t, 32)).astype(F32)  # (T, D)
    counting = CountingOps(ops)
    got = moe.experts_forward(x, packed, counting, "silu")  # (T, D)
    want = moe_mlp(x, lw, spec, silu)  # (T, D)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    for m in (*packed.gate_up, *packed.down, *(packed.shared or ())[1:]):
        assert counting.reads.get(id(m), 0) <= 1
    assert sum(counting.reads.values()) >= 2 * 3  # several experts did run
    if shared:  # the shared expert counts: without it the sums differ
        lw.s_down = np.zeros_like(lw.s_down)
        assert np.abs(moe_mlp(x, lw, spec, silu) - want).max() > 1e-2


# ---- config.json ----
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 6,
}


def test_qwen3_moe_config():
    """decoder_sparse_step 2: layers 1, 3, 5 sparse, but 3 is in mlp_only_layers."""
    c = ModelConfig.from_hf_dict(QWEN3_MOE)
    assert c.moe == MoeSpec(8, 2, 32, True, (False, True, False, False, False, True))
    assert c.qk_norm and c.layer_windows == (0,) * 6
    # transformers 5 writes num_local_experts for num_experts
    d = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert ModelConfig.from_hf_dict(d).moe.num_experts == 4
    windowed = ModelConfig.from_hf_dict(QWEN3_MOE | {"use_sliding_window": True,
                                                     "sliding_window": 8})  # fmt: skip
    assert windowed.layer_windows == (8,) * 6  # transformers 5's Qwen3-MoE: every layer


def test_mixtral_config():
    d = {k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "moe_intermediate_size")}
    d = {k: v for k, v in d.items() if "sparse" not in k and "window" not in k and "norm" not in k}
    d = {k: v for k, v in d.items() if k != "mlp_only_layers"}
    d |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    d |= {"num_local_experts": 4, "sliding_window": 8, "router_jitter_noise": 0.0}
    c = ModelConfig.from_hf_dict(d)
    assert c.moe == MoeSpec(4, 2, 160, True, (True,) * 6)
    assert c.layer_windows == (8,) * 6


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be in \[1, num_experts"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok must be a positive integer"),
        ({"mlp_only_layers": [6]}, "mlp_only_layers .* out of range"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size must be a positive"),
        ({"shared_expert_intermediate_size": 64}, "key 'shared_expert_intermediate_size'"),
    ],
)
def test_qwen3_moe_config_refusals(change, message):
    d = {k: v for k, v in (QWEN3_MOE | change).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


QWEN2_MOE = {k: v for k, v in QWEN3_MOE.items() if k not in ("head_dim", "norm_topk_prob")}
QWEN2_MOE |= {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}
QWEN2_MOE |= {"shared_expert_intermediate_size": 48, "qkv_bias": True}


def test_qwen2_moe_config():
    """Qwen2-MoE: a shared expert, norm_topk_prob false unless set, q/k/v biases; without
    layer_types, use_sliding_window windows the even layers below max_window_layers."""
    c = ModelConfig.from_hf_dict(QWEN2_MOE)
    assert c.moe == MoeSpec(8, 2, 32, False, (False, True, False, False, False, True), 48)
    assert c.qkv_bias and not c.qk_norm and c.layer_windows == (0,) * 6
    windowed = QWEN2_MOE | {"use_sliding_window": True, "sliding_window": 8}
    got = ModelConfig.from_hf_dict(windowed | {"max_window_layers": 3}).layer_windows
    assert got == (8, 0, 8, 0, 0, 0)  # Qwen2MoeConfig's layer_types rule
    given = ["full_attention", "sliding_attention"] * 3
    got = ModelConfig.from_hf_dict(windowed | {"layer_types": given}).layer_windows
    assert got == (0, 8) * 3
    assert ModelConfig.from_hf_dict(QWEN2_MOE | {"norm_topk_prob": True}).moe.renormalize


OLMOE = {k: v for k, v in QWEN3_MOE.items() if k in ("vocab_size", "num_experts_per_tok")}
OLMOE |= {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "num_experts": 8}
OLMOE |= {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3}
OLMOE |= {"num_attention_heads": 4, "num_key_value_heads": 2, "clip_qkv": 8.0}
OLMOE |= {"attention_bias": False, "norm_topk_prob": False}


def test_olmoe_config():
    c = ModelConfig.from_hf_dict(OLMOE)
    assert c.moe == MoeSpec(8, 2, 32, False, (True,) * 3)
    assert c.qk_norm_whole and c.clip_qkv == 8.0 and not c.qkv_bias
    assert ModelConfig.from_hf_dict(OLMOE | {"clip_qkv": None}).clip_qkv is None
    assert ModelConfig.from_hf_dict(OLMOE | {"norm_topk_prob": True}).moe.renormalize
    d = {k: v for k, v in OLMOE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert ModelConfig.from_hf_dict(d).moe.num_experts == 4  # OlmoeConfig's attribute_map


@pytest.mark.parametrize(
    "base, change, message",
    [
        (QWEN2_MOE, {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size "
         "must be a positive integer"),
        (QWEN2_MOE, {"qkv_bias": False}, "qkv_bias=False .* is not supported"),
        (OLMOE, {"clip_qkv": -1}, "clip_qkv must be a positive number or null, got -1"),
        (OLMOE, {"clip_qkv": "8"}, "clip_qkv must be a positive number"),
        (OLMOE, {"attention_bias": True}, "attention_bias=True .* is not supported"),
        (OLMOE, {"num_experts": 0}, "num_experts must be a positive integer, got 0"),
    ],
)  # fmt: skip
def test_qwen2_moe_and_olmoe_config_refusals(base, change, message):
    d = {k: v for k, v in (base | change).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


# ---- the engine ----
@cache
def loaded(name: str):
    return load_model(str(FAMILY_DIR / name))


def greedy(name, backend, prompts, n=8):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine = make_engine(loaded(name), backend=backend, block_size=4, num_gpu_blocks=128)
    return [o.token_ids for o in run_to_completion(engine, prompts, params)]


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_batched_prompts_route_apart(name, backend, monkeypatch):
    """Prompts batched together give each one's tokens as run alone, though the batch's rows
    choose different experts."""
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (3, 11, 6, 17)]
    alone = [greedy(name, backend, [p])[0] for p in prompts]
    calls, route = [], moe.route

    def spy(*args):
        ids, w = route(*args)
        calls.append(ids)
        return ids, w

    monkeypatch.setattr(moe, "route", spy)
    assert greedy(name, backend, prompts) == alone
    first = calls[0]  # (T, k): the first sparse layer of the first step, every prompt's rows
    assert len(first) == sum(map(len, prompts))
    assert len(np.unique(first[:, 0])) > 1  # rows of the batch went to different experts


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_router_never_quantized(name):
    """--quantization int8 on the cpu backend: the experts' matrices int8 (the shared
    expert's too), the router and the shared expert's gate the checkpoint's float32 values."""
    m = loaded(name)
    backend = make_engine(m, backend="cpu", quantization="int8").backend
    for lw, packed in zip(m.weights.layers, backend.layers, strict=True):
        if lw.router is None:
            assert packed.experts is None
            continue
        ex = packed.experts
        assert ex.router.dtype == F32
        np.testing.assert_array_equal(ex.router, lw.router.T)
        matrices = [*ex.gate_up, *ex.down]
        if name == "qwen2_moe":
            assert ex.shared[0].dtype == F32
            np.testing.assert_array_equal(ex.shared[0], lw.s_logit.T)
            matrices += ex.shared[1:]
        assert all(w.kind.startswith("int8") for w in matrices)


def test_refused_by_name():
    m = loaded("mixtral")
    with pytest.raises(ValueError, match=r"q4_k_m: a mixture of experts' experts have no k-q"):
        make_engine(m, backend="cpu", quantization="q4_k_m")


def rewritten(tmp_path, name, edit):
    """A copy of a family checkpoint whose tensors ``edit`` changed (a dict, in place)."""
    out = tmp_path / name
    shutil.copytree(FAMILY_DIR / name, out)
    tensors = {k: np.array(v) for k, v in read_safetensors(FAMILY_DIR / name).items()}
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def fuse_qwen3_moe_experts(t: dict) -> None:
    """Per-expert tensors -> transformers 5's in-memory 3-D form (gate rows, then up rows)."""
    for i in (0, 2):  # the sparse layers (layer 1 is in mlp_only_layers)
        name = "model.layers.{i}.mlp.experts.{e}.{m}_proj.weight"
        g, u, dn = (
            [t.pop(name.format(i=i, e=e, m=m)) for e in range(8)] for m in ("gate", "up", "down")
        )
        t[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate(
            [np.stack(g), np.stack(u)], 1
        )
        t[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(dn)


def test_fused_3d_expert_tensors_load_as_the_per_expert_ones(tmp_path):
    fused = load_model(str(rewritten(tmp_path, "qwen3_moe", fuse_qwen3_moe_experts)))
    plain = loaded("qwen3_moe")
    for a, b in zip(plain.weights.layers, fused.weights.layers, strict=True):
        for field in ("router", "e_gate", "e_up", "e_down", "w_gate"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None and y is None) or np.array_equal(x, y), field
    ids = np.random.default_rng().integers(3, 320, size=9).tolist()
    np.testing.assert_array_equal(
        forward(fused.weights, fused.config, ids), forward(plain.weights, plain.config, ids)
    )


def test_a_missing_expert_is_named(tmp_path):
    gone = "model.layers.2.block_sparse_moe.experts.3.w3.weight"
    path = rewritten(tmp_path, "mixtral", lambda t: t.pop(gone))
    with pytest.raises(ValueError, match=f"missing tensor '{gone}'"):
        load_model(str(path))


def test_a_missing_shared_expert_is_named(tmp_path):
    gone = "model.layers.1.mlp.shared_expert_gate.weight"
    path = rewritten(tmp_path, "qwen2_moe", lambda t: t.pop(gone))
    with pytest.raises(ValueError, match=f"missing tensor '{gone}'"):
        load_model(str(path))
