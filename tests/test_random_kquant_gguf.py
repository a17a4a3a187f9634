"""scripts/make_random_kquant_gguf.py (the Qwen3-30B-A3B-shaped benchmark file, written as
random Q4_K_M blocks) at a small shape: gguf-py reads back the types llama-quantize's Q4_K_M
gives and the values the script meant, and the engine runs the file on `cpu` with the same
greedy tokens and logits as on `numpy` (which dequantizes every block)."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_random_kquant_gguf as script  # noqa: E402

SMALL = script.Shape(layers=2, d=256, heads=4, kv=2, hd=64, experts=6, f=256, top_k=2)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("kq") / "small.gguf"
    script.write(str(p), int(np.random.default_rng().integers(1 << 30)), SMALL)
    return p


def test_the_types_and_values(path):
    r = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_K"
    assert types["blk.1.ffn_down_exps.weight"] == "Q6_K"  # more_bits: the last eighth
    assert types["blk.1.ffn_gate_exps.weight"] == "Q4_K"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"
    for name in ("blk.1.ffn_up_exps.weight", "output.weight"):
        t = next(t for t in r.tensors if t.name == name)
        v = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(v).all() and 0.005 < v.std() < 0.08, (name, v.std())


def test_cpu_runs_it_as_numpy_does(path):
    """The first token's distribution after a random prompt: numpy's five likeliest tokens are
    among cpu's twenty, at the same logprobs within the 8-bit activations' rounding (random
    weights make the logits flat, so the greedy tokens of the two can part on a near tie)."""
    prompt = np.random.default_rng().integers(100, 40000, 12).tolist()
    got = {}
    for backend, k in (("numpy", 5), ("cpu", 20)):
        llm = LLM(str(path), backend=backend, max_model_len=64, num_gpu_blocks=8)
        sp = SamplingParams(temperature=0, max_tokens=1, logprobs=k)
        got[backend] = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].logprobs[0]
    want = got["numpy"]
    assert max(want.values()) - min(want.values()) > 0.02  # not all ties
    for token, logprob in want.items():
        assert abs(got["cpu"][token] - logprob) < 0.05
