"""The routed experts of a round (FP4 E2M1 weights, E8M0 scales per 32 along K) as grouped launches over a
device-built work list.

Reference: the routed part of `dsv41.model.moe.MoE.__call__` on dequantised weights (`dequant_fp4`): for each
(row, slot) with expert e and routing weight r, `swiglu(x, expert e, limit, r)` = w2(r · silu(min(w1x, limit)) ·
clamp(w3x, ±limit)); the slots of a row summed in slot order. The shared expert is not included (it is FP8: the
caller adds it with `fp8_linear`, after the routed sum, as moe.py does).

Launches: (1) gate/up: a program takes one tile of up to BLOCK_M (row, slot) pairs of one expert and a column tile
of the intermediate dimension, reads w1's and w3's rows of that tile together, applies the clamped SwiGLU and the
routing weight in registers and writes h (fp32); (2) down: the same tiles times w2, each (row, slot) output written
to its own place; (3) the slot sum per row in slot order. Weights are unpacked in registers (exact in bf16: an E2M1
value times a power of two); activations (x, then h) are split into bf16 hi + lo parts, both multiplied on the
tensor cores with fp32 accumulation, so the products are float32's to ~1e-5 relative.

Exactness: fixed tile sizes and K order for every row count; each pair's output is computed from its own row only
and the slot sum has a fixed order, so a row's bits do not depend on the other rows of the round. The work list is
built on the device (no host synchronisation) and the grid is an upper bound on the number of tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_linear import INTERPRET, bf16_operand, mma, split_bf16

BLOCK_M = 64          # (row, slot) pairs per tile
BLOCK_N_UP = 64       # intermediate columns per gate/up program (w1 and w3 tiles together)
BLOCK_N_DOWN = 128    # hidden columns per down program
BLOCK_KB = 32         # packed bytes (64 k) per step
NUM_WARPS, NUM_STAGES = 4, 3
SUM_ROWS, SUM_COLS = 8, 512


@triton.jit
def _fp4_pair(q, s_a, s_b, BKB: tl.constexpr, INTERP: tl.constexpr):
    """Packed bytes q (int8 [BKB, BN], BKB = 32: two 16-byte scale groups) and the E8M0 codes of the two groups
    (s_a, s_b: [BN]) -> (even-k, odd-k) weights as bf16 operands. E2M1 code c as fp16 bits (c&7)<<9 | (c&8)<<12 is
    the value times 2^-14 (the subnormal 0.5 included), so the factor is 2^(s-127+14) (codes up to 240)."""
    b = q.to(tl.int32)
    f_a = ((s_a.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)     # per column, then per element
    f_b = ((s_b.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    f = tl.where(tl.arange(0, BKB)[:, None] < 16, f_a[None, :], f_b[None, :])
    vlo = (((b & 0x7) << 9) | ((b & 0x8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    vhi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return bf16_operand(vlo * f, INTERP), bf16_operand(vhi * f, INTERP)


@triton.jit
def _fp4_mma(xt, wq, s_row, g0, acc, BM: tl.constexpr, BKB: tl.constexpr, SCALED: tl.constexpr,
             INTERP: tl.constexpr):
    """acc + xt · W for one K step of 2·BKB: xt [BM, 2·BKB] activations (float32/bf16), wq [BKB, BN] packed bytes of
    W (low nibble = even k), s_row [BN] pointers to the scale rows, g0 the step's first scale group. xt is split
    into bf16 hi + lo parts (split_bf16), each multiplied by the same unpacked W, so the product is float32's.
    SCALED: Triton's microscaling product (tl.dot_scaled, bf16 x e2m1 with E8M0 scales per 32 along K); else the
    bytes are unpacked here and x is split into even and odd k for bf16 products with the low and high nibbles."""
    x_hi, x_lo = split_bf16(xt, INTERP)
    if SCALED:
        s = tl.load(s_row[:, None] + g0 + tl.arange(0, BKB // 16)[None, :])               # [BN, groups]
        wu = wq.to(tl.uint8, bitcast=True)
        acc = tl.dot_scaled(x_hi.to(tl.bfloat16), None, "bf16", wu, s, "e2m1", acc)
        return tl.dot_scaled(x_lo.to(tl.bfloat16), None, "bf16", wu, s, "e2m1", acc)
    else:
        he, ho = tl.split(tl.reshape(x_hi, (BM, BKB, 2)))                                  # even k, odd k
        le, lo_ = tl.split(tl.reshape(x_lo, (BM, BKB, 2)))
        w_even, w_odd = _fp4_pair(wq, tl.load(s_row + g0), tl.load(s_row + g0 + 1), BKB, INTERP)
        acc = mma(he, w_even, acc, INTERP)
        acc = mma(le, w_even, acc, INTERP)
        acc = mma(ho, w_odd, acc, INTERP)
        return mma(lo_, w_odd, acc, INTERP)


@triton.jit
def _tile(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BM: tl.constexpr):
    """The prologue both grouped kernels share: this program's work-list tile (axis 0) -> (pair count, expert,
    first place in `order`, lane offsets, lane mask, the tile's flat (row * k + slot) pair indices). A tile past the
    real work has count 0 (the caller returns); its other loads stay in bounds (the lists cover every tile)."""
    t = tl.program_id(0)
    cnt = tl.load(tile_cnt_ptr + t)
    e = tl.load(tile_e_ptr + t).to(tl.int64)
    p0 = tl.load(tile_start_ptr + t)
    offs_p = tl.arange(0, BM)
    p_ok = offs_p < cnt
    pair = tl.load(order_ptr + p0 + offs_p, mask=p_ok, other=0)
    return cnt, e, p0, offs_p, p_ok, pair


@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, s_ptr, tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, rw_ptr, h_ptr,
                   H, I, TOPK, limit,
                   BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SCALED: tl.constexpr,
                   INTERP: tl.constexpr):
    cnt, e, p0, offs_p, p_ok, pair = _tile(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BM)
    if cnt == 0:
        return
    rows = (pair // TOPK).to(tl.int64)
    rw = tl.load(rw_ptr + pair, mask=p_ok, other=0.0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    HB = H // 2
    w1 = w_ptr + (e * 2 * I + offs_n)[None, :] * HB
    w3 = w1 + I * HB
    s1 = s_ptr + (e * 2 * I + offs_n) * (H // 32)      # [BN] scale rows
    s3 = s1 + I * (H // 32)
    xr = x_ptr + rows[:, None] * H
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for b0 in range(0, HB, BKB):
        b = b0 + tl.arange(0, BKB)
        xt = tl.load(xr + (2 * b0 + tl.arange(0, 2 * BKB))[None, :], mask=p_ok[:, None], other=0.0)
        acc_g = _fp4_mma(xt, tl.load(w1 + b[:, None]), s1, b0 // 16, acc_g, BM, BKB, SCALED, INTERP)
        acc_u = _fp4_mma(xt, tl.load(w3 + b[:, None]), s3, b0 // 16, acc_u, BM, BKB, SCALED, INTERP)
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up * rw[:, None]
    dst = h_ptr + (p0 + offs_p)[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(dst, h, mask=p_ok[:, None])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, s_ptr, tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, y_ptr, H, I,
                     BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SCALED: tl.constexpr,
                     INTERP: tl.constexpr):
    cnt, e, p0, offs_p, p_ok, pair = _tile(tile_e_ptr, tile_start_ptr, tile_cnt_ptr, order_ptr, BM)
    if cnt == 0:
        return
    pair = pair.to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    IB = I // 2
    w = w_ptr + (e * H + offs_n)[None, :] * IB
    s = s_ptr + (e * H + offs_n) * (I // 32)           # [BN] scale rows
    hr = h_ptr + (p0 + offs_p)[:, None].to(tl.int64) * I
    acc = tl.zeros((BM, BN), tl.float32)
    for b0 in range(0, IB, BKB):
        b = b0 + tl.arange(0, BKB)
        ht = tl.load(hr + (2 * b0 + tl.arange(0, 2 * BKB))[None, :], mask=p_ok[:, None], other=0.0)
        acc = _fp4_mma(ht, tl.load(w + b[:, None]), s, b0 // 16, acc, BM, BKB, SCALED, INTERP)
    tl.store(y_ptr + pair[:, None] * H + offs_n[None, :], acc, mask=p_ok[:, None])


@triton.jit
def _slot_sum_kernel(y_ptr, ids_ptr, out_ptr, N, H, TOPK, BR: tl.constexpr, BH: tl.constexpr):
    """out[r] = 0 + y[r, 0] + y[r, 1] + … over the slots whose expert is on this rank (id >= 0), in slot order."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    r_ok = r < N
    ok = r_ok[:, None] & (c < H)[None, :]
    r = r.to(tl.int64)
    acc = tl.zeros((BR, BH), tl.float32)
    for j in range(TOPK):
        here = tl.load(ids_ptr + r * TOPK + j, mask=r_ok, other=-1) >= 0
        acc = acc + tl.load(y_ptr + (r * TOPK + j)[:, None] * H + c[None, :], mask=ok & here[:, None], other=0.0)
    tl.store(out_ptr + r[:, None] * H + c[None, :], acc, mask=ok)


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


def max_tiles(n_pairs: int, n_experts: int) -> int:
    """Upper bound on the work list's tiles: Σ_e ceil(c_e / BLOCK_M) <= n_pairs // BLOCK_M + #experts touched."""
    return n_pairs // BLOCK_M + min(n_experts, n_pairs)


def work_list(expert_ids: torch.Tensor, n_experts: int):
    """(tile_expert, tile_start, tile_count, order), all on the ids' device, built without host synchronisation.
    `order` lists the flat (row * k + slot) pair indices grouped by expert (ascending id, stable: row order within
    an expert; slots with id < 0 go last and belong to no tile); tile t covers order[tile_start[t] : + tile_count[t]]
    of expert tile_expert[t]; tiles past the real work have count 0."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    n_pairs = flat.numel()
    key = torch.where(flat >= 0, flat, n_experts)
    order = torch.argsort(key, stable=True).to(torch.int32)
    # scatter_add, not bincount: bincount reads the maximum back to the host
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key))[:n_experts]
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = torch.cumsum(tiles, 0)
    pair_start = torch.cumsum(counts, 0) - counts
    t = torch.arange(max_tiles(n_pairs, n_experts), device=flat.device)
    e = torch.searchsorted(tile_end, t, right=True)
    live = e < n_experts
    e = e.clamp(max=n_experts - 1)
    off = (t - (tile_end[e] - tiles[e])) * BLOCK_M
    cnt = torch.where(live, (counts[e] - off).clamp(0, BLOCK_M), 0)
    return e.to(torch.int32), (pair_start[e] + off).to(torch.int32), cnt.to(torch.int32), order


WL_PAIRS, WL_TILES = 64, 64


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


def _check(x, w13, s13, w2, s2, expert_ids, weights):
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
    if hidden % (2 * BLOCK_KB) or inter % BLOCK_N_UP or inter % (2 * BLOCK_KB) or hidden % BLOCK_N_DOWN:
        raise ValueError(f"fp4_moe: H={hidden} must be a multiple of {BLOCK_N_DOWN} and I={inter} of {BLOCK_N_UP}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != n or weights.shape != expert_ids.shape:
        raise ValueError(f"fp4_moe: expert_ids and weights must be [{n}, k], got {list(expert_ids.shape)} "
                         f"and {list(weights.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"fp4_moe: expert_ids must be int32/int64, got {expert_ids.dtype}")
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("fp4_moe runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    return s13, s2


def fp4_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
            expert_ids: torch.Tensor, weights: torch.Tensor, limit: float, scaled_dot: bool = False) -> torch.Tensor:
    """Σ over slots (in slot order) of w2(weight · silu(min(w1x, limit)) · clamp(w3x, ±limit)) for each row's
    experts -> float32 [n, H]; equals the routed part of `MoE.__call__` with `dequant_fp4` weights up to the bf16
    rounding of x and h. Slots with expert id < 0 (another rank's) contribute nothing. Layouts: docs/kernels.md.
    scaled_dot: the products through Triton's tl.dot_scaled (bf16 x e2m1) instead of unpacking the bytes in the
    kernel; the same values up to the fp32 summation order (both paths row-invariant, tested)."""
    s13, s2 = _check(x, w13, s13, w2, s2, expert_ids, weights)
    x = x.contiguous()
    n, hidden = x.shape
    n_exp, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = expert_ids.shape[1]
    out = torch.empty((n, hidden), dtype=torch.float32, device=x.device)
    if n == 0 or top_k == 0:
        return out.zero_()
    ids = expert_ids.to(torch.int32).contiguous()
    tile_e, tile_start, tile_cnt, order = work_list_launch(ids, n_exp)
    rw = weights.to(torch.float32).contiguous()
    n_pairs = n * top_k
    h = torch.empty((n_pairs, inter), dtype=torch.float32, device=x.device)
    y = torch.empty((n_pairs, hidden), dtype=torch.float32, device=x.device)
    tiles = tile_cnt.numel()
    _moe_up_kernel[(tiles, inter // BLOCK_N_UP)](
        x, w13, s13, tile_e, tile_start, tile_cnt, order, rw, h, hidden, inter, top_k, float(limit),
        BM=BLOCK_M, BN=BLOCK_N_UP, BKB=BLOCK_KB, SCALED=scaled_dot, INTERP=INTERPRET, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    _moe_down_kernel[(tiles, hidden // BLOCK_N_DOWN)](
        h, w2, s2, tile_e, tile_start, tile_cnt, order, y, hidden, inter,
        BM=BLOCK_M, BN=BLOCK_N_DOWN, BKB=BLOCK_KB, SCALED=scaled_dot, INTERP=INTERPRET, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    _slot_sum_kernel[(triton.cdiv(n, SUM_ROWS), triton.cdiv(hidden, SUM_COLS))](
        y, ids, out, n, hidden, top_k, BR=SUM_ROWS, BH=SUM_COLS)
    return out
