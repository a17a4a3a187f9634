"""The pooling runner (runner="pooling") against sentence-transformers' embeddings
(scripts/make_pooling_golden.py): the tiny llama and qwen3 checkpoints with last, mean and cls
pooling, normalized and not, a Matryoshka cut, and SmolLM2 with mean pooling; cosine >= 0.99999
for every text, alone and batched, prompts chunked across steps; on numpy and cpu. The
checkpoint's sentence-transformers config read as the default; every bad value named."""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from engine import LLM
from engine.pooling_params import PoolingParams, checkpoint_pooling
from engine.sampling_params import SamplingParams

DATA = Path(__file__).parent / "data" / "pooling"
FAMILIES = Path(__file__).parent / "data" / "families"
COSINE = 0.99999


@cache
def golden() -> dict:
    return json.loads((DATA / "golden.json").read_text())


def vectors(case: dict) -> list[np.ndarray]:
    return [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in case["embeddings"]]


def check(got: list, want: list[np.ndarray], case: dict, where: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape, where
        cos = float(g @ w / (np.linalg.norm(g) * np.linalg.norm(w)))
        assert cos >= COSINE, f"{where} text {i}: cosine {cos:.7f}"
        if case["normalize"]:
            assert abs(np.linalg.norm(g) - 1) < 1e-5, where
        else:  # not normalized: the length is the model's too
            np.testing.assert_allclose(np.linalg.norm(g), np.linalg.norm(w), rtol=1e-4)


def pooling(case: dict) -> PoolingParams:
    return PoolingParams(case["pooling_type"], case["normalize"], case["dimensions"])


def st_prompt(name: str | None) -> str:
    """The text make_pooling_golden.py's prompt ``name`` puts before an input ("" for None)."""
    conf = json.loads((DATA / "st_qwen3_prompts/config_sentence_transformers.json").read_text())
    return "" if name is None else conf["prompts"][name]


def matryoshka_copy(name: str, tmp_path: Path) -> Path:
    """The family checkpoint, its config.json declaring Matryoshka cuts of 32 and 64."""
    model = tmp_path / name
    shutil.copytree(FAMILIES / name, model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "matryoshka_dimensions": [32, 64]}))
    return model


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tiny_checkpoints_match_sentence_transformers(name, backend, tmp_path):
    """Each case alone (one text at a time) and batched, with prompts split across steps by a
    small token budget (chunked prefill: mean pooling sums across chunks)."""
    texts = golden()["meta"]["texts"]
    llm = LLM(
        model=str(matryoshka_copy(name, tmp_path)), runner="pooling", backend=backend,
        dtype="float32", enable_chunked_prefill=True, max_num_batched_tokens=32,
        max_num_seqs=4, num_gpu_blocks=64,
    )  # fmt: skip
    for key, case in golden()["cases"].items():
        if not key.startswith(f"{name}/"):
            continue
        want, p = vectors(case), pooling(case)
        inputs = [st_prompt(case.get("prompt_name")) + t for t in texts]
        batched = [o.outputs.embedding for o in llm.embed(inputs, p, use_tqdm=False)]
        check(batched, want, case, f"{key} {backend} batched")
        alone = [llm.embed(t, p, use_tqdm=False)[0].outputs.embedding for t in inputs]
        check(alone, want, case, f"{key} {backend} alone")
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every prompt's blocks went back


def test_smollm2_mean_pooling_matches_sentence_transformers(smollm2):
    case = golden()["cases"]["smollm2/mean_norm"]
    loaded = dataclasses.replace(smollm2, weights=smollm2.weights.astype(np.float32))
    llm = LLM(loaded=loaded, model="smollm2", runner="pooling", backend="cpu", dtype="float32",
              num_gpu_blocks=64, max_num_seqs=4, max_model_len=512)  # fmt: skip
    outs = llm.embed(golden()["meta"]["texts"], pooling(case), use_tqdm=False)
    check([o.outputs.embedding for o in outs], vectors(case), case, "smollm2 mean")


def test_the_checkpoints_sentence_transformers_config_is_the_default(tmp_path):
    """A checkpoint saved by sentence-transformers (mean pooling, a Normalize module): its
    pooling is what a request without PoolingParams gets; pooler_config overrides it."""
    model = tmp_path / "llama-st"
    shutil.copytree(FAMILIES / "llama", model)
    shutil.copytree(DATA / "st_llama_mean", model, dirs_exist_ok=True)
    assert checkpoint_pooling(model) == {
        "pooling_type": "mean", "normalize": True, "prompts": {"document": "", "query": ""},
        "default_prompt_name": None,
    }  # fmt: skip
    llm = LLM(model=str(model), runner="pooling", backend="numpy", dtype="float32",
              num_gpu_blocks=64)  # fmt: skip
    assert llm.engine.pooling_defaults == PoolingParams("mean", True, None)
    text = golden()["meta"]["texts"][1]
    mean = golden()["cases"]["llama/mean_raw"]
    got = llm.embed(text, use_tqdm=False)[0].outputs.embedding
    want = vectors(mean)[1] / np.linalg.norm(vectors(mean)[1])  # the mean, normalized
    check([got], [want], {"normalize": True}, "the checkpoint's default")
    over = LLM(model=str(model), runner="pooling", backend="numpy", num_gpu_blocks=64,
               pooler_config='{"pooling_type": "last", "normalize": false}')  # fmt: skip
    assert over.engine.pooling_defaults == PoolingParams("last", False, None)


def test_bad_values_are_named(tiny, tmp_path):
    with pytest.raises(ValueError, match="pooling_type must be one of last, mean, cls"):
        PoolingParams("max")
    with pytest.raises(ValueError, match="dimensions must be None or an int >= 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="speculative_config: it drafts .* runner='pooling'"):
        LLM(loaded=tiny, model="t", runner="pooling",
            speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')  # fmt: skip
    with pytest.raises(ValueError, match="async_scheduling: it overlaps decode steps"):
        LLM(loaded=tiny, model="t", runner="pooling", async_scheduling=True)
    with pytest.raises(ValueError, match="classify scores the last token"):
        PoolingParams("mean", task="classify")
    with pytest.raises(ValueError, match="pooler_config: unknown key 'pooling'"):
        LLM(loaded=tiny, model="t", runner="pooling", pooler_config='{"pooling": "mean"}')
    llm = LLM(loaded=tiny, model="t", runner="pooling", backend="numpy", num_gpu_blocks=32)
    with pytest.raises(ValueError, match="runner='pooling': it embeds prompts"):
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    gen = LLM(loaded=tiny, model="t", backend="numpy", num_gpu_blocks=32)
    with pytest.raises(ValueError, match="LLM.embed needs an engine made with runner='pooling'"):
        gen.embed(["hi"])
    with pytest.raises(ValueError, match="does not declare Matryoshka embeddings"):
        llm.embed(["hi"], PoolingParams(dimensions=32), use_tqdm=False)
    declared = LLM(model=str(matryoshka_copy("llama", tmp_path)), runner="pooling",
                   backend="numpy", num_gpu_blocks=32)  # fmt: skip
    with pytest.raises(ValueError, match="dimensions 100 is more than the model's 64"):
        declared.embed(["hi"], PoolingParams(dimensions=100), use_tqdm=False)
    with pytest.raises(ValueError, match=r"dimensions 48 is not one the model declares"):
        declared.embed(["hi"], PoolingParams(dimensions=48), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: prompt has 300 tokens, more than"):
        declared.embed([[5] * 300], use_tqdm=False)


def test_the_server_answers_openai_embeddings(tmp_path):
    """POST /v1/embeddings through the official openai client: floats and base64 (the client
    decodes it), a batch in input order, a Matryoshka cut, usage; bad input a 400 naming it;
    a generation route on a pooling server, and the reverse, a 400 saying what it serves."""
    import httpx

    from engine.tools.live_server import LiveServer
    from model_loader.load import load_model

    model = matryoshka_copy("qwen3", tmp_path)
    texts = golden()["meta"]["texts"]
    last = golden()["cases"]["qwen3/last_norm"]
    cut = golden()["cases"]["qwen3/last_dim32"]
    kw = dict(runner="pooling", backend="numpy", dtype="float32", model=str(model),
              pooler_config='{"pooling_type": "last", "normalize": true}')  # fmt: skip
    with LiveServer(load_model(str(model)), **kw) as s:
        client = s.openai_client()
        r = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64
        assert [d.index for d in r.data] == list(range(len(texts)))
        check([d.embedding for d in r.data], vectors(last), last, "server base64")
        floats = client.embeddings.create(model="tiny", input=texts[1], encoding_format="float")
        check([floats.data[0].embedding], vectors(last)[1:2], last, "server float")
        small = client.embeddings.create(model="tiny", input=texts, dimensions=32)
        check([d.embedding for d in small.data], vectors(cut), cut, "server dimensions")
        ids = s.engine.tokenizer.encode(texts[0])
        assert r.usage.prompt_tokens == sum(len(s.engine.tokenizer.encode(t)) for t in texts)
        by_ids = client.embeddings.create(model="tiny", input=[ids], encoding_format="float")
        check([by_ids.data[0].embedding], vectors(last)[:1], last, "server token ids")
        for body, words in [
            ({"input": ""}, "input: an empty string"),
            ({"input": ["a", ""]}, "input 1: an empty string"),
            ({"input": [[999999]]}, "input"),
            ({"input": "a", "dimensions": 100}, "dimensions 100 is more than the model's 64"),
            ({"input": "x" * 3000}, "input: prompt has"),
        ]:
            got = httpx.post(s.url + "/v1/embeddings", json={"model": "tiny", **body})
            assert got.status_code == 400 and words in got.json()["error"]["message"], got.text
        pooled = httpx.post(s.url + "/pooling", json={"model": "tiny", "input": texts}).json()
        check([d["data"] for d in pooled["data"]], vectors(last), last, "/pooling")
        cohere = httpx.post(s.url + "/v2/embed", json={
            "model": "tiny", "texts": texts, "input_type": "search_document",
            "embedding_types": ["float", "base64"],
        }).json()  # fmt: skip
        check(cohere["embeddings"]["float"], vectors(last), last, "/v2/embed float")
        raw = [np.frombuffer(base64.b64decode(b), "<f4") for b in cohere["embeddings"]["base64"]]
        check(raw, vectors(last), last, "/v2/embed base64")
        bad = httpx.post(s.url + "/v2/embed", json={"texts": ["a"], "embedding_types": ["int8"]})
        assert bad.status_code == 400 and "embedding_types: 'int8' is not implemented" in bad.text
        metrics = httpx.get(s.url + "/metrics").text
        counted = next(x for x in metrics.splitlines() if x.startswith("pagedllm:prompt_tokens_t"))
        assert float(counted.split()[-1]) > r.usage.prompt_tokens  # every request's prompt
        gen = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert gen.status_code == 400 and "runner='pooling'" in gen.text
    with LiveServer(load_model(str(model))) as s:
        got = httpx.post(s.url + "/v1/embeddings", json={"model": "tiny", "input": "hi"})
        assert got.status_code == 400 and "needs a server started with --runner pooling" in got.text


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
def test_scores_are_the_rerankers_yes_against_no(backend):
    """LLM.score: each (query, document) in a reranker's prompt, P(yes) against P(no)
    from the LM head after it, against transformers (scripts/make_pooling_golden.py): the
    log-odds within 1e-3, the scores within 1e-5."""
    ref = golden()["rerank"]
    llm = LLM(model=str(FAMILIES / ref["family"]), runner="pooling", backend=backend,
              dtype="float32", num_gpu_blocks=64)  # fmt: skip
    ids, template = tuple(ref["score_tokens"]), ref["template"]
    outs = llm.score(ref["query"], ref["documents"], ids, template, use_tqdm=False)
    got = np.array([o.outputs.score for o in outs])
    np.testing.assert_allclose(got, ref["scores"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.log(got / (1 - got)), ref["log_odds"], atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="'yes' is .* tokens in this vocabulary, not one"):
        llm.score(ref["query"], ref["documents"])
    with pytest.raises(ValueError, match="document: a non-empty string is required"):
        llm.score(ref["query"], [""], ids, template)


def test_the_server_reranks_and_scores():
    """/rerank (Jina's and Cohere's shape: by score, top_n, the documents) and /score, with
    the reranker's golden scores; on a generating server, a 400 saying what it needs."""
    import httpx

    from engine.tools.live_server import LiveServer
    from model_loader.load import load_model

    ref = golden()["rerank"]
    path = str(FAMILIES / ref["family"])
    extra = {"score_tokens": ref["score_tokens"], "template": ref["template"]}
    with LiveServer(load_model(path), runner="pooling", backend="cpu", dtype="float32") as s:
        body = {"model": "tiny", "query": ref["query"], "documents": ref["documents"], **extra}
        r = httpx.post(s.url + "/rerank", json={**body, "top_n": 2}).json()
        want = sorted(range(3), key=lambda i: -ref["scores"][i])[:2]
        assert [x["index"] for x in r["results"]] == want
        for x in r["results"]:
            assert abs(x["relevance_score"] - ref["scores"][x["index"]]) < 1e-5
            assert x["document"]["text"] == ref["documents"][x["index"]]
        sc = httpx.post(s.url + "/score", json={
            "model": "tiny", "text_1": ref["query"], "text_2": ref["documents"], **extra,
        }).json()  # fmt: skip
        got = [d["score"] for d in sc["data"]]
        np.testing.assert_allclose(got, ref["scores"], atol=1e-5, rtol=0)
        bad = httpx.post(s.url + "/rerank", json={**body, "documents": [""]})
        assert bad.status_code == 400 and "document: a non-empty string" in bad.text
    with LiveServer(load_model(path)) as s:
        bad = httpx.post(s.url + "/rerank", json={"query": "q", "documents": ["d"]})
        assert bad.status_code == 400 and "needs a server started with --runner pooling" in bad.text


def test_prefix_caching_serves_last_pooling_and_mean_runs_whole(tmp_path):
    """With prefix caching a shared prefix is computed once for last pooling (the later prompt
    finds it cached, its vector the golden one); mean pooling needs every row, so its prompt
    runs whole, and its vector is the golden one too."""
    texts = golden()["meta"]["texts"]
    llm = LLM(model=str(matryoshka_copy("llama", tmp_path)), runner="pooling", backend="cpu",
              dtype="float32", enable_prefix_caching=True, block_size=4,
              num_gpu_blocks=256)  # fmt: skip
    for key, cached in (("llama/last_norm", True), ("llama/mean_raw", False)):
        case = golden()["cases"][key]
        llm.embed(texts[3], pooling(case), use_tqdm=False)  # fills the cache
        engine = llm.engine
        rid = "again-" + key
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling(case))
        engine.add_request(rid, texts[3], params)
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
        assert (out.num_cached_tokens > 0) == cached, key
        check([out.embedding], vectors(case)[3:], case, key)


@pytest.mark.parametrize(
    "backend, tp, pp", [("numpy", 2, 1), ("cuda-cpu", 2, 1), ("numpy", 1, 2), ("numpy", 2, 2)]
)
def test_parallel_ranks_pool_and_score(backend, tp, pp, tmp_path):
    """Tensor parallel ranks (numpy, and cuda-cpu over the emulated NCCL): the layers'
    collectives run on every rank, the hidden states are whole on each; the reranker's LM head
    is gathered from the vocabulary slices. Pipeline stages: each hands its hidden state on, the
    last one pools (and holds the LM head)."""
    pools_and_scores_as_golden(dict(backend=backend, tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp), tmp_path)  # fmt: skip


def pools_and_scores_as_golden(engine_args: dict, tmp_path, between=lambda: None) -> None:
    """An engine made with ``engine_args`` embeds the texts as sentence-transformers does (last
    and mean pooling), then another scores the reranker's pairs as transformers does; each shut
    down after, ``between`` called between the two."""
    texts = golden()["meta"]["texts"]
    llm = LLM(model=str(matryoshka_copy("llama", tmp_path)), runner="pooling", dtype="float32",
              num_gpu_blocks=64, **engine_args)  # fmt: skip
    try:
        for key in ("llama/last_norm", "llama/mean_raw"):
            case = golden()["cases"][key]
            outs = llm.embed(texts, pooling(case), use_tqdm=False)
            check([o.outputs.embedding for o in outs], vectors(case), case, f"{key} {engine_args}")
    finally:
        llm.shutdown()
    between()
    ref = golden()["rerank"]
    scorer = LLM(model=str(FAMILIES / ref["family"]), runner="pooling", dtype="float32",
                 num_gpu_blocks=64, **engine_args)  # fmt: skip
    try:
        outs = scorer.score(ref["query"], ref["documents"], tuple(ref["score_tokens"]),
                            ref["template"], use_tqdm=False)  # fmt: skip
        np.testing.assert_allclose([o.outputs.score for o in outs], ref["scores"], atol=1e-5)
    finally:
        scorer.shutdown()


def test_the_generate_cli_embeds_with_runner_pooling(capsys):
    """python -m engine.generate --runner pooling: a JSON line per prompt with its vector (the
    default pooling: last, normalized), the golden one; a classifier's label probabilities."""
    from engine.entrypoints.generate import main as generate_main

    text, case = golden()["meta"]["texts"][1], golden()["cases"]["llama/last_norm"]
    argv = ["--model", str(FAMILIES / "llama"), "--runner", "pooling", "--prompt", text]
    assert generate_main([*argv, "--json", "--backend", "numpy", "--dtype", "float32"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["prompt"] == text and row["prompt_tokens"] > 0
    check([row["embedding"]], vectors(case)[1:2], case, "generate --runner pooling")
    ref = json.loads((DATA / "classify.json").read_text())["cls_qwen3"]
    argv = ["--model", str(DATA / "cls_qwen3"), "--runner", "pooling", "--prompt", ref["texts"][0]]
    assert generate_main([*argv, "--json", "--backend", "numpy", "--dtype", "float32"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = np.exp(ref["logits"][0]) / np.exp(ref["logits"][0]).sum()
    np.testing.assert_allclose([row[k] for k in ref["labels"]], want, atol=1e-5, rtol=0)


@cache
def classify_golden() -> dict:
    return json.loads((DATA / "classify.json").read_text())


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
def test_classifiers_match_transformers(backend, tmp_path):
    """LLM.classify on a *ForSequenceClassification checkpoint (the tiny qwen3 under a 3-label
    score head, scripts/make_classifier_golden.py): the logits within 1e-4 of transformers',
    softmax probabilities within 1e-5, alone and batched; a multi-label config gives sigmoids.
    Generating with a classifier, classify without one, a score without a label: named."""
    ref = classify_golden()["cls_qwen3"]
    want = np.array(ref["logits"])  # (N, 3)
    llm = LLM(model=str(DATA / "cls_qwen3"), runner="pooling", backend=backend,
              dtype="float32", num_gpu_blocks=64)  # fmt: skip
    assert llm.engine.model_config.labels == tuple(ref["labels"])
    raw = [o.outputs.probs for o in llm.classify(ref["texts"], activation=False, use_tqdm=False)]
    np.testing.assert_allclose(raw, want, atol=1e-4, rtol=0)
    alone = [llm.classify(t, use_tqdm=False)[0].outputs.probs for t in ref["texts"]]
    np.testing.assert_allclose(alone, softmax(want), atol=1e-5, rtol=0)
    assert all(len(p) == 3 for p in alone)
    score = SamplingParams(max_tokens=1, pooling=PoolingParams(task="score"))
    with pytest.raises(ValueError, match="score without score_tokens needs a one-label"):
        llm.generate("a pair", score, use_tqdm=False)
    multi = tmp_path / "multi"
    shutil.copytree(DATA / "cls_qwen3", multi)
    conf = json.loads((multi / "config.json").read_text())
    conf["problem_type"] = "multi_label_classification"
    (multi / "config.json").write_text(json.dumps(conf))
    llm = LLM(model=str(multi), runner="pooling", backend=backend, dtype="float32",
              num_gpu_blocks=64)  # fmt: skip
    got = [o.outputs.probs for o in llm.classify(ref["texts"], use_tqdm=False)]
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-want)), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="sequence classifier .* runner='pooling'"):
        LLM(model=str(multi), backend=backend, dtype="float32")
    plain = LLM(model=str(FAMILIES / "qwen3"), runner="pooling", backend=backend,
                dtype="float32", num_gpu_blocks=64)  # fmt: skip
    with pytest.raises(ValueError, match="classify needs a sequence classifier"):
        plain.classify("hello", use_tqdm=False)


def test_a_one_label_classifier_reranks(tmp_path):
    """A one-label classifier (the tiny llama, scripts/make_classifier_golden.py) scores pairs
    as sigmoid(logit): LLM.score, /score, /rerank and /classify through the server equal
    transformers' within 1e-5; /classify on a model without a score head is a 400."""
    import httpx

    from engine.tools.live_server import LiveServer
    from model_loader.load import load_model

    ref = classify_golden()["cls_llama"]
    want = 1 / (1 + np.exp(-np.array(ref["logits"])[:, 0]))  # (N,)
    path = str(DATA / "cls_llama")
    llm = LLM(model=path, runner="pooling", backend="cpu", dtype="float32", num_gpu_blocks=64)
    outs = llm.score(ref["query"], ref["documents"], template=ref["template"], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in outs], want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="score_tokens: this model is a sequence classifier"):
        llm.score(ref["query"], ref["documents"], (1, 2), ref["template"], use_tqdm=False)
    with LiveServer(load_model(path), runner="pooling", backend="cpu", dtype="float32") as s:
        body = {"model": "tiny", "query": ref["query"], "documents": ref["documents"],
                "template": ref["template"]}  # fmt: skip
        r = httpx.post(s.url + "/rerank", json=body).json()
        assert [x["index"] for x in r["results"]] == list(np.argsort(-want))
        np.testing.assert_allclose(
            [x["relevance_score"] for x in r["results"]], np.sort(want)[::-1], atol=1e-5, rtol=0
        )
        pairs = {"text_1": ref["query"], "text_2": ref["documents"], "template": ref["template"]}
        sc = httpx.post(s.url + "/score", json=pairs).json()
        np.testing.assert_allclose([d["score"] for d in sc["data"]], want, atol=1e-5, rtol=0)
        c = httpx.post(s.url + "/classify", json={"input": ref["texts"]}).json()
        assert [d["label"] for d in c["data"]] == ["relevant"] * len(want)
        np.testing.assert_allclose([d["probs"][0] for d in c["data"]], want, atol=1e-5, rtol=0)
        assert c["usage"]["prompt_tokens"] == sum(len(llm.engine.tokenizer.encode(t))
                                                  for t in ref["texts"])  # fmt: skip
    qwen3 = classify_golden()["cls_qwen3"]
    with LiveServer(load_model(str(DATA / "cls_qwen3")), runner="pooling", backend="cpu",
                    dtype="float32") as s:  # fmt: skip
        c = httpx.post(s.url + "/classify", json={"input": qwen3["texts"][1]}).json()
        want3 = softmax(np.array(qwen3["logits"][1]))
        assert c["data"][0]["label"] == qwen3["labels"][int(np.argmax(want3))]
        np.testing.assert_allclose(c["data"][0]["probs"], want3, atol=1e-5, rtol=0)
        raw = httpx.post(s.url + "/classify", json={"input": qwen3["texts"][1],
                         "use_activation": False}).json()  # fmt: skip
        np.testing.assert_allclose(raw["data"][0]["probs"], qwen3["logits"][1], atol=1e-4)
        bad = httpx.post(s.url + "/classify", json={"input": ""})
        assert bad.status_code == 400 and "input: an empty string" in bad.text
    with LiveServer(load_model(str(FAMILIES / "llama")), runner="pooling", backend="cpu") as s:
        bad = httpx.post(s.url + "/classify", json={"input": "hi"})
        assert bad.status_code == 400 and "needs a sequence classifier" in bad.text


def test_the_checkpoints_prompts_go_before_the_text(tmp_path):
    """A checkpoint whose config_sentence_transformers.json has a query prompt (Qwen3-Embedding's
    way; make_pooling_golden.py's st_qwen3_prompts): prompt_name "query" equals
    sentence-transformers' encode(prompt_name="query") in LLM.embed, /v1/embeddings and Cohere's
    search_query; a default prompt applies unasked and pooler_config's null turns it off; an
    unknown name is named."""
    import httpx

    from engine.tools.live_server import LiveServer
    from model_loader.load import load_model

    case = golden()["cases"]["qwen3/last_norm_query"]
    texts, want = golden()["meta"]["texts"], vectors(case)
    plain = vectors(golden()["cases"]["qwen3/last_norm"])
    model = tmp_path / "qwen3-st"
    shutil.copytree(FAMILIES / "qwen3", model)
    shutil.copytree(DATA / "st_qwen3_prompts", model, dirs_exist_ok=True)
    llm = LLM(model=str(model), runner="pooling", backend="cpu", dtype="float32",
              num_gpu_blocks=64)  # fmt: skip
    got = [o.outputs.embedding for o in llm.embed(texts, prompt_name="query", use_tqdm=False)]
    check(got, want, case, "prompt_name query")
    check([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)], plain, case, "none")
    with pytest.raises(ValueError, match="prompt_name: 'passage' is not one of .*query"):
        llm.embed(texts, prompt_name="passage", use_tqdm=False)
    with LiveServer(load_model(str(model)), model=str(model), runner="pooling", backend="cpu",
                    dtype="float32") as s:  # fmt: skip
        r = httpx.post(s.url + "/v1/embeddings", json={"input": texts, "prompt_name": "query"})
        check([d["embedding"] for d in r.json()["data"]], want, case, "/v1/embeddings")
        r = httpx.post(s.url + "/v2/embed", json={"texts": texts, "input_type": "search_query"})
        check(r.json()["embeddings"]["float"], want, case, "/v2/embed search_query")
        bad = httpx.post(s.url + "/v1/embeddings", json={"input": "a", "prompt_name": "nope"})
        assert bad.status_code == 400 and "prompt_name: 'nope'" in bad.text
    conf_file = model / "config_sentence_transformers.json"
    conf = json.loads(conf_file.read_text())
    conf_file.write_text(json.dumps({**conf, "default_prompt_name": "query"}))
    llm = LLM(model=str(model), runner="pooling", backend="numpy", dtype="float32",
              num_gpu_blocks=64)  # fmt: skip
    check([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)], want, case, "default")
    off = LLM(model=str(model), runner="pooling", backend="numpy", dtype="float32",
              num_gpu_blocks=64, pooler_config='{"default_prompt_name": null}')  # fmt: skip
    check([o.outputs.embedding for o in off.embed(texts, use_tqdm=False)], plain, case, "off")
    pool_file = model / "1_Pooling/config.json"
    pool_file.write_text(json.dumps({**json.loads(pool_file.read_text()), "include_prompt": False}))
    with pytest.raises(ValueError, match="include_prompt false .* is not supported"):
        LLM(model=str(model), runner="pooling", backend="numpy", num_gpu_blocks=64)
    with pytest.raises(ValueError, match="default_prompt_name: 'passage' is not one of"):
        pool_file.write_text(json.dumps({"pooling_mode": "lasttoken"}))
        LLM(model=str(model), runner="pooling", backend="numpy", num_gpu_blocks=64,
            pooler_config='{"default_prompt_name": "passage"}')  # fmt: skip


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
def test_lora_adapters_pool_as_peft_computes(backend):
    """The pooling runner with LoRA (one batch mixing three adapters and the base model, as
    tests/test_lora.py's golden cases do): each prompt's last hidden state, seen through the
    LM head as the log-odds of its most likely next token against four others, equals PEFT's
    logits (scripts/make_lora_golden.py) within 1e-4; the adapters are in use (an adapter's
    log-odds differ from the base model's by far more); the server embeds with an adapter
    named as the request's model."""
    from engine import LoRARequest

    lora_dir = Path(__file__).parent / "data" / "lora" / "llama"
    cases = json.loads((lora_dir / "golden.json").read_text())["cases"]
    slots = {"r1_qv": 1, "r8_all": 2, "r64_rslora": 3}
    llm = LLM(model=str(FAMILIES / "llama"), runner="pooling", backend=backend, dtype="float32",
              enable_lora=True, max_loras=3, max_lora_rank=64, num_gpu_blocks=64)  # fmt: skip
    prompts, params, loras, want = [], [], [], []
    for c in cases:
        logits = np.frombuffer(base64.b64decode(c["logits"]), "<f4").astype(np.float64)
        top = int(np.argmax(logits))
        name = c["adapter"]
        lr = None if name is None else LoRARequest(name, slots[name], str(lora_dir / name))
        for other in (1, 7, 100, 250):
            p = PoolingParams(task="score", score_tokens=(top, other), activation=False)
            prompts.append(c["prompt_token_ids"])
            params.append(SamplingParams(max_tokens=1, pooling=p))
            loras.append(lr)
            want.append(logits[top] - logits[other])
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    got = np.array([o.embedding[0] for o in outs])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    base = llm.generate(prompts, params, use_tqdm=False)  # the same prompts, no adapter
    moved = np.abs(np.array([o.embedding[0] for o in base]) - got)
    assert moved[[i for i, lr in enumerate(loras) if lr is not None]].min() > 1e-2
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if backend == "cpu":  # the server: an adapter by its name as the request's model
        import httpx

        from engine.tools.live_server import LiveServer
        from model_loader.load import load_model

        r8 = LoRARequest("r8", 9, str(lora_dir / "r8_all"))
        want = llm.embed("hello world", lora_request=r8, use_tqdm=False)[0].outputs.embedding
        with LiveServer(load_model(str(FAMILIES / "llama")), runner="pooling", backend="cpu",
                        dtype="float32", enable_lora=True, max_lora_rank=64,
                        lora_modules=[("r8", r8.lora_path)]) as s:  # fmt: skip
            body = {"model": "r8", "input": "hello world"}
            got = httpx.post(s.url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_a_pooler_keeps_nothing_of_the_steps_rows(kind):
    """What a Pooler keeps between chunks is its own: the step's (T, D) rows written over
    afterwards (a backend may reuse its buffers) change nothing, and no view of them is held
    (it would keep the whole step's rows alive until the prompt ends)."""
    from engine.pooling_params import Pooler

    rng = np.random.default_rng()
    chunks = [rng.standard_normal((n, 8), dtype=np.float32) for n in (5, 3)]
    rows = np.concatenate(chunks)  # (8, 8), a copy
    want = {"last": rows[-1], "mean": rows.mean(0, dtype=np.float64), "cls": rows[0]}
    pooler = Pooler(PoolingParams(kind, normalize=False))
    pooler.add(chunks[0], first=True)
    chunks[0][:] = np.nan  # the first step's buffer, reused
    pooler.add(chunks[1], first=False)
    kept = [a for a in (pooler.acc, pooler.last) if a is not None]
    assert all(a.base is None for a in kept)
    got = pooler.result(8)
    chunks[1][:] = np.nan
    np.testing.assert_allclose(got, want[kind], rtol=1e-6, atol=1e-7)
