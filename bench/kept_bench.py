"""Kept prompt states: TTFT per turn of an agent conversation, with and without kept states.

    python bench/kept_bench.py                                   # starts two built-in tiny servers itself
    python bench/kept_bench.py --url URL --cold-url URL2         # any two servers: URL keeps states, URL2 none

An 8-turn conversation (a long system prompt, 20 tools, thinking off, greedy) goes to both servers turn by turn;
each turn appends the reply (its content, or its tool call with a tool result) and a new user message. Per turn it
records the prompt length, `usage.prompt_tokens_details.cached_tokens`, the TTFT (request sent -> first streamed
delta) on each server and whether both replies have the same token ids. Prints a table and writes
bench/results/kept-cpu.md (--out) with the command, the machine and the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

SYSTEM = ("You are the operations agent of a large logistics company. You plan shipments, answer questions about "
          "inventory, schedules and customs, and you call the tools below whenever a fact must be looked up rather "
          "than guessed. Always state which warehouse, carrier and date you mean. Never invent tracking numbers. ")
TOOL_NAMES = ["get_inventory", "get_shipment", "list_carriers", "quote_rate", "book_pickup", "cancel_pickup",
              "get_weather", "customs_status", "hs_code_lookup", "currency_convert", "warehouse_hours",
              "driver_schedule", "route_plan", "fuel_price", "port_congestion", "invoice_lookup", "create_ticket",
              "update_ticket", "send_email", "calendar_slot"]
QUESTIONS = ["How many pallets of item A-113 are in the Rotterdam warehouse?",
             "Book a pickup for those pallets tomorrow morning.",
             "Which carriers serve Rotterdam to Lyon this week?",
             "Quote the cheapest of them for 12 pallets.",
             "Is there congestion at the port of Antwerp today?",
             "Convert that quote to US dollars.",
             "Open a ticket so finance can check the invoice.",
             "Summarise everything we decided in three lines."]


def tools() -> list[dict]:
    out = []
    for i, name in enumerate(TOOL_NAMES):
        out.append({"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ')}: looks up or changes record type {i} in the "
                                         f"company systems; returns JSON.",
            "parameters": {"type": "object", "properties": {
                "id": {"type": "string", "description": "the record id"},
                "site": {"type": "string", "description": "warehouse or port code"},
                "date": {"type": "string", "description": "ISO date"}}, "required": ["id"]}}})
    return out


class Server:
    def __init__(self, *args: str):
        cmd = [sys.executable, "-m", "dsv41", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.url = ""
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and not self.url:
                self.url = m.group(1)

    def wait_ready(self, timeout=600):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.lines[-30:]))
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError("server not ready")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def turn(url: str, model: str, messages: list, max_tokens: int, salt: str) -> dict:
    """One streamed request: TTFT (first delta), token ids, cached tokens, the assistant message to append."""
    body = {"model": model, "messages": messages, "tools": tools(), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "chat_template_kwargs": {"thinking": False}, "cache_salt": salt}
    t0 = time.perf_counter()
    ttft = None
    content, calls, ids, usage = "", {}, None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if "error" in j:
                raise RuntimeError(j["error"])
            if j.get("usage"):
                usage = j["usage"]
            for c in j.get("choices", []):
                d = c.get("delta", {})
                if ttft is None and (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")):
                    ttft = time.perf_counter() - t0
                content += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    k = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                                       "function": {"name": "", "arguments": ""}})
                    k["function"]["name"] += tc.get("function", {}).get("name") or ""
                    k["function"]["arguments"] += tc.get("function", {}).get("arguments") or ""
                if "token_ids" in c:
                    ids = c["token_ids"]
    if ttft is None:                      # a reply with no text (e.g. EOS at once): the end is the first token
        ttft = time.perf_counter() - t0
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    elif not content:
        msg["content"] = "ok"
    return {"ttft": ttft, "ids": ids, "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt": usage["prompt_tokens"], "msg": msg}


def machine() -> str:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node() or 'host'}: {cpu or platform.processor()}, {os.cpu_count()} cores"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="server that keeps states (default: start the built-in tiny one)")
    ap.add_argument("--cold-url", help="server that keeps none (default: start one with --prompt-cache-gib 0)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-repeat", type=int, default=12, help="copies of the system paragraph (its length)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench/results/kept-cpu.md"))
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    started = []
    try:
        url, cold = a.url, a.cold_url
        if url is None:
            started.append(Server("--prompt-cache-gib", "1"))
        if cold is None:
            started.append(Server("--prompt-cache-gib", "0"))
        for s in started:
            s.wait_ready()
        it = iter(started)
        url = url or next(it).url
        cold = cold or next(it).url
        model = a.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        salt = f"bench-{time.time_ns()}"
        msgs = [{"role": "system", "content": SYSTEM * a.system_repeat}]
        rows = []
        print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT kept s':>12} {'TTFT cold s':>12} {'same ids':>9}")
        for t in range(a.turns):
            msgs.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            k = turn(url, model, msgs, a.max_tokens, salt)
            c = turn(cold, model, msgs, a.max_tokens, salt)
            row = (t + 1, k["prompt"], k["cached"], k["ttft"], c["ttft"], k["ids"] == c["ids"])
            rows.append(row)
            print(f"{row[0]:>4} {row[1]:>7} {row[2]:>7} {row[3]:>12.3f} {row[4]:>12.3f} {str(row[5]):>9}", flush=True)
            msgs.append(k["msg"])
            for call in k["msg"].get("tool_calls") or []:
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"ok": True})})
        metrics = httpx.get(url + "/metrics", timeout=30).text
        kept_lines = [ln for ln in metrics.splitlines() if ln.startswith("dsv41:kept_")]
    finally:
        for s in started:
            s.stop()
    resumed = sum(1 for r in rows[1:] if r[2] > 0)
    same = sum(1 for r in rows if r[5])
    cmd = "python bench/kept_bench.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    lines = ["# kept_bench: TTFT per turn with and without kept prompt states", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- command: `{cmd}`",
             f"- servers: kept {'(started: ' + ' '.join(started[0].cmd[2:]) + ')' if a.url is None else url}; "
             f"cold {cold if a.cold_url else '(started with --prompt-cache-gib 0)'}",
             f"- machine: {machine()}",
             f"- conversation: {a.turns} turns, system prompt = {a.system_repeat} x {len(SYSTEM)} chars, "
             f"{len(TOOL_NAMES)} tools, thinking off, greedy, max_tokens {a.max_tokens}",
             f"- resumed turns after the first: {resumed}/{a.turns - 1}; replies equal kept vs cold: {same}/{a.turns}"]
    if a.note:
        lines.append(f"- note: {a.note}")
    lines += ["", "| turn | prompt tokens | cached tokens | TTFT kept (s) | TTFT cold (s) | same ids |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {'yes' if r[5] else 'NO'} |" for r in rows]
    lines += ["", "Kept-state metrics of the kept server at the end:", "", "```", *kept_lines, "```", ""]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines))
    print(f"wrote {a.out}")
    return 0 if resumed == a.turns - 1 and same == a.turns else 1


if __name__ == "__main__":
    sys.exit(main())
