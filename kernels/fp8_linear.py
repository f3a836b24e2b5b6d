"""Block-scaled FP8 (and plain bf16) linear for decode rounds and prompt chunks: y = x · Wᵀ.

W is the checkpoint's E4M3 [out, in] with its E8M0 32×32 block scales (or a bf16 [out, in] weight, no scales).
Reference: `dsv41.model.linear.linear(x, dsv41.model.quant.dequant_fp8(w, scale))` with x rounded to bf16.

Numerics (issue 24: GPU numerics like DeepSeek's inference code and the peers): x goes to the tensor cores as
bf16 (one rounding, ~2^-9 relative per element), W is dequantised in registers exactly (an E4M3 value times a power
of two is a bf16 value), products accumulate in fp32; y is float32.

Batch invariance by construction: one tiling and one reduction order for every row count.
- Every product is a tensor-core product of BM = 16 rows (a "row tile"); a program holds `mt` row tiles (up to 64
  rows) and reuses each dequantised weight tile for all of them, so a decode round reads W once per row block.
- K is cut into S equal chunks chosen from the weight's shape only (`split_for`); each chunk's sum starts from zero
  and y = ((0 + p_0) + p_1) + … + p_{S-1}. With up to SPLIT_ROWS rows (decode, drafted verify) the chunks run in
  separate programs, so even a narrow weight streams through every SM, and the last program of a column tile to
  finish (an atomic counter) adds the partials in that order: one launch, no second kernel. With more rows (prompt
  chunks) each program runs its chunks itself and adds them in the same order. Either way a row's bits depend only
  on that row (tests: a row alone == among 64 == among 2048).
- The configuration (tile sizes, warps, stages, which operand the weight is) is a function of the weight's shape
  (`config_for`), never of the row count.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl

BM = 16           # rows per tensor-core product: the one row tile of every launch
SPLIT_ROWS = 256  # up to this many rows the K chunks run in programs of their own (decode and verify rounds)
TARGET_PROGRAMS = 264   # programs wanted for a decode round: two per H200 SM (132), so the weight streams everywhere
# The interpreter (CPU CI) mishandles bf16 (truncating casts, wrong dots): there x is rounded to bf16 by bit
# arithmetic and kept in float32, which gives the same products exactly (bf16 x bf16 is exact in float32).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Config:
    """A launch configuration. impl "cuda": the CUDA C kernel of csrc/decode.cu (kernels/cuda.py; its tiling is
    fixed: 64 weight rows a block, 16-byte lane steps); "triton": the Triton kernel below with its column tile, K
    step, which operand W is (swap: W is the tensor-core A operand and the rows are its N side), warps and
    pipeline stages."""
    impl: str = "triton"
    bn: int = 128
    bk: int = 64
    swap: bool = True
    mt: int = 4        # row tiles per program (1, 2 or 4): a row block of BM * mt rows reads each weight tile once
    post: bool = False  # FP8 scales applied to each 32-wide K step's product (bk 32) instead of to each element
    warps: int = 8
    stages: int = 4


# The Triton kernel's configuration where the CUDA C one cannot run (and on CPU under the interpreter): the best of
# bench/kernels_bench.py --sweep on the H200 (2026-12-04: 15-18 % of the copy bandwidth for the large FP8 weights at
# one row, 91-95 % for the bf16 head; the CUDA C kernel 30-44 %).
DEFAULT = Config(bn=64, bk=64, swap=False, mt=4, warps=4, stages=4)
CUDA = Config(impl="cuda")
# Per weight shape (out, in) -> Triton Config, measured on the H200 (bench/kernels_bench.py --sweep); shapes not
# listed take DEFAULT. A function of the shape only: every row count of a weight runs the same configuration.
CONFIGS: dict[tuple[int, int], Config] = {}


# bf16 weights with at least this many rows (the head and its TP shards, the DSpark Markov head) take the Triton kernel:
# it streams them at 91-95 % of the copy bandwidth at 1-8 rows on the H200, the CUDA C one at 60-66 % (kernels.md)
TRITON_BF16_ROWS = 32768


def config_for(out_f: int, in_f: int, device: torch.device | None = None, fp8: bool = True) -> Config:
    """The configuration a weight [out_f, in_f] runs with on `device` (a function of the shape and format only): the
    CUDA C kernel where it can run (a GPU of compute capability >= 8.0 with a CUDA compiler; decided once per
    device), else the Triton kernel."""
    if (device is not None and device.type == "cuda" and not INTERPRET and (fp8 or out_f < TRITON_BF16_ROWS)
            and _cuda_ok(device, out_f, in_f)):
        return CUDA
    return CONFIGS.get((out_f, in_f), DEFAULT)


def _cuda_ok(device: torch.device, out_f: int, in_f: int) -> bool:
    from kernels import cuda
    return out_f % 16 == 0 and in_f % 64 == 0 and cuda.available(device.index)


# ---- shared helpers (also used by fp4_moe.py and sparse_attn.py) ---------------------------------------------------

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
    tensor-core operands (sparse_attn's precise mode)."""
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


# ---- the kernel -----------------------------------------------------------------------------------------------------

@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_n, n_ok, k0, K, BN: tl.constexpr, BK: tl.constexpr, W_FP8: tl.constexpr,
                 EVEN_K: tl.constexpr, INTERP: tl.constexpr, POST: tl.constexpr):
    """W[offs_n, k0:k0+BK] dequantised to bf16 operand values, [BN, BK] (POST: the E4M3 values unscaled)."""
    k = k0 + tl.arange(0, BK)
    if EVEN_K:
        wt = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None], other=0.0)
    else:
        wt = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None] & (k < K)[None, :],
                     other=0.0)
    if W_FP8 and POST:
        return bf16_operand(wt, INTERP)
    elif W_FP8:
        # the E8M0 code of each element's 32x32 block as the float32 2^(s-127); BK spans BK/32 scale groups
        g = (k0 // 32) + tl.arange(0, BK) // 32
        if EVEN_K:
            sc = tl.load(s_ptr + (offs_n // 32)[:, None] * (K // 32) + g[None, :], mask=n_ok[:, None], other=0)
        else:
            sc = tl.load(s_ptr + (offs_n // 32)[:, None] * (K // 32) + g[None, :],
                         mask=n_ok[:, None] & (k < K)[None, :], other=0)
        f = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        return bf16_operand(wt.to(tl.float32) * f, INTERP)
    else:
        return bf16_operand(wt, INTERP)


@triton.jit
def _row_tile(x_ptr, stride_xm, r0, M, k0, K, BK: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr,
              RB: tl.constexpr):
    """x[r0:r0+RB, k0:k0+BK] as bf16 operand values (rows past M are zeros)."""
    rows = r0 + tl.arange(0, RB)
    k = k0 + tl.arange(0, BK)
    ptr = x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :]
    if EVEN_K:
        xt = tl.load(ptr, mask=(rows < M)[:, None], other=0.0)
    else:
        xt = tl.load(ptr, mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0)
    return bf16_operand(xt, INTERP)


@triton.jit
def _product(wb, xb, acc, SWAP: tl.constexpr, INTERP: tl.constexpr):
    """acc + the tile's product: swap: acc [BN, BM] += W [BN, BK] · xᵀ [BK, BM]; else acc [BM, BN] += x · Wᵀ."""
    if SWAP:
        return mma(wb, tl.trans(xb), acc, INTERP)
    else:
        return mma(xb, tl.trans(wb), acc, INTERP)


@triton.jit
def _store_rows(ptr, acc, r0, M, offs_n, n_ok, N, SWAP: tl.constexpr, RB: tl.constexpr):
    """Store a row tile's [RB, BN] result (held as [BN, RB] when swapped) at ptr[row, col] (row stride N)."""
    rows = r0 + tl.arange(0, RB)
    if SWAP:
        p = ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(p, acc, mask=(rows < M)[None, :] & n_ok[:, None])
    else:
        p = ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(p, acc, mask=(rows < M)[:, None] & n_ok[None, :])


@triton.jit
def _load_rows(ptr, r0, M, offs_n, n_ok, N, SWAP: tl.constexpr, RB: tl.constexpr):
    rows = r0 + tl.arange(0, RB)
    if SWAP:
        p = ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]
        return tl.load(p, mask=(rows < M)[None, :] & n_ok[:, None], other=0.0, cache_modifier=".cg")
    else:
        p = ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
        return tl.load(p, mask=(rows < M)[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")


@triton.jit
def _chunk(x_ptr, w_ptr, s_ptr, stride_xm, r0, M, K, offs_n, n_ok, c, kb_chunk, BM_: tl.constexpr,
           MT_: tl.constexpr, SH0: tl.constexpr, SH1: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           SWAP: tl.constexpr, W_FP8: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr,
           POST: tl.constexpr):
    """Chunk c's sums (from zero) for the program's MT_ row tiles: each weight tile dequantised once, then one
    tensor-core product per live row tile (a tile past M is skipped: its rows are not stored)."""
    live1 = r0 + BM_ < M
    live2 = r0 + 2 * BM_ < M
    live3 = r0 + 3 * BM_ < M
    p0 = tl.zeros((SH0, SH1), tl.float32)
    p1 = tl.zeros((SH0, SH1), tl.float32)
    p2 = tl.zeros((SH0, SH1), tl.float32)
    p3 = tl.zeros((SH0, SH1), tl.float32)
    for kb in range(c * kb_chunk, (c + 1) * kb_chunk):
        k0 = kb * BK
        wb = _weight_tile(w_ptr, s_ptr, offs_n, n_ok, k0, K, BN, BK, W_FP8, EVEN_K, INTERP, POST)
        f = 1.0
        if POST:   # BK == 32: one scale per column; the step's product from zero, times it, added on
            sc = tl.load(s_ptr + (offs_n // 32) * (K // 32) + kb, mask=n_ok, other=0)
            f = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        p0 = _step(wb, _row_tile(x_ptr, stride_xm, r0, M, k0, K, BK, EVEN_K, INTERP, BM_), p0, f, SWAP, INTERP,
                   POST)
        if MT_ > 1:   # noqa: SIM102 -- a compile-time and a run-time condition: Triton cannot `and` them
            if live1:
                p1 = _step(wb, _row_tile(x_ptr, stride_xm, r0 + BM_, M, k0, K, BK, EVEN_K, INTERP, BM_), p1, f,
                           SWAP, INTERP, POST)
        if MT_ > 2:
            if live2:
                p2 = _step(wb, _row_tile(x_ptr, stride_xm, r0 + 2 * BM_, M, k0, K, BK, EVEN_K, INTERP, BM_), p2, f,
                           SWAP, INTERP, POST)
            if live3:
                p3 = _step(wb, _row_tile(x_ptr, stride_xm, r0 + 3 * BM_, M, k0, K, BK, EVEN_K, INTERP, BM_), p3, f,
                           SWAP, INTERP, POST)
    return p0, p1, p2, p3


@triton.jit
def _step(wb, xb, acc, f, SWAP: tl.constexpr, INTERP: tl.constexpr, POST: tl.constexpr):
    """One K step: acc + the product, or (POST) acc + the product from zero times the columns' scales f."""
    if POST:
        if SWAP:
            return acc + _product(wb, xb, tl.zeros_like(acc), SWAP, INTERP) * f[:, None]
        else:
            return acc + _product(wb, xb, tl.zeros_like(acc), SWAP, INTERP) * f[None, :]
    else:
        return _product(wb, xb, acc, SWAP, INTERP)


@triton.jit(do_not_specialize=["M", "stride_xm"])
def _linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, KB, E0, E1, E2, S0, S1, S2, S3,
                   BM_: tl.constexpr, MT_: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                   W_FP8: tl.constexpr, SPLIT_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr,
                   INTERP: tl.constexpr, POST: tl.constexpr, SH0: tl.constexpr, SH1: tl.constexpr,
                   MULTI: tl.constexpr = False):
    """Program (column tile, chunk or 0, row block). SPLIT_PROGRAMS: this program computes chunk `pid_c` for one
    row block, stores the partial, and the last of the S programs of the column tile sums the partials in chunk
    order. Else the program runs the S chunks itself in the same order: ((0 + p_0) + p_1) + ...
    Parts (fp8_linear_multi): up to four weights concatenated along N, part i the columns [E_{i-1}, E_i) (E_3 = N)
    with its own split S_i (of the KB K steps) and its own output block of y ([M, E_i - E_{i-1}] at M * E_{i-1});
    a single weight is one part (MULTI False: the table is not read, the kernel is the one-weight kernel)."""
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_m = tl.program_id(2)
    n0 = pid_n * BN
    if MULTI:
        S = tl.where(n0 >= E2, S3, tl.where(n0 >= E1, S2, tl.where(n0 >= E0, S1, S0)))
        lo = tl.where(n0 >= E2, E2, tl.where(n0 >= E1, E1, tl.where(n0 >= E0, E0, 0)))
        hi = tl.where(n0 >= E2, N, tl.where(n0 >= E1, E2, tl.where(n0 >= E0, E1, E0)))
        if pid_c >= S:      # a part with fewer chunks than the launch's most
            return
        y_ptr += M.to(tl.int64) * lo - lo      # this part's output block, row stride hi - lo
    else:
        S = S0
        lo = 0
        hi = N
    kb_chunk = KB // S
    offs_n = n0 + tl.arange(0, BN)
    n_ok = offs_n < hi
    r0 = pid_m * (BM_ * MT_)
    if SPLIT_PROGRAMS:
        # this chunk's partial, then the column tile's counter; the last of its S programs adds them in order
        p0, p1, p2, p3 = _chunk(x_ptr, w_ptr, s_ptr, stride_xm, r0, M, K, offs_n, n_ok, pid_c, kb_chunk, BM_, MT_,
                                SH0, SH1, BN, BK, SWAP, W_FP8, EVEN_K, INTERP, POST)
        part = part_ptr + pid_c.to(tl.int64) * M * N
        _store_tiles(part, p0, p1, p2, p3, r0, M, offs_n, n_ok, N, SWAP, BM_, MT_)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == S - 1:
            a0 = tl.zeros((SH0, SH1), tl.float32)
            a1 = tl.zeros((SH0, SH1), tl.float32)
            a2 = tl.zeros((SH0, SH1), tl.float32)
            a3 = tl.zeros((SH0, SH1), tl.float32)
            for c in range(S):
                part = part_ptr + c * M * N
                a0 = a0 + _load_rows(part, r0, M, offs_n, n_ok, N, SWAP, BM_)
                if MT_ > 1:
                    a1 = a1 + _load_rows(part, r0 + BM_, M, offs_n, n_ok, N, SWAP, BM_)
                if MT_ > 2:
                    a2 = a2 + _load_rows(part, r0 + 2 * BM_, M, offs_n, n_ok, N, SWAP, BM_)
                    a3 = a3 + _load_rows(part, r0 + 3 * BM_, M, offs_n, n_ok, N, SWAP, BM_)
            _store_tiles(y_ptr, a0, a1, a2, a3, r0, M, offs_n, n_ok, hi - lo, SWAP, BM_, MT_)
            tl.atomic_xchg(cnt_ptr + tile, 0)     # ready for the next launch (and the next graph replay)
    else:
        t0 = tl.zeros((SH0, SH1), tl.float32)
        t1 = tl.zeros((SH0, SH1), tl.float32)
        t2 = tl.zeros((SH0, SH1), tl.float32)
        t3 = tl.zeros((SH0, SH1), tl.float32)
        for c in range(S):
            p0, p1, p2, p3 = _chunk(x_ptr, w_ptr, s_ptr, stride_xm, r0, M, K, offs_n, n_ok, c, kb_chunk, BM_, MT_,
                                    SH0, SH1, BN, BK, SWAP, W_FP8, EVEN_K, INTERP, POST)
            t0 = t0 + p0
            t1 = t1 + p1
            t2 = t2 + p2
            t3 = t3 + p3
        _store_tiles(y_ptr, t0, t1, t2, t3, r0, M, offs_n, n_ok, hi - lo, SWAP, BM_, MT_)


@triton.jit
def _store_tiles(ptr, t0, t1, t2, t3, r0, M, offs_n, n_ok, N, SWAP: tl.constexpr, BM_: tl.constexpr,
                 MT_: tl.constexpr):
    _store_rows(ptr, t0, r0, M, offs_n, n_ok, N, SWAP, BM_)
    if MT_ > 1:
        _store_rows(ptr, t1, r0 + BM_, M, offs_n, n_ok, N, SWAP, BM_)
    if MT_ > 2:
        _store_rows(ptr, t2, r0 + 2 * BM_, M, offs_n, n_ok, N, SWAP, BM_)
        _store_rows(ptr, t3, r0 + 3 * BM_, M, offs_n, n_ok, N, SWAP, BM_)


# ---- host side ------------------------------------------------------------------------------------------------

@functools.cache
def split_for(out_f: int, in_f: int, cfg: Config = DEFAULT) -> int:
    """S, the number of K chunks for a weight [out_f, in_f]: the smallest divisor of the K-step count that gives
    TARGET_PROGRAMS programs for one row block (1 for wide weights), else the largest that leaves chunks of two
    or more steps. A function of the weight's shape only, never of the row count."""
    if cfg.impl == "cuda":     # 64 weight rows a block, K steps of 64 (FP8) -- bf16 weights use the same split
        n_tiles, kb = triton.cdiv(out_f, 64), in_f // 64
    else:
        n_tiles, kb = triton.cdiv(out_f, cfg.bn), triton.cdiv(in_f, cfg.bk)
    # chunks of at least 2 K steps: a chunk's sum then stays a loop result, which Triton cannot fold into the next
    # product's accumulator (it folds `dot(a, b, 0) + c` into `dot(a, b, c)`, which would change the bits)
    divisors = [d for d in range(1, kb + 1) if kb % d == 0 and (d == 1 or kb // d >= 2)]
    for d in divisors:
        if n_tiles * d >= TARGET_PROGRAMS:
            return d
    return divisors[-1]


def fp8_split(out_f: int, in_f: int, cfg: Config | None = None) -> int:
    """The K chunks of a weight [out_f, in_f] in its configuration (the bench's label)."""
    return split_for(out_f, in_f, cfg or config_for(out_f, in_f))


_counters: dict[torch.device, torch.Tensor] = {}
COUNTERS = 1 << 16


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of the column tiles' arrival counters (each launch leaves it zeroed again). One per
    device, made on first use; launches on one stream use it in turn."""
    buf = _counters.get(device)
    if buf is None:
        buf = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    if n > COUNTERS:
        raise ValueError(f"fp8_linear: {n} column tiles exceed the counter buffer ({COUNTERS})")
    return buf


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | None:
    if w.dim() != 2 or w.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise TypeError(f"fp8_linear: weight must be float8_e4m3fn or bfloat16 [out, in], got {w.dtype} "
                        f"{list(w.shape)}")
    out_f, in_f = w.shape
    if w.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise TypeError("fp8_linear: an FP8 weight needs its E8M0 scales")
        if scale.dtype == torch.float8_e8m0fnu:
            scale = scale.view(torch.uint8)
        if scale.dtype != torch.uint8:
            raise TypeError(f"fp8_linear: scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
        want = (triton.cdiv(out_f, 32), in_f // 32)
        if in_f % 32 or tuple(scale.shape) != want:
            raise ValueError(f"fp8_linear: weight {list(w.shape)} needs scale {list(want)}, got "
                             f"{list(scale.shape)}")
        if not scale.is_contiguous() or scale.device != w.device:
            raise ValueError("fp8_linear: scale must be contiguous, on the weight's device")
    elif scale is not None:
        raise TypeError("fp8_linear: a bf16 weight takes no scales")
    if x.dim() != 2 or x.shape[1] != in_f or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8_linear: x must be float32/bfloat16 [n, {in_f}], got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1 and x.shape[0] > 0:
        raise ValueError("fp8_linear: x's last dim must be contiguous")
    if not w.is_contiguous():
        raise ValueError("fp8_linear: weight must be contiguous")
    if x.device != w.device:
        raise ValueError(f"fp8_linear: x and weight on different devices ({x.device}, {w.device})")
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("fp8_linear runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
    return scale


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
               cfg: Config | None = None) -> torch.Tensor:
    """y = bf16(x) · Wᵀ as float32 [n, out], W = dequant_fp8(w, scale) (or w itself when bfloat16, scale None).
    x float32/bf16 [n, in] (last dim contiguous, any row stride); w float8_e4m3fn or bfloat16 [out, in]; scale
    E8M0 [ceil(out/32), in/32] (float8_e8m0fnu or its uint8 bits). cfg: a configuration other than the shape's
    (the bench's sweep; a caller that wants batch invariance passes nothing)."""
    scale = _check(x, w, scale)
    out_f, in_f = w.shape
    cfg = cfg or config_for(out_f, in_f, x.device, w.dtype == torch.float8_e4m3fn)
    return _launch(x, w, scale, (out_f,), cfg).view(x.shape[0], out_f)


MAX_PARTS = 4     # weights one fp8_linear_multi launch takes (the kernels' part table)


def multi_config(outs: tuple[int, ...], in_f: int, device: torch.device, fp8: bool) -> Config | None:
    """The configuration the weights [out_i, in_f] (concatenated along out, in this order) run with in ONE launch
    of fp8_linear_multi with every part's bits as its own launch, or None where they cannot: more than MAX_PARTS,
    parts of different configurations, or a part other than the last not ending on a column tile (64 rows for the
    CUDA C kernel, bn for Triton; FP8 parts also on their 32-row scale blocks)."""
    if not 1 < len(outs) <= MAX_PARTS:
        return None
    cfgs = {config_for(o, in_f, device, fp8) for o in outs}
    if len(cfgs) != 1:
        return None
    cfg = cfgs.pop()
    if cfg.impl != "cuda" and not fp8 and device.type == "cuda":
        return None      # the Triton kernel's bf16 form with the part table spills registers (compile_check)
    tile = 64 if cfg.impl == "cuda" else cfg.bn
    if any(o % tile for o in outs[:-1]) or (fp8 and any(o % 32 for o in outs)) or (cfg.post and fp8):
        return None
    return cfg


def fp8_linear_multi(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, outs: tuple[int, ...],
                     cfg: Config) -> list[torch.Tensor]:
    """Several weights that take the same x in one launch: w [Σ out_i, in] (their rows concatenated, FP8 with the
    scales concatenated alike, or bf16) -> [float32 [n, out_i]] (each contiguous), part i the bits of
    fp8_linear(x, w_i) alone: each part keeps its own split (split_for of its own shape: the same chunks, summed
    in the same order) and tiles (`multi_config` gives cfg, the parts' common configuration)."""
    scale = _check(x, w, scale)
    if sum(outs) != w.shape[0]:
        raise ValueError(f"fp8_linear_multi: parts {list(outs)} do not make the weight's {w.shape[0]} rows")
    y = _launch(x, w, scale, tuple(outs), cfg)
    n, res, a = x.shape[0], [], 0
    for o in outs:
        res.append(y[n * a:n * (a + o)].view(n, o))
        a += o
    return res


def _launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, outs: tuple[int, ...],
            cfg: Config) -> torch.Tensor:
    """One launch for the parts `outs` of w's rows (one part: the plain product) -> float32, flat: part i's
    [n, out_i] block at n * (its first row)."""
    n = x.shape[0]
    out_f, in_f = w.shape
    y = torch.empty(n * out_f, dtype=torch.float32, device=x.device)
    if n == 0:
        return y
    if cfg.impl == "cuda":
        return _linear_cuda(x, w, scale, y, outs=outs)
    if cfg.post and cfg.bk != 32:
        raise ValueError(f"fp8_linear: a post-scaled configuration steps K by 32, not {cfg.bk}")
    splits = [split_for(o, in_f, cfg) for o in outs]
    S = max(splits)
    ends = _part_table(outs)
    kb = triton.cdiv(in_f, cfg.bk)
    n_tiles = triton.cdiv(out_f, cfg.bn)
    m_blocks = triton.cdiv(n, BM * cfg.mt)
    split_programs = S > 1 and n <= SPLIT_ROWS
    common = {"BM_": BM, "MT_": cfg.mt, "BN": cfg.bn, "BK": cfg.bk, "SWAP": cfg.swap,
              "W_FP8": w.dtype == torch.float8_e4m3fn, "EVEN_K": in_f % cfg.bk == 0, "INTERP": INTERPRET,
              "POST": cfg.post and w.dtype == torch.float8_e4m3fn,
              "SH0": cfg.bn if cfg.swap else BM, "SH1": BM if cfg.swap else cfg.bn,   # a row tile's result shape
              "MULTI": len(outs) > 1, "num_warps": cfg.warps, "num_stages": cfg.stages}
    s_arg = scale if scale is not None else w
    parts = (*ends, *(splits + [1] * (MAX_PARTS - len(splits))))
    if split_programs:
        part = torch.empty((S, n, out_f), dtype=torch.float32, device=x.device)
        cnt = _counter(x.device, n_tiles * m_blocks)
        _linear_kernel[(n_tiles, S, m_blocks)](x, w, s_arg, y, part, cnt, n, out_f, in_f, x.stride(0), kb, *parts,
                                               SPLIT_PROGRAMS=True, **common)
    else:
        _linear_kernel[(n_tiles, 1, m_blocks)](x, w, s_arg, y, y, y, n, out_f, in_f, x.stride(0), kb, *parts,
                                               SPLIT_PROGRAMS=False, **common)
    return y


def _part_table(outs: tuple[int, ...]) -> list[int]:
    """The kernels' part ends e0, e1, e2 (the last part ends at N; absent parts end there too)."""
    if len(outs) > MAX_PARTS:
        raise ValueError(f"fp8_linear_multi: at most {MAX_PARTS} parts, got {len(outs)}")
    ends, a = [], 0
    for o in outs[:-1]:
        a += o
        ends.append(a)
    total = sum(outs)
    return ends + [total] * (MAX_PARTS - 1 - len(ends))


def pack_x(x: torch.Tensor, mode: int, rows: torch.Tensor | None = None, topk: int = 1) -> torch.Tensor:
    """x (float32 [n, K], last dim contiguous, 16-byte aligned rows) rounded to bf16 and laid out as the CUDA C
    products read their activation fragments (csrc/decode.cu `pack_x`): int32 [n, K/2]. mode 0: FP8 weights, 1: bf16
    weights, 2: FP4 experts; rows: per output row the flat (row * topk + slot) pair whose x row it takes (else
    row i)."""
    from kernels import cuda
    n = x.shape[0] if rows is None else rows.shape[0]
    k = x.shape[1]
    out = torch.empty((n, k // 2), dtype=torch.int32, device=x.device)
    if n:
        per = 8 if mode == 2 else 4
        total = n * (k // per)
        cuda.launch(cuda.function("decode.cu", "pack_x", x.device.index), (triton.cdiv(total, 256), 1, 1), 256,
                    [x, x.stride(0), rows, topk, out, n, k, mode], pdl=pdl.on(x))
    return out


def row_tiles(n: int) -> int:
    """Row tiles of 8 a CUDA C block holds for n rows (1, 2, 4 or 8): the fewest that hold them, up to 64. Only the
    registers the block keeps change: every row tile's product is the same instructions whatever this is."""
    return 1 if n <= 8 else 2 if n <= 16 else 4 if n <= 32 else 8


def _linear_cuda(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, y: torch.Tensor,
                 groups: int = 1, outs: tuple[int, ...] | None = None) -> torch.Tensor:
    """The CUDA C kernel (csrc/decode.cu): the same function, its own fixed tiling (one for every row count).
    groups > 1: w's row groups multiply x's column groups (x [n, groups * in], w [groups * rows, in]). outs: w's
    rows as several weights' parts (fp8_linear_multi), each with its own split and output block."""
    from kernels import cuda
    n = x.shape[0]
    out_f, in_f = w.shape
    if x.dtype != torch.float32:
        x = x.float()                              # bf16 -> float32 is exact; the kernel rounds to bf16 again
    if x.stride(0) % 4 or x.data_ptr() % 16:
        x = x.contiguous()
    fp8 = w.dtype == torch.float8_e4m3fn
    outs = outs or (out_f,)
    splits = [split_for(o, in_f, CUDA) for o in outs] if groups == 1 else [split_for(out_f // groups, in_f, CUDA)]
    S = max(splits)                                # the split of each part (a shape-only choice): the grid's most
    kchunk = in_f // splits[0]
    table = (*_part_table(outs), *(splits[1:] + [1] * (MAX_PARTS - len(splits))))
    xg = out_f // groups if groups > 1 else 0
    tiles = row_tiles(n)
    nb, mb = triton.cdiv(out_f, 64), triton.cdiv(n, 8 * tiles)
    dev = x.device.index
    kind = "fp8_linear" if fp8 else "bf16_linear"
    ldx = x.stride(0)
    if tiles > 1:   # more than one row tile: the rows as packed bf16 fragments first (one small launch)
        x = pack_x(x, 0 if fp8 else 1)
        ldx = x.shape[1]
    if S > 1 and n <= SPLIT_ROWS:
        part = torch.empty((S, n, out_f), dtype=torch.float32, device=x.device)
        fn = cuda.function("decode.cu", f"{kind}_split_t{tiles}", dev)
        cuda.launch(fn, (nb, S, mb), 128, [x, ldx, w, scale if fp8 else w, y, part,
                                           _counter(x.device, nb * mb), n, out_f, in_f, kchunk, splits[0], xg,
                                           *table], pdl=pdl.on(x))
    else:
        fn = cuda.function("decode.cu", f"{kind}_whole_t{tiles}", dev)
        cuda.launch(fn, (nb, 1, mb), 128, [x, ldx, w, scale if fp8 else w, y, y, y, n, out_f, in_f, kchunk,
                                           splits[0], xg, *table], pdl=pdl.on(x))
    return y


def fp8_linear_grouped(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int) -> torch.Tensor:
    """The block-diagonal product of a grouped projection (wo_a): x [n, groups * in] (group g's columns), w [groups *
    rows, in] (group g's rows) -> float32 [n, groups * rows] = cat over g of fp8_linear(x[:, g], w[g]) in one launch
    where the CUDA C kernel runs (rows a multiple of 64), else group by group. The same function either way; each
    group's bits follow one shape-only configuration."""
    out_f, in_f = w.shape
    rows = out_f // groups
    if x.dim() != 2 or x.shape[1] != groups * in_f or out_f % groups:
        raise ValueError(f"fp8_linear_grouped: x {list(x.shape)} and w {list(w.shape)} for {groups} groups")
    if x.device.type == "cuda" and config_for(rows, in_f, x.device).impl == "cuda" and rows % 64 == 0:
        _check(x[:, :in_f], w[:rows], scale[:rows // 32] if scale is not None else None)
        y = torch.empty((x.shape[0], out_f), dtype=torch.float32, device=x.device)
        if x.shape[0] == 0:
            return y
        return _linear_cuda(x, w, scale.view(torch.uint8) if scale is not None else None, y, groups)
    s_rows = rows // 32
    return torch.cat([fp8_linear(x[:, g * in_f:(g + 1) * in_f], w[g * rows:(g + 1) * rows],
                                 scale[g * s_rows:(g + 1) * s_rows] if scale is not None else None)
                      for g in range(groups)], dim=1)


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = bf16(x) · wᵀ as float32 [n, out] for a bf16 weight [out, in] (the head, router gate, compressor...)."""
    return fp8_linear(x, w, None)
