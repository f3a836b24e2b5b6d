"""The server serves a tiny EXL3 pack end to end (openai client: a chat completion and a stream). On the CPU in CI;
scripts/h200/exl3.sh runs it with DSV41_DEVICE=cuda (the server then loads the pack's codes onto the GPU)."""
import os
from pathlib import Path

import pytest
from test_server import LiveServer

from dsv41.tools.make_tiny import main as make_tiny


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> Path:
    """A pack with the real V4.1 tokenizer (the chat template needs its special tokens); its Engram tables in
    pack/engram, outside the pack, as the published packs leave them (served with --engram)."""
    d = tmp_path_factory.mktemp("exl3srv") / "tiny-exl3"
    assert make_tiny(["--out", str(d), "--format", "exl3", "--seed", "2"]) == 0
    return d


@pytest.fixture(scope="module")
def server(pack):
    with LiveServer("--model", str(pack), "--engram", str(pack / "engram"), "--context", "512", "--prefill-chunk", "64", "--state-budget-gib", "1",
                    "--shutdown-grace-s", "5", env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


MSG = [{"role": "user", "content": "Name three rivers."}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def test_models_lists_the_pack(client):
    assert [m.id for m in client.models.list().data] == ["tiny-exl3"]


def test_chat_and_stream_agree(client):
    r = client.chat.completions.create(model="tiny-exl3", messages=MSG, max_tokens=12, temperature=0,
                                       extra_body=NO_THINK)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5
    text = r.choices[0].message.content or ""
    chunks = list(client.chat.completions.create(model="tiny-exl3", messages=MSG, max_tokens=12, temperature=0,
                                                 extra_body=NO_THINK, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert streamed == text and finish == [r.choices[0].finish_reason]


def test_loaded_on_the_requested_device(server, client):
    """The start-up log names the device the pack was loaded on (cuda when DSV41_DEVICE=cuda)."""
    want = os.environ.get("DSV41_DEVICE", "cpu")
    loaded = [line for line in server.lines if "model loaded from" in line]
    assert loaded and (want == "auto" or f" on {want}" in loaded[0]), loaded
