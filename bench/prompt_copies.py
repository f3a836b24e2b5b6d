"""The torch ops a prompt chunk of the CUDA op set issues, by call site, on the CPU (issue 29): what moves data
(cat, stack, copy_, clone, index/gather, padding) and the float32 products torch runs (cuBLAS sgemm on the GPU), with
the bytes each writes. The kernels of kernels/ run in Triton's interpreter (TRITON_INTERPRET=1, set here) and are
not counted: this lists what the model code adds around them. Small checkpoints (make_tiny) keep it minutes on a
CPU; the bytes are the small shapes' (each row's share scales with the release's widths), the call sites and counts
are what a GPU chunk launches.

  python bench/prompt_copies.py --checkpoint DIR [--chunk 256] [--context 256] [--out FILE]
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.model.model import Model, SeqInput  # noqa: E402
from dsv41.model.ops import cuda_ops  # noqa: E402

# aten ops that only move or lay out data, and the float products torch computes itself
MOVES = {"cat", "stack", "copy_", "clone", "index", "index_select", "gather", "constant_pad_nd", "_to_copy",
         "index_put_", "repeat", "expand_copy", "scatter", "masked_scatter", "flip", "roll"}
PRODUCTS = {"mm", "bmm", "addmm", "matmul", "baddbmm"}


def _site() -> str:
    """The innermost frame in dsv41/ (the model code that issued the op), with its caller there."""
    frames = [f for f in traceback.extract_stack() if "/dsv41/" in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    up = frames[-2] if len(frames) > 1 else None
    where = f"{Path(f.filename).name}:{f.lineno} {f.name}"
    return where + (f" <- {Path(up.filename).name}:{up.lineno} {up.name}" if up else "")


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.defaultdict(lambda: [0, 0])      # (kind, op, site) -> [count, bytes written]
        self.total = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if any("triton/runtime/interpreter" in f.filename for f in traceback.extract_stack()[-12:]):
            return out      # a Triton kernel's own tensor traffic in the interpreter (a kernel on the GPU)
        outs = out if isinstance(out, (tuple, list)) else [out]
        nbytes = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
        kind = "move" if name in MOVES else "product" if name in PRODUCTS else ""
        self.total["ops"] += 1
        if kind == "product" and not any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            kind = ""
        if kind:
            e = self.ops[(kind, name, _site())]
            e[0] += 1
            e[1] += nbytes
            self.total[kind] += nbytes
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    model = Model.load(a.checkpoint, device="cpu", keep_quant=True, ops=cuda_ops())
    vocab = min(1000, model.t.vocab_size)
    g = torch.Generator().manual_seed(0)
    st = model.new_state()
    if a.context:
        model.forward([SeqInput(st, torch.randint(3, vocab, (a.context,), generator=g), logits="none")])
    ids = torch.randint(3, vocab, (a.chunk,), generator=g)
    with Count() as c:
        model.forward([SeqInput(st, ids, logits="none")])
    t = model.t
    lines = ["# torch ops of a prompt chunk around the kernels (bench/prompt_copies.py)", "",
             f"- command: `python bench/prompt_copies.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"- checkpoint: {t.num_hidden_layers} layers, hidden {t.hidden_size}, heads {t.num_attention_heads} x "
             f"{t.head_dim}; chunk of {a.chunk} rows after {a.context} tokens; op set {model.ops.name} "
             f"(kernels under TRITON_INTERPRET=1, not counted)",
             f"- torch ops outside kernels: {c.total['ops']}; bytes written by data moves {c.total['move']:,}, by "
             f"float32 torch products {c.total['product']:,}", "",
             "| kind | op | calls | bytes written | bytes / row | call site |", "|---|---|---|---|---|---|"]
    for (kind, op, site), (n, b) in sorted(c.ops.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {kind} | {op} | {n} | {b:,} | {b / a.chunk:,.0f} | `{site}` |")
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
