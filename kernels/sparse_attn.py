"""Sparse attention of a V4.1 block: each query row attends to its own fixed-width key set (K = V, one shared latent
per key), with the per-head sink in the softmax denominator only.

Reference: `dsv41.model.attention.Attention.attend(q, pool[idx.clamp(0)], idx >= 0)`: scores q·k × scale, masked
keys at -inf, softmax over [scores, sink] with the sink column dropped, then P·V with V = K.

The key set is given by indices into a pool of latents (the caller's window ring and compressed KV, in
attention.py's canonical order: the W window positions ascending, then the selected compressed entries
ascending; -1 = masked slot), so nothing is gathered into memory first. One program per (row, block of heads):
the row's keys are read in blocks of BLOCK_J, scores on the tensor cores with fp32 accumulation, an online softmax
in fp32 that starts from the sink (max = sink, sum = 1: the sink's own term, so a row whose keys are all masked
gets zeros, never NaN), then P·V on the tensor cores. By default q, k and P are rounded to bf16, as DeepSeek's
kernel does (arch.md §2.1); precise=True feeds them as bf16 hi + lo parts (three products each: float32's
accuracy, three times the tensor-core work).

Exactness: a program reads only its row, and the block order is the key order, so a row's bits do not depend on the
other rows of the launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_linear import INTERPRET, bf16_operand, mma, split_bf16

BLOCK_H = 16     # heads per program (tl.dot needs >= 16 rows)
BLOCK_J = 64     # keys per online-softmax step (as DeepSeek's kernel)
NUM_WARPS, NUM_STAGES = 8, 2
LOG2E = tl.constexpr(1.4426950408889634)   # scores and the sink in log2 units, for exp2


@triton.jit
def _sparse_attn_kernel(q_ptr, pool_ptr, idx_ptr, sink_ptr, o_ptr, K, scale_log2e,
                        HEADS: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BJ: tl.constexpr,
                        PRECISE: tl.constexpr, INTERP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (r * HEADS + h)[:, None] * D + d[None, :])                           # [BH, D]
    if PRECISE:
        q_hi, q_lo = split_bf16(q, INTERP)
    else:
        q_hi = bf16_operand(q, INTERP)
    m = tl.load(sink_ptr + h).to(tl.float32) * LOG2E        # running max (log2 units), starting at the sink
    den = tl.full((BH,), 1.0, tl.float32)                    # the sink's exp(sink - max)
    acc = tl.zeros((BH, D), tl.float32)
    for j0 in range(0, K, BJ):
        j = j0 + tl.arange(0, BJ)
        ids = tl.load(idx_ptr + r * K + j, mask=j < K, other=-1)
        ok = ids >= 0
        kv = tl.load(pool_ptr + ids.to(tl.int64)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)  # [BJ, D]
        s = tl.zeros((BH, BJ), tl.float32)
        if PRECISE:      # q·k to float32's accuracy: hi·hi + lo·hi + hi·lo (lo·lo is below 2^-17)
            k_hi, k_lo = split_bf16(kv, INTERP)
            s = mma(q_hi, tl.trans(k_hi), s, INTERP)
            s = mma(q_lo, tl.trans(k_hi), s, INTERP)
            s = mma(q_hi, tl.trans(k_lo), s, INTERP)
        else:
            k_hi = bf16_operand(kv, INTERP)
            s = mma(q_hi, tl.trans(k_hi), s, INTERP)
        s = tl.where(ok[None, :], s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if PRECISE:
            p_hi, p_lo = split_bf16(p, INTERP)
            acc = mma(p_hi, k_hi, acc, INTERP)
            acc = mma(p_lo, k_hi, acc, INTERP)
            acc = mma(p_hi, k_lo, acc, INTERP)
        else:
            acc = mma(bf16_operand(p, INTERP), k_hi, acc, INTERP)
        m = m_new
    out = acc / den[:, None]
    tl.store(o_ptr + (r * HEADS + h)[:, None] * D + d[None, :], out)


def sparse_attn(q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                scale: float, precise: bool = False) -> torch.Tensor:
    """o[r, h] = Σ_j softmax_j([q[r,h]·pool[idx[r,j]] · scale]_j ∪ {sink[h]}) · pool[idx[r,j]] (the sink only in
    the denominator; idx -1 = masked) -> float32 [n, heads, D]. q float32/bf16 [n, heads, D]; pool float32/bf16
    [P, D]; idx int32/int64 [n, K] into the pool; sink [heads]. Equals `Attention.attend(q, pool[idx.clamp(0)],
    idx >= 0)`: up to the bf16 rounding of q, k and P by default (the release kernel's numerics, one tensor-core
    product each); to float32's accuracy with precise=True (q, k and P as bf16 hi + lo parts, three products each;
    on sm_90 that variant spills registers at D = 512: correct, not tuned)."""
    if q.dim() != 3 or pool.dim() != 2 or q.shape[2] != pool.shape[1]:
        raise ValueError(f"sparse_attn: q [n, heads, D] and pool [P, D] must agree, got {list(q.shape)}, "
                         f"{list(pool.shape)}")
    n, heads, dim = q.shape
    if idx.dim() != 2 or idx.shape[0] != n or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attn: idx must be int [{n}, K], got {idx.dtype} {list(idx.shape)}")
    if tuple(sink.shape) != (heads,):
        raise ValueError(f"sparse_attn: sink must be [{heads}], got {list(sink.shape)}")
    if heads % BLOCK_H or dim & (dim - 1) or dim < 16:
        raise ValueError(f"sparse_attn: heads must be a multiple of {BLOCK_H} and D a power of two, got {heads}, {dim}")
    for name, t in (("q", q), ("pool", pool)):
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"sparse_attn: {name} must be float32/bfloat16, got {t.dtype}")
    if not (q.device == pool.device == idx.device == sink.device):
        raise ValueError("sparse_attn: q, pool, idx and sink must be on one device")
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("sparse_attn runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    o = torch.empty((n, heads, dim), dtype=torch.float32, device=q.device)
    if n == 0:
        return o
    _sparse_attn_kernel[(n, heads // BLOCK_H)](
        q.contiguous(), pool.contiguous(), idx.to(torch.int32).contiguous(), sink.float().contiguous(), o,
        idx.shape[1], float(scale) * LOG2E.value, HEADS=heads, D=dim, BH=BLOCK_H, BJ=BLOCK_J, PRECISE=precise,
        INTERP=INTERPRET, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return o
