"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the chat path.

A Messages body is converted into the chat completion body it means (`to_chat`) and submitted through the same steps
as `/v1/chat/completions` (dsv41.api.app.prepare_chat): same prompt ids, sampling, grammar, tokens. The chat
parser's deltas become content blocks (thinking, text, tool_use) and Anthropic stream events.

Conversion (docs/apis.md): `system` (a string or text blocks) -> a leading system message; user `text`/`image`
blocks -> a user message, `tool_result` blocks -> `tool` messages (before the user's other blocks); assistant `text`
-> content, `thinking` -> `reasoning_content`, `tool_use` -> `tool_calls`; `tools` (`input_schema`) -> function tools;
`tool_choice` auto/any/tool/none -> auto/required/named/none (`disable_parallel_tool_use` -> at most one call);
`thinking` {enabled, budget_tokens} -> thinking on with that thinking budget, {disabled} -> off, absent -> the
server's `--thinking`; `stop_sequences` -> `stop`. Errors are Anthropic-shaped:
`{"type": "error", "error": {"type": "invalid_request_error" | ..., "message": ...}}`.
"""
from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

import msgspec
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from dsv41.api import limits, sse
from dsv41.api.app import (
    DELTA,
    ERROR,
    KEEP,
    TOKEN,
    chat_controls,
    chat_grammar,
    chat_prompt,
    collect,
    engine,
    json_response,
    prepare_chat,
    read_object,
    reply_events,
)
from dsv41.api.errors import ApiError, bad_request
from dsv41.api.schemas import ReasoningEffort

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 501: "not_found_error", 503: "overloaded_error",
               529: "overloaded_error"}
PARAMS = {"max_tokens": "max_tokens", "response_format": "output_format", "stop": "stop_sequences",
          "chat_template_kwargs": "thinking"}
_PASS = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "thinking_budget", "loop_guard",
         "priority", "chat_template_kwargs", "reasoning_effort", "cache_salt", "draft")
PING = b'event: ping\ndata: {"type":"ping"}\n\n'


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(e: ApiError) -> Response:
    headers = {k: v for k, v in e.headers.items()}
    return Response(msgspec.json.encode(error_body(e.status, e.message)), status_code=e.status,
                    media_type="application/json", headers=headers)


def anthropic_errors(handler):
    """Route wrapper: every ApiError of the route comes out in Anthropic's shape (and status)."""
    async def wrapped(request: HttpRequest) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
    wrapped.__name__ = handler.__name__
    return wrapped


# ================================================================================================ request conversion
class CountTokensRequest(msgspec.Struct, kw_only=True):
    """The fields /v1/messages/count_tokens reads, with their types (checked before `to_chat` converts the body;
    unknown fields are ignored). Messages, tools and blocks stay plain JSON: `to_chat` validates them."""
    messages: list[dict[str, Any]]
    model: str | None = None
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    thinking_budget: int | None = None
    loop_guard: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    cache_salt: str | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """The fields /v1/messages reads (as count_tokens, plus the reply's)."""
    max_tokens: int
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    draft: bool = True
    priority: str | None = None
    metadata: dict[str, Any] | None = None


def _text_blocks(v: Any, where: str, param: str) -> str:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", param=param)
    out = []
    for j, b in enumerate(v):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{j}] must be a text block", param=param)
        out.append(b["text"])
    return "\n\n".join(out) if param == "system" else "".join(out)


def _image(b: dict, where: str) -> dict:
    src = b.get("source")
    if not isinstance(src, dict) or src.get("type") not in ("base64", "url"):
        raise bad_request(f"{where}: an image block needs a base64 or url source", param="messages")
    return {"type": "image", "source": src}


def _tool_result_content(c: Any, where: str) -> Any:
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", param="messages")
    parts = []
    for j, b in enumerate(c):
        t = b.get("type") if isinstance(b, dict) else None
        if t == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif t == "image":
            parts.append(_image(b, f"{where}.content[{j}]"))
        else:
            raise bad_request(f"{where}.content[{j}]: block type {t!r} is not served in a tool result (text, image)",
                              param="messages")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool_call_id(anthropic_id: str) -> str:
    return anthropic_id


def messages_to_chat(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be \"user\" or \"assistant\"", param="messages")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", param="messages")
        if role == "user":
            tools, parts = [], []
            for j, b in enumerate(content):
                t = b.get("type") if isinstance(b, dict) else None
                w = f"{where}.content[{j}]"
                if t == "text" and isinstance(b.get("text"), str):
                    parts.append({"type": "text", "text": b["text"]})
                elif t == "image":
                    parts.append(_image(b, w))
                elif t == "tool_result":
                    tid = b.get("tool_use_id")
                    if not isinstance(tid, str) or not tid:
                        raise bad_request(f"{w}: a tool_result block needs tool_use_id", param="messages")
                    tools.append({"role": "tool", "tool_call_id": _tool_call_id(tid),
                                  "content": _tool_result_content(b.get("content"), w)})
                else:
                    raise bad_request(f"{w}: block type {t!r} is not served in a user message (text, image, "
                                      f"tool_result)", param="messages")
            out.extend(tools)
            if parts or not tools:
                text_only = all(p["type"] == "text" for p in parts)
                out.append({"role": "user",
                            "content": "".join(p["text"] for p in parts) if text_only else parts})
        else:
            msg: dict = {"role": "assistant", "content": ""}
            texts, calls, thinking = [], [], []
            for j, b in enumerate(content):
                t = b.get("type") if isinstance(b, dict) else None
                w = f"{where}.content[{j}]"
                if t == "text" and isinstance(b.get("text"), str):
                    texts.append(b["text"])
                elif t == "thinking" and isinstance(b.get("thinking"), str):
                    thinking.append(b["thinking"])
                elif t == "redacted_thinking":
                    continue
                elif t == "tool_use":
                    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                        raise bad_request(f"{w}: a tool_use block needs id and name", param="messages")
                    inp = b.get("input", {})
                    if not isinstance(inp, dict):
                        raise bad_request(f"{w}: tool_use input must be an object", param="messages")
                    calls.append({"id": _tool_call_id(b["id"]), "type": "function",
                                  "function": {"name": b["name"], "arguments": inp}})
                else:
                    raise bad_request(f"{w}: block type {t!r} is not served in an assistant message (text, "
                                      f"thinking, tool_use)", param="messages")
            msg["content"] = "".join(texts) if texts or not calls else None
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("`tools` must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else t
            raise bad_request(f"tools[{i}]: only custom tools with a name and input_schema are served (got type "
                              f"{kind!r})", param="tools")
        schema = t.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}].input_schema must be an object", param="tools")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any) -> tuple[Any, bool]:
    """-> (chat tool_choice, parallel allowed)."""
    if tc is None:
        return None, True
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("`tool_choice` must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                          param="tool_choice")
    parallel = tc.get("disable_parallel_tool_use") is not True
    t = tc["type"]
    if t == "tool":
        if not isinstance(tc.get("name"), str):
            raise bad_request("tool_choice {\"type\": \"tool\"} needs a name", param="tool_choice")
        return {"type": "function", "function": {"name": tc["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[t], parallel


def to_chat(body: dict, *, counting: bool = False) -> dict:
    """A Messages body -> the chat completion body it means."""
    msgs = messages_to_chat(body.get("messages"))
    if body.get("system") is not None:
        msgs.insert(0, {"role": "system", "content": _text_blocks(body["system"], "`system`", "system")})
    chat: dict = {"messages": msgs}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if not counting:
        mt = body.get("max_tokens")
        if mt is None:
            raise bad_request("max_tokens: Field required", param="max_tokens")
        chat["max_tokens"] = mt
    for k in _PASS:
        if k in body:
            chat[k] = body[k]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("`stop_sequences` must be a list of strings", param="stop_sequences")
        chat["stop"] = stops
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    tc, parallel = _tool_choice(body.get("tool_choice"))
    if tc is not None:
        chat["tool_choice"] = tc
    if not parallel:
        chat["parallel_tool_calls"] = False
    th = body.get("thinking")
    if th is not None:
        t = th.get("type") if isinstance(th, dict) else None
        if t == "enabled":
            b = th.get("budget_tokens")
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise bad_request("thinking.budget_tokens must be a positive integer", param="thinking")
            chat["thinking"] = {"type": "enabled"}
            if "thinking_budget" not in body:
                chat["thinking_budget"] = b
        elif t in ("disabled", "adaptive"):
            chat["thinking"] = {"type": "disabled" if t == "disabled" else "enabled"}
        else:
            raise bad_request("`thinking` must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                              "{\"type\": \"disabled\"}", param="thinking")
    fmt = body.get("output_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request("`output_format` must be {\"type\": \"json_schema\", \"schema\": {...}}",
                              param="output_format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return chat


# ================================================================================================ the reply
def _toolu(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


def _signature(thinking: str) -> str:
    return "dsv41-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _stop_reason(fin, has_calls: bool) -> str:
    if has_calls:
        return "tool_use"
    if fin.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if fin.reason == "length" else "end_turn"


def _input(arguments: str) -> dict:
    try:
        v = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def content_blocks(final) -> list[dict]:
    out: list[dict] = []
    if final.reasoning_content:
        out.append({"type": "thinking", "thinking": final.reasoning_content,
                    "signature": _signature(final.reasoning_content)})
    if final.content or not final.tool_calls:
        out.append({"type": "text", "text": final.content})
    for c in final.tool_calls:
        out.append({"type": "tool_use", "id": _toolu(c["id"]), "name": c["function"]["name"],
                    "input": _input(c["function"]["arguments"])})
    return out


def _usage(run, output: bool = True) -> dict:
    r = run.r
    # Anthropic counts cache reads apart from input_tokens
    return {"input_tokens": r.prompt_len - r.cached_tokens, "output_tokens": len(r.output_ids) if output else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": r.cached_tokens}


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


# ================================================================================================ routes
@anthropic_errors
async def create_message(request: HttpRequest) -> Response:
    eng = engine(request)
    body = await read_object(request, MessagesRequest)
    run = await prepare_chat(eng, to_chat(body), params=PARAMS)
    mid = _message_id()
    request.state.reply_id = run.r.tag = mid            # the access and `done` log lines name it
    if body.get("stream"):
        return StreamingResponse(_stream(request, eng, run, mid, bool(body.get("return_token_ids"))),
                                 media_type="text/event-stream", headers=sse.HEADERS)
    fin, final = await collect(request, eng, run)
    out = {"id": mid, "type": "message", "role": "assistant", "model": run.model, "content": content_blocks(final),
           "stop_reason": _stop_reason(fin, bool(final.tool_calls)), "stop_sequence": fin.stop_sequence,
           "usage": _usage(run), "dsv41": run.reply.info(bool(body.get("return_token_ids")))}
    return json_response(out)


def _event(typ: str, data: dict) -> bytes:
    return f"event: {typ}\n".encode() + sse.frame({"type": typ, **data})


async def _stream(request, eng, run, mid: str, want_ids: bool):
    yield _event("message_start", {"message": {"id": mid, "type": "message", "role": "assistant", "model": run.model,
                                               "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": _usage(run, output=False)}})
    yield PING
    index = -1
    open_kind: str | None = None
    thinking: list[str] = []
    calls: dict[int, int] = {}          # chat call index -> block index

    def stop_block() -> list[bytes]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(_event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": _signature("".join(thinking))}}))
        if open_kind is not None:
            out.append(_event("content_block_stop", {"index": index}))
        open_kind = None
        return out

    def start_block(kind: str, block: dict) -> list[bytes]:
        nonlocal index, open_kind
        out = stop_block()
        index += 1
        open_kind = kind
        out.append(_event("content_block_start", {"index": index, "content_block": block}))
        return out

    has_calls = False
    async for kind, v in reply_events(request, eng, run):
        if kind == TOKEN:
            continue
        if kind == KEEP:
            yield PING
            continue
        if kind == ERROR:
            yield _event("error", {"error": {"type": ERROR_TYPES.get(v.status, "api_error"), "message": v.message}})
            return
        if kind == DELTA:
            d = v
            if d.get("reasoning_content"):
                if open_kind != "thinking":
                    for b in start_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield b
                thinking.append(d["reasoning_content"])
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": d["reasoning_content"]}})
            if d.get("content"):
                if open_kind != "text":
                    for b in start_block("text", {"type": "text", "text": ""}):
                        yield b
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "text_delta", "text": d["content"]}})
            for tc in d.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if tc.get("id"):
                    has_calls = True
                    for b in start_block("tool_use", {"type": "tool_use", "id": _toolu(tc["id"]),
                                                      "name": fn.get("name", ""), "input": {}}):
                        yield b
                    calls[tc.get("index", len(calls))] = index
                piece = fn.get("arguments") or ""
                if piece:
                    yield _event("content_block_delta", {"index": calls.get(tc.get("index"), index), "delta": {
                        "type": "input_json_delta", "partial_json": piece}})
            continue
        fin, final = v
        if index < 0:                   # nothing streamed: one empty text block, as the JSON reply has
            for b in start_block("text", {"type": "text", "text": ""}):
                yield b
        for b in stop_block():
            yield b
        delta = {"stop_reason": _stop_reason(fin, has_calls or bool(final.tool_calls)),
                 "stop_sequence": fin.stop_sequence}
        yield _event("message_delta", {"delta": delta, "usage": {"output_tokens": len(run.r.output_ids)},
                                       "dsv41": run.reply.info(want_ids)})
        yield _event("message_stop", {})
        return


@anthropic_errors
async def count_tokens(request: HttpRequest) -> Response:
    eng = engine(request)
    chat = to_chat(await read_object(request, CountTokensRequest), counting=True)
    chat_controls(eng, chat)
    prompt = await limits.off_loop(eng, chat_prompt, eng, chat, param="messages")      # off the event loop
    # a tool_choice / schema the server cannot serve is refused here too
    await limits.off_loop(eng, chat_grammar, eng, chat, prompt, what="grammar")
    ids = await eng.images.prompt_ids(prompt) if prompt.images else prompt.token_ids    # an image: its span
    return json_response({"input_tokens": len(ids)})


def routes() -> list:
    from starlette.routing import Route
    return [Route("/v1/messages", create_message, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
