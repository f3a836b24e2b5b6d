"""CPU exactness diagnosis on this host (the H200 machine's CPU): which op makes a decode round's row differ from the
prompt pass? Prints a markdown report (and writes it to --out).

1. Primitives at the tiny model's shapes: the CPU round's one torch.bmm of the index scores (MKL SGEMM_BATCH) against
   the per-sequence 64-key torch.mm tiles (MKL SGEMM); a 16-row product on a view at an offset against a contiguous
   copy (MKL's alignment mode, MKL_CBWR); torch's row sum / mean, softmax, sort on different row counts and widths.
2. The model (tests/test_model_round.py's sequences, tiny-a): the prompt pass (P), the forced per-sequence loop (L)
   and the batched round (R), for 6 decode steps and one 3-row verify. Per step, sequence and layer: the first
   tensor that differs between P, L and R (index scores, top-k, attention inputs / output, the layer's streams).

Run from the repo root with the repo on PYTHONPATH: python3 scripts/h200/cpuexact.py --out $OUT/cpuexact.md
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dsv41.model.attention import Attention
from dsv41.model.indexer import Indexer
from dsv41.model.model import Model, SeqInput

LINES: list[str] = []


OUT: Path | None = None


def say(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)
    if OUT is not None:                       # as it goes: a run cut by its time limit still leaves its lines
        OUT.write_text("\n".join(LINES) + "\n")


def cpu_name() -> str:
    name, flags = platform.processor() or "?", []
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in have]
            break
    return f"{name} ({' '.join(flags)})"


# ---- 1. primitives ---------------------------------------------------------------------------------------------

def prim_bmm_vs_mm() -> None:
    g = torch.Generator().manual_seed(0)
    say("| product | shapes (batch x M x K x N) | rows differing bmm vs mm |")
    say("|---|---|---|")
    for (M, K) in [(128, 128), (64, 32), (16 * 64, 128)]:    # tiny (16 rows x 8 heads, 128), test, V4.1 (64 heads)
        for N in (64, 256):
            for B in (1, 6, 32):
                q = torch.randn(B, M, K, generator=g)
                keys = torch.randn(B, N, K, generator=g)
                out = torch.bmm(q, keys.transpose(1, 2))
                bad = 0
                for b in range(B):
                    for t0 in range(0, N, 64):          # raw_scores' 64-key tiles: mm against a transposed tile
                        ref = q[b] @ keys[b, t0:t0 + 64].t()
                        bad += int((out[b, :, t0:t0 + 64] != ref).any(dim=1).sum())
                say(f"| bmm vs mm tiles | {B}x{M}x{K}x{N} | {bad} of {B * M} |")


def prim_rows() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g)
    bad_sum = sum(int(not torch.equal(x[:r].square().mean(-1, keepdim=True)[r - 1], x[r - 1:r].square().mean(-1)))
                  for r in range(1, 65))
    s = torch.randn(64, 4, 14, generator=g)
    sm = torch.softmax(s, -1)
    bad_sm = sum(int(not torch.equal(sm[r], torch.softmax(s[r:r + 1], -1)[0])) for r in range(64))
    v = torch.randn(6, 64, generator=g)
    v[:, 40:] = float("-inf")
    a = torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :6]
    b = torch.sort(v[:, :40], dim=-1, descending=True, stable=True).indices[:, :6]
    say(f"- mean(x^2) over 128 on a prefix of r rows vs alone: {bad_sum} of 64 rows differ")
    say(f"- softmax [*, 4, 14] batched vs alone: {bad_sm} of 64 rows differ")
    say(f"- stable sort top-6, width 64 (-inf padded) vs 40: {'same' if torch.equal(a, b) else 'DIFFERENT'}")


def prim_linear_alignment() -> None:
    """model/linear.py's row tiles are views at an offset set by the tile's place in the batch. Does a 16-row
    product give other bits for the same rows at another address alignment? (MKL's default reproducibility mode
    allows it; MKL_CBWR=AUTO,STRICT, which dsv41 sets, does not.)"""
    g = torch.Generator().manual_seed(2)
    say(f"| x @ W^T, 16 rows (MKL_CBWR={os.environ.get('MKL_CBWR')}) | K x N | offsets (floats) whose rows differ from the aligned copy |")
    say("|---|---|---|")
    for (K, N) in [(128, 256), (1024, 512), (4096, 1024)]:
        w = torch.randn(N, K, generator=g)
        buf = torch.randn(16 * K + 16, generator=g)
        bad = []
        for off in range(1, 16):
            x = buf[off:off + 16 * K].view(16, K)
            if not torch.equal(x @ w.t(), x.clone() @ w.t()):
                bad.append(off)
        say(f"| view vs contiguous copy | {K} x {N} | {bad} |")


class Recorder:
    """Per layer of the current forward: attention inputs/outputs and index scores (with the trace, what
    model_compare names the first differing tensor from). With the TP shards a layer attends once per shard; the
    first shard's call is compared."""

    def __init__(self):
        self.layer = None
        self.rec: dict = {}

    def install(self):
        rec = self
        orig_in, orig_attend = Model._attn_in, Attention.attend
        orig_scores, orig_round = Indexer.scores, Indexer.round_scores

        def _attn_in(self, blk, *a, **k):
            rec.layer = blk.role.index
            return orig_in(self, blk, *a, **k)

        def attend(self, q, keys, valid):
            o = orig_attend(self, q, keys, valid)
            rec.rec.setdefault(("attend", rec.layer), []).append((q.clone(), keys.clone(), valid.clone(), o.clone()))
            return o

        def scores(self, q, w, keys, positions, ratio):
            s = orig_scores(self, q, w, keys, positions, ratio)
            rec.rec.setdefault(("scores", rec.layer), []).append(s.clone())
            return s

        def round_scores(self, q, w, keys, tpad, limit, counts=None):
            s = orig_round(self, q, w, keys, tpad, limit, counts)
            rec.rec.setdefault(("scores", rec.layer), []).append(s.clone())
            return s

        Model._attn_in, Attention.attend = _attn_in, attend
        Indexer.scores, Indexer.round_scores = scores, round_scores


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g)


def model_compare(ckpt: Path) -> bool:
    rec = Recorder()
    rec.install()
    model = Model.load(ckpt)
    layers = [b.role.index for b in model.blocks]
    lens = [1, 6, 9, 17, 26, 40]
    seqs = [tokens(max(lens) + 9, 10 + i) for i in range(len(lens))]

    def run(seq_inputs):
        rec.rec = {}
        tr = {}
        out = model.forward(seq_inputs, trace=tr)
        return out, dict(rec.rec), tr

    # P: each sequence's one pass
    P = []
    for s in seqs:
        out, r, tr = run([SeqInput(model.new_state(), s)])
        P.append((out[0], r, tr))
    orig_prepare = Model._prepare_round

    def decode(loop: bool):
        Model._prepare_round = (lambda self, segs: None) if loop else orig_prepare
        try:
            states = [model.new_state() for _ in lens]
            model.forward([SeqInput(st, s[:n]) for st, s, n in zip(states, seqs, lens)])
            steps = []
            for k in range(7):
                m = 1 if k < 6 else 3
                off = min(k, 6)
                steps.append(run([SeqInput(st, s[n + off:n + off + m]) for st, s, n in zip(states, seqs, lens)]))
            return steps
        finally:
            Model._prepare_round = orig_prepare

    L, R = decode(True), decode(False)
    # run to run: the same pass again gives the same bits? (a flaky product, e.g. alignment-dependent, shows here)
    P2 = [run([SeqInput(model.new_state(), s)])[0][0] for s in seqs]
    R2 = decode(False)
    same_p = all(torch.equal(a[0], b_) for a, b_ in zip(P, P2))
    same_r = all(torch.equal(x, y) for k in range(7) for x, y in zip(R[k][0], R2[k][0]))
    say(f"- run to run: prompt passes {'identical' if same_p else 'DIFFER'}, rounds {'identical' if same_r else 'DIFFER'}")
    say()
    found_any = not (same_p and same_r)
    say("| step | seq len | logits R==P | L==P | R==L | first differing (layer: tensor) R vs P | L vs P |")
    say("|---|---|---|---|---|---|---|")
    for k in range(7):
        m = 1 if k < 6 else 3
        off = min(k, 6)
        for b, n in enumerate(lens):
            prow = slice(n + off, n + off + m)
            brow = slice(b * m, (b + 1) * m)
            lp = torch.equal(L[k][0][b], P[b][0][prow])
            rp = torch.equal(R[k][0][b], P[b][0][prow])
            rl = torch.equal(R[k][0][b], L[k][0][b])

            def first_diff(X, b=b, m=m, brow=brow, prow=prow):
                for li, L_ in enumerate(layers):
                    for name in ("scores", "attend"):
                        xs, ps = X[1].get((name, L_)), P[b][1].get((name, L_))
                        if not xs or not ps:
                            continue
                        if name == "scores":
                            # P: one call per sequence; X: L has one call per sequence, R one for the round
                            if len(xs) == 1 and xs[0].shape[0] == len(lens) * m:
                                x = xs[0][brow]                      # the round's one call
                            elif len(xs) == len(lens):
                                x = xs[b]                            # the loop: one call per sequence
                            else:
                                x = None                             # some sequences had no keys: not aligned
                            p = ps[0][prow]
                            T = min(p.shape[1], x.shape[1]) if x is not None else 0
                            if x is not None and not torch.equal(x[:, :T], p[:, :T]):
                                d = (x[:, :T] - p[:, :T]).abs()
                                d = d[torch.isfinite(d)]
                                return f"{L_}: index scores (max |d| {float(d.max()) if d.numel() else 'inf'})"
                            tk = f"topk.layer{L_}"
                            xt = X[2][tk][b] if len(X[2][tk]) == len(lens) else X[2][tk][0][brow]
                            if not torch.equal(xt, P[b][2][tk][0][prow]):
                                return f"{L_}: top-k picks"
                        else:
                            q, kk, v, o = xs[0]
                            pq, pk, pv, po = ps[0]
                            if not torch.equal(q[brow], pq[prow]):
                                return f"{L_}: attention q (before attend)"
                            if not torch.equal(kk[brow], pk[prow]) or not torch.equal(v[brow], pv[prow]):
                                W = model.t.sliding_window
                                part = "window" if not torch.equal(kk[brow, :W], pk[prow, :W]) else "compressed"
                                return f"{L_}: attention keys ({part} part)"
                            if not torch.equal(o[brow], po[prow]):
                                return f"{L_}: attend output (same q, keys, valid)"
                    xs = X[2]["layer_out_streams"][li][brow]
                    if not torch.equal(xs, P[b][2]["layer_out_streams"][li][prow]):
                        return f"{L_}: layer output streams (after attention matched: MoE / mHC / norms)"
                return "-"
            if not (lp and rp and rl):
                found_any = True
                say(f"| {k if k < 6 else 'verify'} | {n} | {rp} | {lp} | {rl} | {first_diff(R[k])} | {first_diff(L[k])} |")
    if not found_any:
        say("| all | all | True | True | True | - | - |")
    return not found_any


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--model-only", action="store_true", help="skip the primitive checks")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    global OUT
    if a.out:
        OUT = Path(a.out)
        OUT.parent.mkdir(parents=True, exist_ok=True)
    shared = Path(os.environ.get("DSV41_SHARED", ROOT.parent / "shared"))
    ckpt = Path(a.ckpt) if a.ckpt else shared / "vectors/model/tiny-a/checkpoint"
    t0 = time.time()
    say("# CPU exactness diagnosis (scripts/h200/cpuexact.py)")
    say()
    say(f"- command: python3 scripts/h200/cpuexact.py {' '.join(sys.argv[1:])}")
    say(f"- machine: {cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, ATEN_CPU_CAPABILITY="
        f"{os.environ.get('ATEN_CPU_CAPABILITY')}, MKL_CBWR={os.environ.get('MKL_CBWR')}")
    say()
    if not a.model_only:
        say("## Primitives")
        say()
        prim_rows()
        say()
        prim_linear_alignment()
        say()
        prim_bmm_vs_mm()
        say()
    say("## Model: round (R), per-sequence loop (L), prompt pass (P)")
    say()
    ok = model_compare(ckpt)
    say()
    say(f"({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
