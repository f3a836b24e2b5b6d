#!/usr/bin/env python3
"""Release gates against any OpenAI-compatible server (serving.md §4; docs/gates.md says what each check asserts).

    python tools/gates.py --url http://127.0.0.1:8000 [--api-key K] [--only NAME,...] [--out results/gates.md]

Stdlib + httpx + jsonschema only, no dsv41 imports, so the same command gates a foreign server. The checks are about
protocol shape and exactness (equal token ids), never about the words, so they mean the same on a random-weight
checkpoint; `--expect-answers` adds the word checks of the reference gates (17*19 -> 323, the tool continuation
mentions 18) for a real model. Each check prints and reports `passed/total` sub-cases; the exit status is 1 when any
check fails (2 on bad usage). A check the server cannot run (no kept states, no image input, a prompt that fills
faster than the keepalive period) is SKIPPED with the reason; `--strict` counts skips as failures.
"""
from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import json
import os
import platform
import random
import re
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PASS, FAIL, SKIP = "pass", "FAIL", "skip"


class CheckFailed(Exception):
    """A sub-case failed; the message says what was expected and what came."""


class CheckSkipped(Exception):
    """The server cannot run this check (a missing feature); the message says why."""


@dataclass
class Result:
    name: str
    asserts: str
    passed: int = 0
    total: int = 0
    status: str = PASS
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


# ------------------------------------------------------------------------------------------------ HTTP client
class Client:
    def __init__(self, url: str, api_key: str | None, timeout: float, model: str | None):
        self.url = url.rstrip("/")
        self.url = self.url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.model = model

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def post(self, path: str, body: dict) -> dict:
        if self.model and "model" not in body:
            body = {"model": self.model, **body}
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            raise CheckFailed(f"POST {path} -> {r.status_code}: {r.text[:300]}")
        return r.json()

    def stream(self, path: str, body: dict) -> Stream:
        """POST with stream=true; reads the raw SSE bytes (comments included) and parses the frames."""
        if self.model and "model" not in body:
            body = {"model": self.model, **body}
        body = {**body, "stream": True}
        s = Stream()
        t0 = time.monotonic()
        with self.http.stream("POST", path, json=body) as r:
            s.status = r.status_code
            s.content_type = r.headers.get("content-type", "")
            if r.status_code != 200:
                r.read()
                raise CheckFailed(f"POST {path} (stream) -> {r.status_code}: {r.text[:300]}")
            buf = b""
            for piece in r.iter_raw():
                buf += piece
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    s.add(ev.decode("utf-8"), time.monotonic() - t0)
            if buf.strip():
                s.add(buf.decode("utf-8"), time.monotonic() - t0)
        return s


class Stream:
    """The SSE events of one response: `: comment` lines, `data:` JSON frames, the [DONE] marker."""

    def __init__(self):
        self.status = 0
        self.content_type = ""
        self.events: list[tuple[str, object, float]] = []     # (kind, payload, seconds since the request)
        self.done = False

    def add(self, ev: str, t: float) -> None:
        for line in ev.split("\n"):
            if not line:
                continue
            if line.startswith(":"):
                self.events.append(("comment", line, t))
            elif line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    self.done = True
                    self.events.append(("done", None, t))
                else:
                    try:
                        self.events.append(("data", json.loads(data), t))
                    except json.JSONDecodeError as e:
                        raise CheckFailed(f"an SSE data frame is not JSON ({e}): {data[:200]!r}") from None

    @property
    def frames(self) -> list[dict]:
        return [p for k, p, _ in self.events if k == "data"]

    def check_shape(self) -> None:
        expect(self.content_type.startswith("text/event-stream"), f"content-type {self.content_type!r}")
        expect(self.done and self.events[-1][0] == "done", "the stream does not end with data: [DONE]")
        for f in self.frames:
            expect("error" not in f, f"error frame in the stream: {f}")

    def chat_message(self) -> dict:
        """Join chat deltas into one message: content, reasoning_content, tool_calls (by index), finish_reason."""
        content, reasoning, calls, finish, ids = [], [], {}, None, None
        usage = None
        for f in self.frames:
            if f.get("usage"):
                usage = f["usage"]
            for ch in f.get("choices") or []:
                d = ch.get("delta") or {}
                if d.get("content"):
                    content.append(d["content"])
                if d.get("reasoning_content"):
                    reasoning.append(d["reasoning_content"])
                for tc in d.get("tool_calls") or []:
                    c = calls.setdefault(tc.get("index", 0), {"id": None, "name": "", "arguments": ""})
                    c["id"] = tc.get("id") or c["id"]
                    fn = tc.get("function") or {}
                    c["name"] += fn.get("name") or ""
                    c["arguments"] += fn.get("arguments") or ""
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
                    ids = _reply_ids(f, ch) or ids
        return {"content": "".join(content), "reasoning_content": "".join(reasoning),
                "tool_calls": [calls[k] for k in sorted(calls)], "finish_reason": finish, "usage": usage,
                "token_ids": ids}


def _reply_ids(obj: dict, choice: dict) -> list[int] | None:
    """Reply token ids where servers put them: choices[0].token_ids (vLLM, dsv41) or <vendor>.token_ids."""
    if isinstance(choice.get("token_ids"), list):
        return choice["token_ids"]
    for v in obj.values():
        if isinstance(v, dict) and isinstance(v.get("token_ids"), list):
            return v["token_ids"]
    return None


def reply_drafts(d: dict) -> tuple[int, int]:
    """(draft tokens verified, accepted) a reply reports: dsv41's usage.drafts, TensorFold's speculative."""
    u = (d.get("usage") or {}).get("drafts") or {}
    if u:
        return int(u.get("drafted_tokens") or 0), int(u.get("accepted_tokens") or 0)
    spec = d.get("speculative") or {}
    return int(spec.get("drafted") or 0), int(spec.get("accepted") or 0)


def reply_ids(resp: dict) -> list[int]:
    ids = _reply_ids(resp, resp["choices"][0])
    if ids is None:
        raise CheckFailed("the reply carries no token ids although return_token_ids was asked")
    return ids


def calls_of(msg: dict) -> list[dict]:
    return [{"id": c.get("id"), "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg.get("tool_calls") or []]


def check_chat_shape(r: dict) -> dict:
    expect(r.get("object") == "chat.completion", f"object {r.get('object')!r}")
    expect(str(r.get("id", "")).startswith("chatcmpl-"), f"id {r.get('id')!r}")
    ch = r["choices"][0]
    msg = ch["message"]
    expect(msg.get("role") == "assistant", f"role {msg.get('role')!r}")
    expect(msg.get("content") is None or isinstance(msg["content"], str), "content is neither a string nor null")
    expect(ch.get("finish_reason") in ("stop", "length", "tool_calls"), f"finish_reason {ch.get('finish_reason')!r}")
    u = r.get("usage") or {}
    expect(u.get("total_tokens") == u.get("prompt_tokens", -1) + u.get("completion_tokens", -1),
           f"usage totals do not add up: {u}")
    return msg


def no_dsml(text: str | None, where: str) -> None:
    if "DSML" in (text or ""):
        raise CheckFailed(f"DSML markup leaked into {where}: {text[:200]!r}")


# ------------------------------------------------------------------------------------------------ fixtures
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
# small closed argument spaces: a grammar-forced call finishes in a few tokens even on random weights, so its
# arguments can be validated in full
COLOR = {"type": "function", "function": {
    "name": "record_color", "description": "Record the color seen.",
    "parameters": {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                                    "sure": {"type": "boolean"}},
                   "required": ["color", "sure"], "additionalProperties": False}}}
SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "grade": {"enum": [1, 2, 3]}},
     "required": ["ok", "grade"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
]
NO_THINK = {"chat_template_kwargs": {"thinking": False, "enable_thinking": False}}
THINK = {"chat_template_kwargs": {"thinking": True, "enable_thinking": True}}
WEATHER_Q = "What's the weather in Paris in celsius? Use the tool."
PROSE = ("The lighthouse keeper climbed the stairs each evening, counting the steps as his father had, and lit the "
         "lamp whose beam swept the grey water. Ships passed in the night; some signalled, most did not. ")


def png_data_url(w: int = 8, h: int = 8, rgb: tuple = (220, 30, 30)) -> str:
    """A small solid-colour RGB PNG, built with zlib (no imaging library needed)."""
    raw = b"".join(b"\x00" + bytes(rgb) * w for _ in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


# ------------------------------------------------------------------------------------------------ the checks
class Gates:
    def __init__(self, c: Client, a: argparse.Namespace):
        self.c, self.a = c, a
        self._vocab_ids: list[int] | None = None

    # ---- helpers
    def run_many(self, fns, stagger: float = 0.0) -> list:
        """Run callables at once (a burst), or started `stagger` seconds apart; results in call order."""
        with cf.ThreadPoolExecutor(max_workers=max(1, min(len(fns), self.a.concurrency))) as ex:
            futs = []
            for i, f in enumerate(fns):
                if stagger and i:
                    time.sleep(stagger)
                futs.append(ex.submit(f))
            return [f.result() for f in futs]

    def text_ids(self, n: int) -> list[int]:
        """The first n ids of one text (via /tokenize when the server has it; else fixed ids of plain words)."""
        if self._vocab_ids is None or len(self._vocab_ids) < n:
            text = PROSE * (n // 30 + 2)
            ids = None
            for path in ("/tokenize", "/v1/tokenize"):
                try:
                    r = self.c.http.post(path, json={"prompt": text, "add_special_tokens": False})
                    if r.status_code == 200 and isinstance(r.json().get("tokens"), list):
                        ids = r.json()["tokens"]
                        break
                except httpx.HTTPError:
                    pass
            if ids is None:
                rng = random.Random(7)
                ids = [rng.randrange(1000, 30000) for _ in range(n + 64)]
            self._vocab_ids = ids
        expect(len(self._vocab_ids) >= n, f"the tokenizer gave {len(self._vocab_ids)} ids for a {n}-id prompt")
        return self._vocab_ids[:n]

    def completion_ids(self, prompt: list[int], n: int, sampled: int | None = None, **extra) -> list[int]:
        body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "return_token_ids": True, **extra}
        body.update({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": sampled} if sampled is not None
                    else {"temperature": 0})
        r = self.c.post("/v1/completions", body)
        ids = reply_ids(r)
        expect(len(ids) == n, f"{len(ids)} ids for max_tokens={n} with ignore_eos")
        return ids

    def oracle_prompts(self, k: int) -> list[list[int]]:
        """k different token-id prompts (the first 12+3i ids of the text, offset per prompt)."""
        base = self.text_ids(12 + 3 * k + 16 * k)
        return [base[16 * i:16 * i + 12 + 3 * i] for i in range(k)]

    # ---- 1
    def models(self, res: Result) -> None:
        r = self.c.get("/v1/models")
        res.total += 1
        expect(r.status_code == 200, f"/v1/models -> {r.status_code}: {r.text[:200]}")
        data = r.json()
        expect(data.get("object") == "list" and data.get("data"), f"no models listed: {data}")
        ids = [m.get("id") for m in data["data"]]
        expect(all(isinstance(i, str) and i for i in ids), f"model ids {ids}")
        if self.c.model:
            expect(self.c.model in ids, f"--model {self.c.model!r} not listed in {ids}")
        else:
            self.c.model = ids[0]
        res.passed += 1
        res.notes.append(f"served ids {ids}; gating {self.c.model!r}")

    # ---- 2
    def chat_probe(self, res: Result) -> None:
        res.total += 1
        r = self.c.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "17*19="}],
                                                  "max_tokens": self.a.tokens, "temperature": 0, **NO_THINK})
        msg = check_chat_shape(r)
        expect(isinstance(msg.get("content"), str), "a toolless reply has string content")
        expect(not msg.get("reasoning_content"), "thinking off, yet reasoning_content came")
        if self.a.expect_answers:
            expect("323" in msg["content"], f"17*19: no 323 in {msg['content'][:200]!r}")
        res.passed += 1

    # ---- 3
    def reasoning_stream(self, res: Result) -> None:
        res.total += 1
        budget = max(1, self.a.reason_tokens // 2)
        s = self.c.stream("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Is 391 prime? Answer yes or no."}],
            "max_tokens": self.a.reason_tokens, "thinking_budget": budget,
            "stream_options": {"include_usage": True}, **THINK})
        s.check_shape()
        m = s.chat_message()
        expect(m["finish_reason"] in ("stop", "length"), f"finish_reason {m['finish_reason']!r}")
        expect(m["reasoning_content"], "no reasoning_content deltas with thinking on")
        no_dsml(m["content"], "content")
        if m["content"]:
            res.passed += 1
            return
        # a random-weight model never closes its think block by itself: without a thinking_budget the reply ends
        # at max_tokens still reasoning; accept that only when usage says every reply token was reasoning
        u = m["usage"] or {}
        rt = (u.get("completion_tokens_details") or {}).get("reasoning_tokens")
        expect(m["finish_reason"] == "length" and rt is not None and rt == u.get("completion_tokens"),
               f"no content, and not a think block cut by max_tokens (finish {m['finish_reason']}, usage {u})")
        expect(not self.a.strict, f"no content after {self.a.reason_tokens} tokens: the server did not close "
                                  f"the think block at thinking_budget={budget}")
        res.passed += 1
        res.notes.append(f"tolerant: no content within {self.a.reason_tokens} tokens; thinking_budget={budget} "
                         f"not honoured (the think block stayed open; all {rt} reply tokens counted as reasoning)")

    # ---- 4
    def tool_call(self, res: Result) -> None:
        msgs = [{"role": "user", "content": WEATHER_Q}]
        body = {"messages": msgs, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": self.a.tokens,
                "temperature": 0, "return_token_ids": True, **NO_THINK}
        res.total += 1
        r = self.c.post("/v1/chat/completions", body)
        msg = check_chat_shape(r)
        no_dsml(msg.get("content"), "content")
        calls = calls_of(msg)
        for cl in calls:
            expect(cl["name"] == "get_weather", f"call of {cl['name']!r}")
            expect(re.fullmatch(r"call_[0-9A-Za-z_-]+", cl["id"] or "") is not None, f"call id {cl['id']!r}")
        if calls:
            expect(r["choices"][0]["finish_reason"] == "tool_calls", "calls made but finish_reason is not tool_calls")
            expect(msg.get("content") in (None, ""), f"content beside the calls: {msg.get('content')!r}")
        if self.a.expect_answers:
            expect(calls and json.loads(calls[0]["arguments"]).get("city", "").lower().startswith("paris"),
                   f"no get_weather(city=Paris) call: {msg}")
        res.passed += 1
        res.notes.append(f"auto, not streamed: {len(calls)} call(s), finish {r['choices'][0]['finish_reason']}")

        res.total += 1
        s = self.c.stream("/v1/chat/completions", body)
        s.check_shape()
        m = s.chat_message()
        no_dsml(m["content"], "streamed content")
        expect([(x["name"], x["arguments"]) for x in m["tool_calls"]] == [(x["name"], x["arguments"]) for x in calls],
               f"streamed calls {m['tool_calls']} != not streamed {calls}")
        expect((m["content"] or None) == (msg.get("content") or None),
               "streamed content differs from the same greedy request not streamed")
        if m["token_ids"] is not None and _reply_ids(r, r["choices"][0]) is not None:
            expect(m["token_ids"] == reply_ids(r), "streamed reply ids differ from the same request not streamed")
        res.passed += 1

        # continuation with the tool result (the model's own call, else a written one: the history shape is tested)
        res.total += 1
        call = calls[0] if calls else {"id": "call_000000000000000000000001", "name": "get_weather",
                                       "arguments": json.dumps({"city": "Paris", "unit": "c"})}
        hist = msgs + [{"role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["id"],
             "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "light rain"})}]
        r2 = self.c.post("/v1/chat/completions", {**body, "messages": hist})
        msg2 = check_chat_shape(r2)
        no_dsml(msg2.get("content"), "continuation content")
        if self.a.expect_answers:
            expect("18" in (msg2.get("content") or ""), f"the continuation does not mention 18: {msg2}")
        res.passed += 1
        if not calls:
            res.notes.append("no automatic call on this model: the continuation used a written call")

    # ---- 5
    def forced_calls(self, res: Result) -> None:
        import jsonschema
        msgs = [{"role": "user", "content": "What color is the sky? Record it."}]
        for choice, want in (("required", None),
                             ({"type": "function", "function": {"name": "record_color"}}, "record_color"),
                             ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")):
            for stream in (False, True):
                res.total += 1
                body = {"messages": msgs, "tools": [WEATHER, COLOR], "tool_choice": choice,
                        "max_tokens": self.a.call_tokens, "temperature": 0, "return_token_ids": True, **NO_THINK}
                if stream:
                    s = self.c.stream("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
                    s.check_shape()
                    m = s.chat_message()
                    calls, content, finish, usage = m["tool_calls"], m["content"], m["finish_reason"], m["usage"]
                else:
                    r = self.c.post("/v1/chat/completions", body)
                    msg = check_chat_shape(r)
                    calls, content, finish, usage = calls_of(msg), msg.get("content"), \
                        r["choices"][0]["finish_reason"], r["usage"]
                label = f"tool_choice={choice if isinstance(choice, str) else want}, stream={stream}"
                expect(len(calls) >= 1, f"{label}: no call")
                expect(not content, f"{label}: content beside a forced call: {content!r}")
                no_dsml(content, "content")
                # A call cut by max_tokens finishes "length" (OpenAI, vLLM): its arguments may be cut short, so they
                # are only checked when the reply says the call is complete ("tool_calls").
                cut = bool(usage) and usage.get("completion_tokens") == self.a.call_tokens
                expect(finish == "tool_calls" or (finish == "length" and cut),
                       f"{label}: finish_reason {finish!r} after {usage and usage.get('completion_tokens')} tokens")
                for cl in calls:
                    expect(cl["name"] in ("get_weather", "record_color"), f"{label}: call of {cl['name']!r}")
                    if want:
                        expect(cl["name"] == want, f"{label}: call of {cl['name']!r}")
                    if finish == "length":
                        res.notes.append(f"{label}: the call ran to max_tokens ({self.a.call_tokens}), finish length; "
                                         f"arguments not checked")
                        continue
                    try:
                        args = json.loads(cl["arguments"])
                    except json.JSONDecodeError:
                        raise CheckFailed(f"{label}: arguments are not JSON: {cl['arguments'][:200]!r}") from None
                    schema = (COLOR if cl["name"] == "record_color" else WEATHER)["function"]["parameters"]
                    try:
                        jsonschema.validate(args, schema)
                    except jsonschema.ValidationError as e:
                        raise CheckFailed(f"{label}: arguments {args} break the schema: {e.message}") from None
                res.passed += 1

    # ---- 6
    def structured_output(self, res: Result) -> None:
        import jsonschema
        for i, schema in enumerate(SCHEMAS):
            for stream in (False, True):
                res.total += 1
                body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": self.a.json_tokens,
                        "temperature": 0.7, "seed": 11 + i,
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
                        **NO_THINK}
                if stream:
                    s = self.c.stream("/v1/chat/completions", body)
                    s.check_shape()
                    m = s.chat_message()
                    text, finish = m["content"], m["finish_reason"]
                else:
                    r = self.c.post("/v1/chat/completions", body)
                    text, finish = check_chat_shape(r).get("content"), r["choices"][0]["finish_reason"]
                expect(finish == "stop", f"schema {i} stream={stream}: finish_reason {finish!r} (text {text!r})")
                try:
                    jsonschema.validate(json.loads(text), schema)
                except (json.JSONDecodeError, TypeError, jsonschema.ValidationError) as e:
                    raise CheckFailed(f"schema {i} stream={stream}: {text!r}: {e}") from None
                res.passed += 1
        res.total += 1
        bad = self.c.http.post("/v1/chat/completions", json={
            "model": self.c.model, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": 3}}})
        expect(bad.status_code == 400 and "error" in bad.json(), f"a malformed schema -> {bad.status_code}")
        res.passed += 1

    # ---- 7
    def drafted_equals_serial(self, res: Result) -> None:
        prompts = self.oracle_prompts(self.a.prompts)
        n = self.a.tokens
        jobs = [(p, None) for p in prompts] + [(p, 1234 + i) for i, p in enumerate(prompts[:self.a.prompts // 2])]
        counters0 = self.draft_counters()
        drafted = accepted = 0
        for p, seed in jobs:
            res.total += 1
            body = {"prompt": p, "max_tokens": n, "ignore_eos": True, "return_token_ids": True}
            body.update({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": seed} if seed is not None
                        else {"temperature": 0})
            d = self.c.post("/v1/completions", body)
            s = self.c.post("/v1/completions", {**body, "draft": False})
            dr, ac = reply_drafts(d)
            drafted, accepted = drafted + dr, accepted + ac
            expect(reply_ids(d) == reply_ids(s), f"prompt of {len(p)} ids, seed {seed}: drafted {reply_ids(d)} != "
                                                 f"serial {reply_ids(s)}")
            expect(reply_drafts(s)[0] == 0, f"prompt of {len(p)} ids: the `\"draft\": false` reply reports drafted "
                                            f"tokens")
            res.passed += 1
        where = "in the replies"
        if not drafted and counters0 is not None:
            counters1 = self.draft_counters()
            drafted, accepted = counters1[0] - counters0[0], counters1[1] - counters0[1]
            where = "on /metrics"
        if drafted:
            res.notes.append(f"drafting exercised: {drafted} draft tokens verified, {accepted} accepted ({where})")
        else:
            expect(not self.a.strict, "the server reported no drafted tokens: the check did not exercise drafting")
            res.notes.append("tolerant: the server reported no drafted tokens (`usage.drafts`, `speculative`, "
                             "`*draft_tokens_total` on /metrics): the equality holds but does not exercise drafting; "
                             "--strict fails it")

    def draft_counters(self) -> tuple[int, int] | None:
        """(draft tokens verified, accepted) from /metrics counters (dsv41 and vLLM names), None without them."""
        r = self.c.get("/metrics")
        if r.status_code != 200:
            return None
        got: dict[str, float] = {}
        for m in re.finditer(r"^(?:[A-Za-z_]+:)?(draft_tokens_total|draft_accepted_tokens_total|"
                             r"spec_decode_num_draft_tokens_total|spec_decode_num_accepted_tokens_total)"
                             r"(?:\{[^}]*\})? ([0-9.eE+-]+)$", r.text, re.MULTILINE):
            got[m.group(1)] = got.get(m.group(1), 0.0) + float(m.group(2))
        if not got:
            return None
        d = got.get("draft_tokens_total", got.get("spec_decode_num_draft_tokens_total", 0))
        a = got.get("draft_accepted_tokens_total", got.get("spec_decode_num_accepted_tokens_total", 0))
        return int(d), int(a)

    # ---- 8
    def concurrent_equals_solo(self, res: Result) -> None:
        prompts = self.oracle_prompts(self.a.prompts + 4)
        jobs = [(p, None) for p in prompts[:self.a.prompts]] + [(p, 1000 + i) for i, p in
                                                                 enumerate(prompts[self.a.prompts:])]
        fns = [lambda p=p, s=s: self.completion_ids(p, self.a.tokens, s) for p, s in jobs]
        solo = [f() for f in fns]
        expect(len({tuple(x) for x in solo}) > 1, "every prompt gave the same reply: the check cannot tell")
        for label, stagger in (("burst", 0.0), ("staggered", self.a.stagger)):
            got = self.run_many(fns, stagger)
            for i, (g, s) in enumerate(zip(got, solo)):
                res.total += 1
                expect(g == s, f"{label} #{i} ({'seeded' if jobs[i][1] is not None else 'greedy'}): {g} != solo {s}")
                res.passed += 1
        res.notes.append(f"{self.a.prompts} greedy + 4 seeded (T=0.6) prompts, {self.a.tokens} tokens, ignore_eos; "
                         f"burst and {self.a.stagger:g} s staggered")

    # ---- 9
    def resumed_equals_cold(self, res: Result) -> None:
        # a fresh cache_salt per run: the first request is cold even on a server that has seen this conversation;
        # the next turn is sent under the run's salt (resumes) and under another fresh salt (cold)
        salt, other = (f"gates-{random.getrandbits(64):016x}" for _ in range(2))
        hist = [{"role": "system", "content": PROSE * 3},
                {"role": "user", "content": "Tell me about the keeper."}]
        body = {"messages": hist, "max_tokens": self.a.tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **NO_THINK}

        def cached(r: dict) -> int:
            return ((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0

        res.total += 1
        cold = self.c.post("/v1/chat/completions", {**body, "cache_salt": salt})
        warm = self.c.post("/v1/chat/completions", {**body, "cache_salt": salt})
        expect(reply_ids(cold) == reply_ids(warm), "the same conversation sent twice gave other ids")
        res.passed += 1
        res.total += 1
        hist2 = hist + [{"role": "assistant", "content": warm["choices"][0]["message"].get("content") or ""},
                        {"role": "user", "content": "And then?"}]
        nxt = self.c.post("/v1/chat/completions", {**body, "messages": hist2, "cache_salt": salt})
        nxt_cold = self.c.post("/v1/chat/completions", {**body, "messages": hist2, "cache_salt": other})
        expect(reply_ids(nxt) == reply_ids(nxt_cold), "the next turn resumed != the same turn cold")
        res.passed += 1
        if cached(warm) == 0 and cached(nxt) == 0:
            raise CheckSkipped("cached_tokens stayed 0 on a repeated prefix: the server keeps no prompt states "
                               "(resume not exercised; replies of repeated requests are equal)")
        res.total += 1
        expect(cached(cold) == 0, f"the first request under a fresh cache_salt resumed {cached(cold)} tokens")
        expect(cached(warm) > 0, f"the repeated conversation resumed nothing (cached_tokens {cached(warm)})")
        res.passed += 1
        res.notes.append(f"cached_tokens: cold {cached(cold)}, repeat {cached(warm)}, next turn {cached(nxt)} "
                         f"(under another salt {cached(nxt_cold)}); prompt {warm['usage']['prompt_tokens']} tokens")

    # ---- 10
    def length_sweep(self, res: Result) -> None:
        sizes = set(self.a.sizes)
        h = self.c.get("/health")
        if h.status_code == 200 and h.headers.get("content-type", "").startswith("application/json"):
            for k, v in _flatten(h.json()):
                if isinstance(v, int) and not isinstance(v, bool) and re.search(r"chunk|window|group|ratio", k) \
                        and 2 <= v <= self.a.max_sweep:
                    sizes.add(v)
        lengths = set(range(1, self.a.sweep_max_short + 1))
        for s in sizes:
            lengths |= {n for n in (s - 1, s, s + 1) if 1 <= n <= self.a.max_sweep}
        lengths = sorted(lengths)
        text = self.text_ids(max(lengths))
        n = self.a.sweep_tokens
        orders = {"ascending": lengths, "descending": lengths[::-1],
                  "shuffled": random.Random(2026).sample(lengths, len(lengths))}
        got: dict[str, dict[int, list[int]]] = {}
        for name, order in orders.items():
            out = self.run_many([lambda L=L: self.completion_ids(text[:L], n) for L in order])
            got[name] = dict(zip(order, out))
        for L in lengths:
            res.total += 1
            a = got["ascending"][L]
            expect(got["descending"][L] == a and got["shuffled"][L] == a,
                   f"length {L}: replies differ by request order: {[got[o][L] for o in orders]}")
            res.passed += 1
        res.notes.append(f"{len(lengths)} lengths (1..{self.a.sweep_max_short} and the neighbours of "
                         f"{sorted(sizes)}), {n} greedy tokens each, 3 orders at {self.a.concurrency} in flight")

    # ---- 11
    def images(self, res: Result) -> None:
        url = png_data_url()
        res.total += 1
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What color is this?"},
                                                           {"type": "image_url", "image_url": {"url": url}}]}],
                "max_tokens": self.a.tokens, "temperature": 0, "return_token_ids": True, **NO_THINK}
        r = self.c.http.post("/v1/chat/completions", json={"model": self.c.model, **body})
        if r.status_code == 400:
            raise CheckSkipped(f"the server refuses image input: {r.json().get('error', {}).get('message')!r}")
        expect(r.status_code == 200, f"image chat -> {r.status_code}: {r.text[:200]}")
        check_chat_shape(r.json())
        res.passed += 1
        res.total += 1
        again = self.c.post("/v1/chat/completions", body)
        expect(reply_ids(again) == reply_ids(r.json()), "the same image prompt gave other ids")
        res.passed += 1
        res.total += 1
        bad = self.c.http.post("/v1/chat/completions", json={"model": self.c.model, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]},
            {"role": "user", "content": "and?"}]})
        expect(bad.status_code == 400 and "error" in bad.json(), f"an image in an assistant turn -> {bad.status_code}")
        res.passed += 1

    # ---- 12
    def keepalive(self, res: Result) -> None:
        res.total += 1
        ids = self.text_ids(self.a.keepalive_tokens)
        s = self.c.stream("/v1/completions", {"prompt": ids, "max_tokens": 1})
        s.check_shape()
        first = next((t for k, _, t in s.events if k == "data"), None)
        expect(first is not None, "no data frame")
        before = [p for k, p, t in s.events if k == "comment" and t <= first]
        if first <= self.a.keepalive_after:
            if before:
                res.passed += 1
                res.notes.append(f"{len(before)} comment(s) before the first frame at {first:.1f} s")
                return
            raise CheckSkipped(f"a {len(ids)}-token prompt gave its first frame after {first:.1f} s, before the "
                               f"{self.a.keepalive_after:g} s keepalive period: raise --keepalive-tokens")
        expect(any(p.startswith(": keepalive") for p in before),
               f"first data frame after {first:.1f} s with no ': keepalive' comment before it")
        res.passed += 1
        res.notes.append(f"{len(ids)}-token prompt: first frame at {first:.1f} s after {len(before)} keepalive "
                         f"comment(s)")

    # ---- 13
    def metrics(self, res: Result) -> None:
        res.total += 1
        r = self.c.get("/metrics")
        expect(r.status_code == 200, f"/metrics -> {r.status_code}")
        names = set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})? ", r.text, re.MULTILINE))
        missing = []
        for fam in self.a.metric_families:
            if not any(n in (fam, fam + "_bucket") or n.endswith((":" + fam, ":" + fam + "_bucket"))
                       for n in names):
                missing.append(fam)
        expect(not missing, f"families missing from /metrics: {missing}")
        res.passed += 1


def _flatten(obj, prefix: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, obj


CHECKS = {
    "models": "the served id is listed in /v1/models (object list, string ids)",
    "chat_probe": "greedy, thinking off: a chat.completion with role assistant, string content, a finish_reason, "
                  "usage totals that add up, no reasoning_content (--expect-answers: 17*19 -> 323)",
    "reasoning_stream": "thinking on, streamed: SSE content type, JSON frames, [DONE] last, reasoning_content deltas "
                        "and content deltas (tolerant: with no content, finish length and every reply token counted "
                        "as reasoning = a think block the server did not close; --strict fails it)",
    "tool_call": "tool_choice auto: calls (if any) are get_weather with call_ ids and finish tool_calls, no DSML in "
                 "content; streamed == not streamed (same calls, content, ids); the continuation with the tool "
                 "result answers in shape (--expect-answers: a Paris call, the reply mentions 18)",
    "forced_calls": "tool_choice required / named (record_color, get_weather), streamed and not: at least one call, "
                    "the named one, no content, finish tool_calls with arguments JSON that validate against the "
                    "schema, or finish length for a call cut at max_tokens (its arguments not checked)",
    "structured_output": "response_format json_schema (3 schemas, streamed and not, T=0.7 seeded): finish stop and "
                         "the content validates with jsonschema; a malformed schema gets 400",
    "drafted_equals_serial": "/v1/completions with token-id prompts, ignore_eos, return_token_ids: the default "
                             "request and `\"draft\": false` give the same ids (greedy and T=0.6 seeded), the latter "
                             "reporting no drafts; the note counts draft tokens verified (usage.drafts or /metrics; "
                             "none: tolerant, --strict fails it)",
    "concurrent_equals_solo": "greedy and seeded token-id prompts: burst and staggered replies == solo replies (ids)",
    "resumed_equals_cold": "a conversation sent twice under a fresh cache_salt: equal ids, cached_tokens 0 then > 0; "
                           "its next turn under that salt (resumed) == under another fresh salt (cold) (skipped "
                           "when the server keeps no prompt states)",
    "length_sweep": "prompts of the first L ids of one text, L = 1..N and the neighbours of every chunk/window/"
                    "group size (flags and /health): the same greedy reply in ascending, descending and shuffled "
                    "request order",
    "images": "a PNG data URL in a user message: a chat reply, the same ids twice; an image in an assistant turn "
              "gets 400 (skipped when the server refuses image input with 400)",
    "keepalive": "a long streamed prompt: ': keepalive' comments arrive before the first data frame when it comes "
                 "after the keepalive period (skipped when the prompt fills faster)",
    "metrics": "/metrics (Prometheus text) has each family of --metric-families, under any prefix",
}
DEFAULT_FAMILIES = ["requests_running", "requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                    "kv_cache_usage_ratio", "request_latency_seconds", "time_to_first_token_seconds",
                    "client_disconnections_total", "requests_total"]


def write_report(path: Path, results: list[Result], args: argparse.Namespace, argv: list[str], started: str) -> None:
    lines = ["# Release gates", "", f"Command: `python tools/gates.py {' '.join(argv)}`", "",
             f"Server: {args.url} (model {args.model!r}); started {started}", "",
             (f"Client machine: {platform.node()}, {platform.system()} {platform.machine()}, {os.cpu_count()} "
              f"CPUs (a loopback server shares it)"), "",
             "| check | result | passed | seconds | asserts |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.status} | {r.passed}/{r.total} | {r.seconds:.1f} | {r.asserts} |")
    lines += ["", "## Notes", ""]
    for r in results:
        for n in r.notes:
            lines.append(f"- **{r.name}**: {n}")
    fails = [r.name for r in results if r.status == FAIL]
    lines += ["", f"Result: {'FAIL (' + ', '.join(fails) + ')' if fails else 'all checks passed or skipped'}", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL (with or without /v1)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    p.add_argument("--model", default=None, help="model id to gate (default: the first listed)")
    p.add_argument("--only", default="", help="comma-separated check names (default: all): " + ",".join(CHECKS))
    p.add_argument("--out", default="results/gates.md", help="markdown report path")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per HTTP request")
    p.add_argument("--tokens", type=int, default=32, help="reply tokens of most checks")
    p.add_argument("--reason-tokens", type=int, default=1024, help="max_tokens of the reasoning stream "
                   "(thinking_budget = half)")
    p.add_argument("--call-tokens", type=int, default=256, help="max_tokens of forced calls")
    p.add_argument("--json-tokens", type=int, default=256, help="max_tokens of structured output (a grammar "
                   "allows blanks between JSON tokens, which a random-weight model draws often)")
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts of the exactness checks")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight in bursts and sweeps")
    p.add_argument("--stagger", type=float, default=0.4, help="seconds between staggered starts")
    p.add_argument("--sizes", default="64,128,512,2048", help="chunk/window/compression-group sizes whose "
                   "neighbours the length sweep covers (comma-separated; sizes in /health are added)")
    p.add_argument("--sweep-max-short", type=int, default=160, help="the sweep covers every length 1..N")
    p.add_argument("--max-sweep", type=int, default=4096, help="longest sweep prompt")
    p.add_argument("--sweep-tokens", type=int, default=8, help="reply tokens per sweep prompt")
    p.add_argument("--keepalive-tokens", type=int, default=32768, help="prompt length of the keepalive check")
    p.add_argument("--keepalive-after", type=float, default=10.0, help="keepalive period the check expects (s)")
    p.add_argument("--metric-families", default=",".join(DEFAULT_FAMILIES), help="families /metrics must have")
    p.add_argument("--expect-answers", action="store_true", help="also check the words (a real model only)")
    p.add_argument("--strict", action="store_true", help="skipped and tolerant checks count as failures")
    a = p.parse_args(argv)
    a.only = [x for x in a.only.split(",") if x]
    unknown = [x for x in a.only if x not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    a.sizes = [int(x) for x in a.sizes.split(",") if x]
    a.metric_families = [x for x in a.metric_families.split(",") if x]
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    c = Client(a.url, a.api_key, a.timeout, a.model)
    g = Gates(c, a)
    names = a.only or list(CHECKS)
    if "models" not in names:
        names = ["models"] + names           # resolves the model id the other checks send
    results = []
    for name in names:
        res = Result(name, CHECKS[name])
        t0 = time.monotonic()
        try:
            getattr(g, name)(res)
            res.status = PASS
        except CheckSkipped as e:
            res.status = FAIL if a.strict else SKIP
            res.notes.append(f"skipped: {e}")
        except CheckFailed as e:
            res.status = FAIL
            res.notes.append(f"failed: {e}")
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
            res.status = FAIL
            res.notes.append(f"failed: {type(e).__name__}: {e}")
        res.seconds = time.monotonic() - t0
        results.append(res)
        print(f"{name:24s} {res.status:5s} {res.passed}/{res.total}  {res.seconds:7.1f} s", flush=True)
        for n in res.notes:
            print(f"    {n}", flush=True)
    a.model = c.model
    write_report(Path(a.out), results, a, argv, started)
    print(f"report: {a.out}")
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
