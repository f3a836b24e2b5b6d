"""tools/gates.py: each check can fail. A small stdlib HTTP server speaks the OpenAI shapes with one defect switched on
at a time (ids that depend on concurrency or on `draft`, drafts reported with `"draft": false`, DSML in content, a
stream without [DONE], a missing metric family); the matching check must fail and the others pass. Then the gates run against the live dsv41 server on the
built-in checkpoint (a few quick checks; bench/results/gates-cpu.md is the full run).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gates


class Fake:
    """Deterministic replies: token ids are a hash of the prompt (and of the defect's extra input when on)."""

    def __init__(self, defect: str = ""):
        self.defect = defect
        self.in_flight = 0
        self.lock = threading.Lock()

    def ids(self, key: str, n: int) -> list[int]:
        h = hashlib.sha256(key.encode()).digest()
        return [h[i % 32] + 256 * (i // 32) for i in range(n)]


def make_handler(fake: Fake):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, obj, status=200, ctype="application/json"):
            data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send({"object": "list", "data": [{"id": "fake", "object": "model"}]})
            if self.path == "/metrics":
                fams = [f for f in gates.DEFAULT_FAMILIES if not (fake.defect == "metrics" and f == "requests_waiting")]
                return self._send("".join(f"x:{f} 0\n" for f in fams).encode(), ctype="text/plain")
            self._send({"error": {"message": "no"}}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.lock:
                fake.in_flight += 1
            try:
                time.sleep(0.05)
                with fake.lock:
                    crowd = fake.in_flight
                if self.path == "/v1/completions":
                    key = json.dumps([body["prompt"], body.get("seed")])
                    if fake.defect == "racy" and crowd > 1:
                        key += "crowd"
                    if fake.defect == "draft" and body.get("draft") is False:
                        key += "serial"
                    ids = fake.ids(key, body["max_tokens"])
                    reply = {"object": "text_completion", "choices": [
                        {"index": 0, "text": "x", "finish_reason": "length", "token_ids": ids}]}
                    if fake.defect != "nodrafts" and (body.get("draft") is not False or fake.defect == "draftleak"):
                        reply["usage"] = {"drafts": {"drafted_tokens": 3, "accepted_tokens": 1}}
                    return self._send(reply)
                if self.path == "/v1/chat/completions":
                    return self.chat(body)
                self._send({"error": {"message": "no"}}, 404)
            finally:
                with fake.lock:
                    fake.in_flight -= 1

        def chat(self, body):
            content = "<｜DSML｜ calls>" if fake.defect == "dsml" else "hello"
            thinking = (body.get("chat_template_kwargs") or {}).get("thinking")
            if not body.get("stream"):
                return self._send({"id": "chatcmpl-1", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop",
                     "token_ids": fake.ids(json.dumps(body["messages"]), 2)}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
            frames = [{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}]
            if thinking:
                frames.append({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}, "finish_reason": None}]})
            frames.append({"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]})
            frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            data = b": keepalive\n\n" + b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames)
            if fake.defect != "nodone":
                data += b"data: [DONE]\n\n"
            self._send(data, ctype="text/event-stream")

    return H


@pytest.fixture
def fake_server():
    servers = []

    def start(defect: str = "") -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(Fake(defect)))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


QUICK = ["--tokens", "4", "--prompts", "4", "--stagger", "0.01", "--concurrency", "16"]
CHECKS = "models,chat_probe,reasoning_stream,tool_call,drafted_equals_serial,concurrent_equals_solo,metrics"


def run_gates(url: str, tmp_path, only: str = CHECKS, extra=()) -> tuple[int, str]:
    out = tmp_path / "g.md"
    code = gates.main(["--url", url, "--only", only, "--out", str(out), *QUICK, *extra])
    return code, out.read_text()


def status_of(report: str, name: str) -> str:
    return next(line.split("|")[2].strip() for line in report.splitlines() if line.startswith(f"| {name} |"))


def test_a_sound_server_passes(fake_server, tmp_path):
    code, rep = run_gates(fake_server(), tmp_path)
    assert code == 0, rep
    assert status_of(rep, "concurrent_equals_solo") == "pass" and "| 16/16 |" in rep   # (4 greedy + 4 seeded) x burst, staggered


@pytest.mark.parametrize("defect, check", [("racy", "concurrent_equals_solo"), ("draft", "drafted_equals_serial"),
                                           ("draftleak", "drafted_equals_serial"),
                                           ("dsml", "chat_probe"), ("nodone", "reasoning_stream"),
                                           ("metrics", "metrics")])
def test_each_defect_fails_its_check(fake_server, tmp_path, defect, check):
    only = check if check != "chat_probe" else "tool_call"       # DSML in content is the tool check's business
    code, rep = run_gates(fake_server(defect), tmp_path, only=only)
    assert code == 1
    assert status_of(rep, only) == "FAIL", rep


def test_a_missing_feature_skips_and_strict_fails_it(fake_server, tmp_path):
    url = fake_server()                      # the fake server keeps no prompt states: cached_tokens never > 0
    code, rep = run_gates(url, tmp_path, only="resumed_equals_cold")
    assert code == 0 and status_of(rep, "resumed_equals_cold") == "skip", rep
    assert "cached_tokens stayed 0" in rep
    code, rep = run_gates(url, tmp_path, only="resumed_equals_cold", extra=["--strict"])
    assert code == 1 and status_of(rep, "resumed_equals_cold") == "FAIL"


def test_no_drafts_reported_is_tolerant_and_strict_fails_it(fake_server, tmp_path):
    code, rep = run_gates(fake_server(), tmp_path, only="drafted_equals_serial", extra=["--strict"])
    assert code == 0 and "drafting exercised: 18 draft tokens verified, 6 accepted (in the replies)" in rep, rep
    url = fake_server("nodrafts")
    code, rep = run_gates(url, tmp_path, only="drafted_equals_serial")
    assert code == 0 and "tolerant: the server reported no drafted tokens" in rep, rep
    code, rep = run_gates(url, tmp_path, only="drafted_equals_serial", extra=["--strict"])
    assert code == 1 and status_of(rep, "drafted_equals_serial") == "FAIL", rep


def test_png_is_a_valid_image():
    import base64
    import io

    from PIL import Image
    url = gates.png_data_url(5, 3, (1, 2, 3))
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert img.size == (5, 3) and img.getpixel((4, 2)) == (1, 2, 3)


def test_bad_usage_exits_2():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gates.py"), "--url", "http://x", "--only", "nope"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "unknown check" in r.stderr


# ------------------------------------------------------------------------------------------------ live server
def test_gates_against_the_live_server(tmp_path):
    from test_server import LiveServer
    s = LiveServer("--context", "1024", "--prefill-chunk", "64", "--keepalive-s", "0.3", "--state-budget-gib", "2",
                   "--name", "tiny")
    try:
        s.wait_ready()
        out = tmp_path / "live.md"
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "gates.py"), "--url", s.url, "--out", str(out),
                            "--only", ("models,chat_probe,reasoning_stream,drafted_equals_serial,"
                                       "concurrent_equals_solo,keepalive,metrics"),
                            "--tokens", "4", "--reason-tokens", "12", "--prompts", "3", "--keepalive-tokens", "600",
                            "--keepalive-after", "0.3", "--timeout", "120"],
                           capture_output=True, text=True, timeout=400, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        rep = out.read_text()
        for name in ("models", "chat_probe", "reasoning_stream", "drafted_equals_serial", "concurrent_equals_solo",
                     "keepalive", "metrics"):
            assert status_of(rep, name) == "pass", rep
        assert "tolerant: no content" not in rep      # the server closes the think block at thinking_budget
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------------ the replay floor
def test_replay_floor_rings_born_poisoned(shared, monkeypatch):
    """The length sweep's bug class (issue 13): a short last chunk at a cut must read only its own sequence's keys.
    Every window ring is born full of garbage, as a ring reused from another request would be; the prompts of every
    length 1..40 (the tiny-a window is 8, so five wraps; compression groups of 2 and 1, top-k 6), cut into chunks of
    5, eight in flight in shuffled order, give the greedy ids each gives alone in one pass with clean rings."""
    import asyncio
    import json
    import random

    import torch

    from dsv41.model.model import Model
    from dsv41.model.state import SeqState
    from dsv41.sched.memory import MemoryBudget, state_cost
    from dsv41.sched.request import Request
    from dsv41.sched.runner import ModelRunner
    from dsv41.sched.sampler import SamplingParams
    from dsv41.sched.scheduler import Scheduler

    ckpt = shared / "vectors/model/tiny-a/checkpoint"
    model = Model.load(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cost = state_cost(cfg.get("text_config", cfg))
    g = torch.Generator().manual_seed(7)
    text = [0] + torch.randint(3, 500, (39,), generator=g).tolist()
    prompts = [text[:n] for n in range(1, 41)]

    def replies(order, chunk, max_streams):
        async def go():
            sched = Scheduler(ModelRunner(model), MemoryBudget(1 << 40, cost), max_streams=max_streams,
                              prefill_chunk=chunk, stall_target_s=0)
            sched.start()
            made = {i: Request(prompts[i], SamplingParams(temperature=0.0), 4, ignore_eos=True) for i in order}
            for i in order:
                sched.submit(made[i])

            async def drain(r):
                async for _ in sched.stream(r):
                    pass
            await asyncio.gather(*[drain(r) for r in made.values()])
            await sched.stop()
            return {i: list(r.output_ids) for i, r in made.items()}
        return asyncio.run(go())

    clean = replies(list(range(len(prompts))), 4096, 1)      # one stream: each prompt alone, in one pass
    born = SeqState.write_window
    poisoned_rings = []

    def write_window(self, layer, new_kv, start, window):
        if layer not in self.windows:         # born full of another "request's" keys
            self.windows[layer] = torch.full((window, new_kv.shape[1]), 1e4, dtype=new_kv.dtype)
            poisoned_rings.append(self.windows[layer])
        return born(self, layer, new_kv, start, window)

    monkeypatch.setattr(SeqState, "write_window", write_window)
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    got = replies(order, 5, 8)
    assert poisoned_rings and any(bool((r == 1e4).any()) for r in poisoned_rings)    # short prompts leave poison
    bad = {len(prompts[i]): (got[i], clean[i]) for i in clean if got[i] != clean[i]}
    assert not bad, f"lengths whose reply read a poisoned slot (got, clean): {bad}"
