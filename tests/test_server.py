"""The live server, started as scripts/serve.sh does (`python -m dsv41 serve`), on the built-in tiny checkpoint
(random weights, the real V4.1 tokenizer; DSV41_MODEL overrides), shared by every test of this module.

Small knobs make the paths show on a small model: prompt chunks of 64 rows (prompts span rounds), a 512-position
context, keepalive comments every 0.3 s.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 512


class LiveServer:
    def __init__(self, *args: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "dsv41", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._url = threading.Event()
        self.url = ""
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and not self.url:
                self.url = m.group(1)
                self._url.set()

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.lines[-40:]))
            if self._url.is_set():
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError("server not ready in time:\n" + "".join(self.lines[-40:]))

    def __enter__(self) -> "LiveServer":
        """`with LiveServer(...) as s:` waits until it serves and stops it on the way out, even when the start fails."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def openai_client(self, api_key: str = "none", timeout: float = 300) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, timeout=timeout, max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server():
    with LiveServer("--context", str(CONTEXT), "--prefill-chunk", "64", "--keepalive-s", "0.3",
                    "--state-budget-gib", "2", "--shutdown-grace-s", "20", "--name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^dsv41:{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def ids_prompt(i: int, n: int = 12) -> list[int]:
    return [0] + [100 + (i * 37 + j * 11) % 300 for j in range(n - 1)]


# ------------------------------------------------------------------------------------------------ openai client
def test_models_health_tokenize(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    raw = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert raw["context_length"] == CONTEXT and raw["max_model_len"] == CONTEXT
    msgs = [{"role": "user", "content": "What is 17*19?"}]
    tk = httpx.post(server.url + "/tokenize", json={"messages": msgs, **NO_THINK}).json()
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body=NO_THINK)
    assert tk["count"] == len(tk["tokens"]) == chat.usage.prompt_tokens
    assert tk["max_model_len"] == CONTEXT
    text = httpx.post(server.url + "/detokenize", json={"tokens": tk["tokens"]}).json()["prompt"]
    assert "17*19" in text and text.endswith("</think>")


def test_chat_and_completions_plain_and_streamed(client):
    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, extra_body=NO_THINK)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens <= 6 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("length", "stop")
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_THINK)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (r.choices[0].message.content or "")
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    c = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert c.object == "text_completion" and c.usage.completion_tokens == 5 and c.choices[0].finish_reason == "length"
    s = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(x.choices[0].text for x in s if x.choices) == c.choices[0].text
    assert s[-1].usage.completion_tokens == 5


def test_thinking_reply_counts_reasoning_tokens(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Think."}], max_tokens=5,
                                       temperature=0, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert r.usage.completion_tokens_details.reasoning_tokens >= 1
    assert r.usage.completion_tokens_details.reasoning_tokens <= r.usage.completion_tokens


def test_thinking_budget_forces_the_close(server, client):
    close = httpx.post(server.url + "/tokenize", json={"prompt": "\n</think>\n\n", "add_special_tokens": False})
    close_ids = close.json()["tokens"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Think briefly."}],
                                       max_tokens=12, temperature=0, logprobs=False,
                                       extra_body={"chat_template_kwargs": {"thinking": True}, "thinking_budget": 3,
                                                   "return_token_ids": True, "ignore_eos": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert ids[3:3 + len(close_ids)] == close_ids            # 3 drawn reasoning tokens, then the forced close
    think_end = httpx.post(server.url + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False})
    (end_id,) = think_end.json()["tokens"]
    assert r.usage.completion_tokens_details.reasoning_tokens == 3 + close_ids.index(end_id) + 1
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                "thinking_budget": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_budget"


def test_max_tokens_and_stop(client):
    base = client.completions.create(model="tiny", prompt=ids_prompt(3), max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert base.usage.completion_tokens == 24
    # a stop string from the middle of the greedy text: the same request stops there, the match left out
    cands = [text[i:i + 2] for i in range(len(text) // 3, len(text) - 2) if "\ufffd" not in text[i:i + 2]
             and text[i:i + 2].strip()]
    assert cands, text
    stop = cands[0]
    cut = client.completions.create(model="tiny", prompt=ids_prompt(3), max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.usage.completion_tokens < 24
    short = client.completions.create(model="tiny", prompt=ids_prompt(3), max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_seeded_sampling_repeats(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
              temperature=0.9, top_p=0.95, seed=1234, extra_body=NO_THINK)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    other = client.chat.completions.create(**dict(kw, seed=99)).choices[0].message.content
    assert isinstance(other, str)


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINK)
    lps = r.choices[0].logprobs.content
    assert len(lps) == 3
    for e in lps:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)   # greedy: the chosen token is the best


# ------------------------------------------------------------------------------------------------ exactness
def _completion(url: str, i: int, sampled: bool) -> dict:
    body = {"prompt": ids_prompt(i, 8 + i % 5), "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    body.update({"temperature": 0.8, "top_k": 20, "top_p": 0.95, "seed": 1000 + i} if sampled else
                {"temperature": 0})
    return body


async def _send(http: httpx.AsyncClient, url: str, body: dict, delay: float = 0.0) -> list[int]:
    await asyncio.sleep(delay)
    r = await http.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_concurrent_equals_solo(server):
    bodies = [_completion(server.url, i, False) for i in range(16)] + \
             [_completion(server.url, 100 + i, True) for i in range(8)]

    async def run():
        async with httpx.AsyncClient() as http:
            solo = [await _send(http, server.url, b) for b in bodies]
            burst = await asyncio.gather(*[_send(http, server.url, b) for b in bodies])
            stag = await asyncio.gather(*[_send(http, server.url, b, 0.07 * k) for k, b in enumerate(bodies)])
            return solo, burst, stag

    solo, burst, stag = asyncio.run(run())
    assert all(len(s) == 8 for s in solo)
    assert len({tuple(s) for s in solo}) > 12          # different prompts, different replies
    assert burst == solo
    assert stag == solo


# ------------------------------------------------------------------------------------------------ life of a stream
@pytest.fixture(scope="module")
def long_server():
    """A server whose replies may run to 8,000 tokens: the disconnect test's reply must still be decoding when the
    client leaves, and 400 tokens of the tiny model (~1 s) could finish while a loaded CI machine reads 3 frames."""
    with LiveServer("--context", "8192", "--prefill-chunk", "64", "--state-budget-gib", "2", "--name", "tiny") as s:
        yield s


def test_disconnect_frees_the_sequence(long_server):
    server = long_server
    before = metric(server.url, "client_disconnections_total")
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions",
                         json={"prompt": ids_prompt(7), "max_tokens": 8000, "ignore_eos": True, "stream": True}) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])            # one frame is one line, whatever characters the tokens hold
                    n += 1
                if n == 3:
                    break
            assert metric(server.url, "requests_running") == 1
    t0 = time.monotonic()
    while metric(server.url, "requests_running") != 0:
        assert time.monotonic() - t0 < 5, "the cancelled sequence was not freed"
        time.sleep(0.05)
    assert metric(server.url, "client_disconnections_total") == before + 1
    assert metric(server.url, "kv_cache_usage_ratio") == 0.0
    assert metric(server.url, "request_finished_total", '{reason="cancelled"}') >= 1


def test_disconnect_of_a_plain_request_frees_it_too(server):
    before = metric(server.url, "client_disconnections_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"prompt": ids_prompt(8), "max_tokens": 400, "ignore_eos": True})
    t0 = time.monotonic()
    while metric(server.url, "requests_running") != 0:
        assert time.monotonic() - t0 < 5, "the abandoned request kept its sequence"
        time.sleep(0.05)
    assert metric(server.url, "client_disconnections_total") == before + 1


def test_keepalive_while_the_prompt_fills(server):
    body = {"prompt": ids_prompt(11, 480), "max_tokens": 1, "stream": True}
    lines = []
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                lines.append(line)
    first_data = next(i for i, x in enumerate(lines) if x.startswith("data: "))
    assert ": keepalive" in lines[:first_data]
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"


def test_200_requests_through_32_streams(server):
    async def run():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=250)) as http:
            bodies = [{"prompt": ids_prompt(i, 4), "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True} for i in range(200)]
            return await asyncio.gather(*[_send(http, server.url, b) for b in bodies])

    out = asyncio.run(run())
    assert len(out) == 200 and all(len(x) == 2 for x in out)
    assert metric(server.url, "requests_running") == 0 and metric(server.url, "requests_waiting") == 0


def test_bad_requests_get_400_while_a_stream_goes_on(server):
    result: dict = {}

    def stream():
        with httpx.Client(timeout=300) as http:
            with http.stream("POST", server.url + "/v1/completions",
                             json={"prompt": ids_prompt(5), "max_tokens": 30, "ignore_eos": True, "stream": True,
                                   "return_token_ids": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        obj = json.loads(line[6:])
                        if obj["choices"] and obj["choices"][0]["finish_reason"]:
                            result["final"] = obj["choices"][0]

    t = threading.Thread(target=stream)
    t.start()
    chat = server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (chat, b'{"messages": [', None, "not valid JSON"),
        (chat, {"messages": msgs, "temperature": "hot"}, "temperature", "temperature"),
        (chat, {"messages": msgs, "max_tokens": True}, "max_tokens", "max_tokens"),
        (chat, {"messages": msgs, "reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
        (chat, {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
        (chat, {"messages": msgs, "n": 17}, "n", "`n` must be in 1..16"),
        (chat, {"messages": msgs, "top_p": 0}, "top_p", "top_p"),
        (chat, {"messages": msgs, "max_tokens": CONTEXT}, "messages", "maximum context length"),
        (server.url + "/v1/completions", {"prompt": ids_prompt(1, CONTEXT + 5)}, "prompt", "maximum context length"),
        (server.url + "/v1/completions", {"prompt": [1, 2, 10**7]}, "prompt", "outside the vocabulary"),
    ]
    with httpx.Client(timeout=60) as http:
        for url, body, param, words in cases:
            r = http.post(url, content=body) if isinstance(body, bytes) else http.post(url, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert words in err["message"], (words, err)
            assert err["param"] == param, (body, err)
            if "maximum context length" in words:
                assert err["code"] == "context_length_exceeded"
        assert http.get(server.url + "/v1/nowhere").status_code == 404
    t.join(timeout=300)
    assert result["final"]["finish_reason"] == "length" and len(result["final"]["token_ids"]) == 30


def test_structured_output_follows_the_grammar(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Pick a color."}], max_tokens=40, temperature=0.7,
        seed=5, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        extra_body=NO_THINK)
    assert json.loads(r.choices[0].message.content)["color"] in ("red", "blue")
    assert r.choices[0].finish_reason == "stop"
    bad = httpx.post(client.base_url.join("chat/completions").__str__(),
                     json={"messages": [{"role": "user", "content": "x"}],
                           "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": 3}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("response_format")


def test_forced_tool_call_plain_and_streamed(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}]
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
              tool_choice="required", max_tokens=60, temperature=0, extra_body=NO_THINK)
    r = client.chat.completions.create(**kw)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and args["unit"] in ("c", "f")
    chunks = list(client.chat.completions.create(stream=True, **kw))
    # with tools offered the role chunk comes just before the first delta; the name first, then argument pieces
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].id.startswith("call_")
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_forced_call_cut_by_max_tokens_is_length(client):
    """A forced call that max_tokens cuts mid-arguments is reported as "length", never as a complete call."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}]
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
              tool_choice="required", max_tokens=30, temperature=0, extra_body=NO_THINK)
    # 30 tokens reach past the call's name into its arguments (the whole block is ~54 tokens)
    assert client.chat.completions.create(**kw).choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    names = [tc.function.name for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if tc.function.name]
    assert names == ["get_weather"], "the cut must fall inside the call's arguments"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_zz_sigterm_drains_running_replies(server):
    """Last in the module: SIGTERM stops admitting, lets the running reply finish, then the process exits."""
    result: dict = {}
    started = threading.Event()

    def stream():
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", server.url + "/v1/completions",
                             json={"prompt": ids_prompt(9), "max_tokens": 20, "ignore_eos": True, "stream": True,
                                   "return_token_ids": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        obj = json.loads(line[6:])
                        if obj["choices"] and obj["choices"][0]["finish_reason"]:
                            result["final"] = obj["choices"][0]

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    t.join(timeout=60)
    assert result["final"]["finish_reason"] == "length" and len(result["final"]["token_ids"]) == 20
    assert server.proc.wait(timeout=60) is not None
    assert any("draining" in line for line in server.lines)
