"""Drafts on two ranks (`--tp 2`, docs/tp.md): a --draft-agrees checkpoint served by two processes; drafted replies
(most drafts accepted, so verify rows, rollbacks and the collective draft pass run every round) equal the same
requests with "draft": false, greedy and seeded, in a burst and under a JSON schema (grammar masks exist on rank 0
only: rank 0's accept decisions are summed into rank 1). Every round's logits digests are compared between ranks, so
a rank that rolled back or drafted differently fails the lane."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_tp_serve import two_rank_server

from dsv41.tools import make_tiny

N_TOKENS = 24


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("agree-tp")
    make_tiny.main(["--out", str(ckpt), "--seed", "0", "--draft-agrees", "--layers", "7"])
    common = ["--model", str(ckpt), "--context", "256", "--state-budget-gib", "1", "--prefill-chunk", "16",
              "--shutdown-grace-s", "5", "--prompt-cache-gib", "0", "--draft-tokens", "4"]
    with two_rank_server(*common, settle_s=1.0) as ranks:
        yield ranks


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_ranks_drafted_equals_serial(two_ranks):
    r0, r1 = two_ranks
    bodies = []
    for i in range(6):
        b = {"prompt": [0] + [(i * 7919 + k * 104729) % 120000 + 100 for k in range(4 + i)], "max_tokens": N_TOKENS,
             "ignore_eos": True, "return_token_ids": True}
        b.update({"temperature": 0.6, "top_p": 0.95, "seed": 40 + i} if i % 2 else {"temperature": 0})
        bodies.append(("/v1/completions", b))
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    bodies.append(("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "name?"}], "max_tokens": 20, "temperature": 0,
        "return_token_ids": True, "chat_template_kwargs": {"thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}))
    with ThreadPoolExecutor(len(bodies)) as ex:
        drafted = list(ex.map(lambda pb: _post(r0.url, *pb), bodies))
        serial = list(ex.map(lambda pb: _post(r0.url, pb[0], dict(pb[1], draft=False)), bodies))
    for d, s in zip(drafted, serial):
        assert d["choices"][0]["token_ids"] == s["choices"][0]["token_ids"]
    u = [d["usage"].get("drafts") for d in drafted[:6]]
    assert all(x is not None for x in u)
    assert sum(x["accepted_tokens"] for x in u) > 0.8 * sum(x["drafted_tokens"] for x in u)
    assert r0.proc.poll() is None and r1.proc.poll() is None
    assert "lane failed" not in r0.text() and "stopping" not in r1.text()
