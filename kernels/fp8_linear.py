"""FP8 block-scaled linear: y = x · Wᵀ with W the checkpoint's E4M3 [out, in] and its E8M0 32×32 block scales.

Reference: `dsv41.model.linear.linear(x, dsv41.model.quant.dequant_fp8(w, scale))`.

W is dequantised in registers, exactly (an E4M3 value times a power of two is a bf16 value); x is split into two
bf16 parts (x = hi + lo to ~2^-17) and both products run on the tensor cores (`tl.dot`) with fp32 accumulation, so
y is the float32 product to ~1e-5 relative, not a bf16-input approximation (the weight's unpacking, the costly
part of a decode round, is shared by the two products).

Exactness: one configuration for every row count. K is cut into S equal chunks chosen from the weight's shape only
(`fp8_split`); each chunk's tensor-core sum starts from zero and the output is 0 + p_0 + p_1 + … + p_{S-1} in that
order. With one row tile (decode) the chunks run in separate programs (so a small weight still spreads over the GPU)
and a second kernel adds their partials in order; with more rows each program runs its chunks itself and adds them
in the same order. Either way a row's bits depend only on that row.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64   # fixed for every row count (BLOCK_K = two 32-wide scale groups)
NUM_WARPS, NUM_STAGES = 8, 3
TARGET_PROGRAMS = 128                     # programs wanted for one row tile (about one per H200 SM)
SUM_BLOCK = 1024
# The interpreter (CPU CI) mishandles bf16 (truncating casts, wrong dots): there x is rounded to bf16 by bit
# arithmetic and kept in float32, which gives the same products exactly (bf16 x bf16 is exact in float32).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_bf16(x):
    """float32 -> the nearest bf16 value (ties to even), kept as float32 (finite inputs)."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def bf16_operand(v, INTERP: tl.constexpr):
    """v rounded to bf16 (nearest even) as a tensor-core operand; in the interpreter kept as float32 values."""
    if INTERP:
        return round_bf16(v.to(tl.float32))
    else:
        return v.to(tl.bfloat16)


@triton.jit
def split_bf16(v, INTERP: tl.constexpr):
    """v = hi + lo to about 2^-17 relative: hi its bf16 rounding, lo the bf16 rounding of the rest, both as
    tensor-core operands. With weights exact in bf16, hi·W + lo·W in fp32 is the float32 product to ~1e-5."""
    v = v.to(tl.float32)
    if INTERP:
        hi = round_bf16(v)
        return hi, round_bf16(v - hi)
    else:
        hi = v.to(tl.bfloat16)
        return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a · b for bf16-valued operands, fp32 accumulation: tensor cores on the GPU. In the interpreter an
    explicit product-and-sum over k, because numpy's BLAS rounds a row differently by its place in the tile."""
    if INTERP:
        return acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, chunk_blocks, chunks_per_prog,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       INTERP: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_g = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * K
    s_row = s_ptr + (offs_n // 32) * (K // 32)          # [BN]: this column tile's scale rows
    first_half = offs_k[:, None] < 32                   # BK = 64 spans two 32-wide scale groups
    total = tl.zeros((BM, BN), tl.float32)
    c0 = pid_g * chunks_per_prog
    for c in range(c0, c0 + chunks_per_prog):
        part = tl.zeros((BM, BN), tl.float32)
        for kb in range(c * chunk_blocks, (c + 1) * chunk_blocks):
            k = kb * BK + offs_k
            if EVEN_K:
                xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
                wt = tl.load(w_cols + k[:, None], mask=n_ok[None, :], other=0.0)
                s_lo = tl.load(s_row + 2 * kb, mask=n_ok, other=0)
                s_hi = tl.load(s_row + 2 * kb + 1, mask=n_ok, other=0)
            else:
                k_ok = k < K
                xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                wt = tl.load(w_cols + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                s_lo = tl.load(s_row + 2 * kb, mask=n_ok, other=0)
                s_hi = tl.load(s_row + 2 * kb + 1, mask=n_ok & (kb * BK + 32 + 0 * offs_n < K), other=0)
            # 2^(s-127) from the code's float32 bits, per column, then per element the half's factor
            f_lo = (s_lo.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            f_hi = (s_hi.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            wf = wt.to(tl.float32) * tl.where(first_half, f_lo[None, :], f_hi[None, :])
            wb = bf16_operand(wf, INTERP)
            x_hi, x_lo = split_bf16(xt, INTERP)
            part = mma(x_hi, wb, part, INTERP)
            part = mma(x_lo, wb, part, INTERP)
        total = total + part
    out = out_ptr + pid_g.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, total, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, MN, S, BLOCK: tl.constexpr):
    """out = 0 + p[0] + p[1] + … + p[S-1] elementwise, in that order (the fused path's order)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(S):
        acc = acc + tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc, mask=ok)


@functools.cache
def fp8_split(out_f: int, in_f: int) -> int:
    """S, the number of K chunks for a weight [out_f, in_f]: the smallest divisor of the K block count that gives
    TARGET_PROGRAMS programs for one row tile (1 for wide weights), else the largest one that leaves chunks of two
    or more blocks. A function of the weight's shape only, never of the row count."""
    n_tiles = triton.cdiv(out_f, BLOCK_N)
    kb = triton.cdiv(in_f, BLOCK_K)
    # chunks of at least 2 K blocks: a chunk's sum then stays a loop result, which Triton cannot fold into the
    # next dot's accumulator (it folds `dot(a, b, 0) + c` into `dot(a, b, c)`, which would change the bits)
    divisors = [d for d in range(1, kb + 1) if kb % d == 0 and (d == 1 or kb // d >= 2)]
    for d in divisors:
        if n_tiles * d >= TARGET_PROGRAMS:
            return d
    return divisors[-1]


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise TypeError(f"fp8_linear: weight must be float8_e4m3fn [out, in], got {w.dtype} {list(w.shape)}")
    out_f, in_f = w.shape
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"fp8_linear: scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    want = (triton.cdiv(out_f, 32), in_f // 32)
    if in_f % 32 or tuple(scale.shape) != want:
        raise ValueError(f"fp8_linear: weight {list(w.shape)} needs scale {list(want)}, got {list(scale.shape)}")
    if x.dim() != 2 or x.shape[1] != in_f or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8_linear: x must be float32/bfloat16 [n, {in_f}], got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1 and x.shape[0] > 0:
        raise ValueError("fp8_linear: x's last dim must be contiguous")
    if not (w.is_contiguous() and scale.is_contiguous()):
        raise ValueError("fp8_linear: weight and scale must be contiguous")
    if not (x.device == w.device == scale.device):
        raise ValueError(f"fp8_linear: x, weight, scale on different devices ({x.device}, {w.device}, {scale.device})")
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("fp8_linear runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    return scale


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x · dequant_fp8(w, scale)ᵀ as float32 [n, out]; equals `linear(x, dequant_fp8(w, scale))` up to the bf16
    rounding of x and the fp32 summation order. x float32/bf16 [n, in]; w float8_e4m3fn [out, in]; scale E8M0
    [ceil(out/32), in/32] (float8_e8m0fnu or its uint8 bits)."""
    scale = _check(x, w, scale)
    n = x.shape[0]
    out_f, in_f = w.shape
    y = torch.empty((n, out_f), dtype=torch.float32, device=x.device)
    if n == 0:
        return y
    split = fp8_split(out_f, in_f)
    chunk_blocks = triton.cdiv(in_f, BLOCK_K) // split
    m_tiles, n_tiles = triton.cdiv(n, BLOCK_M), triton.cdiv(out_f, BLOCK_N)
    common = {"BM": BLOCK_M, "BN": BLOCK_N, "BK": BLOCK_K, "EVEN_K": in_f % BLOCK_K == 0, "INTERP": INTERPRET,
                  "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    if m_tiles == 1 and split > 1:
        part = torch.empty((split, n, out_f), dtype=torch.float32, device=x.device)
        _fp8_linear_kernel[(1, n_tiles, split)](x, w, scale, part, n, out_f, in_f, x.stride(0), chunk_blocks, 1,
                                                 **common)
        mn = n * out_f
        _sum_partials_kernel[(triton.cdiv(mn, SUM_BLOCK),)](part, y, mn, split, BLOCK=SUM_BLOCK)
    else:
        _fp8_linear_kernel[(m_tiles, n_tiles, 1)](x, w, scale, y, n, out_f, in_f, x.stride(0), chunk_blocks, split,
                                                   **common)
    return y
