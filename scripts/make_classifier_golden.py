"""Golden logits for sequence classifiers (transformers' *ForSequenceClassification).

transformers and torch are NOT project dependencies: run this in the throwaway venv of
scripts/make_pooling_golden.py,

    /tmp/golden-venv/bin/python scripts/make_classifier_golden.py

From the tiny qwen3 and llama checkpoints (tests/data/families/) it builds two classifiers, each
the same decoder with a seeded random score head, saves them with their tokenizer files, and
writes each one's logits for every text (float64, from transformers' own forward; batches of
one, so the last token is the one scored):

    tests/data/pooling/cls_qwen3/         Qwen3ForSequenceClassification, 3 labels
    tests/data/pooling/cls_llama/         LlamaForSequenceClassification, 1 label (a reranker:
                                          the pair in the engine's score template, then sigmoid)
    tests/data/pooling/classify.json      {"cls_qwen3": {texts, logits}, "cls_llama": {...}}
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_pooling_golden import (  # noqa: E402
    DOCUMENTS,
    OUT,
    QUERY,
    ROOT,
    TEMPLATE,
    engine_score_prompt,
)

TEXTS = [
    "I loved every minute of it.",
    "The service was slow and the food was cold.",
    "a",
    " ".join(["it was fine, nothing special"] * 5),
]
# the reranker's pairs: make_pooling_golden.py's QUERY and DOCUMENTS in its short TEMPLATE (the
# tiny checkpoints hold 256 positions)
# name: (family, labels, problem_type, seed)
CLASSIFIERS = {
    "cls_qwen3": ("qwen3", ["negative", "neutral", "positive"], "single_label_classification", 1),
    "cls_llama": ("llama", ["relevant"], None, 2),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build(name: str, family: str, labels: list[str], problem: str | None, seed: int):
    """The family's tiny decoder under a classifier's head (seeded, std 0.5: probabilities far
    from uniform), saved to OUT/name with the tokenizer; the model."""
    src = ROOT / "tests/data/families" / family
    config = transformers.AutoConfig.from_pretrained(src)
    config.architectures = None
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {v: k for k, v in enumerate(labels)}
    config.problem_type = problem
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        src, config=config, dtype=torch.float32
    ).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, out / f)
    return model


def logits(model, tok, texts: list[str]) -> list[list[float]]:
    rows = []
    for text in texts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            rows.append(model(ids).logits[0].double().tolist())
    return rows


def main() -> None:
    golden = dict(meta=dict(transformers=transformers.__version__, torch=torch.__version__))
    pair = engine_score_prompt()
    for name, (family, labels, problem, seed) in CLASSIFIERS.items():
        model = build(name, family, labels, problem, seed)
        tok = transformers.AutoTokenizer.from_pretrained(OUT / name)
        texts = TEXTS if len(labels) > 1 else [pair(QUERY, d, TEMPLATE) for d in DOCUMENTS]
        golden[name] = dict(labels=labels, problem_type=problem, texts=texts,
                            logits=logits(model, tok, texts))  # fmt: skip
        if len(labels) == 1:
            golden[name] |= dict(query=QUERY, documents=DOCUMENTS, template=TEMPLATE)
    (OUT / "classify.json").write_text(json.dumps(golden, indent=1))
    print(f"wrote {OUT / 'classify.json'} and {', '.join(CLASSIFIERS)}")


if __name__ == "__main__":
    main()
