"""The window KV's, the indexer's q and keys', the compressed entries' and the DSpark stages' KV's last steps in one
launch: (RMSNorm), RoPE on the last 2·d dims, (QAT's fake-quant) -- the CUDA path's three kernels (rowops'
rms_norm, rope's rope_, fake_quant's round trips), one to three launches a site, twelve a compressed layer at one
row where launches, not bytes, bound a decode layer.

Each element by the same operations in the same order as those kernels, so the same bits:
- the norm's Σ x² as rowops' fixed tree (for a power-of-two row: level by level, element i plus element i + half),
  here in registers: the row's halves folded by a sum over an axis of two (one add), x · rsqrt(mean + eps) · w
  with the correctly rounded square root and division;
- RoPE as rope_: even·cos - odd·sin, even·sin + odd·cos, each rounded apart (FMA contraction off), `inverse` negates
  sin; the pairs picked by splitting the row's (D/2, 2) view;
- the fake-quant as fake_quant.round_trip over the row's blocks.
One program per row (and head); the row stays in registers (D a power of two, <= 1024). The fake-quant's torch
forms on CPU tensors divide as the CPU does (fake_quant.py), so the op runs on CUDA tensors only; the CPU tests
launch it (`launch`) against the three kernels launched one after another, bitwise.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import fake_quant
from kernels import pdl
from kernels.numerics import inv_count
from kernels.pdl import wait_inputs
from kernels.rowops import _f32

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LAUNCH = {} if INTERPRET else {"enable_fp_fusion": False}
KINDS = {"fp8": (fake_quant.FP8, 32), "fp4_ue8m0": (fake_quant.FP4_UE8M0, 32), "fp4_e4m3": (fake_quant.FP4_E4M3, 16)}


@triton.jit
def row_norm(x, w_ptr, inv_n, eps, D: tl.constexpr, LOG2D: tl.constexpr):
    """rowops' norm of a row x [D] (D a power of two) held in registers: its tree (x_i·x_i + x_{i+D/2}·x_{i+D/2}),
    then halves added level by level, each level's pair one add), x · rsqrt(mean + eps) · w."""
    s = x * x
    for lvl in tl.static_range(LOG2D):
        s = tl.sum(tl.reshape(s, [2, D >> (lvl + 1)]), axis=0)
    total = tl.sum(s, axis=0)                           # the last level's one element
    rstd = tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(total * inv_n + eps))
    return (x * rstd) * tl.load(w_ptr + tl.arange(0, D))


@triton.jit
def _norm_rope_quant_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_row, stride_head, inv_n, eps,
                            floor, inv_max, D: tl.constexpr, LOG2D: tl.constexpr, HALF: tl.constexpr,
                            NORM: tl.constexpr, INVERSE: tl.constexpr, QUANT: tl.constexpr, QB: tl.constexpr,
                            VMAX: tl.constexpr, VALUES: tl.constexpr, SCALE: tl.constexpr, INTERP: tl.constexpr,
                            PDL: tl.constexpr):
    wait_inputs(PDL)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // heads
    h = pid % heads
    d = tl.arange(0, D)
    x = tl.load(x_ptr + row * stride_row + h * stride_head + d)
    if NORM:
        x = row_norm(x, w_ptr, inv_n, eps, D, LOG2D)
    even, odd = tl.split(tl.reshape(x, [D // 2, 2]))   # pair p: (x_2p, x_2p+1)
    p = tl.arange(0, D // 2)
    first = D // 2 - HALF                               # the pairs before it pass through
    on = p >= first
    c = tl.load(cos_ptr + row * HALF + (p - first), mask=on, other=1.0)
    sn = tl.load(sin_ptr + row * HALF + (p - first), mask=on, other=0.0)
    if INVERSE:
        sn = -sn
    new_even = tl.where(on, even * c - odd * sn, even)
    new_odd = tl.where(on, even * sn + odd * c, odd)
    x = tl.reshape(tl.join(new_even, new_odd), [D])
    if QUANT:
        x = tl.reshape(fake_quant.round_trip(tl.reshape(x, [D // QB, QB]), floor, inv_max, VMAX, VALUES, SCALE,
                                             INTERP), [D])
    tl.store(out_ptr + (row * heads + h) * D + d, x)


def applies(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, quant: str | None) -> bool:
    """Whether the kernel takes this call: float32 x [n, D] or [n, heads, D] (last dim contiguous, D a power of two
    <= 1024), a float32 [D] weight or none, float32 cos / sin [n, d] (d a power of two, 2·d <= D)."""
    D = x.shape[-1]
    half = cos.shape[-1]
    return (x.dtype == torch.float32 and x.dim() in (2, 3) and x.stride(-1) == 1 and 16 <= D <= 1024
            and not D & (D - 1) and cos.dtype == torch.float32 and cos.dim() == 2 and cos.shape[0] == x.shape[0]
            and not half & (half - 1) and 2 * half <= D
            and (weight is None or (weight.dtype == torch.float32 and tuple(weight.shape) == (D,)))
            and (quant is None or quant in KINDS))


def norm_rope_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    inverse: bool, quant: str | None) -> torch.Tensor | None:
    """rms_norm (weight given) -> rope -> fake-quant (`quant`: "fp8", "fp4_ue8m0", "fp4_e4m3" or None) of x, a new
    tensor; on CUDA tensors, None where the kernel does not take the call (the caller composes the ops)."""
    if x.device.type != "cuda" or not applies(x, weight, cos, quant):
        return None
    return launch(x, weight, eps, cos, sin, inverse, quant)


def launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
           inverse: bool, quant: str | None) -> torch.Tensor:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    n, D = x.shape[0], x.shape[-1]
    heads, stride_head = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    (floor, vmax, values, scale), qb = KINDS[quant] if quant else (fake_quant.FP8, 32)
    if n and heads:
        _norm_rope_quant_kernel[(n * heads,)](
            x, weight if weight is not None else x, cos.contiguous(), sin.contiguous(), out, heads, x.stride(0),
            stride_head, inv_count(D), _f32(eps), _f32(floor), inv_count(vmax), D=D, LOG2D=D.bit_length() - 1,
            HALF=cos.shape[-1], NORM=weight is not None, INVERSE=inverse, QUANT=quant is not None, QB=qb, VMAX=vmax,
            VALUES=values, SCALE=scale, INTERP=INTERPRET, num_warps=4, **LAUNCH, **pdl.options(x))
    return out
