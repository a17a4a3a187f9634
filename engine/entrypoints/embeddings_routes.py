"""The pooling routes of a server started with ``--runner pooling``: ``/v1/embeddings``,
``/pooling``, Cohere's ``/v2/embed``, ``/classify``, ``/score`` and ``/rerank`` (bodies in
engine/entrypoints/embeddings_api.py)."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import FastAPI, Request

from engine.entrypoints.embeddings_api import (
    ClassifyRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    classify_body,
    cohere_body,
    cohere_prompt_name,
    embeddings_body,
    input_ids,
    pooling_body,
    rerank_body,
    score_body,
)
from engine.entrypoints.middleware import (
    ApiError,
)
from engine.entrypoints.responses import final_output
from engine.entrypoints.server_state import Server, call
from engine.entrypoints.sse import unless_disconnected
from engine.pooling_params import PoolingParams, prompt_before, score_pooling, score_prompt
from engine.sampling_params import SamplingParams


def add_embeddings_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(raw: Request):
        """OpenAI's embeddings over the pooling runner (embeddings_api.py)."""
        req, size = await server.parse(raw, EmbeddingRequest)
        vectors, tokens = await _embed(raw, server, req, size, req.dimensions, "/v1/embeddings")
        model = req.model or server.model_name
        return embeddings_body(model, vectors, tokens, req.encoding_format)

    @app.post("/pooling")
    async def pooling(raw: Request):
        """vLLM's /pooling: each input's pooled vector (embeddings_api.py)."""
        req, size = await server.parse(raw, EmbeddingRequest)
        vectors, tokens = await _embed(raw, server, req, size, req.dimensions, "/pooling")
        return pooling_body(req.model or server.model_name, vectors, tokens)

    @app.post("/v2/embed")
    async def cohere_embed(raw: Request):
        """Cohere's /v2/embed (embeddings_api.py)."""
        creq, size = await server.parse(raw, CohereEmbedRequest)
        call(creq.check)
        name = cohere_prompt_name(creq.input_type, server.llm.engine.prompts)
        req = EmbeddingRequest(model=creq.model, input=creq.texts, prompt_name=name)
        dims = creq.output_dimension
        vectors, tokens = await _embed(raw, server, req, size, dims, "/v2/embed")
        return cohere_body(creq.model or server.model_name, creq, vectors, tokens)

    @app.post("/classify")
    async def classify(raw: Request):
        """A sequence classifier's label probabilities per input (embeddings_api.py)."""
        creq, size = await server.parse(raw, ClassifyRequest)
        _check_pooling(server, creq.model, "/classify")
        req = call(creq.embedding_request)
        ids = await _input_ids(server, req, size)
        pooling = PoolingParams(task="classify", activation=creq.use_activation)
        rows = await _pooled(raw, server, req.model, ids, pooling)
        tokens, labels = sum(len(x) for x in ids), server.llm.engine.model_config.labels
        return classify_body(creq.model or server.model_name, labels, rows, tokens)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(raw: Request):
        """The documents by a reranker's score (embeddings_api.py)."""
        req, size = await server.parse(raw, RerankRequest)
        scores, tokens = await _score(raw, server, req, req.query, req.documents, size, "/rerank")
        return rerank_body(req.model or server.model_name, req, scores, tokens)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(raw: Request):
        """text_1 against each of text_2 (embeddings_api.py)."""
        req, size = await server.parse(raw, ScoreRequest)
        docs = req.documents()
        scores, tokens = await _score(raw, server, req, req.text_1, docs, size, "/score")
        return score_body(req.model or server.model_name, scores, tokens)


async def _embed(raw, server: Server, req: EmbeddingRequest, size: int, dims, route: str):
    """(each input's vector, the inputs' tokens) through the pooling runner."""
    _check_pooling(server, req.model, route)
    engine = server.llm.engine
    before = call(prompt_before, engine.prompts, req.prompt_name, engine.default_prompt_name)
    ids = await _input_ids(server, req, size, before)
    pooling = engine.pooling_defaults
    if dims is not None:
        pooling = call(dataclasses.replace, pooling, dimensions=dims)
    return await _pooled(raw, server, req.model, ids, pooling), sum(len(x) for x in ids)


async def _score(raw, server: Server, req, query: str, docs: list[str], size: int, route: str):
    """(each document's score, the prompts' tokens): its pair in the reranker's prompt, the
    model's P(yes) against P(no) next, or a one-label classifier's sigmoid (the pooling
    runner's score task)."""
    _check_pooling(server, req.model, route)
    if req.score_tokens is not None and len(req.score_tokens) != 2:
        raise ApiError(400, "score_tokens: two token ids (yes, no)")
    ids = tuple(req.score_tokens) if req.score_tokens else None
    labels = server.llm.engine.model_config.num_labels
    pooling = call(score_pooling, ids, labels, server.tokenizer)
    texts = [call(score_prompt, query, d, req.template, req.instruction) for d in docs]
    prompts = [(await _input_ids(server, EmbeddingRequest(input=t), size))[0] for t in texts]
    vectors = await _pooled(raw, server, req.model, prompts, pooling)
    return [v[0] for v in vectors], sum(len(p) for p in prompts)


def _check_pooling(server: Server, model: str | None, route: str) -> None:
    """A served model, on a server that pools (--runner pooling)."""
    server.check_model(model)
    if server.llm.engine.config.runner != "pooling":
        raise ApiError(400, f"{route} needs a server started with --runner pooling (this one "
                            "generates)")  # fmt: skip


async def _input_ids(server: Server, req: EmbeddingRequest, size: int, prompt: str = ""):
    """Each input's token ids, checked (embeddings_api.input_ids), in a worker when large;
    ``prompt`` before each text."""
    args = (server.tokenizer, server.vocab_size, server.max_model_len, server.max_prompt_chars)
    return await server.run(size, call, input_ids, req, *args, prompt)


async def _pooled(raw, server: Server, model, prompts: list, pooling: PoolingParams) -> list:
    """Each prompt's pooled output (a vector; a score's one value), queued together."""
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    streams = await server.start(prompts, params, False, model)
    whole = asyncio.gather(*[final_output(s) for s in streams])
    finals = await unless_disconnected(raw, whole)
    for o in finals:
        if o.outputs[0].error:
            raise ApiError(500, f"pooling failed: {o.outputs[0].error}", "InternalError")
    return [o.embedding for o in finals]
