"""The V4.1 encoder against DeepSeek's reference vectors, through the render entry point, and the prompt shield."""
import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv41 import shared_dir
from dsv41.chat.encoding import encode_messages
from dsv41.chat.errors import ChatError
from dsv41.chat.tokenizer import Tokenizer
from dsv41.tools.render import render_call

CASES = [json.loads(line) for line in (shared_dir() / "vectors/chat/prompts.jsonl").open(encoding="utf-8")]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.builtin()


def _client_has_special(tok, pieces):
    client = "".join(t for t, c in pieces if c)
    return any(tid is not None for _, tid in tok.split_specials(client))


def test_vector_counts(shared):
    manifest = json.loads((shared / "vectors/chat/MANIFEST.json").read_text())
    ok = sum(c["expected"]["ok"] for c in CASES)
    assert (ok, len(CASES) - ok) == (manifest["counts"]["prompt:ok"], manifest["counts"]["prompt:error"])


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_render_matches_reference(tok, case):
    exp = case["expected"]
    out = render_call(case["encoder_call"], tok)
    assert out["ok"] == exp["ok"], out.get("error")
    if not exp["ok"]:
        return
    assert out["prompt"] == exp["prompt"]
    assert hashlib.sha256(out["prompt"].encode()).hexdigest() == exp["prompt_sha256"]
    assert out["token_ids"] == exp["token_ids"]
    assert out["images"] == exp["images"]


def test_render_call_rejects_unknown_fields(tok):
    out = render_call({"messages": [], "thinking_mode": "chat", "thinkng": True}, tok)
    assert not out["ok"] and "thinkng" in out["error"]


@pytest.mark.parametrize("case", [c for c in CASES if c["expected"]["ok"]],
                         ids=[c["id"] for c in CASES if c["expected"]["ok"]])
def test_shielded_ids(tok, case):
    """Shielded ids equal the reference's whenever client text holds no special-token text; otherwise they still
    decode to the same prompt but the client's special text is plain BPE."""
    exp = case["expected"]
    call = {k: v for k, v in case["encoder_call"].items() if k != "return_multi_modal_data"}
    rendered = encode_messages(**call, shield=True)
    ids = render_call(case["encoder_call"], tok, shield=True)["token_ids"]
    assert tok.decode(ids) == exp["prompt"]
    if _client_has_special(tok, rendered.pieces):
        assert ids != exp["token_ids"]
        template_specials = sum(1 for t, c in rendered.pieces if not c
                                for _, i in tok.split_specials(t) if i is not None)
        assert sum(1 for i in ids if i in set(tok.added.values())) == template_specials
    else:
        assert ids == exp["token_ids"]


SPECIALS = ["<｜User｜>", "<｜Assistant｜>", "</think>", "<think>", "<｜DSML｜ calls>", "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>", "<｜System｜>", "<｜latest_reminder｜>", "<｜action｜>", "<｜deepseek_image｜>"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _conversation(where: str, text: str) -> list:
    msgs = [{"role": "system", "content": "sys " + (text if where == "system" else ""), "tools": TOOLS},
            {"role": "user", "content": "u " + (text if where == "user" else "")},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": json.dumps({"a": "v " + (text if where == "args" else "")})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r " + (text if where == "tool" else "")}]
    return msgs


@pytest.mark.parametrize("where", ["system", "user", "tool", "args"])
@pytest.mark.parametrize("special", SPECIALS)
def test_shield(tok, where, special):
    """Special-token text typed by the client is plain text with the shield on, the special id with it off."""
    sid = tok.added[special.replace("<｜DSML｜ calls>", "｜DSML｜")] if "DSML" in special else tok.added[special]
    base = encode_messages(_conversation(where, "x"), "chat", shield=True)
    baseline = tok.encode_pieces(base.pieces, shield=True).count(sid)
    shielded = encode_messages(_conversation(where, special), "chat", shield=True)
    ids = tok.encode_pieces(shielded.pieces, shield=True)
    assert ids.count(sid) == baseline
    assert tok.decode(ids) == shielded.prompt
    if special == "<｜deepseek_image｜>" and where != "args":
        with pytest.raises(ChatError):  # the reference refuses the typed placeholder (it would become the id)
            encode_messages(_conversation(where, special), "chat", shield=False)
        return
    plain = encode_messages(_conversation(where, special), "chat", shield=False)
    assert plain.prompt == shielded.prompt
    assert tok.encode_pieces(plain.pieces, shield=False).count(sid) == baseline + 1
    assert tok.encode_pieces(plain.pieces, shield=False) == tok.encode(plain.prompt, special=True)


def test_segment_boundaries_match_whole_string(tok):
    """Client text glued to template text on both sides tokenizes as the whole string does."""
    for text in ["a", " ", "\n", "12", "99x", "..", "你好", "é", "\n\n##", "'s", "x<", ">y", "¡"]:
        msgs = [{"role": "system", "content": text, "tools": TOOLS}, {"role": "user", "content": text}]
        r = encode_messages(msgs, "thinking")
        assert tok.encode_pieces(r.pieces, shield=True) == tok.encode(r.prompt, special=True), text

CLIENT_TEXT = st.lists(st.sampled_from(SPECIALS + ["a", " ", "\n", "<", "｜", "DSML", "9", "é", "你"]),
                       max_size=12).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=CLIENT_TEXT, text=CLIENT_TEXT, result=CLIENT_TEXT, value=CLIENT_TEXT, thinking=st.booleans())
def test_shield_property(tok, system, text, result, value, thinking):
    """Whatever the client types, shielded ids decode to the prompt and hold exactly the template's specials; with no
    special text in it they are the reference ids."""
    msgs = [{"role": "system", "content": system, "tools": TOOLS}, {"role": "user", "content": text},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": value}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": result}]
    r = encode_messages(msgs, "thinking" if thinking else "chat", shield=True)
    ids = tok.encode_pieces(r.pieces, shield=True)
    assert tok.decode(ids) == r.prompt
    added = set(tok.added.values())
    template = [i for t, c in r.pieces if not c for _, i in tok.split_specials(t) if i is not None]
    assert [i for i in ids if i in added] == template
    if not _client_has_special(tok, r.pieces):
        assert ids == tok.encode(r.prompt, special=True)
