"""The MoE router's elementwise part in one launch: s = sqrt(softplus(z / gate_temp)) and the selection's input
s + bias (bias_vl on image rows), = `dsv41.model.moe.router_scores` run by torch on the GPU, bitwise: the same
operations in the same order as torch's CUDA kernels run them, one per element --
- `z / t` with t a Python float: torch's CUDA division by a CPU scalar multiplies by float32(1 / t) (computed on
  the host in float32; exact for V4.1's t = 1.0, and on the CPU too for a power of two);
- softplus: `where(y > 20, y, log1p(exp(min(y, 20))))` with libdevice's expf / log1pf (the CUDA math library's
  functions torch's `std::exp` / `::log1p` compile to);
- sqrt_rn, then one IEEE add of the bias; FMA contraction off.
The interpreter has no libdevice: there numpy's exp and a log1p written with log stand in (close, not bitwise
torch's CPU functions), so `router_scores` runs on CUDA tensors only (the op set's torch function runs on CPU
ones); the CPU tests launch the kernel itself (`launch`) and check the function to float32 rounding, the GPU test
checks `router_scores` against torch bitwise.
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

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROWS = 4
LAUNCH = {} if INTERPRET else {"enable_fp_fusion": False, "enable_reflect_ftz": False}   # torch: no FTZ


@triton.jit
def _softplus(y, INTERP: tl.constexpr):
    """torch's softplus on CUDA (threshold 20): where(y > 20, y, log1p(exp(min(y, 20))))."""
    c = tl.minimum(y, 20.0)
    if INTERP:                                   # numpy's exp; log1p(u) = log(1 + u) · u / ((1 + u) - 1)
        u = tl.exp(c)
        w = 1.0 + u
        lp = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    else:
        lp = libdevice.log1p(libdevice.exp(c))
    return tl.where(y > 20.0, y, lp)


@triton.jit
def _scores(z_ptr, bias_ptr, vl_ptr, img_ptr, n, E, inv, HAS_IMG: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr,
            INTERP: tl.constexpr):
    """A block of rows' scores s and their bias by row b -> (rows, ok, cols, valid, at, s, b)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < n
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BE)
    valid = ok[:, None] & (cols < E)[None, :]
    at = rows[:, None] * E + cols[None, :]
    y = tl.load(z_ptr + at, mask=valid, other=0.0) * inv
    s = tl.sqrt_rn(_softplus(y, INTERP))
    b = tl.load(bias_ptr + cols, mask=cols < E, other=0.0)[None, :]
    if HAS_IMG:
        img = tl.load(img_ptr + rows, mask=ok, other=0) != 0
        vl = tl.load(vl_ptr + cols, mask=cols < E, other=0.0)[None, :]
        b = tl.where(img[:, None], vl, b)
    return rows, ok, cols, valid, at, s, b


@triton.jit
def _router_scores_kernel(z_ptr, bias_ptr, vl_ptr, img_ptr, s_ptr, sb_ptr, n, E, inv, HAS_IMG: tl.constexpr,
                          BE: tl.constexpr, BR: tl.constexpr, INTERP: tl.constexpr):
    rows, ok, cols, m, at, s, b = _scores(z_ptr, bias_ptr, vl_ptr, img_ptr, n, E, inv, HAS_IMG, BE, BR, INTERP)
    tl.store(s_ptr + at, s, mask=m)
    tl.store(sb_ptr + at, s + b, mask=m)


def router_scores(z: torch.Tensor, temp: float, bias: torch.Tensor, bias_vl: torch.Tensor,
                  image: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(s, s + bias by row) for float32 logits z [n, E] (E <= 1024) on CUDA, float32 biases [E], image [n] bool or
    None; None where it does not apply (the caller's torch function runs): CPU tensors included."""
    if z.device.type != "cuda" or z.dim() != 2 or z.dtype != torch.float32 or z.shape[1] > 1024 or \
            bias.dtype != torch.float32 or bias_vl.dtype != torch.float32:
        return None
    return launch(z, temp, bias, bias_vl, image)


def launch(z: torch.Tensor, temp: float, bias: torch.Tensor, bias_vl: torch.Tensor,
           image: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    z = z.contiguous()
    n, E = z.shape
    s, sb = torch.empty_like(z), torch.empty_like(z)
    if n:
        # torch's CUDA `z / t` for a Python float t: z · float32(1 / t), the reciprocal rounded in float32
        inv = inv_count(temp)
        img = z if image is None else image.contiguous().view(torch.uint8)
        _router_scores_kernel[(triton.cdiv(n, ROWS),)](z, bias.contiguous(), bias_vl.contiguous(), img, s, sb, n, E,
                                                      inv, HAS_IMG=image is not None, BE=triton.next_power_of_2(E),
                                                      BR=ROWS, INTERP=INTERPRET, num_warps=4,
                                                      **LAUNCH)
    return s, sb


@triton.jit
def _route_kernel(z_ptr, bias_ptr, vl_ptr, img_ptr, w_ptr, ids_ptr, n, E, inv, eps, scaling, K: tl.constexpr,
                  KP: tl.constexpr, HAS_IMG: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr, INTERP: tl.constexpr,
                  PDL: tl.constexpr):
    """The whole route of a block of rows in one program: the scores as _router_scores_kernel, the pick as
    kernels/topk.py's router kernel (the largest s + bias, ties to the lower id, -0.0 as +0.0), the weights as
    rowops' route_weights (s at the picks over their slot-order sum + eps, × scaling): their bits, in registers."""
    wait_inputs(PDL)
    rows, ok, cols, valid, at, s, b = _scores(z_ptr, bias_ptr, vl_ptr, img_ptr, n, E, inv, HAS_IMG, BE, BR, INTERP)
    v = tl.where(valid, s + b, float("-inf"))
    v = tl.where(v == 0.0, 0.0, v)
    left = valid
    jj = tl.arange(0, KP)[None, :]
    total = tl.zeros((BR,), tl.float32)
    wk = tl.zeros((BR, KP), tl.float32)
    for j in tl.static_range(K):
        m = tl.max(tl.where(left, v, float("-inf")), axis=1)
        i = tl.min(tl.where(left & (v == m[:, None]), cols[None, :], BE), axis=1)
        left = left & (cols[None, :] != i[:, None])
        i = tl.minimum(i, E - 1)
        w = tl.max(tl.where(cols[None, :] == i[:, None], s, -1.0), axis=1)       # s at the pick (s >= 0)
        tl.store(ids_ptr + rows * K + j, i.to(tl.int64), mask=ok)
        wk = tl.where(jj == j, w[:, None], wk)
        if j == 0:
            total = w
        else:
            total = total + w
    tl.store(w_ptr + rows[:, None] * K + jj, tl.div_rn(wk, total[:, None] + eps) * scaling, mask=ok[:, None] & (jj < K))


def route(z: torch.Tensor, temp: float, bias: torch.Tensor, bias_vl: torch.Tensor, image: torch.Tensor | None, k: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """MoE.route after the gate's product, in one launch: (weights [n, k] float32, ids [n, k] int64) from the logits
    z [n, E] (E <= 1024, 1 < k <= E, k a power of two or not) on CUDA; None where it does not apply (the op set
    composes router_scores, router_topk and route_weights)."""
    if (z.device.type != "cuda" or z.dim() != 2 or z.dtype != torch.float32 or not 1 < k <= z.shape[1] <= 1024
            or bias.dtype != torch.float32 or bias_vl.dtype != torch.float32):
        return None
    return launch_route(z, temp, bias, bias_vl, image, k, scaling)


def launch_route(z: torch.Tensor, temp: float, bias: torch.Tensor, bias_vl: torch.Tensor, image: torch.Tensor | None,
                 k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    from kernels.rowops import _f32
    z = z.contiguous()
    n, E = z.shape
    w = torch.empty((n, k), dtype=torch.float32, device=z.device)
    ids = torch.empty((n, k), dtype=torch.int64, device=z.device)
    if n:
        img = z if image is None else image.contiguous().view(torch.uint8)
        be = triton.next_power_of_2(E)
        _route_kernel[(triton.cdiv(n, ROWS),)](z, bias.contiguous(), bias_vl.contiguous(), img, w, ids, n, E,
                                               inv_count(temp), _f32(1e-20), _f32(scaling), K=k,
                                               KP=triton.next_power_of_2(k),
                                               HAS_IMG=image is not None, BE=be, BR=ROWS, INTERP=INTERPRET,
                                               num_warps=4, **LAUNCH, **pdl.options(w))
    return w, ids
