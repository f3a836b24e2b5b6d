"""Structured output and forced tool calls (dsv41/grammar) against the real V4.1 tokenizer.

A seeded random-token driver walks each grammar: at every step it computes the mask, picks a random allowed token
(after a random number of free steps it prefers closing tokens so every walk ends), consumes it, and stops at EOS.
The decoded text must then satisfy the constraint checked independently (jsonschema, re.fullmatch, a DSML reader
checked against the reference parse vectors)."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import tokenizers
import torch

from dsv41 import BUILTIN_TOKENIZER_DIR
from dsv41.grammar import (
    GrammarError,
    allocate_bitmask,
    apply_mask,
    compile_request,
    fill_draft_masks,
    fill_masks,
    llg_tokenizer,
)

EOS, THINK_CLOSE, DSML = 1, 128822, 128825


@pytest.fixture(scope="module")
def hf():
    return tokenizers.Tokenizer.from_file(str(BUILTIN_TOKENIZER_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def lt(hf):
    return llg_tokenizer(hf)   # built once per process and cached


def enc(hf, text):
    return hf.encode(text, add_special_tokens=False).ids


def allowed_ids(bitmask, row=0):
    return np.flatnonzero(np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little"))


def closing_macros(hf):
    """Token runs the driver prefers once it wants to finish, most final first."""
    texts = ["</｜DSML｜ parameter>", "\n</｜DSML｜ invoke>", "\n</｜DSML｜ calls>", '"', "@", "}", "]"]
    return [[EOS], [THINK_CLOSE]] + [enc(hf, t) for t in texts]


def drive(spec, hf, seed, prefix=(), max_steps=3000, check_disallowed=True):
    """Random walk to EOS. Returns the ids after `prefix` (EOS excluded)."""
    rng = random.Random(seed)
    m = spec.matcher()
    assert m.consume_many(prefix)
    macros = closing_macros(hf)
    free = rng.randint(0, 48)
    bitmask = allocate_bitmask(1)
    out = []
    for step in range(max_steps):
        fill_masks([m], bitmask)
        allowed = allowed_ids(bitmask)
        assert len(allowed), "grammar dead-ended"
        run = None
        if step >= free and rng.random() < 0.8:   # not always: an email needs its "@" before the closing quote
            for mac in macros:
                if mac[0] in allowed and m.cut_draft(mac) == mac:
                    run = mac
                    break
        if run is None:
            run = [int(allowed[rng.randrange(len(allowed))])]
        if check_disallowed and step % 7 == 0:
            # The mask and the matcher agree: a token outside the mask is refused.
            bad = rng.randrange(129280)
            if bad not in set(allowed.tolist()):
                assert m.cut_draft([bad]) == []
        for tok in run:
            assert m.consume(tok), m.error
            if tok == EOS:
                assert m.is_stopped()
                return out
            out.append(tok)
    raise AssertionError(f"no EOS within {max_steps} steps: {hf.decode(out, skip_special_tokens=False)[-300:]!r}")


def text_of(hf, ids):
    return hf.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------------------
# A reader of the DSML calls format, written from serving.md §2.4 and checked against the reference parse vectors.

CALLS_OPEN, CALLS_CLOSE = "\n\n<｜DSML｜ calls>\n", "\n</｜DSML｜ calls>"
INVOKE_RE = re.compile(r'<｜DSML｜ invoke\s+name="([^"]*)">\n(.*?)</｜DSML｜ invoke>', re.DOTALL)
PARAM_RE = re.compile(r'<｜DSML｜ parameter name="([^"]*)" string="(true|false)">(.*?)</｜DSML｜ parameter>', re.DOTALL)


def read_calls(text, thinking=False):
    """[(name, arguments dict)] of the one calls block that ends `text` (after an optional EOS)."""
    text = text.removesuffix("<｜end▁of▁sentence｜>")
    if thinking:
        text = text.split("</think>", 1)[1]
    start = text.index(CALLS_OPEN)
    assert text.endswith(CALLS_CLOSE), text[-80:]
    body = text[start + len(CALLS_OPEN): -len(CALLS_CLOSE)]
    calls, pos = [], 0
    for inv in INVOKE_RE.finditer(body):
        assert body[pos:inv.start()] in ("", "\n"), body[pos:inv.start()]
        pos = inv.end()
        args = {}
        ppos = 0
        for p in PARAM_RE.finditer(inv.group(2)):
            assert inv.group(2)[ppos:p.start()] in ("", "\n")
            ppos = p.end()
            k, is_str, v = p.groups()
            args[k] = v if is_str == "true" else json.loads(v)
        assert inv.group(2)[ppos:].strip() == ""
        calls.append((inv.group(1), args))
    assert body[pos:] == ""
    return calls


def test_dsml_reader_matches_reference_vectors(shared):
    n = 0
    for line in (shared / "vectors" / "chat" / "parse.jsonl").read_text().splitlines():
        case = json.loads(line)
        exp = case["expected"]
        text = case["parse_call"]["text"]
        if not exp["ok"] or "DSML" not in text or "string=\"false\">five" in text:
            continue
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in exp["message"]["tool_calls"]]
        assert read_calls(text, case["parse_call"]["thinking_mode"] == "thinking") == want, case["id"]
        n += 1
    assert n >= 10


# ---------------------------------------------------------------------------------------------------------------
# 30 JSON schemas of real-world shape.

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
     "maximum": 150}, "email": {"type": "string", "format": "email"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
     "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"}}, "required": ["street", "city", "zip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
     "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
         "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1,
                                                                           "maximum": 99}},
         "required": ["sku", "qty"], "additionalProperties": False}}, "total": {"type": "number", "minimum": 0}},
     "required": ["order_id", "items", "total"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
     "updated_at": {"type": "string", "format": "date-time"}}, "required": ["status", "updated_at"]},
    {"type": "object", "properties": {"payment": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "card"}, "last4": {"type": "string",
                                                                            "pattern": "^[0-9]{4}$"}},
         "required": ["kind", "last4"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "bank"}, "iban": {"type": "string",
                                                                           "pattern": "^[A-Z]{2}[0-9]{10}$"}},
         "required": ["kind", "iban"], "additionalProperties": False}]}}, "required": ["payment"]},
    {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"}, "children": {
        "type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}, "required": ["value"],
        "additionalProperties": False}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                               "items": {"type": "string", "minLength": 1, "maxLength": 10}}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"first": {"type": "string"}, "middle": {"type": ["string", "null"]},
                                      "last": {"type": "string"}}, "required": ["first", "middle", "last"]},
    {"oneOf": [
        {"type": "object", "properties": {"event": {"const": "click"}, "x": {"type": "integer"},
                                          "y": {"type": "integer"}}, "required": ["event", "x", "y"],
         "additionalProperties": False},
        {"type": "object", "properties": {"event": {"const": "key"}, "code": {"type": "string", "maxLength": 8}},
         "required": ["event", "code"], "additionalProperties": False}]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                      "day": {"type": "string", "format": "date"}}, "required": ["id", "day"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                      "count": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}},
     "required": ["ratio", "count"]},
    {"type": "object", "properties": {"enabled": {"type": "boolean"}, "verbose": {"type": "boolean"},
                                      "retries": {"type": "integer", "minimum": 0, "maximum": 5}},
     "required": ["enabled"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "number"}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                      "start": {"type": "string", "format": "date-time"},
                                      "end": {"type": "string", "format": "date-time"},
                                      "attendees": {"type": "array", "maxItems": 3,
                                                    "items": {"type": "string", "format": "email"}}},
     "required": ["title", "start", "end"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number", "minimum": 0},
                                      "currency": {"enum": ["USD", "EUR", "JPY"]},
                                      "dimensions": {"type": "object", "properties": {
                                          "w": {"type": "number"}, "h": {"type": "number"}},
                                          "required": ["w", "h"], "additionalProperties": False}},
     "required": ["name", "price", "currency"]},
    {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "code": {"enum": [400, 401, 404, 500]}, "message": {"type": "string"}}, "required": ["code", "message"]}},
     "required": ["error"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"], "additionalProperties": False},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"version": {"const": "1.0"}, "data": {"type": "object"}},
     "required": ["version"]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"type": "object", "properties": {"host": {"type": "string", "format": "hostname"},
                                      "ip": {"type": "string", "format": "ipv4"},
                                      "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
     "required": ["ip", "port"]},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3,
                                               "pattern": "^[A-Z]+$"}}, "required": ["code"]},
    {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["id", "ok"],
        "additionalProperties": False}},
    {"type": "object", "properties": {"level": {"enum": [1, "high", None, True]}}, "required": ["level"]},
    {"type": "object", "properties": {"ingredients": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "amount": {"type": "number"},
                                         "unit": {"enum": ["g", "ml", "pcs"]}},
        "required": ["name", "amount", "unit"]}}, "steps": {"type": "array", "items": {"type": "string"},
                                                            "maxItems": 3}},
     "required": ["ingredients", "steps"]},
    {"$defs": {"user": {"type": "object", "properties": {"login": {"type": "string"}, "id": {"type": "integer"}},
                        "required": ["login", "id"]}},
     "type": "object", "properties": {"title": {"type": "string"}, "labels": {"type": "array", "maxItems": 3,
                                                                              "items": {"enum": ["bug", "docs"]}},
                                      "assignee": {"anyOf": [{"$ref": "#/$defs/user"}, {"type": "null"}]}},
     "required": ["title", "labels", "assignee"]},
    {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["label", "confidence"], "additionalProperties": False},
    {"definitions": {"money": {"type": "object", "properties": {"amount": {"type": "integer"},
                                                                 "currency": {"type": "string",
                                                                              "pattern": "^[A-Z]{3}$"}},
                               "required": ["amount", "currency"]}},
     "type": "object", "properties": {"subtotal": {"$ref": "#/definitions/money"},
                                      "tax": {"$ref": "#/definitions/money"}}, "required": ["subtotal", "tax"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "object", "properties": {"d": {"type": "array", "items": {"type": "integer"},
                                                     "maxItems": 2}}, "required": ["d"]}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"at": {"type": "string", "format": "time"},
                                      "note": {"type": ["string", "null"], "maxLength": 20}},
     "required": ["at"]},
]


def _leap_second_ok(checker):
    """RFC 3339 (the JSON Schema meaning of date-time/time) allows a leap second ":60", which llguidance produces
    and rfc3339-validator refuses; check the rest of the value as usual."""
    fc = jsonschema.FormatChecker()
    try:
        import rfc3339_validator  # noqa: F401
    except ImportError:
        # Without it jsonschema skips date-time and checks time with strptime, which refuses RFC 3339 fractions.
        fc.checks("time")(lambda value: True)
        return fc
    for fmt in ("date-time", "time"):
        inner = checker.checkers[fmt][0]

        def check(value, inner=inner):
            return inner(re.sub(r"^(.*?[Tt ]?[0-9]{2}:[0-9]{2}):60", r"\1:59", value) if isinstance(value, str)
                         else value)
        fc.checks(fmt)(check)
    return fc


def validator(schema):
    cls = jsonschema.validators.validator_for(schema)
    fc = cls.FORMAT_CHECKER
    fc.checkers.update(_leap_second_ok(fc).checkers)
    return cls(schema, format_checker=fc)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_random_walks_validate(i, hf, lt):
    schema = SCHEMAS[i]
    spec = compile_request({"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "s", "schema": schema, "strict": True}}},
                           hf, None, False)
    assert spec.kind == "json_schema"
    v = validator(schema)
    for seed in (i, 1000 + i):
        text = text_of(hf, drive(spec, hf, seed))
        v.validate(json.loads(text))


def test_json_object_and_aliases(hf, lt):
    for req in ({"response_format": {"type": "json_object"}},
                {"structured_outputs": {"json_object": True}}):
        spec = compile_request(req, hf, None, False)
        assert isinstance(json.loads(text_of(hf, drive(spec, hf, 3))), dict)
    schema = SCHEMAS[0]
    for req in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                {"structured_outputs": {"json": schema}}):
        spec = compile_request(req, hf, None, False)
        validator(schema).validate(json.loads(text_of(hf, drive(spec, hf, 4))))


def test_json_whitespace_is_bounded(hf, lt):
    spec = compile_request({"response_format": {"type": "json_object"}}, hf, None, False)
    m = spec.matcher()
    assert m.consume_many(enc(hf, '{"a":' + " " * 32))
    assert m.cut_draft(enc(hf, " 1}")) == []          # a 33rd blank is refused
    assert m.consume_many(enc(hf, "1}")) and m.is_accepting()


def test_guided_choice(hf, lt):
    choices = ["yes", "no", "maybe", "no way", "¿quizás?"]
    spec = compile_request({"guided_choice": choices}, hf, None, False)
    seen = set()
    for seed in range(12):
        text = text_of(hf, drive(spec, hf, seed))
        assert text in choices
        seen.add(text)
    assert len(seen) >= 2
    spec = compile_request({"structured_outputs": {"choice": ["a", "ab"]}}, hf, None, False)
    m = spec.matcher()
    assert m.consume_many(enc(hf, "a")) and m.is_accepting() and not m.is_stopped()


@pytest.mark.parametrize("regex", [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}",
                                   r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)", r"-?[0-9]+(\.[0-9]{1,2})?"])
def test_guided_regex(regex, hf, lt):
    spec = compile_request({"guided_regex": regex}, hf, None, False)
    for seed in range(3):
        text = text_of(hf, drive(spec, hf, seed))
        assert re.fullmatch(regex, text), (regex, text)


def test_guided_grammar_lark_and_gbnf(hf, lt):
    lark = 'start: expr\nexpr: NUM | expr OP expr | "(" expr ")"\nNUM: /[1-9][0-9]{0,2}/\nOP: "+" | "*"\n'
    spec = compile_request({"guided_grammar": lark}, hf, None, False)
    for seed in range(4):
        text = text_of(hf, drive(spec, hf, seed))
        assert re.fullmatch(r"[0-9+*()]+", text), text
        eval(text)  # balanced arithmetic
    gbnf = 'root ::= "x" [0-9] [0-9]?'
    spec = compile_request({"guided_grammar": gbnf}, hf, None, False)
    assert re.fullmatch(r"x[0-9]{1,2}", text_of(hf, drive(spec, hf, 1)))


# ---------------------------------------------------------------------------------------------------------------
# Thinking: free reasoning, then </think>, then the constraint.

def test_thinking_lets_reasoning_through_then_constrains(hf, lt):
    schema = SCHEMAS[26]
    spec = compile_request({"response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                                       "schema": schema}}},
                           hf, None, True)
    reasoning = enc(hf, "The user wants a sentiment label.\n\nIt's {not} JSON yet: \"x\" ]} <b>bold</b> ｜DSML｜ 42")
    assert DSML in reasoning
    m = spec.matcher()
    assert m.in_reasoning()
    bitmask = allocate_bitmask(1)
    for t in reasoning:
        fill_masks([m], bitmask)
        allowed = set(allowed_ids(bitmask).tolist())
        assert t in allowed and EOS not in allowed and THINK_CLOSE in allowed
        assert 128803 not in allowed   # <｜User｜>: no chat markup inside a constrained reply
        assert m.consume(t)
    assert not m.is_accepting()
    assert m.consume(THINK_CLOSE) and not m.in_reasoning()
    fill_masks([m], bitmask)
    allowed = set(allowed_ids(bitmask).tolist())
    assert EOS not in allowed and THINK_CLOSE not in allowed and enc(hf, "{")[0] in allowed
    assert enc(hf, "The")[0] not in allowed
    # And random walks through the whole thing: reasoning, </think>, a valid answer.
    for seed in range(3):
        ids = drive(spec, hf, seed)
        assert THINK_CLOSE in ids
        answer = ids[ids.index(THINK_CLOSE) + 1:]
        validator(schema).validate(json.loads(text_of(hf, answer)))
    # Rolling back across </think> reopens the reasoning.
    m.rollback(1)
    assert m.in_reasoning()


def test_thinking_regex_and_eos_only_when_complete(hf, lt):
    spec = compile_request({"guided_regex": "[0-9]{2}"}, hf, None, True)
    m = spec.matcher()
    assert m.cut_draft([EOS]) == []
    assert m.consume_many(enc(hf, "hmm") + [THINK_CLOSE] + enc(hf, "4"))
    assert m.cut_draft([EOS]) == [] and not m.is_accepting()
    assert m.consume_many(enc(hf, "2")) and m.is_accepting() and m.is_stopped()
    assert m.consume(EOS)


# ---------------------------------------------------------------------------------------------------------------
# Forced tool calls.

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "web_search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "minLength": 1},
                                         "top_k": {"type": "integer", "minimum": 1, "maximum": 10},
                                         "safe": {"type": "boolean"}},
        "required": ["query", "top_k"]}}},
    {"type": "function", "function": {"name": "create_order", "parameters": {
        "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                           "required": ["sku", "qty"], "additionalProperties": False}},
        "type": "object", "properties": {
            "customer": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
                "type": "array", "items": {"type": "string"}, "maxItems": 2}}, "required": ["id"]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
            "priority": {"type": ["string", "null"]},
            "note": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
        "required": ["customer", "items"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _tool_schema(name):
    fn = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    return fn.get("parameters") or {"type": "object"}


def test_forced_tool_matches_reference_vector_ids(shared, hf, lt):
    # The tools the vectors call, as an application would declare them.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "web_search", "parameters": {
                "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"},
                                                 "safe": {"type": "boolean"}}}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                  "properties": {}}}}]
    spec = compile_request({"tool_choice": "required"}, hf, tools, False)
    cases = {json.loads(line)["id"]: json.loads(line)
             for line in (shared / "vectors" / "chat" / "parse.jsonl").read_text().splitlines()}
    for cid in ("parse_call_single", "parse_call_string_false_number", "parse_call_no_params",
                "parse_call_string_multiline", "parse_call_value_with_close_tag_prefix",
                "parse_call_string_true_numberlike"):
        ids = cases[cid]["expected"]["text_token_ids"]
        m = spec.matcher()
        assert m.consume_many(ids), (cid, m.error)
        assert m.is_stopped()
    # Text between invokes and the unoffered tool are refused.
    for cid in ("parse_call_text_between_invokes", "parse_call_not_offered", "parse_call_string_false_invalid_json",
                "parse_call_no_params_compact"):
        m = spec.matcher()
        assert not m.consume_many(cases[cid]["expected"]["text_token_ids"])
        assert m.is_error() and m.is_stopped()
    # Thinking mode: reasoning, </think>, then the block.
    spec_t = compile_request({"tool_choice": "required"}, hf, tools, True)
    m = spec_t.matcher()
    assert m.consume_many(cases["parse_call_thinking_no_eos"]["expected"]["text_token_ids"] + [EOS])


def test_string_or_null_parameter_takes_either_form(hf, lt):
    spec = compile_request({"tool_choice": {"type": "function", "function": {"name": "create_order"}}}, hf, TOOLS,
                           False)
    head = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="create_order">\n'
            '<｜DSML｜ parameter name="customer" string="false">{"id": 7}</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="items" string="false">[{"sku": "A", "qty": 2}]</｜DSML｜ parameter>\n')
    tail = '\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    for prio, want in (('<｜DSML｜ parameter name="priority" string="true">high</｜DSML｜ parameter>', "high"),
                       ('<｜DSML｜ parameter name="priority" string="false">null</｜DSML｜ parameter>', None)):
        text = head + prio + tail
        m = spec.matcher()
        assert m.consume_many(enc(hf, text) + [EOS]), m.error
        assert read_calls(text)[0][1]["priority"] == want
    m = spec.matcher()   # a required parameter missing, or the schema's order broken: refused
    assert not m.consume_many(enc(hf, head.replace('{"id": 7}', '{"tags": []}')))


def test_forced_dsml_is_token_exact(hf, lt):
    spec = compile_request({"tool_choice": "required"}, hf, TOOLS, False)
    m = spec.matcher()
    bitmask = allocate_bitmask(1)
    assert m.consume_many(enc(hf, "\n\n<"))
    fill_masks([m], bitmask)
    assert allowed_ids(bitmask).tolist() == [DSML]   # never the byte pieces of ｜DSML｜


@pytest.mark.parametrize("name", ["get_weather", "web_search", "create_order", "get_time"])
def test_named_tool_call_random_walks(name, hf, lt):
    spec = compile_request({"tool_choice": {"type": "function", "function": {"name": name}}}, hf, TOOLS, False)
    assert spec.tool_names == (name,) and spec.max_calls == 1
    for seed in range(3):
        ids = drive(spec, hf, seed)
        assert ids.count(DSML) >= 4 and ids[:3] == enc(hf, "\n\n<") + [DSML]
        calls = read_calls(text_of(hf, ids))
        assert len(calls) == 1 and calls[0][0] == name
        jsonschema.validate(calls[0][1], _tool_schema(name))


def test_required_chooses_among_tools_and_may_call_several(hf, lt):
    spec = compile_request({"tool_choice": "required"}, hf, TOOLS, True)
    names = set()
    for seed in range(10):
        ids = drive(spec, hf, seed)
        calls = read_calls(text_of(hf, ids), thinking=True)
        for name, args in calls:
            names.add(name)
            jsonschema.validate(args, _tool_schema(name))
    assert len(names) >= 3
    two = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_time">\n\n</｜DSML｜ invoke>\n'
           '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Oslo</｜DSML｜ parameter>'
           '\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert read_calls(two) == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    m = compile_request({"tool_choice": "required"}, hf, TOOLS, False).matcher()
    assert m.consume_many(enc(hf, two) + [EOS])
    one = compile_request({"tool_choice": "required", "parallel_tool_calls": False}, hf, TOOLS, False)
    m = one.matcher()
    assert not m.consume_many(enc(hf, two))   # parallel_tool_calls false: one call only
    for seed in range(3):
        assert len(read_calls(text_of(hf, drive(one, hf, seed)))) == 1


def test_auto_tools_with_response_format_allows_answer_or_calls(hf, lt):
    spec = compile_request({"tool_choice": "auto", "response_format": {"type": "json_object"}}, hf, TOOLS[:1],
                           False)
    m = spec.matcher()
    assert m.consume_many(enc(hf, '{"a": 1}')) and m.is_accepting()
    m = spec.matcher()
    block = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" '
             'string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert m.consume_many(enc(hf, block)) and m.is_accepting()
    assert compile_request({"tool_choice": "auto"}, hf, TOOLS, False) is None


# ---------------------------------------------------------------------------------------------------------------
# Matcher mechanics: rollback, drafts, batches, masks.

def _masks_along(spec, ids):
    m = spec.matcher()
    bm = allocate_bitmask(1)
    out = []
    for t in ids:
        fill_masks([m], bm)
        out.append(bm.clone())
        assert m.consume(t)
    return m, out


def test_rollback_then_reconsume_gives_same_masks(hf, lt):
    spec = compile_request({"tool_choice": "required"}, hf, TOOLS, True)
    ids = drive(spec, hf, 7) + [EOS]
    m, masks = _masks_along(spec, ids)
    bm = allocate_bitmask(1)
    rng = random.Random(0)
    for _ in range(6):
        n = rng.randint(1, min(25, len(ids)))
        m.rollback(n)
        assert len(m) == len(ids) - n
        for j in range(len(ids) - n, len(ids)):
            fill_masks([m], bm)
            assert torch.equal(bm, masks[j]), j
            assert m.consume(ids[j])
        assert m.is_stopped()
    # EOS taken by a stopped matcher: rolling back 1 must remove only the EOS (llguidance's counting trap).
    m.rollback(1)
    fill_masks([m], bm)
    assert allowed_ids(bm).tolist() == [EOS]
    with pytest.raises(ValueError):
        m.rollback(len(ids) + 1)


def test_rollback_eos_when_accepting_but_not_stopped(hf, lt):
    spec = compile_request({"guided_regex": "ab(c)?"}, hf, None, False)
    m = spec.matcher()
    assert m.consume_many(enc(hf, "ab")) and m.is_accepting() and not m.is_stopped()
    assert m.consume(EOS)
    m.rollback(1)
    assert m.is_accepting() and m.cut_draft(enc(hf, "c")) == enc(hf, "c")


def test_draft_masks_equal_serial_masks(hf, lt):
    spec = compile_request({"tool_choice": "required"}, hf, TOOLS, True)
    ids = drive(spec, hf, 11) + [EOS]
    _, masks = _masks_along(spec, ids)
    rng = random.Random(1)
    for _ in range(8):
        p = rng.randrange(len(ids))
        k = rng.randint(0, 5)
        draft = ids[p:p + k]
        m = spec.matcher()
        assert m.consume_many(ids[:p])
        bm = allocate_bitmask(8)
        fill_draft_masks([(m, 1, draft)], bm)
        for j in range(len(draft) + 1):
            if p + j < len(ids):
                assert torch.equal(bm[1 + j], masks[p + j][0]), (p, j)
            else:   # after EOS: never sampled, EOS-only
                assert allowed_ids(bm, 1 + j).tolist() == [EOS]
        assert len(m) == p                     # the matcher did not move
        one = allocate_bitmask(1)
        m.fill_mask(one)
        assert torch.equal(one[0], masks[p][0])
    with pytest.raises(ValueError):
        choice = compile_request({"guided_choice": ["yes"]}, hf, None, False)
        fill_draft_masks([(choice.matcher(), 0, enc(hf, "no"))], allocate_bitmask(8))   # illegal draft


def test_cut_draft_is_longest_legal_prefix(hf, lt):
    spec = compile_request({"guided_choice": ["hello world", "help"]}, hf, None, False)
    m = spec.matcher()
    good = enc(hf, "hello world")
    assert m.cut_draft(good + [EOS, 5, 6]) == good + [EOS]
    assert m.cut_draft(enc(hf, "hello") + enc(hf, " there")) == enc(hf, "hello")
    assert len(m) == 0   # cutting does not consume


def test_batch_fill_equals_single_and_none_rows_allow_all(hf, lt):
    specs = [compile_request({"guided_regex": "[0-9]+"}, hf, None, False),
             compile_request({"tool_choice": "required"}, hf, TOOLS, False),
             compile_request({"response_format": {"type": "json_object"}}, hf, None, True)]
    ms = [s.matcher() for s in specs]
    ms[1].consume_many(enc(hf, "\n\n<") + [DSML])
    ms[2].consume_many(enc(hf, "ok") + [THINK_CLOSE] + enc(hf, '{"k'))
    rows = [ms[0], None, ms[1], ms[2]]
    batch = allocate_bitmask(4)
    batch.zero_()
    fill_masks(rows, batch)
    one = allocate_bitmask(1)
    for i, m in enumerate(rows):
        if m is None:
            assert (batch[i] == -1).all()
        else:
            m.fill_mask(one)
            assert torch.equal(batch[i], one[0])


def test_padded_vocabulary_bitmask(hf, lt):
    spec = compile_request({"guided_choice": ["yes", "no"]}, hf, None, False)
    wide = allocate_bitmask(2, 129280 + 320)          # logits padded past the tokenizer
    exact = allocate_bitmask(1)
    fill_masks([spec.matcher(), None], wide)
    spec.matcher().fill_mask(exact)
    assert torch.equal(wide[0, :4040], exact[0]) and (wide[0, 4040:] == 0).all() and (wide[1] == -1).all()
    logits = torch.zeros(2, 129280 + 320)
    apply_mask(logits, wide)
    assert torch.isinf(logits[0, 129280:]).all() and torch.isfinite(logits[1]).all()


def test_apply_mask(hf, lt):
    spec = compile_request({"guided_choice": ["yes", "no"]}, hf, None, False)
    m = spec.matcher()
    bm = allocate_bitmask(2)
    fill_masks([m, None], bm)
    logits = torch.randn(2, 129280)
    before = logits.clone()
    apply_mask(logits, bm)
    ok = set(allowed_ids(bm).tolist())
    finite = set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())
    assert finite == ok and ok
    assert torch.equal(logits[1], before[1])
    assert torch.equal(logits[0][sorted(ok)], before[0][sorted(ok)])
    wide = torch.zeros(1, 129280 + 64)   # padded vocabulary: the pad columns are never allowed
    apply_mask(wide, bm[:1])
    assert torch.isinf(wide[0, 129280:]).all()
    # Once complete only EOS remains; after an illegal token the row is EOS-only and the matcher reports why.
    assert m.consume_many(enc(hf, "yes"))
    fill_masks([m], bm[:1])
    assert allowed_ids(bm).tolist() == [EOS]
    m2 = spec.matcher()
    assert not m2.consume(enc(hf, "maybe")[0])
    assert m2.is_error() and m2.error
    fill_masks([m2], bm[:1])
    assert allowed_ids(bm).tolist() == [EOS]


@pytest.mark.gpu
def test_apply_mask_gpu_equals_cpu(hf, lt):
    spec = compile_request({"response_format": {"type": "json_object"}}, hf, None, False)
    bm = allocate_bitmask(3)
    fill_masks([spec.matcher(), None, spec.matcher()], bm)
    logits = torch.randn(3, 129280)
    gpu = logits.cuda()
    apply_mask(logits, bm)
    apply_mask(gpu, bm)
    assert torch.equal(gpu.cpu(), logits)


# ---------------------------------------------------------------------------------------------------------------
# Bad input -> GrammarError (HTTP 400).

BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),              # unsupported keyword
    ({"guided_json": {"type": "string", "format": "no-such-format"}}, "guided_json"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),                                           # no tools
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required", "tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "tools": TOOLS,
      "guided_regex": "a"}, "guided_regex"),
]


@pytest.mark.parametrize("req,param", BAD)
def test_bad_input_raises_grammar_error(req, param, hf, lt):
    with pytest.raises(GrammarError) as e:
        compile_request(req, hf, None, False)
    assert e.value.param == param and str(e.value)


def test_compiled_specs_are_reused(hf, lt):
    req = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[2]}}}
    a = compile_request(req, hf, None, False)
    assert compile_request(json.loads(json.dumps(req)), hf, None, False) is a
    assert compile_request(req, hf, None, True) is not a          # thinking changes the grammar
    m1, m2 = a.matcher(), a.matcher()
    assert m1.consume_many(enc(hf, '{"order_id"'))
    assert len(m2) == 0 and m2.cut_draft(enc(hf, "{")) == enc(hf, "{")   # matchers are independent copies


def test_lenient_when_strict_false_and_none_when_unconstrained(hf, lt):
    schema = {"type": "array", "uniqueItems": True, "items": {"type": "integer"}, "maxItems": 3}
    spec = compile_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": False}}}, hf, None, False)
    assert isinstance(json.loads(text_of(hf, drive(spec, hf, 0))), list)
    for req in ({}, {"response_format": {"type": "text"}}, {"tool_choice": "auto", "tools": TOOLS},
                {"tool_choice": "none", "tools": TOOLS}, {"tool_choice": {"type": "auto"}, "tools": TOOLS}):
        assert compile_request(req, hf, None, False) is None
    named = compile_request({"tool_choice": {"type": "function", "function": {"name": "GET_WEATHER"}}}, hf, TOOLS,
                            False)
    assert named.tool_names == ("get_weather",)   # names match offers case-insensitively; the offer's spelling
    for tc in ({"type": "function", "name": "web_search"}, {"type": "tool", "name": "web_search"}):   # Responses,
        assert compile_request({"tool_choice": tc}, hf, TOOLS, False).tool_names == ("web_search",)  # Anthropic
    anyc = compile_request({"tool_choice": {"type": "any"}}, hf, TOOLS, False)
    assert anyc.kind == "tool_call" and len(anyc.tool_names) == len(TOOLS)


def test_tokenizer_from_chat_tokenizer_is_shared(hf, lt):
    from dsv41.chat.tokenizer import Tokenizer
    chat_tok = Tokenizer.from_dir()
    assert llg_tokenizer(chat_tok) is lt          # same tokenizer.json -> the one cached build
    assert llg_tokenizer(chat_tok) is lt and llg_tokenizer(lt) is lt
    assert lt.vocab_size == 129280 and lt.eos_token == EOS and lt.is_special_token(DSML)
    spec = compile_request({"guided_choice": ["x"]}, chat_tok, None, False)
    assert spec.tokenizer is lt
