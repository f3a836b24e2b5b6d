"""Speculative decoding through the live server (tests/test_server.py's LiveServer): a server on a checkpoint whose
DSpark head agrees with the target (make_tiny --draft-agrees, real tokenizer), drafting on; every request is also
sent with "draft": false (the serial path) and the token ids must be equal: 16 prompts greedy and seeded (T=0.6,
top-p 0.95), 32 tokens with ignore_eos (128 in tests/test_drafts.py, in process: the serial side of 16 x 128 takes
3 minutes here on 2 cores), as a 16-stream burst and alone, and JSON-schema replies (drafts cut by the grammar,
verify rows masked). usage.drafts and /metrics report the drafts."""
import concurrent.futures as cf
import json
import re

import httpx
import pytest

from dsv41.serve_config import from_env_and_args
from dsv41.tools import make_tiny
from tests.test_server import LiveServer

NO_THINK = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("agree-real")
    make_tiny.main(["--out", str(ckpt), "--seed", "0", "--draft-agrees", "--layers", "7"])
    # --draft-tokens 5: every round verifies what fits (the adaptive policy rightly declines most drafts for 16 CPU
    # streams, where the DSpark pass costs as much as a decode row; tests/test_drafts.py covers the policy)
    with LiveServer("--model", str(ckpt), "--context", "1024", "--state-budget-gib", "2", "--max-streams", "16",
                    "--draft-tokens", "5") as s:
        yield s


def _body(i: int, sampled: bool, n: int = 32) -> dict:
    prompt = [0] + [(i * 7919 + k * 104729) % 120000 + 100 for k in range(5 + i % 7)]
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "return_token_ids": True}
    body.update({"temperature": 0.6, "top_p": 0.95, "seed": 500 + i} if sampled else {"temperature": 0})
    return body


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def _burst(url: str, path: str, bodies: list[dict]) -> list[dict]:
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        return list(ex.map(lambda b: _post(url, path, b), bodies))


def test_burst_drafted_equals_serial(server):
    bodies = [_body(i, sampled=i % 2 == 1) for i in range(16)]
    drafted = _burst(server.url, "/v1/completions", bodies)
    serial = _burst(server.url, "/v1/completions", [dict(b, draft=False) for b in bodies])
    for d, s in zip(drafted, serial):
        assert d["choices"][0]["token_ids"] == s["choices"][0]["token_ids"]
        assert len(d["choices"][0]["token_ids"]) == 32
        assert "drafts" not in s["usage"]
    u = [d["usage"]["drafts"] for d in drafted]
    accepted = sum(x["accepted_tokens"] for x in u)
    assert accepted > 0.8 * sum(x["drafted_tokens"] for x in u)
    assert sum(x["rounds"] for x in u) < 0.5 * 16 * 32           # several tokens per round
    assert all(x["tokens_per_round"] > 2 for x in u)
    # alone: one greedy and one sampled request by themselves
    for b, s in ((bodies[0], serial[0]), (bodies[1], serial[1])):
        assert _post(server.url, "/v1/completions", b)["choices"][0]["token_ids"] == s["choices"][0]["token_ids"]
    m = httpx.get(server.url + "/metrics", timeout=30).text
    got = {k: float(v) for k, v in re.findall(r"^dsv41:(draft_\w+) (\S+)$", m, re.MULTILINE)}
    assert got["draft_accepted_tokens_total"] >= accepted
    assert got["draft_tokens_per_round"] > 2


def test_json_schema_drafted_equals_serial(server):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    bodies = [{"messages": [{"role": "user", "content": f"Item {i}?"}], "max_tokens": 32, "return_token_ids": True,
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
               **({"temperature": 0.6, "top_p": 0.95, "seed": 7 + i} if i % 2 else {"temperature": 0}), **NO_THINK}
              for i in range(4)]
    drafted = _burst(server.url, "/v1/chat/completions", bodies)
    serial = _burst(server.url, "/v1/chat/completions", [dict(b, draft=False) for b in bodies])
    for d, s in zip(drafted, serial):
        assert d["choices"][0]["token_ids"] == s["choices"][0]["token_ids"]
        if d["choices"][0]["finish_reason"] == "stop":
            json.loads(d["choices"][0]["message"]["content"])
    assert sum(d["usage"].get("drafts", {}).get("drafted_tokens", 0) for d in drafted) > 0


def test_kept_state_of_a_reply_that_ended_inside_a_draft(server):
    """A stop string ends the reply at an accepted draft token (the prompt ends on cycle token 1010, so the reply is
    1011 '么', 1012 'reat', 1013 'ark', 1014 ' time' and the stop ' time' lands on the 3rd draft of the verify
    round): the state holds two rows past the reply, taken back before it is kept (docs/kept.md); a longer prompt
    resumes there and equals a cold run (another salt)."""
    prompt = [0] + [300 + (j * 13) % 900 for j in range(20)] + [1010]
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "cache_salt": "d1", "stop": [" time"],
            "return_token_ids": True}
    r1 = _post(server.url, "/v1/completions", body)
    ids = r1["choices"][0]["token_ids"]
    assert ids == [1011, 1012, 1013, 1014] and r1["choices"][0]["finish_reason"] == "stop"
    assert r1["usage"]["drafts"]["accepted_tokens"] >= 2
    nxt = prompt + ids + [1200, 1201]
    b = len(prompt) + len(ids) - 1
    for sampled in (False, True):
        extra = {"temperature": 0.6, "top_p": 0.95, "seed": 3} if sampled else {}
        more = {"prompt": nxt, "stop": [], "ignore_eos": True, "max_tokens": 12, **extra}
        r2 = _post(server.url, "/v1/completions", {**body, **more})
        r3 = _post(server.url, "/v1/completions", {**body, **more, "cache_salt": f"cold{sampled}"})
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == b
        assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r2["choices"][0]["token_ids"] == r3["choices"][0]["token_ids"]


def test_no_drafts_flag_parses():
    assert from_env_and_args(["--no-drafts"], env={}).drafts is False
    assert from_env_and_args([], env={"DSV41_ROUND_ROWS": "32"}).round_rows == 32
    with pytest.raises(Exception, match="draft-tokens"):
        from_env_and_args(["--draft-tokens", "99"], env={})
