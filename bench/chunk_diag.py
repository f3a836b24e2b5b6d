"""Diagnostic (issue 25): where a sequence fed in chunks through CUDA graphs first leaves the eager run. Each
variant feeds the same ids in chunks of `--chunk` rows beside an eager run (graphs off) and, after every chunk,
compares the chunk's logits and every piece of the sequence's state (window rings, compressed KV, index keys,
open groups, published keys), printing the first differences and when graphs were captured.

Variants: `cuda` (graphs kept across chunks), `fresh` (every chunk captures anew: warm-up runs, capture, replay),
`emulate` (graphs.py's emulation), `replay` (the emulation replaying each piece as captured; on CPU it needs the
kernel op set: `--device cpu --kernels` runs it under TRITON_INTERPRET=1, slowly). `fresh` exact while `cuda` is not points at what a replay reads from
its capture round; both wrong points at the capture's warm-up runs.

    python bench/chunk_diag.py [--checkpoint DIR] [--tokens 96] [--chunk 8]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--kernels" in sys.argv:     # the kernel op set on CPU: Triton's interpreter, set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.api.engine import builtin_checkpoint  # noqa: E402
from dsv41.model.graphs import PieceGraphs  # noqa: E402
from dsv41.model.model import Model, SeqInput  # noqa: E402
from dsv41.model.ops import cuda_ops  # noqa: E402


def state_parts(st) -> dict[str, torch.Tensor]:
    out = {}
    for kind in ("windows", "compressed", "index_keys", "partial_kv", "partial_gate"):
        for L, t in getattr(st, kind).items():
            out[f"{kind}[{L}]"] = t
    return out


def compare(a, b) -> list[str]:
    pa, pb = state_parts(a), state_parts(b)
    bad = []
    for k in sorted(set(pa) | set(pb)):
        x, y = pa.get(k), pb.get(k)
        if x is None or y is None:
            bad.append(f"{k}: only one side has it")
        elif x.shape != y.shape:
            bad.append(f"{k}: shapes {list(x.shape)} vs {list(y.shape)}")
        else:
            rows = (x.float() != y.float()).reshape(x.shape[0], -1).any(-1).nonzero().view(-1).tolist() \
                if x.numel() else []
            if rows:
                bad.append(f"{k}: rows {rows[:10]}")
    if a.published_keys != b.published_keys:
        bad.append(f"published_keys {a.published_keys} vs {b.published_keys}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--variants", default="cuda,fresh,emulate")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", action="store_true", help="on CPU: the CUDA op set's kernels, interpreted")
    ap.add_argument("--start", type=int, default=0, help="tokens fed in one eager pass first (both sides)")
    a = ap.parse_args()
    ck = Path(a.checkpoint) if a.checkpoint else builtin_checkpoint()
    m = (Model.load(ck, keep_quant=True, ops=cuda_ops()) if a.kernels and a.device == "cpu" else
         Model.load(ck, device=a.device))
    t = m.t
    print(f"window {t.sliding_window}, compress ratios {t.compress_ratios[:t.num_hidden_layers]}, index_topk "
          f"{t.index_topk}, whole_round {m.whole_round()}", flush=True)
    ids = torch.randint(3, min(1000, t.vocab_size), (a.tokens,), generator=torch.Generator().manual_seed(1))
    for variant in a.variants.split(","):
        G = PieceGraphs(variant if variant in ("emulate", "replay") else "cuda")
        ref = m.new_state()
        if a.start:
            m.graphs = None
            m.forward([SeqInput(ref, ids[:a.start])])
        got = ref.snapshot()
        shown = 0
        for i in range(a.start, len(ids), a.chunk):
            chunk = ids[i:i + a.chunk]
            m.graphs = None
            lr = m.forward([SeqInput(ref, chunk)])[0]
            if variant == "fresh":
                G.entries.clear()
            m.graphs = G
            before = G.stats["captures"]
            lg = m.forward([SeqInput(got, chunk)])[0]
            if a.device == "cuda":
                torch.cuda.synchronize()
            rows = [i + r for r in (lr != lg).any(-1).nonzero().view(-1).tolist()]
            bad = compare(ref, got)
            if rows or bad or G.stats["captures"] != before:
                print(f"[{variant}] rows {i}..{i + len(chunk) - 1}: captures {G.stats['captures'] - before}, "
                      f"logit rows differing {rows}", flush=True)
                for line in bad[:12]:
                    print(f"    {line}", flush=True)
                shown += bool(rows or bad)
            if shown >= 6:
                break
        print(f"[{variant}] done; failed captures {dict(G.failed)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
