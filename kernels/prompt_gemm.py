"""Tensor-core products for prompt chunks (more than PROMPT_ROWS rows): the block-scaled FP8 linear and the routed FP4
experts as a grouped GEMM over the device-built work list (issue 29).

The decode kernels (csrc/decode.cu, launched by fp8_linear.py / fp4_moe.py) put the weight on the MMA's A side and
up to 64 activation rows on its N side: right for a decode round, where the weight's bytes are the cost, and ~6 % of
the matrix rate for a 2048-row chunk. Here a program holds a BM x BN output tile, streams K in BK steps and feeds
the tensor cores with `tl.dot` (wgmma on sm_90): x as bf16 from a packed copy, the weight dequantised in the
loader, exactly (an E4M3 or E2M1 value times a power of two is a bf16 value), float32 accumulation.

The same bits as the decode kernels, by construction (so the op set may pick either by row count and a row's bits
still never depend on the chunk it shares):
- the same operands: x rounded to bf16 (round to nearest even), the weight's exact values;
- the same MMA chain per output element: decode.cu's lanes read 16 contiguous weight bytes each, so the 16 k of one
  of its m16n8k16 MMAs are not 16 consecutive k. This kernel feeds each 16-wide slice of its dot the same 16 k in
  the same fragment slots (`_fp8_phys` / `_fp4_phys` map a dot position to the physical k): x is packed in that
  order once per call (`pack_rows`), the weight is gathered in it;
- the same K chunks: the FP8 linear cuts K into `fp8_linear.split_for(out, in, CUDA)` chunks, each summed from zero
  and added in order, ((0 + p_0) + p_1) + ...; the experts run K in one chain from zero;
- the same SwiGLU: libdevice's expf and a correctly rounded division, as the CUDA C code's expf and `/` (no fast
  math), h rounded to bf16.
Whether the tensor cores' wgmma sums a 16-wide slice as their mma.sync does is the hardware's: the GPU test
(tests/test_kernels_prompt_gemm.py) compares the bits with the decode kernels'; the CPU tests check the function
(against the dequantised float product) and the chunk invariance.

Batch invariance by construction: one tiling (BM, BN, BK, the K order and chunks) for every row count; each output
element is its own row's chain; row tiles past the rows are masked, never reshaped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.fp4_moe import _unpack
from kernels.fp8_linear import INTERPRET, _product, bf16_operand, mma

PROMPT_ROWS = 64   # rows above which the op set runs the FP8 prompt product (at or below: the decode kernel)
# The experts' prompt GEMM (prompt_fp4_moe) is not in the op set yet: its first H200 run was 2.7x slower than the
# decode kernels (arithmetic E2M1 unpacking); the prmt unpacking and 128-pair tiles that replace it are unmeasured
# (bench/results/prompt-gemm.md). Its bits are the decode kernels' (tested), so routing it is a speed decision only.

FP8_BK = 64        # the FP8 linear's K step: the decode kernel's 64-wide step, whose k order is matched
MOE_BK = 128       # the experts' K step: 128 values (64 packed bytes), the decode kernels' step
PACK_ROWS, PACK_COLS = 16, 256


@dataclass(frozen=True)
class Config:
    """A launch configuration: the output tile (bm rows x bn weight rows; the experts' bm is their work list's
    tile, pairs of one expert), warps, pipeline stages, group_m (row tiles that sweep the columns together, for the L2) and
    tot_mem (the FP8 linear's running sum of its K chunks kept in y, not in registers: frees a tile of registers
    for a wider bn). Any configuration gives the same bits: every output element is its own MMA chain."""
    bm: int = 128
    bn: int = 128
    warps: int = 8
    stages: int = 4
    group_m: int = 8
    tot_mem: bool = False
    swap: bool = False     # the weight as the MMA's A operand (from registers), the rows / pairs as N (yᵀ tiles)


FP8_DEFAULT = Config(swap=True)
MOE_DEFAULT = Config(bm=64, bn=128, warps=8, stages=3, swap=True)
# Per FP8 weight shape (out, in) -> Config, measured on the H200 (bench/prompt_gemm_bench.py --sweep); others take
# FP8_DEFAULT.
FP8_CONFIGS: dict[tuple[int, int], Config] = {}


# the candidates bench/prompt_gemm_bench.py --sweep times (a few spill 64-80 bytes for sm_90)
FP8_SWEEP = [FP8_DEFAULT, Config(), Config(swap=True, tot_mem=True), Config(bm=64, bn=128, warps=4, swap=True),
             Config(bm=64, bn=128, warps=8, swap=True), Config(bm=256, bn=128, swap=True, tot_mem=True),
             Config(bn=256, warps=16, stages=3, tot_mem=True)]
MOE_SWEEP = [MOE_DEFAULT, Config(bm=64, bn=128, warps=8, stages=3), Config(bm=128, bn=64, warps=8, stages=3, swap=True),
             Config(bm=128, bn=128, warps=8, stages=3, swap=True), Config(bm=64, bn=64, warps=4, stages=4, swap=True)]


def fp8_config(out_f: int, in_f: int) -> Config:
    """The configuration an FP8 weight [out_f, in_f] (a group's rows, for a grouped projection) runs with."""
    return FP8_CONFIGS.get((out_f, in_f), FP8_DEFAULT)


# ---- the k order of the decode kernels' MMAs ---------------------------------------------------------------------

@triton.jit
def _fp8_phys(i):
    """Dot position i (0..63) of a 64-wide K step -> the physical k decode.cu's FP8 MMA chain puts there: MMA j =
    i // 16 reads lane t's bytes 16t + 4j .. + 3 as fragment slots (2t, 2t+8, 2t+1, 2t+9)."""
    j = i // 16
    h = (i // 8) % 2
    t = (i // 2) % 4
    b = i % 2
    return 16 * t + 4 * j + 2 * b + h


@triton.jit
def _fp8_order(w, BN: tl.constexpr):
    """A [BN, 64] step loaded in physical k order -> in the dot's (_fp8_phys): physical k = 16t + 4j + 2b + h
    goes to dot position 16j + 8h + 2t + b. A register permutation (no memory)."""
    w = tl.reshape(w, (BN, 4, 4, 2, 2))                       # [n, t, j, b, h]
    return tl.reshape(tl.permute(w, (0, 2, 4, 1, 3)), (BN, 64))   # [n, j, h, t, b]


@triton.jit
def _fp4_phys(i):
    """Dot position i (0..127) of a 128-value K step -> the physical k decode.cu's E2M1 chain puts there: lane t's
    16 bytes are values 32t .. 32t + 31; word j's eight codes feed MMA 2j (codes 0, 4 | 2, 6) and 2j + 1 (1, 5 |
    3, 7)."""
    q = i // 16
    j = q // 2
    s = q % 2
    h = (i // 8) % 2
    t = (i // 2) % 4
    b = i % 2
    return 32 * t + 8 * j + 4 * b + 2 * h + s


@triton.jit
def _fp4_slot(p):
    """The inverse of _fp4_phys: physical k (0..127) of a step -> its dot position."""
    t = p // 32
    j = (p // 8) % 4
    b = (p // 4) % 2
    h = (p // 2) % 2
    s = p % 2
    return 16 * (2 * j + s) + 8 * h + 2 * t + b


@triton.jit
def _pack_kernel(x_ptr, ldx, out_ptr, M, K, BR: tl.constexpr, BC: tl.constexpr, STEP: tl.constexpr,
                 INTERP: tl.constexpr):
    """out[m, s * STEP + i] = bf16(x[m, s * STEP + phys(i)]): x's rows rounded to bf16 in the dot's k order."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    r_ok = r < M
    ok = r_ok[:, None] & (c < K)[None, :]
    if STEP == 64:
        src = (c // 64) * 64 + _fp8_phys(c % 64)
    else:
        src = (c // 128) * 128 + _fp4_phys(c % 128)
    v = tl.load(x_ptr + r[:, None].to(tl.int64) * ldx + src[None, :], mask=ok, other=0.0)
    tl.store(out_ptr + r[:, None].to(tl.int64) * K + c[None, :], bf16_operand(v, INTERP), mask=ok)


def _operand_dtype() -> torch.dtype:
    # the interpreter keeps bf16 operand values in float32 (kernels/fp8_linear.py: its bf16 casts truncate)
    return torch.float32 if INTERPRET else torch.bfloat16


def pack_rows(x: torch.Tensor, step: int) -> torch.Tensor:
    """x [n, K] (float32/bf16, last dim contiguous) rounded to bf16, each `step`-wide K block in the dot's k order
    (step 64: the FP8 linear's, 128: the experts')."""
    n = x.shape[0]
    k = x.shape[1]
    out = torch.empty((n, k), dtype=_operand_dtype(), device=x.device)
    if n and k:
        _pack_kernel[(triton.cdiv(n, PACK_ROWS), triton.cdiv(k, PACK_COLS))](
            x, x.stride(0), out, n, k, BR=PACK_ROWS, BC=PACK_COLS, STEP=step, INTERP=INTERPRET)
    return out


# ---- FP8 linear ------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M"])
def _fp8_kernel(xp_ptr, w_ptr, s_ptr, y_ptr, M, N, K, LDX, LDY, kchunk, S, XG,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, TOT_MEM: tl.constexpr,
                SWAP: tl.constexpr, INTERP: tl.constexpr):
    """y[BM x BN tile] = xp · Wᵀ: the S chunks of K in order, each from zero, added ((0 + p_0) + p_1) + ... (in
    registers, or TOT_MEM: in y itself, p_0 stored, then y + p_c); xp packed by pack_rows(step 64).
    XG > 0: weight rows [g XG, (g+1) XG) multiply xp's columns [g K, (g+1) K) (a grouped projection)."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP_M * n_n                 # the L2-friendly order: GROUP_M row tiles sweep the columns together
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    xoff = 0
    if XG > 0:
        xoff = (pid_n * BN // XG) * K
    i = tl.arange(0, BK)
    x_row = xp_ptr + offs_m[:, None].to(tl.int64) * LDX + xoff + i[None, :]
    w_off = offs_n[:, None] * K + i[None, :]                    # int32 offsets: fewer registers than pointers
    s_row = s_ptr + (offs_n // 32) * (K // 32)                  # [BN]: a step's two scale groups, k0/32 and + 1
    second = (_fp8_phys(i) >= 32)[None, :]                      # dot position i holds a k of the second group
    if SWAP:      # the weight is the MMA's A operand (it may stay in registers), the rows its N side: acc is yᵀ
        y_at = y_ptr + offs_m[None, :].to(tl.int64) * LDY + offs_n[:, None]
        y_ok = m_ok[None, :] & n_ok[:, None]
        SH0: tl.constexpr = BN
        SH1: tl.constexpr = BM
    else:
        y_at = y_ptr + offs_m[:, None].to(tl.int64) * LDY + offs_n[None, :]
        y_ok = m_ok[:, None] & n_ok[None, :]
        SH0: tl.constexpr = BM
        SH1: tl.constexpr = BN
    tot = tl.zeros((SH0, SH1), tl.float32)
    if TOT_MEM:
        tot = tl.zeros((16, 16), tl.float32)      # unused: the sum lives in y
    for c in range(S):
        acc = tl.zeros((SH0, SH1), tl.float32)
        for k0 in range(c * kchunk, (c + 1) * kchunk, BK):
            a = tl.load(x_row + k0, mask=m_ok[:, None], other=0.0)
            wq = tl.load(w_ptr + w_off + k0, mask=n_ok[:, None], other=0.0)
            c0 = tl.load(s_row + k0 // 32, mask=n_ok, other=127).to(tl.int32)
            c1 = tl.load(s_row + k0 // 32 + 1, mask=n_ok, other=127).to(tl.int32)
            f = (tl.where(second, c1[:, None], c0[:, None]) << 23).to(tl.float32, bitcast=True)
            wb = bf16_operand(_fp8_order(wq, BN).to(tl.float32) * f, INTERP)   # bytes permuted, then dequantised
            if SWAP:
                acc = mma(wb, tl.trans(a), acc, INTERP)
            else:
                acc = mma(a, tl.trans(wb), acc, INTERP)
        if TOT_MEM:
            if c == 0:
                tl.store(y_at, acc, mask=y_ok)                       # 0 + p_0 is p_0
            else:
                tl.store(y_at, tl.load(y_at, mask=y_ok, other=0.0) + acc, mask=y_ok)
            tl.debug_barrier()                    # the next chunk's read sees every thread's write
        else:
            tot = tot + acc
    if not TOT_MEM:
        tl.store(y_at, tot, mask=y_ok)


def prompt_fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, groups: int = 1,
                      cfg: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear.fp8_linear's function (y = bf16(x) · Wᵀ, float32 [n, out]) for prompt chunks, in the decode
    kernel's k order and K chunks (the same bits where the hardware sums alike). w float8_e4m3fn [out, in] with
    E8M0 scale [ceil(out/32), in/32] (bf16 weights keep the decode kernel: its k order is another); groups > 1:
    the block-diagonal product of a grouped projection (x [n, groups * in], w [groups * rows, in]), as fp8_linear_grouped. cfg: another configuration
    than the shape's (the bench's sweep; the same bits). out: float32 [n, out] with contiguous rows at any row
    stride (a column block of a wider result: the TP shards' wq_b products side by side, no cat) to write y into."""
    from kernels import fp8_linear as F
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"prompt fp8_linear: an FP8 weight (float8_e4m3fn), got {w.dtype}")
    out_f, in_f = w.shape
    cfg = cfg or fp8_config(out_f // groups, in_f)
    if groups > 1:
        rows = out_f // groups
        if x.dim() != 2 or x.shape[1] != groups * in_f or out_f % groups or rows % cfg.bn:
            raise ValueError(f"prompt fp8_linear: x {list(x.shape)} and w {list(w.shape)} for {groups} groups "
                             f"(group rows a multiple of {cfg.bn})")
        scale = F._check(x[:, :in_f], w[:rows], scale[:rows // 32] if scale is not None else None)
    else:
        scale = F._check(x, w, scale)
    if in_f % FP8_BK:
        raise ValueError(f"prompt fp8_linear: in ({in_f}) must be a multiple of {FP8_BK}")
    n = x.shape[0]
    if out is None:
        y = torch.empty((n, out_f), dtype=torch.float32, device=x.device)
    elif (out.dtype != torch.float32 or tuple(out.shape) != (n, out_f) or out.device != x.device
          or out.stride(1) != 1):
        raise ValueError(f"prompt fp8_linear: out must be float32 [{n}, {out_f}] with contiguous rows on {x.device}, "
                         f"got {out.dtype} {list(out.shape)}")
    else:
        y = out
    if n == 0:
        return y
    S = F.split_for(out_f // groups, in_f, F.CUDA)     # the decode kernel's chunks (a function of the shape)
    xp = pack_rows(x, FP8_BK)
    grid = (triton.cdiv(n, cfg.bm) * triton.cdiv(out_f, cfg.bn),)
    _fp8_kernel[grid](xp, w, scale, y, n, out_f, in_f, xp.shape[1], y.stride(0), in_f // S, S,
                      out_f // groups if groups > 1 else 0,
                      BM=cfg.bm, BN=cfg.bn, BK=FP8_BK, GROUP_M=cfg.group_m, TOT_MEM=cfg.tot_mem and S > 1, SWAP=cfg.swap,
                      INTERP=INTERPRET, num_warps=cfg.warps, num_stages=cfg.stages)
    return y


# ---- FP4 routed experts ----------------------------------------------------------------------------------------

@triton.jit
def _e2m1_tile(w_base, s_base, w_off, s_off, b0, BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr):
    """A [BN, BK = 128] weight step (packed bytes b0 .. b0 + 63 of each row) in the dot's k order, as bf16 operands.
    w_off / s_off [BN, 1]: the rows' int32 offsets from w_base / s_base (the expert's). Byte 16t + 4j + 2b + h
    holds the codes decode.cu's MMA pair of word j puts in slot 8h + 2t + b (low nibble: MMA 2j, high: 2j + 1):
    the bytes are put in the FP8 step's order (_fp8_order), then the nibbles interleaved per 16."""
    c = tl.arange(0, BK // 2)
    q = tl.load(w_base + w_off + b0 + c[None, :])                                       # [BN, 64], physical order
    code = tl.load(s_base + s_off + b0 // 16 + (c // 16)[None, :])                      # byte 16t.. : group t
    # fp4_moe's unpacking: prmt byte-table lookups, four codes an instruction, times 2^(code-127) in bf16 (exact)
    lo, hi = _unpack(q, code, BK // 2, True, INTERP)
    lo = _fp8_order(lo, BN)
    hi = _fp8_order(hi, BN)
    w = tl.reshape(tl.join(lo, hi), (BN, BK // 32, 16, 2))                             # [n, j, slot, s]
    return tl.reshape(tl.permute(w, (0, 1, 3, 2)), (BN, BK))                            # slice 2j + s


@triton.jit
def _tile_pairs(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BP: tl.constexpr):
    t = tl.program_id(0)
    cnt = tl.load(tile_cnt_ptr + t)
    e = tl.load(tile_e_ptr + t).to(tl.int64)
    p0 = tl.load(tile_start_ptr + t)
    offs = tl.arange(0, BP)
    ok = offs < cnt
    pair = tl.load(order_ptr + p0 + offs, mask=ok, other=0)
    return cnt, e, p0 + offs, pair, ok


@triton.jit
def _moe_up_kernel(xp_ptr, w_ptr, s_ptr, tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, rw_ptr, h_ptr,
                   H, I, TOPK, limit, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                   INTERP: tl.constexpr):
    """A work-list tile (up to BP pairs of one expert) x BN intermediate rows: gate and up over K = H in one chain
    each, then h = silu(min(gate, limit)) · clamp(up, ±limit) · routing weight, rounded to bf16 and stored at its
    dot position of the down product's k order. SWAP: the weight is the MMA's A operand, the pairs its N side
    (the tiles are transposed: [BN, BP])."""
    cnt, e, place, pair, ok = _tile_pairs(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BP)
    if cnt == 0:
        return
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    HB = H // 2
    w_base = w_ptr + e * 2 * I * HB                       # the expert's w1 rows, then its w3 rows
    s_base = s_ptr + e * 2 * I * (H // 32)
    w1 = offs_n[:, None] * HB
    w3 = w1 + I * HB
    s1 = offs_n[:, None] * (H // 32)
    s3 = s1 + I * (H // 32)
    x_row = xp_ptr + (pair // TOPK).to(tl.int64)[:, None] * H + tl.arange(0, BK)[None, :]
    if SWAP:
        SH0: tl.constexpr = BN
        SH1: tl.constexpr = BP
    else:
        SH0: tl.constexpr = BP
        SH1: tl.constexpr = BN
    acc_g = tl.zeros((SH0, SH1), tl.float32)
    acc_u = tl.zeros((SH0, SH1), tl.float32)
    for b0 in range(0, HB, BK // 2):
        a = tl.load(x_row + 2 * b0, mask=ok[:, None], other=0.0)
        w1t = _e2m1_tile(w_base, s_base, w1, s1, b0, BN, BK, INTERP)
        acc_g = _product(w1t, a, acc_g, SWAP, INTERP)
        w3t = _e2m1_tile(w_base, s_base, w3, s3, b0, BN, BK, INTERP)
        acc_u = _product(w3t, a, acc_u, SWAP, INTERP)
    rw = tl.load(rw_ptr + pair, mask=ok, other=0.0)
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    if INTERP:
        ex = tl.exp(-gate)
    else:
        ex = libdevice.exp(-gate)         # expf, as the CUDA C kernel
    col = (offs_n // BK) * BK + _fp4_slot(offs_n % BK)
    if SWAP:
        h = tl.math.div_rn(gate, 1.0 + ex) * up * rw[None, :]
        tl.store(h_ptr + place[None, :].to(tl.int64) * I + col[:, None], bf16_operand(h, INTERP), mask=ok[None, :])
    else:
        h = tl.math.div_rn(gate, 1.0 + ex) * up * rw[:, None]
        tl.store(h_ptr + place[:, None].to(tl.int64) * I + col[None, :], bf16_operand(h, INTERP), mask=ok[:, None])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, s_ptr, tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, y_ptr, H, I,
                     BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                     INTERP: tl.constexpr):
    """y[pair, BN columns] = h[place] · w2ᵀ over K = I in one chain (h already in the dot's k order)."""
    cnt, e, place, pair, ok = _tile_pairs(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BP)
    if cnt == 0:
        return
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    IB = I // 2
    w_base = w_ptr + e * H * IB
    s_base = s_ptr + e * H * (I // 32)
    w_off = offs_n[:, None] * IB
    s_off = offs_n[:, None] * (I // 32)
    h_row = h_ptr + place[:, None].to(tl.int64) * I + tl.arange(0, BK)[None, :]
    if SWAP:
        acc = tl.zeros((BN, BP), tl.float32)
    else:
        acc = tl.zeros((BP, BN), tl.float32)
    for b0 in range(0, IB, BK // 2):
        a = tl.load(h_row + 2 * b0, mask=ok[:, None], other=0.0)
        wt = _e2m1_tile(w_base, s_base, w_off, s_off, b0, BN, BK, INTERP)
        acc = _product(wt, a, acc, SWAP, INTERP)
    if SWAP:
        tl.store(y_ptr + pair[None, :].to(tl.int64) * H + offs_n[:, None], acc, mask=ok[None, :])
    else:
        tl.store(y_ptr + pair[:, None].to(tl.int64) * H + offs_n[None, :], acc, mask=ok[:, None])


def prompt_fp4_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                   expert_ids: torch.Tensor, weights: torch.Tensor, limit: float, cfg: Config | None = None,
                   shard_of: torch.Tensor | None = None, shards: int = 1) -> torch.Tensor:
    """fp4_moe.fp4_moe's function (the routed experts, slots summed in slot order; float32 [n, H]) for prompt
    chunks: the same device-built work list, the gate/up and down products as tensor-core tiles of a work-list
    tile's pairs x cfg.bn weight rows, the decode kernels' k order (the same bits where the hardware sums alike).
    cfg: another configuration than MOE_DEFAULT (the bench's sweep; the same bits). shard_of / shards: every TP
    shard's sum from one pass -> [shards, n, H], as fp4_moe.fp4_moe."""
    from kernels import fp4_moe as FM
    cfg = cfg or MOE_DEFAULT
    s13, s2 = FM._check(x, w13, s13, w2, s2, expert_ids, weights, FM.Config(bn_up=cfg.bn, bn_down=cfg.bn,
                                                                             bkb=MOE_BK // 2))
    n, hidden = x.shape
    n_exp, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = expert_ids.shape[1]
    FM.check_shard_of(shard_of, n_exp, x.device, "prompt fp4_moe")
    out = torch.empty((shards, n, hidden) if shard_of is not None else (n, hidden), dtype=torch.float32,
                      device=x.device)
    if n == 0 or top_k == 0:
        return out.zero_()
    ids = expert_ids.to(torch.int32).contiguous()
    # the torch form of the work list (a stable sort and a few scans, no host sync): the same four tensors as the
    # one-program kernel, which takes milliseconds at a prompt chunk's 10^4 pairs (bench/results/round-profile.md)
    tile_e, tile_start, tile_cnt, order = FM.work_list(ids, n_exp, cfg.bm)
    rw = weights.to(torch.float32).contiguous()
    n_pairs = n * top_k
    xp = pack_rows(x.contiguous(), MOE_BK)
    h = torch.empty((n_pairs, inter), dtype=_operand_dtype(), device=x.device)
    y = torch.empty((n_pairs, hidden), dtype=torch.float32, device=x.device)
    tiles = tile_cnt.numel()
    common = {"BP": cfg.bm, "BN": cfg.bn, "BK": MOE_BK, "SWAP": cfg.swap, "INTERP": INTERPRET, "num_warps": cfg.warps,
              "num_stages": cfg.stages}
    _moe_up_kernel[(tiles, inter // cfg.bn)](xp, w13, s13, tile_e, tile_start, tile_cnt, order, rw, h, hidden, inter,
                                             top_k, float(limit), **common)
    _moe_down_kernel[(tiles, hidden // cfg.bn)](h, w2, s2, tile_e, tile_start, tile_cnt, order, y, hidden, inter,
                                                **common)
    return FM._slot_sum(y, ids, shard_of, out)


# ---- may the op set use these kernels on a device? ---------------------------------------------------------------

_agrees: dict[int, bool] = {}


def agrees_with_decode(device: torch.device | int) -> bool:
    """Whether, on this device, the FP8 prompt product gives the decode kernel's bits (csrc/decode.cu, the CUDA C
    one): checked once per device on random non-zero inputs -- a product of 8 K chunks at 1, 65 and 300 rows -- and
    False where the CUDA C kernels do not run. The op set routes rows > PROMPT_ROWS here only when this holds: the
    bits then never depend on the row count. Inside a CUDA graph capture an unchecked device answers False (the
    decode kernel runs: the same bits) without checking. (The experts' bits: tests/test_kernels_prompt_gemm.py.)"""
    dev = device.index if isinstance(device, torch.device) else device
    if dev not in _agrees:
        if INTERPRET or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
            return False
        ok = False
        try:
            with torch.cuda.device(dev):
                ok = _decode_bits(torch.device("cuda", dev))
        except Exception as exc:  # noqa: BLE001 -- any failure: the decode kernels keep every row
            import sys
            print(f"kernels/prompt_gemm.py: not used on cuda:{dev} ({type(exc).__name__}: {exc})", file=sys.stderr)
        if not ok:
            import sys
            print(f"kernels/prompt_gemm.py: cuda:{dev} does not give the decode kernels' bits: the decode kernels "
                  "run every row count", file=sys.stderr)
        _agrees[dev] = ok
    return _agrees[dev]


def _decode_bits(dev: torch.device) -> bool:
    from kernels import cuda
    from kernels import fp8_linear as F
    if not cuda.available(dev.index):
        return False
    g = torch.Generator(device=dev).manual_seed(29)
    w = (torch.randn(256, 1024, device=dev, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(112, 122, (8, 32), dtype=torch.uint8, device=dev, generator=g)
    x = torch.randn(300, 1024, device=dev, generator=g) + 0.1
    y = prompt_fp8_linear(x, w, s)
    return all(torch.equal(F.fp8_linear(x[:n], w, s, cfg=F.CUDA), y[:n]) for n in (1, 65, 300))
