"""Decode rate through HTTP against the engine's own rate on the same checkpoint, in one run (issue 25: one stream
>= 90 %, 32 streams >= 85 % of the engine-only rate), and the host CPU the server spends per streamed token.

Two phases, the same server flags (`--serve-args`, plus the checkpoint and device) in both:
- HTTP: `python -m dsv41 serve` in a subprocess; for each B in --streams, B streamed greedy chat completions released
  together (ignore_eos, --tokens each), read by B client threads in this process. The server's threads' CPU time
  (/proc/PID/task/*/stat) is read before and after each B: the event loop's (the main thread: HTTP, SSE, the
  scheduler's plan and commit) and the other threads' (the round thread: the forward, the draw), per token.
- engine-only: the same engine built in this process by `load_engine` (the server's own start-up), the same chat
  bodies through `prepare_chat` (the route's own preparation and submit), each reply read from the scheduler's event
  stream: everything the route does but HTTP, SSE and the JSON of the chunks.
Rate: the tokens that arrive while all B replies are decoding (from the last first token to the first last token)
per second of that window: the steady decode rate, without prompt passes or the stragglers' tails.

    python bench/http_rate.py [--checkpoint DIR] [--device cpu|cuda] [--streams 1,32] [--tokens 128]
                              [--serve-args "--no-drafts"] [--out bench/results/serve-cpu-rate.md] [--commit REV]

HTTP first (the server subprocess sizes its memory plan with the GPU to itself), then engine-only; each phase runs
one stream and the most streams once uncounted first (the rounds' graphs are captured at a bucket's first use).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides, part {i}."


def body(i: int, tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT.format(i=i)}], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "chat_template_kwargs": {"thinking": False}}


def warm_up(streams: list[int]) -> list[int]:
    """The passes run first and not counted: one stream and the most streams (the rounds' graphs are captured at
    their first use of a row bucket)."""
    return sorted({1, max(streams)})


def steady_rate(times: list[list[float]]) -> tuple[float, int, float]:
    """(tokens per second, tokens, seconds) inside the window where every reply is decoding."""
    times = [t for t in times if len(t) >= 2]
    if not times:
        return float("nan"), 0, 0.0
    lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
    if hi <= lo:
        return float("nan"), 0, 0.0
    n = sum(sum(1 for x in t if lo < x <= hi) for t in times)
    return n / (hi - lo), n, hi - lo


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process's threads: loop (the main thread: the event loop), round (the
    scheduler's round thread, named dsv41-round by the server: the forward's launches, the table, the draws) and
    other (torch's, the grammar masks', the Engram readers')."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"loop": 0.0, "round": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        kind = "loop" if int(task.name) == pid else "round" if name.startswith("dsv41-round") else "other"
        out[kind] += (int(fields[11]) + int(fields[12])) / tick
    return out


def http_phase(a, streams: list[int]) -> dict[int, dict]:
    port = a.port
    cmd = [sys.executable, "-m", "dsv41", "serve", "--host", "127.0.0.1", "--port", str(port), "--device", a.device,
           *(["--model", a.checkpoint] if a.checkpoint else []), "--max-streams", str(max(streams)),
           *shlex.split(a.serve_args)]
    print("server:", " ".join(cmd), flush=True)
    log = open(a.server_log, "w") if a.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    res: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + a.start_timeout_s
        with httpx.Client(timeout=5.0) as c:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
                try:
                    if c.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the server was not ready in time")
                time.sleep(0.5)
        warm = warm_up(streams)
        for i, b in enumerate(warm + streams):   # warm-up passes first (graph captures, buckets)
            times: list[list[float]] = [[] for _ in range(b)]
            errors: list[str] = []
            barrier = threading.Barrier(b + 1)

            def one(i: int, times=times, errors=errors, barrier=barrier) -> None:
                with httpx.Client(timeout=a.timeout) as c:
                    barrier.wait()
                    try:
                        with c.stream("POST", url + "/v1/chat/completions", json=dict(body(i, a.tokens),
                                                                                         stream=True)) as r:
                            for line in r.iter_lines():
                                if not line.startswith("data: ") or line == "data: [DONE]":
                                    continue
                                obj = json.loads(line[6:])
                                for ch in obj.get("choices") or []:
                                    d = ch.get("delta") or {}
                                    if d.get("content") or d.get("reasoning_content"):
                                        times[i].append(time.perf_counter())
                    except Exception as e:  # noqa: BLE001 - reported in the table
                        errors.append(f"{type(e).__name__}: {e}")
            threads = [threading.Thread(target=one, args=(i,)) for i in range(b)]
            for t in threads:
                t.start()
            cpu0 = thread_cpu(proc.pid)
            barrier.wait()
            w0 = time.perf_counter()
            for t in threads:
                t.join()
            wall = time.perf_counter() - w0
            cpu1 = thread_cpu(proc.pid)
            rate, n, sec = steady_rate(times)
            total = sum(len(t) for t in times)
            if i >= len(warm):
                res[b] = {"rate": rate, "tokens": n, "window": sec, "total": total, "errors": errors,
                          "cpu": {k: cpu1[k] - cpu0[k] for k in cpu0}, "wall": wall}
            print(f"HTTP B={b}: {rate:.1f} tok/s ({n} tokens in {sec:.2f} s), errors {len(errors)}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return res


def engine_phase(a, streams: list[int]) -> dict[int, dict]:
    from dsv41.api.app import prepare_chat
    from dsv41.api.engine import load_engine
    from dsv41.sched.request import TokenEvent
    from dsv41.serve_config import from_env_and_args
    argv = ["--device", a.device, *(["--model", a.checkpoint] if a.checkpoint else []), "--max-streams",
            str(max(streams)), *shlex.split(a.serve_args)]
    eng = load_engine(from_env_and_args(argv, env={}))
    res: dict[int, dict] = {}

    async def go() -> None:
        eng.sched.start()
        warm = warm_up(streams)
        for j, b in enumerate(warm + streams):
            preps = [await prepare_chat(eng, body(i, a.tokens)) for i in range(b)]
            times: list[list[float]] = [[] for _ in range(b)]

            async def drain(i, r):
                async for ev in eng.sched.stream(r):
                    if isinstance(ev, TokenEvent):
                        times[i].append(time.perf_counter())
            t0, cpu0, w0 = time.thread_time(), thread_cpu(os.getpid()), time.perf_counter()
            await asyncio.gather(*[drain(i, p.r) for i, p in enumerate(preps)])
            wall, cpu1 = time.perf_counter() - w0, thread_cpu(os.getpid())
            rate, n, sec = steady_rate(times)
            if j >= len(warm):
                res[b] = {"rate": rate, "tokens": n, "window": sec, "loop_cpu": time.thread_time() - t0,
                          "round_cpu": cpu1["round"] - cpu0["round"], "wall": wall,
                          "total": sum(len(t) for t in times)}
            print(f"engine B={b}: {rate:.1f} tok/s ({n} tokens in {sec:.2f} s)", flush=True)
        await eng.sched.stop()
    try:
        import uvloop
        uvloop.run(go())
    except ImportError:
        asyncio.run(go())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="default: the built-in tiny checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--serve-args", default="--no-drafts", help="more server flags, the same in both phases")
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--server-log", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve-rate-cpu.md"))
    a = ap.parse_args(argv)
    streams = [int(s) for s in a.streams.split(",")]
    http = http_phase(a, streams)
    engine = engine_phase(a, streams)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, check=False).stdout.strip()
    dev = a.device
    if dev == "cuda":
        import torch
        dev = torch.cuda.get_device_name()
    cmd = "python bench/http_rate.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    lines = [f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {commit}", "",
             f"- command: `{cmd}`",
             f"- machine: {platform.node()}, {os.cpu_count()} CPUs, device {dev}; checkpoint "
             f"{a.checkpoint or 'built-in tiny'}; server flags `{a.serve_args}`; {a.tokens} tokens a reply",
             "- rate: tokens per second while every reply of the B decodes (HTTP: content chunks at the client); "
             "CPU: the server's threads per streamed token; round thread busy: its CPU seconds per second of the "
             "pass (near 100 %: the rounds are bound by the round thread's host work, not by the device)", "",
             "| streams | engine-only tok/s | HTTP tok/s | HTTP / engine | loop CPU us/token, HTTP (engine-only) | "
             "round thread CPU us/token, HTTP (engine-only) | round thread busy, HTTP (engine-only) | "
             "other threads' CPU us/token, HTTP | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b in streams:
        h, e = http[b], engine[b]
        per, eper = max(h["total"], 1), max(e["total"], 1)
        lines.append(f"| {b} | {e['rate']:.1f} | {h['rate']:.1f} | {h['rate'] / e['rate']:.0%} | "
                     f"{h['cpu']['loop'] / per * 1e6:.0f} ({e['loop_cpu'] / eper * 1e6:.0f}) | "
                     f"{h['cpu']['round'] / per * 1e6:.0f} ({e['round_cpu'] / eper * 1e6:.0f}) | "
                     f"{h['cpu']['round'] / h['wall']:.0%} ({e['round_cpu'] / e['wall']:.0%}) | "
                     f"{h['cpu']['other'] / per * 1e6:.0f} | {len(h['errors'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    old = out.read_text() if out.exists() else ("# Decode rate through HTTP against the engine's own "
                                                "(bench/http_rate.py, issue 25)\n\n")
    title, _, rest = old.partition("\n\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(title + "\n\n" + text + "\n" + rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
