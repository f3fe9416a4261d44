"""A JSON schema made ready for outlines-core, or refused where its regex would break it.

outlines-core turns a schema into one regex, and some of what a schema says does not reach it:
keywords it accepts and ignores (UNENFORCED), `allOf`'s schemas joined end to end
(`{"a": 1}{"b": true}`), `oneOf` read as `anyOf`, `required` names missing from `properties`
dropped, `type` ignored beside `enum` or `const`, an empty `enum` inside a property printed as an
empty value (`{"e": }`), and of a string's `pattern`, `format` and `minLength`/`maxLength` only one
kept. Those are a ValueError here, with what to write instead. What it reads but prints wrong is
rewritten before it sees it: the string formats become patterns of our own (its `time` wanted a
backslash before the fraction, its `date` any Unicode digit and any day to 31 in any month, its
`email` and `uri` let a quote end the JSON string), and every string pattern is printed again so
that nothing it matches ends or escapes the JSON string (engine/regex_text.py).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterator

from .regex_text import for_outlines

# Keywords outlines-core accepts and does not enforce in the regex it builds.
UNENFORCED = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
    "contains", "minContains", "maxContains", "maxProperties", "propertyNames", "dependentRequired",
    "dependentSchemas", "dependencies", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties",
})
_ATOM = r"[a-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?"
# A day that exists: the month's own length, 29 February in leap years alone (every fourth
# year, of the centuries every fourth), as `date.fromisoformat` (jsonschema's date check) reads it
# (but for the year 0000, which RFC 3339 allows and Python's dates lack).
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)"
_DATE = (r"([0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         rf"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
# Each a subset of what outlines-core's own format allows; what a JSON string cannot hold as it
# is goes when the pattern is printed again (engine/regex_text.py).
FORMATS = {
    "date": _DATE,
    "time": r"(2[0-3]|[01][0-9]):[0-5][0-9]:[0-5][0-9](Z)?",
    "date-time": rf"{_DATE}T(2[0-3]|[01][0-9]):([0-5][0-9]):([0-5][0-9])(\.[0-9]{{3}})?(Z)?",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "email": rf"{_ATOM}(\.{_ATOM})*@({_LABEL}\.)+{_LABEL}",
    "uri": r"(https?|ftp)://([a-zA-Z0-9.-]+\.[a-zA-Z]{2,}|localhost)(:[0-9]+)?(/[^\s?#]*)?(\?[^\s#]*)?(#\S*)?",
}
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "not")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_TYPES = {"null": (type(None),), "boolean": (bool,), "object": (dict,), "array": (list,), "string": (str,)}


MAX_DEPTH = 127  # objects and arrays inside each other: outlines-core's JSON reader takes no more
# Array schemas inside each other: outlines-core's regex doubles with each (the items written twice,
# `[item(,item)*]`): 12 give 200 kB and an automaton past MAX_STATES, said in ~4 s; 100 had taken
# the process's memory until it was killed, building the regex.
MAX_ARRAY_DEPTH = 12


def check_depth(schema: Any) -> None:
    """A ValueError where the schema nests deeper than outlines-core reads: it had said "Expected
    a valid JSON string." of a valid schema; or holds arrays inside arrays past MAX_ARRAY_DEPTH.
    Counted without recursion, since Python's own (a deepcopy, a generator of subschemas)
    overflows a few hundred levels down."""
    stack = [(schema, 1, 0)]
    while stack:
        node, level, arrays = stack.pop()
        if isinstance(node, (dict, list)):
            if level > MAX_DEPTH:
                raise ValueError(f"it is nested too deep (objects and arrays inside each other, over {MAX_DEPTH} "
                                 "levels: more than outlines-core reads)")
            if isinstance(node, dict) and ("items" in node or "prefixItems" in node or node.get("type") == "array"):
                arrays += 1
                if arrays > MAX_ARRAY_DEPTH:
                    raise ValueError(f"it is nested too deep (arrays inside arrays, over {MAX_ARRAY_DEPTH} levels: "
                                     "the regex outlines-core builds doubles with each)")
            stack.extend((child, level + 1, arrays)
                         for child in (node.values() if isinstance(node, dict) else node))


def prepare(schema: Any) -> str:
    """The schema (parsed JSON) as the text outlines-core compiles; a ValueError says why it
    cannot be, in one line."""
    schema = copy.deepcopy(schema)
    for node in subschemas(schema):
        _check(node)
        types = node.get("type", "string")  # a pattern or format with no type is a string's
        if "string" in (types if isinstance(types, list) else [types]):  # not {"type": "integer", "format": "int32"}
            _string(node)
    return json.dumps(schema)


def unenforced(schema: Any) -> str | None:
    """The first keyword of UNENFORCED in a schema or its subschemas (not in property names,
    enum or const values), or None."""
    return next((k for node in subschemas(schema) for k in node if k in UNENFORCED), None)


def subschemas(node: Any) -> Iterator[dict]:
    """The schema's objects, itself first: every place a schema can stand, not enum or const values."""
    if isinstance(node, list):  # tuple-style items
        for item in node:
            yield from subschemas(item)
        return
    if not isinstance(node, dict):
        return
    yield node
    for key in _SUBSCHEMA + _SUBSCHEMA_LISTS:
        yield from subschemas(node.get(key))
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for child in node[key].values():
                yield from subschemas(child)


def _check(node: dict) -> None:
    for key in ("enum", "anyOf", "oneOf", "allOf", "type"):
        if isinstance(node.get(key), list) and not node[key]:
            raise ValueError(f"an empty {key!r}: no JSON value is valid against it")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ValueError("'allOf' with several schemas is not supported (outlines-core joins them one after "
                         "the other): merge them into one schema")
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 and not _disjoint(node["oneOf"]):
        raise ValueError("'oneOf' whose schemas a value can meet at once is not supported (it would be read as "
                         "anyOf): use 'anyOf', or give each schema its own type or values")
    required = node.get("required")
    if isinstance(required, list):
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in required if name not in properties]
        if missing:
            raise ValueError(f"'required' names {missing[0]!r}, which 'properties' does not define: "
                             "give it a schema there")
    values = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
    types = node.get("type")
    if values is not None and types is not None:
        types = types if isinstance(types, list) else [types]
        wrong = next((v for v in values if not any(_is(v, t) for t in types)), _NONE)
        if wrong is not _NONE:
            raise ValueError(f"the value {json.dumps(wrong)} is not of the type {node['type']!r} beside it "
                             "(only the values are enforced)")


def _string(node: dict) -> None:
    said = [k for k in ("pattern", "format") if k in node] + (["minLength/maxLength"] if {"minLength", "maxLength"}
                                                               & set(node) else [])
    if len(said) > 1:
        raise ValueError(f"a string's {said[0]!r} and {said[1]!r} together are not supported (only one would be "
                         "enforced): say it all in a 'pattern' (a length as {m,n})")
    if ("format" in node or "pattern" in node) and "type" not in node:
        node["type"] = "string"  # outlines-core reads a bare {"pattern": ...} as no schema at all
    if "format" in node:
        fmt = node.pop("format")
        if fmt not in FORMATS:
            raise ValueError(f"the string format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
        node["pattern"] = FORMATS[fmt]
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        try:
            node["pattern"] = for_outlines(pattern, json_string=True)
        except ValueError as e:
            raise ValueError(f"the string pattern {pattern!r}: {e}") from None


_NONE = object()


def _is(value: Any, json_type: Any) -> bool:
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(json_type, ()))


def _kinds(schema: Any) -> set[str] | None:
    """The JSON types a schema's values can have (integer and number as one), None if unknown."""
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("enum"), list) or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return {next((t for t in ("null", "boolean", "string", "object", "array") if _is(v, t)), "number")
                for v in values}
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list):
        return None
    return {"number" if t == "integer" else t for t in types}


def _disjoint(schemas: list) -> bool:
    """Whether no value can meet two of the schemas, told by their types or their listed values."""
    listed = [s.get("enum") if isinstance(s, dict) and isinstance(s.get("enum"), list) else
              [s["const"]] if isinstance(s, dict) and "const" in s else None for s in schemas]
    if all(v is not None for v in listed):
        seen: list = []
        for values in listed:
            for v in values:
                if any(v == w and type(v) is type(w) or _same_number(v, w) for w in seen):
                    return False
            seen += values
        return True
    kinds = [_kinds(s) for s in schemas]
    if any(k is None for k in kinds):
        return False
    return all(not (a & b) for i, a in enumerate(kinds) for b in kinds[i + 1:])


def _same_number(a: Any, b: Any) -> bool:
    numbers = (int, float)
    return (isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and
            not isinstance(b, bool) and a == b)
