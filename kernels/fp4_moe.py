"""The routed experts of a round (FP4 E2M1 weights, E8M0 scales per 32 along K) as grouped launches over a
device-built work list.

Reference: the routed part of `dsv41.model.moe.MoE.__call__` on dequantised weights (`dequant_fp4`), with x and h
rounded to bf16: for each (row, slot) with expert e and routing weight r, w2(r · silu(min(w1x, limit)) ·
clamp(w3x, ±limit)); the slots of a row summed in slot order. The shared expert is not included (it is FP8: the
caller adds it, as moe.py does).

Launches: (0) the work list (one program: the (row, slot) pairs grouped by expert in tiles of up to BLOCK_M);
(1) gate/up: a program takes one tile and a column block of the intermediate dimension, streams w1's and w3's
rows of that block once, applies the clamped SwiGLU and the routing weight in registers and writes h; (2) down: the
same tiles times w2, each (row, slot) output written to its own place; (3) the slot sum per row in slot order.

Numerics (issue 24: like DeepSeek's inference code): x and h go to the tensor cores as bf16, the weights are
unpacked in registers exactly (an E2M1 value times a power of two is a bf16 value), fp32 accumulation. On the GPU
the unpacking is a byte-permute table lookup (`prmt`: four E2M1 codes -> four bf16 high/low bytes per instruction)
and one bf16x2 multiply by the scale; the interpreter computes the same values arithmetically.

Batch invariance by construction: every product is a tensor-core product of BP = 16 pairs (the weight as the A
operand, the pairs as N); a tile of up to 64 pairs is four such row tiles sharing each unpacked weight tile (a tile
past its pairs is skipped); the K order is fixed; each pair's output depends only on its own row, and the slot sum
has a fixed order. So a row's bits do not depend on the other rows of the round. The work list is built on the
device (no host synchronisation) and the grid is an upper bound on the number of tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_linear import INTERPRET, bf16_operand, mma
from kernels.pdl import wait_inputs

BLOCK_M = 64          # (row, slot) pairs per work-list tile: four row tiles of BP
BP = 16               # pairs per tensor-core product
# the slot sum's tile: one row by 256 columns, two warps (each element its own sum in slot order: any tile gives
# the same bits); 20 programs a row at V4.1's hidden size, where 8 x 512 tiles gave a 1-row round 10
SUM_ROWS, SUM_COLS, SUM_WARPS = 1, 256, 2


@dataclass(frozen=True)
class Config:
    """impl "cuda": the CUDA C kernels of csrc/decode.cu (kernels/cuda.py; fixed tiling: 64 weight rows a block,
    16-byte lane steps, the prmt table unpacking). impl "triton": the Triton kernels below with their gate/up column
    block (w1 and w3 rows each), down column block, packed bytes per K step, warps, stages,
    and whether the bytes are unpacked by the prmt table (GPU) or arithmetically."""
    impl: str = "triton"
    bn_up: int = 64
    bn_down: int = 128
    bkb: int = 64
    warps: int = 4
    stages: int = 4
    asm: bool = True
    post: bool = False   # scales applied to each 16-byte (32-wide K) step's product: bkb 16, no per-weight multiply
    lean: int = 0        # impl "cuda", up to 64 rows: the lean decode form with this many warps a block (1, 2, 4;
    #                      moe_*_lean_w<n>), 0: moe_*_t1 (the same bits either way). 0 by default until the H200
    #                      has timed the lean form (written in session 11 without a GPU: bench/kernels_bench.py
    #                      times both)
    f32_rows: int = 8    # lean rounds of up to this many rows: gate/up reads float32 x (no pack_x launch; same bits)


# The Triton kernels' configuration where the CUDA C ones cannot run: the best of the H200 sweep (2026-12-04: 10-16 %
# of the copy bandwidth; the CUDA C kernels 22-40 %) that keeps its registers.
DEFAULT = Config(bn_up=128, bn_down=128, bkb=16, post=True, warps=8, stages=6)
CUDA = Config(impl="cuda")


def config_for(device: torch.device, hidden: int = 0, inter: int = 0) -> Config:
    """The CUDA C kernels where they can run (decided once per device; H and I multiples of 128: whole 64-byte steps
    of both matrices' rows), else the Triton ones (their column blocks cut to the shapes: the small test models'
    I is 64)."""
    if device.type == "cuda" and not INTERPRET and hidden % 128 == 0 and inter % 128 == 0:
        from kernels import cuda
        if cuda.available(device.index):
            return CUDA
    if inter and (inter % DEFAULT.bn_up or hidden % DEFAULT.bn_down):
        return Config(bn_up=64 if inter % 128 else 128, bn_down=64 if hidden % 128 else 128, bkb=16, post=True,
                      warps=4, stages=6)
    return DEFAULT


# E2M1 magnitudes 0..7 as bf16: high bytes 00 3F 3F 3F 40 40 40 40, low bytes 00 00 80 C0 00 40 80 C0 (0, 0.5, 1,
# 1.5, 2, 3, 4, 6). prmt looks up four codes (one selector nibble each) in a two-register byte table at once.
_UNPACK_ASM = tl.constexpr("""
{
.reg .b32 m, m2, th0, th1, tl0, tl1, hb, lb, s, t, z;
mov.b32 z, 0;
mov.b32 th0, 0x3F3F3F00;
mov.b32 th1, 0x40404040;
mov.b32 tl0, 0xC0800000;
mov.b32 tl1, 0xC0804000;
and.b32 m, $4, 0x77777777;
prmt.b32 hb, th0, th1, m;
prmt.b32 lb, tl0, tl1, m;
prmt.b32 $0, lb, hb, 0x6240;
prmt.b32 $2, lb, hb, 0x7351;
prmt.b32 s, $4, z, 0x1404;
and.b32 t, s, 0x80008000;
or.b32 $2, $2, t;
shl.b32 t, s, 4;
and.b32 t, t, 0x80008000;
or.b32 $0, $0, t;
shr.b32 m2, m, 16;
prmt.b32 hb, th0, th1, m2;
prmt.b32 lb, tl0, tl1, m2;
prmt.b32 $1, lb, hb, 0x6240;
prmt.b32 $3, lb, hb, 0x7351;
prmt.b32 s, $4, z, 0x3424;
and.b32 t, s, 0x80008000;
or.b32 $3, $3, t;
shl.b32 t, s, 4;
and.b32 t, t, 0x80008000;
or.b32 $1, $1, t;
mul.rn.bf16x2 $0, $0, $5;
mul.rn.bf16x2 $1, $1, $6;
mul.rn.bf16x2 $2, $2, $5;
mul.rn.bf16x2 $3, $3, $6;
}
""")


# the same lookup without the scale (post-scaled configurations multiply each 32-wide K step's product instead)
_UNPACK_ASM_NOSCALE = tl.constexpr("\n".join(line for line in _UNPACK_ASM.value.splitlines()
                                              if not line.startswith("mul.")))


@triton.jit
def _e2m1(c):
    """E2M1 codes (int32 0..15: bit 3 sign, then e1 e0 m) -> float32 values, arithmetically."""
    mag = c & 7
    e = mag >> 1
    frac = (mag & 1).to(tl.float32) * 0.5
    v = tl.where(e == 0, frac, (1.0 + frac) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _unpack(q, code, BKB: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr, POST: tl.constexpr = False):
    """Packed bytes q (int8 [BN, BKB], low nibble = even k) and the E8M0 code of each byte's 32-wide K group (uint8
    [BN, BKB]) -> (even-k, odd-k) weights as bf16 operands [BN, BKB], value = E2M1 · 2^(code-127)."""
    if POST and ASM and not INTERP:
        lo, hi = tl.inline_asm_elementwise(_UNPACK_ASM_NOSCALE, "=r,=r,=r,=r,r", [q],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return lo, hi
    elif POST:
        b = q.to(tl.int32) & 0xFF
        return bf16_operand(_e2m1(b & 0xF), INTERP), bf16_operand(_e2m1(b >> 4), INTERP)
    elif ASM and not INTERP:
        f = (code.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)           # 2^(code-127) exactly (code >= 1)
        lo, hi = tl.inline_asm_elementwise(_UNPACK_ASM, "=r,=r,=r,=r,r,r,r", [q, f],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return lo, hi
    else:
        b = q.to(tl.int32) & 0xFF
        f = (code.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        return bf16_operand(_e2m1(b & 0xF) * f, INTERP), bf16_operand(_e2m1(b >> 4) * f, INTERP)


@triton.jit
def _scale_codes(s_row, b0, BN: tl.constexpr, BKB: tl.constexpr):
    """The E8M0 code of each byte of a [BN, BKB] weight step starting at byte b0 (16 bytes = one 32-wide group):
    loaded once per group, broadcast along the group's bytes. s_row: [BN] pointers to the rows' scale rows."""
    G: tl.constexpr = BKB // 16
    sc = tl.load(s_row[:, None] + b0 // 16 + tl.arange(0, G)[None, :])                   # [BN, G]
    return tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, G, 16)), (BN, BKB))


@triton.jit
def _tile(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BM: tl.constexpr):
    """The prologue both grouped kernels share: this program's work-list tile (axis 0) -> (pair count, expert,
    first place in `order`). A tile past the real work has count 0 (the caller returns)."""
    t = tl.program_id(0)
    cnt = tl.load(tile_cnt_ptr + t)
    e = tl.load(tile_e_ptr + t).to(tl.int64)
    p0 = tl.load(tile_start_ptr + t)
    return cnt, e, p0


@triton.jit
def _sub(order_ptr, p0, cnt, j: tl.constexpr, BP_: tl.constexpr):
    """Row tile j of a work-list tile: (places in the tile's h/y rows, the flat pair ids, mask)."""
    offs = j * BP_ + tl.arange(0, BP_)
    ok = offs < cnt
    pair = tl.load(order_ptr + p0 + offs, mask=ok, other=0)
    return p0 + offs, pair, ok


@triton.jit
def _k_step(wl, wh, xe, xo, acc, f, INTERP: tl.constexpr, POST: tl.constexpr):
    """acc + W_even · x_evenᵀ + W_odd · x_oddᵀ for one K step; POST: that step's product from zero times the rows'
    scales f [BN], added on."""
    if POST:
        part = mma(wl, tl.trans(xe), tl.zeros_like(acc), INTERP)
        return acc + mma(wh, tl.trans(xo), part, INTERP) * f[:, None]
    else:
        acc = mma(wl, tl.trans(xe), acc, INTERP)
        return mma(wh, tl.trans(xo), acc, INTERP)


@triton.jit
def _up_step(b0, x_ptr, rows, ok, acc_g, acc_u, wl1, wh1, wl3, wh3, f1, f3, H,
             BKB: tl.constexpr, INTERP: tl.constexpr, POST: tl.constexpr):
    ke = 2 * (b0 + tl.arange(0, BKB))                     # even k of the step; odd = ke + 1
    xr = x_ptr + rows[:, None] * H
    xe = bf16_operand(tl.load(xr + ke[None, :], mask=ok[:, None], other=0.0), INTERP)
    xo = bf16_operand(tl.load(xr + ke[None, :] + 1, mask=ok[:, None], other=0.0), INTERP)
    return _k_step(wl1, wh1, xe, xo, acc_g, f1, INTERP, POST), _k_step(wl3, wh3, xe, xo, acc_u, f3, INTERP, POST)


@triton.jit
def _weights(w, s_row, b0, BN: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr,
             POST: tl.constexpr):
    """One K step of a weight block: (even-k, odd-k) bf16 operands [BN, BKB] and, when POST, the rows' scale
    factors [BN] of the step's 32-wide group (else 1.0: the scales are in the operands)."""
    q = tl.load(w + (b0 + tl.arange(0, BKB))[None, :])
    if POST:
        code = tl.load(s_row + b0 // 16)
        f = (code.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        lo, hi = _unpack(q, q, BKB, ASM, INTERP, True)
        return lo, hi, f
    else:
        lo, hi = _unpack(q, _scale_codes(s_row, b0, BN, BKB), BKB, ASM, INTERP, False)
        return lo, hi, 1.0


@triton.jit
def _swiglu_store(acc_g, acc_u, rw_ptr, pair, ok, h_ptr, place, offs_n, I, limit):
    """h = silu(min(gate, limit)) · clamp(up, ±limit) · the routing weight, [BN, BP] -> h rows (bf16 values)."""
    rw = tl.load(rw_ptr + pair, mask=ok, other=0.0)
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up * rw[None, :]
    tl.store(h_ptr + place[None, :].to(tl.int64) * I + offs_n[:, None], h, mask=ok[None, :])


@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, s_ptr, tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, rw_ptr, h_ptr,
                   H, I, TOPK, limit, BM: tl.constexpr, BP_: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr,
                   ASM: tl.constexpr, INTERP: tl.constexpr, POST: tl.constexpr = False):
    cnt, e, p0 = _tile(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BM)
    if cnt == 0:
        return
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    HB = H // 2
    w1 = w_ptr + (e * 2 * I + offs_n)[:, None] * HB       # [BN, 1] row pointers (w3's rows are I further)
    w3 = w1 + I * HB
    s1 = s_ptr + (e * 2 * I + offs_n) * (H // 32)         # [BN] scale rows
    s3 = s1 + I * (H // 32)
    place0, pair0, ok0 = _sub(order_ptr, p0, cnt, 0, BP_)
    place1, pair1, ok1 = _sub(order_ptr, p0, cnt, 1, BP_)
    place2, pair2, ok2 = _sub(order_ptr, p0, cnt, 2, BP_)
    place3, pair3, ok3 = _sub(order_ptr, p0, cnt, 3, BP_)
    rows0 = (pair0 // TOPK).to(tl.int64)
    rows1 = (pair1 // TOPK).to(tl.int64)
    rows2 = (pair2 // TOPK).to(tl.int64)
    rows3 = (pair3 // TOPK).to(tl.int64)
    g0 = tl.zeros((BN, BP_), tl.float32)
    u0 = tl.zeros((BN, BP_), tl.float32)
    g1 = tl.zeros((BN, BP_), tl.float32)
    u1 = tl.zeros((BN, BP_), tl.float32)
    g2 = tl.zeros((BN, BP_), tl.float32)
    u2 = tl.zeros((BN, BP_), tl.float32)
    g3 = tl.zeros((BN, BP_), tl.float32)
    u3 = tl.zeros((BN, BP_), tl.float32)
    for b0 in range(0, HB, BKB):
        wl1, wh1, f1 = _weights(w1, s1, b0, BN, BKB, ASM, INTERP, POST)
        wl3, wh3, f3 = _weights(w3, s3, b0, BN, BKB, ASM, INTERP, POST)
        g0, u0 = _up_step(b0, x_ptr, rows0, ok0, g0, u0, wl1, wh1, wl3, wh3, f1, f3, H, BKB, INTERP, POST)
        if cnt > BP_:
            g1, u1 = _up_step(b0, x_ptr, rows1, ok1, g1, u1, wl1, wh1, wl3, wh3, f1, f3, H, BKB, INTERP, POST)
        if cnt > 2 * BP_:
            g2, u2 = _up_step(b0, x_ptr, rows2, ok2, g2, u2, wl1, wh1, wl3, wh3, f1, f3, H, BKB, INTERP, POST)
        if cnt > 3 * BP_:
            g3, u3 = _up_step(b0, x_ptr, rows3, ok3, g3, u3, wl1, wh1, wl3, wh3, f1, f3, H, BKB, INTERP, POST)
    _swiglu_store(g0, u0, rw_ptr, pair0, ok0, h_ptr, place0, offs_n, I, limit)
    _swiglu_store(g1, u1, rw_ptr, pair1, ok1, h_ptr, place1, offs_n, I, limit)
    _swiglu_store(g2, u2, rw_ptr, pair2, ok2, h_ptr, place2, offs_n, I, limit)
    _swiglu_store(g3, u3, rw_ptr, pair3, ok3, h_ptr, place3, offs_n, I, limit)


@triton.jit
def _down_step(h_ptr, place, ok, b0, acc, wl, wh, f, I, BKB: tl.constexpr, INTERP: tl.constexpr,
               POST: tl.constexpr):
    ke = 2 * (b0 + tl.arange(0, BKB))
    hr = h_ptr + place[:, None].to(tl.int64) * I
    he = bf16_operand(tl.load(hr + ke[None, :], mask=ok[:, None], other=0.0), INTERP)
    ho = bf16_operand(tl.load(hr + ke[None, :] + 1, mask=ok[:, None], other=0.0), INTERP)
    return _k_step(wl, wh, he, ho, acc, f, INTERP, POST)


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, s_ptr, tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, y_ptr, H, I,
                     BM: tl.constexpr, BP_: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, ASM: tl.constexpr,
                     INTERP: tl.constexpr, POST: tl.constexpr = False):
    cnt, e, p0 = _tile(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BM)
    if cnt == 0:
        return
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    IB = I // 2
    w = w_ptr + (e * H + offs_n)[:, None] * IB
    s = s_ptr + (e * H + offs_n) * (I // 32)
    place0, pair0, ok0 = _sub(order_ptr, p0, cnt, 0, BP_)
    place1, pair1, ok1 = _sub(order_ptr, p0, cnt, 1, BP_)
    place2, pair2, ok2 = _sub(order_ptr, p0, cnt, 2, BP_)
    place3, pair3, ok3 = _sub(order_ptr, p0, cnt, 3, BP_)
    a0 = tl.zeros((BN, BP_), tl.float32)
    a1 = tl.zeros((BN, BP_), tl.float32)
    a2 = tl.zeros((BN, BP_), tl.float32)
    a3 = tl.zeros((BN, BP_), tl.float32)
    for b0 in range(0, IB, BKB):
        wl, wh, f = _weights(w, s, b0, BN, BKB, ASM, INTERP, POST)
        a0 = _down_step(h_ptr, place0, ok0, b0, a0, wl, wh, f, I, BKB, INTERP, POST)
        if cnt > BP_:
            a1 = _down_step(h_ptr, place1, ok1, b0, a1, wl, wh, f, I, BKB, INTERP, POST)
        if cnt > 2 * BP_:
            a2 = _down_step(h_ptr, place2, ok2, b0, a2, wl, wh, f, I, BKB, INTERP, POST)
        if cnt > 3 * BP_:
            a3 = _down_step(h_ptr, place3, ok3, b0, a3, wl, wh, f, I, BKB, INTERP, POST)
    for_store = offs_n[:, None]
    tl.store(y_ptr + pair0[None, :].to(tl.int64) * H + for_store, a0, mask=ok0[None, :])
    tl.store(y_ptr + pair1[None, :].to(tl.int64) * H + for_store, a1, mask=ok1[None, :])
    tl.store(y_ptr + pair2[None, :].to(tl.int64) * H + for_store, a2, mask=ok2[None, :])
    tl.store(y_ptr + pair3[None, :].to(tl.int64) * H + for_store, a3, mask=ok3[None, :])


@triton.jit
def _shard_slot_sum(y_ptr, ids_ptr, shard_ptr, r, r_ok, c, ok, H, TOPK: tl.constexpr, shard, BR: tl.constexpr,
                    BH: tl.constexpr, SHARDED: tl.constexpr):
    """0 + y[r, 0] + y[r, 1] + … over the slots whose expert is on this rank (id >= 0), in slot order; SHARDED: only
    those whose expert is in TP shard `shard` (shard_ptr[id] == shard): the other slots add exact zeros, as in a
    pass with them masked to -1. The slots unrolled (TOPK a constexpr): their id, shard and value loads need not
    wait for the adds before them (a loop over a runtime count paid three load latencies a slot)."""
    acc = tl.zeros((BR, BH), tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + r * TOPK + j, mask=r_ok, other=-1)
        here = e >= 0
        if SHARDED:
            here = here & (tl.load(shard_ptr + tl.maximum(e, 0), mask=here, other=-1) == shard)
        acc = acc + tl.load(y_ptr + (r * TOPK + j)[:, None] * H + c[None, :], mask=ok & here[:, None], other=0.0)
    return acc


@triton.jit
def _slot_sum_kernel(y_ptr, ids_ptr, shard_ptr, out_ptr, a0_ptr, a1_ptr, N, H, TOPK: tl.constexpr, BR: tl.constexpr,
                     BH: tl.constexpr, SHARDED: tl.constexpr, TOTAL: tl.constexpr, ADD0: tl.constexpr,
                     ADD1: tl.constexpr, PDL: tl.constexpr):
    """out[r]: the slot sum (_shard_slot_sum). SHARDED: out[s, r] (s = program axis 2) each TP shard's. TOTAL (two
    shards): out[r] = (sum_0 [+ a0[r]]) + (sum_1 [+ a1[r]]), each shard's part with its addend (its share of the
    shared expert, where ADDi) and the parts added in shard order: MoE.__call__'s sum over shards, one launch."""
    wait_inputs(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    r_ok = r < N
    ok = r_ok[:, None] & (c < H)[None, :]
    r = r.to(tl.int64)
    at = r[:, None] * H + c[None, :]
    if TOTAL:
        acc = _shard_slot_sum(y_ptr, ids_ptr, shard_ptr, r, r_ok, c, ok, H, TOPK, 0, BR, BH, True)
        if ADD0:
            acc = acc + tl.load(a0_ptr + at, mask=ok, other=0.0)
        part = _shard_slot_sum(y_ptr, ids_ptr, shard_ptr, r, r_ok, c, ok, H, TOPK, 1, BR, BH, True)
        if ADD1:
            part = part + tl.load(a1_ptr + at, mask=ok, other=0.0)
        acc = acc + part
    else:
        acc = _shard_slot_sum(y_ptr, ids_ptr, shard_ptr, r, r_ok, c, ok, H, TOPK, tl.program_id(2), BR, BH,
                              SHARDED)
        if SHARDED:
            out_ptr += tl.program_id(2).to(tl.int64) * N * H
    tl.store(out_ptr + at, acc, mask=ok)


@triton.jit
def _work_list_kernel(ids_ptr, n_pairs, n_exp, n_tiles, cursor_ptr, order_ptr, tile_e_ptr, tile_start_ptr,
                      tile_cnt_ptr, EP: tl.constexpr, BP: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr):
    """`work_list` in one program (one launch instead of ~36 torch ops): integer work only. Keys: the expert id,
    n_exp for a slot of another rank (id < 0; sorted last, in no tile), EP - 1 for the padding of a block (dropped).
    Counts per key, then a stable counting sort (a pair's place: its key's start + the pairs of that key before it),
    then each tile's expert, start and count as the torch version computes them."""
    e_idx = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    for p0 in range(0, n_pairs, BP):
        p = p0 + tl.arange(0, BP)
        key = tl.load(ids_ptr + p, mask=p < n_pairs, other=-2)
        key = tl.where(key >= 0, key, tl.where(key == -2, EP - 1, n_exp))
        counts += tl.sum((key[:, None] == e_idx[None, :]).to(tl.int32), axis=0)
    counts = tl.where(e_idx < EP - 1, counts, 0)
    pair_start = tl.cumsum(counts, axis=0) - counts
    tl.store(cursor_ptr + e_idx, pair_start)
    tl.debug_barrier()
    ii = tl.arange(0, BP)
    for p0 in range(0, n_pairs, BP):
        p = p0 + ii
        ok = p < n_pairs
        key = tl.load(ids_ptr + p, mask=ok, other=-2)
        key = tl.where(key >= 0, key, tl.where(key == -2, EP - 1, n_exp))
        same_before = (key[:, None] == key[None, :]) & (ii[None, :] < ii[:, None])
        rank = tl.sum(same_before.to(tl.int32), axis=1)
        base = tl.load(cursor_ptr + key, mask=ok, other=0)
        tl.store(order_ptr + base + rank, p, mask=ok)
        tl.debug_barrier()
        tl.store(cursor_ptr + e_idx, tl.load(cursor_ptr + e_idx)
                 + tl.sum((key[:, None] == e_idx[None, :]).to(tl.int32), axis=0), mask=e_idx < EP - 1)
        tl.debug_barrier()
    real = e_idx < n_exp
    tiles = tl.where(real, (counts + BM - 1) // BM, 0)
    tile_end = tl.cumsum(tiles, axis=0)
    for t0 in range(0, n_tiles, BT):
        t = t0 + tl.arange(0, BT)
        e = tl.sum(((tile_end[None, :] <= t[:, None]) & real[None, :]).to(tl.int32), axis=1)   # searchsorted right
        live = e < n_exp
        e = tl.minimum(e, n_exp - 1)
        hit = e[:, None] == e_idx[None, :]
        t_e = tl.sum(tl.where(hit, tiles[None, :], 0), axis=1)
        end_e = tl.sum(tl.where(hit, tile_end[None, :], 0), axis=1)
        cnt_e = tl.sum(tl.where(hit, counts[None, :], 0), axis=1)
        start_e = tl.sum(tl.where(hit, pair_start[None, :], 0), axis=1)
        off = (t - (end_e - t_e)) * BM
        cnt = tl.where(live, tl.minimum(tl.maximum(cnt_e - off, 0), BM), 0)
        t_ok = t < n_tiles
        tl.store(tile_e_ptr + t, e, mask=t_ok)
        tl.store(tile_start_ptr + t, start_e + off, mask=t_ok)
        tl.store(tile_cnt_ptr + t, cnt, mask=t_ok)


def max_tiles(n_pairs: int, n_experts: int, block_m: int = BLOCK_M) -> int:
    """Upper bound on the work list's tiles: Σ_e ceil(c_e / block_m) <= n_pairs // block_m + #experts touched."""
    return n_pairs // block_m + min(n_experts, n_pairs)


def work_list(expert_ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """(tile_expert, tile_start, tile_count, order), all on the ids' device, built without host synchronisation.
    `order` lists the flat (row * k + slot) pair indices grouped by expert (ascending id, stable: row order within
    an expert; slots with id < 0 go last and belong to no tile); tile t covers order[tile_start[t] : + tile_count[t]]
    of expert tile_expert[t] (up to block_m pairs; kernels/prompt_gemm.py takes larger tiles); tiles past the real
    work have count 0."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    n_pairs = flat.numel()
    key = torch.where(flat >= 0, flat, n_experts)
    order = torch.argsort(key, stable=True).to(torch.int32)
    # scatter_add, not bincount: bincount reads the maximum back to the host
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key))[:n_experts]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    pair_start = torch.cumsum(counts, 0) - counts
    t = torch.arange(max_tiles(n_pairs, n_experts, block_m), device=flat.device)
    e = torch.searchsorted(tile_end, t, right=True)
    live = e < n_experts
    e = e.clamp(max=n_experts - 1)
    off = (t - (tile_end[e] - tiles[e])) * block_m
    cnt = torch.where(live, (counts[e] - off).clamp(0, block_m), 0)
    return e.to(torch.int32), (pair_start[e] + off).to(torch.int32), cnt.to(torch.int32), order


WL_PAIRS, WL_TILES = 64, 64
# Pairs above which fp4_moe builds its work list with the torch ops of `work_list` (the same four tensors): the one
# program's counting sort is serial over blocks of 64 pairs, ~0.9 ms at a 2048-row prompt chunk's 12288 pairs
# (bench/results/round-profile.md, `_work_list_kernel`), where a sort and a few scans take tens of microseconds.
# Above every CUDA graph's row bucket (192 rows x 6 slots), so captured rounds keep their one launch.
WL_ONE_PROGRAM_PAIRS = 4096


def work_list_launch(expert_ids: torch.Tensor, n_experts: int):
    """`work_list` in one kernel launch (the same four tensors, bit for bit: tests/test_kernels_fp4_moe.py)."""
    flat = expert_ids.reshape(-1).to(torch.int32).contiguous()
    n_pairs = flat.numel()
    n_tiles = max_tiles(n_pairs, n_experts)
    dev = flat.device
    ep = triton.next_power_of_2(n_experts + 2)
    cursor = torch.empty(ep, dtype=torch.int32, device=dev)
    order = torch.empty(n_pairs, dtype=torch.int32, device=dev)
    tile_e, tile_start, tile_cnt = (torch.empty(n_tiles, dtype=torch.int32, device=dev) for _ in range(3))
    _work_list_kernel[(1,)](flat, n_pairs, n_experts, n_tiles, cursor, order, tile_e, tile_start, tile_cnt,
                            EP=ep, BP=WL_PAIRS, BT=WL_TILES, BM=BLOCK_M, num_warps=4)
    return tile_e, tile_start, tile_cnt, order


def work_list_cuda(expert_ids: torch.Tensor, n_experts: int):
    """`work_list` for up to 1024 pairs and 1023 experts in one CUDA C block (csrc/decode.cu `work_list_small`): the
    same four tensors, bit for bit (tests/test_kernels_fp4_worklist.py), in a few microseconds where the one-program
    Triton version took ~50 (bench/results/round-profile.md)."""
    from kernels import cuda
    flat = expert_ids.reshape(-1).to(torch.int32).contiguous()
    n_pairs = flat.numel()
    n_tiles = max_tiles(n_pairs, n_experts)
    dev = flat.device
    order = torch.empty(n_pairs, dtype=torch.int32, device=dev)
    tile_e, tile_start, tile_cnt = (torch.empty(n_tiles, dtype=torch.int32, device=dev) for _ in range(3))
    cuda.launch(cuda.function("decode.cu", "work_list_small", dev.index), (1, 1, 1), 1024,
                [flat, n_pairs, n_experts, n_tiles, order, tile_e, tile_start, tile_cnt])
    return tile_e, tile_start, tile_cnt, order


def stack_experts(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(w1, s1, w3, s3, w2, s2), …] (checkpoint tensors of each local expert, in local id order) -> (w13 int8
    [E, 2I, H/2], s13 uint8 [E, 2I, H/32], w2 int8 [E, H, I/2], s2 uint8 [E, H, I/32]) on the first one's device."""
    def u8(s):
        return s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s
    w13 = torch.stack([torch.cat([w1.view(torch.int8), w3.view(torch.int8)]) for w1, _, w3, _, _, _ in experts])
    s13 = torch.stack([torch.cat([u8(s1), u8(s3)]) for _, s1, _, s3, _, _ in experts])
    w2 = torch.stack([w.view(torch.int8) for _, _, _, _, w, _ in experts])
    s2 = torch.stack([u8(s) for _, _, _, _, _, s in experts])
    return w13, s13, w2, s2


def _check(x, w13, s13, w2, s2, expert_ids, weights, cfg: Config):
    if s13.dtype == torch.float8_e8m0fnu:
        s13 = s13.view(torch.uint8)
    if s2.dtype == torch.float8_e8m0fnu:
        s2 = s2.view(torch.uint8)
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp4_moe: x must be float32/bfloat16 [n, H], got {x.dtype} {list(x.shape)}")
    n, hidden = x.shape
    if w13.dim() != 3 or w13.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"fp4_moe: w13 must be packed int8 [E, 2I, H/2], got {w13.dtype} {list(w13.shape)}")
    n_exp, two_i, _hb = w13.shape
    inter = two_i // 2
    want = {"w13": (w13, (n_exp, 2 * inter, hidden // 2)), "s13": (s13, (n_exp, 2 * inter, hidden // 32)),
            "w2": (w2, (n_exp, hidden, inter // 2)), "s2": (s2, (n_exp, hidden, inter // 32))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"fp4_moe: {name} must be {list(shape)} for x {list(x.shape)}, got {list(t.shape)}")
        if not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"fp4_moe: {name} must be contiguous on {x.device}")
    if s13.dtype != torch.uint8 or s2.dtype != torch.uint8 or w2.dtype not in (torch.int8, torch.uint8):
        raise TypeError("fp4_moe: scales must be uint8/float8_e8m0fnu and w2 packed int8")
    if hidden % (2 * cfg.bkb) or inter % cfg.bn_up or inter % (2 * cfg.bkb) or hidden % cfg.bn_down:
        raise ValueError(f"fp4_moe: H={hidden} must be a multiple of {max(2 * cfg.bkb, cfg.bn_down)} and "
                         f"I={inter} of {max(cfg.bn_up, 2 * cfg.bkb)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != n or weights.shape != expert_ids.shape:
        raise ValueError(f"fp4_moe: expert_ids and weights must be [{n}, k], got {list(expert_ids.shape)} "
                         f"and {list(weights.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"fp4_moe: expert_ids must be int32/int64, got {expert_ids.dtype}")
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("fp4_moe runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    return s13, s2


def check_shard_of(shard_of: torch.Tensor | None, n_exp: int, device: torch.device, who: str) -> None:
    """shard_of, when given, is each stacked expert's TP shard: int32 [n_exp] on the activations' device."""
    if shard_of is not None and (shard_of.shape != (n_exp,) or shard_of.dtype != torch.int32
                                 or shard_of.device != device):
        raise ValueError(f"{who}: shard_of must be int32 [{n_exp}] on {device}")


def fp4_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
            expert_ids: torch.Tensor, weights: torch.Tensor, limit: float, cfg: Config | None = None,
            shard_of: torch.Tensor | None = None, shards: int = 1, addends: tuple | None = None) -> torch.Tensor:
    """Σ over slots (in slot order) of w2(weight · silu(min(w1x, limit)) · clamp(w3x, ±limit)) for each row's
    experts -> float32 [n, H]; equals the routed part of `MoE.__call__` with `dequant_fp4` weights and x, h
    rounded to bf16, up to the fp32 summation order. Slots with expert id < 0 (another rank's) contribute nothing.
    Layouts: docs/kernels.md. cfg: a configuration other than DEFAULT (the bench's sweep).

    shard_of (int32 [E]: each stacked expert's tensor-parallel shard, 0..shards-1): one pass over every pair, then
    each shard's own slot sum -> float32 [shards, n, H]; out[s] has the bits of a call with the slots of the other
    shards' experts set to -1 (a pair's output does not depend on the other pairs of the launch, and the slot sum
    adds the same terms in the same order). addends (with shard_of, two shards): a tensor [n, H] or None per shard
    -> float32 [n, H], (out[0] + addends[0]) + (out[1] + addends[1]) in one launch (MoE.__call__'s sum of the
    shards' parts with their shares of the shared expert, the same additions)."""
    if addends is not None and (shard_of is None or shards != 2 or len(addends) != 2):
        raise ValueError("fp4_moe: addends take shard_of over two shards, one addend (or None) each")
    cfg = cfg or config_for(x.device, x.shape[1], w13.shape[1] // 2)
    if cfg.impl == "cuda" and cfg.lean not in (0, 1, 2, 4):
        raise ValueError(f"fp4_moe: lean must be 0, 1, 2 or 4 warps, got {cfg.lean}")
    if cfg.post and cfg.bkb != 16:
        raise ValueError(f"fp4_moe: a post-scaled configuration steps 16 bytes, not {cfg.bkb}")
    s13, s2 = _check(x, w13, s13, w2, s2, expert_ids, weights, cfg)
    x = x.contiguous()
    n, hidden = x.shape
    n_exp, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = expert_ids.shape[1]
    check_shard_of(shard_of, n_exp, x.device, "fp4_moe")
    sharded = shard_of is not None
    out = torch.empty((shards, n, hidden) if sharded and addends is None else (n, hidden), dtype=torch.float32,
                      device=x.device)
    if n == 0 or top_k == 0:
        out.zero_()
        if addends is not None:     # the slot sums are zeros: the total is the addends', added as the kernel would
            parts = [out if a is None else out + a for a in addends]
            return parts[0] + parts[1]
        return out
    ids = expert_ids.to(torch.int32).contiguous()
    if cfg.impl == "cuda" and n * top_k <= 1024 and n_exp < 1024:
        tile_e, tile_start, tile_cnt, order = work_list_cuda(ids, n_exp)
    elif n * top_k > WL_ONE_PROGRAM_PAIRS:
        tile_e, tile_start, tile_cnt, order = work_list(ids, n_exp)
    else:
        tile_e, tile_start, tile_cnt, order = work_list_launch(ids, n_exp)
    rw = weights.to(torch.float32).contiguous()
    n_pairs = n * top_k
    y = torch.empty((n_pairs, hidden), dtype=torch.float32, device=x.device)
    tiles = tile_cnt.numel()
    if cfg.impl == "cuda":
        from kernels import cuda
        dev = x.device.index
        if x.dtype != torch.float32 or x.data_ptr() % 16:
            x = x.float().clone() if x.data_ptr() % 16 else x.float()
        # a tile holds at most min(n, 64) pairs (a row picks an expert once). A decode round (n <= 64, an expert
        # has one or two pairs) takes one row tile of 8 and loops over a tile's pairs in chunks of 8 (fewer
        # registers, more blocks per SM); a prompt chunk the fewest row tiles that hold a tile, so its experts'
        # weights stream once. The bits are the same either way (each pair's MMA chain does not change).
        from kernels.fp8_linear import row_tiles
        rt = 1 if n <= BLOCK_M else row_tiles(BLOCK_M)
        from kernels.fp8_linear import pack_x
        # bf16 fragments of the rows (the up kernel's B operand); a round of up to cfg.f32_rows rows lets the lean
        # up kernel round float32 x itself (the same cvt.rn: the same bits, one launch fewer)
        x32 = rt == 1 and cfg.lean > 0 and n <= cfg.f32_rows
        xq = x if x32 else pack_x(x, 2)
        hq = torch.empty((n_pairs, inter), dtype=torch.int16, device=x.device)   # bf16 h, in the same order
        # a decode round: the lean one-row-tile form (cfg.lean warps a block: 6 experts at one row still fill every
        # SM); its pairs' MMA chains are the t forms' (the same bits)
        lean = rt == 1 and cfg.lean > 0
        form, rows_b = (f"lean_w{cfg.lean}", 16 * cfg.lean) if lean else (f"t{rt}", 64)
        up = f"moe_up_lean_x_w{cfg.lean}" if x32 else f"moe_up_{form}"
        cuda.launch(cuda.function("decode.cu", up, dev), (tiles, inter // rows_b, 1), 2 * rows_b,
                    [xq, w13, s13, tile_e, tile_start, tile_cnt, order, rw, hq, hidden, inter, top_k, float(limit)])
        cuda.launch(cuda.function("decode.cu", f"moe_down_{form}", dev), (tiles, hidden // rows_b, 1), 2 * rows_b,
                    [hq, w2, s2, tile_e, tile_start, tile_cnt, order, y, hidden, inter])
        return _slot_sum(y, ids, shard_of, out, addends)
    h = torch.empty((n_pairs, inter), dtype=torch.float32, device=x.device)
    common = {"BM": BLOCK_M, "BP_": BP, "BKB": cfg.bkb, "ASM": cfg.asm, "INTERP": INTERPRET, "POST": cfg.post,
              "num_warps": cfg.warps, "num_stages": cfg.stages}
    _moe_up_kernel[(tiles, inter // cfg.bn_up)](
        x, w13, s13, tile_e, tile_start, tile_cnt, order, rw, h, hidden, inter, top_k, float(limit),
        BN=cfg.bn_up, **common)
    _moe_down_kernel[(tiles, hidden // cfg.bn_down)](
        h, w2, s2, tile_e, tile_start, tile_cnt, order, y, hidden, inter, BN=cfg.bn_down, **common)
    return _slot_sum(y, ids, shard_of, out, addends)


def _slot_sum(y: torch.Tensor, ids: torch.Tensor, shard_of: torch.Tensor | None, out: torch.Tensor,
              addends: tuple | None = None) -> torch.Tensor:
    """The pairs' outputs y [n * k, H] summed per row in slot order into out ([n, H], or [shards, n, H] per shard
    of shard_of) in one launch; addends (two shards: each shard's tensor [n, H] or None): out [n, H] the total over
    the shards, each with its addend (_slot_sum_kernel's TOTAL)."""
    n, top_k = ids.shape
    hidden = y.shape[1]
    total = addends is not None
    shards = 1 if total or shard_of is None else out.shape[0]
    a0, a1 = ((a.contiguous() if a is not None else out) for a in addends) if total else (out, out)
    _slot_sum_kernel[(triton.cdiv(n, SUM_ROWS), triton.cdiv(hidden, SUM_COLS), shards)](
        y, ids, ids if shard_of is None else shard_of, out, a0, a1, n, hidden, top_k, BR=SUM_ROWS, BH=SUM_COLS,
        SHARDED=shard_of is not None, TOTAL=total, ADD0=total and addends[0] is not None,
        ADD1=total and addends[1] is not None, num_warps=SUM_WARPS, **pdl.options(out))
    return out
