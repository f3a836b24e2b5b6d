"""Triton kernels for EXL3 linears (tested against dsv41/model/exl3.py, the bit-exact torch reference).

y = H(H(x * suh) @ W~) * svh (+ bias), H = blockdiag(H128), W~ the decoded trellis. Three launches:
  had_in     x * suh, 128-point Hadamard, rounded to fp16 (the tensor-core input, as exllamav3 does)
  gemm       xh @ W~ with W~ decoded in registers tile by tile from the trellis (never written to memory); split
             along the input dimension into partial sums [split, G, M, out] fp32
  had_out    partials summed in split order, Hadamard, * svh, + bias
Grouped launch (routed experts): G groups of rows, group g multiplied by expert ids[g] of a stack of E same-shape
EXL3 matrices, all in one launch of each kernel.

Exactness: the tile sizes and the split depend only on the weight's shape, never on the row count, so a row's
result does not depend on which or how many other rows share the launch (decode rounds and prompt passes alike).
`exl3_linear_prompt` (trellis -> W~ in memory -> cuBLAS fp16 GEMM) is faster for long prompts but its GEMM picks
kernels by row count, so it is not row-invariant; the caller chooses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.exl3_format import HAD_DIM, HAD_SCALE_F32, Exl3FormatError
from kernels.exl3_format import parse_exl3 as _parse
from kernels.exl3_format import sylvester as _sylvester

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64     # fixed: a row's arithmetic must not depend on the row count
TARGET_PROGRAMS = 512                      # split the input dimension until (out/BLOCK_N)*split reaches this
HAD_ROWS = 16                              # rows per Hadamard program (tl.dot needs >= 16)

@triton.jit
def _codebook(w, CB: tl.constexpr):
    """fp16 value of 16-bit windows w (uint32) under codebook CB (0 3INST, 1 MCG, 2 MUL1); codebook.cuh exactly."""
    if CB == 2:
        x = w * 0x83DCD12D
        s = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)              # two 16-bit lanes of byte-pair sums
        s = (s & 0xFFFF) + (s >> 16)                                # the sum of the four bytes
        # (1024 + byte sum) * fp16(0x1eee) + fp16(0xc931) = ... * 1774*2^-18 - 1329*2^-7: exact in float32, so one
        # rounding like the fp16 fma
        v = (s + 1024).to(tl.float32) * 0.00676727294921875 + (-10.3828125)
        return v.to(tl.float16)
    else:
        if CB == 1:
            x = w * 0xCBAC1FED
        else:
            x = w * 89226354 + 64248484
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        # both halves lie in [1/8, 2) in magnitude: their float32 sum is exact, then one fp16 rounding
        return (lo.to(tl.float32) + hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _window_layout(NT, K2: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """Where each element of a [BK, BN] block of W~ finds its 16-bit window: (word offset of the first word, of the
    next word, bit offset of the window in the first word, MSB first), the word offsets relative to the first word
    of the block's first tile. A function of the position in the block only, so it is computed once per program
    and every block the program decodes adds one scalar base.

    Element (row, col) sits at trellis position p = 8*lane + j (tensor-core order); its window ends at bit
    (p+1)*K of the tile's ring (half-integer K: the odd positions carry KA+1 bits)."""
    r = (tl.arange(0, BK) % 16)[:, None]
    c = (tl.arange(0, BN) % 16)[None, :]
    p = ((c & 7) * 4 + ((r & 7) >> 1)) * 8 + (r & 1) + 2 * (r >> 3) + 4 * (c >> 3)
    KA: tl.constexpr = K2 // 2
    HALF: tl.constexpr = K2 % 2
    NW: tl.constexpr = 4 * K2            # 32-bit words per tile
    RING: tl.constexpr = 128 * K2        # bits per tile
    m1 = (p & 15) + 1
    end = (p >> 4) * (8 * K2) + m1 * KA + HALF * (m1 >> 1)
    start = (end - 16 + RING) % RING
    wi = start >> 5
    tile = (tl.arange(0, BK) // 16)[:, None] * NT + (tl.arange(0, BN) // 16)[None, :]
    return tile * NW + wi, tile * NW + (wi + 1) % NW, (start & 31).to(tl.uint32)


@triton.jit
def _decode_block(words, oa, ob, off, k0, n0, NT, K2: tl.constexpr, CB: tl.constexpr):
    """W~[k0:k0+BK, n0:n0+BN] (fp16) from the trellis words (int32 view of the int16 trellis), given the layout.

    The window is bits off..off+15 (MSB first) of the pair (a, b): a funnel shift in 32-bit arithmetic (no 64-bit
    shifts), and the second word is loaded only where the window reaches into it (off > 16)."""
    NW: tl.constexpr = 4 * K2
    base = words + ((k0 // 16).to(tl.int64) * NT + n0 // 16) * NW
    a = tl.load(base + oa).to(tl.uint32, bitcast=True)
    b = tl.load(base + ob, mask=off > 16, other=0).to(tl.uint32, bitcast=True)
    hi = a << off
    lo = (b >> 1) >> (31 - off)                                   # b >> (32 - off), without a shift by 32
    w = ((hi | lo) >> 16) & 0xFFFF
    return _codebook(w, CB)


@triton.jit
def _hadamard_product(x, h16):
    """x @ H (unscaled +-1 Sylvester, fp16 [128, 128]) for float32 x [R, 128] on tensor cores: x split into two fp16
    parts (hi + lo carries ~22 bits), +-1 products are exact, fp32 accumulation."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return tl.dot(hi, h16) + tl.dot(lo, h16)


@triton.jit
def _load_h(h_ptr):
    i = tl.arange(0, 128)
    return tl.load(h_ptr + i[:, None] * 128 + i[None, :])


@triton.jit
def _had_in_kernel(x_ptr, suh_ptr, ids_ptr, h_ptr, out_ptr, M, D, HAD_SCALE: tl.constexpr, BR: tl.constexpr):
    pid_r = tl.program_id(0)
    blk = tl.program_id(1)
    g = tl.program_id(2)
    e = tl.load(ids_ptr + g).to(tl.int64)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = blk * 128 + tl.arange(0, 128)
    off = g.to(tl.int64) * M * D + rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + off, mask=rows[:, None] < M, other=0.0).to(tl.float32)
    s = tl.load(suh_ptr + e * D + cols).to(tl.float32)
    y = _hadamard_product(x * s[None, :], _load_h(h_ptr)) * HAD_SCALE
    tl.store(out_ptr + off, y.to(tl.float16), mask=rows[:, None] < M)


@triton.jit
def _had_out_kernel(part_ptr, svh_ptr, bias_ptr, ids_ptr, h_ptr, out_ptr, M, N, G, SPLIT,
                    HAS_BIAS: tl.constexpr, HAD_SCALE: tl.constexpr, BR: tl.constexpr):
    pid_r = tl.program_id(0)
    blk = tl.program_id(1)
    g = tl.program_id(2)
    e = tl.load(ids_ptr + g).to(tl.int64)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = blk * 128 + tl.arange(0, 128)
    mask = rows[:, None] < M
    off = g.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.zeros((BR, 128), dtype=tl.float32)
    for s in range(SPLIT):                   # fixed order: deterministic, independent of the other rows
        acc += tl.load(part_ptr + s * G * M * N + off, mask=mask, other=0.0).to(tl.float32)
    y = _hadamard_product(acc, _load_h(h_ptr)) * HAD_SCALE
    y = y * tl.load(svh_ptr + e * N + cols).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + e * N + cols).to(tl.float32)[None, :]
    tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, words_ptr, ids_ptr, rows_ptr, part_ptr, M, N, D, NT, expert_words, steps_per_split,
                 K2: tl.constexpr, CB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    g = tl.program_id(2)
    G = tl.num_programs(2)
    num_n = N // BN
    pid_m = pid // num_n
    pid_n = pid % num_n
    m_valid = tl.load(rows_ptr + g)
    if pid_m * BM < m_valid:                 # groups with fewer rows skip their empty row blocks
        e = tl.load(ids_ptr + g).to(tl.int64)
        words = words_ptr + e * expert_words
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        xrow = x_ptr + g.to(tl.int64) * M * D + rm[:, None].to(tl.int64) * D
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        oa, ob, off = _window_layout(NT, K2, BK, BN)
        s0 = pid_s * steps_per_split
        s1 = tl.minimum(s0 + steps_per_split, D // BK)
        for step in range(s0, s1):
            k0 = step * BK
            xk = tl.load(xrow + (k0 + tl.arange(0, BK))[None, :], mask=rm[:, None] < m_valid, other=0.0)
            w = _decode_block(words, oa, ob, off, k0, pid_n * BN, NT, K2, CB)
            acc += tl.dot(xk, w)
        off = (pid_s * G + g).to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part_ptr + off, acc, mask=rm[:, None] < M)


@triton.jit
def _reconstruct_kernel(words_ptr, out_ptr, N, NT, K2: tl.constexpr, CB: tl.constexpr,
                        BK: tl.constexpr, BN: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    oa, ob, off = _window_layout(NT, K2, BK, BN)
    w = _decode_block(words_ptr, oa, ob, off, pid_k * BK, pid_n * BN, NT, K2, CB)
    rk = pid_k * BK + tl.arange(0, BK)
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(out_ptr + rk[:, None].to(tl.int64) * N + rn[None, :], w)


@dataclass
class Exl3Weight:
    """A stack of E EXL3 matrices of one shape, rate and codebook on one device (E = 1 for a plain linear)."""
    trellis: torch.Tensor          # int16 [E, in/16, out/16, 16K]
    suh: torch.Tensor              # fp16 [E, in]
    svh: torch.Tensor              # fp16 [E, out]
    bias: torch.Tensor | None      # fp16 [E, out]
    K2: int                        # 2 * bits per weight
    cb: int                        # codebook
    in_features: int
    out_features: int

    @classmethod
    def from_tensors(cls, parts: dict | list[dict], device: str | torch.device = "cuda") -> Exl3Weight:
        """From one EXL3 tensor dict (trellis, suh|su, svh|sv, mcg|mul1, bias) or a list of same-shape ones."""
        parts = [parts] if isinstance(parts, dict) else list(parts)
        parsed = [_parse(p) for p in parts]
        t0, K, cb = parsed[0][0], parsed[0][1], parsed[0][2]
        for tr, k, c, *_ in parsed[1:]:
            if tr.shape != t0.shape or k != K or c != cb:
                raise Exl3FormatError("grouped EXL3 matrices must share shape, rate and codebook")
        has_bias = [p[5] is not None for p in parsed]
        if any(has_bias) and not all(has_bias):
            raise Exl3FormatError("grouped EXL3 matrices: bias on some but not all")
        dev = torch.device(device)
        return cls(
            trellis=torch.stack([p[0] for p in parsed]).to(dev).contiguous(),
            suh=torch.stack([p[3] for p in parsed]).to(dev, torch.float16).contiguous(),
            svh=torch.stack([p[4] for p in parsed]).to(dev, torch.float16).contiguous(),
            bias=torch.stack([p[5] for p in parsed]).to(dev, torch.float16).contiguous() if all(has_bias) else None,
            K2=round(2 * K), cb=cb, in_features=t0.shape[0] * 16, out_features=t0.shape[1] * 16)

    @property
    def experts(self) -> int:
        return self.trellis.shape[0]

    def split(self) -> tuple[int, int]:
        """(split count, input steps per split): a function of the shape only (see the module's exactness note)."""
        steps = self.in_features // BLOCK_K
        want = max(1, -(-TARGET_PROGRAMS // (self.out_features // BLOCK_N)))
        per = max(1, -(-steps // min(steps, want)))
        return -(-steps // per), per


_H16: dict = {}


def _sylvester_fp16(device: torch.device) -> torch.Tensor:
    """Unscaled Sylvester H128 (+-1, fp16) on the device, made once per device."""
    key = str(device)
    if key not in _H16:
        _H16[key] = _sylvester(HAD_DIM).to(device=device, dtype=torch.float16).contiguous()
    return _H16[key]


def _words(w: Exl3Weight) -> torch.Tensor:
    return w.trellis.view(torch.int32)


def _had_in(x: torch.Tensor, w: Exl3Weight, ids: torch.Tensor) -> torch.Tensor:
    G, M, D = x.shape
    xh = torch.empty((G, M, D), dtype=torch.float16, device=x.device)
    _had_in_kernel[(triton.cdiv(M, HAD_ROWS), D // 128, G)](
        x, w.suh, ids, _sylvester_fp16(x.device), xh, M, D, HAD_SCALE=HAD_SCALE_F32, BR=HAD_ROWS, num_warps=8)
    return xh


def _had_out(part: torch.Tensor, w: Exl3Weight, ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    S, G, M, N = part.shape
    y = torch.empty((G, M, N), dtype=out_dtype, device=part.device)
    bias = w.bias if w.bias is not None else w.svh
    _had_out_kernel[(triton.cdiv(M, HAD_ROWS), N // 128, G)](
        part, w.svh, bias, ids, _sylvester_fp16(part.device), y, M, N, G, S, HAS_BIAS=w.bias is not None, HAD_SCALE=HAD_SCALE_F32, BR=HAD_ROWS,
        num_warps=8)
    return y


def exl3_grouped(x: torch.Tensor, w: Exl3Weight, ids: torch.Tensor, rows: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y[g] = x[g] @ W[ids[g]] for G groups in one launch per kernel. x: [G, M, in] (rows >= rows[g] of group g are
    ignored and their outputs are unspecified); ids, rows: int32 [G]. W~ is decoded in registers, never stored."""
    if x.dim() != 3 or x.shape[-1] != w.in_features:
        raise Exl3FormatError(f"x must be [G, M, {w.in_features}], got {tuple(x.shape)}")
    G, M, D = x.shape
    x = x.contiguous()
    ids = ids.to(device=x.device, dtype=torch.int32).contiguous()
    if ids.shape != (G,):
        raise Exl3FormatError(f"ids must be [{G}], got {tuple(ids.shape)}")
    rows = (torch.full((G,), M, dtype=torch.int32, device=x.device) if rows is None
            else rows.to(device=x.device, dtype=torch.int32).contiguous())
    N = w.out_features
    S, per = w.split()
    xh = _had_in(x, w, ids)
    part = torch.empty((S, G, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M) * (N // BLOCK_N), S, G)
    _gemm_kernel[grid](xh, _words(w), ids, rows, part, M, N, D, N // 16, w.trellis[0].numel() // 2, per,
                       K2=w.K2, CB=w.cb, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=8,
                       # no software pipelining: the trellis loads are gathers, which the pipeliner turns into 4-byte
                       # cp.async copies through 80 KB of shared memory (seen in the sm_90 PTX); one stage keeps
                       # them plain cached loads as in the reconstruct kernel
                       num_stages=1)
    return _had_out(part, w, ids, out_dtype)


def exl3_linear_triton(x: torch.Tensor, w: Exl3Weight, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y = x @ W (+ bias) for a single EXL3 matrix, W~ decoded in registers; any row count, row-invariant."""
    if w.experts != 1:
        raise Exl3FormatError("exl3_linear_triton takes one matrix; use exl3_grouped for a stack")
    lead = x.shape[:-1]
    x2 = x.reshape(1, -1, x.shape[-1])
    ids = torch.zeros(1, dtype=torch.int32, device=x.device)
    return exl3_grouped(x2, w, ids, out_dtype=out_dtype).reshape(*lead, w.out_features)


def exl3_reconstruct(w: Exl3Weight, expert: int = 0) -> torch.Tensor:
    """W~ (fp16 [in, out], the rotated basis) of one matrix of the stack, decoded tile by tile into memory."""
    D, N = w.in_features, w.out_features
    out = torch.empty((D, N), dtype=torch.float16, device=w.trellis.device)
    _reconstruct_kernel[(D // BLOCK_K, N // BLOCK_N)](
        w.trellis[expert].view(torch.int32), out, N, N // 16, K2=w.K2, CB=w.cb, BK=BLOCK_K, BN=BLOCK_N, num_warps=8)
    return out


def exl3_linear_prompt(x: torch.Tensor, w: Exl3Weight, w_rot: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Prompt pass: W~ dequantised into memory (or given), then one fp16 tensor-core GEMM (cuBLAS); same Hadamard
    kernels as the fused path. Fast for many rows, not row-invariant (the GEMM picks kernels by row count)."""
    if w.experts != 1:
        raise Exl3FormatError("exl3_linear_prompt takes one matrix")
    lead = x.shape[:-1]
    x2 = x.reshape(1, -1, x.shape[-1]).contiguous()
    ids = torch.zeros(1, dtype=torch.int32, device=x.device)
    xh = _had_in(x2, w, ids)
    if w_rot is None:
        w_rot = exl3_reconstruct(w)
    part = torch.matmul(xh[0], w_rot).unsqueeze(0).unsqueeze(0)   # fp16 out, fp32 accumulate
    return _had_out(part, w, ids, out_dtype).reshape(*lead, w.out_features)


# ---- the CUDA C kernel (kernels/csrc/exl3.cu) -------------------------------------------------------------------
#
# One launch per linear or grouped stack: input Hadamard, trellis decode on the tensor cores, split-K partials added
# in split order by the last block of each 128-column block, output Hadamard, * svh (+ bias). The split depends on
# the weight's shape only (never on the rows or the groups), so a row's result is the same bits alone or in any
# batch, and a grouped launch gives each group the bits of its own matrix's launch.

CUDA_BLOCK_N = 128           # output columns a block: one Hadamard block
CUDA_TARGET_BLOCKS = 396     # blocks wanted for one matrix: three per H200 SM (132)
CUDA_COUNTERS = 1 << 20      # arrival counters (4 MB): one per (group, row block, column block) of a launch
_K2_CUDA = (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
_counters: dict = {}
_cuda_ok: dict = {}


# (K2, codebook) with an eight-row-tile kernel (exl3.cu): MUL1 at every rate, 4 bits with 3INST and MCG
_T8 = {(k, 2) for k in _K2_CUDA} | {(8, 0), (8, 1)}
# ... and with four (up to 32 rows, fewer registers): the reference pack's main rates
_T4 = {(5, 2), (8, 0), (8, 2)}


def cuda_row_tiles(K2: int, cb: int, rows: int, variant: str = "") -> int:
    """Row tiles of 8 a block of the kernel for `rows` rows a group: one when it holds the rows or no larger
    kernel exists for the rate (then every 8 rows are a block), four up to 32 rows where that kernel exists, else
    eight. The MMA chain of a row tile is the same instructions in each, so the choice never changes a bit."""
    if rows <= 8 or variant:
        return 1
    if rows <= 32 and (K2, cb) in _T4:
        return 4
    return 8 if (K2, cb) in _T8 else 1


def cuda_kernel_name(K2: int, cb: int, rows: int, variant: str = "") -> str:
    """The exl3.cu kernel for rate K2/2, codebook cb and a launch of `rows` rows a group (cuda_row_tiles). variant
    "w": the warp-ring form (rates 2.5 mul1 and 4 3inst/mul1, one row tile: the bench's comparison); bench-only
    forms at 2.5 mul1 and 4 3inst: "o" the served form held to 64 registers, "r" register-direct (each warp's
    words straight into registers, no shared-memory ring); where the time goes (wrong values): "n" the warp ring
    without the decode, "e" no stages at all."""
    return f"exl3{variant}_k{K2}_cb{cb}_t{cuda_row_tiles(K2, cb, rows, variant)}"


def cuda_split(in_features: int, out_features: int, target: int = CUDA_TARGET_BLOCKS) -> tuple[int, int]:
    """(S, 128-row input blocks a chunk) of the CUDA kernel: a function of the shape only (`target` other than the
    default: the bench's split sweep)."""
    hb = in_features // 128
    want = max(1, -(-target // (out_features // CUDA_BLOCK_N)))
    hpc = -(-hb // min(hb, want))
    return -(-hb // hpc), hpc


def cuda_available(device: torch.device | int | None = None) -> bool:
    """Whether the CUDA C EXL3 kernel runs here (a CUDA device of compute capability >= 8.0, the CUDA C kernels of
    kernels/cuda.py available, exl3.cu compiled and loaded); checked once per device. Also makes the split's arrival
    counters there (outside any graph capture)."""
    import os
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if isinstance(device, torch.device):
        device = device.index
    dev = torch.cuda.current_device() if device is None else device
    if dev not in _cuda_ok:
        from kernels import cuda
        ok = False
        try:
            if cuda.available(dev):
                cuda.function("exl3.cu", cuda_kernel_name(5, 2, 1), dev)
                _counter(torch.device("cuda", dev))
                with torch.cuda.device(dev):
                    _self_check(torch.device("cuda", dev))
                ok = True
        except (cuda.CudaKernelError, OSError, AssertionError) as exc:
            import sys
            print(f"kernels/exl3.py: the CUDA C EXL3 kernel is not used ({exc})", file=sys.stderr)
        _cuda_ok[dev] = ok
    return _cuda_ok[dev]


def _self_check(dev: torch.device) -> None:
    """Once per device before the kernel is used: a small product at the two rates the packs use most (2.5 mul1,
    4 3inst; a 4-way split, 40 rows) agrees with the Triton path (reconstruct + fp16 GEMM) within the kernels'
    tolerance, and rows through the one- and four-row-tile kernels have the bits they have through the eight-row-tile
    one. AssertionError otherwise (the Triton kernels are used then)."""
    g = torch.Generator().manual_seed(30)
    for K2, cb in ((5, 2), (8, 0)):
        w = Exl3Weight(trellis=torch.randint(-32768, 32768, (1, 32, 8, 8 * K2), generator=g, dtype=torch.int16).to(dev),
                       suh=(0.02 * torch.randn(1, 512, generator=g)).half().to(dev),
                       svh=(0.02 * torch.randn(1, 128, generator=g)).half().to(dev),
                       bias=None, K2=K2, cb=cb, in_features=512, out_features=128)
        x = torch.randn(40, 512, generator=g).to(dev)
        y = exl3_linear_cuda(x, w)                      # eight row tiles
        ref = exl3_linear_prompt(x, w)
        err, top = (y - ref).abs().max().item(), ref.abs().max().item()
        assert err <= 4e-3 * top, f"self-check at K={K2 / 2}: max error {err:.3g} of {top:.3g}"
        for a, b in ((1, 2), (0, 3), (19, 39)):         # one and four row tiles against eight
            assert torch.equal(exl3_linear_cuda(x[a:b], w), y[a:b]), f"self-check at K={K2 / 2}: row invariance"


def _counter(device: torch.device) -> torch.Tensor:
    buf = _counters.get(device)
    if buf is None:
        buf = _counters[device] = torch.zeros(CUDA_COUNTERS, dtype=torch.int32, device=device)
    return buf


def _aligned(t: torch.Tensor, n: int = 16) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % n == 0 else t.clone()


def exl3_grouped_cuda(x: torch.Tensor, w: Exl3Weight, ids: torch.Tensor | None, rows: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float32, target: int = CUDA_TARGET_BLOCKS,
                      variant: str = "", pdl: bool = False) -> torch.Tensor:
    """exl3_grouped on the CUDA C kernel: y[g] = x[g] @ W[ids[g]] (+ bias) for x [G, M, in], one launch; rows
    >= rows[g] of group g are ignored and their outputs unspecified. ids None: every group multiplies matrix 0.
    `target` (the split's blocks per matrix, cuda_split) and `variant` (cuda_kernel_name): only the bench changes
    them. pdl: a programmatic dependent launch (kernels/cuda.py), the bench's comparison: a plain linear streams
    its first weights while the stream's previous kernel finishes."""
    if x.dim() != 3 or x.shape[-1] != w.in_features:
        raise Exl3FormatError(f"x must be [G, M, {w.in_features}], got {tuple(x.shape)}")
    if w.K2 not in _K2_CUDA:
        raise Exl3FormatError(f"no CUDA EXL3 kernel for K = {w.K2 / 2}")
    G, M, D = x.shape
    N = w.out_features
    dev = x.device
    y = torch.empty((G, M, N), dtype=torch.float32, device=dev)
    if G == 0 or M == 0:
        return y.to(out_dtype)
    x = _aligned(x.float())
    if ids is not None:
        ids = ids.to(device=dev, dtype=torch.int32).contiguous()
        if ids.shape != (G,):
            raise Exl3FormatError(f"ids must be [{G}], got {tuple(ids.shape)}")
    elif w.experts != 1:
        raise Exl3FormatError("a stack of matrices needs ids")
    if rows is not None:
        rows = rows.to(device=dev, dtype=torch.int32).contiguous()
    S, hpc = cuda_split(D, N, target)
    RB = -(-M // (8 * cuda_row_tiles(w.K2, w.cb, M, variant)))
    cols = N // CUDA_BLOCK_N
    if G * RB * cols > CUDA_COUNTERS:
        raise Exl3FormatError(f"a launch of {G * RB * cols} column blocks exceeds the {CUDA_COUNTERS} counters")
    part = torch.empty((S, G, M, N), dtype=torch.float32, device=dev) if S > 1 else y
    _launch(x, w, ids, rows, None, y, part, M, N, D, S, hpc, G * RB, variant, pdl)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


# the bench-only forms (cuda_kernel_name) live in a module of their own (exl3.cu compiled with EXL3_BENCH_FORMS)
_BENCH_FORMS = {"o", "r", "n", "e"}


def _launch(x, w, ids, rows, xmap, y, part, M, N, D, S, hpc, z, variant="", pdl=False):
    from kernels import cuda
    dev = x.device
    source = "exl3.cu#EXL3_BENCH_FORMS" if variant in _BENCH_FORMS else "exl3.cu"
    fn = cuda.function(source, cuda_kernel_name(w.K2, w.cb, M, variant), dev.index)
    cuda.launch(fn, (N // CUDA_BLOCK_N, S, z), 128,
                [x, _aligned(w.trellis).view(torch.int32), w.trellis[0].numel() // 2, _aligned(w.suh, 8),
                 _aligned(w.svh, 8), None if w.bias is None else _aligned(w.bias, 8), ids, rows, xmap, y, part,
                 _counter(dev), M, N, D, hpc, S], pdl=pdl)


def exl3_runs_cuda(x: torch.Tensor, w: Exl3Weight, ids: torch.Tensor, rows: torch.Tensor, xmap: torch.Tensor,
                   max_rows: int) -> torch.Tensor:
    """The CUDA C kernel in run mode, for a round's routed experts without a host sync: G positions; position g
    starts a run of rows[g] positions (0: none) multiplied by matrix ids[g] of the stack, position q reading row
    xmap[q] of x [*, in]; y [G, out] (fp32), rows of positions in no run unspecified. max_rows >= every rows[g] (a
    host bound such as G: it picks the kernel and the row blocks, never the arithmetic). Each position's result
    has the bits of the same row through exl3_grouped_cuda / exl3_linear_cuda."""
    if x.dim() != 2 or x.shape[-1] != w.in_features:
        raise Exl3FormatError(f"x must be [*, {w.in_features}], got {tuple(x.shape)}")
    G, D, N = ids.shape[0], w.in_features, w.out_features
    dev = x.device
    y = torch.empty((G, N), dtype=torch.float32, device=dev)
    if G == 0:
        return y
    M = max(1, int(max_rows))
    S, hpc = cuda_split(D, N)
    RB = -(-M // (8 * cuda_row_tiles(w.K2, w.cb, M)))
    if G * RB * (N // CUDA_BLOCK_N) > CUDA_COUNTERS:
        raise Exl3FormatError(f"a launch of {G * RB * (N // CUDA_BLOCK_N)} column blocks exceeds the counters")
    part = torch.empty((S, G, N), dtype=torch.float32, device=dev) if S > 1 else y
    i32 = dict(device=dev, dtype=torch.int32)
    _launch(_aligned(x.float()), w, ids.to(**i32).contiguous(), rows.to(**i32).contiguous(),
            xmap.to(**i32).contiguous(), y, part, M, N, D, S, hpc, G * RB)
    return y


def exl3_linear_cuda(x: torch.Tensor, w: Exl3Weight, out_dtype: torch.dtype = torch.float32,
                     target: int = CUDA_TARGET_BLOCKS, variant: str = "", pdl: bool = False) -> torch.Tensor:
    """y = x @ W (+ bias) for one EXL3 matrix on the CUDA C kernel; any row count, row-invariant."""
    if w.experts != 1:
        raise Exl3FormatError("exl3_linear_cuda takes one matrix; use exl3_grouped_cuda for a stack")
    lead = x.shape[:-1]
    y = exl3_grouped_cuda(x.reshape(1, -1, x.shape[-1]), w, None, out_dtype=out_dtype, target=target,
                          variant=variant, pdl=pdl)
    return y.reshape(*lead, w.out_features)


__all__ = [
    "BLOCK_K",
    "BLOCK_M",
    "BLOCK_N",
    "Exl3Weight",
    "cuda_available",
    "cuda_kernel_name",
    "cuda_split",
    "exl3_grouped",
    "exl3_grouped_cuda",
    "exl3_linear_cuda",
    "exl3_runs_cuda",
    "exl3_linear_prompt",
    "exl3_linear_triton",
    "exl3_reconstruct",
]


# exl3_routed (dsv41/model/exl3_load.py) takes the op set's grouped kernel; the CUDA C one also offers run mode,
# which lets it route a round's experts without waiting for the device
exl3_grouped_cuda.runs = exl3_runs_cuda
