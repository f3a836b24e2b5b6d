"""/v1/responses on the live server (built-in tiny checkpoint, the server tests' LiveServer), with the official
openai client: plain, streamed (event order), tool round trip, structured output, previous_response_id, GET/DELETE,
the thinking budget, and the token ids of each reply == the equivalent chat completion's. Plus the bounded store."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_server import LiveServer

from dsv41.api.errors import ApiError
from dsv41.api.responses import ResponseStore, input_messages, to_chat

KEY = "sk-responses-test"
CLOSE = [201, 128822, 271]          # "\n</think>\n\n"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    with LiveServer("--context", "768", "--prefill-chunk", "256", "--keepalive-s", "0.3", "--state-budget-gib", "2",
                    "--name", "tiny", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_ids(server, body: dict) -> list[int]:
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "return_token_ids": True, "model": "tiny"},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_plain_equals_chat(server, client):
    r = client.responses.create(model="tiny", instructions="Be brief.", input="What is 17*19?", max_output_tokens=8,
                                temperature=0, extra_body={"return_token_ids": True})
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["reasoning", "message"]       # thinking is the server default
    assert r.usage.output_tokens == 8 and r.usage.output_tokens_details.reasoning_tokens == 8
    ids = r.model_extra["dsv41"]["token_ids"]
    assert ids == chat_ids(server, {"messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "What is 17*19?"}],
                                    "max_tokens": 8, "temperature": 0})
    off = client.responses.create(model="tiny", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is 17*19?"}]}], max_output_tokens=6, temperature=0,
        reasoning={"effort": "none"}, extra_body={"return_token_ids": True})
    assert [o.type for o in off.output] == ["message"] and off.output_text
    assert off.model_extra["dsv41"]["token_ids"] == chat_ids(server, {
        "messages": [{"role": "user", "content": "What is 17*19?"}], "max_tokens": 6, "temperature": 0,
        "reasoning_effort": "none"})


def test_streamed_events_in_order(server, client):
    body = {"model": "tiny", "input": "Name a colour.", "max_output_tokens": 10, "temperature": 0,
            "extra_body": {"return_token_ids": True, "thinking_budget": 4}}
    events = list(client.responses.create(stream=True, **body))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # reasoning item, then the message item, each opened and closed in the documented order
    want = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
            "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
            "response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    squeezed = [t for i, t in enumerate(types[2:-1]) if i == 0 or t != types[2:-1][i - 1]]
    assert squeezed == want
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert final.output[1].content[0].text == text and final.output[0].content[0].text == reasoning
    plain = client.responses.create(**body)
    assert plain.model_extra["dsv41"]["token_ids"] == final.model_extra["dsv41"]["token_ids"]
    assert plain.output_text == text


def test_thinking_budget_closes_at_the_budget(server, client):
    r = client.responses.create(model="tiny", input="Think, then answer: 2+2?", max_output_tokens=12, temperature=0,
                                extra_body={"thinking_budget": 5, "return_token_ids": True})
    ids = r.model_extra["dsv41"]["token_ids"]
    assert ids[5:8] == CLOSE and r.model_extra["dsv41"]["reasoning_closed_by"] == "budget"
    assert r.usage.output_tokens_details.reasoning_tokens == 7          # 5 drawn + "\n</think>"
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text
    free = chat_ids(server, {"messages": [{"role": "user", "content": "Think, then answer: 2+2?"}],
                             "max_tokens": 12, "temperature": 0})
    assert ids[:5] == free[:5] and CLOSE[1] not in free                 # the model's own reasoning, then the close


def test_tool_round_trip_with_previous_response_id(server, client):
    r = client.responses.create(model="tiny", input="Weather in Paris, in celsius?", tools=[WEATHER],
                                tool_choice="required", reasoning={"effort": "none"}, max_output_tokens=64,
                                temperature=0, extra_body={"return_token_ids": True})
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["unit"] in ("c", "f")
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert r.model_extra["dsv41"]["token_ids"] == chat_ids(server, {
        "messages": [{"role": "user", "content": "Weather in Paris, in celsius?"}], "tools": chat_tools,
        "tool_choice": "required", "reasoning_effort": "none", "max_tokens": 64, "temperature": 0})
    out = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 18}'}]
    r2 = client.responses.create(model="tiny", previous_response_id=r.id, input=out, tools=[WEATHER],
                                 reasoning={"effort": "none"}, max_output_tokens=6, temperature=0,
                                 extra_body={"return_token_ids": True})
    assert r2.previous_response_id == r.id and r2.output_text
    # the same conversation sent whole (the client's usual `input += response.output`), without the store
    whole = [{"role": "user", "content": "Weather in Paris, in celsius?"},
             *[o.model_dump(exclude_none=True) for o in r.output], *out]
    r3 = client.responses.create(model="tiny", input=whole, tools=[WEATHER], reasoning={"effort": "none"},
                                 max_output_tokens=6, temperature=0, store=False,
                                 extra_body={"return_token_ids": True})
    assert r3.model_extra["dsv41"]["token_ids"] == r2.model_extra["dsv41"]["token_ids"]
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)                                 # store: false
    client.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r2.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", previous_response_id=r2.id, input="and now?", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_structured_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    # thinking on: the budget closes the reasoning with </think> alone (grammar), then the answer follows the schema
    r = client.responses.create(model="tiny", input="Reply in JSON.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "reply", "schema": schema,
                                                 "strict": True}},
                                extra_body={"thinking_budget": 3, "return_token_ids": True})
    assert r.status == "completed", r.output
    assert r.model_extra["dsv41"]["token_ids"][3] == CLOSE[1]
    jsonschema.validate(json.loads(r.output_text), schema)


def test_bad_input_gets_400_and_the_server_goes_on(server, client):
    bad = [({"input": [{"type": "web_search_call"}]}, "input"),
           ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
           ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
           ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
           ({"input": "x", "temperature": "hot"}, "temperature"),
           ({"input": "x", "thinking_budget": -2}, "thinking_budget"),
           ({"input": "x", "loop_guard": "on"}, "loop_guard"),
           ({"input": [{"role": "robot", "content": "x"}]}, "input"),
           ({}, "input")]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", extra_body=body)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (body, e.value.body)
    r = httpx.post(server.url + "/v1/responses", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/responses", json={"input": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    ok = client.responses.create(model="tiny", input="still there?", max_output_tokens=2, temperature=0)
    assert ok.usage.output_tokens == 2


# --- no server -----------------------------------------------------------------------------------------------------
def test_store_is_bounded_by_count_and_bytes():
    s = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(5):
        s.put(f"r{i}", {"id": f"r{i}"}, [])
    assert len(s) == 3 and s.get("r0") is None and s.get("r4") is not None
    big = {"x": "y" * 4000}
    s.put("b1", big, [])
    s.put("b2", big, [])
    s.put("b3", big, [])
    assert s.nbytes <= 10_000 and s.get("b1") is None and s.get("b3") is not None
    s.put("huge", {"x": "y" * 20_000}, [])
    assert s.get("huge") is None
    assert s.delete("b3") and not s.delete("b3")


def test_input_items_become_chat_messages():
    msgs = input_messages([
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ])
    assert msgs == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "done"}]
    chat, conv = to_chat({"instructions": "sys", "input": "q", "max_output_tokens": 5, "reasoning": {"effort": "low"},
                          "text": {"format": {"type": "json_object"}}, "tool_choice": {"type": "function",
                                                                                         "name": "f"}}, None)
    assert chat["messages"][0] == {"role": "system", "content": "sys"} and conv == [{"role": "user", "content": "q"}]
    assert chat["max_tokens"] == 5 and chat["reasoning_effort"] == "low"
    assert chat["response_format"] == {"type": "json_object"}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert to_chat({"input": "q", "parallel_tool_calls": False, "priority": "background", "loop_guard": True},
                   None)[0] | {"messages": None} == {"messages": None, "parallel_tool_calls": False,
                                                     "priority": "background", "loop_guard": True}
    with pytest.raises(ApiError):
        to_chat({"input": "q", "background": True}, None)
