"""Kept prompt states on the live server (built-in tiny checkpoint): resumed == cold, salts, eviction, /metrics.

"Cold" is the same request on a second server that keeps nothing (--prompt-cache-gib 0), so it never saw any
prefix. A small --prompt-cache-gib on the first makes eviction happen within the module.
"""
from __future__ import annotations

import re

import httpx
import pytest

from test_server import LiveServer

CACHE_GIB = 0.003          # ~3 MiB: a handful of states of this module's prompts (~2 KiB a position)


def Server(*args: str) -> LiveServer:
    return LiveServer(*args, env={"OMP_NUM_THREADS": "1"})


ARGS = ("--context", "1024", "--prefill-chunk", "64", "--state-budget-gib", "1", "--name", "tiny")


@pytest.fixture(scope="module")
def servers():
    both = [Server(*ARGS, "--prompt-cache-gib", str(CACHE_GIB)), Server(*ARGS, "--prompt-cache-gib", "0")]
    try:
        for s in both:
            s.wait_ready()
        yield [s.url for s in both]
    finally:
        for s in both:
            s.stop()


@pytest.fixture(scope="module")
def url(servers):
    return servers[0]


@pytest.fixture(scope="module")
def cold_url(servers):
    return servers[1]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^dsv41:(kept_\w+) (\S+)$", text, re.MULTILINE)}


def chat(url: str, messages, salt, *, thinking=False, tools=None, sampled=False, max_tokens=6):
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "return_token_ids": True,
            "chat_template_kwargs": {"thinking": thinking}}
    body.update({"temperature": 1.0, "seed": 77} if sampled else {"temperature": 0})
    if tools:
        body["tools"] = tools
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["token_ids"], j["usage"]["prompt_tokens_details"]["cached_tokens"], j


TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"does thing {i}",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for i in range(2)]
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 4}


@pytest.mark.parametrize("thinking,tools,sampled,turns", [(False, TOOLS, False, 3), (True, None, True, 2),
                                                         (True, TOOLS, False, 2)])
def test_conversation_resumes_every_turn_and_equals_cold(url, cold_url, thinking, tools, sampled, turns):
    """Chat (the next prompt extends prompt + reply), toolless thinking (the reasoning is dropped: the next prompt
    shares the prompt up to its generation header) and thinking with tools (extends fully)."""
    salt = f"conv-{thinking}-{bool(tools)}-{sampled}"
    msgs = [SYSTEM]
    for turn in range(turns):
        msgs.append({"role": "user", "content": f"question number {turn}: what about {turn * 7}?"})
        ids, cached, j = chat(url, msgs, salt, thinking=thinking, tools=tools, sampled=sampled)
        want, cached0, _ = chat(cold_url, msgs, salt, thinking=thinking, tools=tools, sampled=sampled)
        assert ids == want, (turn, cached)
        assert cached0 == 0
        n = j["usage"]["prompt_tokens"]
        if turn == 0:
            assert cached == 0
        else:
            assert 8 <= cached < n, (turn, cached, n)
        msg = j["choices"][0]["message"]
        msgs.append({"role": "assistant", "content": msg.get("content") or "ok",
                     **({"reasoning_content": msg["reasoning_content"]} if msg.get("reasoning_content") else {})})


def test_completion_resumes_at_an_odd_boundary_after_the_reply(url, cold_url):
    """Raw ids: the state after prompt + reply (minus its last token) is kept; a longer prompt resumes there, at a
    boundary that is a multiple of neither the window (8) nor the compression ratio (2)."""
    prompt = [0] + [100 + (j * 13) % 300 for j in range(40)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "cache_salt": "raw",
            "ignore_eos": True, "return_token_ids": True}
    r1 = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
    reply = r1["choices"][0]["token_ids"]
    nxt = prompt + reply + [200, 201, 202]
    b = len(prompt) + len(reply) - 1
    assert b % 2 == 0 or b % 8 != 0
    for sampled in (False, True):
        extra = {"temperature": 1.0, "seed": 5} if sampled else {}
        r2 = httpx.post(url + "/v1/completions", json={**body, "prompt": nxt, **extra}, timeout=300).json()
        r3 = httpx.post(cold_url + "/v1/completions", json={**body, "prompt": nxt, **extra}, timeout=300).json()
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == b
        assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r2["choices"][0]["token_ids"] == r3["choices"][0]["token_ids"]


def test_salts_never_share_and_no_salt_is_its_own_namespace(url):
    msgs = [SYSTEM, {"role": "user", "content": "salted question"}]
    follow = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    chat(url, msgs, "alice")
    _, hit, _ = chat(url, follow, "alice")
    _, miss, _ = chat(url, follow, "bob")
    _, none, _ = chat(url, follow, None)
    assert hit > 0 and miss == 0 and none == 0
    _, none2, _ = chat(url, follow + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}],
                       None)
    assert none2 > 0                      # unsalted requests share among themselves


def test_budget_evicts_without_error_and_is_never_exceeded(url):
    budget = int(CACHE_GIB * (1 << 30))
    for i in range(5):                   # distinct long prompts fill the small budget
        msgs = [{"role": "system", "content": f"system {i} " * 60}, {"role": "user", "content": "hi"}]
        chat(url, msgs, "fill", max_tokens=2)
        m = metrics(url)
        assert m["kept_state_bytes"] <= m["kept_state_budget_bytes"] == budget
    m = metrics(url)
    assert m["kept_state_evictions_total"] > 0
    assert m["kept_states"] > 0 and m["kept_state_hits_total"] > 0 and m["kept_state_misses_total"] > 0
