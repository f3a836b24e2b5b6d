"""Grammar mask time against the server's decode round time, at batch 1 and batch 32 (issue 5).

    python bench/grammar_round_bench.py                          # starts a server on the built-in tiny checkpoint
    python bench/grammar_round_bench.py --url http://127.0.0.1:8000 --model NAME
    python bench/grammar_round_bench.py --out bench/results/grammar-round-h200.md

Two figures per batch size B, for the large schema of bench/grammar_bench.py (48 required properties):
- mask: `fill_masks` of B matchers at their own positions along seeded random replies (grammar_bench.walk), timed
  here in-process, per round and per token. The server's runner does exactly this once per round for its
  constrained rows (dsv41/sched/runner.py), on rank 0, before the draw.
- round: the live server's decode round, measured from the streamed tokens of B chat streams sent at once
  (max_tokens N, greedy): the gap between a stream's consecutive tokens is one round. Once with B unconstrained
  streams (ignore_eos), once with B streams constrained by the same schema (`response_format` json_schema). The
  difference of the medians is what grammar costs a round on the server (mask + consume + apply + bookkeeping).
The server's /metrics counters (rounds, tokens) over each burst are printed as a cross-check.
Figures on a shared host are noisy: the machine line says how many CPUs there were and the load.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx
from grammar_bench import EOS, large_schema, pct, walk

from dsv41.grammar import allocate_bitmask, compile_request, fill_masks, llg_tokenizer

NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def mask_times(spec, seqs: list[list[int]], batch: int) -> list[float]:
    """µs of each full round of `fill_masks` over `batch` matchers, each at its own position along its reply."""
    ms = [spec.matcher() for _ in range(batch)]
    bm = allocate_bitmask(batch)
    out = []
    for k in range(min(len(s) for s in seqs[:batch])):
        t0 = time.perf_counter()
        fill_masks(ms, bm)
        out.append((time.perf_counter() - t0) * 1e6)
        for i, m in enumerate(ms):
            assert m.consume(seqs[i][k]), m.error
    return out


async def stream_gaps(http: httpx.AsyncClient, body: dict) -> tuple[list[float], int, str]:
    """Seconds between consecutive content chunks of one chat stream (the server sends a chunk per drawn token,
    holding back only a split UTF-8 character), the token count (the final chunk's token_ids) and the finish
    reason."""
    times: list[float] = []
    finish, ntok = "", 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if not obj.get("choices"):
                continue
            c = obj["choices"][0]
            if c.get("delta", {}).get("content"):
                times.append(time.perf_counter())
            if c.get("token_ids"):
                ntok = len(c["token_ids"])
            finish = c.get("finish_reason") or finish
    return [t1 - t0 for t0, t1 in itertools.pairwise(times)], ntok, finish


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {k: float(v) for k, v in re.findall(r"^dsv41:(decode_rounds_total|generation_tokens_total) (\S+)$",
                                                text, re.MULTILINE)}


PROMPT = "Fill in the invoice record."


def prompt_len(url: str, body: dict) -> int:
    return httpx.post(url + "/tokenize", json={k: body[k] for k in ("messages", "response_format", *NO_THINK)
                                               if k in body}, timeout=60).json()["count"]


def padded_to(url: str, target: int) -> list[dict]:
    """Unconstrained messages as long as the constrained prompt (which carries the schema): a decode round's cost
    grows with the context, so the comparison holds the prompt length equal."""
    k = 0
    for _ in range(4):
        msgs = [{"role": "user", "content": PROMPT + " x" * k}]
        n = prompt_len(url, {"messages": msgs, **NO_THINK})
        if n == target:
            break
        k += target - n
    return msgs


async def burst(url: str, model: str, batch: int, tokens: int, schema: dict | None, target: int = 0) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens, "temperature": 0, "stream": True, "return_token_ids": True, **NO_THINK}
    if schema is None:
        body["ignore_eos"] = True
        body["messages"] = padded_to(url, target) if target else body["messages"]
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    plen = prompt_len(url, body)
    before = metrics(url)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=batch + 4)) as http:
        res = await asyncio.gather(*(stream_gaps(http, body) for _ in range(batch)))
    wall = time.perf_counter() - t0
    after = metrics(url)
    # each stream's median gap is its round time in steady state (the first gaps hold the others' prefills)
    per_stream = [statistics.median(g) for g, _, _ in res if g]
    gaps = [x for g, _, _ in res for x in g]
    return {"round_ms": statistics.median(per_stream) * 1e3, "p90_ms": pct(gaps, 0.9) * 1e3,
            "tokens": sum(n for _, n, _ in res), "finish": sorted({f for _, _, f in res}), "wall_s": wall,
            "prompt": plen, "rounds": after.get("decode_rounds_total", 0) - before.get("decode_rounds_total", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="", help="a running server; empty = start one on the built-in tiny checkpoint")
    ap.add_argument("--model", default="tiny", help="model id to send")
    ap.add_argument("--fields", type=int, default=48)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens of each stream")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar-round-cpu.md"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import tokenizers
    hf = tokenizers.Tokenizer.from_file(str(ROOT / "kit" / "tokenizer" / "tokenizer.json"))
    llg_tokenizer(hf)
    schema = large_schema(args.fields)
    spec = compile_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "big", "schema": schema, "strict": True}}}, hf, None, False)
    closers = [[EOS]] + [hf.encode(t, add_special_tokens=False).ids for t in ('"', "@", "a", "}", "]")]
    seqs = [walk(spec, closers, seed) for seed in range(max(batches))]

    server = None
    url = args.url.rstrip("/")
    if not url:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_server import LiveServer
        server = LiveServer("--context", "4096", "--state-budget-gib", "4", "--max-streams", str(max(batches)),
                            "--name", args.model)
        server.wait_ready()
        url = server.url
    try:
        info = httpx.get(url + "/health", timeout=30).json() if server is None else {}
        rows = []
        for b in batches:
            mask = mask_times(spec, seqs, b)
            cons = asyncio.run(burst(url, args.model, b, args.tokens, schema))
            free = asyncio.run(burst(url, args.model, b, args.tokens, None, target=cons["prompt"]))
            mask_ms = statistics.median(mask) / 1e3
            extra = cons["round_ms"] - free["round_ms"]
            rows.append((b, mask_ms, mask_ms / b * 1e3, pct(mask, 0.9) / 1e3, free, cons, extra))
            print(f"batch {b}: mask {mask_ms:.2f} ms/round; round {free['round_ms']:.1f} ms unconstrained, "
                  f"{cons['round_ms']:.1f} ms constrained ({cons['tokens']} tokens, finish {cons['finish']})")
    finally:
        if server is not None:
            server.stop()

    import llguidance
    import torch
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f}; "
               f"torch {torch.__version__}; llguidance {llguidance.__version__}; "
               f"server {'started here: built-in tiny checkpoint, --device auto' if server else f'{url} {info}'}; "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    head = ("| batch | mask / round (in-process) | mask / token | mask p90 / round | round, unconstrained | "
            "round, constrained | constrained - unconstrained | mask share of constrained round | "
            "prompt tokens | rounds counted (/metrics, free / constrained) |")
    lines = []
    for b, mask_ms, mask_tok_us, mask_p90, free, cons, extra in rows:
        lines.append(f"| {b} | {mask_ms:.2f} ms | {mask_tok_us:.0f} µs | {mask_p90:.2f} ms | "
                     f"{free['round_ms']:.1f} ms (p90 {free['p90_ms']:.1f}) | "
                     f"{cons['round_ms']:.1f} ms (p90 {cons['p90_ms']:.1f}) | {extra:+.1f} ms | "
                     f"{100 * mask_ms / cons['round_ms']:.2f}% | {free['prompt']} / {cons['prompt']} | {free['rounds']:.0f} / {cons['rounds']:.0f} |")
    title = f"Grammar mask vs decode round: {args.fields}-property schema, {args.tokens}-token streams"
    print(title)
    print(machine)
    print(head)
    print("\n".join(lines))
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    md = [f"# {title}", "", f"Command: `{cmd}`", "", f"Machine: {machine}", "", head,
          "|" + "---|" * (head.count("|") - 1)] + lines
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(md) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
