"""Sparse attention (kernels/sparse_attn.py) and the indexer's round scores (kernels/indexer.py) at V4.1 shapes
against their byte floors, beside the session-9 kernels they replaced, on the GPU (issue 24).

Shapes: 64 heads (two TP shards of 32), D 512, 640 keys a row (the 128 window + 512 top-k), the sink. Decode rows
1, 8, 32, 64 in the decode round's form (each row's keys gathered, [n, 640, D] as the pool, float32 as the round
gathers them today, and bf16); a 2048-row prompt chunk in the pool form (indices into an 8192-latent pool).

Columns: the new kernel as the layer runs it (one launch over both shards' heads; the form it picks), each form
forced (split: a program per 64-key split + the fold kernel; whole: a program per row), and the old kernel as the
layer ran it (a launch per shard of 32 heads, then torch.cat) and at 64 heads in one launch. Byte floor: q, the
keys, the indices and the output read/written once, at the copy bandwidth measured in the same run. Times:
median CUDA-graph replay per call, the graph cycling through copies of the inputs totalling >= 256 MB (5x the L2),
so the keys come from HBM.

Indexer: 32 heads x 128, a round of n sequences with one row each, 1024 keys a sequence (a ratio-2 layer after
2048 tokens) read through the table of addresses; byte floor: the keys, q, w and the scores once. Prompt: 2048
rows of one sequence against 2048 keys.

  python3 bench/attn_bench.py [--out bench/results/attn.md] [--rows 1,8,32,64] [--commit C]
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels import indexer as X                              # noqa: E402
from kernels import sparse_attn as A                          # noqa: E402
from kernels.fp8_linear import bf16_operand, mma              # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from kernels_bench import commit_of                           # noqa: E402

HEADS, SHARDS, D, WINDOW, TOPK = 64, 2, 512, 128, 512
STREAM_BYTES = 256 << 20


@triton.jit
def _old_kernel(q_ptr, pool_ptr, idx_ptr, sink_ptr, o_ptr, K, scale_log2e, HEADS: tl.constexpr, D: tl.constexpr,
                BH: tl.constexpr, BJ: tl.constexpr, INTERP: tl.constexpr):
    """The session-9 kernel (d4003fd, bf16 mode), kept here only as this bench's old column: one program per (row,
    16 heads) over all the row's keys, an online softmax started from the sink."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, D)
    q_hi = bf16_operand(tl.load(q_ptr + (r * HEADS + h)[:, None] * D + d[None, :]), INTERP)
    m = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
    den = tl.full((BH,), 1.0, tl.float32)
    acc = tl.zeros((BH, D), tl.float32)
    for j0 in range(0, K, BJ):
        j = j0 + tl.arange(0, BJ)
        ids = tl.load(idx_ptr + r * K + j, mask=j < K, other=-1)
        ok = ids >= 0
        kv = tl.load(pool_ptr + ids.to(tl.int64)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        k_hi = bf16_operand(kv, INTERP)
        s = mma(q_hi, tl.trans(k_hi), tl.zeros((BH, BJ), tl.float32), INTERP)
        s = tl.where(ok[None, :], s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = mma(bf16_operand(p, INTERP), k_hi, acc * alpha[:, None], INTERP)
        m = m_new
    tl.store(o_ptr + (r * HEADS + h)[:, None] * D + d[None, :], acc / den[:, None])


def split_only(q, pool, idx, sink, scale):
    """The split form's first kernel alone (its states to scratch, no fold): where the split form's time goes."""
    n, heads, dim = q.shape
    K = idx.shape[1]
    S = triton.cdiv(K, A.BLOCK_J)
    acc = torch.empty((n, S, heads, dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((n, S, 2, heads), dtype=torch.float32, device=q.device)
    A._split_kernel[(n * S * heads // A.BLOCK_H,)](
        q, pool, idx, sink, acc, ml, K, S, scale * 1.4426950408889634, HEADS=heads, D=dim, BH=A.BLOCK_H,
        BJ=A.BLOCK_J, PRECISE=False, INTERP=A.INTERPRET, ROWS=False, num_warps=A.NUM_WARPS,
        num_stages=A.NUM_STAGES)
    return acc


def old_attn(q, pool, idx, sink, scale):
    n, heads, dim = q.shape
    o = torch.empty((n, heads, dim), dtype=torch.float32, device=q.device)
    _old_kernel[(n, heads // 16)](q.contiguous(), pool, idx, sink, o, idx.shape[1], scale * 1.4426950408889634,
                                  HEADS=heads, D=dim, BH=16, BJ=64, INTERP=A.INTERPRET, num_warps=8, num_stages=2)
    return o


def old_layer(q, pool, idx, sink, scale):
    """As Attention.attend ran the old kernel: a launch per shard's heads, then the cat."""
    h = HEADS // SHARDS
    return torch.cat([old_attn(q[:, i * h:(i + 1) * h], pool, idx, sink[i * h:(i + 1) * h], scale)
                      for i in range(SHARDS)], dim=1)


@triton.jit
def _old_round_scores(tab_ptr, q_ptr, w_ptr, cnt_ptr, out_ptr, n, T, RB, scale, H, D: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr):
    """The session-9 round kernel (d4003fd), kept here only as this bench's old column: 16 rows in the product, a
    loop over the heads."""
    b = tl.program_id(0) // RB
    local = (tl.program_id(0) % RB) * BM + tl.arange(0, BM)
    rows = b * n + local
    keys = tl.program_id(1) * BN + tl.arange(0, BN)
    d = tl.arange(0, D)
    rmask = local < n
    base = tl.load(tab_ptr + b).to(tl.pointer_type(tl.float32))
    kmask = keys < tl.load(cnt_ptr + b)
    kt = tl.load(base + keys[None, :] * D + d[:, None], mask=kmask[None, :], other=0.0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for h in range(H):
        q = tl.load(q_ptr + rows[:, None] * (H * D) + h * D + d[None, :], mask=rmask[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision="tf32x3")
        w = tl.load(w_ptr + rows * H + h, mask=rmask, other=0.0)
        acc = acc + (tl.maximum(s, 0.0) * scale) * w[:, None]
    tl.store(out_ptr + rows[:, None] * T + keys[None, :], acc, mask=rmask[:, None] & (keys < T)[None, :])


def old_index_table(q, w, table, counts, T, scale):
    N, H, D = q.shape
    B = table.shape[0]
    out = torch.empty((N, T), dtype=torch.float32, device=q.device)
    n = N // B
    rb = triton.cdiv(n, 16)
    _old_round_scores[(B * rb, triton.cdiv(T, 64))](table, q, w, counts, out, n, T, rb, scale, H, D=D, BM=16, BN=64,
                                                    num_warps=4)
    return out


def index_case(n_seq, rows, T, g, H=32, Di=128):
    keys = [torch.randn(T, Di, generator=g, device="cuda") for _ in range(n_seq)]
    q = torch.randn(n_seq * rows, H, Di, generator=g, device="cuda")
    w = torch.randn(n_seq * rows, H, generator=g, device="cuda") * H ** -0.5
    table = torch.tensor([k.data_ptr() for k in keys], dtype=torch.int64, device="cuda")
    counts = torch.full((n_seq,), T, dtype=torch.int64, device="cuda")
    return q, w, table, counts, keys


def copy_bandwidth() -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median") * 1e-3
    return 2 * n * 2 / t


def decode_case(n, dtype, g):
    """q [n, 64, D], the gathered keys as a pool [n*640, D], idx [n, 640] (row r's slots; a new sequence's masked
    window head and a short top-k on some rows, as a round has), sink."""
    K = WINDOW + TOPK
    q = (torch.randn(n, HEADS, D, generator=g, device="cuda") * 2).to(dtype)
    pool = torch.randn(n * K, D, generator=g, device="cuda").to(dtype)
    idx = torch.arange(n * K, device="cuda", dtype=torch.int32).view(n, K)
    keep = torch.randint(K // 2, K + 1, (n, 1), generator=g, device="cuda")
    idx = torch.where(torch.arange(K, device="cuda")[None, :] < keep, idx, -1)
    sink = torch.randn(HEADS, generator=g, device="cuda")
    return q, pool, idx, sink


def prompt_case(n, g, pool_rows=8192):
    K = WINDOW + TOPK
    q = torch.randn(n, HEADS, D, generator=g, device="cuda") * 2
    pool = torch.randn(pool_rows, D, generator=g, device="cuda")
    pos = torch.randint(K, pool_rows, (n,), generator=g, device="cuda")
    win = pos[:, None] - WINDOW + 1 + torch.arange(WINDOW, device="cuda")[None, :]
    comp = torch.sort(torch.randint(0, pool_rows, (n, TOPK), generator=g, device="cuda"), dim=1).values
    idx = torch.cat([win, comp], dim=1).to(torch.int32)
    sink = torch.randn(HEADS, generator=g, device="cuda")
    return q, pool, idx, sink


def time_graph(fn, cases) -> float:
    """Median seconds per call of fn over the cases, back to back in one CUDA graph."""
    def run():
        for c in cases:
            fn(*c)
    run()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run, rep=40, return_mode="median") * 1e-3 / len(cases)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attn.md"))
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--prompt-rows", type=int, default=2048)
    ap.add_argument("--commit", default=os.environ.get("DSV41_COMMIT", ""))
    args = ap.parse_args()
    bw = copy_bandwidth()
    scale = D ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    head = ["# Sparse attention at V4.1 shapes (bench/attn_bench.py)", "",
            f"- command: `python3 {' '.join(sys.argv)}`, commit {commit_of(args.commit)}",
            (f"- machine: {torch.cuda.get_device_name()} ({socket.gethostname()}), torch {torch.__version__}, "
             f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"),
            f"- copy bandwidth measured in the same run: {bw / 1e12:.2f} TB/s (read + write bytes)",
            f"- 64 heads (2 TP shards of 32), D {D}, {WINDOW + TOPK} keys a row; split = {A.BLOCK_J} keys, the "
            f"whole form from {A.WHOLE_FROM} (row, 16-head) programs",
            "- new: one launch over both shards' heads (the layer's call; `auto` = the form it picks); old: the "
            "session-9 kernel, a launch per shard + cat (`old layer`) or one launch of 64 heads (`old 64h`)", "",
            "| rows | keys | call | time (us) | bytes (MB) | floor (us) | % of floor | check |",
            "|---|---|---|---|---|---|---|---|"]
    lines = []
    out = Path(args.out)

    def emit(line):
        lines.append(line)
        print(line, flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(head + lines) + "\n")

    calls = [("new auto", lambda q, p, i, s: A.sparse_attn(q, p, i, s, scale)),
             ("new split", lambda q, p, i, s: A.sparse_attn(q, p, i, s, scale, form="split")),
             ("new whole", lambda q, p, i, s: A.sparse_attn(q, p, i, s, scale, form="whole")),
             ("new split, 1st kernel only", lambda q, p, i, s: split_only(q, p, i, s, scale)),
             ("old layer", lambda q, p, i, s: old_layer(q, p, i, s, scale)),
             ("old 64h", lambda q, p, i, s: old_attn(q, p, i, s, scale))]
    for dtype in (torch.float32, torch.bfloat16):
        esz = torch.tensor([], dtype=dtype).element_size()
        for n in [int(r) for r in args.rows.split(",")]:
            K = WINDOW + TOPK
            nbytes = n * HEADS * D * esz + n * K * D * esz + n * K * 4 + n * HEADS * D * 4
            copies = max(2, min(256, -(-STREAM_BYTES // nbytes)))
            cases = [decode_case(n, dtype, g) for _ in range(copies)]
            c0 = cases[0]
            auto = A.sparse_attn(*c0[:3], c0[3], scale)
            split = A.sparse_attn(*c0[:3], c0[3], scale, form="split")
            whole = A.sparse_attn(*c0[:3], c0[3], scale, form="whole")
            old = old_layer(*c0, scale)
            same = torch.equal(split, whole) and torch.equal(auto, split)
            per_shard = all(torch.equal(A.sparse_attn(c0[0][:, i * 32:(i + 1) * 32].contiguous(), c0[1], c0[2],
                                                      c0[3][i * 32:(i + 1) * 32], scale), auto[:, i * 32:(i + 1) * 32])
                            for i in range(SHARDS))
            big = c0[1].float().abs().max().item()
            check = (f"split==whole {same}, shards apart==one launch {per_shard}, "
                     f"max|new-old|/max|k| {(auto - old).abs().max().item() / big:.1e}")
            floor = nbytes / bw
            for name, fn in calls:
                t = time_graph(fn, cases)
                emit(f"| {n} | {str(dtype).split('.')[-1]} | {name} | {t * 1e6:.1f} | {nbytes / 1e6:.2f} | "
                     f"{floor * 1e6:.2f} | {floor / t * 100:.0f}% | {check if name == 'new auto' else ''} |")
            del cases
    n = args.prompt_rows
    cases = [prompt_case(n, g)]
    c0 = cases[0]
    flops = 4 * n * HEADS * (WINDOW + TOPK) * D
    auto = A.sparse_attn(*c0, scale)
    check = f"max|new-old|/max|k| {(auto - old_layer(*c0, scale)).abs().max().item() / c0[1].abs().max().item():.1e}"
    for name, fn in calls:
        t = time_graph(fn, cases)
        emit(f"| {n} (prompt, pool form) | float32 | {name} | {t * 1e6:.1f} | | | {flops / t / 1e12:.0f} TFLOP/s | "
             f"{check if name == 'new auto' else ''} |")
    # the indexer's round scores: n sequences of one row, and a prompt chunk of one sequence
    T, scale_i = 1024, 128 ** -0.5
    icalls = [("new table", lambda q, w, t, c, k: X.index_scores_table(q, w, t, c, T, scale_i)),
              ("old table", lambda q, w, t, c, k: old_index_table(q, w, t, c, T, scale_i))]
    for n in [int(r) for r in args.rows.split(",")]:
        nbytes = n * T * 128 * 4 + n * 32 * 129 * 4 + n * T * 4
        copies = max(2, min(64, -(-STREAM_BYTES // nbytes)))
        cases = [index_case(n, 1, T, g) for _ in range(copies)]
        q, w, t, c, keys = cases[0]
        new = X.index_scores_table(q, w, t, c, T, scale_i)
        alone = all(torch.equal(X.index_scores(q[b:b + 1], w[b:b + 1], keys[b], scale_i), new[b:b + 1])
                    for b in range(n))
        rel = ((new - old_index_table(q, w, t, c, T, scale_i)).abs().max() / new.abs().max()).item()
        check = f"table==per sequence {alone}, max|new-old|/max {rel:.1e}"
        floor = nbytes / bw
        for name, fn in icalls:
            tm = time_graph(fn, cases)
            emit(f"| {n} | indexer, {T} keys | {name} | {tm * 1e6:.1f} | {nbytes / 1e6:.2f} | {floor * 1e6:.2f} | "
                 f"{floor / tm * 100:.0f}% | {check if name == 'new table' else ''} |")
        del cases
    n, T = args.prompt_rows, 2048
    q, w, t, c, keys = index_case(1, n, T, g)
    flops = 2 * 3 * n * 32 * 128 * T
    for name, fn in (("index_scores (the prompt's kernel, as before)", lambda: X.index_scores(q, w, keys[0], scale_i)),
                     ("old table", lambda: old_index_table(q, w, t, c, T, scale_i))):
        tm = time_graph(lambda *_: fn(), [()])
        emit(f"| {n} (prompt) | indexer, {T} keys | {name} | {tm * 1e6:.1f} | | | {flops / tm / 1e12:.0f} TFLOP/s "
             "(3xTF32) | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
