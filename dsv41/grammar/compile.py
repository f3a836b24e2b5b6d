"""Request -> llguidance grammar: JSON schema, regex, choice, Lark, or a forced DSML tool call.

One entry point, `compile_request`, reads every structured-output field a chat request can carry, checks that they do
not conflict, and returns a `GrammarSpec` (or None when the reply is unconstrained). The spec holds one compiled
matcher; `spec.matcher()` hands each sequence a cheap copy of it.

Grammar shape (serving.md §1.3, §2.4, §8):
- thinking on: `reasoning </think> answer`; reasoning is free text (plus the DSML token), EOS is not allowed in it;
- the answer is the constraint itself: JSON, regex, choice, a client Lark grammar, or the DSML calls block;
- with tools offered, `tool_choice` "auto" and a structured-output constraint, the answer is the constraint *or* a
  calls block (so agents can still call tools);
- EOS is allowed only where the whole grammar accepts (llguidance sets the EOS bit itself).

DSML is written token-exact: `｜DSML｜` (id 128825) is one token in the model's output, so the grammar names it as a
token (`<[128825]>`) and the llguidance tokenizer marks it special, which keeps it out of every free-text lexeme
(JSON strings, regexes, raw parameter values). The model's own ids are then the only way to spell the markup.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

from dsv41 import BUILTIN_TOKENIZER_DIR

THINK_CLOSE_TEXT = "</think>"   # id 128822 in the V4.1 tokenizer
DSML_TEXT = "｜DSML｜"            # id 128825

# Whitespace between JSON tokens: flexible but bounded, so a constrained reply cannot spin on blanks forever
# (upstream semantics: at most 32 blanks between JSON tokens).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"

STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")


class GrammarError(ValueError):
    """A request's structured-output or tool_choice fields cannot be served; the server answers 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


# ---------------------------------------------------------------------------------------------------------------
# llguidance tokenizer: built once per tokenizer.json text, per process (~1 s).

@dataclass(frozen=True)
class Vocab:
    """An llguidance tokenizer and the ids the grammars name (looked up by text, so any tokenizer.json works)."""

    lt: llg.LLTokenizer
    eos: int
    think_close: int | None     # </think>
    dsml: int | None            # ｜DSML｜

    @property
    def words(self) -> int:
        """int32 words in one bitmask row."""
        return (self.lt.vocab_size + 31) // 32


_TOK_LOCK = threading.Lock()
_TOK_BY_SHA: dict[str, Vocab] = {}
_TOK_BY_OBJ: dict[int, tuple[Any, Vocab]] = {}
_BY_LT: dict[int, Vocab] = {}


def _tokenizer_json_text(tok: Any) -> str:
    """The tokenizer.json text behind `tok` (None = the bundled V4.1 tokenizer)."""
    import tokenizers

    if tok is None:
        return (BUILTIN_TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8")
    if isinstance(tok, (str, Path)):
        p = Path(tok)
        if p.is_dir():
            p = p / "tokenizer.json"
        return p.read_text(encoding="utf-8")
    if isinstance(tok, tokenizers.Tokenizer):
        return tok.to_str()
    # The chat part's Tokenizer wraps a `tokenizers.Tokenizer`; take it from the usual attribute names.
    for name in ("full", "hf", "tokenizer", "backend", "_tokenizer", "_tok", "_hf"):
        inner = getattr(tok, name, None)
        if isinstance(inner, tokenizers.Tokenizer):
            return inner.to_str()
    for name in ("json_path", "path", "dir"):
        p = getattr(tok, name, None)
        if isinstance(p, (str, Path)):
            return _tokenizer_json_text(p)
    raise TypeError(f"cannot find a tokenizers.Tokenizer or tokenizer.json behind {type(tok).__name__}")


def vocab_for(tok: Any = None) -> Vocab:
    """The llguidance tokenizer (+ the ids grammars name) for `tok`: a tokenizers.Tokenizer, the chat Tokenizer, a
    path, an LLTokenizer built here, or None for kit/tokenizer. Built once per tokenizer.json text per process (~1 s).
    `｜DSML｜` is marked special so that no free-text lexeme (JSON string, regex, raw value) can contain it."""
    if isinstance(tok, llg.LLTokenizer):
        with _TOK_LOCK:
            v = _BY_LT.get(id(tok))
        if v is None:
            raise ValueError("an LLTokenizer not built by dsv41.grammar.llg_tokenizer")
        return v
    with _TOK_LOCK:
        hit = _TOK_BY_OBJ.get(id(tok))
        if hit is not None and hit[0] is tok:
            return hit[1]
    text = _tokenizer_json_text(tok)
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    with _TOK_LOCK:
        v = _TOK_BY_SHA.get(sha)
    if v is None:
        spec = json.loads(text)
        ids = {}
        for added in spec.get("added_tokens", []):
            ids[added.get("content")] = added.get("id")
            if added.get("content") == DSML_TEXT:
                added["special"] = True
        lt = llg.LLTokenizer(json.dumps(spec, ensure_ascii=False))
        v = Vocab(lt, lt.eos_token, ids.get(THINK_CLOSE_TEXT), ids.get(DSML_TEXT))
        with _TOK_LOCK:
            v = _TOK_BY_SHA.setdefault(sha, v)
            _BY_LT[id(v.lt)] = v
    with _TOK_LOCK:
        _TOK_BY_OBJ[id(tok)] = (tok, v)
    return v


def llg_tokenizer(tok: Any = None) -> llg.LLTokenizer:
    """The cached llguidance tokenizer for `tok` (see `vocab_for`)."""
    return vocab_for(tok).lt


# ---------------------------------------------------------------------------------------------------------------
# The compiled spec.

def _limits() -> llg.LLParserLimits:
    # Runtime errors must not echo the client's grammar into logs or error events.
    return llg.LLParserLimits(verbose_errors=False)


@dataclass
class GrammarSpec:
    """A compiled constraint for one request. `matcher()` gives each sequence its own state."""

    kind: str                       # json_object | json_schema | regex | choice | grammar | tool_call
    grammar: str                    # the llguidance grammar (Lark text or its JSON form)
    thinking: bool
    vocab: Vocab = field(repr=False)
    tool_names: tuple[str, ...] = ()
    max_calls: int | None = None    # forced calls: 1 for a named tool or parallel_tool_calls false, None = any
    _proto: llg.LLMatcher | None = field(default=None, repr=False)

    def __post_init__(self):
        if self._proto is None:
            self._proto = llg.LLMatcher(self.vocab.lt, self.grammar, log_level=0, limits=_limits())
        if self._proto.is_error():   # llguidance's own message: a bad schema, regex, Lark rule, unknown keyword...
            raise GrammarError(f"invalid grammar: {self._proto.get_error().strip()}")

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        return self.vocab.lt

    def matcher(self):
        from dsv41.grammar.matchers import Matcher

        return Matcher(self._proto.deep_copy(), self.vocab, thinking=self.thinking)


# Compiled specs by grammar: agents send the same schema or tools request after request. A spec's prototype matcher
# is only ever copied, never advanced, so one spec serves any number of requests.
SPEC_CACHE_SIZE = 64
_SPECS: OrderedDict[tuple, GrammarSpec] = OrderedDict()
_SPEC_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------------------------
# Lark pieces.

def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json_body(schema: Any, lenient: bool, param: str | None) -> str:
    """`%json {...}` with our whitespace rule (the schema's own x-guidance keys win)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object", param)
    opts = {"whitespace_pattern": JSON_WHITESPACE}
    if lenient:
        opts["lenient"] = True
    user_opts = schema.get("x-guidance")
    if isinstance(user_opts, dict):
        opts.update(user_opts)
    schema = {**schema, "x-guidance": opts}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _parse_schema(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{param}: not valid JSON: {e}", param) from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError(f"{param}: a JSON schema must be an object", param)
    return value


def _regex_body(regex: Any, param: str) -> str:
    if not isinstance(regex, str) or not regex:
        raise GrammarError(f"{param} must be a non-empty string", param)
    return "/" + llg.regex_to_lark(regex) + "/"


def _choice_body(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(f"{param} must be a non-empty list of non-empty strings", param)
    return " | ".join(_lit(c) for c in dict.fromkeys(choices))


# ---------------------------------------------------------------------------------------------------------------
# Forced DSML calls (serving.md §2.2 rule 6, §2.4):
#   \n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="N">\n P1\n P2 \n</｜DSML｜ invoke>\n ... \n</｜DSML｜ calls>
#   P = <｜DSML｜ parameter name="K" string="true|false">V</｜DSML｜ parameter>
# Every piece after the first starts with "\n<", so no literal is a prefix of another alternative at one position
# (llguidance's lexer does not backtrack).

def _tool_function(tool: Any) -> dict:
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        return tool["function"]
    if isinstance(tool, dict) and "name" in tool:
        return tool
    raise GrammarError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")


def _resolve(schema: Any, root: dict) -> Any:
    """Follow one local `$ref` (for deciding a parameter's DSML form only)."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str) and ref.startswith("#/"):
        node: Any = root
        for part in ref[2:].split("/"):
            if not isinstance(node, dict) or part not in node:
                return schema
            node = node[part]
        return node
    return schema


def _string_form(schema: Any, root: dict) -> str:
    """How the model writes this parameter: "raw" (string="true" only), "json" (string="false" only) or "both".

    The encoder writes string="true" exactly when the value is a string, so a string-typed parameter is raw text;
    a parameter whose type list includes "string" may be either.
    """
    s = _resolve(schema, root)
    if not isinstance(s, dict):
        return "json"
    t = s.get("type")
    enum = s.get("enum")
    if "const" in s:
        enum = [s["const"]]
    if t == "string" or (t is None and enum and all(isinstance(v, str) for v in enum)):
        if "format" in s:
            return "json"   # formats are enforced by the JSON grammar, i.e. as a quoted string="false" value
        return "raw"
    if isinstance(t, list) and "string" in t:
        return "both"
    return "json"


def _raw_value_rule(schema: Any, root: dict) -> str:
    """The raw text of a string="true" value followed by the `</` before the closing DSML token.

    Free text is one greedy lexeme ending in `</`: the DSML token that follows is special, so the lexeme ends
    exactly where the model writes `</｜DSML｜`."""
    s = _resolve(schema, root)
    s = s if isinstance(s, dict) else {}
    enum = [s["const"]] if "const" in s else s.get("enum")
    if enum:
        strings = [v for v in enum if isinstance(v, str)]
        if strings:
            return "(" + " | ".join(_lit(v) for v in dict.fromkeys(strings)) + ") \"</\""
    pattern = s.get("pattern")
    if isinstance(pattern, str):
        body = pattern.removeprefix("^")
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
        return "/(" + llg.regex_to_lark(body) + ")<\\//"
    lo, hi = s.get("minLength"), s.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):
        lo = lo if isinstance(lo, int) else 0
        hi = hi if isinstance(hi, int) else ""
        return f"/(.|\\n){{{lo},{hi}}}<\\//"
    return "/(.|\\n)*<\\//"


class _CallGrammar:
    """Builds the Lark rules for a calls block over the offered tools."""

    def __init__(self, dsml: int | None, lenient: bool):
        self.rules: list[str] = []
        self.lenient = lenient
        self.n = 0
        self.dsml = dsml
        self.d = f"<[{dsml}]>"

    def _rule(self, body: str) -> str:
        self.n += 1
        name = f"dsml_{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def _param(self, name: str, schema: Any, root: dict) -> str:
        """One parameter, from just after its opening `<｜DSML｜` to its `</｜DSML｜ parameter>`."""
        head = f" parameter name=\"{name}\" string="
        form = _string_form(schema, root)
        alts = []
        if form in ("raw", "both"):
            alts.append(_lit(head + '"true">') + " " + _raw_value_rule(schema, root))
        if form in ("json", "both"):
            sub = schema if isinstance(schema, dict) else {}
            defs = {k: root[k] for k in ("$defs", "definitions") if k in root and k not in sub}
            alts.append(_lit(head + '"false">') + " "
                        f"{_json_body({**sub, **defs}, self.lenient, 'tools')} \"</\"")
        return self._rule("(" + " | ".join(f"({a})" for a in alts) + f") {self.d} \" parameter>\"")

    def _generic_params(self) -> str:
        """Tools without declared properties: any names, raw or JSON values."""
        p = self._rule(f"\" parameter name=\\\"\" /[^\"<>\\n]+/ \"\\\" string=\\\"\" "
                       f"(\"true\\\">\" /(.|\\n)*<\\// | \"false\\\">\" {_json_body({}, self.lenient, 'tools')} \"</\") "
                       f"{self.d} \" parameter>\"")
        return f"(\"<\" {self.d} {p} (\"\\n<\" {self.d} {p})*)?"

    def invoke(self, fn: dict) -> str:
        """Rule for one call of `fn`, from just after its opening `<｜DSML｜` to `</｜DSML｜ invoke>`."""
        name = fn["name"]
        params = fn.get("parameters")
        params = params if isinstance(params, dict) else {}
        props = params.get("properties")
        head = _lit(f" invoke name=\"{name}\">\n")
        if not isinstance(props, dict) or not props:
            body = self._generic_params() if not isinstance(props, dict) else ""
            return self._rule(f"{head} {body} \"\\n</\" {self.d} \" invoke>\"")
        for k in props:
            if not k or '"' in k or "\n" in k:
                raise GrammarError(f"tool {name!r}: parameter names must be non-empty, without quotes or newlines",
                                   "tools")
        required = set(params.get("required") or [])
        items = [(k, self._param(k, v, params), k in required) for k, v in props.items()]
        # first_i: no parameter written yet, parameters i.. remain; rest_i: at least one written (so "\n<" first).
        first, rest = "", ""
        for k, prule, req in reversed(items):
            skip_rest = "" if req else f" | {rest}"       # an empty alternative when nothing follows
            skip_first = "" if req else f" | {first}"
            new_rest = self._rule(f"\"\\n<\" {self.d} {prule} {rest}{skip_rest}")
            new_first = self._rule(f"\"<\" {self.d} {prule} {rest}{skip_first}")
            first, rest = new_first, new_rest
        return self._rule(f"{head} {first} \"\\n</\" {self.d} \" invoke>\"")

    def block(self, fns: list[dict], max_calls: int | None) -> str:
        if self.dsml is None:
            raise GrammarError("this tokenizer has no ｜DSML｜ token: tool calls cannot be constrained", "tools")
        invokes = [self.invoke(fn) for fn in fns]
        call = self._rule(" | ".join(invokes))
        more = "" if max_calls == 1 else f" (\"\\n<\" {self.d} {call})*"
        return self._rule(f"\"\\n\\n<\" {self.d} \" calls>\\n<\" {self.d} {call}{more} \"\\n</\" {self.d} \" calls>\"")


# ---------------------------------------------------------------------------------------------------------------
# Request fields -> one constraint.

def _structured(req: dict) -> tuple[str, str, Any, bool] | None:
    """(kind, param, value, lenient) of the single structured-output constraint in `req`, or None."""
    found: list[tuple[str, str, Any, bool]] = []
    rf = req.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise GrammarError("response_format must be an object with a type", "response_format")
        t = rf["type"]
        if t == "json_object":
            found.append(("json_object", "response_format", {"type": "object"}, False))
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise GrammarError("response_format.json_schema.schema is required", "response_format")
            # strict false (OpenAI's "best effort") ignores keywords the grammar cannot enforce; otherwise 400.
            strict = js.get("strict")
            found.append(("json_schema", "response_format",
                          _parse_schema(js["schema"], "response_format.json_schema.schema"), strict is False))
        elif t != "text":
            raise GrammarError(f"response_format.type {t!r} is not one of text, json_object, json_schema",
                               "response_format")
    if req.get("guided_json") is not None:
        found.append(("json_schema", "guided_json", _parse_schema(req["guided_json"], "guided_json"), False))
    if req.get("guided_regex") is not None:
        found.append(("regex", "guided_regex", req["guided_regex"], False))
    if req.get("guided_choice") is not None:
        found.append(("choice", "guided_choice", req["guided_choice"], False))
    if req.get("guided_grammar") is not None:
        found.append(("grammar", "guided_grammar", req["guided_grammar"], False))
    so = req.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise GrammarError("structured_outputs must be an object", "structured_outputs")
        keys = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                if so.get(k) not in (None, False)]
        if len(keys) != 1:
            raise GrammarError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                               "structured_outputs")
        k = keys[0]
        if k == "structural_tag":
            raise GrammarError("structured_outputs.structural_tag is not supported", "structured_outputs")
        if k == "json":
            found.append(("json_schema", "structured_outputs", _parse_schema(so["json"], "structured_outputs.json"),
                          False))
        elif k == "json_object":
            found.append(("json_object", "structured_outputs", {"type": "object"}, False))
        else:
            found.append((k, "structured_outputs", so[k], False))
    if len(found) > 1:
        raise GrammarError("only one of " + ", ".join(f[1] for f in found) + " may be given", found[1][1])
    return found[0] if found else None


def _forced_tools(req: dict, tools: list) -> tuple[list[dict], int | None] | None:
    """The tools a forced call may use and the call limit, or None when calls are not forced."""
    tc = req.get("tool_choice")
    if tc is None or tc in ("auto", "none") or (isinstance(tc, dict) and tc.get("type") in ("auto", "none")):
        return None
    one = req.get("parallel_tool_calls") is False
    if tc == "required" or (isinstance(tc, dict) and tc.get("type") == "any"):
        if not tools:
            raise GrammarError("tool_choice \"required\" needs tools", "tool_choice")
        return [_tool_function(t) for t in tools], 1 if one else None
    name = None
    if isinstance(tc, dict) and tc.get("type") == "function":
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tc.get("name")   # Chat form, or the Responses form
    elif isinstance(tc, dict) and tc.get("type") == "tool":
        name = tc.get("name")                                                 # Anthropic form
    if not isinstance(name, str) or not name:
        raise GrammarError("tool_choice must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not tools:
        raise GrammarError(f"tool_choice names {name!r} but no tools were given", "tool_choice")
    fns = [_tool_function(t) for t in tools]
    for fn in fns:
        if isinstance(fn.get("name"), str) and fn["name"].lower() == name.lower():
            return [fn], 1
    raise GrammarError(f"tool_choice names {name!r}, which is not among the offered tools", "tool_choice")


def compile_request(req: dict, tok: Any = None, tools: list | None = None, thinking: bool = False
                    ) -> GrammarSpec | None:
    """The grammar for a chat request, or None when its reply is unconstrained. Raises GrammarError (-> 400).

    `tools` are the tools the prompt offers (None: the request's own `tools`); `thinking` whether the reply opens
    with free reasoning closed by `</think>`.
    """
    if tools is None:
        tools = req.get("tools") or []
    tc = req.get("tool_choice")
    if tc == "none" or (isinstance(tc, dict) and tc.get("type") == "none"):
        tools = []
    for t in tools:
        fn = _tool_function(t)
        if not isinstance(fn.get("name"), str) or not fn["name"] or '"' in fn["name"] or "\n" in fn["name"]:
            raise GrammarError("every tool needs a name without quotes or newlines", "tools")
    structured = _structured(req)
    forced = _forced_tools(req, tools)
    if forced is not None and structured is not None:
        raise GrammarError(f"{structured[1]} cannot be combined with a forced tool call (tool_choice)",
                           structured[1])
    if forced is None and structured is None:
        return None

    vocab = vocab_for(tok)
    subs: list[dict] = []
    calls = _CallGrammar(vocab.dsml, lenient=False)
    names: tuple[str, ...] = ()
    max_calls = None
    if forced is not None:
        fns, max_calls = forced
        kind = "tool_call"
        answer = calls.block(fns, max_calls)
        names = tuple(fn["name"] for fn in fns)
    else:
        kind, param, value, lenient = structured
        if kind in ("json_object", "json_schema"):
            answer = _json_body(value, lenient, param)
        elif kind == "regex":
            answer = _regex_body(value, param)
        elif kind == "choice":
            answer = _choice_body(value, param)
        else:
            if not isinstance(value, str) or not value.strip():
                raise GrammarError(f"{param} must be a non-empty grammar string", param)
            try:
                user = any_to_lark(value)
            except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on malformed GBNF
                raise GrammarError(f"{param}: {e}", param) from None
            subs.append({"name": "client", "lark_grammar": user})
            answer = "@client"
        # With tools on offer (tool_choice auto) the reply may still be calls instead of the constrained answer.
        if tools:
            fns = [_tool_function(t) for t in tools]
            block = calls.block(fns, 1 if req.get("parallel_tool_calls") is False else None)
            answer = f"({answer}) | {block}"
    lines = []
    if thinking:
        if vocab.think_close is None:
            raise GrammarError("this tokenizer has no </think> token", "chat_template_kwargs")
        lines.append(f"start: reasoning <[{vocab.think_close}]> answer")
        # Reasoning is free text; the DSML token is special to llguidance, so it is let through explicitly.
        lines.append(f"reasoning: THINK_TEXT (<[{vocab.dsml}]> THINK_TEXT)*" if vocab.dsml is not None
                     else "reasoning: THINK_TEXT")
        lines.append("THINK_TEXT: /(.|\\n)*/")
    else:
        lines.append("start: answer")
    lines.append(f"answer: {answer}")
    lines.extend(calls.rules)
    lark = "\n".join(lines) + "\n"
    grammar = json.dumps({"grammars": [{"lark_grammar": lark}, *subs]}, ensure_ascii=False) if subs else lark
    key = (hashlib.sha256(grammar.encode("utf-8")).hexdigest(), id(vocab), kind, thinking, names, max_calls)
    with _SPEC_LOCK:
        spec = _SPECS.get(key)
        if spec is not None:
            _SPECS.move_to_end(key)
            return spec
    try:
        spec = GrammarSpec(kind=kind, grammar=grammar, thinking=thinking, vocab=vocab, tool_names=names,
                           max_calls=max_calls)
    except GrammarError as e:
        e.param = structured[1] if structured else "tool_choice"
        raise
    with _SPEC_LOCK:
        _SPECS[key] = spec
        while len(_SPECS) > SPEC_CACHE_SIZE:
            _SPECS.popitem(last=False)
    return spec
