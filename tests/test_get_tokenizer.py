"""LLM.get_tokenizer(): encodes, decodes and renders chats like a Hugging Face tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from engine.frontend.llm import LLM

CONV = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_gpu_blocks=16, max_model_len=128)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def test_encode_decode_and_call_match_the_engine_tokenizer(llm, tok):
    inner = llm.engine.tokenizer
    ids = tok.encode("hi my name is")
    assert ids == inner.encode("hi my name is")
    assert tok.encode("hi", add_special_tokens=False) == inner.encode("hi", False)
    assert tok("hi my name is")["input_ids"] == ids
    assert tok(["hi", "hello"])["input_ids"] == [tok.encode("hi"), tok.encode("hello")]
    assert tok.decode(ids, skip_special_tokens=True) == inner.decode(ids)
    assert tok.decode(np.array(ids)) == inner.decode(ids, skip_special_tokens=False)


def test_decode_keeps_special_tokens_unless_skipped(tok):
    special = tok.all_special_ids[0]
    ids = [special, *tok.encode("hi", add_special_tokens=False)]
    assert tok.decode(ids).startswith(tok.convert_ids_to_tokens(special))
    assert tok.decode(ids, skip_special_tokens=True) == tok.decode(ids[1:])


def test_vocab_size_len_and_special_ids(llm, tok):
    inner = llm.engine.tokenizer
    assert tok.vocab_size == len(tok) == inner.vocab_size
    assert tok.eos_token_id == inner.eos_token_ids[0]
    assert tok.convert_tokens_to_ids(tok.eos_token) == tok.eos_token_id


def test_apply_chat_template_text_or_ids(llm, tok):
    inner = llm.engine.tokenizer
    text = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    assert text == inner.apply_chat_template(CONV, add_generation_prompt=True)
    ids = tok.apply_chat_template(CONV, tokenize=True, add_generation_prompt=True)
    assert ids == inner.encode(text, add_special_tokens=False)
    assert tok.apply_chat_template(CONV) == inner.encode(  # HF defaults: ids, no prompt
        inner.apply_chat_template(CONV, add_generation_prompt=False), add_special_tokens=False
    )


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda t: t.encode(5), "text"),
        (lambda t: t.decode(["a"]), "token_ids"),
        (lambda t: t.decode([-1]), "token_ids"),
    ],
)
def test_bad_values_name_the_argument(tok, call, name):
    with pytest.raises(ValueError, match=rf"^tokenizer: {name} must be"):
        call(tok)
