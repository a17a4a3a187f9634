"""OpenAI's embeddings API (``POST /v1/embeddings``), vLLM's ``/pooling`` and ``/classify``,
Cohere's ``/v2/embed``, and ``/score`` and ``/rerank`` (vLLM's, Jina's and Cohere's shapes),
over the pooling runner (``--runner pooling``): ``input`` a string, strings, token ids or lists
of token ids; ``encoding_format`` float (a list of numbers) or base64 (the little-endian float32
bytes, as OpenAI's client decodes them); ``dimensions`` a Matryoshka cut the model declares;
``usage`` counts the prompt tokens; ``prompt_name`` (an extension) puts the checkpoint's
sentence-transformers prompt of that name before each text. Each input is one pooling request
(engine/pooling_params.py); they run batched like any prompts.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engine.frontend.input_processor import tokenize_prompt


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted, no effect
    prompt_name: str | None = None  # the checkpoint's sentence-transformers prompt (not OpenAI's)

    def inputs(self) -> list[str | list[int]]:
        """One input or a batch: text, token ids, or a list of either."""
        x: Any = self.input
        if isinstance(x, str) or (x and all(isinstance(t, int) for t in x)):
            return [x]
        if not x:
            raise ValueError("input: an empty list (give a string, strings or token ids)")
        return list(x)


def input_ids(req: EmbeddingRequest, tokenizer, vocab: int, max_len: int, max_chars: int,
              prompt: str = ""):  # fmt: skip
    """Each input's token ids, checked (empty, too long, ids out of the vocabulary) with the
    input's index in the message; ``prompt`` put before each text input."""
    inputs, out = req.inputs(), []
    for i, x in enumerate(inputs):
        where = f"input {i}" if len(inputs) > 1 else "input"
        if isinstance(x, str) and not x:
            raise ValueError(f"{where}: an empty string has nothing to embed")
        try:
            x = prompt + x if isinstance(x, str) else x
            out.append(tokenize_prompt(x, tokenizer, vocab, max_len, max_chars)[1])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def embeddings_body(model: str, vectors: list[list[float]], prompt_tokens: int, fmt: str):
    """OpenAI's ``list`` of ``embedding`` objects, in input order, and the usage."""
    data = []
    for i, v in enumerate(vectors):
        value: Any = v
        if fmt == "base64":
            value = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


class ClassifyRequest(BaseModel):
    """vLLM's ``/classify``: each input's label probabilities from a sequence classifier."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    use_activation: bool = True  # False: the raw logits
    user: str | None = None

    def embedding_request(self) -> EmbeddingRequest:
        return EmbeddingRequest(model=self.model, input=self.input)


def classify_body(model: str, labels: tuple[str, ...], rows: list, tokens: int) -> dict:
    """vLLM's ``/classify`` answer: per input, its most probable label and every label's
    probability (logits without the activation), in input order."""
    data = [
        {"index": i, "label": labels[int(np.argmax(r))], "probs": r, "num_classes": len(r)}
        for i, r in enumerate(rows)
    ]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


class RerankRequest(BaseModel):
    """Jina's and Cohere's ``/rerank`` (vLLM's): the documents ordered by a reranker's score."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    score_tokens: list[int] | None = None  # the yes and no ids (default: the vocabulary's, or
    #   a one-label classifier's head)
    template: str | None = None  # {query}, {document}, {instruction} (default: Qwen3-Reranker's)
    instruction: str | None = None


class ScoreRequest(BaseModel):
    """vLLM's ``/score``: ``text_1`` (one query) against each of ``text_2``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    text_1: str
    text_2: str | list[str]
    score_tokens: list[int] | None = None
    template: str | None = None
    instruction: str | None = None

    def documents(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)


def rerank_body(model: str, req: RerankRequest, scores: list[float], tokens: int) -> dict:
    """The documents by score, highest first, ``top_n`` of them, each with its index."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": req.documents[i]}
        results.append(item)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"total_tokens": tokens}}  # fmt: skip


def score_body(model: str, scores: list[float], tokens: int) -> dict:
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


class CohereEmbedRequest(BaseModel):
    """Cohere's ``/v2/embed`` (as vLLM serves it): ``texts``, ``embedding_types`` float and
    base64 (others refused by name); ``input_type`` picks the checkpoint's prompt of that name
    (search_query: "query", search_document: "document") where it has one; ``truncate`` NONE
    only."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    texts: list[str] = Field(min_length=1)
    input_type: str | None = None  # search_query, search_document: the checkpoint's prompt
    embedding_types: list[str] = Field(default_factory=lambda: ["float"])
    truncate: str | None = None
    output_dimension: int | None = Field(default=None, ge=1)

    def check(self) -> None:
        unknown = sorted(set(self.embedding_types) - {"float", "base64"})
        if unknown:
            raise ValueError(f"embedding_types: {unknown[0]!r} is not implemented (float, base64)")
        if self.truncate not in (None, "NONE"):
            raise ValueError("truncate: only NONE (a text longer than the context is a 400)")


def cohere_prompt_name(input_type: str | None, prompts: dict[str, str]) -> str | None:
    """The checkpoint prompt a Cohere ``input_type`` names: its own name, or search_query's
    "query" and search_document's "document"; None where the checkpoint has no such prompt."""
    if input_type is None:
        return None
    for name in (input_type, input_type.removeprefix("search_")):
        if name in prompts:
            return name
    return None


def cohere_body(model: str, req: CohereEmbedRequest, vectors: list, tokens: int) -> dict:
    embeddings: dict[str, Any] = {}
    for kind in req.embedding_types:
        embeddings[kind] = [
            v if kind == "float" else base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
            for v in vectors
        ]
    return {"id": f"embed-{uuid.uuid4().hex}", "embeddings": embeddings, "texts": req.texts,
            "meta": {"billed_units": {"input_tokens": tokens}},
            "response_type": "embeddings_by_type", "model": model}  # fmt: skip


def pooling_body(model: str, vectors: list, tokens: int) -> dict:
    """vLLM's ``/pooling``: each input's pooled data."""
    data = [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(vectors)]
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
