"""Images through the live server with the openai client (issue 11): user and tool messages, streamed and not,
four at once == each alone, kept states across an image (same bytes resume past it, other bytes only before it,
both == cold), the Responses and Anthropic image parts, and every refusal a 400 while the server keeps serving.

The checkpoint is make_tiny --vision with a smaller vision min_pixels (tests/test_images.py), so each image is a few
dozen positions and a prompt chunk of 32 cuts the spans."""
from __future__ import annotations

import concurrent.futures as cf
import io

import httpx
import openai
import pytest
from PIL import Image
from test_images import SMALL_MIN_PIXELS, data_url, image_bytes, make_vision_checkpoint
from test_server import LiveServer

NO_THINK = {"chat_template_kwargs": {"thinking": False}}
MAX_PIXELS = 1_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_vision_checkpoint(tmp_path_factory.mktemp("vision_live"))
    with LiveServer("--model", str(ckpt), "--name", "tiny", "--context", "2048", "--prefill-chunk", "32",
                    "--state-budget-gib", "1", "--keepalive-s", "0.3", "--max-images", "3",
                    "--image-max-pixels", str(MAX_PIXELS), env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def img_part(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def ask(client, content, *, stream=False, max_tokens=6, salt=None, messages=None):
    extra = {**NO_THINK, "return_token_ids": True}
    if salt is not None:
        extra["cache_salt"] = salt
    msgs = messages or [{"role": "user", "content": content}]
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=max_tokens, temperature=0,
                                           extra_body=extra)
        return r.choices[0].token_ids, r
    ids, text = None, []
    for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if ch.choices:
            text.append(ch.choices[0].delta.content or "")
            if ch.choices[0].finish_reason is not None:
                ids = ch.choices[0].model_extra.get("token_ids")
    return ids, "".join(text)


def test_user_image_streamed_and_not(client):
    content = [{"type": "text", "text": "What is in this picture?"}, img_part(image_bytes(120, 90, seed=3))]
    ids, r = ask(client, content)
    assert r.choices[0].finish_reason == "length" and len(ids) == 6
    sids, stext = ask(client, content, stream=True)
    assert sids == ids and stext == r.choices[0].message.content
    text_only, r0 = ask(client, [content[0]])
    assert text_only != ids                           # the image is seen
    # the image part became its span: n_h*(n_w+1)+2 positions
    assert r.usage.prompt_tokens == r0.usage.prompt_tokens + span_tokens(content[1])


def span_tokens(part: dict) -> int:
    from dsv41.model.image_prep import (
        ImagePrepConfig,
        image_bytes_from_data_url,
        prepare_image,
    )
    img = prepare_image(image_bytes_from_data_url(part["image_url"]["url"]),
                        ImagePrepConfig(min_pixels=SMALL_MIN_PIXELS))
    assert img.n_tokens == img.plan.n_llm_h * (img.plan.n_llm_w + 1) + 2
    return img.n_tokens


def test_tool_result_image(client):
    msgs = [{"role": "user", "content": "take a screenshot"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1",
             "content": [{"type": "text", "text": "here"}, img_part(image_bytes(80, 120, "JPEG", seed=4),
                                                                      "image/jpeg")]}]
    tools = [{"type": "function", "function": {"name": "shot", "parameters": {"type": "object"}}}]
    extra = {**NO_THINK, "return_token_ids": True}
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=4, temperature=0,
                                       extra_body=extra)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.prompt_tokens > span_tokens(msgs[2]["content"][1])
    ids = None
    for ch in client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=4, temperature=0,
                                             stream=True, extra_body=extra):
        if ch.choices and ch.choices[0].finish_reason is not None:
            ids = ch.choices[0].model_extra.get("token_ids")
    assert ids == r.choices[0].token_ids


def test_four_at_once_equal_each_alone(client):
    contents = [[{"type": "text", "text": f"Picture {k}?"}, img_part(image_bytes(*wh, seed=10 + k))]
                for k, wh in enumerate([(64, 48), (300, 200), (90, 400), (500, 60)])]
    alone = [ask(client, c)[0] for c in contents]
    with cf.ThreadPoolExecutor(4) as ex:
        together = list(ex.map(lambda c: ask(client, c, stream=bool(contents.index(c) % 2))[0], contents))
    assert together == alone
    assert len({tuple(a) for a in alone}) > 1


def test_kept_states_across_an_image(client):
    a, b = image_bytes(100, 100, seed=21), image_bytes(100, 100, seed=22)
    first = [{"role": "system", "content": "You describe pictures briefly and precisely."},
             {"role": "user", "content": [{"type": "text", "text": "Describe:"}, img_part(a)]}]
    _, r1 = ask(client, None, messages=first, salt="kept")
    turn2 = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Shorter, please."}]
    same, r_same = ask(client, None, messages=turn2, salt="kept")
    cold, _ = ask(client, None, messages=turn2, salt="cold-1")
    assert same == cold
    other_turn = [dict(m) for m in turn2]
    other_turn[1] = {"role": "user", "content": [{"type": "text", "text": "Describe:"}, img_part(b)]}
    other, r_other = ask(client, None, messages=other_turn, salt="kept")
    other_cold, _ = ask(client, None, messages=other_turn, salt="cold-2")
    assert other == other_cold
    # same bytes: resumed past the image (the first turn's prompt + reply is kept); other bytes with the same ids:
    # only up to where the image starts
    assert r_same.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r_other.usage.prompt_tokens_details.cached_tokens <= image_start(first)


def image_start(messages) -> int:
    from dsv41 import BUILTIN_TOKENIZER_DIR
    from dsv41.chat.policy import build_chat_prompt
    from dsv41.chat.tokenizer import Tokenizer
    p = build_chat_prompt({"messages": messages, **NO_THINK}, Tokenizer.from_dir(BUILTIN_TOKENIZER_DIR))
    return p.images[0].position


def test_responses_and_anthropic_image_parts(server, client):
    data = image_bytes(70, 70, seed=31)
    chat_ids, _ = ask(client, [{"type": "text", "text": "What?"}, img_part(data)], max_tokens=4)
    r = httpx.post(server.url + "/v1/responses", timeout=300, json={
        "model": "tiny", "max_output_tokens": 4, "temperature": 0, "reasoning": {"effort": "none"},
        "return_token_ids": True,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "What?"},
                                               {"type": "input_image", "image_url": data_url(data)}]}]})
    assert r.status_code == 200, r.text
    m = httpx.post(server.url + "/v1/messages", timeout=300, json={
        "model": "tiny", "max_tokens": 4, "temperature": 0, "return_token_ids": True,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_url(data).split(",", 1)[1]}}]}]})
    assert m.status_code == 200, m.text
    assert m.json()["usage"]["input_tokens"] > span_tokens(img_part(data))
    assert chat_ids


def _truncated_png() -> bytes:
    data = image_bytes(200, 200, seed=5)
    return data[: len(data) // 2]


def _ppm() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 20), (1, 2, 3)).save(buf, format="PPM")
    return buf.getvalue()


def _bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (1200, 1000), 0).save(buf, format="PNG")   # 1.2 M pixels in a few KB
    return buf.getvalue()


def test_every_refusal_is_a_400_and_the_server_keeps_serving(server, client):
    small = image_bytes(30, 30, seed=7)
    user = lambda *parts: [{"role": "user", "content": [{"type": "text", "text": "see"}, *parts]}]
    cases = {
        "assistant turn": ([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": [img_part(small)]},
                            {"role": "user", "content": "and?"}], "only in user messages and tool results"),
        "system turn": ([{"role": "system", "content": [img_part(small)]}, {"role": "user", "content": "hi"}],
                        "only in user messages and tool results"),
        "truncated": (user(img_part(_truncated_png())), "truncated"),
        "not an image": (user(img_part(b"hello, world" * 10)), "not a readable image"),
        "unsupported": (user(img_part(_ppm(), "image/x-portable-pixmap")), "unsupported image format PPM"),
        "bomb": (user(img_part(_bomb())), f"over the limit of {MAX_PIXELS}"),
        "too many": (user(*[img_part(small)] * 4), "at most 3 images"),
        "url off": (user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}),
                    "image URLs are off"),
        "bad base64": (user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}),
                       "not valid base64"),
    }
    for name, (msgs, want) in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body=NO_THINK)
        assert e.value.status_code == 400 and want in e.value.body["message"], (name, e.value.body)
    # the placeholder typed as text: chat shields it (plain text), completions (no shield) refuse it
    r = client.chat.completions.create(model="tiny", max_tokens=2, extra_body=NO_THINK,
                                       messages=[{"role": "user", "content": "<｜deepseek_image｜> what?"}])
    assert r.usage.prompt_tokens < span_tokens(img_part(small))
    with pytest.raises(openai.BadRequestError, match="image placeholder"):
        client.completions.create(model="tiny", prompt="a <｜deepseek_image｜> b", max_tokens=2)
    ids, _ = ask(client, [{"type": "text", "text": "still there?"}, img_part(small)], max_tokens=2)
    assert len(ids) == 2


def test_tokenize_and_count_tokens_count_an_image_as_its_span(server, client):
    data = image_bytes(90, 50, seed=41)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What?"}, img_part(data)]}]
    tk = httpx.post(server.url + "/tokenize", json={"messages": msgs, **NO_THINK}, timeout=300).json()
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, extra_body=NO_THINK)
    assert tk["count"] == len(tk["tokens"]) == r.usage.prompt_tokens
    assert tk["count"] > span_tokens(img_part(data))
    body = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data_url(data).split(",", 1)[1]}}]}]}
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=300).json()["input_tokens"]
    m = httpx.post(server.url + "/v1/messages", json={**body, "max_tokens": 1}, timeout=300)
    assert m.status_code == 200, m.text
    u = m.json()["usage"]
    assert counted == u["input_tokens"] + u["cache_read_input_tokens"]      # Anthropic counts cache reads apart
