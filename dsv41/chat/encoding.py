"""The DeepSeek-V4.1 chat encoding (DeepSeek's `encoding/encoding.py`, `encode_messages`), rendered as pieces.

The output is a list of pieces `(text, client)`: `client` is True for text that came from the request (message text,
reasoning, names, argument values, tool results, tool schemas) and False for the template's own text (role tokens,
the effort line, the tools preamble, DSML markup, image placeholders). Joined, the pieces are the reference prompt
string byte for byte; `Tokenizer.encode_pieces` tokenizes template text with special-token matching and, with the
prompt shield on, client text without it (see docs/chat.md).

Every rule here is pinned by ../shared/vectors/chat/prompts.jsonl (made with the reference); the request policy on
top (which fields map to what, what is refused) is in policy.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dsv41.chat.errors import ChatError
from dsv41.chat.tokenizer import BOS, EOS, IMAGE_PLACEHOLDER, THINK_END, THINK_START

SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_CLOSE = f"</{DSML} parameter>"
TASK_TOKENS = {
    "read_url": "<｜read_url｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "action": "<｜action｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
}
EFFORT_NAMES = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = 75

TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    f'writing a "{CALLS_OPEN}" block like the following:\n\n{CALLS_OPEN}\n<{DSML} invoke name="$TOOL_NAME">\n'
    f'<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}\n...\n'
    f'{INVOKE_CLOSE}\n<{DSML} invoke name="$TOOL_NAME2">\n...\n{INVOKE_CLOSE}\n{CALLS_CLOSE}\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
RESPONSE_FORMAT_HEAD = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

Piece = tuple[str, bool]


def effort_line(effort: int) -> str:
    return f"Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def to_json(value: Any) -> str:
    """JSON the way the reference writes values and schemas: Python's defaults, ensure_ascii off."""
    return json.dumps(value, ensure_ascii=False)


def resolve_effort(effort: Any) -> int:
    """The encoder's effort: None = 75, "low"/"high"/"max", or an int 1..100 (bools and floats refused)."""
    if effort is None:
        return DEFAULT_EFFORT
    if isinstance(effort, str) and effort in EFFORT_NAMES:
        return EFFORT_NAMES[effort]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise ChatError(
        f"invalid reasoning_effort {effort!r}: the encoder takes an integer 1-100 or one of 'low', 'high', 'max'",
        "reasoning_effort")


@dataclass
class Rendered:
    pieces: list[Piece]
    images: list[dict] = field(default_factory=list)  # the image records, in placeholder order

    @property
    def prompt(self) -> str:
        return "".join(t for t, _ in self.pieces)


class _Out:
    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.images: list[dict] = []  # image records in placeholder order

    def t(self, text: str) -> None:  # template text
        if text:
            self.pieces.append((text, False))

    def c(self, text: str) -> None:  # client text
        if text:
            self.pieces.append((text, True))


# A "part" of processed content: ("text", s) client text, ("image", record) the placeholder, ("unsupported", type),
# ("sep",) the blank line between joined parts.
Part = tuple


def _image_record(block: dict) -> dict:
    record: dict = {"type": "image"}
    if block.get("type") == "image_url":
        url = block.get("image_url")
        record["url"] = url if isinstance(url, str) else (url or {}).get("url", "") if isinstance(url, dict) else ""
    else:
        for key in ("source", "url", "data"):
            if key in block:
                record[key] = block[key]
    if not any(record.get(k) for k in ("source", "url", "data")):
        raise ChatError("image block does not contain a valid source (image_url.url, or source/url/data)")
    return record


def _check_placeholder(text: Any, what: str, shield: bool) -> None:
    # The reference refuses the placeholder typed as text because it would tokenize to the image id; with the
    # shield on it is plain text, so there is nothing to refuse.
    if not shield and isinstance(text, str) and IMAGE_PLACEHOLDER in text:
        raise ChatError(f"{what} must not contain the image placeholder token {IMAGE_PLACEHOLDER!r}; "
                        "send images as image_url content parts")


def _process_parts(blocks: list, shield: bool) -> list[Part]:
    parts: list[Part] = []
    for b in blocks:
        if not isinstance(b, dict):
            raise ChatError(f"content parts must be objects, got {type(b).__name__}")
        kind = b.get("type")
        if kind in ("image", "image_url"):
            parts.append(("image", _image_record(b)))
        elif kind == "text":
            text = b.get("text") or ""
            if not isinstance(text, str):
                raise ChatError("a text content part's text must be a string")
            _check_placeholder(text, "a text content part", shield)
            parts.append(("text", text))
        else:
            parts.append(("unsupported", str(kind)))
    return parts


def _joined(parts: list[Part]) -> list[Part]:
    """Non-user content as one text: text and image parts joined by blank lines, other part types left out."""
    kept = [p for p in parts if p[0] in ("text", "image")]
    out: list[Part] = []
    for i, p in enumerate(kept):
        if i:
            out.append(("sep",))
        out.append(p)
    return out


def _preprocess(messages: list, shield: bool) -> list[dict]:
    """Validate, turn content into parts, and merge tool results and consecutive user messages into user turns."""
    if not isinstance(messages, list):
        raise ChatError("messages must be a list")
    merged: list[dict] = []
    for i, raw in enumerate(messages):
        if not isinstance(raw, dict):
            raise ChatError(f"messages[{i}] must be an object")
        m = dict(raw)
        role = m.get("role")
        content = m.get("content")
        _check_placeholder(content, f"messages[{i}].content", shield)
        _check_placeholder(m.get("reasoning_content"), f"messages[{i}].reasoning_content", shield)
        if isinstance(content, list):
            parts = _process_parts(content, shield)
        elif role == "user":
            if "content" in raw and not isinstance(content, str):
                raise ChatError(f"messages[{i}].content must be a string or a list of content parts")
            parts = [("text", content or "")]
        else:
            parts = None  # rendered from m["content"] as is
        if role == "tool":
            if isinstance(content, list):
                body = _joined(parts)
            else:
                body = [("text", content if isinstance(content, str) else str(raw.get("content", "")))]
            block = {"kind": "tool_result", "parts": body, "id": m.get("tool_call_id", "")}
            if merged and merged[-1].get("role") == "user":
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            blocks = [{"kind": "part", "part": p} for p in parts]
            if merged and merged[-1].get("role") == "user" and merged[-1].get("task") is None:
                merged[-1]["blocks"].extend(blocks)
            else:
                m["blocks"] = blocks
                merged.append(m)
        else:
            if parts is not None:
                m["parts"] = _joined(parts)
            merged.append(m)
    return merged


def _sort_tool_results(full: list[dict]) -> None:
    """Tool results in a user turn follow the preceding assistant's call order (unknown ids sort as 0, stable)."""
    order: dict = {}
    for m in full:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            order = {}
            for k, tc in enumerate(m["tool_calls"]):
                tc_id = (tc.get("id") or (tc.get("function") or {}).get("id", "")) if isinstance(tc, dict) else ""
                if tc_id:
                    order[tc_id] = k
        elif m.get("role") == "user":
            results = [b for b in m["blocks"] if b["kind"] == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                m["blocks"] = [next(ranked) if b["kind"] == "tool_result" else b for b in m["blocks"]]


def _emit_parts(out: _Out, parts: list[Part]) -> None:
    for p in parts:
        if p[0] == "text":
            out.c(p[1])
        elif p[0] == "image":
            out.t(IMAGE_PLACEHOLDER)
            out.images.append(p[1])
        elif p[0] == "sep":
            out.t("\n\n")
        else:
            out.c(f"[Unsupported {p[1]}]")


def _emit_content(out: _Out, m: dict) -> None:
    if "parts" in m:
        _emit_parts(out, m["parts"])
    else:
        content = m.get("content")
        out.c(content if isinstance(content, str) else ("" if content is None else str(content)))


def call_arguments(arguments: Any) -> dict:
    """A call's arguments as the object the encoder writes: JSON strings decoded (twice if double-encoded);
    anything that is not an object becomes {"arguments": <the original>}."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
            if isinstance(value, str):
                value = json.loads(value)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict):
            return value
    return {"arguments": arguments}


def _emit_tools(out: _Out, tools: Any) -> None:
    if not isinstance(tools, list):
        raise ChatError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    out.t("\n\n" + TOOLS_HEAD)
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ChatError(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        if k:
            out.t("\n")
        out.c(to_json(tool["function"]))
    out.t(TOOLS_TAIL)


def _emit_calls(out: _Out, tool_calls: list, i: int) -> None:
    out.t("\n\n" + CALLS_OPEN + "\n")
    for k, tc in enumerate(tool_calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or "name" not in fn or "arguments" not in fn:
            raise ChatError(f"messages[{i}].tool_calls[{k}] must be {{\"function\": {{\"name\", \"arguments\"}}}}")
        if k:
            out.t("\n")
        out.t(f'<{DSML} invoke name="')
        out.c(str(fn["name"]))
        out.t('">\n')
        for j, (key, value) in enumerate(call_arguments(fn["arguments"]).items()):
            if j:
                out.t("\n")
            out.t(f'<{DSML} parameter name="')
            out.c(str(key))
            out.t('" string="true">' if isinstance(value, str) else '" string="false">')
            out.c(value if isinstance(value, str) else to_json(value))
            out.t(PARAM_CLOSE)
        out.t("\n" + INVOKE_CLOSE)
    out.t("\n" + CALLS_CLOSE)


def encode_messages(messages: list, thinking_mode: str, reasoning_effort: Any = None, drop_thinking: bool = True,
                    context: list | None = None, add_default_bos_token: bool = True, shield: bool = False
                    ) -> Rendered:
    """Render a conversation the way DeepSeek's `encode_messages` does (arguments as the reference names them).

    Raises ChatError where the reference refuses. `shield` only lifts the reference's refusal of the image
    placeholder typed as text (under the shield it cannot become the image token); the text is the same.
    """
    if thinking_mode not in ("chat", "thinking"):
        raise ChatError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}", "thinking_mode")
    thinking = thinking_mode == "thinking"
    ctx = _preprocess(context or [], shield)
    msgs = _preprocess(messages, shield)
    full = ctx + msgs
    _sort_tool_results(full)
    keep_reasoning = not drop_thinking or any(m.get("tools") for m in full)
    last_user = max((k for k, m in enumerate(full) if m.get("role") in ("user", "system")), default=-1)

    out = _Out()
    if add_default_bos_token and not ctx:
        out.t(BOS)
    for i in range(len(ctx), len(full)):
        m = full[i]
        role = m.get("role")
        effort = resolve_effort(reasoning_effort)  # the reference validates it for every message, in any mode
        if i == 0 and (thinking or role == "system"):
            out.t(SYSTEM)
            if thinking:
                out.t(effort_line(effort))
        if role == "system":
            if i:
                out.t(SYSTEM)
            _emit_content(out, m)
            if m.get("tools"):
                _emit_tools(out, m["tools"])
            if m.get("response_format"):
                out.t(RESPONSE_FORMAT_HEAD)
                out.c(to_json(m["response_format"]))
        elif role == "user":
            out.t(USER)
            for k, b in enumerate(m["blocks"]):
                if k:
                    out.t("\n\n")
                if b["kind"] == "tool_result":
                    out.t("<tool_result>")
                    _emit_parts(out, b["parts"])
                    out.t("</tool_result>")
                else:
                    _emit_parts(out, [b["part"]])
        elif role == "latest_reminder":
            out.t(LATEST_REMINDER)
            _emit_content(out, m)
        elif role == "assistant":
            prev_task = i > 0 and full[i - 1].get("task") is not None
            if thinking and not prev_task and (keep_reasoning or i > last_user):
                reasoning = m.get("reasoning_content")
                out.c(reasoning if isinstance(reasoning, str) else "")
                out.t(THINK_END)
            _emit_content(out, m)
            if m.get("tool_calls"):
                if not isinstance(m["tool_calls"], list):
                    raise ChatError(f"messages[{i - len(ctx)}].tool_calls must be a list")
                _emit_calls(out, m["tool_calls"], i - len(ctx))
            if not m.get("wo_eos"):  # the reference's per-message switch: an assistant turn left open
                out.t(EOS)
        else:
            raise ChatError(f"unknown role {role!r}: use system, user, assistant or tool")

        # What follows a message: nothing when the next one is not an answer to it.
        if i + 1 < len(full) and full[i + 1].get("role") not in ("assistant", "latest_reminder"):
            continue
        task = m.get("task")
        if task is not None:
            if task not in TASK_TOKENS:
                raise ChatError(f"invalid task {task!r}: valid tasks are {list(TASK_TOKENS)}")
            if task == "action":
                out.t(ASSISTANT + (THINK_START if thinking else THINK_END))
            out.t(TASK_TOKENS[task])
        elif role == "user" or (role == "system" and i > 0):
            opens_thinking = thinking and (keep_reasoning or i >= last_user)
            out.t(ASSISTANT + (THINK_START if opens_thinking else THINK_END))
    return Rendered(out.pieces, out.images)
