"""Ops dispatched and host syncs per decode round (issue 8): the launch count, not the bytes, bounds a GPU round.

Counts every aten op a decode round dispatches (TorchDispatchMode), split into the attention side (`Model._history`:
window ring, compressor, indexer, top-k, key gather, the part a round runs outside its CUDA graphs; before
the graphs commit it was `Model._attention`, which also held the q/kv projections and the attention itself; the
batched round's once-per-round host work apart) and the rest, for rounds of R sequences x 1 new token at context
C, on a small checkpoint on the CPU. Ops are split into view ops and bare allocations (no kernel on a GPU) and the
rest (~one launch each on a GPU), and the ops that make a GPU wait for the host or the host for the GPU are counted
apart: .item() / int() / bool() of a tensor (_local_scalar_dense), nonzero, masked_select, unique, a tensor-repeat
repeat_interleave, copies to the CPU.
Also the CPU time of the round (median of --repeat successive rounds, after one uncounted round).

    OMP_NUM_THREADS=1 python bench/round_ops.py [--checkpoint DIR] [--rows 1,8,32] [--contexts 256,4096]
                                                [--tag before|after] [--out bench/results/round-ops-cpu.md]
                                                [--cuda-path]

Default checkpoint: the built-in tiny one (10 layers, every layer role). The results file gets one section per tag
(a re-run with the same tag replaces its section).
--cuda-path: count the round on the CUDA path's functions instead (a model loaded with the op set cuda_ops(): FP8/FP4
weights kept, the Triton kernels run by the interpreter on CPU tensors, each launch counted as one op; the prompts are
fed by the reference model of the same checkpoint); no times then.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if "--cuda-path" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: the kernels run on CPU tensors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv41.model.model import Model, SeqInput

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "equal", "is_nonzero"}


NO_LAUNCH = {"detach", "alias", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}   # no kernel on a GPU


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "other"
        self.counts: dict[tuple[str, str], int] = {}
        self.names: dict[str, int] = {}
        self.in_launch = False

    def launch(self, name: str) -> None:
        """A Triton kernel launch (one op on a GPU)."""
        key = (self.phase, "op")
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.phase == "attn":
            self.names["triton:" + name] = self.names.get("triton:" + name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_launch:     # the interpreter's own copies of a launch's arguments
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        tensor_repeats = (name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor)
                          and kwargs.get("output_size") is None)
        if (name in SYNC_OPS or tensor_repeats
                or (name in ("_to_copy", "copy_") and _to_host(func, args, kwargs))):
            kind = "sync"
        elif func.is_view or name in NO_LAUNCH:
            kind = "view"
        else:
            kind = "op"
        key = (self.phase, kind)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.phase == "attn" and kind != "view":
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **kwargs)


def _to_host(func, args, kwargs) -> bool:
    """A device -> host copy (only meaningful on CUDA; on the CPU every tensor is on the host)."""
    src = args[1] if func.overloadpacket.__name__ == "copy_" else args[0]
    dst = args[0].device if func.overloadpacket.__name__ == "copy_" else kwargs.get("device", src.device)
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst).type == "cpu"


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 4000, (n,), generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--contexts", default="256,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--code", default=None, help="what code ran (default: HEAD + working tree)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/round-ops-cpu.md"))
    ap.add_argument("--cuda-path", action="store_true")
    a = ap.parse_args()
    if a.checkpoint is None:
        from dsv41.api.engine import builtin_checkpoint
        a.checkpoint = str(builtin_checkpoint())
    host = Model.load(a.checkpoint)      # feeds the prompts (and, without --cuda-path, runs the counted rounds)
    model = host
    if a.cuda_path:
        from dsv41.model.ops import cuda_ops
        model = Model.load(a.checkpoint, keep_quant=True, ops=cuda_ops())
    n_layers = len(model.blocks)
    rows_list = [int(x) for x in a.rows.split(",")]
    table = []
    counter = OpCounter()
    if a.cuda_path:
        from triton.runtime import interpreter

        run = interpreter.InterpretedFunction.run

        def counted(self, *args, **kw):
            counter.launch(getattr(self.fn, "__name__", "?"))
            counter.in_launch = True
            try:
                return run(self, *args, **kw)
            finally:
                counter.in_launch = False
        interpreter.InterpretedFunction.run = counted
    def attention_side(orig):
        def attention(*args, **kw):
            prev, counter.phase = counter.phase, "attn"
            try:
                return orig(*args, **kw)
            finally:
                counter.phase = prev
        return attention

    # the history: the per-sequence path's _history, a round's parts (inside its one piece since issue 25)
    for name in ("_history", "_round_keys", "_compress_round", "_index_round"):
        if hasattr(model, name):
            setattr(model, name, attention_side(getattr(model, name)))
    prepare = getattr(model, "_prepare_round", None)
    if prepare is not None:            # the batched round's once-per-round host work (host tensors, one copy)
        def prep(*args, **kw):
            prev, counter.phase = counter.phase, "prep"
            try:
                return prepare(*args, **kw)
            finally:
                counter.phase = prev
        model._prepare_round = prep
    top_names = {}
    for ctx in (int(x) for x in a.contexts.split(",")):
        base = model.new_state()
        ids = _ids(ctx, ctx)
        t0 = time.perf_counter()
        for s in range(0, ctx, a.chunk):
            host.forward([SeqInput(base, ids[s:s + a.chunk], logits="none")])
        print(f"context {ctx}: prefill {time.perf_counter() - t0:.1f} s", flush=True)
        for R in rows_list:
            snaps = []
            for j in range(R):          # R sequences at slightly different lengths (0..3 extra tokens)
                st = base.snapshot()
                if j % 4:
                    host.forward([SeqInput(st, _ids(j % 4, 1000 + j), logits="none")])
                snaps.append(st)
            states = snaps
            # a first round outside the count: a snapshot's compressed KV has no growth room, so the first append
            # after it reallocates (once); the counted and timed rounds are the steady state (states advance)
            host.forward([SeqInput(st, _ids(1, 2000 + j), logits="last") for j, st in enumerate(states)])
            counter.counts.clear()
            counter.names.clear()
            with counter:
                model.forward([SeqInput(st, _ids(1, 3000 + j), logits="last") for j, st in enumerate(states)])
            c = dict(counter.counts)
            if R == max(rows_list) and ctx == max(int(x) for x in a.contexts.split(",")):
                top_names = dict(counter.names)
            times = []
            for k in range(0 if a.cuda_path else a.repeat):
                step = [SeqInput(st, _ids(1, 4000 + 100 * k + j), logits="last") for j, st in enumerate(states)]
                t0 = time.perf_counter()
                model.forward(step)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3 if times else float("nan")

            def g(phase, kind, c=c):
                return c.get((phase, kind), 0)
            attn_ops, attn_sync, attn_view = g("attn", "op"), g("attn", "sync"), g("attn", "view")
            oth_ops, oth_sync = g("other", "op"), g("other", "sync")
            prep_ops = g("prep", "op") + g("prep", "sync")
            table.append((ctx, R, attn_ops / n_layers, attn_sync / n_layers, attn_view / n_layers,
                          oth_ops / n_layers, oth_sync, prep_ops, attn_ops + oth_ops, attn_sync + oth_sync, ms))
            print(f"ctx {ctx} rows {R}: attention side {attn_ops / n_layers:.0f} ops + {attn_sync / n_layers:.1f} "
                  f"syncs / layer, rest {oth_ops / n_layers:.0f} ops / layer; round {attn_ops + oth_ops} ops, "
                  f"{attn_sync + oth_sync} syncs, {ms:.1f} ms", flush=True)
    _write(a, n_layers, table, top_names)


def _write(a, n_layers, table, top_names) -> None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = "?"
    lines = [f"## {a.tag}", "",
             (f"`OMP_NUM_THREADS=1 python bench/round_ops.py --rows {a.rows} --contexts {a.contexts} "
              f"--repeat {a.repeat} --tag {shlex.quote(a.tag)}{' --cuda-path' if a.cuda_path else ''}` "
             f"({a.code or f'HEAD {commit} + working tree'}), {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; checkpoint {Path(a.checkpoint).name} "
             f"({n_layers} layers). One decode round = R sequences x 1 token. Per layer = the round's count / "
             f"{n_layers}. 'syncs' = ops that make the host wait for a GPU (item/int/bool of a tensor, nonzero, "
             f"data-dependent shapes, copies to the host); on the CPU every tensor is a host tensor, so the 'other' "
             f"syncs include host-side work that is no GPU sync (Engram hashing's checks, the input check's id "
             f"range) next to real ones (MoE's expert list: unique + nonzero per expert on the torch path). "
             f"'round prep host ops': the batched round's once-per-round integer work on host tensors (no launch; "
             f"one host-to-device copy on a GPU). The CPU indexer scores 64-key tiles with a head loop on the "
             f"per-sequence path (on CUDA: one kernel launch per sequence and layer)."), "",
             ("| context | rows | attention-side ops / layer | attention-side syncs / layer | attention-side view / "
             "allocation ops / layer | other ops / layer | other syncs / round | round prep host ops | "
             "ops / round (excl. prep) | syncs / round | CPU ms / round |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for ctx, R, ao, asy, av, oo, osy, pre, tot, tsy, ms in table:
        lines.append(f"| {ctx} | {R} | {ao:.0f} | {asy:.1f} | {av:.0f} | {oo:.0f} | {osy} | {pre} | {tot} | {tsy} | "
                     f"{ms:.1f} |")
    top = sorted(top_names.items(), key=lambda kv: -kv[1])[:12]
    lines += ["", ("Most frequent attention-side ops (largest context and rows, whole round): "
                   + ", ".join(f"{k} {v}" for k, v in top)), ""]
    section = "\n".join(lines) + "\n"
    out = Path(a.out)
    head = ("# Ops and host syncs per decode round (CPU count)\n\n"
            "What a decode round dispatches (bench/round_ops.py); on a GPU each non-view op is about one kernel "
            "launch, which is what bounds a round there (bench/results/gpu.md).\n\n")
    text = out.read_text() if out.exists() else head
    pat = re.compile(rf"^## {re.escape(a.tag)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    text = pat.sub(section, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + section
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
