"""The streaming reply parser: reference parse vectors through the parse entry point, our rules where the reference
refuses, OpenAI delta shapes, and split invariance (random text cuts and random token splits)."""
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv41 import shared_dir
from dsv41.chat.encoding import encode_messages
from dsv41.chat.parser import ReplyParser, parse_reply
from dsv41.chat.tokenizer import EOS, IncrementalDetokenizer, Tokenizer
from dsv41.tools.parse import parse_call

CASES = [json.loads(line) for line in (shared_dir() / "vectors/chat/parse.jsonl").open(encoding="utf-8")]
ACCEPTED = [c for c in CASES if c["expected"]["ok"]]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.builtin()


def _json_or_none(s):
    try:
        return json.loads(s)
    except ValueError:
        return None


@pytest.mark.parametrize("case", ACCEPTED, ids=[c["id"] for c in ACCEPTED])
def test_parse_matches_reference(case):
    exp = case["expected"]["message"]
    out = parse_call(case["parse_call"])
    assert out["ok"]
    msg = out["message"]
    assert msg["content"] == exp["content"]
    assert msg["reasoning_content"] == exp["reasoning_content"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == [c["function"]["name"] for c in exp["tool_calls"]]
    for ours, ref in zip(msg["tool_calls"], exp["tool_calls"]):
        assert ours["type"] == "function"
        ours_args = json.loads(ours["function"]["arguments"])  # ours are always valid JSON
        ref_args = _json_or_none(ref["function"]["arguments"])
        if ref_args is not None:
            assert ours_args == ref_args


def _by_id(case_id):
    return next(c for c in CASES if c["id"] == case_id)["parse_call"]


@pytest.mark.parametrize("case_id,content,reasoning,calls", [
    ("parse_chat_missing_eos", "Hello there.", "", []),               # a reply cut by max_tokens keeps its text
    ("parse_call_cut_in_opener", "Sure.", "", []),                    # a cut-off opener is markup, dropped
    ("parse_call_unclosed_parameter", "", "", [("get_weather", {"city": "Par"})]),  # closed at the end
    ("parse_call_text_between_invokes", "", "", [("get_weather", {"city": "Paris"})] * 2),  # stray text dropped
    ("parse_call_without_blank_line", "Sure.", "", [("get_weather", {"city": "Paris"})]),
    ("parse_call_single_newline_before", "Sure.\n", "", [("get_weather", {"city": "Paris"})]),
    ("parse_call_inside_reasoning", "answer", None, []),              # a block inside reasoning is reasoning
    ("parse_call_v4_spelling", "", "", [("f", {"a": "1"})]),           # V4's <｜DSML｜tool_calls> read as V4.1's
])
def test_where_the_reference_refuses(case_id, content, reasoning, calls):
    out = parse_call(_by_id(case_id))
    assert out["ok"]
    msg = out["message"]
    assert msg["content"] == content
    if reasoning is not None:
        assert msg["reasoning_content"] == reasoning
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == calls
    assert "DSML" not in msg["content"]


def _call_text(name, params):
    body = "\n".join(f'<｜DSML｜ parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                     f'{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜ parameter>' for k, v in params.items())
    return f'<｜DSML｜ invoke name="{name}">\n{body}\n</｜DSML｜ invoke>'


def _block(*calls):
    return "\n\n<｜DSML｜ calls>\n" + "\n".join(_call_text(n, p) for n, p in calls) + "\n</｜DSML｜ calls>"


def test_offered_tools_and_text_rewrite():
    text = "ok" + _block(("GET_WEATHER", {"city": "Paris"}), ("delete_all", {"force": True}))
    final = parse_reply(text, thinking=False, tools=WEATHER)
    assert [c["function"]["name"] for c in final.tool_calls] == ["get_weather"]   # offered spelling
    assert json.loads(final.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert final.content == 'ok<tool_call>{"name":"delete_all","arguments":{"force":true}}</tool_call>'
    assert re.fullmatch(r"call_[0-9a-f]{24}", final.tool_calls[0]["id"])
    none_offered = parse_reply(text, thinking=False, tools=None)
    assert none_offered.tool_calls == [] and "DSML" not in none_offered.content


def test_parallel_tool_calls_false_keeps_first():
    text = _block(("get_weather", {"city": "A"}), ("nope", {}), ("get_weather", {"city": "B"}))
    final = parse_reply(text, thinking=False, tools=WEATHER, parallel_tool_calls=False)
    assert [json.loads(c["function"]["arguments"]) for c in final.tool_calls] == [{"city": "A"}]
    assert final.content == ""


def test_delta_shapes_and_message():
    p = ReplyParser(thinking=True, tools=WEATHER, new_id=lambda: "call_" + "0" * 24)
    deltas = p.feed("Think.</think>Checking." + _block(("get_weather", {"city": "Pa\"ris", "days": [1, 2]})))
    more, final = p.finish()
    deltas += more
    assert deltas[0] == {"role": "assistant"}
    assert {"reasoning_content": "Think."} in deltas and {"content": "Checking."} in deltas
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": "call_" + "0" * 24, "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    args = "".join(c["function"]["arguments"] for c in calls)
    assert args == '{"city":"Pa\\"ris","days":[1,2]}' == final.tool_calls[0]["function"]["arguments"]
    msg = final.message()
    assert msg["content"] == "Checking." and msg["reasoning_content"] == "Think."
    assert parse_reply(_block(("get_weather", {})), False, WEATHER).message()["content"] is None


def test_string_false_values():
    final = parse_reply(_block(("f", {})).replace("\n\n</｜DSML｜ invoke>",
                        '\n<｜DSML｜ parameter name="a" string="false">NaN</｜DSML｜ parameter>\n'
                        '<｜DSML｜ parameter name="b" string="false"> {"x": 1e2} </｜DSML｜ parameter>\n'
                        '<｜DSML｜ parameter name="c">raw</｜DSML｜ parameter>\n</｜DSML｜ invoke>'),
                        False, any_tool=True)
    assert final.tool_calls[0]["function"]["arguments"] == '{"a":"NaN","b":{"x":100.0},"c":"raw"}'


def test_calls_at_end_of_unclosed_reasoning_are_calls():
    final = parse_reply("need data" + _block(("get_weather", {"city": "X"})) + "\n", True, WEATHER)
    assert final.reasoning_content == "need data" and len(final.tool_calls) == 1
    final = parse_reply("need data" + _block(("get_weather", {"city": "X"})) + " more", True, WEATHER)
    assert final.tool_calls == [] and final.reasoning_content.endswith(" more")


# ---- split invariance ----
TEXT = st.lists(st.sampled_from(list("ab <>/\n\"=｜é😀think") + ["DSML", "</think>", "\n\n", "<｜DSML｜ calls>"]),
                max_size=20).map("".join)
VALUE = st.one_of(TEXT, st.integers(-10**6, 10**6), st.booleans(), st.none(),
                  st.lists(st.integers(0, 9), max_size=3), st.dictionaries(st.sampled_from("xyz"), st.integers(0, 9)))
CALL = st.tuples(st.sampled_from(["get_weather", "Get_Weather", "other"]),
                 st.dictionaries(st.sampled_from(["city", "n", "q"]), VALUE, max_size=3))


def _run(text, cuts, thinking, parallel=True):
    p = ReplyParser(thinking, WEATHER, parallel_tool_calls=parallel, new_id=lambda: "call_x")
    deltas, pos = [], 0
    for c in sorted(cuts) + [len(text)]:
        deltas += p.feed(text[pos:c])
        pos = c
    more, final = p.finish()
    return deltas + more, final


def _joined(deltas):
    out = {"content": "", "reasoning_content": "", "calls": {}}
    for d in deltas:
        for k in ("content", "reasoning_content"):
            out[k] += d.get(k, "")
        for tc in d.get("tool_calls", []):
            c = out["calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
            if "id" in tc:
                assert c["name"] is None and tc["function"]["arguments"] == ""  # name first, once
                c["name"] = tc["function"]["name"]
            c["arguments"] += tc["function"]["arguments"]
    return out


def _check(deltas, final):
    j = _joined(deltas)
    assert j["content"] == final.content and j["reasoning_content"] == final.reasoning_content
    assert [(c["name"], c["arguments"]) for _, c in sorted(j["calls"].items())] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in final.tool_calls]
    for c in final.tool_calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
    assert "<｜DSML｜ invoke" not in final.content
    assert sum(1 for d in deltas if "role" in d) == 1 and "role" in deltas[0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reasoning=TEXT, content=TEXT, calls=st.lists(CALL, max_size=3), thinking=st.booleans(),
       cut_at_end=st.booleans(), parallel=st.booleans(), data=st.data())
def test_any_cut_gives_the_same_result(reasoning, content, calls, thinking, cut_at_end, parallel, data):
    text = (reasoning + "</think>" if thinking else "") + content + (_block(*calls) if calls else "")
    if cut_at_end:
        text = text[:data.draw(st.integers(0, len(text)))]
    whole_deltas, whole = _run(text, [], thinking, parallel)
    _check(whole_deltas, whole)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    deltas, final = _run(text, cuts, thinking, parallel)
    _check(deltas, final)
    assert final == whole
    if calls and not cut_at_end and "</think>" not in reasoning + content and "DSML" not in content \
            and "<｜DSML｜ calls>" not in reasoning:
        offered = [(n, p) for n, p in calls if n.lower() == "get_weather"]
        if not parallel:
            offered = offered[:1]
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls]
        assert got == [("get_weather", p) for _, p in offered]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(reasoning=TEXT, content=TEXT, calls=st.lists(CALL, min_size=1, max_size=3), data=st.data())
def test_any_token_split_gives_the_same_result(tok, reasoning, content, calls, data):
    text = reasoning + "</think>" + content + _block(*calls)
    ids = tok.encode(text, special=True)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=10)))
    detok = IncrementalDetokenizer(tok)
    p = ReplyParser(True, WEATHER, new_id=lambda: "call_x")
    deltas, pos = [], 0
    for c in cuts + [len(ids)]:
        deltas += p.feed(detok.push_many(ids[pos:c]))
        pos = c
    deltas += p.feed(detok.finish())
    more, final = p.finish()
    _check(deltas + more, final)
    assert final == parse_reply(text, True, WEATHER, new_id=lambda: "call_x")


def test_roundtrip_through_the_encoder():
    """What the encoder writes for an assistant turn parses back to the same message."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris", "days": 3}}}]
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "Sure.", "reasoning_content": "r", "tool_calls": calls}]
    prompt = encode_messages(msgs, "thinking").prompt
    reply = prompt.split("<｜Assistant｜><think>", 1)[1].split(EOS)[0]
    final = parse_reply(reply, True, WEATHER)
    assert (final.reasoning_content, final.content) == ("r", "Sure.")
    assert json.loads(final.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_held_block_decided_by_what_follows():
    block = _block(("get_weather", {"city": "X"}))
    for tail, calls in ((["\n", "\n", " more"], 0), (["\n", "\n"], 1), (["</think>ok"], 0)):
        p = ReplyParser(True, WEATHER)
        for piece in ["r", block[:7], block[7:]] + tail:
            p.feed(piece)
        final = p.finish()[1]
        assert len(final.tool_calls) == calls
        if not calls:
            assert block in final.reasoning_content


def test_long_block_in_reasoning_is_reasoning(monkeypatch):
    import dsv41.chat.parser as parser_module
    monkeypatch.setattr(parser_module, "HELD_LIMIT", 200)
    text = "r" + _block(("get_weather", {"city": "X" * 300}))
    whole = parse_reply(text, True, WEATHER)
    assert whole.tool_calls == [] and whole.reasoning_content == text
    for step in (1, 7, 50):
        assert _run(text, list(range(step, len(text), step)), True)[1] == parse_reply(text, True, WEATHER,
                                                                                      new_id=lambda: "call_x")
    assert len(parse_reply("r" + _block(("get_weather", {"city": "X"})), True, WEATHER).tool_calls) == 1


def _v4(text: str) -> str:
    """The same reply in V4's spelling of the block (serving.md §2.4: `<｜DSML｜tool_calls>`, no space)."""
    return (text.replace("<｜DSML｜ calls>", "<｜DSML｜tool_calls>").replace("</｜DSML｜ calls>", "</｜DSML｜tool_calls>")
            .replace("｜DSML｜ invoke", "｜DSML｜invoke").replace("｜DSML｜ parameter", "｜DSML｜parameter"))


def test_v4_spelling_gives_the_calls():
    text = "ok" + _block(("get_weather", {"city": "Paris"}), ("get_weather", {"n": 3}))
    v4 = _v4(text)
    assert "<｜DSML｜tool_calls>" in v4 and "｜DSML｜ " not in v4
    final = parse_reply(v4, thinking=False, tools=WEATHER)
    assert [json.loads(c["function"]["arguments"]) for c in final.tool_calls] == [{"city": "Paris"}, {"n": 3}]
    assert final.content == "ok"


def test_v4_reply_cut_inside_a_closer_reads_as_v41():
    """A reply that ends inside a closer (max_tokens: `</｜DSML｜parameter` without its `>`, found by the property
    test below): V4's spelling reads as V4.1's unfinished closer, not as part of the value."""
    text = "aa" + _block(("other", {"n": {"x": 0}, "q": {"x": 0}}), ("get_weather", {"city": "Oslo"}))
    for tag in ("parameter>", "invoke>"):
        for at in (text.index(tag) + len(tag) - 1, text.rindex(tag) + len(tag) - 1):
            cut = text[:at]
            assert _v4(cut) != cut
            assert _run(_v4(cut), [], False)[1] == _run(cut, [], False)[1], cut[-30:]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reasoning=TEXT, content=TEXT, calls=st.lists(CALL, max_size=3), thinking=st.booleans(),
       cut_at_end=st.booleans(), data=st.data())
def test_v4_spelling_parses_as_v41_under_any_cut(reasoning, content, calls, thinking, cut_at_end, data):
    text = (reasoning + "</think>" if thinking else "") + content + (_block(*calls) if calls else "")
    if cut_at_end:
        text = text[:data.draw(st.integers(0, len(text)))]
    _, want = _run(text, [], thinking)
    v4 = _v4(text)
    deltas, final = _run(v4, data.draw(st.lists(st.integers(0, len(v4)), max_size=12)), thinking)
    _check(deltas, final)
    assert final == want


def test_partial_tail_is_the_longest_marker_prefix_ending_the_text():
    """The streaming parser's hold-back: the longest suffix of the text that is a proper prefix of a marker, against
    the definition (every marker, every length) on random texts over the markers' own characters."""
    import random

    from dsv41.chat.parser import _V4_TAGS, _partial_tail

    def brute(buf, markers):
        return max([n for m in markers for n in range(1, min(len(buf), len(m) - 1) + 1) if buf.endswith(m[:n])],
                   default=0)
    rng = random.Random(7)
    sets = [_V4_TAGS, ("</think>", "\n\n<｜DSML｜function_calls>", "<｜DSML｜function_calls>"), ("ab", "aab", "b")]
    for markers in sets:
        alphabet = sorted(set("".join(markers))) + ["x", " "]
        for _ in range(3000):
            buf = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            if rng.random() < 0.3:              # often end inside a marker
                m = rng.choice(markers)
                buf += m[:rng.randint(1, len(m))]
            assert _partial_tail(buf, markers) == brute(buf, markers), (buf, markers)
