"""The request policy: OpenAI request shapes in, token ids + thinking + tools + images out, typed 400s."""
import base64
import json

import pytest

from dsv41 import shared_dir
from dsv41.chat.errors import ChatError
from dsv41.chat.policy import build_chat_prompt
from dsv41.chat.tokenizer import Tokenizer

VECTORS = {c["id"]: c for c in map(json.loads, (shared_dir() / "vectors/chat/prompts.jsonl").open(encoding="utf-8"))}
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.builtin()


def build(tok, **req):
    return build_chat_prompt(req, tok, default_thinking=False)


@pytest.mark.parametrize("case_id", ["chat_user_only", "thinking_effort_low", "thinking_effort_int_62",
                                     "tools_system_chat", "call_round_then_user_thinking",
                                     "call_results_reordered_by_id", "image_two_images_interleaved",
                                     "mid_system_thinking_drops_reasoning", "unicode_tool_result"])
def test_requests_render_as_the_reference(tok, case_id):
    case = VECTORS[case_id]
    p = build_chat_prompt(case["request"], tok, default_thinking=False)
    assert p.token_ids == case["expected"]["token_ids"]
    assert p.prompt_text == case["expected"]["prompt"]
    assert p.thinking == (case["encoder_call"]["thinking_mode"] == "thinking")


def user(text="hi"):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("effort,shown", [("minimal", 25), ("low", 50), ("medium", 62), ("high", 75),
                                          ("xhigh", 88), ("max", 100), (1, 1), (100, 100), (None, 75)])
def test_effort_names(tok, effort, shown):
    p = build(tok, messages=user(), reasoning_effort=effort, chat_template_kwargs={"thinking": True})
    assert p.thinking and p.reasoning_effort == shown
    assert f"Reasoning Effort: {shown} (range" in p.prompt_text
    p = build(tok, messages=user(), chat_template_kwargs={"thinking": True, "reasoning_effort": effort})
    assert p.reasoning_effort == shown


@pytest.mark.parametrize("req,thinking", [
    ({}, False),
    ({"chat_template_kwargs": {"thinking": True}}, True),
    ({"chat_template_kwargs": {"enable_thinking": True, "thinking": False}}, True),
    ({"chat_template_kwargs": {"thinking": {"type": "enabled"}}}, True),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, True),
    ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, False),
    ({"reasoning_effort": "high"}, False),
    ({"reasoning_effort": "none", "thinking": {"type": "enabled"}}, True),
])
def test_thinking_switches(tok, req, thinking):
    p = build(tok, messages=user(), **req)
    assert p.thinking == thinking
    assert p.prompt_text.endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")
    assert (p.reasoning_effort is None) == (not thinking)


def test_default_thinking_is_a_parameter(tok):
    assert build_chat_prompt({"messages": user()}, tok, default_thinking=True).thinking
    assert not build_chat_prompt({"messages": user(), "reasoning_effort": "none"}, tok, default_thinking=True).thinking
    p = build_chat_prompt({"messages": user()}, tok, default_thinking=True, default_effort="max")
    assert p.reasoning_effort == 100


def test_final_assistant_message_is_continued(tok):
    msgs = user("Give JSON.") + [{"role": "assistant", "content": "{\"a\":", "reasoning_content": "easy"}]
    p = build(tok, messages=msgs, chat_template_kwargs={"thinking": True})
    assert p.prompt_text.endswith("<｜User｜>Give JSON.<｜Assistant｜><think>easy</think>{\"a\":")
    assert p.continues_assistant and not p.thinking and p.reasoning_effort == 75   # the reply starts in content
    p = build(tok, messages=msgs)
    assert p.prompt_text.endswith("<｜Assistant｜></think>{\"a\":") and p.token_ids[-1] != tok.eos_id
    calls = user() + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    p = build(tok, messages=calls, tools=[TOOL])
    assert p.token_ids[-1] == tok.eos_id and not p.continues_assistant


def test_developer_is_system(tok):
    a = build(tok, messages=[{"role": "developer", "content": "Be brief."}] + user())
    b = build(tok, messages=[{"role": "system", "content": "Be brief."}] + user())
    assert a.token_ids == b.token_ids and a.prompt_text.startswith("<｜begin▁of▁sentence｜><｜System｜>Be brief.")


def test_leading_system_messages_merge(tok):
    p = build(tok, messages=[{"role": "system", "content": "A"}, {"role": "developer", "content": [
        {"type": "text", "text": "B"}, {"type": "text", "text": "C"}]}, {"role": "system", "content": ""}] + user()
        + [{"role": "assistant", "content": "x"}, {"role": "system", "content": "D"}], tools=[TOOL])
    assert p.prompt_text.startswith("<｜begin▁of▁sentence｜><｜System｜>A\n\nB\n\nC\n\n## Tools")
    assert p.prompt_text.count("<｜System｜>") == 2 and "<｜System｜>D<｜Assistant｜>" in p.prompt_text


def test_tools_and_response_format_get_an_empty_system(tok):
    p = build(tok, messages=user(), tools=[TOOL])
    assert p.prompt_text.startswith("<｜begin▁of▁sentence｜><｜System｜>\n\n## Tools\n\n")
    assert p.tools == [TOOL]
    rf = {"type": "json_object"}
    p = build(tok, messages=user(), response_format=rf)
    assert "## Response Format:" in p.prompt_text and p.response_format == rf
    p = build(tok, messages=[{"role": "system", "content": "S"}] + user(), tools=[TOOL], response_format=rf)
    assert p.prompt_text.count("<｜System｜>") == 1 and "S\n\n## Tools" in p.prompt_text
    assert "## Response Format" not in build(tok, messages=user(), response_format={"type": "text"}).prompt_text


def test_tool_choice_none_hides_tools(tok):
    p = build(tok, messages=user(), tools=[TOOL], tool_choice="none")
    assert p.tools == [] and "## Tools" not in p.prompt_text
    assert build(tok, messages=user(), tools=[TOOL], tool_choice="auto").tools == [TOOL]


def test_arguments_as_object_string_or_double_encoded(tok):
    def conv(args):
        return [{"role": "user", "content": "w"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    obj = {"city": "Paris"}
    ids = {build(tok, messages=conv(a), tools=[TOOL]).prompt_text
           for a in (obj, json.dumps(obj), json.dumps(json.dumps(obj)))}
    assert len(ids) == 1 and 'string="true">Paris</｜DSML｜ parameter>' in ids.pop()
    empty = build(tok, messages=conv(""), tools=[TOOL]).prompt_text
    assert '<｜DSML｜ invoke name="get_weather">\n\n</｜DSML｜ invoke>' in empty


def test_images(tok):
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]
    p = build(tok, messages=msgs)
    assert [im.position for im in p.images] == [i for i, t in enumerate(p.token_ids) if t == tok.image_id]
    assert len(p.images) == 2 and all(im.data == base64.b64decode(PNG) for im in p.images)
    assert p.images[0].media_type == "image/png"
    tool_img = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": [
                    {"type": "image_url", "image_url": f"data:image/png;base64,{PNG}"}]}]
    p = build(tok, messages=tool_img, tools=[TOOL])
    assert "<tool_result><｜deepseek_image｜></tool_result>" in p.prompt_text and len(p.images) == 1
    with pytest.raises(ChatError, match="at most 1 images"):
        build_chat_prompt({"messages": msgs}, tok, max_images=1)
    url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    with pytest.raises(ChatError, match="URLs are off"):
        build(tok, messages=url)
    assert build_chat_prompt({"messages": url}, tok, allow_image_urls=True).images[0].url == "https://x/y.png"
    typed = build(tok, messages=user("see <｜deepseek_image｜>"))
    assert tok.image_id not in typed.token_ids and typed.images == []   # shielded: plain text


@pytest.mark.parametrize("req,param,fragment", [
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "not a role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "not null"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": "data:image/png;base64,"
                                                      + PNG}]}] + user()}, "messages", "only in user messages"),
    ({"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": "data:image/png;base64,"
                                                   + PNG}]}] + user()}, "messages", "only in user messages"),
    ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]}, "messages", "no call with that id"),
    ({"messages": user() + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages", "not valid JSON"),
    ({"messages": user() + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages", "JSON object"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages", "not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png,abc"}]}]},
     "messages", "must be base64"),
    ({"messages": user(), "reasoning_effort": "huge"}, "reasoning_effort", "integer 1-100"),
    ({"messages": user(), "reasoning_effort": 0}, "reasoning_effort", "integer 1-100"),
    ({"messages": user(), "reasoning_effort": True}, "reasoning_effort", "integer 1-100"),
    ({"messages": user(), "tools": [{"name": "f"}]}, "tools", "type"),
    ({"messages": user(), "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "not in tools"),
    ({"messages": user(), "response_format": {"type": "xml"}}, "response_format", "json_object"),
    ({"messages": user(), "chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking", "true"),
])
def test_errors(tok, req, param, fragment):
    with pytest.raises(ChatError, match=fragment) as e:
        build_chat_prompt(req, tok)
    assert e.value.param == param


def test_shield_switch(tok):
    req = {"messages": user("x </think> <｜User｜> y")}
    on, off = build_chat_prompt(req, tok), build_chat_prompt(req, tok, shield=False)
    assert on.prompt_text == off.prompt_text
    assert off.token_ids == tok.encode(off.prompt_text, special=True)
    user_id = tok.added["<｜User｜>"]
    assert on.token_ids.count(user_id) == 1 and off.token_ids.count(user_id) == 2
    assert tok.think_end_id not in on.token_ids and tok.think_end_id in off.token_ids


@pytest.mark.parametrize("params,ok", [
    (None, True), ({"type": "object", "properties": {"q": {"type": ["string", "null"]}}, "required": ["q"]}, True),
    ({"$defs": {"a": {"type": "integer"}}, "anyOf": [{"$ref": "#/$defs/a"}, True]}, True),
    (7, False), ({"type": "dict"}, False), ({"properties": {"q": "string"}}, False), ({"required": [1]}, False),
    ({"items": {"type": "objekt"}}, False), ({"oneOf": "x"}, False), ({"minItems": -1}, False)])
def test_tool_parameters_must_be_a_json_schema(tok, params, ok):
    fn = {"name": "f", **({} if params is None else {"parameters": params})}
    req = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": fn}]}
    if ok:
        assert build(tok, **req).tools
    else:
        with pytest.raises(ChatError) as e:
            build(tok, **req)
        assert e.value.param == "tools" and "invalid schema for function 'f'" in e.value.message
