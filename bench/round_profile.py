"""Where a decode round's and a prompt chunk's time goes on the GPU path (torch.profiler), to aim issue 8's work.

For each case (decode rounds of R rows over a `--context`-token history; one prompt chunk of `--chunk` rows after
that history) it reports: the wall time per round, the GPU's busy time (the sum of its kernels' times) and so the
share of the round the GPU is idle waiting for the host, kernel launches per round, the host synchronisations
(device-to-host copies and stream / device syncs), and the top kernels by GPU time and top host ops by self CPU time.

  python bench/round_profile.py --checkpoint DIR [--context 2048] [--rows 1,32] [--chunk 2048] [--rounds 3]
                                [--chunk-context 2048,32768]
                                [--out bench/results/round-profile.md] [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import io
import pstats
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.model import device as dev  # noqa: E402
from dsv41.model.model import Model, SeqInput  # noqa: E402

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _dev_time(e) -> float:
    """An event's own GPU time in µs (the attribute's name moved between torch releases)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, name, None)
        if v is not None:
            return float(v)
    return 0.0


def profile_case(fn, rounds: int, cuda: bool, shapes: bool = False) -> dict:
    fn()                                 # warm: compiles, allocator
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=shapes) as prof:
        t = time.perf_counter()
        for _ in range(rounds):
            fn()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / rounds
    ka = prof.key_averages()
    kernels, host, syncs, d2h = [], [], 0, 0
    for e in ka:
        gpu = _dev_time(e)
        if e.key in SYNC_OPS:
            syncs += e.count
        if "DtoH" in e.key:
            d2h += e.count
        if e.self_cpu_time_total > 0 and not e.key.startswith("cuda"):
            host.append((e.self_cpu_time_total, e.count, e.key))
        if gpu > 0 and e.self_cpu_time_total == 0:      # device-side events (kernels, memcpy, memset)
            kernels.append((gpu, e.count, e.key))
    launches = sum(c for _, c, name in kernels if not name.startswith("Memset"))
    busy = sum(g for g, _, _ in kernels)
    by_op = []          # --shapes: the host op that launched the GPU work, with its input shapes
    if shapes:
        for e in prof.key_averages(group_by_input_shape=True):
            gpu = _dev_time(e)
            if gpu > 0 and e.self_cpu_time_total > 0:
                by_op.append((gpu, e.count, f"{e.key} {e.input_shapes}"))
    return {"wall_ms": wall * 1e3, "busy_ms": busy / 1e3 / rounds, "launches": launches / rounds,
            "syncs": syncs / rounds, "d2h": d2h / rounds,
            "kernels": sorted(kernels, reverse=True)[:15], "host": sorted(host, reverse=True)[:15], "rounds": rounds,
            "by_op": sorted(by_op, reverse=True)[:40]}


def host_split(model, fn, rounds: int, cuda: bool) -> dict:
    """Where a round's host time goes, without the profiler: each piece's host time (the graphed pieces' replays and
    copies, the eager `_history`), the round's host time (enqueue: until forward returns) against its wall time
    (until the GPU is done; equal when the host is the bottleneck), then the top Python functions under cProfile."""
    acc: dict[str, float] = collections.defaultdict(float)
    hist = model._history
    G = model.graphs
    run = G.run if G is not None else None

    def timed_hist(*args, **kw):
        t = time.perf_counter()
        r = hist(*args, **kw)
        acc["_history (eager)"] += time.perf_counter() - t
        return r

    def timed_run(key, f, args, **kw):
        t = time.perf_counter()
        r = run(key, f, args, **kw)
        acc[f"piece {key[0]} (graph replay)"] += time.perf_counter() - t
        return r

    prep = model._prepare_round

    def timed_prep(*args, **kw):
        t = time.perf_counter()
        r = prep(*args, **kw)
        acc["_prepare_round (host metadata, one copy)"] += time.perf_counter() - t
        return r

    model._history = timed_hist
    model._prepare_round = timed_prep
    if G is not None:
        G.run = timed_run
    try:
        fn()
        if cuda:
            torch.cuda.synchronize()
        acc.clear()
        enqueue = 0.0
        t0 = time.perf_counter()
        for _ in range(rounds):
            t = time.perf_counter()
            fn()
            enqueue += time.perf_counter() - t
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        pieces = dict(acc)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(rounds):
            fn()
        if cuda:
            torch.cuda.synchronize()
        prof.disable()
    finally:
        del model._history, model._prepare_round
        if G is not None:
            del G.run
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return {"pieces": {k: v * 1e3 / rounds for k, v in sorted(pieces.items(), key=lambda kv: -kv[1])},
            "enqueue_ms": enqueue * 1e3 / rounds, "wall_ms": wall * 1e3 / rounds, "cprofile": buf.getvalue()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--chunk-context", default="", help="histories (tokens, comma list) for the prompt-chunk case "
                    "(default: --context)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/round-profile.md"))
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shapes", action="store_true", help="also the GPU time of each host op by input shapes "
                    "(record_shapes: more host time per op, so the wall times are not comparable)")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda:
        dev.setup_cuda("cuda")
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT, check=False).stdout.strip() or "?"
    model = Model.load(a.checkpoint, device=a.device, keep_quant=True)
    K, vocab = model.t.num_hidden_layers, min(1000, model.t.vocab_size)
    g = torch.Generator().manual_seed(0)
    base = model.new_state()
    prompt = torch.randint(3, vocab, (a.context,), generator=g)
    for s in range(0, a.context, a.chunk):
        model.forward([SeqInput(base, prompt[s:s + a.chunk], logits="none")])

    cases, splits = [], []
    for R in [int(r) for r in a.rows.split(",")]:
        states = [base.snapshot() for _ in range(R)]

        def decode(states=states, R=R):
            toks = torch.randint(3, vocab, (R,), generator=g)
            model.forward([SeqInput(st, toks[i:i + 1], logits="none") for i, st in enumerate(states)])
        cases.append((f"decode round, {R} row{'s' if R > 1 else ''}", profile_case(decode, a.rounds, cuda, a.shapes)))
        splits.append((cases[-1][0], host_split(model, decode, max(a.rounds, 5), cuda)))
        del states
        print(f"{cases[-1][0]}: {cases[-1][1]['wall_ms']:.1f} ms", flush=True)

    chunk_ids = torch.randint(3, vocab, (a.chunk,), generator=g)
    for ctx in [int(c) for c in (a.chunk_context or str(a.context)).split(",")]:
        hist = base
        if ctx != a.context:
            hist = model.new_state()
            ids = torch.randint(3, vocab, (ctx,), generator=g)
            for s in range(0, ctx, a.chunk):
                model.forward([SeqInput(hist, ids[s:s + a.chunk], logits="none")])

        def chunk(hist=hist):
            model.forward([SeqInput(hist.snapshot(), chunk_ids, logits="none")])
        cases.append((f"prompt chunk of {a.chunk} rows after {ctx} tokens", profile_case(chunk, max(1, a.rounds - 1),
                                                                                        cuda)))
        print(f"{cases[-1][0]}: {cases[-1][1]['wall_ms']:.1f} ms", flush=True)
        del hist

    cmd = "python bench/round_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    name = torch.cuda.get_device_name() if cuda else "cpu"
    lines = ["# Where a round's time goes (bench/round_profile.py, torch.profiler)", "",
             f"- machine: {name}; commit {commit}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- command: `{cmd}`",
             f"- checkpoint: {K} layers, {a.context}-token history for the decode rounds; kernels: "
             f"{', '.join(model.ops.kernels) or 'none'} (op set {model.ops.name})", "",
             "| case | wall ms | GPU busy ms | GPU busy % | kernel launches | host syncs | DtoH copies |",
             "|---|---|---|---|---|---|---|"]
    for title, r in cases:
        lines.append(f"| {title} | {r['wall_ms']:.2f} | {r['busy_ms']:.2f} | {r['busy_ms'] / r['wall_ms']:.0%} | "
                     f"{r['launches']:.0f} | {r['syncs']:.0f} | {r['d2h']:.0f} |")
    for title, r in cases:
        lines += ["", f"## {title}: top kernels by GPU time (per round)", "", "| µs | count | kernel |", "|---|---|---|"]
        lines += [f"| {t / r['rounds']:.0f} | {c / r['rounds']:.0f} | `{k[:110]}` |" for t, c, k in r["kernels"]]
        lines += ["", f"## {title}: top host ops by self CPU time (per round)", "", "| µs | count | op |",
                  "|---|---|---|"]
        lines += [f"| {t / r['rounds']:.0f} | {c / r['rounds']:.0f} | `{k[:110]}` |" for t, c, k in r["host"]]
        if r["by_op"]:
            lines += ["", f"## {title}: GPU time by the host op that launched it, by input shapes (per round)", "",
                      "| µs | count | op [input shapes] |", "|---|---|---|"]
            lines += [f"| {t / r['rounds']:.0f} | {c / r['rounds']:.0f} | `{k[:200]}` |" for t, c, k in r["by_op"]]
    for title, r in splits:
        lines += ["", f"## {title}: host time per piece, no profiler (per round)", "",
                  f"Host time to enqueue the round {r['enqueue_ms']:.2f} ms; wall time (GPU done) "
                  f"{r['wall_ms']:.2f} ms.",
                  "", "| piece | host ms |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in r["pieces"].items()]
        lines += ["", "Top functions by own time (cProfile, rounds as above):", "", "```", r["cprofile"].strip(), "```"]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
