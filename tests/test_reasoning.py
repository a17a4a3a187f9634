"""Reasoning models' thinking split from the answer (engine/entrypoints/reasoning.py): the qwen3
and deepseek_r1 parsers on whole and streamed text (</think> split anywhere across pieces), and
through the server on a tiny model that writes a reasoning model's output (tests/scripted.py):
``reasoning_content`` in chat completions, streamed as its own deltas; a schema that applies to
the answer after the thinking (the thinking would break it); ``chat_template_kwargs``
``enable_thinking: false`` closing the thinking in the prompt; a template that opens it."""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import httpx
import numpy as np
import pytest

from engine.entrypoints.reasoning import ReasoningSplit, prompt_state
from engine.tools.live_server import MODEL, LiveServer
from tests.scripted import scripted_factory

# parser, whether the prompt opened the thinking, output, (thinking, answer)
CASES = [
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "Paris.")),
    ("qwen3", False, "Paris.", (None, "Paris.")),
    ("qwen3", False, "<think>cut short", ("cut short", None)),
    ("qwen3", False, "<thin", (None, "<thin")),
    ("qwen3", False, "", (None, None)),
    ("qwen3", True, "Hmm.</think>Paris", ("Hmm.", "Paris")),
    ("deepseek_r1", True, "Hmm, ok.</think>\n\nParis.", ("Hmm, ok.", "Paris.")),
    ("deepseek_r1", True, "<think>Hmm</think>Paris</think>", ("Hmm", "Paris</think>")),
    ("deepseek_r1", True, "all thinking", ("all thinking", None)),
    # a prompt that opened nothing: the output's first text decides, for every parser
    ("deepseek_r1", False, "Paris.", (None, "Paris.")),
    ("deepseek_r1", False, " <think>Hmm</think>Paris", ("Hmm", "Paris")),
    ("deepseek_r1", False, '{"a": "</think>"}', (None, '{"a": "</think>"}')),
]


def fed(parser: str, text: str, rng: random.Random, opened: bool = False):
    split, thinking, answer, i = ReasoningSplit(parser, opened), "", "", 0
    while True:
        j = min(len(text), i + rng.randint(1, 4))
        a, b = split.feed(text[i:j], final=j == len(text))
        thinking, answer, i = thinking + a, answer + b, j
        if i == len(text):
            return (thinking if split.thought else None), answer or None


@pytest.mark.parametrize("parser, opened, text, want", CASES)
def test_thinking_and_answer_whole_and_in_pieces(parser, opened, text, want):
    assert ReasoningSplit(parser, opened).split(text) == want
    rng = random.Random()
    for _ in range(10):
        assert fed(parser, text, rng, opened) == want


def test_a_prompt_that_opens_or_closes_the_thinking():
    assert prompt_state("<|im_start|>assistant\n<think>\n") == (True, False)
    assert prompt_state("assistant\n<think>\n\n</think>\n\n") == (False, True)
    assert prompt_state("<|im_start|>assistant\n") == (False, False)


QWEN3 = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
R1 = QWEN3.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
ASK = [{"role": "user", "content": "How many?"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def with_template(loaded, template: str):
    tok = copy.copy(loaded.tokenizer)
    tok.chat_template, tok._template = template, None
    return dataclasses.replace(loaded, tokenizer=tok)


def with_think_tokens(loaded):
    """The model with <think> and </think> as tokens of their own (as a reasoning model's
    vocabulary has them: Qwen3's, DeepSeek-R1's), two new random embedding rows."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from model_loader.tokenizer import Tokenizer

    old = loaded.tokenizer
    backend = HFTokenizer.from_str(old.backend.to_str())
    backend.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    tok = Tokenizer(backend, bos_token_id=old.bos_token_id, eos_token_ids=old.eos_token_ids,
                    add_bos=old.add_bos, chat_template=old.chat_template)  # fmt: skip
    w, n = loaded.weights, backend.get_vocab_size(with_added_tokens=True)
    rows = np.random.default_rng(0).standard_normal((n - w.embed.shape[0], w.embed.shape[1]))
    embed = np.vstack([w.embed, rows.astype(w.embed.dtype)])  # (V + 2, D)
    head = embed if w.lm_head is w.embed else np.vstack([w.lm_head, rows.astype(w.embed.dtype)])
    weights = dataclasses.replace(w, embed=embed, lm_head=head)
    config = dataclasses.replace(loaded.config, vocab_size=n)
    return dataclasses.replace(loaded, config=config, weights=weights, tokenizer=tok)


@pytest.fixture(scope="module")
def qwen3(tiny):
    script = {"start": 0, "ids": [], "eos": tiny.tokenizer.eos_token_ids[0]}
    loaded = with_template(with_think_tokens(tiny), QWEN3)
    with LiveServer(loaded, reasoning_parser="qwen3", backend_factory=scripted_factory(script),
                    max_model_len=256, num_gpu_blocks=64) as s:  # fmt: skip
        yield s, script, loaded.tokenizer


def write(server, script, tok, text: str, **extra) -> None:
    """The scripted model writes ``text`` after the prompt of ASK (with these request fields)."""
    body = {"model": MODEL, "messages": ASK, **extra}
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    script["start"], script["ids"] = len(ids), tok.encode(text, add_special_tokens=False)


def test_reasoning_content_whole_and_streamed(qwen3):
    server, script, tok = qwen3
    write(server, script, tok, "<think>\nLet me count.\n</think>\n\nFive.")
    client = server.openai_client()
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "\nLet me count.\n" and msg.content == "Five."
    thinking = content = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                                stream=True):  # fmt: skip
        delta = chunk.choices[0].delta
        thinking += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (thinking, content) == ("\nLet me count.\n", "Five.")


def test_a_schema_applies_to_the_answer_after_the_thinking(qwen3):
    """The thinking (not JSON) is not masked; the answer is, and ends the output when complete."""
    server, script, tok = qwen3
    write(server, script, tok, '<think>\nCount: {one, two}\n</think>\n\n{"n": 2} and more')
    r = server.openai_client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    )  # fmt: skip
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "\nCount: {one, two}\n"
    assert json.loads(msg.content) == {"n": 2} and r.choices[0].finish_reason == "stop"


def test_a_model_that_does_not_think_is_constrained_from_its_first_token(qwen3):
    """The model writes prose where a schema is asked and never opens <think>: the grammar
    applies from the first token (it used to wait for a </think> that never came), so the
    scripted prose is masked and the answer is the schema's."""
    server, script, tok = qwen3
    write(server, script, tok, "The answer is two.")
    r = server.openai_client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    )  # fmt: skip
    msg = r.choices[0].message
    assert "reasoning_content" not in msg.model_extra or not msg.model_extra["reasoning_content"]
    assert set(json.loads(msg.content)) == {"n"}


def test_thinking_switched_off_in_the_template(qwen3):
    """enable_thinking false: the template closes the thinking in the prompt, the output is
    the answer, constrained from its first token."""
    server, script, tok = qwen3
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    write(server, script, tok, '{"n": 3}', **kw)
    r = server.openai_client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, extra_body=kw,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    )  # fmt: skip
    msg = r.choices[0].message
    assert json.loads(msg.content) == {"n": 3} and "reasoning_content" not in msg.model_extra
    bad = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "chat_template_kwargs": {"messages": []}})  # fmt: skip
    assert bad.status_code == 400 and "'messages' is set by the server" in bad.text


def test_a_template_that_opens_the_thinking(tiny):
    """deepseek_r1's templates open <think> in the prompt: the output starts inside it."""
    script = {"start": 0, "ids": [], "eos": tiny.tokenizer.eos_token_ids[0]}
    loaded = with_template(tiny, R1)
    with LiveServer(loaded, reasoning_parser="deepseek_r1",
                    backend_factory=scripted_factory(script), max_model_len=256,
                    num_gpu_blocks=64) as s:  # fmt: skip
        write(s, script, loaded.tokenizer, "Two and three.\n</think>\n\nFive.")
        r = s.openai_client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=30)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Two and three.\n" and msg.content == "Five."


def test_the_thinking_in_responses_and_messages(qwen3):
    """A reasoning item before the message (Responses), a thinking block before the text
    (Messages); streamed as reasoning_text deltas and thinking_delta events."""
    import anthropic

    server, script, tok = qwen3
    write(server, script, tok, "<think>\nLet me count.\n</think>\n\nFive.")
    client = server.openai_client()
    r = client.responses.create(model=MODEL, input="How many?", max_output_tokens=40)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "\nLet me count.\n" and r.output_text == "Five."
    with client.responses.stream(model=MODEL, input="How many?", max_output_tokens=40) as st:
        events = list(st)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "\nLet me count.\n"
    assert "response.reasoning_text.done" in [e.type for e in events]

    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, max_tokens=40, messages=ASK)
    m = claude.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 32})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "\nLet me count.\n" and m.content[1].text == "Five."
    with claude.messages.stream(**kw) as st:
        events = list(st)
        final = st.get_final_message()
    pieces = [e.delta.thinking for e in events
              if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]  # fmt: skip
    assert "".join(pieces) == "\nLet me count.\n" and final.content[1].text == "Five."
