"""The OpenAI Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) on the chat path.

A Responses body is converted into the chat completion body it means (`to_chat`), and that body goes through the very
steps `/v1/chat/completions` takes (`app.prepare_chat`: dsv41.chat.policy prompt, grammar, limits, sampling): same prompt
ids, same seed, same tokens. The chat parser's deltas become Responses output items and stream events.

Conversion (docs/apis.md): `instructions` -> a leading system message; `input` (a string, or items) -> messages:
`message` items (roles user/assistant/system/developer; parts input_text/output_text/input_image), `reasoning` items ->
the next assistant turn's `reasoning_content`, `function_call` -> that turn's `tool_calls`, `function_call_output` ->
`tool` messages. `tools` (function tools), `tool_choice`, `parallel_tool_calls`, `reasoning.effort` ("none" = no
thinking), `text.format` -> `response_format`, `max_output_tokens` -> `max_tokens`; sampling fields and the server
controls (`thinking_budget`, `loop_guard`, `priority`) pass through.

`store` (default true) keeps the response and its conversation in a bounded in-memory store (1,024 responses and 256
MiB, oldest out first); `previous_response_id` continues a stored conversation (its instructions are not carried
over, as OpenAI does).
"""
from __future__ import annotations

import collections
import secrets
import threading
import time
from typing import Any

import msgspec
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from dsv41.api import sse
from dsv41.api.app import (
    DELTA,
    ERROR,
    FINISH,
    KEEP,
    TOKEN,
    Prepared,
    collect,
    engine,
    json_response,
    prepare_chat,
    read_object,
    reply_events,
)
from dsv41.api.errors import ApiError, bad_request
from dsv41.sched.request import FinishEvent

STORE_MAX_RESPONSES = 1024
STORE_MAX_BYTES = 256 << 20


# ================================================================================================ the store
class ResponseStore:
    """Stored responses: id -> (response object, conversation as chat messages). Bounded by count and bytes; the
    oldest go first. Thread-safe (the routes run on one loop, but tests and tools may not)."""

    def __init__(self, max_count: int = STORE_MAX_RESPONSES, max_bytes: int = STORE_MAX_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: collections.OrderedDict[str, tuple[dict, list[dict], int]] = collections.OrderedDict()
        self.nbytes = 0
        self._lock = threading.Lock()

    def put(self, rid: str, response: dict, conversation: list[dict]) -> None:
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        with self._lock:
            if rid in self._items:
                self.nbytes -= self._items.pop(rid)[2]
            if size > self.max_bytes:
                return
            self._items[rid] = (response, conversation, size)
            self.nbytes += size
            while len(self._items) > self.max_count or self.nbytes > self.max_bytes:
                _, (_, _, n) = self._items.popitem(last=False)
                self.nbytes -= n

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            got = self._items.get(rid)
            return None if got is None else (got[0], got[1])

    def delete(self, rid: str) -> bool:
        with self._lock:
            got = self._items.pop(rid, None)
            if got is not None:
                self.nbytes -= got[2]
            return got is not None

    def __len__(self) -> int:
        return len(self._items)


def store_of(request: HttpRequest) -> ResponseStore:
    st = request.app.state.dsv41
    store = getattr(st, "responses_store", None)
    if store is None:
        store = st.responses_store = ResponseStore()
    return store


def _not_found(rid: str) -> ApiError:
    return ApiError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")


# ================================================================================================ request conversion
class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields /v1/responses reads, with their types (checked before `to_chat` converts the body; unknown fields
    are ignored). Items, tools and formats stay plain JSON here: `to_chat` validates them as it converts."""
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = None
    draft: bool = True
    thinking_budget: int | None = None
    loop_guard: bool | None = None
    priority: str | None = None
    background: bool | None = None          # refused when true
    user: str | None = None
    metadata: dict[str, str] | None = None


PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
          "reasoning_effort": "reasoning.effort", "chat_template_kwargs": "reasoning"}
_PASS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "parallel_tool_calls",
         "thinking_budget", "loop_guard", "priority", "chat_template_kwargs", "thinking", "cache_salt", "draft")
_UNSUPPORTED = {"background": "background responses are not served (send background: false)",
                "conversation": "conversations are not served; use previous_response_id",
                "prompt": "stored prompt templates are not served"}


def _parts(content: Any, where: str, role: str) -> Any:
    """Responses content (a string or parts) -> chat content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", param="input")
    out = []
    for j, p in enumerate(content):
        t = p.get("type") if isinstance(p, dict) else None
        if t in ("input_text", "output_text", "text", "summary_text", "reasoning_text") and \
                isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif t == "refusal" and isinstance(p.get("refusal"), str):
            out.append({"type": "text", "text": p["refusal"]})
        elif t == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise bad_request(f"{where}.content[{j}]: input_image needs an image_url (file ids are not "
                                  f"served)", param="input")
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad_request(f"{where}.content[{j}]: content part type {t!r} is not served (input_text, "
                              f"output_text, input_image)", param="input")
    if role != "user" and all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _text_of(parts: Any) -> str:
    if isinstance(parts, list):
        return "".join(p.get("text", "") for p in parts if isinstance(p, dict))
    return parts if isinstance(parts, str) else ""


def input_messages(items: Any) -> list[dict]:
    """Responses `input` -> chat messages (without the instructions)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("`input` must be a string or a list of input items", param="input")
    msgs: list[dict] = []
    reasoning: str | None = None

    def assistant(new: bool) -> dict:
        nonlocal reasoning
        last = msgs[-1] if msgs else None
        if new or last is None or last["role"] != "assistant" or last.get("_closed"):
            last = {"role": "assistant", "content": ""}
            msgs.append(last)
        if reasoning is not None:
            last["reasoning_content"] = reasoning
            reasoning = None
        return last

    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_request(f"{where} must be an object", param="input")
        t = it.get("type", "message")
        if t == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                                  param="input")
            content = _parts(it.get("content"), where, role)
            if role == "assistant":
                last = msgs[-1] if msgs else None
                fill = (last is not None and last["role"] == "assistant" and not last.get("tool_calls")
                        and not last.get("content") and not last.get("_closed"))
                m = assistant(new=not fill)
                m["content"] = content
            else:
                msgs.append({"role": role, "content": content})
        elif t == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            if not isinstance(parts, list):
                raise bad_request(f"{where}: reasoning content must be a list of parts", param="input")
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1]["_closed"] = True     # reasoning opens the next assistant turn
            reasoning = _text_of(parts)
        elif t == "function_call":
            name, args, cid = it.get("name"), it.get("arguments", "{}"), it.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(cid, str) or not cid:
                raise bad_request(f"{where}: a function_call item needs name and call_id", param="input")
            m = assistant(new=False)
            if not m.get("content"):
                m["content"] = None
            m.setdefault("tool_calls", []).append(
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
        elif t == "function_call_output":
            cid, out = it.get("call_id"), it.get("output")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where}: a function_call_output item needs call_id", param="input")
            msgs.append({"role": "tool", "tool_call_id": cid,
                         "content": out if isinstance(out, str) else _parts(out, where, "tool")})
        else:
            raise bad_request(f"{where}: input item type {t!r} is not served (message, reasoning, function_call, "
                              f"function_call_output)", param="input")
    if reasoning is not None:                  # reasoning with nothing after it: an assistant turn of its own
        msgs.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    for m in msgs:
        m.pop("_closed", None)
    return msgs


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("`tools` must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise bad_request(f"tools[{i}]: tool type {kind!r} is not served (only function tools)", param="tools")
        if isinstance(t.get("function"), dict):           # chat spelling, accepted too
            out.append(t)
            continue
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None or tc in ("auto", "none", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise bad_request("`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                      "\"name\": ...}", param="tool_choice")


def _format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("`text` must be an object", param="text")
    f = text.get("format")
    if f is None:
        return None
    t = f.get("type") if isinstance(f, dict) else None
    if t == "text":
        return None
    if t == "json_object":
        return {"type": "json_object"}
    if t == "json_schema":
        if not isinstance(f.get("schema"), dict):
            raise bad_request("text.format: a json_schema format needs a `schema` object", param="text.format")
        js = {k: f[k] for k in ("name", "schema", "strict", "description") if k in f}
        js.setdefault("name", "response")
        return {"type": "json_schema", "json_schema": js}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {t!r}", param="text.format")


def to_chat(body: dict, previous: list[dict] | None) -> tuple[dict, list[dict]]:
    """A Responses body -> (the chat completion body it means, its conversation without instructions)."""
    for k, why in _UNSUPPORTED.items():
        if body.get(k):
            raise bad_request(why, param=k)
    if "input" not in body:
        raise bad_request("`input` is required", param="input")
    conv = list(previous or []) + input_messages(body["input"])
    msgs = list(conv)
    ins = body.get("instructions")
    if ins is not None:
        if not isinstance(ins, str):
            raise bad_request("`instructions` must be a string", param="instructions")
        msgs.insert(0, {"role": "system", "content": ins})
    chat: dict = {"messages": msgs}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    for k in _PASS:
        if k in body:
            chat[k] = body[k]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    tc = _tool_choice(body.get("tool_choice"))
    if tc is not None:
        chat["tool_choice"] = tc
    rf = _format(body.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_request("`reasoning` must be an object", param="reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat, conv


# ================================================================================================ the response object
def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


class Items:
    """Builds the output items of one reply from chat deltas; `events` holds the stream events they imply."""

    def __init__(self, stream: bool):
        self.stream = stream
        self.output: list[dict] = []
        self.events: list[tuple[str, dict]] = []
        self.open: dict | None = None          # the item receiving deltas
        self.text: list[str] = []
        self.calls: dict[int, dict] = {}       # chat tool-call index -> function_call item

    def _ev(self, typ: str, **fields) -> None:
        if self.stream:
            self.events.append((typ, fields))

    def _begin(self, item: dict) -> None:
        self.close()
        self.output.append(item)
        self.open = item
        self.text = []
        self._ev("response.output_item.added", output_index=len(self.output) - 1, item=_snapshot(item))
        if item["type"] == "message":
            self._ev("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                     content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        elif item["type"] == "reasoning":
            self._ev("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                     content_index=0, part={"type": "reasoning_text", "text": ""})

    def close(self, status: str = "completed") -> None:
        item, self.open = self.open, None
        if item is None:
            return
        idx = self.output.index(item)
        text = "".join(self.text)
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            self._ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text,
                     logprobs=[])
            self._ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            self._ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                     text=text)
            self._ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part)
        elif item["type"] == "function_call":
            self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                     name=item["name"], arguments=item["arguments"])
        item["status"] = status
        self._ev("response.output_item.done", output_index=idx, item=_snapshot(item))

    def delta(self, d: dict) -> None:
        if "reasoning_content" in d:
            if self.open is None or self.open["type"] != "reasoning":
                self._begin({"id": _id("rs"), "type": "reasoning", "summary": [], "content": [],
                             "status": "in_progress"})
            self.text.append(d["reasoning_content"])
            self._ev("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                     content_index=0, delta=d["reasoning_content"])
        if d.get("content"):
            if self.open is None or self.open["type"] != "message":
                self._begin({"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                             "content": []})
            self.text.append(d["content"])
            self._ev("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                     content_index=0, delta=d["content"], logprobs=[])
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("id"):
                item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": tc["id"],
                        "name": fn.get("name", ""), "arguments": ""}
                self._begin(item)
                self.calls[tc.get("index", len(self.calls))] = item
            item = self.calls.get(tc.get("index", len(self.calls) - 1))
            piece = fn.get("arguments") or ""
            if item is not None and piece:
                item["arguments"] += piece
                self._ev("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=self.output.index(item), delta=piece)

    def finish(self, status: str) -> list[dict]:
        self.close(status)
        if not any(it["type"] in ("message", "function_call") for it in self.output):
            self._begin({"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                         "content": []})
            self.close(status)
        for it in self.output:
            it["status"] = status if it["status"] == "in_progress" else it["status"]
        return self.output


def _snapshot(item: dict) -> dict:
    return msgspec.json.decode(msgspec.json.encode(item))


def items_from_final(final) -> Items:
    """Output items of a non-streamed reply, from the chat parser's final message."""
    it = Items(stream=False)
    if final.reasoning_content:
        it.delta({"reasoning_content": final.reasoning_content})
    if final.content:
        it.delta({"content": final.content})
    for i, c in enumerate(final.tool_calls):
        it.delta({"tool_calls": [{"index": i, "id": c["id"], "function": c["function"]}]})
    return it


def response_object(rid: str, created: int, body: dict, chat: dict, run: Prepared | None, status: str,
                    output: list[dict], finish: FinishEvent | None = None) -> dict:
    r = run.r if run is not None else None
    usage = None
    if run is not None and finish is not None:
        n = len(r.output_ids)
        usage = {"input_tokens": r.prompt_len, "input_tokens_details": {"cached_tokens": r.cached_tokens}, "output_tokens": n,
                 "output_tokens_details": {"reasoning_tokens": run.reply.reasoning_tokens()},
                 "total_tokens": r.prompt_len + n}
    tools = [{"type": "function", **t["function"]} for t in chat.get("tools") or []]
    for t in tools:
        t.setdefault("strict", None)
        t.setdefault("parameters", None)
    tc = body.get("tool_choice", "auto")
    text = body.get("text") or {"format": {"type": "text"}}
    out = {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
           "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
           "model": run.model if run is not None else body.get("model"), "output": output,
           "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
           "previous_response_id": body.get("previous_response_id"),
           "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
           "store": body.get("store", True) is not False,
           "temperature": r.params.temperature if r is not None else body.get("temperature"),
           "text": text, "tool_choice": tc if tc is not None else "auto", "tools": tools,
           "top_p": r.params.top_p if r is not None else body.get("top_p"), "truncation": "disabled",
           "usage": usage, "user": body.get("user"), "metadata": body.get("metadata") or {}}
    if run is not None and finish is not None:
        out["dsv41"] = run.reply.info(bool(body.get("return_token_ids")))
        if finish.stop_sequence is not None:
            out["stop_sequence"] = finish.stop_sequence
    return out


def _status(fin: FinishEvent) -> str:
    return "incomplete" if fin.reason == "length" else "completed"


def _conversation_after(conv: list[dict], final) -> list[dict]:
    msg = final.message()
    return conv + [{k: v for k, v in msg.items() if k != "reasoning_content" or v}]


# ================================================================================================ routes
async def create_response(request: HttpRequest) -> Response:
    eng = engine(request)
    body = await read_object(request, ResponsesRequest)
    store = store_of(request)
    prev_id = body.get("previous_response_id")
    previous = None
    if prev_id is not None:
        got = store.get(prev_id) if isinstance(prev_id, str) else None
        if got is None:
            raise ApiError(400, f"Previous response with id '{prev_id}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        previous = got[1]
    chat, conv = to_chat(body, previous)
    run = await prepare_chat(eng, chat, params=PARAMS)
    rid = _id("resp")
    request.state.reply_id = run.r.tag = rid            # the access and `done` log lines name it
    created = int(time.time())
    keep = body.get("store", True) is not False
    if body.get("stream"):
        return StreamingResponse(_stream(request, eng, run, rid, created, body, chat, conv, store if keep else None),
                                 media_type="text/event-stream", headers=sse.HEADERS)
    fin, final = await collect(request, eng, run)
    status = _status(fin)
    output = items_from_final(final).finish(status)
    out = response_object(rid, created, body, chat, run, status, output, fin)
    if keep:
        store.put(rid, out, _conversation_after(conv, final))
    return json_response(out)


async def _stream(request, eng, run: Prepared, rid: str, created: int, body: dict, chat: dict, conv: list[dict],
                  store: ResponseStore | None):
    seq = 0

    def event(typ: str, fields: dict) -> bytes:
        nonlocal seq
        data = sse.frame({"type": typ, "sequence_number": seq, **fields})
        seq += 1
        return f"event: {typ}\n".encode() + data

    items = Items(stream=True)
    shell = response_object(rid, created, body, chat, run, "in_progress", [])
    yield event("response.created", {"response": shell})
    yield event("response.in_progress", {"response": shell})
    async for kind, v in reply_events(request, eng, run):
        if kind == TOKEN:
            continue
        if kind == KEEP:
            yield sse.KEEPALIVE
        elif kind == DELTA:
            items.delta(v)
        elif kind == ERROR:
            failed = response_object(rid, created, body, chat, run, "failed", items.output)
            failed["error"] = {"code": "server_error", "message": v.message}
            yield event("error", {"code": "server_error", "message": v.message, "param": None})
            yield event("response.failed", {"response": failed})
            return
        else:                                   # FINISH
            fin, final = v
            status = _status(fin)
            output = items.finish(status)
        for typ, fields in items.events:
            yield event(typ, fields)
        items.events.clear()
        if kind == FINISH:
            out = response_object(rid, created, body, chat, run, status, output, fin)
            if store is not None:
                store.put(rid, out, _conversation_after(conv, final))
            yield event("response.completed" if status == "completed" else "response.incomplete",
                        {"response": out})
            return


async def get_response(request: HttpRequest) -> Response:
    rid = request.path_params["response_id"]
    got = store_of(request).get(rid)
    if got is None:
        raise _not_found(rid)
    return json_response(got[0])


async def delete_response(request: HttpRequest) -> Response:
    rid = request.path_params["response_id"]
    if not store_of(request).delete(rid):
        raise _not_found(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})


def routes() -> list:
    from starlette.routing import Route
    return [Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])]
