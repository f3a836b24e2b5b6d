"""Serving on two ranks (`--tp 2`), two processes on this machine over loopback and the shm ring, on the built-in
tiny checkpoint (DSV41_MODEL overrides): the replies equal one rank's, the logits agree within float32 summation
order (rank 0 and rank 1 bitwise: every round's digests are compared), either rank may start first, and a rank that
dies or stops answering ends the streams with an error and stops the other with a line naming it.

Prompt chunks of 16 rows: most prompts span rounds, so some rounds want no logits rows at all.
One torch thread per process: the 2-core box runs up to three servers at once here.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from dsv41.comm.channel import free_lane_port

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--context", "256", "--state-budget-gib", "1", "--prefill-chunk", "16",
          "--shutdown-grace-s", "5", "--name", "tiny"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
if os.environ.get("DSV41_MODEL"):
    COMMON += ["--model", os.environ["DSV41_MODEL"]]

PROMPTS = [[0] + [random.Random(k).randrange(3, 120000) for _ in range(3 + 5 * k)] for k in range(8)]
TOKENS = 5


class Proc:
    """One `python -m dsv41 serve` process (or scripts/serve.sh), its output lines timestamped."""

    def __init__(self, *args: str, script: bool = False, env: dict | None = None):
        cmd = ([str(ROOT / "scripts/serve.sh")] if script else [sys.executable, "-m", "dsv41", "serve"]) + list(args)
        # serve.sh runs the suite's own Python (PYTHON: as it is, no .venv of its own)
        env = {**(env or {}), **({"PYTHON": sys.executable} if script else {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, **ENV, **env),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.url = ""
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))
            m = re.search(r"listening on (http://\S+)", line)
            if m and not self.url:
                self.url = m.group(1)

    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, pattern: str) -> float | None:
        for t, line in self.lines:
            if re.search(pattern, line):
                return t
        return None

    def wait_line(self, pattern: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.first(pattern)
            if t is not None:
                return t
            time.sleep(0.05)
        raise AssertionError(f"no line /{pattern}/ within {timeout} s:\n{self.text()[-3000:]}")

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.text()[-3000:])
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError("server not ready in time:\n" + self.text()[-3000:])

    def stop(self) -> None:
        """SIGTERM the whole process group (a serve.sh and its ranks too), SIGKILL what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)      # followers left behind by a failed test
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def complete(url: str, prompt: list[int], seed: int | None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "logprobs": 3, "return_token_ids": True,
            "ignore_eos": True}
    body.update({"temperature": 0.0} if seed is None else {"temperature": 0.9, "top_p": 0.95, "seed": seed})
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"ids": c["token_ids"], "top": c["logprobs"]["top_logprobs"], "lp": c["logprobs"]["token_logprobs"]}


JOBS = [(p, None) for p in PROMPTS] + [(p, 100 + k) for k, p in enumerate(PROMPTS)]   # greedy, then seeded


def run_jobs(url: str, burst: bool) -> list[dict]:
    if not burst:
        return [complete(url, p, s) for p, s in JOBS]
    with ThreadPoolExecutor(len(JOBS)) as ex:
        return list(ex.map(lambda j: complete(url, *j), JOBS))


@pytest.fixture(scope="module")
def one_rank():
    s = Proc("--port", "0", *COMMON)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@contextlib.contextmanager
def two_rank_server(*args: str, settle_s: float = 2.0, env: dict | None = None):
    """`--tp 2` on this host: rank 1 first (it waits), rank 0 `settle_s` later; yields (rank 0, rank 1) once rank 0
    serves, and stops both on the way out."""
    master = f"127.0.0.1:{free_lane_port()}"
    r1 = Proc("--tp", "2", "--rank", "1", "--master", master, *args, env=env)
    try:
        r1.wait_line(r"waiting for rank 0", 60)
        time.sleep(settle_s)
        r0 = Proc("--tp", "2", "--master", master, "--port", "0", *args, env=env)
        try:
            r0.wait_ready()
            yield r0, r1
        finally:
            r0.stop()
    finally:
        r1.stop()


@pytest.fixture(scope="module")
def two_ranks():
    # the two ranks run their rounds' pieces through the graphs' bookkeeping (emulated on CPU, real on CUDA), the
    # one-rank reference eagerly on CPU: the replies must still be one rank's
    with two_rank_server(*COMMON, env={"DSV41_GRAPHS": "emulate"}) as ranks:
        yield ranks


def test_two_ranks_reply_as_one_alone_and_in_a_burst(one_rank, two_ranks):
    r0, r1 = two_ranks
    want = run_jobs(one_rank.url, burst=False)
    assert all(len(w["ids"]) == TOKENS for w in want)
    assert len({tuple(w["ids"]) for w in want}) > 8          # the prompts and seeds do lead to different replies
    alone = run_jobs(r0.url, burst=False)
    burst = run_jobs(r0.url, burst=True)
    for k, (w, a, b) in enumerate(zip(want, alone, burst)):
        # one rank computes its split products in the two ranks' shards (weights.TP_SHARDS): the same bytes
        assert a == w, f"job {k} alone: tp2 {a['ids']} != tp1 {w['ids']} (or their logprobs differ)"
        assert b == w, f"job {k} in a burst: tp2 {b['ids']} != tp1 {w['ids']} (or their logprobs differ)"
    # rank 1 is alive and every round's digest matched rank 0's (a mismatch is fatal for the lane)
    h = httpx.get(r0.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["rounds_total"] >= 2 * TOKENS
    assert r0.proc.poll() is None and r1.proc.poll() is None
    assert "lane failed" not in r0.text() and "stopping" not in r1.text()


def test_grammar_masks_on_rank_0_only(one_rank, two_ranks):
    """A constrained reply: the mask applies on rank 0; rank 1 digests the same unmasked logits."""
    r0, _ = two_ranks
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a number"}], "max_tokens": 12,
            "temperature": 0, "return_token_ids": True, "chat_template_kwargs": {"thinking": False},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": {"type": "object",
                                                                        "properties": {"n": {"type": "integer"}},
                                                                        "required": ["n"]}}}}
    got = [httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120) for s in (one_rank, r0)]
    assert [g.status_code for g in got] == [200, 200], got[1].text
    ids = [g.json()["choices"][0]["token_ids"] for g in got]
    assert ids[0] == ids[1]
    assert r0.proc.poll() is None


def _stream_until_error(url: str, killer) -> tuple[int, dict | None]:
    """Stream a long reply; call killer() after 3 tokens; return (tokens seen, the error event)."""
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    n, err = 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                err = ev
                break
            n += 1
            if n == 3:
                killer()
    return n, err


def test_rank_1_killed_mid_stream_rank_0_started_first():
    hb = 2.0
    master = f"127.0.0.1:{free_lane_port()}"
    knobs = ["--tp", "2", "--master", master, "--heartbeat-interval-s", "0.25", "--heartbeat-timeout-s", str(hb)]
    r0 = Proc(*knobs, "--port", "0", *COMMON)
    r1 = None
    try:
        r0.wait_line(r"waiting for the other ranks", 60)
        time.sleep(2)
        r1 = Proc(*knobs, "--rank", "1", *COMMON)
        r0.wait_ready()
        killed = []

        def kill():
            r1.proc.send_signal(signal.SIGKILL)
            killed.append(time.monotonic())

        n, err = _stream_until_error(r0.url, kill)
        assert n >= 3 and err is not None, "the stream ended without an error event"
        assert "rank 1" in err["error"]["message"]
        rc = r0.proc.wait(timeout=hb + 20)
        assert rc == 1
        said = r0.first(r"lane failed: rank 1 lost")
        assert said is not None, r0.text()[-2000:]
        # at once when it is in a ring wait (the pid is gone), else by the heartbeat (+ its 50 ms polls, a loaded box)
        assert said - killed[0] < hb + 1.0, f"rank 0 noticed after {said - killed[0]:.1f} s"
    finally:
        r0.stop()
        if r1 is not None:
            r1.stop()


def test_silent_rank_stops_the_other_idle():
    """No request running: rank 1 stopped (SIGSTOP) is found by its process state (--rank-lost-s 1, long before the
    heartbeat timeout); then rank 0 dead stops rank 1."""
    hb = 30.0                   # the heartbeat alone would take this long
    master = f"127.0.0.1:{free_lane_port()}"
    knobs = ["--tp", "2", "--master", master, "--heartbeat-interval-s", "0.25", "--heartbeat-timeout-s", str(hb)]
    r1 = Proc(*knobs, "--rank", "1", *COMMON)
    r0 = Proc(*knobs, "--port", "0", *COMMON)
    r1b = r0b = None
    try:
        r0.wait_ready()
        assert complete(r0.url, PROMPTS[0], None)["ids"]
        r1.proc.send_signal(signal.SIGSTOP)
        t = time.monotonic()
        assert r0.proc.wait(timeout=hb + 20) == 1
        said = r0.first(r"lane failed: rank 1 lost: its process \d+ is stopped")
        assert said is not None and said - t < 2.0, r0.text()[-2000:]
        r1.proc.send_signal(signal.SIGKILL)
        # the other way round: rank 0 killed, rank 1 exits naming it
        master = f"127.0.0.1:{free_lane_port()}"
        knobs[3] = master
        r1b = Proc(*knobs, "--rank", "1", *COMMON)
        r0b = Proc(*knobs, "--port", "0", *COMMON)
        r0b.wait_ready()
        r1b.wait_line(r"ready", 60)
        r0b.proc.send_signal(signal.SIGKILL)
        assert r1b.proc.wait(timeout=hb + 20) == 1
        assert re.search(r"rank 1 of 2: stopping after \d+ rounds: rank 0 lost", r1b.text()), r1b.text()[-2000:]
    finally:
        for p in (r0, r1, r0b, r1b):
            if p is not None:
                if p.proc.poll() is None:
                    p.proc.send_signal(signal.SIGCONT)
                p.stop()


def test_serve_sh_tp2_starts_both_ranks_and_stops_them(one_rank):
    master = f"127.0.0.1:{free_lane_port()}"
    s = Proc("--tp", "2", "--master", master, "--port", "0", *COMMON, script=True)
    try:
        s.wait_ready()
        assert complete(s.url, PROMPTS[2], None)["ids"] == complete(one_rank.url, PROMPTS[2], None)["ids"]
        os.kill(s.proc.pid, signal.SIGTERM)            # the script only: it stops rank 0, rank 0 stops rank 1
        assert s.proc.wait(timeout=40) == 143
        s.wait_line(r"rank 1 of 2: rank 0 shut down", 10)
        out = subprocess.run(["pgrep", "-f", master], check=False, capture_output=True, text=True).stdout.split()
        assert out == [], f"ranks left running: {out}"
    finally:
        s.stop()


def _rank_pid(master: str, rank: int) -> int:
    out = subprocess.run(["pgrep", "-f", f"{master}.*--rank {rank}"], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def _health_503_after(url: str, t0: float, limit: float) -> tuple[float, str]:
    """Seconds from t0 until /health answers 503 (polled every 20 ms), and its body."""
    while time.monotonic() - t0 < limit:
        r = httpx.get(url + "/health", timeout=2)
        if r.status_code == 503:
            return time.monotonic() - t0, r.text
        assert r.status_code == 200
        time.sleep(0.02)
    raise AssertionError(f"/health did not turn 503 within {limit} s")


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_serve_sh_rank_1_killed_or_stopped_while_idle(sig):
    """Issue 27: rank 1 killed or stopped while nothing runs (heartbeat timeout 30 s, so only the process watch can
    see it in time): /health answers 503 naming rank 1 within 2 s, and serve.sh exits non-zero, the stopped rank
    taken down within --kill-grace-s of rank 0's exit (SIGTERM + SIGCONT), no rank process left."""
    grace = 4.0
    master = f"127.0.0.1:{free_lane_port()}"
    s = Proc("--tp", "2", "--master", master, "--port", "0", *COMMON, "--no-drafts", "--heartbeat-timeout-s", "30",
             "--kill-grace-s", str(grace), script=True, env={"PYTHON": sys.executable})
    pid = None
    try:
        s.wait_ready()
        assert complete(s.url, PROMPTS[0], None)["ids"]          # served, then idle
        pid = _rank_pid(master, 1)
        time.sleep(0.5)
        os.kill(pid, getattr(signal, sig))
        t0 = time.monotonic()
        took, body = _health_503_after(s.url, t0, 5)
        assert took < 2.0, took
        assert f"rank 1 lost: its process {pid} " in body, body
        rc = s.proc.wait(timeout=grace + 30)
        ended = time.monotonic() - t0
        assert rc != 0, s.text()[-2000:]
        r0_exit = s.first(r"Finished server process")
        assert r0_exit is not None, s.text()[-2000:]
        assert time.monotonic() - r0_exit < grace + 1 and ended < 2.0 + 5 + grace, (ended, s.text()[-2000:])
        left = subprocess.run(["pgrep", "-f", master], capture_output=True, text=True).stdout.split()
        assert left == [], f"ranks left running: {left}"
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        s.stop()


def test_rank_1_stopped_mid_stream_ends_the_stream_naming_it():
    """Busy: rank 0 waits in a ring collective for a stopped rank 1; the watch's verdict ends that wait, the stream
    gets an error event naming rank 1 within 2 s (heartbeat timeout 30 s)."""
    master = f"127.0.0.1:{free_lane_port()}"
    knobs = ["--tp", "2", "--master", master, "--heartbeat-timeout-s", "30", "--no-drafts"]
    r1 = Proc(*knobs, "--rank", "1", *COMMON)
    r0 = Proc(*knobs, "--port", "0", *COMMON)
    stopped = []
    try:
        r0.wait_ready()

        def stop():
            r1.proc.send_signal(signal.SIGSTOP)
            stopped.append(time.monotonic())

        n, err = _stream_until_error(r0.url, stop)
        took = time.monotonic() - stopped[0]
        assert err is not None and "rank 1 lost: its process" in err["error"]["message"], err
        assert took < 2.5, took
        assert r0.proc.wait(timeout=30) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            r1.proc.send_signal(signal.SIGCONT)
        r0.stop()
        r1.stop()


def test_kept_states_resume_on_both_ranks(one_rank, two_ranks):
    """A second turn resumes from the state kept after the first (RestoreState runs on both ranks): same tokens as
    one rank, and rank 1 agrees (the lane stays up)."""
    r0, r1 = two_ranks
    turn = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour."}]

    def chat(url, messages):
        body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "chat_template_kwargs": {"thinking": False}}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["choices"][0], j["usage"]["prompt_tokens_details"]["cached_tokens"]

    for url in (one_rank.url, r0.url):
        first, _ = chat(url, turn)
        nxt = turn + [{"role": "assistant", "content": first["message"]["content"]},
                      {"role": "user", "content": "Another one."}]
        second, cached = chat(url, nxt)
        if url == one_rank.url:
            want = (first["token_ids"], second["token_ids"])
        else:
            assert (first["token_ids"], second["token_ids"]) == want
            assert cached > 0, "the second turn did not resume from a kept state"
    assert r0.proc.poll() is None and r1.proc.poll() is None
