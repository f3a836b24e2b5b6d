"""Streaming reply parser: the model's text, piece by piece, split into reasoning, content and DSML tool calls.

Fed the decoded reply (IncrementalDetokenizer output, so never half a character), it returns OpenAI-shaped stream
deltas and, at the end, the final message. Every decision depends on the text alone, never on how it was cut into
pieces: text that could still turn out to be markup (a tail that is a prefix of `</think>` or of a calls opener, a
tag not yet closed) is held back until the next piece or the end decides it. The deltas joined give the final
message exactly. Rules (docs/chat.md, "Reply parsing"):

- Thinking mode starts in reasoning; `</think>` switches to content. Chat mode starts in content.
- `\\n\\n<｜DSML｜ calls>` (the blank line optional) opens a calls block in content; nothing from the opener to
  `</｜DSML｜ calls>` reaches content. Each `invoke` of an offered tool (name matched case-insensitively, reported in
  the offered spelling) becomes a tool call: a delta with id, type and name first, then the arguments in pieces as
  compact JSON (`string="true"` values stream as JSON strings; other values are JSON-parsed when complete and
  re-dumped compactly, or kept as a string when they are not valid JSON).
- A call to a tool that was not offered is text: it goes to content as `<tool_call>{"name",...}</tool_call>`.
- Text between tags inside a block is dropped; text after a block is content again (whitespace alone is dropped).
- A calls block inside reasoning is reasoning, unless the reply ends right after it (no `</think>`) and it is at
  most HELD_LIMIT characters long: then it is the answer's calls.
- At the end of the reply a cut-off calls opener is dropped; an open invoke of an offered tool is closed (an open
  value ends where the text ends, a partial tag is dropped): one valid offered call. A partial invoke header is
  dropped.
"""
from __future__ import annotations

import functools
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from dsv41.chat.encoding import CALLS_CLOSE, CALLS_OPEN, DSML, INVOKE_CLOSE, PARAM_CLOSE
from dsv41.chat.tokenizer import THINK_END

Delta = dict  # one OpenAI `choices[0].delta` object

INVOKE_PREFIX = f"<{DSML} invoke"
PARAM_PREFIX = f"<{DSML} parameter"
INVOKE_RE = re.compile(re.escape(INVOKE_PREFIX) + r'\s+name="(.*?)"\s*>')
PARAM_RE = re.compile(re.escape(PARAM_PREFIX) + r'\s+name="(.*?)"(?:\s+string="(true|false)")?\s*>')
TAG_LIMIT = 256  # a tag header not complete within this many characters is not a tag
HELD_LIMIT = 32768  # a calls block inside reasoning longer than this (from its opener) is reasoning
# V4's spelling of the block (serving.md §2.4: `<｜DSML｜tool_calls>`, no space), read as V4.1's: each V4 tag is
# rewritten to V4.1's before the scanner sees it, so a V4 reply parses exactly as the same reply in V4.1's spelling
V4_SPELLING = ((f"<{DSML}tool_calls>", CALLS_OPEN), (f"</{DSML}tool_calls>", CALLS_CLOSE),
               (f"<{DSML}invoke", INVOKE_PREFIX), (f"</{DSML}invoke>", INVOKE_CLOSE),
               (f"<{DSML}parameter", PARAM_PREFIX), (f"</{DSML}parameter>", PARAM_CLOSE))
_V4_TAGS = tuple(v4 for v4, _ in V4_SPELLING)


def _v41_spelling(text: str) -> str:
    if DSML in text:
        for v4, v41 in V4_SPELLING:
            text = text.replace(v4, v41)
    return text

def _v41_tail(raw: str) -> str:
    """A reply's last characters when they are an unfinished V4 tag past `<｜DSML｜` (a closer without its `>`):
    the same unfinished V4.1 tag (as many characters short of its end), so the end of the reply reads as the same
    reply in V4.1's spelling would (a partial closer there is the closer the model did not finish)."""
    for v4, v41 in V4_SPELLING:
        if len(raw) < len(v4) and v4.startswith(raw) and len(raw) > v4.index(DSML) + len(DSML):
            return v41[:len(v41) - (len(v4) - len(raw))]
    return raw


_REASONING, _HELD, _CONTENT, _CALLS, _INVOKE, _PARAM = range(6)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
        raise ValueError("non-finite number")
    return f


def json_value(raw: str) -> Any:
    """A `string="false"` value: parsed as strict JSON, else the raw text as a string."""
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return raw


def _partial_tail(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of the markers. Only the prefixes that end
    with buf's last character are tried (longest first): a streamed token's text rarely ends with a marker's
    character, so this is a dict probe a token where trying every prefix of every marker was ~60 string ops (a
    tenth of the event loop's work per streamed token at 32 streams)."""
    if not buf:
        return 0
    for n, prefix in _prefixes_by_last(tuple(markers)).get(buf[-1], ()):
        if n <= len(buf) and buf.endswith(prefix):
            return n
    return 0


@functools.cache
def _prefixes_by_last(markers: tuple[str, ...]) -> dict[str, list[tuple[int, str]]]:
    """Last character -> (length, prefix) of the markers' proper prefixes ending with it, longest first."""
    table: dict[str, list[tuple[int, str]]] = {}
    for m in markers:
        for n in range(1, len(m)):
            table.setdefault(m[n - 1], []).append((n, m[:n]))
    for v in table.values():
        v.sort(reverse=True)
    return table


def _strip_blank_line(text: str) -> str:
    return text[:-2] if text.endswith("\n\n") else text


@dataclass
class FinalMessage:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI form: {"id", "type", "function": {...}}
    thinking: bool = False

    def message(self) -> dict:
        """The OpenAI `choices[0].message` (content null when there are calls and no text)."""
        msg: dict = {"role": "assistant", "content": self.content if (self.content or not self.tool_calls) else None}
        if self.thinking or self.reasoning_content:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class _Invoke:
    def __init__(self, name: str, mode: str, index: int = -1):
        self.name = name          # offered spelling when mode == "call"
        self.mode = mode          # "call" (streamed), "text" (not offered: rewritten into content), "drop"
        self.index = index
        self.args: dict = {}      # for "text": key -> value
        self.n_params = 0
        self.key = ""
        self.is_string = True
        self.value: list[str] = []


class ReplyParser:
    """feed(text) -> deltas; finish() -> (deltas, FinalMessage). See the module docstring for the rules.

    tools: the offered tools (OpenAI tool objects, function objects or names); calls to other names are text.
    any_tool: accept every name as offered (the reference parser's behaviour; tools is then ignored).
    parallel_tool_calls: False keeps only the first call; later invokes (and unoffered ones) are dropped.
    """

    def __init__(self, thinking: bool, tools: list | None = None, *, any_tool: bool = False,
                 parallel_tool_calls: bool = True, new_id: Callable[[], str] = new_call_id):
        self.thinking = thinking
        self.any_tool = any_tool
        self.parallel = parallel_tool_calls
        self.new_id = new_id
        self.offered: dict[str, str] = {}
        for t in tools or []:
            name = t if isinstance(t, str) else (t.get("function", t) or {}).get("name")
            if isinstance(name, str) and name:
                self.offered.setdefault(name.casefold(), name)
        self.state = _REASONING if thinking else _CONTENT
        self.buf = ""
        self.raw = ""             # fed text not yet respelled: a tail that may still become a V4 tag
        self.hold = ""            # _HELD: a calls block met inside reasoning, from its blank line on
        self.hold_scanned = 0     # how far `hold` was searched for </think> and the block's closer
        self.hold_close = -1      # where the held block's closer is, once seen
        self.after_calls = False  # content right after a block: whitespace alone is dropped
        self.invoke: _Invoke | None = None
        self.final = FinalMessage(thinking=thinking)
        self._parts: dict[str, list[str]] = {"reasoning": [], "content": []}  # joined into `final` at the end
        self._arg_parts: list[list[str]] = []  # per call, joined into its arguments at the end
        self._out: list[Delta] = []
        self._role_sent = False
        self._done = False

    # ---- public ----
    def role_delta(self) -> list[Delta]:
        """The role delta now if not sent yet (the server sends it right after the headers when no tools)."""
        if self._role_sent:
            return []
        self._role_sent = True
        return [{"role": "assistant"}]

    def feed(self, text: str) -> list[Delta]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        raw = self.raw + text
        keep = _partial_tail(raw, _V4_TAGS)
        self.raw = raw[len(raw) - keep:]
        self.buf += _v41_spelling(raw[:len(raw) - keep])
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[list[Delta], FinalMessage]:
        if not self._done:
            self._done = True
            self.buf += _v41_spelling(_v41_tail(self.raw))
            self.raw = ""
            self._run(final=True)
            self._end()
            self.final.reasoning_content = "".join(self._parts["reasoning"])
            self.final.content = "".join(self._parts["content"])
            for call, parts in zip(self.final.tool_calls, self._arg_parts):
                call["function"]["arguments"] = "".join(parts)
            if not self._role_sent:
                self._out.insert(0, {"role": "assistant"})
                self._role_sent = True
        return self._take(), self.final

    # ---- emission ----
    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _emit(self, delta: Delta) -> None:
        if not self._role_sent:
            self._role_sent = True
            self._out.append({"role": "assistant"})
        self._out.append(delta)

    def _reasoning(self, text: str) -> None:
        if text:
            self._parts["reasoning"].append(text)
            self._emit({"reasoning_content": text})

    def _content(self, text: str) -> None:
        if text:
            self._parts["content"].append(text)
            self._emit({"content": text})

    def _args(self, inv: _Invoke, piece: str) -> None:
        if piece:
            self._arg_parts[inv.index].append(piece)
            self._emit({"tool_calls": [{"index": inv.index, "function": {"arguments": piece}}]})

    # ---- the scanner ----
    def _run(self, final: bool) -> None:
        handlers = {_REASONING: self._in_reasoning, _HELD: self._in_held, _CONTENT: self._in_content,
                    _CALLS: self._in_calls, _INVOKE: self._in_invoke, _PARAM: self._in_param}
        while handlers[self.state](final):
            pass

    def _in_reasoning(self, final: bool) -> bool:
        buf = self.buf
        i_end, i_calls = buf.find(THINK_END), buf.find(CALLS_OPEN)
        if i_end != -1 and (i_calls == -1 or i_end < i_calls):
            self._reasoning(buf[:i_end])
            self.buf = buf[i_end + len(THINK_END):]
            self.state = _CONTENT
            return True
        if i_calls != -1:
            before = _strip_blank_line(buf[:i_calls])
            self._reasoning(before)
            self.hold, self.buf = buf[len(before):], ""
            self.state = _HELD
            return True
        keep = 0 if final else _partial_tail(buf, (THINK_END, "\n\n" + CALLS_OPEN, CALLS_OPEN))
        self._reasoning(buf[:len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False

    def _in_held(self, final: bool) -> bool:
        hold = self.hold + self.buf
        self.hold, self.buf = hold, ""
        start = hold.find(CALLS_OPEN) + len(CALLS_OPEN)
        limit = start + HELD_LIMIT
        if self.hold_close == -1:
            since = max(start, self.hold_scanned - len(CALLS_CLOSE))
            self.hold_scanned = len(hold)
            i_end, i_close = hold.find(THINK_END, since), hold.find(CALLS_CLOSE, since)
            if i_end != -1 and (i_close == -1 or i_end < i_close):
                return self._held_is_reasoning(hold, min(i_end, limit))  # </think> inside the block
            if i_close != -1 and i_close <= limit:
                self.hold_close = i_close
            elif len(hold) > limit:
                return self._held_is_reasoning(hold, limit)  # too long to be the answer's calls
        if self.hold_close != -1:
            after = self.hold_close + len(CALLS_CLOSE)
            if hold[after:].strip():
                return self._held_is_reasoning(hold, after)  # more reasoning follows the block
        if not final:
            return False
        # the reply ended inside reasoning right after (or inside) a calls block: those are the answer's calls
        self.hold, self.buf, self.hold_scanned, self.hold_close = "", hold[start:], 0, -1
        self.state = _CALLS
        return True

    def _held_is_reasoning(self, hold: str, upto: int) -> bool:
        self._reasoning(hold[:upto])
        self.hold, self.buf, self.hold_scanned, self.hold_close = "", hold[upto:], 0, -1
        self.state = _REASONING
        return True

    def _in_content(self, final: bool) -> bool:
        buf = self.buf
        if self.after_calls:
            stripped = buf.lstrip()
            if not stripped:
                if final:
                    self.buf = ""
                return False
            self.after_calls = False
        i = buf.find(CALLS_OPEN)
        if i != -1:
            self._content(_strip_blank_line(buf[:i]))
            self.buf = buf[i + len(CALLS_OPEN):]
            self.state = _CALLS
            return True
        keep = _partial_tail(buf, ("\n\n" + CALLS_OPEN, CALLS_OPEN))
        if final:
            tail = buf[len(buf) - keep:]
            # a calls opener cut off by the end of the reply is markup, not text: dropped with its blank line
            buf = _strip_blank_line(buf[:len(buf) - keep]) if "<｜" in tail else buf
            keep = 0
        self._content(buf[:len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False

    def _match_tag(self, rx: re.Pattern, prefix_len: int, final: bool):
        """At a tag prefix at buf[0]: the match, None to wait for more text, or False when it is not a tag (the
        prefix is then skipped)."""
        m = rx.match(self.buf, 0, TAG_LIMIT)
        if m:
            return m
        if final or len(self.buf) >= TAG_LIMIT:
            self.buf = self.buf[prefix_len:]
            return False
        return None

    def _in_calls(self, final: bool) -> bool:
        buf = self.buf
        i_inv, i_close = buf.find(INVOKE_PREFIX), buf.find(CALLS_CLOSE)
        if i_close != -1 and (i_inv == -1 or i_close < i_inv):
            self.buf = buf[i_close + len(CALLS_CLOSE):]
            self.state, self.after_calls = _CONTENT, True
            return True
        if i_inv != -1:
            self.buf = buf[i_inv:]
            m = self._match_tag(INVOKE_RE, len(INVOKE_PREFIX), final)
            if m is None:
                return False
            if m:
                self.buf = self.buf[m.end():]
                self._open_invoke(m.group(1))
                self.state = _INVOKE
            return True
        keep = 0 if final else _partial_tail(buf, (INVOKE_PREFIX, CALLS_CLOSE))
        self.buf = buf[len(buf) - keep:]
        return False

    def _in_invoke(self, final: bool) -> bool:
        buf = self.buf
        found = [(buf.find(t), t) for t in (PARAM_PREFIX, INVOKE_CLOSE, CALLS_CLOSE, INVOKE_PREFIX)]
        found = [(i, t) for i, t in found if i != -1]
        if not found:
            keep = 0 if final else _partial_tail(buf, (PARAM_PREFIX, INVOKE_CLOSE, CALLS_CLOSE, INVOKE_PREFIX))
            self.buf = buf[len(buf) - keep:]
            return False
        i, tag = min(found)
        self.buf = buf[i:]
        if tag == PARAM_PREFIX:
            m = self._match_tag(PARAM_RE, len(PARAM_PREFIX), final)
            if m is None:
                return False
            if m:
                self.buf = self.buf[m.end():]
                self._open_param(m.group(1), m.group(2) != "false")
                self.state = _PARAM
            return True
        self._close_invoke()
        if tag == INVOKE_CLOSE:
            self.buf = self.buf[len(INVOKE_CLOSE):]
            self.state = _CALLS
        elif tag == CALLS_CLOSE:
            self.buf = self.buf[len(CALLS_CLOSE):]
            self.state, self.after_calls = _CONTENT, True
        else:  # a new invoke without closing the last one
            self.state = _CALLS
        return True

    def _in_param(self, final: bool) -> bool:
        buf = self.buf
        i = buf.find(PARAM_CLOSE)
        if i != -1:
            self._value(buf[:i])
            self.buf = buf[i + len(PARAM_CLOSE):]
            self._close_param()
            self.state = _INVOKE
            return True
        keep = _partial_tail(buf, (PARAM_CLOSE,))
        self._value(buf[:len(buf) - keep])
        # at the end a partial closer is the closer the model did not finish: dropped
        self.buf = "" if final else buf[len(buf) - keep:]
        return False

    def _end(self) -> None:
        """The reply ended: close what is open (see the module docstring)."""
        if self.state == _PARAM:
            self._close_param()
            self.state = _INVOKE
        if self.state == _INVOKE:
            self._close_invoke()
        self.state = _CONTENT
        self.buf = ""

    # ---- calls ----
    def _open_invoke(self, raw_name: str) -> None:
        name = raw_name if self.any_tool else self.offered.get(raw_name.casefold())
        started = len(self.final.tool_calls)
        if name is not None and (self.parallel or started == 0):
            inv = _Invoke(name, "call", started)
            call = {"id": self.new_id(), "type": "function", "function": {"name": name, "arguments": ""}}
            self.final.tool_calls.append(call)
            self._arg_parts.append([])
            self._emit({"tool_calls": [{"index": inv.index, "id": call["id"], "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
        elif name is None and self.parallel:
            inv = _Invoke(raw_name, "text")
        else:
            inv = _Invoke(raw_name, "drop")
        self.invoke = inv

    def _open_param(self, key: str, is_string: bool) -> None:
        inv = self.invoke
        inv.key, inv.is_string, inv.value = key, is_string, []
        if inv.mode == "call" and is_string:
            self._args(inv, ("{" if inv.n_params == 0 else ",") + compact_json(key) + ':"')

    def _value(self, piece: str) -> None:
        inv = self.invoke
        if not piece:
            return
        inv.value.append(piece)
        if inv.mode == "call" and inv.is_string:
            self._args(inv, compact_json(piece)[1:-1])

    def _close_param(self) -> None:
        inv = self.invoke
        raw = "".join(inv.value)
        value = raw if inv.is_string else json_value(raw)
        if inv.mode == "call":
            if inv.is_string:
                self._args(inv, '"')
            else:
                self._args(inv, ("{" if inv.n_params == 0 else ",") + compact_json(inv.key) + ":" + compact_json(value))
        inv.args[inv.key] = value
        inv.n_params += 1

    def _close_invoke(self) -> None:
        inv, self.invoke = self.invoke, None
        if inv is None:
            return
        if inv.mode == "call":
            self._args(inv, "{}" if inv.n_params == 0 else "}")
        elif inv.mode == "text":
            self._content("<tool_call>" + compact_json({"name": inv.name, "arguments": inv.args}) + "</tool_call>")


def parse_reply(text: str, thinking: bool, tools: list | None = None, *, any_tool: bool = False,
                parallel_tool_calls: bool = True, new_id: Callable[[], str] = new_call_id) -> FinalMessage:
    """The whole reply at once (same result as streaming it)."""
    p = ReplyParser(thinking, tools, any_tool=any_tool, parallel_tool_calls=parallel_tool_calls, new_id=new_id)
    p.feed(text)
    return p.finish()[1]
