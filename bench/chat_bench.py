"""Chat layer speed: render + tokenize long conversations, and stream a long reply through detok + parser.

    python bench/chat_bench.py [--tokens 1000000] [--turns 200] [--tools 30] [--repeat 3]

Prints a table and writes bench/results/chat.md. Cases:
- long: one conversation of about --tokens prompt tokens (user/assistant turns of ~20K tokens each), thinking mode.
- agent: --turns tool rounds (user, assistant with reasoning + a call, tool result) with --tools tools offered.
- reply: a 20K-token reply (reasoning, content, 8 tool calls) fed token by token through the incremental
  detokenizer and the reply parser.
"Chars tokenized / prompt" checks that each message is tokenized at most once per request, on a cold memo (1.00 =
every character went through the BPE exactly once; below 1 when identical runs, such as the DSML glue between
special tokens, are encoded once for the request; specials are looked up, not tokenized).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.chat.parser import ReplyParser  # noqa: E402
from dsv41.chat.policy import build_chat_prompt  # noqa: E402
from dsv41.chat.tokenizer import IncrementalDetokenizer, RunMemo, Tokenizer  # noqa: E402

WORDS = ("the server decodes each token of the window exactly while the expert router picks a kernel for "
         "attention over compressed keys and a draft is verified against the cache 数据 模型 推理 😀 naïve").split()


def text(rng: random.Random, n_words: int) -> str:
    out = []
    for i in range(n_words):
        out.append(rng.choice(WORDS))
        if i % 17 == 16:
            out.append(".\n" if i % 51 == 50 else ",")
    return " ".join(out)


def long_conversation(target_tokens: int, rng: random.Random) -> dict:
    per_msg = 20_000
    msgs = [{"role": "system", "content": "You summarise long documents."}]
    n = max(1, target_tokens // per_msg)
    for k in range(n):
        msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": text(rng, int(per_msg / 1.2))})
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": "Summarise all of it."})
    return {"messages": msgs, "chat_template_kwargs": {"thinking": True}}


def agent_conversation(turns: int, n_tools: int, rng: random.Random) -> dict:
    tools = [{"type": "function", "function": {
        "name": f"tool_{k}", "description": text(rng, 25),
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": text(rng, 8)},
                                                        "limit": {"type": "integer", "minimum": 1}},
                       "required": ["query"]}}} for k in range(n_tools)]
    msgs = [{"role": "system", "content": "You are an agent. " + text(rng, 100)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": text(rng, 30)})
        cid = f"call_{t:04d}"
        msgs.append({"role": "assistant", "content": "", "reasoning_content": text(rng, 60),
                     "tool_calls": [{"id": cid, "type": "function", "function": {
                         "name": f"tool_{t % n_tools}",
                         "arguments": json.dumps({"query": text(rng, 6), "limit": 5})}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": json.dumps({"results": text(rng, 120)})})
    return {"messages": msgs, "tools": tools, "chat_template_kwargs": {"thinking": True}}


class CountingPlain:
    """Wraps the plain BPE to count the characters it is given."""

    def __init__(self, inner):
        self.inner, self.chars = inner, 0

    def encode_batch_fast(self, texts, **kw):
        self.chars += sum(len(t) for t in texts)
        return self.inner.encode_batch_fast(texts, **kw)


def bench_prompt(tok: Tokenizer, req: dict, repeat: int) -> dict:
    specials = set(tok.added.values())
    best = {"cold": 1e9, "warm": 1e9, "ref": 1e9}
    for _ in range(repeat):
        tok.memo = RunMemo()
        t0 = time.perf_counter()
        p = build_chat_prompt(req, tok, shield=True)
        best["cold"] = min(best["cold"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        again = build_chat_prompt(req, tok, shield=True)   # the same conversation re-sent: long runs from the memo
        best["warm"] = min(best["warm"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = build_chat_prompt(req, tok, shield=False)
        best["ref"] = min(best["ref"], time.perf_counter() - t0)
    assert again.token_ids == p.token_ids
    tok.memo = RunMemo()
    counter = CountingPlain(tok.plain)
    tok.__dict__["plain"] = counter
    try:
        build_chat_prompt(req, tok, shield=True)
    finally:
        tok.__dict__["plain"] = counter.inner
    special_chars = sum(len(tok.id_to_text(i)) for i in p.token_ids if i in specials)
    ratio = counter.chars / (len(p.prompt_text) - special_chars)
    return {"tokens": len(p.token_ids), "chars": len(p.prompt_text), "t_cold": best["cold"], "t_warm": best["warm"],
            "t_ref": best["ref"], "ratio": ratio, "same": p.token_ids == ref.token_ids}


def bench_reply(tok: Tokenizer, rng: random.Random) -> dict:
    calls = "".join(f'\n<｜DSML｜ invoke name="tool_{k}">\n<｜DSML｜ parameter name="query" string="true">'
                    f'{text(rng, 200)}</｜DSML｜ parameter>\n<｜DSML｜ parameter name="limit" string="false">{k}'
                    f'</｜DSML｜ parameter>\n</｜DSML｜ invoke>' for k in range(8))
    reply = text(rng, 7000) + "</think>" + text(rng, 5000) + "\n\n<｜DSML｜ calls>" + calls + "\n</｜DSML｜ calls>"
    ids = tok.encode(reply, special=True)
    tools = [{"type": "function", "function": {"name": f"tool_{k}"}} for k in range(8)]
    t0 = time.perf_counter()
    detok, parser, n_deltas = IncrementalDetokenizer(tok), ReplyParser(True, tools), 0
    for i in ids:
        n_deltas += len(parser.feed(detok.push(i)))
    n_deltas += len(parser.feed(detok.finish()))
    deltas, final = parser.finish()
    dt = time.perf_counter() - t0
    assert len(final.tool_calls) == 8
    return {"tokens": len(ids), "seconds": dt, "deltas": n_deltas + len(deltas)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--tools", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/chat.md"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    tok = Tokenizer.builtin()
    tok.plain  # noqa: B018 - build it now, not inside the first timing
    t_load = time.perf_counter() - t0
    rng = random.Random(0)
    rows = []
    for name, req in (("long", long_conversation(args.tokens, rng)),
                      ("agent", agent_conversation(args.turns, args.tools, rng))):
        r = bench_prompt(tok, req, args.repeat)
        rows.append((name, len(req["messages"]), r))
    rep = bench_reply(tok, rng)

    lines = ["| case | messages | prompt tokens | prompt chars | shield, cold (s) | shield, re-sent (s) "
             "| reference ids (s) | M tok/s (cold) | chars tokenized / prompt | shield ids == reference |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, n_msgs, r in rows:
        lines.append(f"| {name} | {n_msgs} | {r['tokens']:,} | {r['chars']:,} | {r['t_cold']:.3f} | "
                     f"{r['t_warm']:.3f} | {r['t_ref']:.3f} | {r['tokens'] / r['t_cold'] / 1e6:.2f} | "
                     f"{r['ratio']:.2f} | {r['same']} |")
    reply_line = (f"Reply streaming: {rep['tokens']:,} tokens fed one by one through IncrementalDetokenizer + "
                  f"ReplyParser (8 tool calls): {rep['seconds']:.3f} s = {rep['tokens'] / rep['seconds']:,.0f} "
                  f"tokens/s, {rep['deltas']:,} deltas.")
    table = "\n".join(lines)
    print(table)
    print(reply_line)
    print(f"tokenizer load (full + plain): {t_load:.2f} s")

    cmd = "python bench/chat_bench.py " + " ".join(sys.argv[1:])
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or 'unknown cpu'}), " \
              f"Python {platform.python_version()}, 1-min load average {os.getloadavg()[0]:.1f} at the end of the " \
              "run (shared machine: figures are upper bounds)"
    body = (f"# Chat layer benchmark\n\nCommand: `{cmd.strip()}`\n\nMachine: {machine}\n\n"
            f"Best of {args.repeat} runs per case; times are the whole request policy (validate, render, tokenize). "
            f"Cold: empty run memo; re-sent: the same conversation again (long messages' ids from the memo, as an "
            f"agent re-sending its history); reference: shield off, one whole-string encode. Chars tokenized / "
            f"prompt: at most 1.00 means no text was tokenized twice in a request (below 1: identical runs once).\n\n"
            f"{table}\n\n{reply_line}\n\nTokenizer load (full + plain BPE): {t_load:.2f} s.\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(body, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
