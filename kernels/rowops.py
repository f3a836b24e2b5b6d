"""The per-layer row ops of the CUDA path in one launch each: RMSNorm with the fixed pairwise-tree row sum, the
mHC Sinkhorn normalisation of all rows' comb matrices, and the mHC stream collapse / expand.

Reference (the torch fallbacks, which the kernels must equal BITWISE on the same device):
- `rms_norm(x, w, eps)` = the CUDA op set's (dsv41/model/ops.py) norm: y = x · (1 / sqrt(Σ_tree(x·x) · (1/n) +
  eps)) · w, where Σ_tree is `kernels.numerics.tree_row_sum` (level by level: s[i] = s[i] + s[i + L//2] for
  i < L//2, an odd length's last element carried to position L//2) and 1/n is float32(1)/float32(n) (torch's CUDA
  `t / n` multiplies by that; the op set's tree mean writes it out: kernels.numerics.inv_count);
- `sinkhorn(comb, iters, eps)` = `dsv41.model.mhc.sinkhorn` (hc_mixes' Sinkhorn): norm_cols, then (iters - 1) ×
  (norm_rows, norm_cols), each sum over the 4 streams left to right ((c0 + c1) + c2) + c3, then c / (sum + eps);
- `hc_collapse`, `hc_expand` = `dsv41.model.mhc.hc_collapse` / `hc_expand`: each product rounded, then the sum over
  the streams left to right (and post·y added last);
- `route_weights` = `dsv41.model.moe.route_weights` (the end of `MoE.route`): the scores at the picks, divided by
  their slot-order sum + 1e-20, times the routed scaling factor.

Why bitwise: the kernels run only IEEE float32 operations that round once (add, mul, div_rn, sqrt_rn) in the
reference's order, with FMA contraction off (`enable_fp_fusion=False`: ptxas may not fuse x·x + y·y), and torch's
CUDA kernels run the same correctly rounded operations (nvcc without fast math: div.rn, sqrt.rn; `1 / t` is
reciprocal · 1). Under TRITON_INTERPRET=1 numpy runs them with the same IEEE rounding, so the CPU tests compare
them with the fallback run on CPU tensors (the op set cuda_ops(kernels=False)). A row's result depends on its row
only (one program per row for the norm; row-wise blocks for Sinkhorn), whatever the row count.

The tree runs in a per-row scratch buffer (two halves of ceil(n/2), ping-pong: the first level reads x and writes
one half, each next level reads one half and writes the other; a block barrier between levels), so one program
handles any row length (5120, 20480, odd lengths) with about one row of scratch.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.numerics import inv_count
from kernels.pdl import wait_inputs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
NORM_BLOCK, NORM_WARPS = 1024, 4
REG_ELEMENTS, REG_WARPS = 8192, 8     # rows whose [P, OP] tile is at most this many elements stay in registers
SINK_ROWS = 32
LAUNCH = {} if INTERPRET else {"enable_fp_fusion": False}


def tree_shape(n: int) -> dict | None:
    """The register tile of a row of n (_tree_cols): n = ODD · P, P the largest power of two dividing n; the
    constexprs of the register kernels, or None where the padded tile would pass REG_ELEMENTS (the scratch-row
    kernels take those rows)."""
    if n <= 0:
        return None
    p = n & -n
    odd = n // p
    op = triton.next_power_of_2(odd)
    if p * op > REG_ELEMENTS or op > 16:           # the tail's moves are [OP, OP] selections: a few survivors
        return None
    tail, length = 0, odd
    while length > 1:
        length = length // 2 + length % 2
        tail += 1
    return {"P": p, "OP": op, "LOG_P": p.bit_length() - 1, "ODD": odd, "TAIL": tail}


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, buf_ptr, N, inv_n, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    _norm_row(x_ptr + r * N, w_ptr, out_ptr + r * N, buf_ptr + r * (2 * ((N + 1) // 2)), N, inv_n, eps, HAS_W,
              BLOCK)


@triton.jit
def _rms_norm_reg_kernel(x_ptr, w_ptr, out_ptr, N, inv_n, eps, HAS_W: tl.constexpr, P: tl.constexpr,
                         OP: tl.constexpr, LOG_P: tl.constexpr, ODD: tl.constexpr, TAIL: tl.constexpr,
                         PDL: tl.constexpr):
    """_rms_norm_kernel with the row and its tree in registers (rows up to REG_ELEMENTS padded): the same bits."""
    wait_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols, m = _tree_cols(P, OP, ODD)
    x = tl.load(x_ptr + r * N + cols, mask=m, other=0.0)
    tl.store(out_ptr + r * N + cols, _normed(x, w_ptr, cols, m, inv_n, eps, HAS_W, P, OP, LOG_P, ODD, TAIL), mask=m)


@triton.jit
def _norm_row(xr, w_ptr, orow, src, N, inv_n, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """One row's norm: xr [N] -> orow [N] (may be xr: each element is read, then written, by one thread), the
    tree's levels in the scratch row src [2 * ceil(N/2)]."""
    half_n = (N + 1) // 2                              # the scratch row: two halves of ceil(N/2) (ping-pong)
    dst = src + half_n
    offs = tl.arange(0, BLOCK)
    half = N // 2
    for c in range(0, half, BLOCK):                    # the first level, on the squares (x.square(): x · x)
        i = c + offs
        m = i < half
        a = tl.load(xr + i, mask=m, other=0.0)
        b = tl.load(xr + i + half, mask=m, other=0.0)
        tl.store(src + i, a * a + b * b, mask=m)
    carry = offs < N % 2                               # an odd length's last element moves to position half
    last = tl.load(xr + (N - 1) + offs, mask=carry, other=0.0)
    tl.store(src + half + offs, last * last, mask=carry)
    tl.debug_barrier()
    length = half + N % 2
    while length > 1:                                  # device.tree_row_sum, level by level
        half = length // 2
        for c in range(0, half, BLOCK):
            i = c + offs
            m = i < half
            s = tl.load(src + i, mask=m, other=0.0) + tl.load(src + i + half, mask=m, other=0.0)
            tl.store(dst + i, s, mask=m)
        carry = offs < length % 2                        # an odd length's last element moves to position half
        tl.store(dst + half + offs, tl.load(src + (length - 1) + offs, mask=carry, other=0.0), mask=carry)
        length = half + length % 2
        tl.debug_barrier()
        tmp = src
        src = dst
        dst = tmp
    total = tl.load(src)
    rstd = tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(total * inv_n + eps))
    for c in range(0, N, BLOCK):
        i = c + offs
        m = i < N
        y = tl.load(xr + i, mask=m, other=0.0) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + i, mask=m, other=0.0)
        tl.store(orow + i, y, mask=m)


@triton.jit
def _stream_sum(c, axis: tl.constexpr, HC: tl.constexpr):
    """Σ of c [BR, HC, HC] over `axis` (1: over j, 2: over k), left to right: ((c_0 + c_1) + c_2) + ... Each term
    is picked by a masked sum whose other terms are +0.0 (exact: the entries are positive)."""
    idx = tl.arange(0, HC)
    if axis == 1:
        sel = idx[None, :, None]
    else:
        sel = idx[None, None, :]
    acc = tl.sum(tl.where(sel == 0, c, 0.0), axis=axis)
    for t in tl.static_range(1, HC):
        acc = acc + tl.sum(tl.where(sel == t, c, 0.0), axis=axis)
    return acc


@triton.jit
def _sinkhorn_kernel(c_ptr, out_ptr, n, iters, eps, HC: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = (rows < n)[:, None, None]
    j = tl.arange(0, HC)[None, :, None]
    k = tl.arange(0, HC)[None, None, :]
    at = rows.to(tl.int64)[:, None, None] * (HC * HC) + j * HC + k
    c = tl.load(c_ptr + at, mask=ok, other=1.0)
    c = tl.div_rn(c, _stream_sum(c, 1, HC)[:, None, :] + eps)          # norm_cols
    for _ in range(iters - 1):
        c = tl.div_rn(c, _stream_sum(c, 2, HC)[:, :, None] + eps)      # norm_rows
        c = tl.div_rn(c, _stream_sum(c, 1, HC)[:, None, :] + eps)      # norm_cols
    tl.store(out_ptr + at, c, mask=ok)


@triton.jit
def _hc_collapse_kernel(s_ptr, pre_ptr, out_ptr, H, HC: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = ((pre[r,0]·x_0 + pre[r,1]·x_1) + pre[r,2]·x_2) + … for x_j = streams[r, j] (mhc.hc_collapse)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.load(pre_ptr + r * HC) * tl.load(s_ptr + r * HC * H + cols, mask=m, other=0.0)
    for j in tl.static_range(1, HC):
        acc = acc + tl.load(pre_ptr + r * HC + j) * tl.load(s_ptr + (r * HC + j) * H + cols, mask=m, other=0.0)
    tl.store(out_ptr + r * H + cols, acc, mask=m)


@triton.jit
def _hc_expand_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, H, HC: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    """out[r, k] = post[r,k]·y[r] + ((comb[r,0,k]·x_0 + comb[r,1,k]·x_1) + …) for x_j = residual[r, j]
    (mhc.hc_expand), all k of a column block at once."""
    wait_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    k = tl.arange(0, HC)
    acc = tl.load(comb_ptr + r * HC * HC + k)[:, None] * tl.load(res_ptr + r * HC * H + cols, mask=m, other=0.0)[None, :]
    for j in tl.static_range(1, HC):
        x = tl.load(res_ptr + (r * HC + j) * H + cols, mask=m, other=0.0)
        acc = acc + tl.load(comb_ptr + (r * HC + j) * HC + k)[:, None] * x[None, :]
    y = tl.load(y_ptr + r * H + cols, mask=m, other=0.0)
    out = tl.load(post_ptr + r * HC + k)[:, None] * y[None, :] + acc
    tl.store(out_ptr + (r * HC + k)[:, None] * H + cols[None, :], out, mask=m[None, :])


@triton.jit
def _site_cols(y_ptr, y2_ptr, res_ptr, post_ptr, comb_ptr, streams_ptr, pre_ptr, r, H, cols, m, HC: tl.constexpr,
               EXPAND: tl.constexpr, Y2: tl.constexpr):
    """Row r's columns `cols` (any shape, masked by m) of a site's input: (EXPAND) the streams = hc_expand(y,
    residual, post, comb), stored; -> the collapse u = hc_collapse(streams, pre) there. Each element by the
    operations of _hc_expand_kernel and _hc_collapse_kernel; stream by stream (a [HC, BLOCK] tile's rows picked by
    a sum would lose a -0.0's sign in the interpreter's sum)."""
    if EXPAND:
        y = tl.load(y_ptr + r * H + cols, mask=m, other=0.0)
        if Y2:              # y the sum of two partials, in order (the TP shards' wo_b products)
            y = y + tl.load(y2_ptr + r * H + cols, mask=m, other=0.0)
    for k in tl.static_range(HC):
        if EXPAND:          # stream k: post_k·y + ((comb[0,k]·x_0 + comb[1,k]·x_1) + …)
            acc = tl.load(comb_ptr + r * HC * HC + k) * tl.load(res_ptr + r * HC * H + cols, mask=m, other=0.0)
            for j in tl.static_range(1, HC):
                acc = acc + (tl.load(comb_ptr + (r * HC + j) * HC + k)
                             * tl.load(res_ptr + (r * HC + j) * H + cols, mask=m, other=0.0))
            st = tl.load(post_ptr + r * HC + k) * y + acc
            tl.store(streams_ptr + (r * HC + k) * H + cols, st, mask=m)
        else:
            st = tl.load(streams_ptr + (r * HC + k) * H + cols, mask=m, other=0.0)
        if k == 0:          # the collapse: ((pre_0·s_0 + pre_1·s_1) + …)
            u = tl.load(pre_ptr + r * HC) * st
        else:
            u = u + tl.load(pre_ptr + r * HC + k) * st
    return u


@triton.jit
def _hc_site_in_kernel(y_ptr, y2_ptr, res_ptr, post_ptr, comb_ptr, streams_ptr, pre_ptr, w_ptr, x_ptr, buf_ptr, H,
                       inv_n, eps, HC: tl.constexpr, BLOCK: tl.constexpr, EXPAND: tl.constexpr, HAS_W: tl.constexpr,
                       Y2: tl.constexpr):
    """A site's input in one program per row (rows too long for _hc_site_in_reg_kernel): _site_cols block by
    block into x's row, then rms_norm in place (the scratch-row tree): the bits of the three launches."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    xr = x_ptr + r * H
    for c in range(0, H, BLOCK):
        cols = c + offs
        m = cols < H
        u = _site_cols(y_ptr, y2_ptr, res_ptr, post_ptr, comb_ptr, streams_ptr, pre_ptr, r, H, cols, m, HC, EXPAND,
                       Y2)
        tl.store(xr + cols, u, mask=m)
    tl.debug_barrier()                                 # the row's collapse, whole, before its norm reads it
    _norm_row(xr, w_ptr, xr, buf_ptr + r * (2 * ((H + 1) // 2)), H, inv_n, eps, HAS_W, BLOCK)


@triton.jit
def _hc_site_in_reg_kernel(y_ptr, y2_ptr, res_ptr, post_ptr, comb_ptr, streams_ptr, pre_ptr, w_ptr, x_ptr, H, inv_n,
                           eps, HC: tl.constexpr, EXPAND: tl.constexpr, HAS_W: tl.constexpr, Y2: tl.constexpr,
                           P: tl.constexpr, OP: tl.constexpr, LOG_P: tl.constexpr, ODD: tl.constexpr,
                           TAIL: tl.constexpr, PDL: tl.constexpr):
    """_hc_site_in_kernel with the row in registers (its tree in registers too: _tree_total), one program per row:
    the same bits without the scratch row's level-by-level round trips."""
    wait_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols, m = _tree_cols(P, OP, ODD)
    u = _site_cols(y_ptr, y2_ptr, res_ptr, post_ptr, comb_ptr, streams_ptr, pre_ptr, r, H, cols, m, HC, EXPAND, Y2)
    tl.store(x_ptr + r * H + cols, _normed(u, w_ptr, cols, m, inv_n, eps, HAS_W, P, OP, LOG_P, ODD, TAIL), mask=m)


@triton.jit
def _tree_cols(P: tl.constexpr, OP: tl.constexpr, ODD: tl.constexpr):
    """A row of N = ODD · P elements (P a power of two, ODD odd <= OP) as a [P, OP] tile: element c·ODD + j at
    [c, j], columns j >= ODD masked off. Then the tree's level that pairs i with i + N/2 pairs tile row c with
    c + P/2 (same j): a reshape to [2, P/2, OP] and a sum over its first axis (one add)."""
    c = tl.arange(0, P)
    j = tl.arange(0, OP)
    cols = c[:, None] * ODD + j[None, :]
    return cols, (j < ODD)[None, :] & (c >= 0)[:, None]


@triton.jit
def _tree_total(x, P: tl.constexpr, OP: tl.constexpr, LOG_P: tl.constexpr, ODD: tl.constexpr, TAIL: tl.constexpr):
    """Σ_tree(x·x) (numerics.tree_row_sum of the squares) of a row held as _tree_cols' [P, OP] tile (masked
    columns 0): the LOG_P halving levels as reshape-and-add, then tree_row_sum's levels on the ODD survivors (TAIL
    of them: L -> L//2 + L%2), each element moved by a masked sum whose other terms are +0.0 (exact: squares are
    >= 0)."""
    s = x * x
    for lvl in tl.static_range(LOG_P):
        s = tl.sum(tl.reshape(s, [2, P >> (lvl + 1), OP]), axis=0)
    s = tl.reshape(s, [OP])
    i = tl.arange(0, OP)
    length = ODD
    for _ in tl.static_range(TAIL):
        half = length // 2
        shifted = tl.sum(tl.where(i[None, :] == i[:, None] + half, s[None, :], 0.0), axis=1)    # s[i + half]
        last = tl.sum(tl.where(i == length - 1, s, 0.0), axis=0)
        s = tl.where(i < half, s + shifted, tl.where((i == half) & (length % 2 == 1), last, 0.0))
        length = half + length % 2
    return tl.sum(tl.where(i == 0, s, 0.0), axis=0)


@triton.jit
def _normed(x, w_ptr, cols, m, inv_n, eps, HAS_W: tl.constexpr, P: tl.constexpr, OP: tl.constexpr,
            LOG_P: tl.constexpr, ODD: tl.constexpr, TAIL: tl.constexpr):
    """x · (1 / sqrt(Σ_tree(x·x) · (1/n) + eps)) · w of a row held as a _tree_cols tile (_norm_row's operations)."""
    total = _tree_total(tl.where(m, x, 0.0), P, OP, LOG_P, ODD, TAIL)
    rstd = tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(total * inv_n + eps))
    y = x * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=m, other=0.0)
    return y


@triton.jit
def _route_weights_kernel(s_ptr, ids_ptr, out_ptr, n, E, eps, scaling, K: tl.constexpr, KP: tl.constexpr,
                          BR: tl.constexpr):
    """w = s[r, ids[r]]; out = w / (((w_0 + w_1) + …) + eps) · scaling (moe.MoE.route after the top-k)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < n
    j = tl.arange(0, KP)
    m = ok[:, None] & (j < K)[None, :]
    rows = rows.to(tl.int64)
    ids = tl.load(ids_ptr + rows[:, None] * K + j[None, :], mask=m, other=0)
    w = tl.load(s_ptr + rows[:, None] * E + ids, mask=m, other=0.0)
    total = tl.sum(tl.where(j[None, :] == 0, w, 0.0), axis=1)       # each term picked alone (+0.0 others)
    for t in tl.static_range(1, K):
        total = total + tl.sum(tl.where(j[None, :] == t, w, 0.0), axis=1)
    out = tl.div_rn(w, total[:, None] + eps) * scaling
    tl.store(out_ptr + rows[:, None] * K + j[None, :], out, mask=m)


@functools.lru_cache(maxsize=64)
def _f32(v: float) -> float:
    """v rounded to float32 (as torch rounds a Python scalar for a float32 tensor op), as a Python float."""
    return float(torch.tensor(v, dtype=torch.float32, device="cpu"))


def _check_device(x: torch.Tensor, name: str) -> None:
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"{name} runs on CUDA (or on CPU under TRITON_INTERPRET=1)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x · rsqrt(mean_tree(x²) + eps) · weight over the last dim (float32), one launch; bitwise the CUDA op set's
    torch norm (linear.rms_norm with the tree mean)."""
    _check_device(x, "rms_norm")
    x = x.float()
    shape = x.shape
    n_cols = shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    rows = x2.shape[0]
    out = torch.empty_like(x2)
    if weight is not None and tuple(weight.shape) != (n_cols,):
        raise ValueError(f"rms_norm: weight must be [{n_cols}], got {list(weight.shape)}")
    if rows == 0 or n_cols == 0:
        return out.reshape(shape)
    w = weight.float().contiguous() if weight is not None else x2
    tile = tree_shape(n_cols)
    if tile is not None:
        _rms_norm_reg_kernel[(rows,)](x2, w, out, n_cols, inv_count(n_cols), _f32(eps), HAS_W=weight is not None,
                                      **tile, num_warps=REG_WARPS, **LAUNCH, **pdl.options(x2))
        return out.reshape(shape)
    buf = torch.empty((rows, 2 * ((n_cols + 1) // 2)), dtype=torch.float32, device=x.device)
    _rms_norm_kernel[(rows,)](x2, w, out, buf, n_cols, inv_count(n_cols), _f32(eps), HAS_W=weight is not None,
                              BLOCK=NORM_BLOCK, num_warps=NORM_WARPS, **LAUNCH)
    return out.reshape(shape)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor | None:
    """comb [n, hc, hc] (softmax + eps) -> the doubly stochastic comb of mhc.hc_mixes, one launch; None when hc is
    not a power of two or comb is not on CUDA (the caller runs the torch loop: hc_mix's CPU fallback calls the op
    set's Sinkhorn on CPU tensors)."""
    if comb.device.type != "cuda" and not INTERPRET:
        return None
    n, hc, hc2 = comb.shape
    if hc != hc2 or hc & (hc - 1) or comb.dtype != torch.float32:
        return None
    c = comb.contiguous()
    out = torch.empty_like(c)
    if n == 0:
        return out
    _sinkhorn_kernel[(triton.cdiv(n, SINK_ROWS),)](c, out, n, int(iters), _f32(eps), HC=hc, BR=SINK_ROWS,
                                                   num_warps=1, **LAUNCH)
    return out


ELEM_BLOCK = 1024


def _mix_ok(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in ts)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor | None:
    """mhc.hc_collapse in one launch: [n, hc, H], [n, hc] -> [n, H]; None where it does not apply (dtype)."""
    _check_device(streams, "hc_collapse")
    n, hc, hidden = streams.shape
    if not _mix_ok(streams, pre) or hc & (hc - 1) or tuple(pre.shape) != (n, hc):
        return None
    out = torch.empty((n, hidden), dtype=torch.float32, device=streams.device)
    if n and hidden:
        _hc_collapse_kernel[(n, triton.cdiv(hidden, ELEM_BLOCK))](
            streams.contiguous(), pre.contiguous(), out, hidden, HC=hc, BLOCK=ELEM_BLOCK, num_warps=4, **LAUNCH)
    return out


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor | None:
    """mhc.hc_expand in one launch: y [n, H], residual [n, hc, H], post [n, hc], comb [n, hc, hc] -> [n, hc, H];
    None where it does not apply."""
    _check_device(residual, "hc_expand")
    n, hc, hidden = residual.shape
    if (not _mix_ok(y, residual, post, comb) or hc & (hc - 1) or tuple(y.shape) != (n, hidden)
            or tuple(post.shape) != (n, hc) or tuple(comb.shape) != (n, hc, hc)):
        return None
    out = torch.empty((n, hc, hidden), dtype=torch.float32, device=residual.device)
    if n and hidden:
        _hc_expand_kernel[(n, triton.cdiv(hidden, ELEM_BLOCK))](
            y.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous(), out, hidden, HC=hc,
            BLOCK=ELEM_BLOCK, num_warps=4, **LAUNCH, **pdl.options(out))
    return out


def hc_site_in(y: torch.Tensor | None, streams: torch.Tensor, post: torch.Tensor | None, comb: torch.Tensor | None,
               pre: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple | None:
    """An mHC site's input in one launch: y None: (streams, rms_norm(hc_collapse(streams, pre), weight, eps)); else
    the streams are first hc_expand(y, streams, post, comb) (the previous site's output added): the bits of the
    three kernels (or of the CUDA op set's torch forms). y may be a pair of partials (y0, y1): y = y0 + y1 first.
    None where it does not apply (dtypes, hc, a weight not float32 [H], more than two partials): the caller
    composes the ops."""
    _check_device(streams, "hc_site_in")
    n, hc, hidden = streams.shape
    y2 = None
    if isinstance(y, tuple):
        if len(y) != 2 or any(t.shape != y[0].shape or t.dtype != torch.float32 for t in y):
            return None
        y, y2 = y[0], y[1].contiguous()
    ts = (streams, pre) if y is None else (streams, pre, y, post, comb)
    if (not _mix_ok(*ts) or hc & (hc - 1) or tuple(pre.shape) != (n, hc)
            or (weight is not None and (weight.dtype != torch.float32 or tuple(weight.shape) != (hidden,)))
            or (y is not None and (tuple(y.shape) != (n, hidden) or tuple(post.shape) != (n, hc)
                                   or tuple(comb.shape) != (n, hc, hc)))):
        return None
    x = torch.empty((n, hidden), dtype=torch.float32, device=streams.device)
    res = streams.contiguous()
    out = res if y is None else torch.empty((n, hc, hidden), dtype=torch.float32, device=streams.device)
    if n and hidden:
        w = weight.contiguous() if weight is not None else x
        yy, pp, cc = (x, pre, pre) if y is None else (y.contiguous(), post.contiguous(), comb.contiguous())
        tile = tree_shape(hidden)
        if tile is not None:
            _hc_site_in_reg_kernel[(n,)](yy, y2 if y2 is not None else yy, res, pp, cc, out, pre.contiguous(), w, x,
                                         hidden, inv_count(hidden), _f32(eps), HC=hc, EXPAND=y is not None,
                                         HAS_W=weight is not None, Y2=y2 is not None, **tile, num_warps=REG_WARPS,
                                         **LAUNCH, **pdl.options(x))
            return out, x
        buf = torch.empty((n, 2 * ((hidden + 1) // 2)), dtype=torch.float32, device=streams.device)
        _hc_site_in_kernel[(n,)](yy, y2 if y2 is not None else yy, res, pp, cc, out, pre.contiguous(), w, x, buf,
                                 hidden, inv_count(hidden), _f32(eps), HC=hc, BLOCK=NORM_BLOCK, EXPAND=y is not None,
                                 HAS_W=weight is not None, Y2=y2 is not None, num_warps=NORM_WARPS, **LAUNCH)
    return out, x


ROUTE_ROWS = 32


def route_weights(s: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """The routing weights of moe.MoE.route from the scores s [n, E] and the picked ids [n, k] (k > 1): the scores
    at the picks divided by their sum (slot order) + 1e-20, times scaling; one launch. None where it does not
    apply."""
    _check_device(s, "route_weights")
    n, n_exp = s.shape
    k = ids.shape[1]
    if s.dtype != torch.float32 or k < 2 or tuple(ids.shape) != (n, k):
        return None
    out = torch.empty((n, k), dtype=torch.float32, device=s.device)
    if n:
        _route_weights_kernel[(triton.cdiv(n, ROUTE_ROWS),)](
            s.contiguous(), ids.contiguous(), out, n, n_exp, _f32(1e-20), _f32(scaling), K=k,
            KP=triton.next_power_of_2(k), BR=ROUTE_ROWS, num_warps=1, **LAUNCH)
    return out
