"""Benchmark any OpenAI-compatible server the way the reference recipe's kit_bench.py does (anchors.md §2.1).

    python bench/serve_bench.py --url http://127.0.0.1:8000 [--model ID] [--out bench/results/serve-cpu.md]

Sections (each streamed, greedy, thinking off, `ignore_eos` so replies run to max_tokens):
- single: per prompt a short warm-up, then --reps streamed reps; tok/s = (completion tokens - 1) / (last - first
  content chunk time); the median over reps and prompts;
- concurrent N: N requests released together (a barrier); aggregate tok/s = all tokens / wall;
- sustained N: exactly N in flight for --sustain-s seconds, a new request as each ends; per-stream tok/s p50/p95/p05
  and TTFT p50/p95;
- prefill L: a fresh `Session <8 numbers>` + filler words cut to exactly L prompt tokens (via /tokenize when the
  server has it), 1-token completion; tok/s = L / TTFT;
- behind L: a short request's TTFT while an L-token prompt fills, and the longest gap between tokens of a reply that
  was already running when the long prompt arrived (the worst stall).

Prints a table and writes a markdown file with the command, the machine and the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a Python class implementing an LRU cache with a time-to-live for each entry, with unit tests.",
    "Write an essay of about 400 words on how the printing press changed Europe.",
    "Count from 1 to 200, separated by commas.",
]
FILLER = ("river stone garden window paper light music table orange forest number silver market winter cloud "
          "bridge candle mirror story letter").split()


class Client:
    def __init__(self, url: str, model: str | None, key: str | None, timeout: float):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(timeout=timeout, headers=self.headers)
        self.model = model or self._first_model()
        self.has_tokenize = self._probe_tokenize()

    def _first_model(self) -> str:
        r = self.http.get(self.url + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def _probe_tokenize(self) -> bool:
        try:
            r = self.http.post(self.url + "/tokenize", json={"model": self.model, "prompt": "hi"})
            return r.status_code == 200 and "tokens" in r.json()
        except httpx.HTTPError:
            return False

    def tokenize(self, text: str) -> list[int]:
        r = self.http.post(self.url + "/tokenize", json={"model": self.model, "prompt": text,
                                                         "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"]

    def stream(self, body: dict, path: str = "/v1/chat/completions") -> dict:
        """Send a streamed request; return times of the first/last content chunk, token count, ttft, gaps."""
        body = dict(body, model=self.model, stream=True, stream_options={"include_usage": True})
        t0 = time.perf_counter()
        times: list[float] = []
        usage = None
        with httpx.Client(timeout=self.http.timeout, headers=self.headers) as http:
            with http.stream("POST", self.url + path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        raise RuntimeError(f"stream error: {obj['error']}")
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for ch in obj.get("choices") or []:
                        d = ch.get("delta") or {}
                        text = d.get("content") or d.get("reasoning_content") or ch.get("text")
                        if text:
                            times.append(time.perf_counter())
        n = usage["completion_tokens"] if usage else len(times)
        return {"t0": t0, "first": times[0] if times else None, "last": times[-1] if times else None,
                "tokens": n, "prompt_tokens": usage["prompt_tokens"] if usage else None,
                "ttft": (times[0] - t0) if times else None,
                "gaps": [b - a for a, b in zip(times, times[1:])], "times": times}


def chat_body(prompt: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "chat_template_kwargs": {"thinking": False}}


def decode_rate(res: dict) -> float | None:
    if res["first"] is None or res["last"] is None or res["last"] <= res["first"] or res["tokens"] < 2:
        return None
    return (res["tokens"] - 1) / (res["last"] - res["first"])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def run_parallel(fn, n: int) -> list:
    barrier = threading.Barrier(n)
    out: list = [None] * n

    def work(i):
        barrier.wait()
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[i] = e

    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def bench_single(c: Client, tokens: int, reps: int) -> dict:
    rates = []
    for p in PROMPTS:
        c.stream(chat_body(p, 8))
        for _ in range(reps):
            r = decode_rate(c.stream(chat_body(p, tokens)))
            if r:
                rates.append(r)
    return {"tok_s": statistics.median(rates) if rates else float("nan"), "n": len(rates)}


def bench_concurrent(c: Client, n: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    res = run_parallel(lambda i: c.stream(chat_body(PROMPTS[i % 3] + f" (variant {i})", tokens)), n)
    wall = time.perf_counter() - t0
    ok = [r for r in res if isinstance(r, dict)]
    total = sum(r["tokens"] for r in ok)
    return {"agg_tok_s": total / wall, "ok": len(ok), "n": n, "wall_s": wall,
            "errors": [str(r) for r in res if not isinstance(r, dict)][:3]}


def bench_sustained(c: Client, n: int, tokens: int, seconds: float) -> dict:
    stop_at = time.perf_counter() + seconds
    results: list[dict] = []
    lock = threading.Lock()
    counter = [0]

    def worker(_):
        while time.perf_counter() < stop_at:
            with lock:
                counter[0] += 1
                k = counter[0]
            r = c.stream(chat_body(PROMPTS[k % 3] + f" (request {k})", tokens))
            with lock:
                results.append(r)
        return None

    t0 = time.perf_counter()
    run_parallel(worker, n)
    wall = time.perf_counter() - t0
    rates = [x for x in (decode_rate(r) for r in results) if x]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    total = sum(r["tokens"] for r in results)
    return {"agg_tok_s": total / wall, "p50": pct(rates, 0.5), "p95": pct(rates, 0.95), "p05": pct(rates, 0.05),
            "ttft_p50": pct(ttfts, 0.5), "ttft_p95": pct(ttfts, 0.95), "requests": len(results)}


def long_prompt(c: Client, n_tokens: int, rng: random.Random) -> str:
    salt = "Session " + " ".join(str(rng.randint(0, 99)) for _ in range(8)) + ". "
    words = " ".join(rng.choice(FILLER) for _ in range(n_tokens + 16))
    text = salt + words
    if c.has_tokenize:
        ids = c.tokenize(text)
        if len(ids) >= n_tokens:     # cut at a word boundary near L, then trim by tokens through the server
            lo, hi = 0, len(text)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if len(c.tokenize(text[:mid])) <= n_tokens:
                    lo = mid
                else:
                    hi = mid - 1
            text = text[:lo]
    return text


def bench_prefill(c: Client, n_tokens: int, rng: random.Random) -> dict:
    text = long_prompt(c, n_tokens, rng)
    r = c.stream({"prompt": text, "max_tokens": 1, "temperature": 0, "ignore_eos": True}, path="/v1/completions")
    L = r["prompt_tokens"] or n_tokens
    return {"prompt_tokens": L, "ttft_s": r["ttft"], "tok_s": L / r["ttft"] if r["ttft"] else float("nan")}


def bench_behind(c: Client, n_tokens: int, rng: random.Random, running_tokens: int) -> dict:
    """A reply decoding, then an L-token prompt arrives, then a short request: the short TTFT and the reply's worst
    gap between tokens while the prompt fills."""
    text = long_prompt(c, n_tokens, rng)
    out: dict = {}

    def running():
        out["running"] = c.stream(chat_body("Count from 1 to 500.", running_tokens))

    def longp():
        out["long"] = c.stream({"prompt": text, "max_tokens": 1, "temperature": 0, "ignore_eos": True},
                               path="/v1/completions")

    def short():
        out["short"] = c.stream(chat_body("Say hi.", 4))

    t_run = threading.Thread(target=running)
    t_run.start()
    time.sleep(0.5)
    t_long = threading.Thread(target=longp)
    t_long.start()
    time.sleep(0.05)
    t_short = threading.Thread(target=short)
    t_short.start()
    for t in (t_short, t_long, t_run):
        t.join()
    lo = out["long"]
    # gaps of the running reply that overlap the long prompt's fill window
    fill_end = lo["first"] or lo["t0"]
    times = out["running"]["times"]
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= lo["t0"] and a <= fill_end]
    return {"prompt_tokens": lo["prompt_tokens"], "long_ttft_s": lo["ttft"], "short_ttft_s": out["short"]["ttft"],
            "worst_stall_s": max(gaps) if gaps else float("nan"),
            "median_gap_s": statistics.median(out["running"]["gaps"]) if out["running"]["gaps"] else float("nan")}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=5).stdout.strip().replace("\n", ", ")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores" + (f", GPU {gpu}" if gpu else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--tokens", type=int, default=128, help="reply tokens in single/concurrent/sustained")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrent", default="2,4,8", help="comma-separated N")
    ap.add_argument("--sustained", type=int, default=4, help="N in flight (0 = skip)")
    ap.add_argument("--sustain-s", type=float, default=30.0)
    ap.add_argument("--prefill", default="512,2048", help="comma-separated prompt lengths")
    ap.add_argument("--behind", type=int, default=4096, help="long prompt length for the TTFT-behind probe (0=skip)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default="bench/results/serve-cpu.md")
    ap.add_argument("--note", default="", help="a line for the results file (what was served, how)")
    a = ap.parse_args(argv)

    c = Client(a.url, a.model, a.api_key, a.timeout)
    rng = random.Random(20261004)
    rows: list[tuple[str, str]] = []

    def add(name: str, text: str) -> None:
        rows.append((name, text))
        print(f"{name:<24} {text}", flush=True)

    print(f"serve_bench: {a.url} model {c.model}", flush=True)
    s = bench_single(c, a.tokens, a.reps)
    add("single stream", f"{s['tok_s']:.1f} tok/s (median of {s['n']}, {a.tokens} tokens)")
    for n in [int(x) for x in a.concurrent.split(",") if x]:
        r = bench_concurrent(c, n, a.tokens)
        err = f"; errors: {r['errors']}" if r["errors"] else ""
        add(f"concurrent {n}", f"{r['agg_tok_s']:.1f} tok/s aggregate ({r['ok']}/{r['n']} ok, "
                               f"{r['wall_s']:.1f} s){err}")
    if a.sustained:
        r = bench_sustained(c, a.sustained, a.tokens, a.sustain_s)
        add(f"sustained {a.sustained} x {a.sustain_s:g} s",
            f"{r['agg_tok_s']:.1f} tok/s aggregate; per stream p50 {r['p50']:.1f} / p95 {r['p95']:.1f} / p05 "
            f"{r['p05']:.1f}; TTFT p50 {r['ttft_p50']:.3f} s / p95 {r['ttft_p95']:.3f} s ({r['requests']} requests)")
    for L in [int(x) for x in a.prefill.split(",") if x]:
        r = bench_prefill(c, L, rng)
        add(f"prefill {L}", f"{r['tok_s']:.0f} tok/s ({r['prompt_tokens']} tokens, TTFT {r['ttft_s']:.3f} s)")
    if a.behind:
        r = bench_behind(c, a.behind, rng, max(64, a.tokens))
        add(f"behind {a.behind}", f"short TTFT {r['short_ttft_s']:.3f} s while a {r['prompt_tokens']}-token prompt "
                                  f"fills (its TTFT {r['long_ttft_s']:.3f} s); running reply worst stall "
                                  f"{r['worst_stall_s']:.3f} s (median gap {r['median_gap_s']:.3f} s)")

    cmd = "python " + shlex.join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    lines = [f"# serve_bench: {c.model}", "", f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- command: `{cmd}`", f"- server: {a.url}", f"- machine: {machine()}"]
    if a.note:
        lines.append(f"- note: {a.note}")
    lines += ["", "| measure | result |", "|---|---|"] + [f"| {n} | {t} |" for n, t in rows]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
