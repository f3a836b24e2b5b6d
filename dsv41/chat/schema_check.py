"""A structural check of a JSON Schema (a tool's `parameters`): what OpenAI answers 400 to, caught before the schema
reaches the prompt or a grammar. It checks the shape of the keywords a tool schema uses (types, properties,
required, items, enum, the combinators, $defs), recursively; it does not check a value against the schema."""
from __future__ import annotations

from typing import Any

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_DEPTH = 64


def schema_problem(schema: Any, where: str, depth: int = 0) -> str | None:
    """None for a well-formed schema, else what is wrong and where (`where` names the schema's place)."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} must be a JSON Schema object, got {type(schema).__name__}"
    if depth > MAX_DEPTH:
        return f"{where} nests deeper than {MAX_DEPTH} levels"
    t = schema.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        bad = [x for x in ts if not isinstance(x, str) or x not in TYPES]
        if bad or not ts:
            return f"{where}.type must be one of {', '.join(TYPES)} (or a list of them), got {t!r}"
    for k in _SUBSCHEMA:
        if k in schema:
            v = schema[k]
            if k == "items" and isinstance(v, list):           # draft-4 tuple form
                for i, s in enumerate(v):
                    if (p := schema_problem(s, f"{where}.items[{i}]", depth + 1)) is not None:
                        return p
                continue
            if (p := schema_problem(v, f"{where}.{k}", depth + 1)) is not None:
                return p
    for k in _SCHEMA_LISTS:
        if k in schema:
            v = schema[k]
            if not isinstance(v, list) or (not v and k != "prefixItems"):
                return f"{where}.{k} must be a non-empty list of schemas"
            for i, s in enumerate(v):
                if (p := schema_problem(s, f"{where}.{k}[{i}]", depth + 1)) is not None:
                    return p
    for k in _SCHEMA_MAPS:
        if k in schema:
            v = schema[k]
            if not isinstance(v, dict):
                return f"{where}.{k} must be an object mapping names to schemas"
            for name, s in v.items():
                if (p := schema_problem(s, f"{where}.{k}.{name}", depth + 1)) is not None:
                    return p
    if "required" in schema:
        r = schema["required"]
        if not isinstance(r, list) or not all(isinstance(x, str) for x in r):
            return f"{where}.required must be a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}.enum must be a list"
    for k in _COUNTS:
        v = schema.get(k)
        if k in schema and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"{where}.{k} must be a non-negative integer"
    for k in _NUMBERS:
        v = schema.get(k)
        if k in schema and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            return f"{where}.{k} must be a number"
    if "pattern" in schema and not isinstance(schema["pattern"], str):
        return f"{where}.pattern must be a string"
    if "$ref" in schema and not isinstance(schema["$ref"], str):
        return f"{where}.$ref must be a string"
    return None
