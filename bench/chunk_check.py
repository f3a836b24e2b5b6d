"""Diagnostic (issue 25): a sequence fed in chunks of 1/3/8 rows (chunks of <= window rows are rounds: the round's
tables, masked groups, whole-round graph) == one pass, on a device, with CUDA graphs on and off, printing the first
rows that differ. tests/test_gpu_cuda.py asserts the same; this says which of graphs / kernels moves a row.

    python bench/chunk_check.py [--device cuda] [--tokens 90]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41.api.engine import builtin_checkpoint  # noqa: E402
from dsv41.model.graphs import PieceGraphs  # noqa: E402
from dsv41.model.model import Model, SeqInput  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=90)
    a = ap.parse_args()
    m = Model.load(builtin_checkpoint(), device=a.device)
    G = m.graphs
    ids = torch.randint(3, min(1000, m.t.vocab_size), (a.tokens,), generator=torch.Generator().manual_seed(1))
    m.graphs = None
    ref = m.forward([SeqInput(m.new_state(), ids)])[0]
    for graphs in (None, G or PieceGraphs("emulate")):
        m.graphs = graphs
        for chunk in (1, 3, 8):
            st = m.new_state()
            got = torch.cat([m.forward([SeqInput(st, ids[i:i + chunk])])[0] for i in range(0, len(ids), chunk)])
            bad = (got != ref).any(-1).nonzero().view(-1).tolist()
            print(f"graphs {'on' if graphs else 'off'} chunk {chunk}: equal {not bad}, rows differing {bad[:12]}"
                  + (f", failed captures {list(graphs.failed)}" if graphs is not None and graphs.failed else ""),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
