"""RoPE in place in one launch: the last 2·d dims of each row (and head) of a float32 x rotated pair by pair by
the row's angles, = `dsv41.model.rope.apply_rope_` (its products and sums: even·cos - odd·sin, even·sin +
odd·cos, each rounded apart; `inverse` negates sin first), bitwise on any device: only IEEE multiplies and adds,
FMA contraction off, so the interpreter on CPU gives torch's CPU bits and the GPU gives torch's CUDA bits. Run by
torch that is eight launches a call (a layer rotates q, kv and the output, the indexer q and keys, the compressed
entries: ~45 launches a layer at one row, each a few microseconds of a decode round's GPU time). A program per
(row, block of heads); a row's result depends on its row only.

`cos_sin`: the rows' angles, cos and sin of positions · inv_freq (`dsv41.model.rope.cos_sin`: the position as
float32, one product, cos and sin) in one launch where torch took four (a round's two tables; each compressed
layer's closing groups): libdevice's cosf / sinf, the CUDA math library's functions torch's CUDA cos / sin compile to
(no FTZ, as torch), so the GPU test checks torch's bits; the interpreter has numpy's instead, so it runs on CUDA
tensors only (the op set keeps torch's on CPU ones) and the CPU test launches the kernel itself against torch to
float32 rounding.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import pdl
from kernels.pdl import wait_inputs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HEADS = 16
LAUNCH = {} if INTERPRET else {"enable_fp_fusion": False}
TRIG_LAUNCH = {} if INTERPRET else {"enable_fp_fusion": False, "enable_reflect_ftz": False}   # torch: no FTZ
COS_SIN_ROWS = 16


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, heads, stride_row, stride_head, stride_cs, first,
                 HALF: tl.constexpr, HB: tl.constexpr, INVERSE: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    ok = (h < heads)[:, None]
    p = tl.arange(0, HALF)
    c = tl.load(cos_ptr + row * stride_cs + p)[None, :]
    s = tl.load(sin_ptr + row * stride_cs + p)[None, :]
    if INVERSE:
        s = -s
    at = x_ptr + row * stride_row + h.to(tl.int64)[:, None] * stride_head + first + 2 * p[None, :]
    even = tl.load(at, mask=ok, other=0.0)
    odd = tl.load(at + 1, mask=ok, other=0.0)
    tl.store(at, even * c - odd * s, mask=ok)
    tl.store(at + 1, even * s + odd * c, mask=ok)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor | None:
    """x [n, D] or [n, heads, D] float32 (its last dim contiguous) rotated in place by cos / sin [n, d] float32
    (d a power of two, 2·d <= D), returned; None where it does not apply (the caller's torch function runs)."""
    if x.device.type != "cuda" and not INTERPRET:
        return None
    n = x.shape[0]
    half = cos.shape[-1]
    if (x.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or x.dim() not in (2, 3) or x.stride(-1) != 1 or cos.shape != (n, half) or sin.shape != cos.shape
            or half & (half - 1) or 2 * half > x.shape[-1] or cos.stride(1) != 1 or sin.stride() != cos.stride()):
        return None
    heads, stride_head = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    if n and heads:
        _rope_kernel[(n, triton.cdiv(heads, HEADS))](x, cos, sin, heads, x.stride(0), stride_head, cos.stride(0),
                                                     x.shape[-1] - 2 * half, HALF=half, HB=HEADS, INVERSE=inverse,
                                                     num_warps=4 if heads > 1 else 1, **LAUNCH, **pdl.options(x))
    return x


@triton.jit
def _cos_sin_kernel(pos_ptr, f_ptr, cos_ptr, sin_ptr, n, HALF: tl.constexpr, BR: tl.constexpr, INTERP: tl.constexpr,
                    PDL: tl.constexpr):
    wait_inputs(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = (rows < n)[:, None]
    j = tl.arange(0, HALF)
    p = tl.load(pos_ptr + rows, mask=rows < n, other=0).to(tl.float32)
    a = p[:, None] * tl.load(f_ptr + j)[None, :]
    at = rows.to(tl.int64)[:, None] * HALF + j[None, :]
    if INTERP:
        c = tl.cos(a)
        s = tl.sin(a)
    else:
        c = libdevice.cos(a)
        s = libdevice.sin(a)
    tl.store(cos_ptr + at, c, mask=ok)
    tl.store(sin_ptr + at, s, mask=ok)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin) [n, d] float32 of integer positions [n] times float32 inv_freq [d] (d a power of two) on CUDA;
    None where it does not apply (the caller's torch function)."""
    if (positions.device.type != "cuda" or positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32)
            or inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or inv_freq.shape[0] & (inv_freq.shape[0] - 1)):
        return None
    return launch_cos_sin(positions, inv_freq)


def launch_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    n, half = positions.shape[0], inv_freq.shape[0]
    c = torch.empty((n, half), dtype=torch.float32, device=positions.device)
    s = torch.empty_like(c)
    if n:
        _cos_sin_kernel[(triton.cdiv(n, COS_SIN_ROWS),)](positions.contiguous(), inv_freq.contiguous(), c, s, n,
                                                         HALF=half, BR=COS_SIN_ROWS, INTERP=INTERPRET, num_warps=4,
                                                         **TRIG_LAUNCH, **pdl.options(c))
    return c, s
