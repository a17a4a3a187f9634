"""How a pooling request turns its prompt's hidden states into one vector (vLLM's
``PoolingParams``): ``pooling_type`` last (the last token's, as Qwen3-Embedding and GTE-Qwen2
pool), mean (over every prompt token, as SmolLM2's sentence-transformers models) or cls (the first
token's); ``normalize`` to unit length; ``dimensions``: the first N dimensions (a Matryoshka
cut, taken before normalizing, as sentence-transformers' ``truncate_dim`` does).

The hidden states are the model's last ones after its final norm (transformers'
``last_hidden_state``), in float32; the pooling sums in float64.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("embed", "score", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """``task`` embed: the pooled vector; score: a reranker's relevance, the probability of
    ``score_tokens[0]`` ("yes") against ``score_tokens[1]`` ("no") as the LM head predicts the
    token after the prompt (Qwen3-Reranker's way), ``sigmoid(logit_yes - logit_no)``, or with
    no score_tokens a one-label classifier's ``sigmoid(logit)``; classify: a sequence
    classifier's (*ForSequenceClassification) head on the last token, its labels' probabilities
    (``classifier_activation``). ``activation`` False: score and classify give the raw logits."""

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    task: str = "embed"
    score_tokens: tuple[int, int] | None = None
    activation: bool = True

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(
                f"PoolingParams: task must be one of {', '.join(TASKS)}, got {self.task!r}"
            )
        ids = self.score_tokens
        if ids is not None and self.task != "score":
            raise ValueError("PoolingParams: score_tokens (yes, no ids) go with task 'score'")
        if self.task == "classify" and self.pooling_type != "last":
            raise ValueError("PoolingParams: classify scores the last token: pooling_type 'last'")
        if not isinstance(self.activation, bool):
            raise ValueError(f"PoolingParams: activation must be a bool, got {self.activation!r}")
        if ids is not None:
            ok = len(ids) == 2 and all(isinstance(t, int) and t >= 0 for t in ids)
            if not ok:
                raise ValueError(f"PoolingParams: score_tokens must be two token ids, got {ids!r}")
            object.__setattr__(self, "score_tokens", tuple(ids))
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"PoolingParams: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}"
            )
        if not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams: normalize must be a bool, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"PoolingParams: dimensions must be None or an int >= 1, got {d!r}")

    def finish(self, v: np.ndarray) -> np.ndarray:
        """A pooled (D,) float64 vector cut to ``dimensions`` and normalized: (d,) float32."""
        if self.dimensions is not None:
            v = v[: self.dimensions]
        if self.normalize:
            norm = float(np.sqrt(np.dot(v, v)))
            v = v / norm if norm > 0 else v
        return v.astype(np.float32)


def classifier_activation(logits: np.ndarray, problem_type: str | None) -> np.ndarray:
    """A classifier's (L,) float64 logits as probabilities, as vLLM turns them: sigmoid for one
    label or a multi-label problem, none for regression, else softmax over the labels."""
    if problem_type == "regression":
        return logits
    if problem_type == "multi_label_classification" or logits.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    e = np.exp(logits - logits.max())
    return e / e.sum()


class Pooler:
    """One sequence's pooling across its prefill chunks: ``add(rows, first)`` each chunk's
    (n, D) hidden states (``first``: the chunk starts the prompt), ``result(total)`` the
    vector once the prompt is done."""

    def __init__(self, params: PoolingParams):
        self.params = params
        self.acc: np.ndarray | None = None  # mean: the running sum; cls: the first row
        self.last: np.ndarray | None = None

    def add(self, rows: np.ndarray, first: bool) -> None:
        kind = self.params.pooling_type
        if kind == "mean":
            s = rows.sum(axis=0, dtype=np.float64)
            self.acc = s if self.acc is None else self.acc + s
        elif kind == "cls" and first:
            self.acc = rows[0].astype(np.float64)
        elif kind == "last":  # a copy: a view would keep the step's whole (T, D) rows alive
            self.last = rows[-1].copy()

    def result(self, num_tokens: int) -> np.ndarray:
        kind = self.params.pooling_type
        if kind == "mean":
            v = self.acc / num_tokens
        elif kind == "cls":
            v = self.acc
        else:
            v = self.last.astype(np.float64)
        return self.params.finish(v)


# Qwen3-Reranker's prompt (its model card): a query and a document judged "yes" or "no"
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def score_prompt(query: str, document: str, template: str | None = None,
                 instruction: str | None = None) -> str:  # fmt: skip
    """The text a reranker scores: ``template`` (QWEN3_RERANK_TEMPLATE by default) with the
    query, the document and the instruction in its ``{query}``, ``{document}``,
    ``{instruction}`` places."""
    template = QWEN3_RERANK_TEMPLATE if template is None else template
    for name, value in (("query", query), ("document", document)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name}: a non-empty string is required")
    return (
        template.replace("{instruction}", instruction or DEFAULT_INSTRUCTION)
        .replace("{query}", query)
        .replace("{document}", document)
    )


def yes_no_tokens(tokenizer) -> tuple[int, int]:
    """The ids of "yes" and "no", each one token of the model's vocabulary (a ValueError
    otherwise: pass PoolingParams' score_tokens)."""
    ids = []
    for word in ("yes", "no"):
        got = tokenizer.encode(word, add_special_tokens=False)
        if len(got) != 1:
            raise ValueError(
                f"score: {word!r} is {len(got)} tokens in this vocabulary, not one; give "
                "score_tokens (the yes and no token ids)"
            )
        ids.append(got[0])
    return ids[0], ids[1]


def score_pooling(score_tokens, num_labels: int, tokenizer) -> PoolingParams:
    """A score request's PoolingParams: the LM head's log-odds of ``score_tokens`` (yes, no),
    by default the vocabulary's one-token "yes" and "no"; a one-label classifier's own head
    when no tokens are given."""
    if score_tokens is None and num_labels != 1:
        score_tokens = yes_no_tokens(tokenizer)
    return PoolingParams(task="score", score_tokens=score_tokens)


def checkpoint_pooling(model_dir: str | Path | None) -> dict:
    """The pooling a sentence-transformers checkpoint declares (``modules.json``, its Pooling
    module's ``config.json``, a ``Normalize`` module; ``config_sentence_transformers.json``'s
    prompts and default prompt): {"pooling_type", "normalize", "prompts",
    "default_prompt_name"}; {} for a model directory without them (or no directory). A Pooling
    module that leaves the prompt's tokens out of the pool (``include_prompt`` false) is
    refused by name."""
    if model_dir is None:
        return {}
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not root.is_dir() or not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    out: dict = {"normalize": any(m.get("type", "").endswith("Normalize") for m in modules)}
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            conf = json.loads((root / m.get("path", "") / "config.json").read_text())
            flags = {  # older sentence-transformers: a flag per mode
                "pooling_mode_lasttoken": "lasttoken",
                "pooling_mode_mean_tokens": "mean",
                "pooling_mode_cls_token": "cls",
            }
            chosen = [kind for key, kind in flags.items() if conf.get(key)]
            mode = conf.get("pooling_mode")  # newer: its name
            modes = [mode] if isinstance(mode, str) else chosen
            names = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
            if len(modes) != 1 or modes[0] not in names:
                raise ValueError(
                    f"{root}: the Pooling module's config asks for pooling {modes or 'none'}; "
                    "one of lasttoken, mean, cls is supported"
                )
            out["pooling_type"] = names[modes[0]]
            if conf.get("include_prompt", True) is not True:
                raise ValueError(
                    f"{root}: the Pooling module's include_prompt false (the prompt's tokens "
                    "left out of the pool) is not supported"
                )
    st = root / "config_sentence_transformers.json"
    if st.is_file():
        conf = json.loads(st.read_text())
        out["prompts"] = conf.get("prompts") or {}
        out["default_prompt_name"] = conf.get("default_prompt_name")
    return out


def prompt_before(prompts: dict[str, str], name: str | None, default: str | None) -> str:
    """The text a checkpoint's sentence-transformers prompts put before an input (as its
    ``encode(prompt_name=...)`` does): ``name``'s, else the default prompt's, else ""."""
    name = default if name is None else name
    if name is None:
        return ""
    if name not in prompts:
        known = ", ".join(prompts) or "none"
        raise ValueError(f"prompt_name: {name!r} is not one of the model's prompts ({known})")
    return prompts[name]


def pooling_defaults(config) -> tuple[PoolingParams | None, dict[str, str], str | None]:
    """The pooling runner's PoolingParams for a request that sets none (the checkpoint's
    sentence-transformers config under ``pooler_config``'s keys), its prompts and default
    prompt name (``pooler_config``'s ``default_prompt_name`` over the checkpoint's); None,
    {}, None for a generate engine."""
    if config.runner != "pooling":
        return None, {}, None
    found = {}
    if config.model and Path(config.model).is_dir():  # a GGUF or a name: no such config
        found = checkpoint_pooling(config.model)
    prompts, default = found.pop("prompts", {}), found.pop("default_prompt_name", None)
    over = dict(config.pooler)
    default = over.pop("default_prompt_name", default)
    if default is not None and default not in prompts:
        known = ", ".join(prompts) or "none"
        raise ValueError(f"default_prompt_name: {default!r} is not one of the model's prompts "
                         f"({known})")  # fmt: skip
    return PoolingParams(**{**found, **over}), prompts, default


def matryoshka_dimensions(config) -> list[int] | None:
    """The Matryoshka cuts a pooling model directory's config.json declares: its
    ``matryoshka_dimensions`` ([] for ``is_matryoshka`` without a list: any cut), None when it
    declares none (or there is no directory, or the engine generates: not read then)."""
    conf = Path(config.model) / "config.json" if config.model else None
    if config.runner != "pooling" or conf is None or not conf.is_file():
        return None
    raw = json.loads(conf.read_text())
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        return sorted(dims)
    return [] if raw.get("is_matryoshka") else None
