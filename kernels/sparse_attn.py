"""Sparse attention of a V4.1 block: each query row attends to its own fixed-width key set (K = V, one shared latent
per key), with the per-head sink in the softmax denominator only.

Reference: `dsv41.model.attention.Attention.attend(q, pool[idx.clamp(0)], idx >= 0)`: scores q·k × scale, masked
keys at -inf, softmax over [scores, sink] with the sink column dropped, then P·V with V = K.

The key set is given by indices into a pool of latents (the caller's window ring and compressed KV, in
attention.py's canonical order: the W window positions ascending, then the selected compressed entries
ascending; -1 = masked slot), so nothing is gathered into memory first. The keys of a row are cut into splits of
BLOCK_J = 64 keys (a constant, as DeepSeek's kernel's block: the cut depends on K only, never on the row count).
A split's state is a softmax over its keys started from the sink's max with an empty sum: (m, l, acc) = (max,
Σ exp, Σ exp · v) in fp32, q·k and P·V on the tensor cores with fp32 accumulation. The row's result folds the
splits' states in split order into the sink's own state (max = sink, sum = 1, acc = 0) and divides: the sink sits
in the denominator only, and a row whose keys are all masked gets zeros, never NaN. By default q, k and P are
rounded to bf16, as DeepSeek's kernel does (arch.md §2.1); precise=True feeds them as bf16 hi + lo parts (three
products each: float32's accuracy, three times the tensor-core work).

Two forms run that same chain of float operations (the same jitted functions, tile shapes, warps and stages, so
the same MMA layout and reduction trees):
- split: one program per (row, split, 16 heads) writes its split's state to scratch, and a second kernel folds
  them (few rows: a decode round's 1 row is 40 programs at 64 heads and 640 keys instead of 4);
- whole: one program per (row, 16 heads) computes the splits one after another, folding each as it goes (from
  16 rows at 64 heads, when the row programs alone fill the GPU: no scratch traffic).
So a row's bits depend neither on the form, nor on the other rows of the launch, nor on which heads share it (a
head's scores, softmax and P·V are its own rows of the products): one launch over every TP shard's heads gives
each shard's bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import pdl
from kernels.fp8_linear import INTERPRET, bf16_operand, mma, split_bf16
from kernels.pdl import wait_inputs

BLOCK_H = 16       # heads per program (tl.dot needs >= 16 rows)
BLOCK_J = 64       # keys per split (DeepSeek's kernel's block); fixed: a row's bits depend on it
COMBINE_H = 2      # heads per program of the fold kernel (32 programs a row at 64 heads)
WHOLE_FROM = 64    # (row, head block) programs from which the whole form runs (the same bits, no scratch): H200,
#                    64 heads, fp32 keys: split 14 / 30 / 94 us at 1 / 8 / 32 rows, whole 50 / 51 / 53
NUM_WARPS, NUM_STAGES = 8, 3   # both forms (3 stages: the fp32-key form fits 255 registers without spilling)
LOG2E = tl.constexpr(1.4426950408889634)   # scores and the sink in log2 units, for exp2


@triton.jit
def _queries(q_ptr, r, h, HEADS: tl.constexpr, D: tl.constexpr, PRECISE: tl.constexpr, INTERP: tl.constexpr):
    """The row's q for heads h as tensor-core operands: (bf16 q, its bf16 remainder if PRECISE else q again)."""
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (r * HEADS + h)[:, None] * D + d[None, :])                           # [BH, D]
    if PRECISE:
        q_hi, q_lo = split_bf16(q, INTERP)
    else:
        q_hi = bf16_operand(q, INTERP)
        q_lo = q_hi
    return q_hi, q_lo


@triton.jit
def _split_state(q_hi, q_lo, pool_ptr, idx_ptr, m0, r, s, K, scale_log2e, D: tl.constexpr, BH: tl.constexpr,
                 BJ: tl.constexpr, PRECISE: tl.constexpr, INTERP: tl.constexpr, ROWS: tl.constexpr):
    """Split s of row r (keys s·BJ .. s·BJ + BJ - 1, those past K masked), a softmax from max m0 (the sink, log2
    units) with an empty sum -> (m, l, acc) [BH], [BH], [BH, D]. ROWS: the keys are held row by row (row r's key j
    at pool row r·K + j) and idx_ptr is their bool validity [n, K] read as int32 words of 4 (K a multiple of 4): a
    byte-wide load would keep the compiler from pipelining the loop as it does the index form's int32 loads (278
    KB of shared memory instead of 150 at D 512); else the indices [n, K] into the pool."""
    d = tl.arange(0, D)
    j = s * BJ + tl.arange(0, BJ)
    if ROWS:        # int32 as the index form's (n·K keys of a round fit)
        word = tl.load(idx_ptr + r * (K // 4) + j // 4, mask=j < K, other=0)
        ids = tl.where(((word >> ((j & 3) * 8)) & 0xFF) != 0, (r * K).to(tl.int32) + j, -1)
    else:
        ids = tl.load(idx_ptr + r * K + j, mask=j < K, other=-1)
    ok = ids >= 0
    kv = tl.load(pool_ptr + ids.to(tl.int64)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)    # [BJ, D]
    sc = tl.zeros((BH, BJ), tl.float32)
    acc = tl.zeros((BH, D), tl.float32)
    if PRECISE:      # q·k to float32's accuracy: hi·hi + lo·hi + hi·lo (lo·lo is below 2^-17)
        k_hi, k_lo = split_bf16(kv, INTERP)
        sc = mma(q_hi, tl.trans(k_hi), sc, INTERP)
        sc = mma(q_lo, tl.trans(k_hi), sc, INTERP)
        sc = mma(q_hi, tl.trans(k_lo), sc, INTERP)
    else:
        k_hi = bf16_operand(kv, INTERP)
        sc = mma(q_hi, tl.trans(k_hi), sc, INTERP)
    sc = tl.where(ok[None, :], sc * scale_log2e, float("-inf"))
    m = tl.maximum(m0, tl.max(sc, axis=1))
    p = tl.exp2(sc - m[:, None])
    den = tl.sum(p, axis=1)
    if PRECISE:
        p_hi, p_lo = split_bf16(p, INTERP)
        acc = mma(p_hi, k_hi, acc, INTERP)
        acc = mma(p_lo, k_hi, acc, INTERP)
        acc = mma(p_hi, k_lo, acc, INTERP)
    else:
        acc = mma(bf16_operand(p, INTERP), k_hi, acc, INTERP)
    return m, den, acc


@triton.jit
def _sinks(sink_ptr, h, INTERP: tl.constexpr):
    """The heads' sinks (float32 or bf16) in log2 units, sink · log2 e rounded once (as torch's float32 product:
    mul.rn, never contracted into the fold's subtractions)."""
    v = tl.load(sink_ptr + h).to(tl.float32)
    if INTERP:
        return v * LOG2E
    else:
        return libdevice.mul_rn(v, LOG2E)


@triton.jit
def _fold(m, den, acc, m_s, den_s, acc_s):
    """The running state (m, den, acc) with split state (m_s, den_s, acc_s) folded in. The run starts empty (m =
    -inf, den = acc = 0): the first fold then gives the first split's state exactly (0·0 + x·1 = x whichever
    products the compiler fuses), so no constant start that it could fold differently in the two forms."""
    m_new = tl.maximum(m, m_s)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_s - m_new)
    return m_new, den * a + den_s * b, acc * a[:, None] + acc_s * b[:, None]


@triton.jit
def _finish(m, den, acc, sink):
    """The folded state with the sink's own term (exp(sink - max), in the denominator only), divided out."""
    m_new = tl.maximum(m, sink)
    a = tl.exp2(m - m_new)
    return acc * a[:, None] / (den * a + tl.exp2(sink - m_new))[:, None]


@triton.jit
def _whole_kernel(q_ptr, pool_ptr, idx_ptr, sink_ptr, o_ptr, K, scale_log2e, HEADS: tl.constexpr,
                  D: tl.constexpr, BH: tl.constexpr, BJ: tl.constexpr, PRECISE: tl.constexpr,
                  INTERP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, BH heads): every split of the row in order, each folded as it is done."""
    wait_inputs(PDL)
    pid = tl.program_id(0).to(tl.int64)
    r = pid // (HEADS // BH)
    h = (pid % (HEADS // BH)) * BH + tl.arange(0, BH)
    q_hi, q_lo = _queries(q_ptr, r, h, HEADS, D, PRECISE, INTERP)
    sink = _sinks(sink_ptr, h, INTERP)
    m = tl.full((BH,), float("-inf"), tl.float32)
    den = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, D), tl.float32)
    for s in range(0, tl.cdiv(K, BJ)):
        m_s, den_s, acc_s = _split_state(q_hi, q_lo, pool_ptr, idx_ptr, sink, r, s, K, scale_log2e, D, BH, BJ,
                                         PRECISE, INTERP, ROWS)
        m, den, acc = _fold(m, den, acc, m_s, den_s, acc_s)
    d = tl.arange(0, D)
    tl.store(o_ptr + (r * HEADS + h)[:, None] * D + d[None, :], _finish(m, den, acc, sink))


@triton.jit
def _split_kernel(q_ptr, pool_ptr, idx_ptr, sink_ptr, acc_ptr, ml_ptr, K, S, scale_log2e, HEADS: tl.constexpr,
                  D: tl.constexpr, BH: tl.constexpr, BJ: tl.constexpr, PRECISE: tl.constexpr,
                  INTERP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, split, BH heads), the heads fastest (a split's keys read once into L2 for all of
    them): the split's state to scratch, acc [n, S, HEADS, D] and (m, l) [n, S, 2, HEADS]."""
    wait_inputs(PDL)
    pid = tl.program_id(0).to(tl.int64)
    hb = pid % (HEADS // BH)
    rs = pid // (HEADS // BH)                                # r * S + s
    r = rs // S
    s = rs % S
    h = hb * BH + tl.arange(0, BH)
    q_hi, q_lo = _queries(q_ptr, r, h, HEADS, D, PRECISE, INTERP)
    sink = _sinks(sink_ptr, h, INTERP)
    m_s = sink
    den_s = tl.zeros((BH,), tl.float32)
    acc_s = tl.zeros((BH, D), tl.float32)
    # a loop of one trip the compiler cannot unroll: it pipelines the key loads through shared memory as the whole
    # form's loop does (straight-line code keeps the fp32 key tile in registers and spills)
    for s1 in range(s, tl.minimum(s + 1, S)):
        m_s, den_s, acc_s = _split_state(q_hi, q_lo, pool_ptr, idx_ptr, sink, r, s1, K, scale_log2e, D, BH, BJ,
                                         PRECISE, INTERP, ROWS)
    d = tl.arange(0, D)
    tl.store(acc_ptr + (rs * HEADS + h)[:, None] * D + d[None, :], acc_s)
    tl.store(ml_ptr + rs * 2 * HEADS + h, m_s)
    tl.store(ml_ptr + rs * 2 * HEADS + HEADS + h, den_s)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, sink_ptr, o_ptr, S: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                    BH: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, BH heads): the row's S split states folded in split order, then the sink."""
    wait_inputs(PDL)
    pid = tl.program_id(0).to(tl.int64)
    r = pid // (HEADS // BH)
    h = (pid % (HEADS // BH)) * BH + tl.arange(0, BH)
    d = tl.arange(0, D)
    m = tl.full((BH,), float("-inf"), tl.float32)
    den = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, D), tl.float32)
    for s in tl.static_range(S):
        rs = r * S + s
        m_s = tl.load(ml_ptr + rs * 2 * HEADS + h)
        den_s = tl.load(ml_ptr + rs * 2 * HEADS + HEADS + h)
        acc_s = tl.load(acc_ptr + (rs * HEADS + h)[:, None] * D + d[None, :])
        m, den, acc = _fold(m, den, acc, m_s, den_s, acc_s)
    tl.store(o_ptr + (r * HEADS + h)[:, None] * D + d[None, :], _finish(m, den, acc, _sinks(sink_ptr, h, INTERP)))


def sparse_attn(q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                scale: float, precise: bool = False, form: str | None = None) -> torch.Tensor:
    """o[r, h] = Σ_j softmax_j([q[r,h]·pool[idx[r,j]] · scale]_j ∪ {sink[h]}) · pool[idx[r,j]] (the sink only in
    the denominator; idx -1 = masked) -> float32 [n, heads, D]. q float32/bf16 [n, heads, D]; pool float32/bf16
    [P, D]; idx int32/int64 [n, K] into the pool, or bool [n, K]: the keys held row by row (a decode round's
    gathered keys [n, K, D] or [n · K, D]: row r's key j is pool row r·K + j), idx their validity (no index tensor
    made); sink float32/bf16 [heads]. Equals `Attention.attend(q, pool[idx.clamp(0)], idx >= 0)`: up to the bf16
    rounding of q, k and P by default (the release kernel's numerics, one tensor-core product each); to float32's
    accuracy with precise=True (q, k and P as bf16 hi + lo parts, three products each; on sm_90 that variant spills
    registers at D = 512: correct, not tuned). form: "split" or "whole" (the same bits); None picks by the launch's
    size (whole from WHOLE_FROM (row, head block) programs)."""
    rows_form = idx.dtype == torch.bool
    if rows_form and pool.dim() == 3:
        pool = pool.reshape(-1, pool.shape[-1])
    if rows_form and idx.dim() == 2 and idx.shape[1] % 4:   # (the kernel reads the validity 4 bytes at a time)
        if pool.shape[0] != idx.numel():
            raise ValueError(f"sparse_attn: keys held row by row must be [{idx.numel()}, D], got {list(pool.shape)}")
        idx = torch.where(idx, torch.arange(idx.numel(), device=idx.device).view(idx.shape), -1)
        rows_form = False
    if q.dim() != 3 or pool.dim() != 2 or q.shape[2] != pool.shape[1]:
        raise ValueError(f"sparse_attn: q [n, heads, D] and pool [P, D] must agree, got {list(q.shape)}, "
                         f"{list(pool.shape)}")
    n, heads, dim = q.shape
    if idx.dim() != 2 or idx.shape[0] != n or idx.dtype not in (torch.int32, torch.int64, torch.bool):
        raise ValueError(f"sparse_attn: idx must be int or bool [{n}, K], got {idx.dtype} {list(idx.shape)}")
    if rows_form and pool.shape[0] != idx.numel():
        raise ValueError(f"sparse_attn: keys held row by row must be [{idx.numel()}, D], got {list(pool.shape)}")
    if tuple(sink.shape) != (heads,) or sink.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"sparse_attn: sink must be float32/bf16 [{heads}], got {sink.dtype} {list(sink.shape)}")
    if heads % BLOCK_H or dim & (dim - 1) or dim < 16:
        raise ValueError(f"sparse_attn: heads must be a multiple of {BLOCK_H} and D a power of two, got {heads}, {dim}")
    for name, t in (("q", q), ("pool", pool)):
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"sparse_attn: {name} must be float32/bfloat16, got {t.dtype}")
    if not (q.device == pool.device == idx.device == sink.device):
        raise ValueError("sparse_attn: q, pool, idx and sink must be on one device")
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("sparse_attn runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    if form not in (None, "split", "whole"):
        raise ValueError(f"sparse_attn: form must be 'split', 'whole' or None, got {form!r}")
    o = torch.empty((n, heads, dim), dtype=torch.float32, device=q.device)
    K = idx.shape[1]
    if n == 0 or K == 0:
        return o.zero_() if n else o
    hb = heads // BLOCK_H
    if form is None:
        form = "whole" if n * hb >= WHOLE_FROM else "split"
    # (the kernels read the sinks as they are and scale them to log2 units, as this wrapper's product did)
    q, pool, sink = q.contiguous(), pool.contiguous(), sink.contiguous()
    idx = idx.contiguous().view(torch.int32) if rows_form else idx.to(torch.int32).contiguous()
    common = dict(HEADS=heads, D=dim, BH=BLOCK_H, BJ=BLOCK_J, PRECISE=precise, ROWS=rows_form,
                  INTERP=INTERPRET, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl.options(o))
    scale_log2e = float(scale) * LOG2E.value
    if form == "whole":
        _whole_kernel[(n * hb,)](q, pool, idx, sink, o, K, scale_log2e, **common)
        return o
    S = triton.cdiv(K, BLOCK_J)
    acc = torch.empty((n, S, heads, dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((n, S, 2, heads), dtype=torch.float32, device=q.device)
    _split_kernel[(n * S * hb,)](q, pool, idx, sink, acc, ml, K, S, scale_log2e, **common)
    _combine_kernel[(n * heads // COMBINE_H,)](acc, ml, sink, o, S=S, HEADS=heads, D=dim, BH=COMBINE_H,
                                               INTERP=INTERPRET, num_warps=4, **pdl.options(o))
    return o
