"""Host work a graphed decode round still dispatches (issue 25): the ops a round runs OUTSIDE its CUDA graphs.

With CUDA graphs a replayed piece costs the host one graph launch plus the copies of its inputs into the static
buffers; everything else a round dispatches (the eager history between the pieces, the round's metadata, the head)
is one host op each, at ~10-35 µs a dispatch on the H200's host. This counts, on the CPU, a round's dispatched aten
ops outside the pieces (the metadata's ops run on host tensors on a GPU too: host work, no launch) (`PieceGraphs("emulate")`, the same bookkeeping as the CUDA graphs: a piece's own ops are not
counted, its replay counts one), per layer kind, for rounds of R sequences x 1 token (and 3-row verify rounds).
View ops and bare allocations (no kernel on a GPU) are left out. The CPU-time column is the round's wall time on
this machine with the emulation (it runs the pieces too: not the GPU's host time); "host ms outside the pieces" is
the round's CPU time (this thread's: the machine may be shared) less the emulated pieces' own work (the median of
5 rounds, no op counting): the host's share of a round, of which "_prepare_round ms" builds the round's metadata.

    OMP_NUM_THREADS=1 python bench/round_host.py [--checkpoint DIR] [--rows 1,8,32] [--context 64]
                                                 [--out bench/results/round-host-cpu.md] [--tag after]

Default checkpoint: tiny-a of ../shared/vectors (10 layers: window-only, KV sources, reuse, re-index).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv41.model.graphs import PieceGraphs  # noqa: E402
from dsv41.model.model import Model, SeqInput  # noqa: E402

NO_LAUNCH = {"detach", "alias", "empty", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view",
             "slice", "select", "expand", "as_strided", "t", "transpose", "unsqueeze", "squeeze", "permute",
             "reshape", "unbind", "split", "split_with_sizes", "narrow", "_reshape_alias", "lift_fresh"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.paused = 0
        self.where = "round"
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.paused and name not in NO_LAUNCH:
            self.ops[self.where] += 1
        return func(*args, **(kwargs or {}))


def kind(model, blk) -> str:
    r = blk.role
    if r.ratio == 0:
        return "window-only"
    if blk.compressor is not None:
        return "KV source" + (" + indexer" if blk.indexer is not None else "")
    return "re-index" if blk.indexer is not None else "reuse"


def measure(model, R: int, n: int, context: int, counter: Count, timed: int = 5) -> tuple[dict, float, dict]:
    g = torch.Generator().manual_seed(R)
    V = min(1000, model.t.vocab_size)
    states = [model.new_state() for _ in range(R)]
    model.graphs = None
    model.forward([SeqInput(st, torch.randint(3, V, (context + i,), generator=g), logits="none")
                   for i, st in enumerate(states)])
    G = model.graphs = PieceGraphs("emulate")
    run = G.run

    spent = collections.Counter()                  # seconds in the emulated pieces' own work, in _prepare_round

    def counted_run(key, fn, args, **kw):
        counter.ops[counter.where] += 1            # the graph launch
        counter.paused += 1                        # the piece's own ops: inside the graph

        def piece(*a):
            t = time.thread_time()
            try:
                return fn(*a)
            finally:
                spent["pieces"] += time.thread_time() - t
        try:
            return run(key, piece, args, **kw)
        finally:
            counter.paused -= 1

    def fill_counted(static, args, n_):
        counter.paused -= 1                        # the copies into the static inputs: host ops
        try:
            return fill(static, args, n_)
        finally:
            counter.paused += 1

    import dsv41.model.graphs as gm
    fill = gm._fill
    G.run = counted_run
    gm._fill = fill_counted
    hist = model._history
    # attribute the eager history to its layer's kind
    by_blk = {b.role.index: kind(model, b) for b in model.blocks}

    def hist_k(blk, *a, **k):
        counter.where = by_blk[blk.role.index]
        try:
            return hist(blk, *a, **k)
        finally:
            counter.where = "round"
    prep = model._prepare_round

    def prep_k(*a, **k):
        counter.where = "metadata (_prepare_round, host tensors)"
        t = time.thread_time()
        try:
            return prep(*a, **k)
        finally:
            spent["prepare"] += time.thread_time() - t
            counter.where = "round"
    model._history = hist_k
    model._prepare_round = prep_k
    try:
        for _ in range(2):                          # capture round (not counted), then one counted round
            counter.ops.clear()
            toks = torch.randint(3, V, (R, n), generator=g)
            t = time.perf_counter()
            with counter:
                model.forward([SeqInput(st, toks[i], logits="last") for i, st in enumerate(states)])
            wall = time.perf_counter() - t
        # host time without the counter: the round's wall time less the emulated pieces' own work (what a GPU's
        # graphs would run), and _prepare_round's share; the median of `timed` rounds
        host, prepare = [], []
        for _ in range(timed):
            spent.clear()
            toks = torch.randint(3, V, (R, n), generator=g)
            t = time.thread_time()
            model.forward([SeqInput(st, toks[i], logits="last") for i, st in enumerate(states)])
            host.append(time.thread_time() - t - spent["pieces"])
            prepare.append(spent["prepare"])
    finally:
        G.run = run
        gm._fill = fill
        del model._history, model._prepare_round
        model.graphs = None
    return dict(counter.ops), wall, {"host": statistics.median(host), "prepare": statistics.median(prepare)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    shared = Path(os.environ.get("DSV41_SHARED", ROOT.parent / "shared"))
    ap.add_argument("--checkpoint", default=str(shared / "vectors/model/tiny-a/checkpoint"))
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=str(ROOT / "bench/results/round-host-cpu.md"))
    a = ap.parse_args(argv)
    model = Model.load(a.checkpoint)
    kinds = collections.Counter(kind(model, b) for b in model.blocks)
    counter = Count()
    rows = []
    for R in [int(x) for x in a.rows.split(",")]:
        for n in (1, 3):
            ops, wall, host = measure(model, R, n, a.context, counter)
            rows.append((R, n, ops, wall, host))
            print(R, n, ops, f"{wall * 1e3:.0f} ms", f"host {host['host'] * 1e3:.2f} ms",
                  f"_prepare_round {host['prepare'] * 1e3:.2f} ms", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip()
    cols = ["round", "metadata (_prepare_round, host tensors)"] + sorted(kinds)
    lines = [f"## {a.tag}: commit {commit}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "", f"- command: `python bench/round_host.py {' '.join(argv or sys.argv[1:])}`; {platform.node()}, "
             f"{platform.processor() or platform.machine()}; {a.context}-token prompts",
             f"- checkpoint: {Path(a.checkpoint).name} ({len(model.blocks)} layers: "
             + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + ")", "",
             "| sequences x rows | ops outside the graphs | " + " | ".join(
                 "round (graph launches, input copies, embed, head)" if c == "round" else
                 c if c.startswith("metadata") else f"eager history: {c}" for c in cols)
             + " | CPU ms (emulated) | host ms outside the pieces | _prepare_round ms |",
             "|---" * (len(cols) + 5) + "|"]
    for R, n, ops, wall, host in rows:
        lines.append(f"| {R} x {n} | {sum(ops.values())} | " + " | ".join(str(ops.get(c, 0)) for c in cols)
                     + f" | {wall * 1e3:.0f} | {host['host'] * 1e3:.2f} | {host['prepare'] * 1e3:.2f} |")
    out = Path(a.out)
    head = ["# Host ops a graphed decode round dispatches (bench/round_host.py)", "", __doc__.split("\n\n")[1], ""]
    old = out.read_text().split("\n## ", 1)[1] if out.exists() and "\n## " in out.read_text() else ""
    keep = "" if not old else "\n## " + old
    out.write_text("\n".join(head + lines) + "\n" + keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
