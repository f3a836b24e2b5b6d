"""The starlette app: OpenAI-compatible routes on top of the scheduler.

One request, end to end: the body is decoded into a msgspec Struct (400 naming the bad field), the prompt is built
(chat: dsv41.chat.policy renders and tokenizes the messages; completions: the given ids or the string's tokens),
limits are resolved (context, max_tokens), a sched Request is submitted, and its events become one JSON body or SSE
frames (`: keepalive` comments while nothing is due). A client that goes away cancels its request; the scheduler
frees its sequence at the next round boundary.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dsv41.api import limits, sse
from dsv41.api.auth import OPEN_PATHS, KeyCheck
from dsv41.api.errors import ApiError, bad_request, context_exceeded, from_decode_error
from dsv41.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dsv41.api.metrics import Metrics
from dsv41.api.schemas import (ChatCompletionRequest, CompletionRequest, CompletionTokensDetails, DetokenizeRequest,
                               ModelCard, ModelList, PromptTokensDetails, SamplingFields, TokenizeRequest, Usage,
                               DraftUsage)
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
        self.keys = KeyCheck.from_config(cfg)
        self.engine = None
        self.load_error: str | None = None
        self.openapi: bytes | None = None


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def engine(request: HttpRequest):
    """The loaded engine; 503 while it loads or after it failed to load."""
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
    except msgspec.DecodeError as e:                 # ValidationError included: the message names the field
        raise from_decode_error(e) from None


_MISSING = re.compile(r"^Object missing required field `([^`]+)`$")


def check_fields(raw: dict, typ):
    """`raw` decoded as the msgspec type `typ` (strict types); a bad field is a 400 naming it in `param`."""
    try:
        return msgspec.convert(raw, typ)
    except msgspec.ValidationError as e:
        err = from_decode_error(e)
        m = _MISSING.match(str(e))          # a missing top-level field has no path in msgspec's message
        if err.param is None and m:
            err.param = m.group(1)
        raise err from None


async def read_object(request: HttpRequest, checked_as=None) -> dict:
    """The body as a JSON object (the APIs that convert a body by hand: Responses, Anthropic), its fields first
    checked against the msgspec type `checked_as` (the type the OpenAPI document shows)."""
    raw = _decode(await request.body(), Any)
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    if checked_as is not None:
        check_fields(raw, checked_as)
    return raw


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


def _logit_bias(eng, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (JSON keys, so strings) -> a bias in [-100, 100] added to the logit."""
    out = []
    for k, v in (bias or {}).items():
        if not k.strip().isdigit() or not 0 <= int(k) < eng.vocab_size:
            raise bad_request(f"`logit_bias` keys must be token ids in 0..{eng.vocab_size - 1}, got {k!r}",
                              param="logit_bias")
        _check_number("logit_bias", v, -100.0, 100.0)
        out.append((int(k), float(v)))
    return tuple(sorted(out))


def _sampling(eng, f: SamplingFields, prompt_ids: list[int], logprobs: bool, top_logprobs: int,
              choice: int = 0) -> SamplingParams:
    """The request's SamplingParams; choice i of an `n` > 1 request samples with seed + i (vLLM's rule), so it is
    the reply a request of n = 1 with that seed gets."""
    cfg = eng.cfg
    _check_number("temperature", f.temperature)
    _check_number("frequency_penalty", f.frequency_penalty, -2.0, 2.0)
    _check_number("presence_penalty", f.presence_penalty, -2.0, 2.0)
    _check_number("repetition_penalty", f.repetition_penalty, 0.0, lo_open=True)
    if f.prompt_logprobs is not None:
        raise bad_request("`prompt_logprobs` is not served (the prompt's logits are not computed); leave it out",
                          param="prompt_logprobs")
    _check_number("top_p", f.top_p, 0.0, 1.0, lo_open=True)
    _check_number("min_p", f.min_p, 0.0, 1.0)
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"`top_logprobs` must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}",
                          param="top_logprobs")
    if f.seed is not None:
        seed = f.seed
    elif cfg.seed_random:
        seed = random_seed()
    else:
        seed = prompt_seed(prompt_ids, cfg.seed_salt)
    rp = 1.0 if f.repetition_penalty is None else f.repetition_penalty
    return SamplingParams(
        temperature=cfg.temperature if f.temperature is None else f.temperature,
        top_p=cfg.top_p if f.top_p is None else f.top_p,
        top_k=cfg.top_k if f.top_k is None else f.top_k,
        min_p=cfg.min_p if f.min_p is None else f.min_p,
        seed=(seed + choice) & ((1 << 64) - 1), logprobs=logprobs, top_logprobs=top_logprobs,
        frequency_penalty=f.frequency_penalty or 0.0, presence_penalty=f.presence_penalty or 0.0,
        repetition_penalty=rp, logit_bias=_logit_bias(eng, f.logit_bias), prompt_len=len(prompt_ids),
        prompt_tokens=tuple(sorted(set(prompt_ids))) if rp != 1.0 else ())


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


def _detokenizer(eng, skip_special: bool = False):
    from dsv41.chat.tokenizer import IncrementalDetokenizer
    d = IncrementalDetokenizer(eng.tok)
    return _SkipSpecial(d, eng.tok.special_ids) if skip_special else d


class _SkipSpecial:
    """A detokenizer whose text leaves special tokens out (completions' skip_special_tokens, vLLM's default)."""

    def __init__(self, inner, special: frozenset[int]):
        self.inner, self.special = inner, special

    def push(self, tid: int) -> str:
        return "" if tid in self.special else self.inner.push(tid)

    def push_many(self, ids) -> str:
        return self.inner.push_many([i for i in ids if i not in self.special])

    def finish(self) -> str:
        return self.inner.finish()


def _served_name(eng, asked: str | None) -> str:
    """The id a reply reports (--name); a `model` this server does not serve is a 404, as OpenAI and vLLM answer."""
    if not eng.serves(asked):
        raise ApiError(404, f"The model `{asked}` does not exist. This server serves `{eng.name}`.",
                       param="model", code="model_not_found")
    return eng.name


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
        r = self.r
        drafts = DraftUsage(r.drafted, r.draft_accepted, r.decode_rounds,
                            round(n / max(1, r.decode_rounds), 3)) if r.drafted else None
        return Usage(self.r.prompt_len, n, self.r.prompt_len + n, PromptTokensDetails(self.r.cached_tokens),
                     CompletionTokensDetails(self.reasoning_tokens()), drafts)

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

    def info(self, want_ids: bool = False) -> dict:
        """The `dsv41` object every API's reply carries: token digest, seed, sampling mode, what closed the
        reasoning (a control), and the ids when asked for there."""
        r = self.r
        out = {"token_sha": self.token_sha(), "seed": r.params.seed,
               "sampling": "greedy" if r.params.greedy else "exact"}
        ctl = getattr(r, "control", None)
        if ctl is not None and ctl.closed_by:
            out["reasoning_closed_by"] = ctl.closed_by
        if want_ids:
            out["token_ids"] = list(r.output_ids)
        return out


@dataclass
class Prepared:
    """One submitted request: the scheduler's Request and what every API builds its reply from."""
    r: Request
    reply: Reply
    model: str              # the served name the reply reports
    prompt: Any = None      # chat.policy ChatPrompt (chat requests)
    parser: Any = None      # chat.parser ReplyParser (chat requests)


def chat_prompt(eng, raw: dict):
    """Render and tokenize a chat request with the server's defaults (dsv41.chat.policy); ChatError -> 400."""
    from dsv41.chat import policy
    from dsv41.chat.errors import ChatError
    try:
        prompt = policy.build_chat_prompt(raw, eng.tok, shield=True, default_thinking=eng.cfg.thinking,
                                          default_effort=eng.cfg.reasoning_effort, max_images=eng.cfg.max_images,
                                          allow_image_urls=eng.cfg.image_urls)
    except ChatError as e:
        raise bad_request(e.message, param=e.param) from None
    if prompt.images and eng.images is None:
        raise bad_request("image input is off on this server (its checkpoint has no vision weights, or "
                          "--max-images is 0); send text only", param="messages")
    return prompt


def chat_grammar(eng, raw: dict, prompt):
    """The reply's grammar matcher (structured output, forced tool calls), or None; GrammarError -> 400."""
    from dsv41.grammar.compile import GrammarError, compile_request
    t0 = time.perf_counter()
    try:
        spec = compile_request(raw, eng.tok, tools=prompt.tools, thinking=prompt.thinking)
    except GrammarError as e:
        raise bad_request(e.message, param=e.param) from None
    finally:
        metrics = getattr(eng.sched, "metrics", None)
        if metrics is not None:
            metrics.grammar_compile_seconds += time.perf_counter() - t0
    return spec.matcher() if spec is not None else None


def chat_controls(eng, raw: dict) -> tuple[int | None, bool, bool]:
    """(thinking budget, loop guard, background) of a chat body with the server's defaults; ControlError -> 400."""
    from dsv41.sched.controls import ControlError, parse_controls
    try:
        return parse_controls(raw, default_budget=eng.cfg.thinking_budget, default_loop_guard=eng.cfg.loop_guard)
    except ControlError as e:
        raise bad_request(e.message, param=e.param) from None


def _renamed(e: ApiError, params: dict[str, str] | None) -> ApiError:
    if params and e.param in params:
        e.param = params[e.param]
    return e


async def prepare_chat(eng, raw: dict, req: ChatCompletionRequest | None = None,
                       params: dict[str, str] | None = None, choice: int = 0) -> Prepared:
    """Submit a chat completion body: prompt (chat.policy), grammar, limits, sampling and seed, reasoning controls.
    Every API that is the chat path in another shape (Responses, Anthropic) comes through here, so its tokens are
    the chat route's. `req` is the body already decoded (else decoded from `raw`); an ApiError's `param` is renamed
    through `params` into the calling API's field names."""
    from dsv41.chat.parser import ReplyParser
    from dsv41.sched.controls import ControlledRequest, reasoning_control, wait_background_turn
    try:
        if req is None:
            req = check_fields(raw, ChatCompletionRequest)
        model = _served_name(eng, req.model)
        if not req.messages:
            raise bad_request("the conversation is empty: send at least one message", param="messages")
        # tokenizing and compiling off the event loop, bounded (dsv41/api/limits.py)
        prompt = await limits.off_loop(eng, chat_prompt, eng, raw, limit=eng.context_len, param="messages")
        matcher = await limits.off_loop(eng, chat_grammar, eng, raw, prompt, what="grammar")
        # image placeholders -> their spans (dsv41/api/images.py: fetch, decode, tower, cached by hash)
        ids, images = await eng.images.prompt_images(prompt) if prompt.images else (list(prompt.token_ids), [])
        asked_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = _max_tokens(eng, len(ids), getattr(req, asked_name), "messages", asked_name)
        sp = _sampling(eng, req, ids, bool(req.logprobs), (req.top_logprobs or 0) if req.logprobs else 0, choice)
        budget, loop_guard, background = chat_controls(eng, raw)
        control = reasoning_control(eng.tok, thinking=prompt.thinking, grammar=matcher is not None, budget=budget,
                                    loop_guard=loop_guard)
        if background:
            await wait_background_turn(eng.sched)
        r = _submit(eng, ControlledRequest(prompt_ids=ids, params=sp, max_tokens=max_tokens, eos_ids=eng.eos_ids,
                                           ignore_eos=req.ignore_eos, stop=_stops(req.stop),
                                           detokenizer=_detokenizer(eng), matcher=matcher, control=control,
                                           cache_salt=req.cache_salt, images=images, draft=req.draft))
    except ApiError as e:
        raise _renamed(e, params) from None
    parser = ReplyParser(thinking=prompt.thinking, tools=prompt.tools or None,
                         parallel_tool_calls=req.parallel_tool_calls is not False)
    return Prepared(r, Reply(eng, r, prompt.thinking), model, prompt, parser)


async def _completion_request(eng, body: bytes) -> CompletionRequest:
    """A completions body decoded, its string prompt (or a batch of one string) tokenized off the event loop, bounded
    by the context (dsv41/api/limits.py), and put back as its ids (BOS first with add_special_tokens): the ids
    `_completion_prompt` would make, without blocking every stream while a long text is tokenized."""
    req = _decode(body, CompletionRequest)
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        bos = [eng.bos_id] if req.add_special_tokens else []
        ids = await limits.off_loop(eng, eng.tok.encode, p, True, limit=eng.context_len - len(bos), param="prompt")
        req.prompt = bos + ids
    elif isinstance(p, list) and len(p) >= eng.context_len and isinstance(p[0], int):
        # ids that cannot fit: refused before every one of them is checked against the vocabulary
        raise context_exceeded(eng.context_len, len(p), req.max_tokens, "prompt")
    return req


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


def prepare_completion(eng, req: CompletionRequest, choice: int = 0) -> Prepared:
    """Submit a completions body: the given ids or the string's tokens, limits, sampling and seed."""
    model = _served_name(eng, req.model)
    if req.suffix:
        raise bad_request("`suffix` is not supported", param="suffix")
    if req.echo:
        raise bad_request("`echo` is not supported", param="echo")
    ids = _completion_prompt(eng, req)
    if eng.tok.image_id in ids:     # a span's rows exist only for image_url parts of chat messages
        raise bad_request(f"the prompt holds the image placeholder token (id {eng.tok.image_id}); send images as "
                          "image_url parts of a /v1/chat/completions message", param="prompt")
    max_tokens = _max_tokens(eng, len(ids), req.max_tokens, "prompt")
    params = _sampling(eng, req, ids, req.logprobs is not None, req.logprobs or 0, choice)
    r = _submit(eng, Request(prompt_ids=ids, params=params, max_tokens=max_tokens, eos_ids=eng.eos_ids,
                             ignore_eos=req.ignore_eos, stop=_stops(req.stop),
                             detokenizer=_detokenizer(eng, req.skip_special_tokens),
                             cache_salt=req.cache_salt, draft=req.draft))
    return Prepared(r, Reply(eng, r, thinking=False), model)


# ------------------------------------------------------------------------------------------------ the reply loop
def finish_error(ev: FinishEvent) -> ApiError | None:
    """The error a finish stands for (cancelled by its client: 499, nginx's 'client closed request', which nobody
    reads; by a shutdown: 503; an engine failure: 500), None for a reply."""
    if ev.reason == "cancelled":
        return ApiError(499, "the client closed the request", code="client_closed_request")
    if ev.reason == "shutdown":
        return ApiError(503, "the request was cancelled (server shutting down)", type="server_error")
    if ev.reason == "error":
        return ApiError(500, ev.error or "the engine failed", type="server_error")
    return None


async def _watch_disconnect(request: HttpRequest, eng, r: Request) -> None:
    """For non-streamed replies: the only message left on the socket is the disconnect."""
    while not r.finished:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            if not r.finished:
                request.app.state.dsv41.metrics.client_disconnections_total += 1
                eng.sched.cancel(r)
            return


KEEP, TOKEN, DELTA, FINISH, ERROR = "keepalive", "token", "delta", "finish", "error"


async def reply_events(request: HttpRequest, eng, prep: Prepared, stream: bool = True):
    """The one reply loop every route runs, as (kind, value):
    (KEEP, None) while nothing is due (streams only), (TOKEN, TokenEvent) for each drawn token, with a chat parser
    (DELTA, chat delta) for each delta it makes (its role delta included), then one (FINISH, (FinishEvent,
    FinalMessage | None)) or (ERROR, ApiError). A client that goes away (a streamed consumer that stops, or a
    non-streamed request's disconnect) cancels the request and is counted."""
    r, parser = prep.r, prep.parser
    done = False
    watcher = None if stream else asyncio.ensure_future(_watch_disconnect(request, eng, r))
    source = eng.sched.stream(r, eng.cfg.keepalive_s if stream else None, sse.KEEPALIVE)
    try:
        async for ev in source:
            if ev is sse.KEEPALIVE:
                yield KEEP, None
                continue
            if isinstance(ev, TokenEvent):
                yield TOKEN, ev
            deltas = parser.feed(ev.text) if parser is not None and ev.text else []
            if isinstance(ev, FinishEvent):
                err = finish_error(ev)
                if err is not None:
                    done = True
                    yield ERROR, err
                    return
                final = None
                if parser is not None:
                    tail, final = parser.finish()
                    deltas = list(deltas) + list(tail)
            for d in deltas:
                yield DELTA, d
            if isinstance(ev, FinishEvent):
                done = True
                yield FINISH, (ev, final)
                return
    finally:
        await source.aclose()               # its keepalive timer, if one is armed
        if watcher is not None:
            watcher.cancel()
        if not done and not r.finished:
            if stream:
                request.app.state.dsv41.metrics.client_disconnections_total += 1
            eng.sched.cancel(r)


async def collect(request: HttpRequest, eng, prep: Prepared, on_token=None):
    """Run a non-streamed reply to its end: (FinishEvent, FinalMessage | None); on_token(TokenEvent) sees each
    token. A failed or cancelled reply raises its ApiError."""
    async with contextlib.aclosing(reply_events(request, eng, prep, stream=False)) as events:   # watcher ends now
        async for kind, v in events:
            if kind == TOKEN and on_token is not None:
                on_token(v)
            elif kind == ERROR:
                raise v
            elif kind == FINISH:
                return v
    raise RuntimeError("event stream ended without a finish")   # pragma: no cover


def _stream_error(err: ApiError) -> bytes:
    return sse.frame({"error": {"message": err.message, "type": "server_error"}}) + sse.DONE


def _choice_extra(prep: Prepared, fin: FinishEvent, return_ids: bool) -> dict:
    extra = {}
    if fin.stop_sequence is not None:
        extra["stop_reason"] = fin.stop_sequence
    if return_ids:
        extra["token_ids"] = list(prep.r.output_ids)
    return extra


def _reply_body(prep: Prepared, rid: str, obj: str, choice: dict, fin: FinishEvent) -> dict:
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": prep.model, "choices": [choice],
           "usage": prep.reply.usage(), "exact_mode": "exact", "dsv41": prep.reply.info()}
    if fin.stop_sequence is not None:
        out["stop_sequence"] = fin.stop_sequence
    return out


MAX_CHOICES = 16


def _name_reply(request: HttpRequest, rid: str, prep: Prepared) -> None:
    """The reply's id on the request's access line and on its scheduler `done` line."""
    request.state.reply_id = rid
    prep.r.tag = rid


def _choices(req: SamplingFields) -> int:
    """`n`: how many choices (1..MAX_CHOICES)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"`n` must be in 1..{MAX_CHOICES}, got {n}", param="n")
    return n


async def _more_choices(eng, first: Prepared, n: int, again) -> list[Prepared]:
    """`first` and choices 1..n-1, each its own request with seed + i (`again(i)` submits choice i); a failure
    cancels those already submitted."""
    preps = [first]
    try:
        for i in range(1, n):
            preps.append(await again(i))
            preps[-1].r.tag = first.r.tag
    except BaseException:
        for p in preps:
            eng.sched.cancel(p.r)
        raise
    return preps


async def _run_choices(eng, preps: list[Prepared], one) -> list[tuple[FinishEvent, dict]]:
    """Every choice's (finish, choice object) from `one(index, prep)`, run at once; any left is cancelled when one
    fails or the client goes away."""
    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(preps))))
    finally:
        for p in preps:
            if not p.r.finished:
                eng.sched.cancel(p.r)


def _usage(preps: list[Prepared]) -> Usage:
    """The usage of one or more choices: the prompt once, every choice's tokens."""
    us = [p.reply.usage() for p in preps]
    if len(us) == 1:
        return us[0]
    completion = sum(u.completion_tokens for u in us)
    return Usage(us[0].prompt_tokens, completion, us[0].prompt_tokens + completion, us[0].prompt_tokens_details,
                 CompletionTokensDetails(sum(u.completion_tokens_details.reasoning_tokens for u in us)))


def _choices_body(preps: list[Prepared], rid: str, obj: str, done: list[tuple[FinishEvent, dict]]) -> dict:
    """The reply body of one or more choices: usage counts the prompt once and every choice's tokens."""
    out = _reply_body(preps[0], rid, obj, done[0][1], done[0][0])
    if len(preps) > 1:
        out["choices"] = [c for _, c in done]
        out["usage"] = _usage(preps)
        out.pop("stop_sequence", None)          # each choice names its own (stop_reason)
    return out


async def _choices_stream(eng, preps: list[Prepared], streams: list, rid: str, obj: str, include_usage: bool):
    """The SSE frames of n streamed choices (each stream's chunks name its choice's index), interleaved as they
    come, then one usage chunk (with include_usage: the prompt once, every choice's tokens) and [DONE]. An error
    frame (it carries its own [DONE]) or a client gone ends every choice."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(frames) -> None:
        try:
            async for f in frames:
                await q.put(f)
        finally:
            q.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            f = await q.get()
            if f is None:
                left -= 1
                continue
            yield f
            if f.endswith(sse.DONE):
                return
        if include_usage:
            yield sse.frame({**_Frames(rid, obj, preps[0].model).base, "choices": [],
                             "usage": msgspec.to_builtins(_usage(preps))})
        yield sse.DONE
    finally:
        for t in tasks:
            t.cancel()
        for p in preps:
            if not p.r.finished:
                eng.sched.cancel(p.r)


class _Frames:
    """The SSE frames of one streamed chat or completions reply: chunks, the usage chunk, [DONE]. A choice of an
    `n` > 1 reply (`index`, last False) leaves the usage and [DONE] to _choices_stream."""

    def __init__(self, rid: str, obj: str, model: str, index: int = 0, last: bool = True):
        self.base = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
        self.index, self.last = index, last

    def chunk(self, choice: dict) -> bytes:
        return sse.frame({**self.base, "choices": [{"index": self.index, **choice}]})

    def end(self, prep: Prepared, include_usage: bool) -> bytes:
        if not self.last:
            return b""
        usage = sse.frame({**self.base, "choices": [], "usage": msgspec.to_builtins(prep.reply.usage())})
        return (usage if include_usage else b"") + sse.DONE


# ------------------------------------------------------------------------------------------------ chat
def _finish_reason(reason: str, final) -> str:
    """"tool_calls" for a reply that ended on its calls; a reply cut by max_tokens stays "length" even inside a call
    (its arguments may be cut short), as OpenAI and vLLM report it."""
    return "tool_calls" if final.tool_calls and reason != "length" else reason


async def chat_completions(request: HttpRequest) -> Response:
    eng = engine(request)
    body = await request.body()
    req = _decode(body, ChatCompletionRequest)
    n = _choices(req)
    raw = msgspec.json.decode(body)
    prep = await prepare_chat(eng, raw, req)
    rid = "chatcmpl-" + secrets.token_hex(16)
    _name_reply(request, rid, prep)
    preps = await _more_choices(eng, prep, n, lambda i: prepare_chat(eng, raw, req, choice=i))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if n == 1:
            stream = _chat_stream(request, eng, prep, rid, include_usage, req.return_token_ids)
        else:
            stream = _choices_stream(eng, preps, [_chat_stream(request, eng, p, rid, False, req.return_token_ids,
                                                               index=i, last=False) for i, p in enumerate(preps)],
                                     rid, "chat.completion.chunk", include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers=sse.HEADERS)

    async def one(i: int, p: Prepared):
        logprobs: list[dict] = []

        def on_token(ev: TokenEvent):
            if req.logprobs:
                logprobs.append(p.reply.chat_logprob(ev))

        fin, final = await collect(request, eng, p, on_token)
        return fin, {"index": i, "message": final.message(), "logprobs": {"content": logprobs} if req.logprobs
                     else None, "finish_reason": _finish_reason(fin.reason, final),
                     **_choice_extra(p, fin, req.return_token_ids)}

    return json_response(_choices_body(preps, rid, "chat.completion", await _run_choices(eng, preps, one)))


async def _chat_stream(request, eng, prep: Prepared, rid: str, include_usage: bool, return_ids: bool,
                       index: int = 0, last: bool = True):
    frames = _Frames(rid, "chat.completion.chunk", prep.model, index, last)

    def chunk(delta: dict, finish_reason=None, logprobs=None, **extra) -> bytes:
        return frames.chunk({"delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                             "finish_reason": finish_reason, **extra})

    pending_lp: list[dict] = []
    if not prep.prompt.tools:               # role right after the headers; with tools, before the first delta
        for d in prep.parser.role_delta():
            yield chunk(d)
    async for kind, v in reply_events(request, eng, prep):
        if kind == KEEP:
            yield sse.KEEPALIVE
        elif kind == TOKEN:
            if prep.r.params.logprobs:
                pending_lp.append(prep.reply.chat_logprob(v))
        elif kind == DELTA:
            yield chunk(v, logprobs=pending_lp or None)
            pending_lp = []
        elif kind == ERROR:
            yield _stream_error(v)
        else:
            fin, final = v
            yield chunk({}, _finish_reason(fin.reason, final), logprobs=pending_lp or None,
                        **_choice_extra(prep, fin, return_ids))
            yield frames.end(prep, include_usage)


# ------------------------------------------------------------------------------------------------ completions
async def completions(request: HttpRequest) -> Response:
    eng = engine(request)
    req = await _completion_request(eng, await request.body())
    n = _choices(req)
    prep = prepare_completion(eng, req)
    want_lp = req.logprobs is not None
    rid = "cmpl-" + secrets.token_hex(16)
    _name_reply(request, rid, prep)

    async def again(i: int) -> Prepared:
        return prepare_completion(eng, req, choice=i)

    preps = await _more_choices(eng, prep, n, again)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if n == 1:
            stream = _completion_stream(request, eng, prep, rid, include_usage, req.return_token_ids, want_lp)
        else:
            stream = _choices_stream(eng, preps, [_completion_stream(request, eng, p, rid, False, req.return_token_ids,
                                                                     want_lp, index=i, last=False)
                                                  for i, p in enumerate(preps)], rid, "text_completion", include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers=sse.HEADERS)

    async def one(i: int, p: Prepared):
        texts: list[str] = []
        lp = _LegacyLogprobs(p.reply) if want_lp else None

        def on_token(ev: TokenEvent):
            texts.append(ev.text)
            if lp is not None:
                lp.add(ev)

        fin, _ = await collect(request, eng, p, on_token)
        texts.append(fin.text)
        choice = {"index": i, "text": "".join(texts), "logprobs": lp.body() if lp else None,
                  "finish_reason": fin.reason, **_choice_extra(p, fin, req.return_token_ids)}
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(p.r.prompt_ids)
        return fin, choice

    return json_response(_choices_body(preps, rid, "text_completion", await _run_choices(eng, preps, one)))


class _LegacyLogprobs:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs (dicts), text_offset."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top: list[dict] = []
        self.offsets: list[int] = []
        self.offset = 0

    def add(self, ev: TokenEvent) -> None:
        t = self.reply.token_str(ev.token_id)
        self.tokens.append(t)
        self.token_logprobs.append(ev.sample.logprob)
        self.top.append({self.reply.token_str(i): lp for i, lp in (ev.sample.top or [])})
        self.offsets.append(self.offset)
        self.offset += len(t)

    def body(self, start: int = 0) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top[start:], "text_offset": self.offsets[start:]}


async def _completion_stream(request, eng, prep: Prepared, rid: str, include_usage: bool, return_ids: bool,
                             want_lp: bool, index: int = 0, last: bool = True):
    frames = _Frames(rid, "text_completion", prep.model, index, last)
    lp = _LegacyLogprobs(prep.reply) if want_lp else None
    sent_lp = 0

    def chunk(text: str, finish_reason=None, **extra) -> bytes:
        nonlocal sent_lp
        choice = {"text": text, "logprobs": None, "finish_reason": finish_reason, **extra}
        if lp is not None and len(lp.tokens) > sent_lp:
            choice["logprobs"] = lp.body(sent_lp)
            sent_lp = len(lp.tokens)
        return frames.chunk(choice)

    async for kind, v in reply_events(request, eng, prep):
        if kind == KEEP:
            yield sse.KEEPALIVE
        elif kind == TOKEN:
            if lp is not None:
                lp.add(v)
            if v.text or lp is not None:
                yield chunk(v.text)
        elif kind == ERROR:
            yield _stream_error(v)
        elif kind == FINISH:
            fin, _ = v
            if fin.text:
                yield chunk(fin.text)
            yield chunk("", fin.reason, **_choice_extra(prep, fin, return_ids))
            yield frames.end(prep, include_usage)


# ------------------------------------------------------------------------------------------------ small routes
async def models(request: HttpRequest) -> Response:
    eng = engine(request)
    return json_response(ModelList([ModelCard(eng.name, eng.created, eng.context_len, eng.context_len)]))


async def model_card(request: HttpRequest) -> Response:
    """GET /v1/models/{model}: the served model's card under any id it answers to; 404 model_not_found else."""
    eng = engine(request)
    asked = request.path_params["model"]
    _served_name(eng, asked)
    return json_response(ModelCard(eng.name, eng.created, eng.context_len, eng.context_len))


async def tokenize(request: HttpRequest) -> Response:
    eng = engine(request)
    body = await request.body()
    req = _decode(body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of `prompt` and `messages`", param="prompt")
    if req.messages is not None:
        raw = msgspec.json.decode(body)
        prompt = await limits.off_loop(eng, chat_prompt, eng, raw, param="messages")
        # an image counts as the span it expands to (as in the chat reply's usage)
        ids = await eng.images.prompt_ids(prompt) if prompt.images else list(prompt.token_ids)
    else:
        ids = await limits.off_loop(eng, eng.tok.encode, req.prompt, True, param="prompt")
        if req.add_special_tokens:
            ids = [eng.bos_id] + ids
    out = {"count": len(ids), "max_model_len": eng.context_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [eng.tok.decode([i]) for i in ids]
    return json_response(out)


async def detokenize(request: HttpRequest) -> Response:
    eng = engine(request)
    req = _decode(await request.body(), DetokenizeRequest)
    return json_response({"prompt": await limits.off_loop(eng, _detokenized, eng, req.tokens, param="tokens")})


def _detokenized(eng, tokens: list[int]) -> str:
    """The text of `tokens` (a worker thread's job: millions of ids take seconds); an id outside the vocabulary is
    a 400."""
    bad = [t for t in tokens if not 0 <= t < eng.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{eng.vocab_size - 1})", param="tokens")
    return eng.tok.decode(tokens)


async def health(request: HttpRequest) -> Response:
    st: AppState = request.app.state.dsv41
    eng = st.engine
    if eng is None:
        return json_response({"status": "error" if st.load_error else "loading", "error": st.load_error}, 503)
    lane = eng.lane
    if lane is not None and (lane.fatal is not None or lane.leader.hb.lost is not None):
        # a rank is lost (docs/tp.md): 503 from the moment the channel's watch knows, before the server stops
        why = lane.message() or f"tensor-parallel lane failed: {lane.leader.hb.lost}"
        return json_response({"status": "error"} if st.keys.enabled else {"status": "error", "error": why}, 503)
    if st.keys.enabled:
        return json_response({"status": "ok"})
    s = eng.sched
    return json_response({"status": "ok", "model": eng.name, "context_length": eng.context_len, "device": eng.device,
                  "requests_running": s.n_running, "requests_waiting": s.n_waiting,
                  "streams": {"max": s.max_streams, "running": s.n_running},
                  "prompt_tokens_total": s.prompt_tokens_total,
                  "completion_tokens_total": s.generation_tokens_total, "rounds_total": s.rounds_total})


async def openapi_json(request: HttpRequest) -> Response:
    st: AppState = request.app.state.dsv41
    if st.openapi is None:                   # built on first use: a few ms, and most servers are never asked
        from dsv41.api.openapi import document
        st.openapi = msgspec.json.encode(document())
    return Response(st.openapi, media_type="application/json")


async def metrics_text(request: HttpRequest) -> Response:
    st: AppState = request.app.state.dsv41
    return PlainTextResponse(st.metrics.render(), media_type=METRICS_CONTENT_TYPE)


# ------------------------------------------------------------------------------------------------ wiring
class Guard:
    """ASGI middleware: API keys, OpenAI-shaped errors for everything, request counting, the access line. Pure ASGI
    (no body buffering), so SSE streams and disconnects pass straight through."""

    def __init__(self, app, state: AppState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_bytes = 0
        path = scope["path"]
        status_box = [0]
        t0 = time.monotonic()

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
                    scope.setdefault("state", {})["error"] = f"{err.code}: {err.message}"
                    # Anthropic clients expect their own error shape on their routes.
                    from dsv41.api import anthropic
                    resp = anthropic.error_response(err) if path.startswith("/v1/messages") else err.response()
                    return await resp(scope, receive, send_counted)
            if scope["method"] in limits.BODY_METHODS:   # the whole body first, within its size and time limits
                try:
                    receive, body_bytes = await limits.read_body(scope, receive, self.state.cfg.max_body_bytes,
                                                                 self.state.cfg.body_timeout_s)
                except limits.BodyError as err:
                    body_bytes = err.received
                    if err.status == 499:
                        limits.client_gone(path, err)
                    scope.setdefault("state", {})["error"] = f"{err.code}: {err.message}"
                    from dsv41.api import anthropic
                    resp = anthropic.error_response(err) if path.startswith("/v1/messages") else err.response()
                    return await resp(scope, receive, send_counted)
            await self.app(scope, receive, send_counted)
        finally:
            if body_bytes >= limits.TRIM_AFTER_BYTES:      # hand what the body and its tokens used back
                limits.trim_memory_soon()
            self.state.metrics.request_done(_route_label(path), status_box[0])
            _access_line(scope, status_box[0], time.monotonic() - t0)


access_log = logging.getLogger("dsv41.access")


def _access_line(scope, status: int, seconds: float) -> None:
    """One line a request: method, path, status, seconds, the reply's id (the scheduler's `done` line names it too)
    and, for an error, its reason. A status of 0 is a client gone before any reply."""
    st = scope.get("state") or {}
    extra = "".join(f" {k}={st[k]}" for k in ("reply_id",) if st.get(k))
    if st.get("error"):
        extra += f" error={st['error']!r}"
    access_log.info("%s %s %s %.3fs%s", scope["method"], scope["path"], status or "-", seconds, extra)


_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
           "/metrics", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/openapi.json")


def _route_label(path: str) -> str:
    for r in _ROUTES:
        if path.endswith(r):
            return r
    return "other"


async def _api_error(request, exc: ApiError) -> Response:
    request.state.error = f"{exc.code or exc.type}: {exc.message}"     # the access line says why (info level)
    return exc.response()


async def _http_error(request, exc: HTTPException) -> Response:
    request.state.error = f"{exc.status_code}: {exc.detail}"
    if exc.status_code == 404:
        return ApiError(404, f"unknown path {request.url.path}", code="not_found").response()
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        err = ApiError(405, f"{request.method} is not served on {request.url.path}"
                       + (f" (allowed: {allow})" if allow else ""), code="method_not_allowed",
                       headers={"Allow": allow} if allow else None)
        if request.url.path.startswith("/v1/messages"):      # Anthropic clients read their own error shape
            from dsv41.api import anthropic
            return anthropic.error_response(err)
        return err.response()
    return ApiError(exc.status_code, str(exc.detail)).response()


async def _too_deep(request, exc: RecursionError) -> Response:
    # msgspec (and the schema compilers) give up on absurdly nested JSON by raising RecursionError: the client's fault.
    return ApiError(400, "the request body nests too deeply; flatten it (JSON nesting is limited)",
                    code="invalid_request").response()


async def _server_error(request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return json_response({"error": {"message": f"internal error: {type(exc).__name__}: {exc}", "type": "server_error"}},
                 500)


def create_app(cfg, metrics: Metrics | None = None, on_startup=None, on_shutdown=None) -> tuple[Starlette, AppState]:
    # Both build on this module's request preparation: imported here, not at the top, to keep the import one-way.
    from dsv41.api import anthropic, responses
    metrics = metrics or Metrics()
    state = AppState(cfg, metrics)
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_card, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/", health, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/v1/metrics", metrics_text, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
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


__all__ = ["AppState", "JSONResponse", "create_app"]
