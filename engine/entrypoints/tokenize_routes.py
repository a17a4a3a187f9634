"""The tokenizer's routes' bodies: POST /tokenize and /detokenize, GET /tokenizer_info
(vLLM's shapes), each computed off the event loop for a large request. ``server`` is the
``api_server.Server`` of the app (its tokenizer, limits and chat template)."""

from __future__ import annotations

import json

from fastapi.responses import Response

from engine.entrypoints.middleware import ApiError
from engine.entrypoints.protocol import TokenizeRequest


def json_response(body: str) -> Response:
    return Response(body, media_type="application/json")


def tokenize_body(server, req: TokenizeRequest) -> str:
    """The /tokenize answer, as JSON text (a list of millions of ids is slow to encode)."""
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages")
    max_chars, flag = server.limits.max_tokenize_chars, "(--max-tokenize-chars)"
    if req.messages is not None:
        try:
            conv = [m.for_template() for m in req.messages]
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        kw = req.chat_template_kwargs
        agp, effort = req.add_generation_prompt, req.reasoning_effort
        tokens = server.chat_ids(conv, agp, max_chars, tools, flag, kw=kw, effort=effort)
    else:
        if len(req.prompt) > max_chars:
            got = len(req.prompt)
            raise ApiError(400, f"prompt has {got} characters, more than {max_chars} {flag}")
        tokens = server.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    rest = json.dumps({"count": len(tokens), "max_model_len": server.max_model_len})
    return f'{{"tokens": {int_list_json(tokens)}, {rest[1:]}'


def tokenizer_info_body(tokenizer, max_model_len: int) -> dict:
    """``GET /tokenizer_info``, in vLLM's shape (a Hugging Face tokenizer's config): the class
    transformers would load this tokenizer.json with, BOS / EOS, the context length, the chat
    template and the added tokens."""

    def text(token_id):
        return None if token_id is None else tokenizer.id_to_token(token_id)

    eos = tokenizer.eos_token_ids
    added = tokenizer.backend.get_added_tokens_decoder()  # id -> AddedToken
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tokenizer.bos_token_id),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token": text(eos[0]) if eos else None,
        "eos_token_id": eos[0] if eos else None,
        "eos_token_ids": list(eos),
        "pad_token": None,
        "unk_token": None,
        "add_bos_token": tokenizer.add_bos,
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
        "chat_template": tokenizer.chat_template,
        "added_tokens_decoder": {
            str(i): {"content": t.content, "special": t.special} for i, t in sorted(added.items())
        },
    }


def int_list_json(ids: list[int], chunk: int = 1 << 14) -> str:
    """``json.dumps(ids)`` in pieces: one call over millions of ids holds the GIL for seconds,
    between pieces the event loop's thread gets its turn."""
    pieces = (",".join(map(str, ids[i : i + chunk])) for i in range(0, len(ids), chunk))
    return f"[{','.join(pieces)}]"


def detokenize_body(server, tokens: list[int]) -> str:
    vocab = server.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside [0, {vocab})")
    text = server.tokenizer.decode(tokens, skip_special_tokens=False)  # vLLM keeps them too
    return json.dumps({"prompt": text}, ensure_ascii=False)


# ---- generation ----
