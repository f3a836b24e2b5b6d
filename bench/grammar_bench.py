"""Grammar mask cost per token for a large JSON schema, at batch 1 and batch 32 (dsv41/grammar).

    python bench/grammar_bench.py                       # -> bench/results/grammar.md
    python bench/grammar_bench.py --out bench/results/grammar-h200.md

What is timed (llguidance via dsv41.grammar, the V4.1 tokenizer from kit/):
- compile: `compile_request` for the schema (grammar build + validation + the prototype matcher);
- first mask: the first `fill_masks` of a fresh matcher (the lexer's initial work; upstream does it at admission);
- mask: `fill_masks` per decode round along replies made by a seeded random walk (every step picks a random allowed
  token, then closing tokens after a while), one sequence (batch 1) and 32 sequences at their own positions
  (batch 32; a round masks all live rows at once, the cost per token is the round over its rows);
- consume: `Matcher.consume` per token; apply: `apply_mask` of [rows, 129280] float32 logits (CPU, and CUDA when
  present).
Figures on a shared host are noisy: the machine line says how many CPUs there were and the load.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

from dsv41.grammar import allocate_bitmask, apply_mask, compile_request, fill_masks, llg_tokenizer

EOS = 1


def large_schema(fields: int = 48) -> dict:
    """A closed object of `fields` required properties cycling through real-world shapes."""
    defs = {"address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                        "properties": {"street": {"type": "string", "maxLength": 40},
                                       "city": {"type": "string", "maxLength": 30},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}
    shapes = [
        {"type": "string", "maxLength": 60},
        {"type": "integer", "minimum": 0, "maximum": 100000},
        {"enum": ["draft", "open", "paid", "void", "refunded"]},
        {"type": "string", "format": "date-time"},
        {"$ref": "#/$defs/address"},
        {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                           "price": {"type": "number", "minimum": 0}}}},
        {"anyOf": [{"type": "null"}, {"type": "string", "format": "email"}]},
        {"type": "boolean"},
        {"type": "number", "minimum": -1000, "maximum": 1000},
        {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}},
    ]
    props = {f"field_{i:02d}": shapes[i % len(shapes)] for i in range(fields)}
    return {"$defs": defs, "type": "object", "additionalProperties": False, "required": list(props),
            "properties": props}


def walk(spec, closers, seed: int, max_steps: int = 6000) -> list[int]:
    """A seeded random reply (ids, EOS last) the grammar allows."""
    rng = random.Random(seed)
    m = spec.matcher()
    bm = allocate_bitmask(1)
    out: list[int] = []
    free = rng.randint(0, 32)
    for step in range(max_steps):
        fill_masks([m], bm)
        allowed = np.flatnonzero(np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little"))
        run = None
        if (step >= free or step % 4 == 0) and rng.random() < 0.8:   # sometimes random: formats need it
            for c in closers:
                if c[0] in allowed and m.cut_draft(c) == c:
                    run = c
                    break
        if run is None:
            # Model-like replies are mostly compact: re-draw a blank token a few times.
            for _ in range(4):
                run = [int(allowed[rng.randrange(len(allowed))])]
                if spec.tokenizer.decode_bytes(run).strip():
                    break
        for t in run:
            assert m.consume(t), m.error
            out.append(t)
            if t == EOS:
                return out
    raise RuntimeError("walk did not finish: " + repr(spec.tokenizer.decode_str(out[-300:])))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fields", type=int, default=48)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar.md"))
    args = ap.parse_args()

    import tokenizers
    hf = tokenizers.Tokenizer.from_file(str(ROOT / "kit" / "tokenizer" / "tokenizer.json"))
    t0 = time.perf_counter()
    llg_tokenizer(hf)
    tok_s = time.perf_counter() - t0
    schema = large_schema(args.fields)
    req = {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema,
                                                                      "strict": True}}}
    from dsv41.grammar import compile as grammar_compile
    compile_ms = []
    for _ in range(3):
        grammar_compile._SPECS.clear()   # time a real compile, not the spec cache
        t0 = time.perf_counter()
        spec = compile_request(req, hf, None, False)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    closers = [[EOS]] + [hf.encode(t, add_special_tokens=False).ids for t in ('"', "@", "a", "}", "]")]
    seqs = [walk(spec, closers, seed) for seed in range(args.batch)]

    first_ms = []
    for _ in range(5):
        m = spec.matcher()
        bm = allocate_bitmask(1)
        t0 = time.perf_counter()
        fill_masks([m], bm)
        first_ms.append((time.perf_counter() - t0) * 1e3)

    # Batch 1: one sequence at a time, a mask before every token.
    mask1, consume1 = [], []
    bm = allocate_bitmask(1)
    for seq in seqs[:8]:
        m = spec.matcher()
        for t in seq:
            t0 = time.perf_counter()
            fill_masks([m], bm)
            t1 = time.perf_counter()
            m.consume(t)
            t2 = time.perf_counter()
            mask1.append((t1 - t0) * 1e6)
            consume1.append((t2 - t1) * 1e6)

    # Batch B: every sequence at its own position; each round masks the live rows together.
    B = args.batch
    ms = [spec.matcher() for _ in range(B)]
    bmB = allocate_bitmask(B)
    rounds, per_tok = [], []
    for k in range(max(map(len, seqs))):
        live = [ms[i] if k < len(seqs[i]) else None for i in range(B)]
        n = sum(x is not None for x in live)
        t0 = time.perf_counter()
        fill_masks(live, bmB)
        dt = (time.perf_counter() - t0) * 1e6
        if n == B:
            rounds.append(dt)
            per_tok.append(dt / n)
        for i, m in enumerate(live):
            if m is not None:
                m.consume(seqs[i][k])

    # The same batch-B rounds with llguidance pools of other sizes (dsv41 uses MASK_THREADS; llguidance's own
    # default is 80% of the CPUs, up to 32).
    import llguidance

    from dsv41.grammar import matchers as grammar_matchers
    default_pool = grammar_matchers._executor()
    pools = {}
    for threads in sorted({1, 2, 4, 8, os.cpu_count() or 1}):
        grammar_matchers._EXECUTOR = llguidance.LLExecutor(threads)
        ms = [spec.matcher() for _ in range(B)]
        xs = []
        for k in range(min(map(len, seqs))):
            t0 = time.perf_counter()
            fill_masks(ms, bmB)
            xs.append((time.perf_counter() - t0) * 1e6)
            for i, m in enumerate(ms):
                m.consume(seqs[i][k])
        pools[threads] = xs
    grammar_matchers._EXECUTOR = default_pool

    apply = {}
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        for rows in (1, B):
            logits = torch.randn(rows, 129280, device=dev)
            mask = allocate_bitmask(rows)
            fill_masks([spec.matcher() for _ in range(rows)], mask)
            xs = []
            for it in range(30):
                x = logits.clone()
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                apply_mask(x, mask)
                if dev == "cuda":
                    torch.cuda.synchronize()
                if it >= 5:
                    xs.append((time.perf_counter() - t0) * 1e6)
            apply[(dev, rows)] = xs

    ntok = [len(s) for s in seqs]
    rows = [
        ("tokenizer build (once per process)", f"{tok_s * 1e3:.0f} ms", ""),
        ("compile_request (grammar + matcher), uncached", f"{statistics.median(compile_ms):.1f} ms", "median of 3"),
        ("first mask of a fresh matcher", f"{statistics.median(first_ms):.2f} ms", "median of 5"),
        ("mask, batch 1, per token", f"{statistics.median(mask1):.0f} µs",
         f"p90 {pct(mask1, .9):.0f} µs, mean {statistics.mean(mask1):.0f} µs, {len(mask1)} tokens"),
        ("consume, per token", f"{statistics.median(consume1):.0f} µs", f"p90 {pct(consume1, .9):.0f} µs"),
        (f"mask, batch {B}, per round", f"{statistics.median(rounds):.0f} µs",
         f"p90 {pct(rounds, .9):.0f} µs, {len(rounds)} full rounds"),
        (f"mask, batch {B}, per token", f"{statistics.median(per_tok):.1f} µs", "round / rows"),
    ]
    for threads, xs in pools.items():
        rows.append((f"mask, batch {B}, per round, pool of {threads} threads", f"{statistics.median(xs):.0f} µs",
                     f"p90 {pct(xs, .9):.0f} µs"))
    for (dev, r), xs in apply.items():
        rows.append((f"apply_mask {dev}, {r} x 129280 fp32", f"{statistics.median(xs):.0f} µs",
                     f"p90 {pct(xs, .9):.0f} µs"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    gpu = f"; {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f}{gpu}; "
               f"torch {torch.__version__}; llguidance {llguidance.__version__}; "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    title = (f"Grammar masks: {args.fields}-property schema, replies of {min(ntok)}-{max(ntok)} tokens "
             f"(median {int(statistics.median(ntok))})")
    width = max(len(r[0]) for r in rows)
    print(title)
    print(machine)
    for name, val, note in rows:
        print(f"  {name:<{width}}  {val:>10}  {note}")
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    md = [f"# {title}", "", f"Command: `{cmd}`", "", f"Machine: {machine}", "",
          "| what | median | notes |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(md) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
