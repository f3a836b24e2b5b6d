"""Lightning-indexer scores in one launch: I[t, s] = Σ_h relu(q[t, h] · k[s]) · scale · w[t, h], float32.

Reference: `dsv41.model.indexer.Indexer.scores` before its visibility mask (the torch path cuts the keys into tiles
of 64 and the rows into fixed row tiles, with a Python loop over heads: thousands of launches per call on a GPU).

Numerics: float32 in and out, heads added in order 0..H-1 as the reference does. The q·k products run on the tensor
cores as 3xTF32 (`input_precision="tf32x3"`: each operand split into a TF32 high part and a TF32 remainder, three
products, fp32 accumulation), about float32's accuracy (~1e-6 relative) at several times the rate of IEEE fp32 dots
(which ran at ~13 TFLOP/s on the H200 and bound long prompts: 2026-12-03 gpu.md). Under QAT the indexer's q and k
are FP4 values times a power of two, exact in TF32, so the remainders are zero and every product is exact. The sum
over the head dim is the kernel's own fixed order, so values differ from the torch path by float32-level rounding.
One pass (`one_pass=True`, the op set's choice at load when QAT is on): the products in a single TF32 pass. Its
bits are the three passes' exactly when q and k are exact in TF32 (each operand's remainder is zero, so the two
remainder products add exact zeros to a zero accumulator before the main product), as the FP4 values times powers
of two of QAT's indexer q and keys are; a third of the tensor-core work, which bounds the kernel at 32 rows (3x
its keys' read on the H100). Both kernels take the same mode, so a round's values stay the per-sequence kernel's.
Exactness: one configuration (BLOCK_M rows x BLOCK_N keys per program, the whole head dim in one product), so a
(row, key) value depends only on that row and that key: not on the other rows of the call, nor on how many keys
the sequence has (chunked prompt == one pass, a row alone == among many).

A decode round (`index_scores_table`: one or a few rows a sequence) arranges the same arithmetic differently: a
row's heads are the rows of its product (q[t] [H, D] · the key tile, heads padded to 16 with zeros) instead of 16
rows of which a round fills one, then the heads' terms are taken out one by one and added in order 0..H-1 as the
per-sequence kernel adds them (acc + (relu(s)·scale)·w, the same fused multiply-add). A product's element depends
only on its own row and column of the operands (the same MMA instruction and k order whichever rows share it),
so the round's values are the per-sequence kernel's bits (tests/test_model_round.py, on CUDA at V4.1 shapes).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, NUM_WARPS = 16, 64, 4
ROUND_WARPS = 8   # the round kernel: its 32-head tile's 3xTF32 operands spill at 4
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# N, T (rows, keys) and H are not specialised on, and the head loop is a runtime loop: one compiled variant for
# every call (the first H200 run spent ~70 s compiling unrolled variants per key count).
@triton.jit(do_not_specialize=["N", "T", "H"])
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, N, T, scale, H, D: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    keys = tl.program_id(1) * BN + tl.arange(0, BN)
    d = tl.arange(0, D)
    rmask, kmask = rows < N, keys < T
    kt = tl.load(k_ptr + keys[None, :] * D + d[:, None], mask=kmask[None, :], other=0.0)     # [D, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for h in range(H):
        q = tl.load(q_ptr + rows[:, None] * (H * D) + h * D + d[None, :], mask=rmask[:, None], other=0.0)
        if INTERP:   # numpy's BLAS would round a row by its place in the tile: an explicit product-sum instead
            s = tl.sum(q[:, :, None] * kt[None, :, :], axis=1)
        else:
            s = tl.dot(q, kt, input_precision=PREC)
        w = tl.load(w_ptr + rows * H + h, mask=rmask, other=0.0)
        acc = acc + (tl.maximum(s, 0.0) * scale) * w[:, None]
    tl.store(out_ptr + rows[:, None] * T + keys[None, :], acc, mask=rmask[:, None] & kmask[None, :])


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float,
                 one_pass: bool = False) -> torch.Tensor:
    """q [n, H, D] float32, w [n, H] float32, keys [T, D] float32 -> scores [n, T] float32 (no visibility mask).
    D must be a power of two (the release's 128). one_pass: q and keys are exact in TF32 (module docstring)."""
    n, H, D = q.shape
    T = keys.shape[0]
    if D & (D - 1) or keys.shape[1] != D or w.shape != (n, H):
        raise ValueError(f"index_scores: q {list(q.shape)}, w {list(w.shape)}, keys {list(keys.shape)}")
    out = torch.empty((n, T), dtype=torch.float32, device=q.device)
    if n == 0 or T == 0:
        return out
    q, w, keys = (t.float().contiguous() for t in (q, w, keys))
    grid = (triton.cdiv(n, BLOCK_M), triton.cdiv(T, BLOCK_N))
    _index_scores_kernel[grid](q, w, keys, out, n, T, float(scale), H, D=D, BM=BLOCK_M, BN=BLOCK_N,
                               INTERP=INTERPRET, PREC=_precision(one_pass), num_warps=NUM_WARPS)
    return out


# A round of B sequences with n rows each against their own keys, each (row, key) value the bits the per-sequence
# launch gives. Each sequence's keys are reached through a table of its key tensor's address with its key count
# (no padded copy of every sequence's keys per layer); keys past a sequence's count read 0.
@triton.jit(do_not_specialize=["n", "T", "RB", "H"])
def _index_scores_round_kernel(tab_ptr, q_ptr, w_ptr, cnt_ptr, out_ptr, n, T, RB, scale, H, HP: tl.constexpr,
                               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, INTERP: tl.constexpr,
                               PREC: tl.constexpr):
    b = tl.program_id(0) // RB
    first = (tl.program_id(0) % RB) * BM
    keys = tl.program_id(1) * BN + tl.arange(0, BN)
    d = tl.arange(0, D)
    hh = tl.arange(0, HP)
    base = tl.load(tab_ptr + b).to(tl.pointer_type(tl.float32))
    kmask = keys < tl.load(cnt_ptr + b)
    kt = tl.load(base + keys[None, :] * D + d[:, None], mask=kmask[None, :], other=0.0)
    for i in range(0, BM):
        if first + i < n:
            row = b * n + first + i
            q = tl.load(q_ptr + row * (H * D) + hh[:, None] * D + d[None, :], mask=(hh < H)[:, None], other=0.0)
            if INTERP:
                s = tl.sum(q[:, :, None] * kt[None, :, :], axis=1)
            else:
                s = tl.dot(q, kt, input_precision=PREC)                                        # [HP, BN]
            g = tl.maximum(s, 0.0) * scale
            if INTERP:
                acc = tl.zeros((BN,), dtype=tl.float32)
                for h in range(H):     # head h's row of g, exactly (the others add zeros), then its term in order
                    g_h = tl.sum(tl.where((hh == h)[:, None], g, 0.0), axis=0)
                    acc = acc + g_h * tl.load(w_ptr + row * H + h)
                tl.store(out_ptr + row.to(tl.int64) * T + keys, acc, mask=keys < T)
            else:
                # The heads' terms in order as a float32 FMA product: Triton lowers an "ieee" float32 dot to one
                # accumulator per output, k = 0..HP-1 in order, each step fma(w[k], g[k, key], acc) from zero: the
                # per-sequence kernel's loop, bit for bit (heads past H add w = 0 times g = 0 to a sum that is never
                # -0). Row 0 of the 16-row operand is the row's weights, the rest zeros; only row 0 is stored. The
                # masked sum per head it replaces crossed the warps HP times a key tile (the 1-row round's scores
                # took 160 us a layer at 128K positions).
                r16 = tl.arange(0, 16)
                wv = tl.load(w_ptr + row * H + hh, mask=hh < H, other=0.0)
                w16 = tl.where((r16 == 0)[:, None], wv[None, :], 0.0)                             # [16, HP]
                acc16 = tl.dot(w16, g, input_precision="ieee")                                    # [16, BN]
                tl.store(out_ptr + row.to(tl.int64) * T + keys[None, :] + 0 * r16[:, None], acc16,
                         mask=(r16 == 0)[:, None] & (keys < T)[None, :])


def _precision(one_pass: bool) -> str:
    """The products' tl.dot precision: one TF32 pass for operands exact in TF32, else three (~float32's accuracy)."""
    return "tf32" if one_pass else "tf32x3"


def _heads_tile(H: int) -> int:
    """The round kernel's product rows for H heads: a power of two, >= 16 (tl.dot's least); heads past H read 0."""
    return max(16, triton.next_power_of_2(H))


def index_scores_table(q: torch.Tensor, w: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, T: int,
                       scale: float, one_pass: bool = False) -> torch.Tensor:
    """Each sequence's rows against its own keys, sequence b's keys reached through table[b] (int64 address of a
    contiguous float32 [counts[b], D] tensor; its rows are q[b*n:(b+1)*n]): q [B*n, H, D], w [B*n, H], counts [B]
    int64 -> scores [B*n, T] (T >= every count; columns past a sequence's count score zero keys). One launch, no copy
    of the keys; equal (torch.equal) to index_scores per sequence in the same mode (one_pass)."""
    N, H, D = q.shape
    B = table.shape[0]
    if D & (D - 1) or w.shape != (N, H) or table.dtype != torch.int64 or counts.shape != (B,) or (B and N % B):
        raise ValueError(f"index_scores_table: q {list(q.shape)}, w {list(w.shape)}, table {list(table.shape)}")
    out = torch.empty((N, T), dtype=torch.float32, device=q.device)
    if N == 0 or T == 0:
        return out
    n = N // B
    q, w = (t.float().contiguous() for t in (q, w))
    rb = triton.cdiv(n, BLOCK_M)
    grid = (B * rb, triton.cdiv(T, BLOCK_N))
    _index_scores_round_kernel[grid](table, q, w, counts, out, n, T, rb, float(scale), H, HP=_heads_tile(H), D=D,
                                     BM=BLOCK_M, BN=BLOCK_N, INTERP=INTERPRET, PREC=_precision(one_pass),
                                     num_warps=ROUND_WARPS)
    return out
