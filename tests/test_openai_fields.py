"""OpenAI fields do what OpenAI and vLLM do with them (issue 26), on a live server (built-in tiny checkpoint, drafts
on): logit_bias and the frequency / presence / repetition penalties change the greedy reply as vLLM's sampler does
(predicted token by token from the unpenalised reply's logprobs), `n` choices are the replies of n seeded requests
(seed + i), an unknown `model` is 404 model_not_found (aliases through --served-model-name), GET /v1/models/{id},
a wrong method 405, a tool whose `parameters` is no JSON Schema 400; /metrics parsed by prometheus_client with
vLLM's names; the access and `done` log lines. (adjust_row alone: tests/test_sched_sampler.py.)
"""
from __future__ import annotations

import json

import httpx
import pytest
from test_server import LiveServer, ids_prompt


NO_THINK = {"chat_template_kwargs": {"thinking": False}}
MSGS = [{"role": "user", "content": "Count with me: one, two, three."}]
C = 1000                     # the token the tests bias (an ordinary vocabulary id)


@pytest.fixture(scope="module")
def server():
    # --draft-tokens 3: every decode round verifies drafts (the adaptive policy may decline them all on a loaded CPU),
    # so the penalties are checked on verify rows too and /metrics has drafts to count
    with LiveServer("--context", "512", "--prefill-chunk", "64", "--keepalive-s", "0.3", "--state-budget-gib", "2",
                    "--name", "tiny", "--served-model-name", "alias-a", "--served-model-name", "alias-b",
                    "--draft-tokens", "3") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert isinstance(e["message"], str) and e["message"]
    return e


# ------------------------------------------------------------------------------------------------ logit_bias, penalties
def chat(http, **kw) -> dict:
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 20, "return_token_ids": True, **NO_THINK, **kw}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def gaps(choice: dict) -> list[tuple[float, str]]:
    """For each step of a reply that drew C every time: (the best other token's raw logprob - C's, its text)."""
    out = []
    for e in choice["logprobs"]["content"]:
        others = list(e["top_logprobs"])
        for k, t in enumerate(others):          # drop C's own entry (the chosen token's)
            if t["token"] == e["token"] and t["logprob"] == e["logprob"]:
                del others[k]
                break
        out.append((others[0]["logprob"] - e["logprob"], others[0]["token"]))
    return out


def test_logit_bias_forces_and_forbids(http):
    plain = chat(http)["token_ids"]
    forced = chat(http, logit_bias={str(C): 100})
    assert forced["token_ids"] == [C] * 12
    banned = chat(http, logit_bias={str(plain[0]): -100})["token_ids"]
    assert banned[0] != plain[0]
    # logprobs stay the model's own (vLLM's raw logprobs): the first step's are the unbiased reply's
    assert forced["logprobs"]["content"][0]["top_logprobs"] == chat(http)["logprobs"]["content"][0]["top_logprobs"]


def _predicted_switch(steps: list[tuple[float, str]], bias: float, penalty) -> int:
    """The first step where C's biased, penalised logit falls below the best other token's (or len(steps))."""
    for k, (gap, _) in enumerate(steps):
        margin = bias - penalty(k) - gap
        assert abs(margin) > 1e-3, "a near tie: pick another bias"
        if margin < 0:
            return k
    return len(steps)


@pytest.mark.parametrize("field,penalty", [("frequency_penalty", lambda k: 2.0 * k),
                                           ("presence_penalty", lambda k: 2.0 * (k > 0))])
def test_frequency_and_presence_penalties_turn_the_greedy_reply_away(http, field, penalty):
    base = chat(http, logit_bias={str(C): 100})            # C every step: the raw gaps at each prefix of C's
    steps = gaps(base)
    bias = steps[0][0] + 1.5                               # C wins step 0 by 1.5 without a penalty
    assert chat(http, logit_bias={str(C): bias})["token_ids"][0] == C
    k = _predicted_switch(steps, bias, penalty)
    assert 0 < k < len(steps), f"the penalty should turn the reply away from C within 12 steps (k={k})"
    got = chat(http, logit_bias={str(C): bias}, **{field: 2.0})
    assert got["token_ids"][:k] == [C] * k
    assert got["token_ids"][k] != C
    assert got["logprobs"]["content"][k]["token"] == steps[k][1]   # the best other token, as predicted
    # the opposite sign rewards the repeat: C stays as long as without any penalty
    neg = chat(http, logit_bias={str(C): bias}, **{field: -2.0})["token_ids"]
    k0 = _predicted_switch(steps, bias, lambda k: 0.0)
    assert neg[:k0] == [C] * k0 and k0 >= k


def test_repetition_penalty_turns_away_from_seen_tokens(http):
    assert chat(http, logit_bias={str(C): 100}, repetition_penalty=1.0)["token_ids"] == [C] * 12
    got = chat(http, logit_bias={str(C): 100}, repetition_penalty=1e4)["token_ids"]
    assert got[0] == C and got[1] != C                     # (l + 100) / 1e4 once C is in the reply
    assert len(set(got)) == len(got)                       # no token twice: every seen one is divided down


def test_penalties_and_bias_refused_out_of_range(http):
    for field, v in [("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0),
                     ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"999999999": 1})]:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, field: v})
        assert error(r, 400)["param"] == field, (field, v)


# ------------------------------------------------------------------------------------------------ n
def test_n_choices_are_n_seeded_requests(http):
    body = {"model": "tiny", "prompt": ids_prompt(3), "max_tokens": 6, "temperature": 1.0, "ignore_eos": True,
            "return_token_ids": True, "seed": 41}
    r = http.post("/v1/completions", json={**body, "n": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    alone = [http.post("/v1/completions", json={**body, "seed": 41 + i}).json() for i in range(3)]
    assert [c["token_ids"] for c in out["choices"]] == [a["choices"][0]["token_ids"] for a in alone]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1          # sampled: the choices differ
    u = out["usage"]
    assert u["prompt_tokens"] == len(ids_prompt(3)) and u["completion_tokens"] == 18
    assert u["total_tokens"] == u["prompt_tokens"] + 18
    streamed = sse_choices(http, "/v1/completions", {**body, "n": 3})     # interleaved chunks, indexed
    assert [(c["content"], c["token_ids"]) for c in streamed["choices"]] == \
        [(c["text"], c["token_ids"]) for c in out["choices"]]
    assert totals(streamed["usage"]) == totals(u)


def test_n_chat_choices_and_refusals(http):
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 4, "temperature": 0.8, "seed": 5, "ignore_eos": True,
            "return_token_ids": True, **NO_THINK}
    out = http.post("/v1/chat/completions", json={**body, "n": 2}).json()
    alone = [http.post("/v1/chat/completions", json={**body, "seed": 5 + i}).json()["choices"][0] for i in range(2)]
    assert [(c["index"], c["message"]["content"], c["token_ids"]) for c in out["choices"]] == \
        [(i, a["message"]["content"], a["token_ids"]) for i, a in enumerate(alone)]
    assert error(http.post("/v1/chat/completions", json={**body, "n": 0}), 400)["param"] == "n"
    assert error(http.post("/v1/chat/completions", json={**body, "n": 17}), 400)["param"] == "n"
    streamed = sse_choices(http, "/v1/chat/completions", {**body, "n": 2})
    assert [(c["content"], c["token_ids"], c["finish_reason"]) for c in streamed["choices"]] == \
        [(c["message"]["content"], c["token_ids"], c["finish_reason"]) for c in out["choices"]]
    assert totals(streamed["usage"]) == totals(out["usage"])


def totals(usage: dict) -> tuple:
    """usage's counts (cached_tokens aside: a repeated prompt resumes from a kept state)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def sse_choices(http, path: str, body: dict) -> dict:
    """A streamed reply's choices put back together by index (text or content, token_ids, finish_reason) and its
    usage chunk; [DONE] comes once, last."""
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    frames = [json.loads(d) for d in data[:-1]]
    usage = [f["usage"] for f in frames if not f["choices"]]
    assert len(usage) == 1 and frames[-1]["usage"] == usage[0]
    got: dict[int, dict] = {}
    for f in frames:
        for c in f["choices"]:
            g = got.setdefault(c["index"], {"content": "", "token_ids": None, "finish_reason": None})
            g["content"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            g["token_ids"] = c.get("token_ids", g["token_ids"])
            g["finish_reason"] = c.get("finish_reason") or g["finish_reason"]
    assert sorted(got) == list(range(len(got)))
    return {"choices": [got[i] for i in sorted(got)], "usage": usage[0]}


# ------------------------------------------------------------------------------------------------ model, method, tools
def test_unknown_model_is_404_and_aliases_answer(http):
    for path, body in [("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, **NO_THINK}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1})]:
        e = error(http.post(path, json={**body, "model": "gpt-nonesuch"}), 404)
        assert e["code"] == "model_not_found" and e["param"] == "model" and "gpt-nonesuch" in e["message"]
        for name in ("tiny", "alias-a", "alias-b", "dsv41", None):
            r = http.post(path, json={**body, **({"model": name} if name else {})})
            assert r.status_code == 200, (path, name, r.text)
            assert r.json()["model"] == "tiny"
    for name in ("tiny", "alias-b"):
        card = http.get(f"/v1/models/{name}").json()
        assert card["id"] == "tiny" and card["object"] == "model"
    assert error(http.get("/v1/models/gpt-nonesuch"), 404)["code"] == "model_not_found"


def test_wrong_method_is_405_naming_the_allowed_ones(http):
    r = http.delete("/v1/chat/completions")
    e = error(r, 405)
    assert e["code"] == "method_not_allowed" and "POST" in r.headers["allow"]
    r = http.post("/v1/models")
    assert error(r, 405)["code"] == "method_not_allowed" and "GET" in r.headers["allow"]


def test_tool_parameters_must_be_a_json_schema(http):
    def tools(params):
        return {"messages": MSGS, "max_tokens": 1, **NO_THINK,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}
    ok = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"anyOf": [{"type": "string"},
                                                                                     {"type": "null"}]}},
          "required": ["x"]}
    assert http.post("/v1/chat/completions", json=tools(ok)).status_code == 200
    for bad in [5, "object", {"type": "objekt"}, {"type": "object", "properties": {"x": 3}},
                {"type": "object", "required": "x"}, {"type": "array", "items": [1]}, {"anyOf": []},
                {"type": "string", "maxLength": -1}]:
        e = error(http.post("/v1/chat/completions", json=tools(bad)), 400)
        assert e["param"] == "tools" and "'f'" in e["message"] and "parameters" in e["message"], (bad, e)


# ------------------------------------------------------------------------------------------------ /metrics
def test_metrics_parse_with_vllm_names_beside_ours(http):
    from prometheus_client.parser import text_string_to_metric_families

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8, **NO_THINK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text
    for _ in range(2):      # the second resumes the first's kept prompt state
        assert http.post("/v1/completions", json={"prompt": ids_prompt(9, 40), "max_tokens": 3}).status_code == 200
    text = http.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}     # the official parser reads all of it

    def value(name: str, sample: str | None = None, **labels) -> float:
        got = [s.value for s in fams[name].samples if s.name == (sample or name)
               and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(got) == 1, (name, labels, got)
        return got[0]

    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert fams[name].type == "gauge" and value(name, model_name="tiny") == 0
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens"):     # counters: the parser drops `_total`
        assert fams[name].type == "counter"
        assert value(name, name + "_total", model_name="tiny") == value(name.replace("vllm:", "dsv41:"),
                                                                        name.replace("vllm:", "dsv41:") + "_total")
    gen = value("vllm:generation_tokens", "vllm:generation_tokens_total", model_name="tiny")
    assert gen > 0
    assert value("vllm:request_success", "vllm:request_success_total", model_name="tiny", finished_reason="length") \
        == value("dsv41:request_finished", "dsv41:request_finished_total", reason="length") > 0
    h = fams["vllm:time_to_first_token_seconds"]
    assert h.type == "histogram"
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count", model_name="tiny") \
        == value("dsv41:time_to_first_token_seconds", "dsv41:time_to_first_token_seconds_count") > 0
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds"):
        assert fams[name].type == "histogram", name
    # drafting acceptance, kept-state hits and grammar time
    drafted = value("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total", model_name="tiny")
    accepted = value("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total",
                     model_name="tiny")
    assert drafted == value("dsv41:draft_tokens", "dsv41:draft_tokens_total") > 0
    assert 0 <= accepted == value("dsv41:draft_accepted_tokens", "dsv41:draft_accepted_tokens_total") <= drafted
    hits = value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", model_name="tiny")
    assert hits == value("dsv41:kept_cached_tokens", "dsv41:kept_cached_tokens_total") > 0
    assert value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", model_name="tiny") > hits
    assert value("dsv41:grammar_seconds", "dsv41:grammar_seconds_total", part="compile") > 0
    assert value("dsv41:grammar_seconds", "dsv41:grammar_seconds_total", part="mask") > 0


# ------------------------------------------------------------------------------------------------ logs
def test_one_log_format_an_access_line_per_request_and_the_done_line_names_the_reply(server, http):
    import re
    import time

    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **NO_THINK})
    rid = r.json()["id"]
    bad = http.post("/v1/completions", json={"prompt": "hi", "model": "gpt-nonesuch"})
    assert bad.status_code == 404
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR|DEBUG) [\w.]+: "
    deadline = time.monotonic() + 10
    while True:
        text = "".join(server.lines)
        access = re.search(rf"{stamp}POST /v1/chat/completions 200 \d+\.\d{{3}}s reply_id={rid}$", text, re.M)
        done = re.search(rf"{stamp}done \d+ reply_id={rid} prompt=\d+ ", text, re.M)
        refused = re.search(stamp + r"POST /v1/completions 404 \d+\.\d{3}s error='model_not_found: The model "
                            r"`gpt-nonesuch` does not exist", text, re.M)
        if (access and done and refused) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert access and access.group(1) == "INFO", text[-3000:]
    assert done, text[-3000:]
    assert refused and refused.group(1) == "INFO", text[-3000:]
    # uvicorn's own lines come in the same format (no "INFO:     Started server process")
    assert re.search(stamp + r"Started server process", text, re.M), text[:2000]
    assert not re.search(r"^INFO: ", text, re.M)


# ------------------------------------------------------------------------------------------------ completions' text
def test_completions_bos_and_special_tokens_as_vllm(http):
    plain = http.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False}).json()["tokens"]
    bos = http.post("/tokenize", json={"prompt": ""}).json()["tokens"]
    assert len(bos) == 1
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    got = http.post("/v1/completions", json=body).json()["choices"][0]
    assert got["prompt_token_ids"] == bos + plain                       # BOS added by default, as vLLM does
    got = http.post("/v1/completions", json={**body, "add_special_tokens": False}).json()["choices"][0]
    assert got["prompt_token_ids"] == plain
    eos_text = "<｜end▁of▁sentence｜>"
    eos = http.post("/tokenize", json={"prompt": eos_text, "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1
    forced = {**body, "logit_bias": {str(eos[0]): 100}}
    got = http.post("/v1/completions", json=forced).json()["choices"][0]
    assert got["token_ids"] == eos * 3 and got["text"] == ""            # skip_special_tokens: true by default
    got = http.post("/v1/completions", json={**forced, "skip_special_tokens": False}).json()["choices"][0]
    assert got["token_ids"] == eos * 3 and got["text"] == eos_text * 3
    for path, b in (("/v1/completions", body), ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1})):
        assert error(http.post(path, json={**b, "prompt_logprobs": 1}), 400)["param"] == "prompt_logprobs"
    assert error(http.post("/v1/completions", json={**body, "echo": True}), 400)["param"] == "echo"
