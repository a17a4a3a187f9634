"""Bounds a JSON schema leaves open, added before llguidance compiles it, so that a small
model cannot write one value until ``max_tokens`` (greedy SmolLM2 writes ``1111...`` for a
population): the grammar ends where the schema would let the output ramble.

- An ``integer`` without a ``minimum`` (or ``exclusiveMinimum``) gets ``-MAX_INTEGER``, one
  without a ``maximum`` gets ``MAX_INTEGER``: at most 15 digits, as llama.cpp's JSON grammars
  allow. A side the schema bounds is kept as written.
- A ``number`` gets the same bounds on its open sides and, without a ``multipleOf`` of its own,
  ``multipleOf: FRACTION_STEP``: at most 10 digits after the point and no exponent. (llama.cpp
  allows 15 fraction digits; llguidance takes no ``multipleOf`` finer than 1e-10, and 10
  digits are more than a float32 holds.)
- ``{"type": "object"}`` alone (``json_object``, and an object schema with no properties) is
  rewritten as any object whose values are any JSON with those number bounds, recursively.

Strings are left as the schema says: a string without ``maxLength`` can rightly be long (an
answer, a document), and JSON_WHITESPACE already bounds what lies between values.
"""

from __future__ import annotations

import copy

MAX_INTEGER = 10**15 - 1  # 15 digits
FRACTION_STEP = 1e-10  # 10 digits after the point
NUMERIC = ("number", "integer")
ANY = "pagedllm_any_json"  # the $defs name of any JSON value, bounded


def bound_numbers(schema: dict) -> dict:
    """A copy of ``schema`` with the bounds above on every number it leaves open."""
    schema = copy.deepcopy(schema)
    if schema == {"type": "object"}:
        return _any_object()
    _walk(schema)
    return schema


def _walk(node) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item)
        return
    if not isinstance(node, dict):
        return
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if any(t in NUMERIC for t in types):
        _bound(node, "number" in types)
    for key, value in node.items():
        if key not in ("enum", "const", "default", "examples"):  # data, not schemas
            _walk(value)


def _bound(node: dict, fractional: bool) -> None:
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node["minimum"] = -MAX_INTEGER
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node["maximum"] = MAX_INTEGER
    if fractional and "multipleOf" not in node:
        node["multipleOf"] = FRACTION_STEP


def _any_object() -> dict:
    value = {"$ref": f"#/$defs/{ANY}"}
    number = {"type": "number"}
    _bound(number, True)
    any_value = {
        "anyOf": [
            {"type": ["null", "boolean", "string"]},
            number,
            {"type": "array", "items": value},
            {"type": "object", "additionalProperties": value},
        ]
    }
    return {"type": "object", "additionalProperties": value, "$defs": {ANY: any_value}}
