"""What a request's output must look like: vLLM's ``StructuredOutputsParams`` names.

Exactly one constraint is set: ``json`` (a JSON schema, as a dict or its JSON text), ``regex``,
``choice`` (the output is one of these strings), ``grammar`` (Lark, or llama.cpp's GBNF) or
``json_object=True`` (any JSON object). ``key()`` is the hashable form the compiler caches
grammars under: equal constraints give equal keys, however their schema's keys were ordered.

Three defaults make the JSON kinds' output end where a small model would otherwise ramble:

- Whitespace between JSON tokens is bounded (``JSON_WHITESPACE``, as llama.cpp's JSON grammars
  bound it): one space, or a newline and at most 20 spaces or tabs of indent; never a run of
  blank lines. ``disable_any_whitespace=True`` allows none at all (``{"a":1,"b":[2]}``).
- An object schema that declares ``properties`` and says nothing of ``additionalProperties``
  is closed (no other keys), as OpenAI's strict outputs and vLLM's default backend (xgrammar)
  treat it; ``disable_additional_properties=False`` keeps JSON Schema's open default (vLLM's
  guidance backend's). ``closed_objects`` says which schemas this touches.
- Numbers the schema leaves open take at most 15 integer and 10 fraction digits
  (``engine.core.structured.json_bounds``, applied where the grammar is compiled).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"  # between JSON tokens (llama.cpp's JSON grammars' bound)

# Schema keywords whose value maps names to schemas. The order of "properties" is the order the
# output writes the keys in, so it is kept; the others are sorted by name.
ORDERED_MAPS = frozenset({"properties"})
SORTED_MAPS = frozenset({"$defs", "definitions", "patternProperties", "dependentSchemas"})
DATA = frozenset({"enum", "const", "default", "examples"})  # JSON values, kept as written


def _bad(name: str, value, expected: str) -> ValueError:
    return ValueError(f"StructuredOutputsParams: {name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (see the module docstring). Not hashable when
    ``json`` is a dict: use ``key()``."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True
    # a reasoning model's output: the grammar is for the answer after its thinking, which ends
    # at reasoning_end; with reasoning_start the output's first tokens decide whether it thinks
    # (the grammar applies from token 0 to an output that does not open with it), without it
    # the output starts inside the thinking (the prompt opened it)
    reasoning_end: str | None = None
    reasoning_start: str | None = None
    # reasoning_end is a regular expression (harmony: the header that opens the final channel
    # or a named call): its first match in the output ends the thinking
    reasoning_end_regex: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(given) if given else "none"
            raise ValueError(
                f"StructuredOutputsParams: exactly one of {', '.join(KINDS)} must be set, "
                f"got {names}"
            )
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None:
            _parse_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise _bad(name, value, "a string")
        if self.choice is not None:
            ok = isinstance(self.choice, list | tuple) and len(self.choice) > 0
            if not ok or not all(isinstance(c, str) for c in self.choice):
                raise _bad("choice", self.choice, "a non-empty list of strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _bad("json_object", self.json_object, "a bool")
        for name in ("reasoning_end", "reasoning_start"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise _bad(name, value, "None or a non-empty string")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise _bad("reasoning_start", self.reasoning_start, "set with reasoning_end only")
        if self.reasoning_end_regex is not False:
            if self.reasoning_end_regex is not True or self.reasoning_end is None:
                raise _bad(
                    "reasoning_end_regex",
                    self.reasoning_end_regex,
                    "a bool, True with reasoning_end only",
                )
            try:
                re.compile(self.reasoning_end)
            except re.error as e:
                raise _bad(
                    "reasoning_end", self.reasoning_end, f"a regular expression ({e})"
                ) from None
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")

    @property
    def kind(self) -> str:
        """The name of the constraint that is set: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> dict:
        """``json`` as a canonical dict (parsed when given as JSON text); its objects closed
        unless ``disable_additional_properties`` is False."""
        schema = canonical_schema(_parse_schema(self.json))
        return closed_objects(schema) if self.disable_additional_properties else schema

    def key(self) -> tuple:
        """A hashable canonical form: (kind, spec[, disable_any_whitespace]); computed once."""
        key = self.__dict__.get("_key")
        if key is None:
            key = self.__dict__["_key"] = self._make_key()  # frozen: bypass __setattr__
        return key

    def _make_key(self) -> tuple:
        kind = self.kind
        if kind == "json":
            text = json.dumps(self.schema(), separators=(",", ":"), ensure_ascii=False)
            return (kind, text, self.disable_any_whitespace)  # schema(): closed or not
        if kind == "json_object":
            return (kind, self.disable_any_whitespace)
        if kind == "choice":
            return (kind, tuple(self.choice))
        return (kind, getattr(self, kind))


# where a schema holds subschemas: maps of them, single ones, and lists of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then")
_SCHEMA_ONE += ("else", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
# an object with one of these beside its properties takes keys from elsewhere: left open
_OPEN_BESIDE = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
_OPEN_BESIDE += ("anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependencies")


def closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """A copy of ``schema`` where each object schema that declares ``properties`` and nothing
    that lets other keys in (``_OPEN_BESIDE``) gets ``additionalProperties: false``, except the
    members of an ``allOf`` (closing each would leave no object satisfying all of them). Schemas
    that declare no properties (``{"type": "object"}``: any object) stay open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s, key == "allOf") for s in out[key]]
    declares = isinstance(out.get("properties"), dict)
    if declares and not in_all_of and not any(k in out for k in _OPEN_BESIDE):
        out["additionalProperties"] = False
    return out


def _parse_schema(schema: dict | str) -> dict:
    """The schema dict of a dict or its JSON text; a ValueError naming ``json`` otherwise."""
    expected = "a JSON schema (a dict or its JSON text)"
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _bad("json", schema, f"{expected}; not valid JSON: {e}") from None
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise _bad("json", schema, expected)
    return parsed


def canonical_schema(schema: Any) -> Any:
    """schema with every object's keys sorted, except the names under "properties" (their order
    is the output's) and JSON values under "enum", "const", "default", "examples"."""
    if isinstance(schema, list):
        return [canonical_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k in sorted(schema):
        v = schema[k]
        if k in DATA:
            out[k] = v
        elif k in ORDERED_MAPS and isinstance(v, dict):
            out[k] = {name: canonical_schema(s) for name, s in v.items()}
        elif k in SORTED_MAPS and isinstance(v, dict):
            out[k] = {name: canonical_schema(v[name]) for name in sorted(v)}
        else:
            out[k] = canonical_schema(v)
    return out
