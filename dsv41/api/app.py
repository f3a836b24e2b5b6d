"""The starlette app: OpenAI-compatible routes on top of the scheduler.

One request, end to end: the body is decoded into a msgspec Struct (400 naming the bad field), the prompt is built
(chat: dsv41.chat.policy renders and tokenizes the messages; completions: the given ids or the string's tokens),
limits are resolved (context, max_tokens), a sched Request is submitted, and its events become one JSON body or SSE
frames (`: keepalive` comments while nothing is due). A client that goes away cancels its request; the scheduler
frees its sequence at the next round boundary.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import secrets
import time
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dsv41.api import anthropic, responses, sse
from dsv41.api.auth import OPEN_PATHS, KeyCheck
from dsv41.api.errors import ApiError, bad_request, context_exceeded, from_decode_error
from dsv41.api.metrics import Metrics
from dsv41.api.schemas import (ChatCompletionRequest, CompletionRequest, CompletionTokensDetails, DetokenizeRequest,
                               ModelCard, ModelList, PromptTokensDetails, SamplingFields, TokenizeRequest, Usage)
from dsv41.sched.request import FinishEvent, Request, TokenEvent
from dsv41.sched.sampler import MAX_TOP_LOGPROBS, SamplingParams, prompt_seed, random_seed
from dsv41.sched.scheduler import QueueFull, ShuttingDown, TooLarge

log = logging.getLogger("dsv41.api")

MAX_STOP_STRINGS = 16


class AppState:
    """Shared by the routes: the engine once loaded (None while loading), metrics, keys."""

    def __init__(self, cfg, metrics: Metrics):
        self.cfg = cfg
        self.metrics = metrics
        self.keys = KeyCheck(cfg.api_key)
        self.engine = None
        self.load_error: str | None = None


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _engine(request: HttpRequest):
    st: AppState = request.app.state.dsv41
    if st.engine is None:
        msg = f"the model failed to load: {st.load_error}" if st.load_error else "the model is loading; retry shortly"
        raise ApiError(503, msg, type="server_error")
    return st.engine


def _decode(body: bytes, typ):
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise from_decode_error(e) from None
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None


# ------------------------------------------------------------------------------------------------ request fields
def _check_number(name: str, v: float | None, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False) -> None:
    if v is None:
        return
    if not math.isfinite(v):
        raise bad_request(f"`{name}` must be a finite number", param=name)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise bad_request(f"`{name}` must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise bad_request(f"`{name}` must be <= {hi}, got {v}", param=name)


def _stops(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"`stop` takes at most {MAX_STOP_STRINGS} strings", param="stop")
    return [s for s in stops if s]


def _sampling(eng, f: SamplingFields, prompt_ids: list[int], logprobs: bool, top_logprobs: int) -> SamplingParams:
    cfg = eng.cfg
    if f.n is not None and f.n != 1:
        raise bad_request(f"`n` must be 1 (this server returns one choice per request), got {f.n}", param="n")
    _check_number("temperature", f.temperature)
    _check_number("top_p", f.top_p, 0.0, 1.0, lo_open=True)
    _check_number("min_p", f.min_p, 0.0, 1.0)
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"`top_logprobs` must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}",
                          param="top_logprobs")
    if f.seed is not None:
        seed = f.seed & ((1 << 64) - 1)
    elif cfg.seed_random:
        seed = random_seed()
    else:
        seed = prompt_seed(prompt_ids, cfg.seed_salt)
    return SamplingParams(
        temperature=cfg.temperature if f.temperature is None else f.temperature,
        top_p=cfg.top_p if f.top_p is None else f.top_p,
        top_k=cfg.top_k if f.top_k is None else f.top_k,
        min_p=cfg.min_p if f.min_p is None else f.min_p,
        seed=seed, logprobs=logprobs, top_logprobs=top_logprobs)


def _max_tokens(eng, prompt_len: int, asked: int | None, param: str, asked_name: str = "max_tokens") -> int:
    limit = eng.context_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param=param)
    if prompt_len >= limit:
        raise context_exceeded(limit, prompt_len, asked, param)
    if asked is None:
        return min(eng.cfg.max_tokens, limit - prompt_len)
    if asked < 1:
        raise bad_request(f"`{asked_name}` must be at least 1, got {asked}", param=asked_name)
    if prompt_len + asked > limit:
        raise context_exceeded(limit, prompt_len, asked, param)
    return asked


def _submit(eng, r: Request) -> Request:
    try:
        return eng.sched.submit(r)
    except (QueueFull, ShuttingDown) as e:
        raise ApiError(503, str(e), type="server_error") from None
    except TooLarge as e:
        raise bad_request(str(e), param="max_tokens", code="context_length_exceeded") from None


def _detokenizer(eng):
    from dsv41.chat.tokenizer import IncrementalDetokenizer
    return IncrementalDetokenizer(eng.tok)


# ------------------------------------------------------------------------------------------------ reply pieces
class Reply:
    """Accumulates one request's events into what the response needs: ids, text, logprobs, timing."""

    def __init__(self, eng, r: Request, thinking: bool):
        self.eng = eng
        self.r = r
        self.thinking = thinking
        self.finish: FinishEvent | None = None

    def usage(self) -> Usage:
        n = len(self.r.output_ids)
        return Usage(self.r.prompt_len, n, self.r.prompt_len + n, PromptTokensDetails(self.r.cached_tokens),
                     CompletionTokensDetails(self.reasoning_tokens()))

    def reasoning_tokens(self) -> int:
        if not self.thinking:
            return 0
        ids = self.r.output_ids
        end = self.eng.think_end_id
        if end is not None and end in ids:
            return ids.index(end) + 1
        return len(ids)

    def token_str(self, tid: int) -> str:
        return self.eng.tok.decode([tid])

    def chat_logprob(self, ev: TokenEvent) -> dict:
        s = ev.sample
        t = self.token_str(s.token_id)
        return {"token": t, "logprob": s.logprob, "bytes": list(t.encode("utf-8")),
                "top_logprobs": [{"token": (ts := self.token_str(i)), "logprob": lp, "bytes": list(ts.encode())}
                                 for i, lp in (s.top or [])]}

    def token_sha(self) -> str:
        return hashlib.sha256(",".join(map(str, self.r.output_ids)).encode()).hexdigest()[:12]


async def _events(eng, r: Request):
    async for ev in eng.sched.stream(r):
        yield ev


async def _watch_disconnect(request: HttpRequest, eng, r: Request) -> None:
    """For non-streamed replies: the only message left on the socket is the disconnect."""
    while not r.finished:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            if not r.finished:
                request.app.state.dsv41.metrics.client_disconnections_total += 1
                eng.sched.cancel(r)
            return


async def _collect(request: HttpRequest, eng, r: Request, on_event) -> FinishEvent:
    watcher = asyncio.ensure_future(_watch_disconnect(request, eng, r))
    try:
        async for ev in _events(eng, r):
            on_event(ev)
            if isinstance(ev, FinishEvent):
                return ev
    finally:
        watcher.cancel()
        if not r.finished:
            eng.sched.cancel(r)
    raise RuntimeError("event stream ended without a finish")   # pragma: no cover


def _finish_error(ev: FinishEvent) -> ApiError:
    if ev.reason == "cancelled":
        return ApiError(503, "the request was cancelled (server shutting down)", type="server_error")
    return ApiError(500, ev.error or "the engine failed", type="server_error")


# ------------------------------------------------------------------------------------------------ chat
def _chat_prompt(eng, raw: dict):
    """Render and tokenize a chat request with the server's defaults (dsv41.chat.policy); ChatError -> 400."""
    from dsv41.chat import policy
    from dsv41.chat.errors import ChatError
    try:
        prompt = policy.build_chat_prompt(raw, eng.tok, shield=True, default_thinking=eng.cfg.thinking,
                                          default_effort=eng.cfg.reasoning_effort)
    except ChatError as e:
        raise bad_request(e.message, param=e.param) from None
    if prompt.images:
        raise bad_request("image input is not served by this server yet", param="messages")
    return prompt


def _grammar(eng, raw: dict, prompt):
    """The reply's grammar matcher (structured output, forced tool calls), or None; GrammarError -> 400."""
    from dsv41.grammar.compile import GrammarError, compile_request
    try:
        spec = compile_request(raw, eng.tok, tools=prompt.tools, thinking=prompt.thinking)
    except GrammarError as e:
        raise bad_request(e.message, param=e.param) from None
    return spec.matcher() if spec is not None else None


def _finish_reason(reason: str, final) -> str:
    """"tool_calls" for a reply that ended on its calls; a reply cut by max_tokens stays "length" even inside a call
    (its arguments may be cut short), as OpenAI and vLLM report it."""
    return "tool_calls" if final.tool_calls and reason != "length" else reason


async def chat_completions(request: HttpRequest) -> Response:
    eng = _engine(request)
    body = await request.body()
    req = _decode(body, ChatCompletionRequest)
    raw = msgspec.json.decode(body)
    if not req.messages:
        raise bad_request("`messages` must hold at least one message", param="messages")
    prompt = _chat_prompt(eng, raw)
    matcher = _grammar(eng, raw, prompt)
    ids = list(prompt.token_ids)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(eng, len(ids), asked, "messages",
                             "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    params = _sampling(eng, req, ids, bool(req.logprobs), (req.top_logprobs or 0) if req.logprobs else 0)
    from dsv41.sched.controls import (ControlError, ControlledRequest, parse_controls, reasoning_control,
                                      wait_background_turn)
    try:
        budget, loop_guard, background = parse_controls(raw, default_budget=eng.cfg.thinking_budget,
                                                        default_loop_guard=eng.cfg.loop_guard)
    except ControlError as e:
        raise bad_request(e.message, param=e.param) from None
    control = reasoning_control(eng.tok, thinking=prompt.thinking, grammar=matcher is not None, budget=budget,
                                loop_guard=loop_guard)
    if background:
        await wait_background_turn(eng.sched)
    r = _submit(eng, ControlledRequest(prompt_ids=ids, params=params, max_tokens=max_tokens, eos_ids=eng.eos_ids,
                                       ignore_eos=req.ignore_eos, stop=_stops(req.stop),
                                       detokenizer=_detokenizer(eng), matcher=matcher, control=control,
                                       cache_salt=req.cache_salt))
    from dsv41.chat.parser import ReplyParser
    tools = getattr(prompt, "tools", None) or None
    parser = ReplyParser(thinking=prompt.thinking, tools=tools,
                         parallel_tool_calls=req.parallel_tool_calls is not False)
    reply = Reply(eng, r, prompt.thinking)
    rid = "chatcmpl-" + secrets.token_hex(16)
    model = req.model if req.model in (eng.name,) else eng.name
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        gen = _chat_stream(request, eng, r, reply, parser, rid, model, bool(tools), include_usage,
                           req.return_token_ids)
        return StreamingResponse(gen, media_type="text/event-stream", headers=sse.HEADERS)

    logprobs: list[dict] = []

    def on_event(ev):
        if isinstance(ev, TokenEvent):
            if ev.text:
                parser.feed(ev.text)
            if req.logprobs:
                logprobs.append(reply.chat_logprob(ev))
        elif ev.text:
            parser.feed(ev.text)

    fin = await _collect(request, eng, r, on_event)
    if fin.reason in ("cancelled", "error"):
        raise _finish_error(fin)
    _, final = parser.finish()
    message = final.message()
    finish_reason = _finish_reason(fin.reason, final)
    choice = {"index": 0, "message": message, "logprobs": {"content": logprobs} if req.logprobs else None,
              "finish_reason": finish_reason}
    if fin.stop_sequence is not None:
        choice["stop_reason"] = fin.stop_sequence
    if req.return_token_ids:
        choice["token_ids"] = list(r.output_ids)
    out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": [choice],
           "usage": reply.usage(), "exact_mode": "exact",
           "dsv41": {"token_sha": reply.token_sha(), "seed": r.params.seed,
                     "sampling": "greedy" if r.params.greedy else "exact"}}
    if fin.stop_sequence is not None:
        out["stop_sequence"] = fin.stop_sequence
    return _json(out)


async def _chat_stream(request, eng, r: Request, reply: Reply, parser, rid: str, model: str, has_tools: bool,
                       include_usage: bool, return_ids: bool):
    created = int(time.time())
    metrics = request.app.state.dsv41.metrics

    def chunk(delta: dict, finish_reason=None, logprobs=None, **extra) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                  "finish_reason": finish_reason}
        choice.update(extra)
        return sse.frame({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                          "choices": [choice]})

    pending_lp: list[dict] = []
    done = False
    try:
        if not has_tools:                       # role right after the headers; with tools, before the first delta
            for d in parser.role_delta():
                yield chunk(d)
        async for ev in sse.with_keepalive(_events(eng, r), eng.cfg.keepalive_s):
            if ev is sse.KEEPALIVE:
                yield ev
                continue
            deltas = parser.feed(ev.text) if ev.text else []
            if isinstance(ev, TokenEvent) and r.params.logprobs:
                pending_lp.append(reply.chat_logprob(ev))
            if isinstance(ev, FinishEvent):
                if ev.reason in ("cancelled", "error"):
                    err = _finish_error(ev)
                    yield sse.frame({"error": {"message": err.message, "type": "server_error"}})
                    yield sse.DONE
                    done = True
                    return
                tail, final = parser.finish()
                deltas = list(deltas) + list(tail)
            for d in deltas:
                if "role" not in d:
                    for d0 in parser.role_delta():
                        yield chunk(d0)
                yield chunk(d, logprobs=pending_lp or None)
                pending_lp = []
            if isinstance(ev, TokenEvent):
                continue
            for d0 in parser.role_delta():
                yield chunk(d0)
            extra = {}
            if ev.stop_sequence is not None:
                extra["stop_reason"] = ev.stop_sequence
            if return_ids:
                extra["token_ids"] = list(r.output_ids)
            yield chunk({}, _finish_reason(ev.reason, final), logprobs=pending_lp or None, **extra)
            if include_usage:
                yield sse.frame({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                 "choices": [], "usage": msgspec.to_builtins(reply.usage())})
            yield sse.DONE
            done = True
            return
    finally:
        if not done and not r.finished:
            metrics.client_disconnections_total += 1
            eng.sched.cancel(r)


# ------------------------------------------------------------------------------------------------ completions
def _completion_prompt(eng, req: CompletionRequest) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and any(not isinstance(x, int) for x in p):
        if len(p) != 1:
            raise bad_request("batched prompts are not served: send one prompt (a string or a list of token ids) "
                              "per request", param="prompt")
        p = p[0]
        if isinstance(p, list) and any(not isinstance(x, int) for x in p):
            raise bad_request("`prompt` must be a string or a list of token ids", param="prompt")
    if isinstance(p, str):
        ids = eng.tok.encode(p, special=True)
        if req.add_special_tokens:
            ids = [eng.bos_id] + ids
        return ids
    bad = [t for t in p if not 0 <= t < eng.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{eng.vocab_size - 1})", param="prompt")
    return list(p)


async def completions(request: HttpRequest) -> Response:
    eng = _engine(request)
    body = await request.body()
    req = _decode(body, CompletionRequest)
    if req.suffix:
        raise bad_request("`suffix` is not supported", param="suffix")
    if req.echo:
        raise bad_request("`echo` is not supported", param="echo")
    ids = _completion_prompt(eng, req)
    max_tokens = _max_tokens(eng, len(ids), req.max_tokens, "prompt")
    want_lp = req.logprobs is not None
    params = _sampling(eng, req, ids, want_lp, req.logprobs or 0)
    r = _submit(eng, Request(prompt_ids=ids, params=params, max_tokens=max_tokens, eos_ids=eng.eos_ids,
                             ignore_eos=req.ignore_eos, stop=_stops(req.stop), detokenizer=_detokenizer(eng),
                             cache_salt=req.cache_salt))
    reply = Reply(eng, r, thinking=False)
    rid = "cmpl-" + secrets.token_hex(16)
    model = req.model if req.model in (eng.name,) else eng.name
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_completion_stream(request, eng, r, reply, rid, model, include_usage,
                                                    req.return_token_ids, want_lp),
                                 media_type="text/event-stream", headers=sse.HEADERS)
    texts: list[str] = []
    lp = _LegacyLogprobs(reply) if want_lp else None

    def on_event(ev):
        if ev.text:
            texts.append(ev.text)
        if lp is not None and isinstance(ev, TokenEvent):
            lp.add(ev)

    fin = await _collect(request, eng, r, on_event)
    if fin.reason in ("cancelled", "error"):
        raise _finish_error(fin)
    choice = {"index": 0, "text": "".join(texts), "logprobs": lp.body() if lp else None,
              "finish_reason": fin.reason}
    if fin.stop_sequence is not None:
        choice["stop_reason"] = fin.stop_sequence
    if req.return_token_ids:
        choice["token_ids"] = list(r.output_ids)
        choice["prompt_token_ids"] = ids
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [choice], "usage": reply.usage(), "exact_mode": "exact",
           "dsv41": {"token_sha": reply.token_sha(), "seed": r.params.seed,
                     "sampling": "greedy" if r.params.greedy else "exact"}}
    if fin.stop_sequence is not None:
        out["stop_sequence"] = fin.stop_sequence
    return _json(out)


class _LegacyLogprobs:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs (dicts), text_offset."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top: list[dict] = []
        self.offsets: list[int] = []
        self.offset = 0

    def add(self, ev: TokenEvent) -> dict:
        t = self.reply.token_str(ev.token_id)
        start = len(self.tokens)
        self.tokens.append(t)
        self.token_logprobs.append(ev.sample.logprob)
        self.top.append({self.reply.token_str(i): lp for i, lp in (ev.sample.top or [])})
        self.offsets.append(self.offset)
        self.offset += len(t)
        return start

    def body(self, start: int = 0) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top[start:], "text_offset": self.offsets[start:]}


async def _completion_stream(request, eng, r: Request, reply: Reply, rid: str, model: str, include_usage: bool,
                             return_ids: bool, want_lp: bool):
    created = int(time.time())
    metrics = request.app.state.dsv41.metrics
    lp = _LegacyLogprobs(reply) if want_lp else None
    sent_lp = 0

    def chunk(text: str, finish_reason=None, **extra) -> bytes:
        nonlocal sent_lp
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if lp is not None and len(lp.tokens) > sent_lp:
            choice["logprobs"] = lp.body(sent_lp)
            sent_lp = len(lp.tokens)
        choice.update(extra)
        return sse.frame({"id": rid, "object": "text_completion", "created": created, "model": model,
                          "choices": [choice]})

    done = False
    try:
        async for ev in sse.with_keepalive(_events(eng, r), eng.cfg.keepalive_s):
            if ev is sse.KEEPALIVE:
                yield ev
                continue
            if isinstance(ev, TokenEvent):
                if lp is not None:
                    lp.add(ev)
                if ev.text or lp is not None:
                    yield chunk(ev.text)
                continue
            if ev.reason in ("cancelled", "error"):
                err = _finish_error(ev)
                yield sse.frame({"error": {"message": err.message, "type": "server_error"}})
                yield sse.DONE
                done = True
                return
            if ev.text:
                yield chunk(ev.text)
            extra = {}
            if ev.stop_sequence is not None:
                extra["stop_reason"] = ev.stop_sequence
            if return_ids:
                extra["token_ids"] = list(r.output_ids)
            yield chunk("", ev.reason, **extra)
            if include_usage:
                yield sse.frame({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": [], "usage": msgspec.to_builtins(reply.usage())})
            yield sse.DONE
            done = True
            return
    finally:
        if not done and not r.finished:
            metrics.client_disconnections_total += 1
            eng.sched.cancel(r)


# ------------------------------------------------------------------------------------------------ small routes
async def models(request: HttpRequest) -> Response:
    eng = _engine(request)
    return _json(ModelList([ModelCard(eng.name, eng.created, eng.context_len, eng.context_len)]))


async def tokenize(request: HttpRequest) -> Response:
    eng = _engine(request)
    body = await request.body()
    req = _decode(body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of `prompt` and `messages`", param="prompt")
    if req.messages is not None:
        raw = msgspec.json.decode(body)
        prompt = _chat_prompt(eng, raw)
        ids = list(prompt.token_ids)
    else:
        ids = eng.tok.encode(req.prompt, special=True)
        if req.add_special_tokens:
            ids = [eng.bos_id] + ids
    out = {"count": len(ids), "max_model_len": eng.context_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [eng.tok.decode([i]) for i in ids]
    return _json(out)


async def detokenize(request: HttpRequest) -> Response:
    eng = _engine(request)
    req = _decode(await request.body(), DetokenizeRequest)
    bad = [t for t in req.tokens if not 0 <= t < eng.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{eng.vocab_size - 1})", param="tokens")
    return _json({"prompt": eng.tok.decode(req.tokens)})


async def health(request: HttpRequest) -> Response:
    st: AppState = request.app.state.dsv41
    eng = st.engine
    if eng is None:
        return _json({"status": "error" if st.load_error else "loading", "error": st.load_error}, 503)
    if st.keys.enabled:
        return _json({"status": "ok"})
    s = eng.sched
    return _json({"status": "ok", "model": eng.name, "context_length": eng.context_len, "device": eng.device,
                  "requests_running": s.n_running, "requests_waiting": s.n_waiting,
                  "streams": {"max": s.max_streams, "running": s.n_running},
                  "prompt_tokens_total": s.prompt_tokens_total,
                  "completion_tokens_total": s.generation_tokens_total, "rounds_total": s.rounds_total})


async def metrics_text(request: HttpRequest) -> Response:
    st: AppState = request.app.state.dsv41
    return PlainTextResponse(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# ------------------------------------------------------------------------------------------------ wiring
class Guard:
    """ASGI middleware: API keys, OpenAI-shaped errors for everything, request counting. Pure ASGI (no body
    buffering), so SSE streams and disconnects pass straight through."""

    def __init__(self, app, state: AppState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status_box = [0]

        async def send_counted(msg):
            if msg["type"] == "http.response.start":
                status_box[0] = msg["status"]
            await send(msg)

        try:
            gated = path not in OPEN_PATHS and scope["method"] != "OPTIONS" and not (
                path.endswith("/metrics") and self.state.cfg.metrics_open)
            if gated and self.state.keys.enabled:
                from starlette.datastructures import Headers
                if not self.state.keys.ok(Headers(scope=scope)):
                    err = ApiError(401, "A valid API key is required", code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
                    # Anthropic clients expect their own error shape on their routes.
                    resp = anthropic.error_response(err) if path.startswith("/v1/messages") else err.response()
                    return await resp(scope, receive, send_counted)
            await self.app(scope, receive, send_counted)
        finally:
            self.state.metrics.request_done(_route_label(path), status_box[0])


_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
           "/metrics", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses")


def _route_label(path: str) -> str:
    for r in _ROUTES:
        if path.endswith(r):
            return r
    return "other"


async def _api_error(request, exc: ApiError) -> Response:
    return exc.response()


async def _http_error(request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return ApiError(404, f"unknown path {request.url.path}", code="not_found").response()
    if exc.status_code == 405:
        return ApiError(501, f"{request.method} is not served on {request.url.path}",
                        code="not_implemented").response()
    return ApiError(exc.status_code, str(exc.detail)).response()


async def _too_deep(request, exc: RecursionError) -> Response:
    # msgspec (and the schema compilers) give up on absurdly nested JSON by raising RecursionError: the client's fault.
    return ApiError(400, "the request body nests too deeply; flatten it (JSON nesting is limited)",
                    code="invalid_request").response()


async def _server_error(request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return _json({"error": {"message": f"internal error: {type(exc).__name__}: {exc}", "type": "server_error"}},
                 500)


def create_app(cfg, metrics: Metrics | None = None, on_startup=None, on_shutdown=None) -> tuple[Starlette, AppState]:
    metrics = metrics or Metrics()
    state = AppState(cfg, metrics)
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/", health, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/v1/metrics", metrics_text, methods=["GET"]),
        *responses.routes(),
        *anthropic.routes(),
    ]
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        if on_startup is not None:
            await on_startup(state)
        yield
        if on_shutdown is not None:
            await on_shutdown(state)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, RecursionError: _too_deep,
                                        Exception: _server_error})
    app.state.dsv41 = state
    return Guard(app, state), state


__all__ = ["create_app", "AppState", "JSONResponse"]
