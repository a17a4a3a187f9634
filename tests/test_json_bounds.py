"""The bounds a JSON grammar puts on values its schema leaves open (engine/core/structured/
json_bounds.py): numbers of at most 15 integer digits and 10 fraction digits, no exponent;
the schema's own minimum, maximum and multipleOf kept; any JSON inside json_object bounded
the same way. Checked on freshly drawn numbers through SmolLM2's tokenizer, on random walks of
the grammar, and on the case that made them: greedy SmolLM2 writing a float's digits until
max_tokens, which now ends as JSON."""

from __future__ import annotations

import json
import random

import pytest

from engine import SamplingParams
from engine.core.structured import StructuredOutputCompiler, StructuredOutputsParams
from engine.core.structured.json_bounds import MAX_INTEGER, bound_numbers
from engine.frontend.llm import run_to_completion
from tests.test_structured import walks
from tests.utils import make_engine


@pytest.fixture(scope="module")
def compiler(smollm2):
    return StructuredOutputCompiler(smollm2.tokenizer, vocab_size=smollm2.config.vocab_size)


def takes(compiler, tokenizer, schema, text) -> bool:
    m = compiler.matcher(StructuredOutputsParams(json=schema))
    return all(m.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
        m.is_accepting()
    )


def one(value_schema: dict) -> dict:
    return {"type": "object", "properties": {"v": value_schema}, "required": ["v"]}


def digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(n - 1))


@pytest.mark.parametrize("kind", ["integer", "number", ["integer", "null"]])
def test_open_numbers_take_at_most_15_integer_digits(compiler, smollm2, kind):
    tok, rng, schema = smollm2.tokenizer, random.Random(), one({"type": kind})
    for n in (1, rng.randint(2, 14), 15):
        for sign in ("", "-"):
            assert takes(compiler, tok, schema, f'{{"v": {sign}{digits(rng, n)}}}'), n
    for n in (16, rng.randint(17, 40)):
        assert not takes(compiler, tok, schema, f'{{"v": {digits(rng, n)}}}'), n


def test_open_numbers_take_at_most_10_fraction_digits_and_no_exponent(compiler, smollm2):
    tok, rng, schema = smollm2.tokenizer, random.Random(), one({"type": "number"})
    for n in (1, rng.randint(2, 9), 10):
        assert takes(compiler, tok, schema, f'{{"v": {digits(rng, 3)}.{digits(rng, n)}}}'), n
    for n in (11, rng.randint(12, 60)):
        assert not takes(compiler, tok, schema, f'{{"v": 1.{digits(rng, n)}}}'), n
    assert not takes(compiler, tok, schema, '{"v": 2.5e3}')
    assert not takes(compiler, tok, one({"type": "integer"}), '{"v": 2.5}')


def test_a_schemas_own_bounds_are_kept(compiler, smollm2):
    tok, rng = smollm2.tokenizer, random.Random()
    big = one({"type": "integer", "maximum": 10**17})
    assert takes(compiler, tok, big, f'{{"v": {digits(rng, 17)[:1]}{"0" * 16}}}')
    assert not takes(compiler, tok, big, f'{{"v": -{digits(rng, 16)}}}')  # open side: 15
    natural = one({"type": "integer", "minimum": 0})
    assert not takes(compiler, tok, natural, '{"v": -3}')
    assert takes(compiler, tok, natural, f'{{"v": {digits(rng, 15)}}}')
    halves = one({"type": "number", "multipleOf": 0.5})
    assert takes(compiler, tok, halves, '{"v": 7.5}')
    assert not takes(compiler, tok, halves, '{"v": 7.25}')
    given = {"type": "number", "minimum": 1, "exclusiveMaximum": 2, "enum": [1.5]}
    assert bound_numbers(one(given))["properties"]["v"] == {**given, "multipleOf": 1e-10}


def test_json_object_bounds_numbers_at_any_depth(compiler, smollm2):
    tok, rng = smollm2.tokenizer, random.Random()
    m = lambda text: takes(compiler, tok, {"type": "object"}, text)  # noqa: E731
    assert m('{"a": {"b": [1, -2.5, "x", null, true, {}]}, "c": []}')
    assert m(f'{{"a": [{{"b": {digits(rng, 15)}}}]}}')
    assert not m(f'{{"a": [{{"b": {digits(rng, 16)}}}]}}')
    assert not m(f'{{"a": {{"b": 0.{digits(rng, 11)}}}}}')


def test_walks_write_bounded_numbers(compiler, smollm2):
    """Random walks of a schema of open numbers: every output parses, every number within
    the bounds."""
    schema = {"type": "object", "properties": {"n": {"type": "number"},
              "i": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
              "required": ["n", "i"], "additionalProperties": False}  # fmt: skip
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    seed = random.randrange(2**31)
    for text in walks(compiler, params, smollm2.tokenizer, 8, seed=seed, max_steps=120):
        value = json.loads(text)
        for x in [value["n"], *value["i"]]:
            whole, _, fraction = repr(abs(x)).partition(".")
            assert len(whole) <= 15 and len(fraction) <= 10 and "e" not in repr(x), (text, seed)
            assert abs(x) <= MAX_INTEGER


def test_greedy_smollm2_ends_its_float(smollm2):
    """Without the bound, greedy SmolLM2 writes "area_km2": 123.2488888... until max_tokens
    (measured: 96 tokens of 8s); bounded, the JSON ends and parses."""
    schema = {"type": "object", "properties": {"city": {"type": "string"},
              "population": {"type": "integer"}, "area_km2": {"type": "number"}},
              "required": ["city", "population", "area_km2"]}  # fmt: skip
    engine = make_engine(smollm2, backend="cpu")
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give the population and area of Paris as JSON."}]
    )
    so = StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)
    out = run_to_completion(engine, [prompt], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert set(json.loads(out.text)) == {"city", "population", "area_km2"}
