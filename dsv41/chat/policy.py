"""The request policy: an OpenAI chat request in, the prompt the engine runs out.

The encoder (encoding.py) is pinned by DeepSeek's reference; this layer is ours. It validates the request (a
ChatError names the field and what to change), maps the request's shape onto the encoder's arguments, renders,
tokenizes (the prompt shield on by default) and decodes the image parts. Every rule is listed in docs/chat.md.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any

from dsv41.chat.encoding import DEFAULT_EFFORT, encode_messages
from dsv41.chat.errors import ChatError
from dsv41.chat.schema_check import schema_problem
from dsv41.chat.tokenizer import Tokenizer

EFFORTS = {"minimal": 25, "low": 50, "medium": 62, "high": 75, "xhigh": 88, "max": 100}
OFF = "none"
ROLES = ("system", "developer", "user", "assistant", "tool")
_DATA_URL = re.compile(r"data:(?P<media>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)


@dataclass
class ImageInput:
    """One image of the prompt: the token index of its placeholder, and its bytes (or URL when URLs are on)."""
    position: int
    data: bytes | None
    media_type: str | None = None
    url: str | None = None


@dataclass
class ChatPrompt:
    token_ids: list[int]
    prompt_text: str
    thinking: bool
    reasoning_effort: int | None            # the rendered effort; None when thinking is off
    continues_assistant: bool = False       # the reply continues the request's final assistant message
    tools: list[dict] = field(default_factory=list)   # offered tools (OpenAI objects); [] when none or hidden
    tool_choice: Any = None
    response_format: dict | None = None
    images: list[ImageInput] = field(default_factory=list)   # in placeholder order


def parse_effort(value: Any, param: str = "reasoning_effort") -> int | str | None:
    """None, "none" (thinking off), or the encoder's integer for a name or an integer 1..100."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in EFFORTS:
        return EFFORTS[value.lower()]
    if isinstance(value, str) and value.lower() == OFF:
        return OFF
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100:
        return value
    raise ChatError(f"{param} must be one of {', '.join(EFFORTS)}, none, or an integer 1-100; got {value!r}", param)


def _mode(value: Any, param: str) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, dict) and value.get("type") in ("enabled", "disabled"):
        return value["type"] == "enabled"
    raise ChatError(f"{param} must be true, false, or {{\"type\": \"enabled\" | \"disabled\"}}", param)


def thinking_and_effort(req: dict, default_thinking: bool, default_effort: Any) -> tuple[bool, int | None]:
    """The thinking switch and the effort to render (None = the encoder's default 75, or thinking off)."""
    kw = req.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise ChatError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if req.get("reasoning_effort") is not None:
        effort = parse_effort(req["reasoning_effort"])
    else:
        effort = parse_effort(kw.get("reasoning_effort"), "chat_template_kwargs.reasoning_effort")
    explicit = _mode(kw.get("enable_thinking"), "chat_template_kwargs.enable_thinking")
    if explicit is None:
        explicit = _mode(kw.get("thinking"), "chat_template_kwargs.thinking")
    if explicit is None:
        explicit = _mode(req.get("thinking"), "thinking")
    if explicit is not None:
        thinking = explicit
    else:
        thinking = default_thinking if effort != OFF else False
    if not thinking:
        return False, None
    if effort is None or effort == OFF:
        effort = parse_effort(default_effort, "default reasoning effort")
    return True, None if effort == OFF else effort


def _content(m: dict, i: int, role: str) -> Any:
    """The message's content checked: a string, a list of text (and, for user/tool, image) parts, or empty."""
    content = m.get("content")
    if content is None:
        if role == "user" and "content" in m:
            raise ChatError(f"messages[{i}].content must be a string or a list of content parts, not null")
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatError(f"messages[{i}].content must be a string or a list of content parts")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ChatError(f"messages[{i}].content[{j}].text must be a string")
        elif kind in ("image_url", "image"):
            if role not in ("user", "tool"):
                raise ChatError("image input: images are accepted only in user messages and tool results")
        else:
            raise ChatError(f"messages[{i}].content[{j}]: content part type {kind!r} is not supported; "
                            "send text or image_url parts")
    return content


def _arguments(args: Any, where: str) -> dict:
    """Call arguments as an object: a JSON object, or a string holding one (also double-encoded); "" = {}."""
    if args is None or args == "":
        return {}
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            value = json.loads(args)
            if isinstance(value, str):
                value = json.loads(value)
        except (ValueError, RecursionError):
            raise ChatError(f"{where}.arguments is not valid JSON: send the call's arguments as a JSON object "
                            "(or a string holding one)") from None
        if isinstance(value, dict):
            return value
    raise ChatError(f"{where}.arguments must be a JSON object (or a string holding one)")


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise ChatError("messages must be a non-empty list of messages")
    out: list[dict] = []
    call_ids: set | None = None  # the calls of the last assistant message
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] must be an object with a role")
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role {role!r} is not a role: use system, developer, user, assistant "
                            "or tool")
        if role == "developer":  # V4.1 has no developer role; it is the system prompt
            role = "system"
        msg: dict = {"role": role, "content": _content(m, i, role)}
        if role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ChatError(f"messages[{i}].reasoning_content must be a string")
            if reasoning:
                msg["reasoning_content"] = reasoning
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ChatError(f"messages[{i}].tool_calls must be a list")
            call_ids = set()
            norm = []
            for k, tc in enumerate(calls):
                where = f"messages[{i}].tool_calls[{k}].function"
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ChatError(f"{where} must be an object with a non-empty name")
                call_ids.add(tc.get("id"))
                norm.append({"id": tc.get("id"), "type": "function",
                             "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), where)}})
            if norm:
                msg["tool_calls"] = norm
        elif role == "tool":
            tid = m.get("tool_call_id")
            if call_ids is None or tid not in call_ids or tid is None:
                raise ChatError(f"messages[{i}] is a tool result for call id {tid!r}, but the assistant message "
                                "before it made no call with that id: send tool results right after the assistant "
                                "message whose tool_calls they answer, with its call ids")
            msg["tool_call_id"] = tid
        out.append(msg)
    # leading system (and developer) messages are one system prompt, joined by a blank line, as the reference
    # server serves them; a system message after the conversation started stays a V4.1 mid-conversation turn
    while len(out) > 1 and out[0]["role"] == "system" and out[1]["role"] == "system":
        second = out.pop(1)
        texts = [_text(out[0]["content"]), _text(second["content"])]
        out[0]["content"] = "\n\n".join(t for t in texts if t)
    return out


def _text(content: Any) -> str:
    """A system message's content as one string (text parts joined by blank lines, as the encoder joins them)."""
    if isinstance(content, list):
        return "\n\n".join(part["text"] for part in content)
    return content


def _tools(req: dict) -> tuple[list[dict], Any]:
    tools = req.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ChatError("tools must be a list", "tools")
    names = set()
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise ChatError(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"tools[{k}].function.name must be a non-empty string", "tools")
        if fn.get("parameters") is not None:      # OpenAI refuses a tool whose parameters are no JSON Schema
            problem = schema_problem(fn["parameters"], f"tools[{k}].function.parameters")
            if problem is not None:
                raise ChatError(f"invalid schema for function {fn['name']!r}: {problem}", "tools")
        names.add(fn["name"])
    choice = req.get("tool_choice")
    if choice in (None, "auto", "required"):
        pass
    elif choice == "none":
        tools = []  # "none" hides the tools: no tools block, and no call is parsed
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        if choice["function"].get("name") not in names:
            raise ChatError(f"tool_choice names {choice['function'].get('name')!r}, which is not in tools",
                            "tool_choice")
    else:
        raise ChatError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    if choice == "required" and not tools:
        raise ChatError('tool_choice "required" needs tools', "tool_choice")
    return tools, choice


def _response_format(req: dict) -> dict | None:
    rf = req.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ChatError('response_format must be {"type": "text" | "json_object" | "json_schema", ...}',
                        "response_format")
    if rf["type"] == "json_schema" and not isinstance(rf.get("json_schema"), dict):
        raise ChatError('response_format json_schema needs a "json_schema" object', "response_format")
    return rf


def _image_bytes(record: dict, allow_urls: bool) -> tuple[bytes | None, str | None, str | None]:
    """(data, media type, url) of one image record as the encoder returns it."""
    src = record.get("source")
    if isinstance(src, dict):  # Anthropic form
        if src.get("type") == "base64":
            return _b64(src.get("data")), src.get("media_type"), None
        url = src.get("url")
    else:
        url = record.get("url") or record.get("data")
    if not isinstance(url, str):
        raise ChatError("image input: an image part needs a data URL")
    m = _DATA_URL.fullmatch(url)
    if m:
        if ";base64" not in m.group("params"):
            raise ChatError("image input: image data URLs must be base64")
        return _b64(m.group("data")), m.group("media") or None, None
    if url.startswith(("http://", "https://")):
        if not allow_urls:
            raise ChatError("image input: image URLs are off on this server (send a base64 data URL)")
        return None, None, url
    raise ChatError("image input: an image must be a base64 data URL (data:image/png;base64,...)")


def _b64(data: Any) -> bytes:
    if not isinstance(data, str):
        raise ChatError("image input: image data must be a base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ChatError("image input: image data is not valid base64") from None


def build_chat_prompt(req: dict, tok: Tokenizer, shield: bool = True, *, default_thinking: bool = True,
                      default_effort: Any = None, max_images: int | None = None,
                      allow_image_urls: bool = False) -> ChatPrompt:
    """Validate an OpenAI chat request (a decoded JSON object) and render + tokenize its prompt.

    shield: client text is tokenized without special-token matching (the default; False = the reference's ids).
    default_thinking / default_effort: the server's --thinking / --reasoning-effort, used when the request says
    nothing. max_images: refuse more images than this (None: no limit here). allow_image_urls: http(s) image URLs
    are passed on (as ImageInput.url) instead of refused.
    """
    if not isinstance(req, dict):
        raise ChatError("the request body must be a JSON object", None)
    messages = _messages(req.get("messages"))
    thinking, effort = thinking_and_effort(req, default_thinking, default_effort)
    tools, tool_choice = _tools(req)
    rf = _response_format(req)
    rendered_rf = rf if rf is not None and rf["type"] != "text" else None
    if tools or rendered_rf:
        # the encoder renders tools and response_format only on a leading system message
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        if tools:
            messages[0]["tools"] = tools
        if rendered_rf:
            messages[0]["response_format"] = rendered_rf
    last = messages[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls")
    if prefill:
        # a final assistant message is a prefix for the reply to continue (Anthropic prefill): rendered without
        # its EOS, and the reply starts in content, after that turn's </think>
        last["wo_eos"] = True
    rendered = encode_messages(messages, "thinking" if thinking else "chat", reasoning_effort=effort, shield=shield)
    ids = tok.encode_pieces(rendered.pieces, shield=shield)
    if max_images is not None and len(rendered.images) > max_images:
        raise ChatError(f"image input: at most {max_images} images per conversation; this one has "
                        f"{len(rendered.images)}")
    positions = [k for k, t in enumerate(ids) if t == tok.image_id]
    if len(positions) != len(rendered.images):
        raise ChatError("image input: message text must not contain the image placeholder token")
    images = []
    for pos, record in zip(positions, rendered.images):
        data, media, url = _image_bytes(record, allow_image_urls)
        images.append(ImageInput(pos, data, media, url))
    shown_effort = (DEFAULT_EFFORT if effort is None else effort) if thinking else None
    # `thinking` tells the parser and the grammar whether the reply starts inside a think block
    return ChatPrompt(ids, rendered.prompt, thinking and not prefill, shown_effort, prefill, tools, tool_choice, rf,
                      images)
