"""Structured output: constraints compile to llguidance grammars whose masks only ever let through
text the constraint accepts.

The oracle is independent of llguidance: random walks (a uniformly random allowed token each
step, until EOS is drawn) are decoded by the project's tokenizer and checked with Python's ``re``,
``json`` and a small JSON-schema checker below (jsonschema is not installed).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from engine.core.structured import (
    StructuredOutputCompiler,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_bitmask,
    bitmask_width,
    unpack_bitmask,
)
from engine.structured_params import closed_objects

HI = StructuredOutputsParams(regex="hi( there)?")
TINY_PAD = 45  # the tiny model's lm_head pretends to have this many ids past the tokenizer

PERSON = {  # a pydantic-like nested schema: objects, arrays, enums, numbers, booleans
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "floor": {"type": "integer", "minimum": -2, "maximum": 40},
            },
            "required": ["zip", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "role", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_compiler(tiny):
    return StructuredOutputCompiler(tiny.tokenizer, vocab_size=tiny.tokenizer.vocab_size + TINY_PAD)


@pytest.fixture(scope="module")
def smol_compiler(smollm2):
    return StructuredOutputCompiler(smollm2.tokenizer, vocab_size=smollm2.config.vocab_size)


# --- helpers ----------------------------------------------------------------------------------


def walk(compiler, matcher, rng, max_steps=200, shun=None) -> list[int] | None:
    """Random allowed tokens until EOS is drawn: the ids before it, or None if it never came.

    shun: (V,) bool, tokens drawn only one step in ten while another token is allowed (a
    uniform walk through flexible JSON whitespace would hardly ever leave it).
    """
    out = []
    for _ in range(max_steps):
        allowed = matcher.allowed_mask()  # (V,) bool
        assert not allowed[compiler.tokenizer_vocab_size :].any(), "a padding id was allowed"
        assert allowed[list(compiler.eos_token_ids)].all() == matcher.is_accepting()
        ids = np.flatnonzero(allowed)
        if shun is not None and rng.random() < 0.9 and not shun[ids].all():
            ids = ids[~shun[ids]]
        token = int(rng.choice(ids))
        assert matcher.accept(token)
        if token in compiler.eos_token_ids:
            assert matcher.is_stopped()
            return out
        out.append(token)
    return None


def walks(compiler, params, tokenizer, n, seed=0, max_steps=200, shun=None) -> list[str]:
    """The decoded texts of n random walks (special tokens kept, so a stray one shows)."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        ids = walk(compiler, compiler.matcher(params), rng, max_steps, shun)
        assert ids is not None, f"no EOS within {max_steps} steps"
        texts.append(tokenizer.decode(ids, skip_special_tokens=False))
    return texts


def check_schema(value, schema) -> None:
    """Asserts value satisfies schema (the keywords PERSON uses)."""
    if "enum" in schema:
        assert value in schema["enum"], value
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), value
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= value.keys(), value
        if schema.get("additionalProperties") is False:
            assert value.keys() <= props.keys(), value
        for name, sub in props.items():
            if name in value:
                check_schema(value[name], sub)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for item in value:
            check_schema(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
        assert re.search(schema.get("pattern", ""), value), value
    elif kind in ("integer", "number"):
        allowed = int if kind == "integer" else (int, float)
        assert isinstance(value, allowed) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value
    elif kind == "boolean":
        assert isinstance(value, bool), value


def mask_of(matcher) -> bytes:
    return np.packbits(matcher.allowed_mask()).tobytes()


# --- params and the cache ---------------------------------------------------------------------


def test_params_take_exactly_one_constraint():
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"json": {}, "json_object": True}):
        with pytest.raises(ValueError, match="exactly one of json, regex, choice"):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="json must be a JSON schema.*not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=["a", 1])
    assert StructuredOutputsParams(json='{"type": "string"}').kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_equal_constraints_share_one_compiled_grammar(tiny_compiler):
    x, y = {"minimum": 1, "type": "integer"}, {"$ref": "#/$defs/y"}
    defs = {"y": {"type": "string", "maxLength": 3}, "z": {"type": "boolean"}}
    a = {"type": "object", "$defs": defs, "properties": {"x": x, "y": y}}
    b = {
        "properties": {"x": dict(reversed(x.items())), "y": y},
        "$defs": dict(reversed(defs.items())),
    }
    b["type"] = "object"
    pa, pb = StructuredOutputsParams(json=a), StructuredOutputsParams(json=json.dumps(b))
    assert pa.key() == pb.key()
    assert tiny_compiler.compile(pa) is tiny_compiler.compile(pb)
    # the order of "properties" is the order of the output's keys: a different constraint
    swapped = {"type": "object", "properties": {"y": {}, "x": {}}}
    plain = {"type": "object", "properties": {"x": {}, "y": {}}}
    assert StructuredOutputsParams(json=swapped).key() != StructuredOutputsParams(json=plain).key()
    loose = StructuredOutputsParams(json=a, disable_any_whitespace=True)
    assert loose.key() != pa.key()


def test_cache_is_lru_and_bounded(tiny):
    compiler = StructuredOutputCompiler(tiny.tokenizer, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first_a  # a is now the most recent: b goes next
    compiler.compile(c)
    assert compiler.compile(a) is first_a
    assert compiler.compile(b) is not compiler.compile(c)
    assert len(compiler._cache) == 2


@pytest.mark.parametrize(
    "params, words",
    [
        (dict(regex="[0-9"), "structured output regex: .*unclosed character class"),
        (dict(regex="(a"), "structured output regex: .*unclosed group"),
        (dict(json={"type": "objectx"}), "structured output json: Invalid type: objectx"),
        (dict(json={"$ref": "#/$defs/nope"}), "structured output json: .*does not exist"),
        (dict(grammar="start: foo"), "structured output grammar: .*unknown name"),
    ],
)
def test_bad_constraints_are_one_line_value_errors(tiny_compiler, params, words):
    with pytest.raises(ValueError, match=words) as err:
        tiny_compiler.compile(StructuredOutputsParams(**params))
    assert "\n" not in str(err.value)


# --- random walks stay inside the constraint --------------------------------------------------


@pytest.mark.parametrize("regex", [r"[0-9]{1,3}(\.[0-9]{2})?", r"(cat|dog)s? [a-z ]{2,6}!"])
def test_regex_walks_match(tiny_compiler, tiny, smol_compiler, smollm2, regex):
    params = StructuredOutputsParams(regex=regex)
    for compiler, model, n in ((tiny_compiler, tiny, 40), (smol_compiler, smollm2, 10)):
        for text in walks(compiler, params, model.tokenizer, n):
            assert re.fullmatch(regex, text), text


def test_choice_walks_give_a_choice(tiny_compiler, tiny, smol_compiler, smollm2):
    choices = ["yes", "yes!", "no", 'a "quote"', "back\\slash", "new\nline", "東京 🙂"]
    params = StructuredOutputsParams(choice=choices)
    for compiler, model, n in ((tiny_compiler, tiny, 40), (smol_compiler, smollm2, 20)):
        assert set(walks(compiler, params, model.tokenizer, n)) <= set(choices)
        for choice in choices:  # each is reachable, token by token, and complete at its end
            m = compiler.matcher(params)
            assert all(map(m.accept, model.tokenizer.encode(choice, False))), choice
            assert m.is_accepting()


def test_json_schema_walks_are_valid(smol_compiler, smollm2):
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    for text in walks(smol_compiler, params, smollm2.tokenizer, 8, seed=1):
        check_schema(json.loads(text), PERSON)
        assert not re.search(r"\s", _outside_strings(text)), text


def test_json_schema_walks_with_flexible_whitespace(smol_compiler, smollm2):
    tok = smollm2.tokenizer
    pieces = tok.backend.decode_batch([[i] for i in range(smol_compiler.vocab_size)])
    spaces = np.array([p.isspace() for p in pieces])  # (V,) whitespace-only tokens
    params = StructuredOutputsParams(json=PERSON)
    texts = walks(smol_compiler, params, tok, 4, seed=5, max_steps=300, shun=spaces)
    for text in texts:
        check_schema(json.loads(text), PERSON)
    assert any(re.search(r"\s", _outside_strings(t)) for t in texts)


def _outside_strings(text: str) -> str:
    """text with the JSON string literals taken out."""
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_json_schema_walks_on_the_tiny_vocab(tiny_compiler, tiny):
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    for text in walks(tiny_compiler, params, tiny.tokenizer, 15, seed=2, max_steps=400):
        check_schema(json.loads(text), PERSON)


def test_json_object_walks_parse_as_objects(tiny_compiler, tiny):
    params = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    rng = np.random.default_rng(3)
    finished = 0
    for _ in range(20):
        ids = walk(tiny_compiler, tiny_compiler.matcher(params), rng, max_steps=150)
        if ids is not None:
            finished += 1
            assert isinstance(json.loads(tiny.tokenizer.decode(ids, False)), dict)
    assert finished >= 10


def test_lark_and_gbnf_grammar_walks_match(tiny_compiler, tiny):
    lark = 'start: sum\nsum: NUM | sum "+" NUM\nNUM: /[1-9][0-9]?/\n'
    gbnf = 'root ::= num ("+" num)*\nnum ::= [1-9] [0-9]?\n'
    for grammar in (lark, gbnf):
        params = StructuredOutputsParams(grammar=grammar)
        for text in walks(tiny_compiler, params, tiny.tokenizer, 30):
            assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", text), text


# --- EOS, refusals, rollback, drafts ----------------------------------------------------------


def test_eos_is_allowed_exactly_when_the_grammar_can_end(tiny_compiler, tiny):
    tok = tiny.tokenizer
    (eos,) = tiny_compiler.eos_token_ids
    m = tiny_compiler.matcher(HI)
    assert not m.allowed_mask()[eos] and not m.is_accepting()
    assert not m.accept(eos)  # refused: nothing changes, no error state
    assert all(map(m.accept, tok.encode("hi", False)))
    assert m.allowed_mask()[eos] and m.is_accepting() and not m.is_stopped()
    assert all(map(m.accept, tok.encode(" there", False)))
    assert m.is_stopped() and np.flatnonzero(m.allowed_mask()).tolist() == [eos]
    assert not m.accept(tok.encode("hi", False)[0]) and not m.accept(tok.vocab_size + 1)
    assert m.accept(eos) and m.is_stopped() and m.error is None


def test_rollback_restores_the_mask(smol_compiler, smollm2):
    params = StructuredOutputsParams(json=PERSON)
    rng = np.random.default_rng(4)
    m = smol_compiler.matcher(params)
    for _ in range(60):
        before, n = mask_of(m), m.num_tokens
        k = int(rng.integers(1, 4))
        taken = 0
        for _ in range(k):
            allowed = np.flatnonzero(m.allowed_mask())
            taken += m.accept(int(rng.choice(allowed)))
        m.rollback(taken)
        assert m.num_tokens == n and mask_of(m) == before
        token = int(rng.choice(np.flatnonzero(m.allowed_mask())))
        if token in smol_compiler.eos_token_ids:
            break
        m.accept(token)
    with pytest.raises(ValueError, match="rollback: num_tokens must be in"):
        m.rollback(m.num_tokens + 1)


def test_rollback_through_eos(tiny_compiler, tiny):
    tok = tiny.tokenizer
    (eos,) = tiny_compiler.eos_token_ids
    m = tiny_compiler.matcher(HI)
    assert all(map(m.accept, tok.encode("hi", False)))
    after_hi = mask_of(m)
    assert m.accept(eos)  # the grammar could go on: llguidance records this EOS
    m.rollback(1)
    assert mask_of(m) == after_hi and not m.is_stopped()
    assert all(map(m.accept, tok.encode(" there", False))) and m.accept(eos)  # after its stop
    m.rollback(1 + len(tok.encode(" there", False)))
    assert mask_of(m) == after_hi
    m.reset()
    assert m.num_tokens == 0 and mask_of(m) == mask_of(tiny_compiler.matcher(HI))


def test_validate_tokens_counts_the_draft_accept_would_take(tiny_compiler, tiny):
    tok = tiny.tokenizer
    (eos,) = tiny_compiler.eos_token_ids
    m = tiny_compiler.matcher(HI)
    good = tok.encode("hi there", False)
    start = mask_of(m)
    assert m.validate_tokens(good + [eos, eos]) == len(good) + 1
    assert m.validate_tokens(good[:1] + tok.encode("!", False) + good[1:]) == 1
    assert m.validate_tokens([tiny_compiler.vocab_size - 1, *good]) == 0  # a padding id
    assert m.num_tokens == 0 and mask_of(m) == start
    assert all(map(m.accept, good)) and m.is_stopped()
    assert m.validate_tokens([eos, eos]) == 1 and m.validate_tokens(good[:1]) == 0


def test_matchers_from_one_grammar_are_independent(tiny_compiler, tiny):
    a, b = tiny_compiler.matcher(HI), tiny_compiler.matcher(HI)
    start = mask_of(b)
    assert all(map(a.accept, tiny.tokenizer.encode("hi", False)))
    assert mask_of(b) == start != mask_of(a)
    assert mask_of(tiny_compiler.matcher(HI)) == start


# --- bitmasks ---------------------------------------------------------------------------------


def test_fill_bitmasks_matches_one_matcher_at_a_time(tiny_compiler, tiny):
    v = tiny_compiler.vocab_size
    ms = [tiny_compiler.matcher(StructuredOutputsParams(regex=r)) for r in ("hi+", "[0-9]+")]
    ms[0].accept(tiny.tokenizer.encode("hi", False)[0])
    bitmask = allocate_bitmask(3, v)
    tiny_compiler.fill_bitmasks([ms[0], None, ms[1]], bitmask)
    rows = unpack_bitmask(bitmask, v)  # (3, V)
    assert (rows[0] == ms[0].allowed_mask()).all() and (rows[2] == ms[1].allowed_mask()).all()
    assert rows[1].all()  # no matcher: left all-allowed
    with pytest.raises(ValueError, match="fill_bitmask: row must be a contiguous"):
        ms[0].fill_bitmask(bitmask[:, 0])


def masked_one_by_one(logits, bitmask):
    """The oracle: logits (K, V) with token t of row k at -inf unless bit t of bitmask row k."""
    out = logits.copy()
    for k in range(out.shape[0]):
        for t in range(out.shape[1]):
            word = int(bitmask[k, t // 32]) if t < 32 * bitmask.shape[1] else 0
            if not (word >> (t % 32)) & 1:
                out[k, t] = -np.inf
    return out


@pytest.mark.parametrize("vocab, width", [(70, 3), (100, 3), (64, 2)])
def test_apply_bitmask_matches_bit_by_bit(vocab, width):
    rng = np.random.default_rng(vocab)
    bitmask = rng.integers(-(2**31), 2**31, size=(4, width), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    got = logits.copy()
    apply_bitmask(got, bitmask)
    np.testing.assert_array_equal(got, masked_one_by_one(logits, bitmask))
    rows = np.array([3, 1])  # bitmask row 0 masks logits row 3, row 1 row 1
    got, expect = logits.copy(), logits.copy()
    apply_bitmask(got, bitmask[:2], rows)
    expect[rows] = masked_one_by_one(logits[rows], bitmask[:2])
    np.testing.assert_array_equal(got, expect)
    assert bitmask_width(vocab) == (vocab + 31) // 32


def test_apply_bitmask_checks_shapes():
    with pytest.raises(ValueError, match="logits must be"):
        apply_bitmask(np.zeros((2, 8)), allocate_bitmask(2, 8))
    with pytest.raises(ValueError, match="bitmask has 2 rows, expected 3"):
        apply_bitmask(np.zeros((3, 8), np.float32), allocate_bitmask(2, 8))


# ---- the JSON defaults: bounded whitespace, closed objects ----

SHAPE = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
    "required": ["a", "b"],
}


def takes(compiler, tokenizer, params, text: str) -> bool:
    """Whether the grammar takes ``text`` whole (its tokens one by one, then can end)."""
    m = compiler.matcher(params)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(m.accept(t) for t in ids) and m.is_accepting()


def test_json_whitespace_is_bounded_as_llama_cpp_bounds_it(smol_compiler, smollm2):
    """Between JSON tokens: nothing, one space, or a newline and up to 20 spaces or tabs; never
    blank lines or a longer indent. disable_any_whitespace: none at all."""
    tok, p = smollm2.tokenizer, StructuredOutputsParams(json=SHAPE)
    good = ['{"a": 1, "b": ["x"]}', '{"a":1,"b":["x"]}', '{"a": 1 , "b": [ ]}']
    good += ['{\n  "a": 1,\n  "b": [\n    "x"\n  ]\n}', '{\n\t"a": 1,\n\t"b": []\n}']
    good += ["{\n" + " " * 20 + '"a": 1, "b": []}']
    for text in good:
        assert takes(smol_compiler, tok, p, text), text
    bad = ['{\n\n  "a": 1, "b": []}', "{\n" + " " * 21 + '"a": 1, "b": []}']
    bad += ['{"a":  1, "b": []}', '{"a": 1,\n "b": []} \n ']
    for text in bad:
        assert not takes(smol_compiler, tok, p, text), text
    tight = StructuredOutputsParams(json=SHAPE, disable_any_whitespace=True)
    assert takes(smol_compiler, tok, tight, '{"a":1,"b":["x"]}')
    assert not takes(smol_compiler, tok, tight, '{"a": 1,"b":["x"]}')
    obj = StructuredOutputsParams(json_object=True)
    assert takes(smol_compiler, tok, obj, '{\n  "k": {"x": [1, 2]}\n}')
    assert not takes(smol_compiler, tok, obj, '{\n\n\n  "k": 1}')


def test_objects_are_closed_unless_the_schema_or_the_request_opens_them(smol_compiler, smollm2):
    """A declared object takes no other keys (OpenAI's strict outputs, vLLM's xgrammar);
    additionalProperties stated, an empty object schema, and disable_additional_properties
    False keep them."""
    tok, extra = smollm2.tokenizer, '{"a": 1, "b": [], "c": 2}'
    assert takes(smol_compiler, tok, StructuredOutputsParams(json=SHAPE), '{"a": 1, "b": []}')
    assert not takes(smol_compiler, tok, StructuredOutputsParams(json=SHAPE), extra)
    opened = StructuredOutputsParams(json=SHAPE, disable_additional_properties=False)
    assert takes(smol_compiler, tok, opened, extra)
    stated = StructuredOutputsParams(json={**SHAPE, "additionalProperties": {"type": "integer"}})
    assert takes(smol_compiler, tok, stated, extra)
    assert takes(smol_compiler, tok, StructuredOutputsParams(json_object=True), extra)
    nested = {"type": "object", "properties": {"in": SHAPE}}
    assert not takes(
        smol_compiler, tok, StructuredOutputsParams(json=nested), '{"in": ' + extra + "}"
    )


def test_closed_objects_leaves_compositions_open():
    """allOf members and objects whose keys come from elsewhere stay as written (closing them
    would refuse what the schema allows); every declared object elsewhere is closed."""
    a, b = {"properties": {"a": {}}}, {"properties": {"b": {}}}
    schema = {
        "allOf": [a, b],
        "$defs": {"d": {"type": "object", "properties": {"x": {"items": a}}}},
        "properties": {"p": {"anyOf": [a, {"type": "object"}]}, "q": {**a, "$ref": "#/$defs/d"}},
    }
    out = closed_objects(schema)
    assert out["allOf"] == [a, b] and "additionalProperties" not in out  # has allOf
    d = out["$defs"]["d"]
    assert d["additionalProperties"] is False
    assert d["properties"]["x"]["items"] == {**a, "additionalProperties": False}
    assert out["properties"]["p"]["anyOf"] == [
        {**a, "additionalProperties": False},
        {"type": "object"},
    ]
    assert "additionalProperties" not in out["properties"]["q"]  # beside a $ref
    assert schema["$defs"]["d"] == {"type": "object", "properties": {"x": {"items": a}}}  # a copy


def test_a_reasoning_grammar_skips_newlines_only_after_the_thinking(smol_compiler, smollm2):
    """A grammar for a reasoning model's answer: an output that never thinks is held to the
    grammar from its first token (no newline the grammar refuses, even right after its first
    word); after </think> up to two refused newlines are skipped, then none."""
    from engine.core.structured.matcher import AfterReasoning

    tok, regex = smollm2.tokenizer, "[a-z]{3,9}"
    bounds = dict(reasoning_start="<think>", reasoning_end="</think>")
    newline = tok.encode("\n", add_special_tokens=False)[0]

    def allows(m, token: int) -> bool:
        row = np.empty(bitmask_width(smol_compiler.vocab_size), np.int32)
        m.fill_bitmask(row)
        return bool(unpack_bitmask(row, smol_compiler.vocab_size)[token])

    plain = smol_compiler.matcher(StructuredOutputsParams(regex=regex))
    never = smol_compiler.matcher(StructuredOutputsParams(regex=regex, **bounds))
    assert isinstance(never, AfterReasoning)
    for t in tok.encode("ab", add_special_tokens=False):
        assert plain.accept(t) and never.accept(t)
    assert not allows(plain, newline) and not allows(never, newline)
    assert not never.accept(newline)
    opened = smol_compiler.matcher(StructuredOutputsParams(regex=regex, reasoning_end="</think>"))
    assert all(opened.accept(t) for t in tok.encode("hmm</think>", add_special_tokens=False))
    assert opened.state == "answer"
    for _ in range(AfterReasoning.NEWLINES):
        assert allows(opened, newline) and opened.accept(newline)
    assert not allows(opened, newline) and not opened.accept(newline)
