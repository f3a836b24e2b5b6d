"""An image request served on two ranks (`--tp 2`, two processes over loopback and the shm ring): rank 1 gets the
span rows from rank 0 through the ring (dsv41/sched/images.py), so the reply equals one rank's and every round's
logits digests agree (a rank without the rows would diverge at the first image row and fail the lane)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_images import data_url, image_bytes, make_vision_checkpoint
from test_tp_serve import Proc, two_rank_server

TOKENS = 5


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    ckpt = make_vision_checkpoint(tmp_path_factory.mktemp("vision_tp"))
    common = ["--model", str(ckpt), "--context", "512", "--state-budget-gib", "1", "--prefill-chunk", "16",
              "--shutdown-grace-s", "5", "--name", "tiny"]
    one = Proc("--port", "0", *common)
    try:
        with two_rank_server(*common, settle_s=1.0) as (r0, _):
            one.wait_ready()
            yield one, r0
    finally:
        one.stop()


def chat(url: str, k: int) -> list[int]:
    content = [{"type": "text", "text": f"Picture {k}:"},
               {"type": "image_url", "image_url": {"url": data_url(image_bytes(60 + 70 * k, 140 - 30 * k, seed=k))}}]
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True, "chat_template_kwargs": {"thinking": False}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_two_ranks_serve_an_image_as_one(servers):
    one, two = servers
    want = [chat(one.url, k) for k in range(3)]
    assert [chat(two.url, k) for k in range(3)] == want
    with ThreadPoolExecutor(3) as ex:
        assert list(ex.map(lambda k: chat(two.url, k), range(3))) == want
    h = httpx.get(two.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["rounds_total"] >= 2 * TOKENS
