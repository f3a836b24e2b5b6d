"""An mHC site's mixes on the CUDA path in three launches (run by torch: the norm, a row-tiled float32 GEMM with
its padding copies, and thirteen elementwise launches per site, two sites a layer, each a few microseconds of a
decode round's GPU time at one row, where launches, not bytes, bound a layer):

`hc_pre`: the 24 mixes m = (x̂ · fnᵀ) · rsqrt(mean(x̂²) + eps) in arch.md 2.4's order (the product of the raw
flattened streams, then the row's statistic), the K dimension in fixed chunks summed in order: the CUDA path's own
numerics (the torch path normalises first, then multiplies: the same value to float32 rounding), a row's bits
independent of the other rows. Two launches.

`hc_mix`: from m, pre, post and the Sinkhorn-normalised comb, = `dsv41.model.mhc.hc_mix` run by torch on the GPU,
bitwise. One launch.

The same operations in the same order as torch's CUDA kernels run them, one per element:
- x = m · scale[i] + base (two roundings: FMA contraction off);
- sigmoid as dsv41.model.linear.sigmoid, 1 / (1 + exp(-x)): libdevice's expf (the CUDA math library's function that
  torch's `std::exp` compiles to), an IEEE add, a correctly rounded reciprocal (torch's `1.0 / t`); pre adds
  float32(hc_eps), post doubles (exact);
- softmax over each comb row of 4 as torch's persistent warp softmax for rows of 4: the max, e = expf(x - max), the
  sum in its butterfly order (e0 + e2) + (e1 + e3), e / sum correctly rounded; then + float32(hc_eps);
- Sinkhorn as kernels/rowops.py (each stream sum left to right, divisions correctly rounded).
The interpreter has no libdevice: numpy's exp stands in (close, not bitwise torch's CPU exp), so `hc_mix` runs on
CUDA tensors only (the op set's torch function runs on CPU ones); the CPU tests launch the kernel itself (`launch`)
and check it to float32 rounding, the GPU test checks `hc_mix` against torch bitwise. Each row's results depend on
its row only (a block of rows per program, no reduction across rows).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import pdl
from kernels.numerics import inv_count
from kernels.pdl import wait_inputs
from kernels.rowops import _f32, _stream_sum

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROWS = 16
LAUNCH = {} if INTERPRET else {"enable_fp_fusion": False, "enable_reflect_ftz": False}   # torch: no FTZ


@triton.jit
def _exp(x, INTERP: tl.constexpr):
    if INTERP:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _sigmoid(x, INTERP: tl.constexpr):
    """1 / (1 + exp(-x)), each step rounded (dsv41.model.linear.sigmoid on CUDA)."""
    d = 1.0 + _exp(-x, INTERP)
    return tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d)


@triton.jit
def _hc_mix_kernel(m_ptr, s_ptr, b_ptr, pre_ptr, post_ptr, comb_ptr, n, stride_m, iters, eps,
                   HC: tl.constexpr, BR: tl.constexpr, INTERP: tl.constexpr):
    _mix_rows(m_ptr, s_ptr, b_ptr, pre_ptr, post_ptr, comb_ptr, n, stride_m, iters, eps, tl.program_id(0), HC, BR,
              INTERP)


@triton.jit
def _mix_rows(m_ptr, s_ptr, b_ptr, pre_ptr, post_ptr, comb_ptr, n, stride_m, iters, eps, block,
              HC: tl.constexpr, BR: tl.constexpr, INTERP: tl.constexpr):
    """Rows block·BR .. of the mixes m -> pre, post, comb (hc_mix)."""
    rows = block * BR + tl.arange(0, BR)
    ok = rows < n
    r64 = rows.to(tl.int64)
    j = tl.arange(0, HC)
    mrow = m_ptr + r64 * stride_m
    at = r64[:, None] * HC + j[None, :]
    x = tl.load(mrow[:, None] + j[None, :], mask=ok[:, None], other=0.0) * tl.load(s_ptr) + tl.load(b_ptr + j)[None, :]
    tl.store(pre_ptr + at, _sigmoid(x, INTERP) + eps, mask=ok[:, None])
    x = (tl.load(mrow[:, None] + HC + j[None, :], mask=ok[:, None], other=0.0) * tl.load(s_ptr + 1)
         + tl.load(b_ptr + HC + j)[None, :])
    tl.store(post_ptr + at, 2.0 * _sigmoid(x, INTERP), mask=ok[:, None])
    # comb: [BR, HC (stream j), HC (stream k)], softmax over k
    jj = tl.arange(0, HC)[None, :, None]
    kk = tl.arange(0, HC)[None, None, :]
    off = jj * HC + kk
    ok3 = ok[:, None, None]
    x = tl.load(mrow[:, None, None] + 2 * HC + off, mask=ok3, other=0.0) * tl.load(s_ptr + 2) + \
        tl.load(b_ptr + 2 * HC + off)
    e = _exp(x - tl.max(x, axis=2)[:, :, None], INTERP)
    # the warp butterfly of 4 lanes: lane k + lane k^2, then + lane k^1 -> (e0 + e2) + (e1 + e3); each term picked
    # alone by a masked sum whose other terms are +0.0 (exact: the terms are >= 0)
    e0 = tl.sum(tl.where(kk == 0, e, 0.0), axis=2)
    e1 = tl.sum(tl.where(kk == 1, e, 0.0), axis=2)
    e2 = tl.sum(tl.where(kk == 2, e, 0.0), axis=2)
    e3 = tl.sum(tl.where(kk == 3, e, 0.0), axis=2)
    c = tl.div_rn(e, ((e0 + e2) + (e1 + e3))[:, :, None]) + eps
    c = tl.div_rn(c, _stream_sum(c, 1, HC)[:, None, :] + eps)          # Sinkhorn: norm_cols
    for _ in range(iters - 1):
        c = tl.div_rn(c, _stream_sum(c, 2, HC)[:, :, None] + eps)      # norm_rows
        c = tl.div_rn(c, _stream_sum(c, 1, HC)[:, None, :] + eps)      # norm_cols
    tl.store(comb_ptr + r64[:, None, None] * (HC * HC) + off, c, mask=ok3)


@triton.jit
def _hc_pre_partial_kernel(x_ptr, fn_ptr, part_ptr, n, K, stride_x, KC: tl.constexpr, BK: tl.constexpr,
                           NM: tl.constexpr, NMP: tl.constexpr, BR: tl.constexpr):
    """Program (row block, K chunk): _pre_partial."""
    _pre_partial(x_ptr, fn_ptr, part_ptr, n, K, stride_x, tl.program_id(0), tl.program_id(1), KC, BK, NM, NMP, BR)


@triton.jit
def _pre_partial(x_ptr, fn_ptr, part_ptr, n, K, stride_x, block, chunk, KC: tl.constexpr, BK: tl.constexpr,
                 NM: tl.constexpr, NMP: tl.constexpr, BR: tl.constexpr):
    """Each row's dots with the NM mix weights over its chunk of the flattened streams, and its sum of squares
    there -> part[chunk, row, 0:NM], part[chunk, row, NM]. The chunk's steps run in order, each a fixed-shape
    product (a row's sums never see another row)."""
    rows = block * BR + tl.arange(0, BR)
    ok = rows < n
    r64 = rows.to(tl.int64)
    j = tl.arange(0, NMP)
    acc = tl.zeros((BR, NMP), dtype=tl.float32)
    sq = tl.zeros((BR,), dtype=tl.float32)
    for k0 in tl.range(0, KC, BK):                   # a loop: unrolled, a 1024 chunk's steps spill
        kk = chunk * KC + k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + r64[:, None] * stride_x + kk[None, :], mask=ok[:, None] & (kk < K)[None, :], other=0.0)
        w = tl.load(fn_ptr + j[:, None].to(tl.int64) * K + kk[None, :], mask=(j < NM)[:, None] & (kk < K)[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
    base = part_ptr + (chunk.to(tl.int64) * n + r64) * (NM + 1)
    tl.store(base[:, None] + j[None, :], acc, mask=ok[:, None] & (j < NM)[None, :])
    tl.store(base + NM, sq, mask=ok)


@triton.jit
def _hc_pre_combine_kernel(part_ptr, m_ptr, n, inv_k, eps, S: tl.constexpr, NM: tl.constexpr, NMP: tl.constexpr,
                           BR: tl.constexpr):
    _pre_combine(part_ptr, m_ptr, n, inv_k, eps, tl.program_id(0), S, NM, NMP, BR)


@triton.jit
def _pre_combine(part_ptr, m_ptr, n, inv_k, eps, block, S: tl.constexpr, NM: tl.constexpr, NMP: tl.constexpr,
                 BR: tl.constexpr):
    """m = (Σ_chunks dots) · rsqrt(Σ_chunks squares · (1/K) + eps) per row, the chunks summed in order (arch.md
    2.4: one statistic per token, applied after the product). The chunk loop is unrolled (S a constexpr): its
    loads do not wait on each other's adds, where a loop over a runtime S paid a load latency per chunk (~0.5 µs
    each, 80 of them at hc · H = 20480: 44 µs a site at one row on the H200)."""
    rows = block * BR + tl.arange(0, BR)
    ok = rows < n
    r64 = rows.to(tl.int64)
    j = tl.arange(0, NMP)
    dots = tl.zeros((BR, NMP), dtype=tl.float32)
    sq = tl.zeros((BR,), dtype=tl.float32)
    for c in tl.static_range(S):
        base = part_ptr + (c * n + r64) * (NM + 1)
        dots += tl.load(base[:, None] + j[None, :], mask=ok[:, None] & (j < NM)[None, :], other=0.0)
        sq += tl.load(base + NM, mask=ok, other=0.0)
    r = tl.div_rn(tl.full(sq.shape, 1.0, tl.float32), tl.sqrt_rn(sq * inv_k + eps))
    tl.store(m_ptr + r64[:, None] * NM + j[None, :], dots * r[:, None], mask=ok[:, None] & (j < NM)[None, :])


@triton.jit
def _hc_site_mixes_kernel(x_ptr, fn_ptr, part_ptr, cnt_ptr, m_ptr, s_ptr, b_ptr, pre_ptr, post_ptr, comb_ptr, n, K,
                          stride_x, inv_k, norm_eps, iters, hc_eps, S: tl.constexpr, KC: tl.constexpr, BK: tl.constexpr,
                          NM: tl.constexpr, NMP: tl.constexpr, BR: tl.constexpr, HC: tl.constexpr,
                          INTERP: tl.constexpr, MIX: tl.constexpr, PDL: tl.constexpr):
    """An mHC site's mixes in one launch: program (row block, K chunk) stores its chunk's partial (_pre_partial);
    the last of a row block's S programs to arrive sums them in chunk order (_pre_combine) and runs hc_mix on the
    block's rows (_mix_rows): the two kernels' and hc_mix's bits, whichever program arrives last. MIX false: m
    only (the bench's variant with hc_mix as a one-warp launch after it)."""
    wait_inputs(PDL)
    block = tl.program_id(0)
    _pre_partial(x_ptr, fn_ptr, part_ptr, n, K, stride_x, block, tl.program_id(1), KC, BK, NM, NMP, BR)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel")
    if done == S - 1:
        _pre_combine(part_ptr, m_ptr, n, inv_k, norm_eps, block, S, NM, NMP, BR)
        if MIX:
            tl.debug_barrier()                          # the block's m, whole, before its rows are mixed
            _mix_rows(m_ptr, s_ptr, b_ptr, pre_ptr, post_ptr, comb_ptr, n, NM, iters, hc_eps, block, HC, BR,
                      INTERP)
        tl.atomic_xchg(cnt_ptr + block, 0)              # ready for the next launch (and the next graph replay)


PRE_KC, PRE_BK, PRE_ROWS, PRE_WARPS = 256, 32, 16, 4   # BK 64 at 4 warps spills (compile_check)
# (K chunk, step, warps, hc_mix in the launch) of hc_site_mixes: the served form, then bench/kernels_bench.py's
# variants (--only rowops; a 1-row launch was 30 us on the H200 in session 13, the chunk's serial steps and the
# 4-warp mix its suspects)
SITE_SWEEP = ((PRE_KC, PRE_BK, PRE_WARPS, True), (256, 32, 4, False), (256, 64, 8, True), (256, 128, 8, True),
              (512, 128, 8, True), (256, 64, 8, False))


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor | None:
    """The mixes m [n, NM] = (x̂ · fnᵀ) · rsqrt(mean(x̂²) + eps) of the flattened streams x̂ [n, hc · H] (arch.md 2.4's
    order: the product of the raw streams, then the row's statistic), for float32 streams and fn [NM, hc · H] on
    CUDA, in two launches: fixed K chunks of PRE_KC (each a program per block of PRE_ROWS rows) and their sums in
    chunk order, so a row's bits do not depend on the other rows. None where it does not apply."""
    if (streams.device.type != "cuda" or streams.dtype != torch.float32 or fn.dtype != torch.float32
            or streams.dim() != 3 or fn.dim() != 2 or fn.shape[1] != streams.shape[1] * streams.shape[2]
            or fn.shape[0] > 64):
        return None
    return launch_pre(streams, fn, norm_eps)


def launch_pre(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """hc_pre's kernels themselves, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    n = streams.shape[0]
    x = streams.reshape(n, -1)
    if x.stride(1) != 1:
        x = x.contiguous()
    K, NM = x.shape[1], fn.shape[0]
    NMP = max(16, triton.next_power_of_2(NM))
    S = triton.cdiv(K, PRE_KC)
    m = torch.empty((n, NM), dtype=torch.float32, device=x.device)
    if n:
        part = torch.empty((S, n, NM + 1), dtype=torch.float32, device=x.device)
        grid = triton.cdiv(n, PRE_ROWS)
        _hc_pre_partial_kernel[(grid, S)](x, fn.contiguous(), part, n, K, x.stride(0), KC=PRE_KC, BK=PRE_BK, NM=NM,
                                          NMP=NMP, BR=PRE_ROWS, num_warps=PRE_WARPS, **LAUNCH)
        _hc_pre_combine_kernel[(grid,)](part, m, n, inv_count(K), _f32(norm_eps), S=S, NM=NM, NMP=NMP, BR=PRE_ROWS,
                                        num_warps=1, **LAUNCH)
    return m


def hc_site_mixes(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                  iters: int, hc_eps: float, norm_eps: float) -> tuple | None:
    """(pre, post, comb) of an mHC site from its streams [n, hc, H] in one launch: hc_pre then hc_mix, their bits
    (the same functions; the last program of a row block to finish its chunk completes the block). On CUDA where
    both apply, else None (the caller runs them apart)."""
    if (streams.device.type != "cuda" or hc != 4 or streams.dtype != torch.float32 or fn.dtype != torch.float32
            or streams.dim() != 3 or streams.shape[1] != hc or fn.dim() != 2
            or fn.shape != ((2 + hc) * hc, streams.shape[1] * streams.shape[2]) or iters < 1
            or any(t.dtype != torch.float32 for t in (scale, base))):
        return None
    return launch_site(streams, fn, scale, base, hc, iters, hc_eps, norm_eps)


_counters: dict[torch.device, torch.Tensor] = {}


def launch_site(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                iters: int, hc_eps: float, norm_eps: float, kc: int = PRE_KC, bk: int = PRE_BK,
                warps: int = PRE_WARPS, mix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_site_mixes' kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones. The bench's sweep varies
    kc (the K chunk), bk (its step: bk == kc loads the chunk at once), warps, and mix (False: hc_mix as a one-warp
    launch after it); the op set's are hc_pre's (PRE_KC, PRE_BK, PRE_WARPS) and mix in the launch."""
    n = streams.shape[0]
    x = streams.reshape(n, -1)
    if x.stride(1) != 1:
        x = x.contiguous()
    K, NM = x.shape[1], fn.shape[0]
    S = triton.cdiv(K, kc)
    pre = torch.empty((n, hc), dtype=torch.float32, device=x.device)
    post = torch.empty_like(pre)
    comb = torch.empty((n, hc, hc), dtype=torch.float32, device=x.device)
    if n:
        blocks = triton.cdiv(n, PRE_ROWS)
        cnt = _counters.get(x.device)
        if cnt is None or cnt.numel() < blocks:       # zeroed; each launch leaves it zeroed again
            cnt = _counters[x.device] = torch.zeros(max(blocks, 1024), dtype=torch.int32, device=x.device)
        part = torch.empty((S, n, NM + 1), dtype=torch.float32, device=x.device)
        m = torch.empty((n, NM), dtype=torch.float32, device=x.device)
        _hc_site_mixes_kernel[(blocks, S)](x, fn.contiguous(), part, cnt, m, scale.contiguous(), base.contiguous(),
                                           pre, post, comb, n, K, x.stride(0), inv_count(K), _f32(norm_eps),
                                           int(iters), _f32(hc_eps), S=S, KC=kc, BK=bk, NM=NM,
                                           NMP=max(16, triton.next_power_of_2(NM)), BR=PRE_ROWS, HC=hc,
                                           INTERP=INTERPRET, MIX=mix, num_warps=warps, **LAUNCH,
                                           **pdl.options(x))
        if not mix:
            return launch(m, scale, base, hc, iters, hc_eps)
    return pre, post, comb


def hc_mix(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
           hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(pre [n, hc], post [n, hc], comb [n, hc, hc]) from float32 mixes m [n, (2 + hc) · hc] on CUDA, as
    dsv41.model.mhc.hc_mix; None where it does not apply (the caller's torch function runs): CPU tensors, hc != 4
    (the softmax's butterfly is written for rows of 4), other dtypes."""
    if (m.device.type != "cuda" or hc != 4 or m.dim() != 2 or m.shape[1] != (2 + hc) * hc
            or any(t.dtype != torch.float32 for t in (m, scale, base)) or iters < 1):
        return None
    return launch(m, scale, base, hc, iters, hc_eps)


def launch(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
           hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    n = m.shape[0]
    if m.stride(1) != 1:
        m = m.contiguous()
    pre = torch.empty((n, hc), dtype=torch.float32, device=m.device)
    post = torch.empty_like(pre)
    comb = torch.empty((n, hc, hc), dtype=torch.float32, device=m.device)
    if n:
        _hc_mix_kernel[(triton.cdiv(n, ROWS),)](m, scale.contiguous(), base.contiguous(), pre, post, comb, n,
                                                m.stride(0), int(iters), _f32(hc_eps), HC=hc, BR=ROWS,
                                                INTERP=INTERPRET, num_warps=1, **LAUNCH)
    return pre, post, comb
