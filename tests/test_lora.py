"""LoRA adapters against PEFT: random adapters of ranks 1, 8 and 64 (rsLoRA) on the tiny llama,
qwen2 and phi3 checkpoints (phi3's in its fused qkv_proj / gate_up_proj names), golden greedy
tokens and logits from PEFT over transformers (scripts/make_lora_golden.py). One batch mixes the
three adapters and the base model in its first step; the prefix cache keeps adapters apart; a bad
adapter is a one-line error and the engine keeps serving."""

from __future__ import annotations

import base64
import json
import re
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.config import EngineConfig
from tests.test_families import loaded
from tests.utils import make_engine

LORA_DIR = Path(__file__).parent / "data" / "lora"
FAMILIES = ("llama", "qwen2", "phi3")
# float32 logits at the prompt's last position, PEFT + transformers vs the engine: measured
# worst cases 4e-5 (llama), 9.3e-5 (qwen2's rank-64 rsLoRA on numpy), 1.01e-4 (the same on the
# cpu backend, whose float32 sums round in another order); a wrong adapter, slot or scale is
# off by far more than 1e-2
ATOL = 2e-4


@cache
def golden(family: str) -> dict:
    return json.loads((LORA_DIR / family / "golden.json").read_text())


def lora(family: str, name: str | None) -> LoRARequest | None:
    if name is None:
        return None
    ids = {"r1_qv": 1, "r8_all": 2, "r64_rslora": 3}
    return LoRARequest(name, ids[name], str(LORA_DIR / family / name))


def run(engine, prompts, loras, n: int) -> list:
    """Every prompt added before the first step, with its adapter; outputs in order."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, (p, lr) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(i), p, params, lora_request=lr)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    return [done[str(i)] for i in range(len(prompts))]


def slots_seen(engine) -> list[set]:
    """The adapter slots of each forward's rows, from now on."""
    seen, forward = [], engine.backend.forward

    def spy(batch):
        s = batch.lora_slots
        seen.append(set() if s is None else set(s.tolist()))
        return forward(batch)

    engine.backend.forward = spy
    return seen


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_three_adapters_and_the_base_model_matches_peft(family, backend):
    cases = golden(family)["cases"]
    engine = make_engine(
        loaded(family), backend=backend, record_logits=True, enable_lora=True, max_loras=3,
        max_lora_rank=64, enable_prefix_caching=True,
    )  # fmt: skip
    seen = slots_seen(engine)
    prompts = [c["prompt_token_ids"] for c in cases]
    outs = run(engine, prompts, [lora(family, c["adapter"]) for c in cases], 8)
    assert seen[0] == {-1, 0, 1, 2}  # the first step: every adapter's rows and the base model's
    for case, out in zip(cases, outs, strict=True):
        n = len(case["prompt_token_ids"])
        where = f"{family} {backend} adapter {case['adapter']}, prompt of {n}"
        assert out.outputs[0].token_ids == case["token_ids"], where
        want = np.frombuffer(base64.b64decode(case["logits"]), dtype="<f4")
        got = out.outputs[0].step_logits[0]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=where)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def smollm2_loras(tmp_path_factory, smollm2):
    """The SmolLM2 golden adapters, written again from their seeds (engine/tools/random_lora.py,
    as scripts/make_lora_golden.py --smollm2 wrote them), byte for byte: {name: LoRARequest}."""
    import hashlib

    from engine.tools.random_lora import PARTS, write_random_adapter

    meta, out = golden("smollm2")["meta"], tmp_path_factory.mktemp("smollm2-lora")
    reqs = {}
    for i, (name, (rank, seed, modules, alpha, rslora)) in enumerate(meta["adapters"].items()):
        mods = modules.split(",") if modules else PARTS
        folder = write_random_adapter(
            out / name, smollm2.config, rank, seed, mods, alpha, rslora, meta["b_scale"]
        )
        raw = (folder / "adapter_model.safetensors").read_bytes()
        assert hashlib.sha256(raw).hexdigest() == meta["sha256"][name], f"{name}: other bytes"
        reqs[name] = LoRARequest(name, i + 1, str(folder))
    return reqs


@pytest.mark.parametrize("backend", ["cpu", "cuda-cpu"])
def test_smollm2_with_three_adapters_and_the_base_model_matches_peft(
    smollm2, smollm2_loras, backend
):
    """SmolLM2-135M (its Q4_1 GGUF in float32, as transformers dequantizes it) with random
    adapters of rank 1, 8 and 64 and the base model in one batch: PEFT's greedy tokens (8 on cpu,
    the first 3 on the emulated device), its first-step logits (at 512 of the 49,152 ids) within
    the base model's own golden tolerance."""
    import dataclasses

    from engine.golden import LOGITS_ATOL

    cases = golden("smollm2")["cases"]
    loaded = dataclasses.replace(smollm2, weights=smollm2.weights.astype(np.float32))
    engine = make_engine(
        loaded, backend=backend, dtype="float32", record_logits=True, enable_lora=True,
        max_loras=3, max_lora_rank=64, num_gpu_blocks=64,
    )  # fmt: skip
    seen = slots_seen(engine)
    prompts = [c["prompt_token_ids"] for c in cases]
    loras = [smollm2_loras.get(c["adapter"]) for c in cases]
    # the emulated device runs every kernel in Python threads: 3 of the 8 tokens there
    n = len(cases[0]["token_ids"]) if backend == "cpu" else 3
    outs = run(engine, prompts, loras, n)
    assert seen[0] == {-1, 0, 1, 2}
    for case, out in zip(cases, outs, strict=True):
        where = f"{backend} adapter {case['adapter']}, prompt of {len(case['prompt_token_ids'])}"
        assert out.outputs[0].token_ids == case["token_ids"][:n], where
        want = np.frombuffer(base64.b64decode(case["logits"]), dtype="<f4")
        got = out.outputs[0].step_logits[0][case["logit_ids"]]
        np.testing.assert_allclose(got, want, atol=LOGITS_ATOL, rtol=0, err_msg=where)


@pytest.mark.parametrize(
    "backend, tp, pp", [("numpy", 2, 1), ("numpy", 4, 1), ("numpy", 1, 2), ("cuda-cpu", 4, 1)]
)
def test_parallel_ranks_each_keep_their_cut_of_the_adapters(backend, tp, pp):
    """Tensor parallel (at 4 ranks the 2 KV heads are shared by pairs of ranks) and pipeline
    parallel: each rank its cut of each adapter; PEFT's tokens and logits, adapters mixed."""
    family = "qwen2"
    cases = golden(family)["cases"]
    engine = make_engine(
        loaded(family), backend=backend, record_logits=True, enable_lora=True, max_loras=3,
        max_lora_rank=64, tensor_parallel_size=tp, pipeline_parallel_size=pp,
    )  # fmt: skip
    try:
        outs = run(
            engine,
            [c["prompt_token_ids"] for c in cases],
            [lora(family, c["adapter"]) for c in cases],
            8,
        )
        for case, out in zip(cases, outs, strict=True):
            assert out.outputs[0].token_ids == case["token_ids"], case["adapter"]
            want = np.frombuffer(base64.b64decode(case["logits"]), dtype="<f4")
            np.testing.assert_allclose(out.outputs[0].step_logits[0], want, atol=ATOL, rtol=0)
    finally:
        engine.backend.shutdown()


def test_the_prefix_cache_never_shares_blocks_between_adapters():
    family = "llama"
    prompt = golden(family)["cases"][1]["prompt_token_ids"]  # 40 tokens: two full blocks
    engine = make_engine(loaded(family), enable_lora=True, max_loras=2, enable_prefix_caching=True)
    outs = run(engine, [prompt] * 4, [None, lora(family, "r1_qv"), lora(family, "r1_qv"), None], 2)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32, 32]  # each shares with its own kind
    want = {
        c["adapter"]: c["token_ids"][:2]
        for c in golden(family)["cases"]
        if c["prompt_token_ids"] == prompt
    }
    assert [o.outputs[0].token_ids for o in outs] == [
        want[None],
        want["r1_qv"],
        want["r1_qv"],
        want[None],
    ]


def test_one_slot_serves_three_adapters_in_turn_and_loses_nothing():
    family = "qwen2"
    cases = golden(family)["cases"]
    engine = make_engine(loaded(family), enable_lora=True, max_loras=1, max_lora_rank=64)
    seen = slots_seen(engine)
    outs = run(
        engine,
        [c["prompt_token_ids"] for c in cases],
        [lora(family, c["adapter"]) for c in cases],
        8,
    )
    assert [o.outputs[0].token_ids for o in outs] == [c["token_ids"] for c in cases]
    assert all(len(s - {-1}) <= 1 for s in seen)  # one adapter a step at most
    assert engine.core.lora.slots == [3]  # the last adapter holds the slot


def test_llm_takes_one_lora_request_or_one_per_prompt():
    family = "llama"
    cases = [c for c in golden(family)["cases"] if c["adapter"] in (None, "r8_all")]
    llm = LLM(model=str(Path(__file__).parent / "data/families" / family), enable_lora=True,
              max_loras=2, num_gpu_blocks=64, max_model_len=128)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [c["prompt_token_ids"] for c in cases]
    outs = llm.generate(
        prompts, params, use_tqdm=False, lora_request=[lora(family, c["adapter"]) for c in cases]
    )
    assert [o.outputs[0].token_ids for o in outs] == [c["token_ids"] for c in cases]
    r8 = [c for c in cases if c["adapter"] == "r8_all"]
    outs = llm.generate(
        [c["prompt_token_ids"] for c in r8],
        params,
        use_tqdm=False,
        lora_request=lora(family, "r8_all"),
    )
    assert [o.outputs[0].token_ids for o in outs] == [c["token_ids"] for c in r8]
    with pytest.raises(ValueError, match="lora_request: 1 given for 2 prompts"):
        llm.generate(prompts[:2], params, lora_request=[None])


def test_the_replay_names_each_requests_adapter(tmp_path):
    family = "llama"
    html = tmp_path / "run.html"
    llm = LLM(model=str(Path(__file__).parent / "data/families" / family), enable_lora=True,
              num_gpu_blocks=64, max_model_len=128, trace_html=str(html))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(
        [[5, 6, 7], [8, 9]], params, use_tqdm=False, lora_request=[lora(family, "r8_all"), None]
    )
    text = html.read_text()
    assert '"lora":"r8_all"' in text and '"lora":null' in text


def broken(tmp_path, family="llama", name="r8_all", edit=None, drop=None) -> LoRARequest:
    d = tmp_path / "bad"
    shutil.copytree(LORA_DIR / family / name, d)
    if edit:
        conf = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps(conf | edit))
    if drop:
        (d / drop).unlink()
    return LoRARequest("bad", 9, str(d))


def nan_adapter(tmp_path) -> LoRARequest:
    from safetensors.numpy import load_file, save_file

    req = broken(tmp_path)
    f = Path(req.lora_path) / "adapter_model.safetensors"
    t = load_file(str(f))
    key = sorted(t)[0]
    t[key] = t[key].copy()
    t[key][0, 0] = np.nan
    save_file(t, str(f))
    return req


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: broken(p, drop="adapter_model.safetensors"), "no adapter_model.safetensors"),
        (lambda p: broken(p, edit=dict(use_dora=True)), "DoRA is not implemented"),
        (lambda p: broken(p, edit=dict(modules_to_save=["lm_head"])), "modules_to_save"),
        (lambda p: broken(p, edit=dict(lora_alpha=0)), "lora_alpha must be a positive number"),
        (lambda p: broken(p, name="r64_rslora"), "rank 64 > max_lora_rank 16"),
        (lambda p: broken(p, family="phi3"), None),  # phi3's fused names: fine for llama too
        (nan_adapter, "holds NaN or infinite values"),
        (lambda p: LoRARequest("gone", 9, str(p / "nowhere")), "no adapter_config.json"),
    ],
)
def test_a_bad_adapter_is_one_line_and_the_engine_keeps_serving(tmp_path, make, why):
    family = "llama"
    engine = make_engine(loaded(family), enable_lora=True, max_loras=2)
    req = make(tmp_path)
    prompt = golden(family)["cases"][0]["prompt_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    if why is None:
        engine.add_request("ok", prompt, params, lora_request=req)
        engine.abort("ok")
    else:
        with pytest.raises(ValueError, match=why) as e:
            engine.add_request("bad", prompt, params, lora_request=req)
        assert "\n" not in str(e.value)
    outs = run(engine, [prompt], [None], 8)  # the base model still answers
    assert outs[0].outputs[0].token_ids == golden(family)["cases"][0]["token_ids"]


def test_an_adapter_for_another_shape_or_depth_is_refused_by_name(tmp_path, tiny):
    from safetensors.numpy import load_file, save_file

    req = broken(tmp_path)
    f = Path(req.lora_path) / "adapter_model.safetensors"
    t = load_file(str(f))
    key = next(k for k in sorted(t) if "layers.1.mlp.down_proj.lora_A" in k)
    t[key] = t[key][:, :100].copy()  # (8, 160) -> (8, 100): another intermediate size
    save_file(t, str(f))
    engine = make_engine(loaded("llama"), enable_lora=True)
    why = r"layer 1 down_proj: A \(8, 100\) and B \(64, 8\) do not fit the model's \(8, 160\)"
    with pytest.raises(ValueError, match=why):
        engine.add_request("0", [5, 6, 7], lora_request=req)
    shallow = make_engine(tiny, enable_lora=True)  # 2 layers; the adapter has 3
    with pytest.raises(ValueError, match="layer 2, the model has 2"):
        shallow.add_request("0", [5, 6, 7], lora_request=lora("llama", "r8_all"))


def test_lora_options_are_checked():
    with pytest.raises(ValueError, match="lora_request needs an engine made with enable_lora"):
        make_engine(loaded("llama")).add_request(
            "0", [5, 6], lora_request=LoRARequest("a", 1, "/x")
        )
    with pytest.raises(ValueError, match="max_loras must be an integer"):
        EngineConfig(max_loras=0)
    with pytest.raises(ValueError, match="lora_int_id must be at least 1"):
        LoRARequest("a", 0, "/x").check()


# ---- the server ----


def test_the_server_serves_adapters_by_model_name_and_loads_them_at_run_time(tmp_path):
    """The official openai client: /v1/models lists the adapters with their parent; a request's
    model picks its adapter (PEFT's tokens); an adapter loaded while serving, unloaded, and an
    unknown one's 404."""
    import httpx
    import openai

    from engine.tools.live_server import LiveServer

    family = "llama"
    cases = {(c["adapter"], len(c["prompt_token_ids"])): c for c in golden(family)["cases"]}
    modules = [("r1", str(LORA_DIR / family / "r1_qv")), ("r8", str(LORA_DIR / family / "r8_all"))]
    kw = dict(
        enable_lora=True,
        max_loras=2,
        max_lora_rank=64,
        model=str(LORA_DIR.parent / "families" / family),
    )
    with LiveServer(loaded(family), lora_modules=modules, runtime_lora=True, **kw) as s:
        client = s.openai_client()
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", "r1", "r8"}
        assert models["r8"].model_extra["parent"] == "tiny"

        def complete(model, adapter):
            case = cases[(adapter, 40)]
            out = client.completions.create(
                model=model, prompt=case["prompt_token_ids"], max_tokens=8, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return out, case

        for model, adapter in (("r1", "r1_qv"), ("tiny", None), ("r8", "r8_all")):
            out, case = complete(model, adapter)
            assert out.model == model
            assert out.choices[0].text == s.engine.tokenizer.decode(case["token_ids"]), model
        post = lambda path, body: httpx.post(s.url + path, json=body, timeout=30)  # noqa: E731
        r = post(
            "/v1/load_lora_adapter",
            {"lora_name": "r64", "lora_path": str(LORA_DIR / family / "r64_rslora")},
        )
        assert r.status_code == 200, r.text
        out, case = complete("r64", "r64_rslora")
        assert out.choices[0].text == s.engine.tokenizer.decode(case["token_ids"])
        assert post("/v1/unload_lora_adapter", {"lora_name": "r64"}).status_code == 200
        r = post("/v1/unload_lora_adapter", {"lora_name": "r64"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        with pytest.raises(openai.NotFoundError, match="The model `r64` does not exist"):
            complete("r64", "r64_rslora")
        r = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
        inplace = {"lora_name": "r1", "lora_path": modules[0][1], "load_inplace": True}
        r = post("/v1/load_lora_adapter", inplace)
        assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"
        out, _ = complete("r1", "r1_qv")  # still serving
        metrics = httpx.get(s.url + "/metrics").text
        assert 'running_lora_adapters="r1"' in metrics and 'max_lora="2"' in metrics


def test_bench_spreads_requests_over_random_adapters(tiny_model_dir, capsys):
    from engine.tools.bench import main as bench_main

    argv = ["--model", str(tiny_model_dir), "--backend", "cpu", "--num-requests", "6"]
    argv += ["--max-num-seqs", "4", "--min-prompt", "4", "--max-prompt", "12", "--min-output"]
    argv += ["8", "--max-output", "8", "--batch1-tokens", "4", "--lora-adapters", "3"]
    assert bench_main([*argv, "--lora-rank", "4"]) == 0
    out = capsys.readouterr().out
    assert "6 requests over 3 LoRA adapters of rank 4" in out and "48 generated" not in out
    from model_loader.config import ModelConfig

    c = ModelConfig.from_json(Path(tiny_model_dir) / "config.json")
    line = next(x for x in out.splitlines() if x.startswith("LoRA memory per adapter: "))
    loaded, more = (int(w.replace(",", "")) for w in re.findall(r"\(([\d,]+) bytes", line))
    d, q, kv, f = c.hidden_size, c.q_dim, c.kv_dim, c.intermediate_size
    per_layer = 4 * ((d + q) + (d + kv) * 2 + (q + d) + (d + f) * 2 + (f + d))  # rank 4
    assert loaded == 4 * per_layer * c.num_hidden_layers  # seven projections' float32 pairs
    assert 0 <= more < loaded  # the cpu backend's A, where it packs it (B: the pairs' own)


def test_random_lora_writes_an_adapter_the_engine_serves(tmp_path, tiny_model_dir, capsys):
    """python -m engine.tools.random_lora (the README's stand-in for a fine-tune): a PEFT
    directory on the modules asked for that moves the model's tokens; bad values named."""
    from engine.tools.random_lora import main as random_lora

    out = tmp_path / "qv"
    argv = ["--model", str(tiny_model_dir), "--rank", "4", "--seed", "5", "--b-scale", "2"]
    assert random_lora([*argv, "--modules", "q_proj,v_proj", "--out", str(out)]) == 0
    conf = json.loads((out / "adapter_config.json").read_text())
    assert (conf["r"], conf["target_modules"]) == (4, ["q_proj", "v_proj"])
    llm = LLM(model=str(tiny_model_dir), enable_lora=True, backend="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base, tuned = (
        llm.generate([[5, 6, 7, 8]], params, lora_request=lr)[0].outputs[0].token_ids
        for lr in (None, LoRARequest("qv", 1, str(out)))
    )
    assert base != tuned
    assert random_lora([*argv, "--modules", "q_proj,lm_head", "--out", str(out)]) == 2
    assert "unknown modules ['lm_head']" in capsys.readouterr().err


def test_serve_refuses_adapters_it_cannot_serve(capsys):
    from engine.entrypoints.serve import main as serve_main

    base = ["--model", str(Path(__file__).parent / "data/families/llama"), "--port", "0"]
    assert serve_main([*base, "--lora-modules", "a=/x"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert serve_main([*base, "--enable-lora", "--lora-modules", "a"]) == 2
    assert "'a' is not name=path" in capsys.readouterr().err


def test_adapters_through_the_kv_tiers_and_a_core_process(tmp_path):
    """Blocks an adapter computed, stored on disk and loaded by a restarted engine, only ever
    serve that adapter (the chain's root is the adapter's); and a core process runs adapters."""
    family = "llama"
    cases = [c for c in golden(family)["cases"] if len(c["prompt_token_ids"]) == 40]
    prompts = [c["prompt_token_ids"] for c in cases]
    loras = [lora(family, c["adapter"]) for c in cases]
    kw = dict(enable_lora=True, max_loras=3, max_lora_rank=64, enable_prefix_caching=True)
    kw |= dict(kv_cache_dir=str(tmp_path), block_size=8)
    first = make_engine(loaded(family), **kw)
    run(first, prompts, loras, 8)
    first.shutdown()
    again = make_engine(loaded(family), **kw)
    outs = run(again, prompts, loras, 8)
    assert [o.outputs[0].token_ids for o in outs] == [c["token_ids"] for c in cases]
    assert [o.num_cached_tokens for o in outs] == [32] * 4  # each from its own blocks on disk
    again.shutdown()
    model = str(LORA_DIR.parent / "families" / family)
    kw = dict(enable_lora=True, max_loras=3, max_lora_rank=64, engine_core_process=True)
    core = make_engine(loaded(family), model=model, **kw)
    try:
        outs = run(core, prompts, loras, 8)
        assert [o.outputs[0].token_ids for o in outs] == [c["token_ids"] for c in cases]
        bad = LoRARequest("bad", 7, str(tmp_path / "nowhere"))
        with pytest.raises(ValueError, match="no adapter_config.json"):  # refused here, at once
            core.add_request("bad", prompts[0], lora_request=bad)
    finally:
        core.shutdown()


def test_generate_runs_every_prompt_with_the_adapter_of_lora(capsys):
    from engine.entrypoints.generate import main as generate_main

    family = "llama"
    model = str(Path(__file__).parent / "data/families" / family)
    argv = ["--model", model, "--prompt", "hello there", "--max-tokens", "8", "--ignore-eos"]
    argv += ["--num-gpu-blocks", "32", "--max-model-len", "64", "--no-tqdm", "--json"]
    texts = []
    for extra in ([], ["--lora", str(LORA_DIR / family / "r8_all")]):
        assert generate_main([*argv, *extra]) == 0
        texts.append(json.loads(capsys.readouterr().out.splitlines()[0])["text"])
    llm = LLM(model=model, enable_lora=True, num_gpu_blocks=32, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate("hello there", params, use_tqdm=False, lora_request=lora(family, "r8_all"))
    assert texts[1] == want[0].outputs[0].text != texts[0]
    rank64 = ["--lora", str(LORA_DIR / family / "r64_rslora")]
    assert generate_main([*argv, *rank64]) == 2
    assert "rank 64 > max_lora_rank 16" in capsys.readouterr().err


def test_loaded_adapters_stay_within_max_cpu_loras_least_recently_used_out():
    family = "llama"
    engine = make_engine(
        loaded(family), enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=64
    )
    manager = engine.core.lora
    prompt = golden(family)["cases"][0]["prompt_token_ids"]
    outs = {}
    for name in ("r1_qv", "r8_all", "r64_rslora", "r1_qv"):
        outs[name] = run(engine, [prompt], [lora(family, name)], 8)[0].outputs[0].token_ids
        assert len(manager.loaded) <= 2
    # r8_all, the least recently used and in no slot, went first; r1_qv was read again
    assert list(manager.loaded) == [3, 1] and manager.slots == [1]
    want = {
        c["adapter"]: c["token_ids"]
        for c in golden(family)["cases"]
        if c["prompt_token_ids"] == prompt
    }
    assert outs == {k: want[k] for k in outs}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_llama_cpp_lora_gguf_gives_pefts_tokens(family):
    """llama.cpp's convert_lora_to_gguf.py of the r8 adapter (Q/K B rows permuted for llama, as
    its base weights are): loaded as a GGUF, the tokens and logits of PEFT."""
    cases = [c for c in golden(family)["cases"] if c["adapter"] == "r8_all"]
    engine = make_engine(loaded(family), enable_lora=True, record_logits=True)
    gguf_lora = LoRARequest("g", 1, str(LORA_DIR / family / "r8_all.gguf"))
    outs = run(engine, [c["prompt_token_ids"] for c in cases], [gguf_lora] * len(cases), 8)
    for case, out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == case["token_ids"]
        want = np.frombuffer(base64.b64decode(case["logits"]), dtype="<f4")
        np.testing.assert_allclose(out.outputs[0].step_logits[0], want, atol=ATOL, rtol=0)


def test_a_gguf_that_is_not_a_lora_adapter_is_refused(tmp_path):
    engine = make_engine(loaded("llama"), enable_lora=True)
    model_gguf = tmp_path / "x.gguf"
    model_gguf.write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        engine.add_request("0", [5, 6], lora_request=LoRARequest("x", 1, str(model_gguf)))
