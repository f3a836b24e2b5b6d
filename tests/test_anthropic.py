"""/v1/messages and /v1/messages/count_tokens on the live server (built-in tiny checkpoint, the server tests'
LiveServer) with the official anthropic client: plain, streamed (event order), tool_use round trip, thinking with a
budget, count_tokens, x-api-key, Anthropic-shaped errors; each greedy reply's ids == the equivalent chat's."""
from __future__ import annotations

import anthropic
import httpx
import pytest
from test_server import LiveServer

from dsv41.api.anthropic import to_chat
from dsv41.api.errors import ApiError

KEY = "sk-ant-test"
CLOSE = [201, 128822, 271]          # "\n</think>\n\n"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                            "additionalProperties": False}}
GREEDY = {"temperature": 0, "return_token_ids": True}


@pytest.fixture(scope="module")
def server():
    with LiveServer("--context", "768", "--prefill-chunk", "256", "--keepalive-s", "0.3", "--state-budget-gib", "2",
                    "--name", "tiny", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def chat(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "return_token_ids": True, "model": "tiny"},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_plain_equals_chat_and_count_tokens(server, client):
    m = client.messages.create(model="tiny", max_tokens=8, system="Be brief.",
                               messages=[{"role": "user", "content": "What is 17*19?"}],
                               thinking={"type": "disabled"}, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    c = chat(server, {"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 17*19?"}],
                      "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"thinking": False}})
    assert m.model_extra["dsv41"]["token_ids"] == c["choices"][0]["token_ids"]
    assert m.content[0].text == c["choices"][0]["message"]["content"]
    n = client.messages.count_tokens(model="tiny", system="Be brief.", thinking={"type": "disabled"},
                                     messages=[{"role": "user", "content": "What is 17*19?"}])
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens == c["usage"]["prompt_tokens"]


def test_streamed_events_in_order(client):
    body = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": "Name a colour."}],
            "thinking": {"type": "enabled", "budget_tokens": 4}, "extra_body": GREEDY}
    with client.messages.stream(**body) as st:
        raw = [ev for ev in st if ev.type in ("message_start", "content_block_start", "content_block_delta",
                                              "content_block_stop", "message_delta", "message_stop")]
        final = st.get_final_message()
    types = [e.type for e in raw]
    squeezed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert squeezed == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                        "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                        "message_stop"]
    deltas = [e.delta.type for e in raw if e.type == "content_block_delta"]
    assert deltas[-2] != "signature_delta" and "signature_delta" in deltas
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    plain = client.messages.create(**body)
    assert plain.model_extra["dsv41"]["token_ids"] == raw[-2].model_extra["dsv41"]["token_ids"]
    assert [b.model_dump(exclude_none=True) for b in plain.content] == \
        [b.model_dump(exclude_none=True) for b in final.content]


def test_thinking_budget_closes_at_the_budget(server, client):
    m = client.messages.create(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "2+2?"}],
                               thinking={"type": "enabled", "budget_tokens": 5}, extra_body=GREEDY)
    ids = m.model_extra["dsv41"]["token_ids"]
    assert ids[5:8] == CLOSE and m.model_extra["dsv41"]["reasoning_closed_by"] == "budget"
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].signature
    c = chat(server, {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 12, "temperature": 0,
                      "thinking": {"type": "enabled"}, "thinking_budget": 5})
    assert c["choices"][0]["token_ids"] == ids                          # the chat route's budget: the same reply
    assert c["choices"][0]["message"]["reasoning_content"] == m.content[0].thinking


def test_tool_use_round_trip(server, client):
    msgs = [{"role": "user", "content": "Weather in Paris, in celsius?"}]
    m = client.messages.create(model="tiny", max_tokens=64, messages=msgs, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               thinking={"type": "disabled"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input["unit"] in ("c", "f")
    assert uses[0].id.startswith("toolu_")
    # (its ids == the chat completion's: the same path as tests/test_responses.py's tool round trip)
    follow = msgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": '{"temperature_c": 18}'}]}]
    m2 = client.messages.create(model="tiny", max_tokens=6, messages=follow, tools=[WEATHER],
                                thinking={"type": "disabled"}, extra_body=GREEDY)
    assert m2.stop_reason in ("max_tokens", "end_turn", "tool_use") and m2.usage.input_tokens + m2.usage.cache_read_input_tokens > \
        m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_errors_are_anthropic_shaped_and_the_server_goes_on(server, client):
    bad = [({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
           ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "role"),
           ({"max_tokens": 4, "messages": []}, "messages"),
           ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
           ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "all"}},
            "tool_choice"),
           ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
             "thinking": {"type": "enabled", "budget_tokens": 0}}, "budget_tokens"),
           ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document")]
    h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    for body, word in bad:
        r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", **body}, headers=h, timeout=30)
        assert r.status_code == 400, (body, r.text)
        j = r.json()
        assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error", j
        assert word in j["error"]["message"], j
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}],
                               extra_body={"temperature": "hot"})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages/count_tokens", content=b"{oops", headers=h)
    assert r.status_code == 400 and r.json()["type"] == "error"
    bad_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    ok = client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "still there?"}],
                                extra_body=GREEDY)
    assert ok.usage.output_tokens == 2


def test_pings_while_a_long_prompt_fills(server, client):
    text = " ".join(f"item {i}," for i in range(150))
    msgs = [{"role": "user", "content": text}]
    assert 500 < client.messages.count_tokens(model="tiny", messages=msgs).input_tokens < 740
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", timeout=120, headers={"x-api-key": KEY},
                      json={"model": "tiny", "max_tokens": 1, "stream": True, "messages": msgs}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    first_block = events.index("content_block_start")
    assert events[0] == "message_start" and events[1:first_block].count("ping") >= 2, events
    assert events[-2:] == ["message_delta", "message_stop"]


def test_bad_key_error_is_anthropic_shaped(server):
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "x"}]},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "A valid API key is required"}}


# --- no server -----------------------------------------------------------------------------------------------------
def test_messages_become_chat_messages():
    chat = to_chat({"max_tokens": 9, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "stop_sequences": ["END"], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                    "tools": [WEATHER], "thinking": {"type": "enabled", "budget_tokens": 64},
                    "messages": [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": [
                            {"type": "thinking", "thinking": "hmm", "signature": "s"},
                            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"unit": "c"}}]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text",
                                                                                           "text": "18"}]},
                            {"type": "text", "text": "and tomorrow?"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "a\n\nb"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18"},
        {"role": "user", "content": "and tomorrow?"}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["thinking"] == {"type": "enabled"} and chat["thinking_budget"] == 64
    assert chat["stop"] == ["END"] and chat["max_tokens"] == 9
    assert chat["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    with pytest.raises(ApiError):
        to_chat({"messages": [{"role": "user", "content": "q"}]})               # max_tokens is required
    assert "max_tokens" not in to_chat({"messages": [{"role": "user", "content": "q"}]}, counting=True)
