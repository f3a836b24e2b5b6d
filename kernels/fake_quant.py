"""QAT's fake-quant round trips (arch.md 2.1) in one launch each, = `dsv41.model.quant`'s functions run by torch on
the GPU, bitwise. Per block of `block` values along the last dim: amax = max |v| floored, a scale from amax / max,
the values divided by the scale, clamped to ±max, rounded to the format and multiplied back.

- `fp8_fake_quant` (the window KV): amax floored at 1e-4, scale 2^ceil(log2(amax / 448)) from the exponent bits,
  values to E4M3.
- `fp4_fake_quant_ue8m0` (the indexer's q and keys, blocks of 32): amax floored at 6·2^-126, scale
  2^ceil(log2(amax / 6)), values to E2M1.
- `fp4_fake_quant_e4m3` (the compressed KV entries, blocks of 16): amax floored at 6·2^-9, scale amax / 6 rounded to
  E4M3, values to E2M1.

torch's CUDA `amax / 448.0` (a CPU scalar divisor) multiplies by float32(1 / 448), which these do too; v / scale is a
correctly rounded division (div_rn; exact for a power-of-two scale); the rest is exact or a rounding to a format:
E4M3 by the hardware's cvt.rn.satfinite as torch's software RNE (which saturates at 448 too), E2M1 by comparisons
with the midpoints between its values (ties to the even code: 0.25, 1.25, 2.5 and 5 go down, 0.75, 1.75 and 3.5
up, as quant.e2m1_codes), the sign copied from the bits (torch.copysign). Run by torch these are 13-20 launches a
call: the window KV once a layer, the indexer's q and keys and the compressed entries on the layers that have them.
On CPU tensors the op set keeps the torch functions (whose CPU division by a scalar is a true division); the CPU
tests launch the kernel itself (`launch`) against that reciprocal form, the GPU tests against torch bitwise. A
block's result depends on its own values only.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.numerics import inv_count
from kernels.rowops import _f32

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCKS = 32                     # quant blocks a program
LAUNCH = {} if INTERPRET else {"enable_fp_fusion": False}
E4M3, E2M1 = 0, 1               # the values' format
POW2, E4M3_SCALE = 0, 1         # the scale's
# (floor of amax, the format's max, the values' format, the scale's) of each round trip: quant's constants
FP8 = (1e-4, 448.0, E4M3, POW2)
FP4_UE8M0 = (6 * 2.0 ** -126, 6.0, E2M1, POW2)
FP4_E4M3 = (6 * 2.0 ** -9, 6.0, E2M1, E4M3_SCALE)


@triton.jit
def _e4m3(q, INTERP: tl.constexpr):
    """q (within ±448) rounded to E4M3, nearest, ties to even, as float32. The interpreter's float8 cast does not
    round so; there the rounding is written out: normal values keep 3 mantissa bits (round the 20 dropped bits to
    nearest even), values below 2^-6 are multiples of 2^-9 (rounded to nearest even by the 1.5·2^23 add)."""
    if INTERP:
        bits = q.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        up = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576                     # & ~0xFFFFF
        normal = (up | (bits & -2147483648)).to(tl.float32, bitcast=True)      # the sign bit back
        t = q * 512.0
        sub = ((t + 12582912.0) - 12582912.0) / 512.0
        return tl.where(mag >= 0x3C800000, normal, sub)                        # 2^-6: E4M3's least normal
    else:
        return q.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _e2m1(q):
    """q (within ±6, or NaN) rounded to the nearest E2M1 value, ties to the even code, the sign kept (a NaN gives
    a signed zero, as quant.round_e2m1's NaN -> code 0 and copysign)."""
    a = tl.abs(q)
    m = tl.where(a > 0.25, 0.5, 0.0)
    m = tl.where(a >= 0.75, 1.0, m)
    m = tl.where(a > 1.25, 1.5, m)
    m = tl.where(a >= 1.75, 2.0, m)
    m = tl.where(a > 2.5, 3.0, m)
    m = tl.where(a >= 3.5, 4.0, m)
    m = tl.where(a > 5.0, 6.0, m)
    sign = q.to(tl.int32, bitcast=True) & -2147483648
    return (m.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fake_quant_kernel(x_ptr, out_ptr, n_blocks, floor, inv_max, VMAX: tl.constexpr, BLOCK: tl.constexpr,
                       BB: tl.constexpr, VALUES: tl.constexpr, SCALE: tl.constexpr, INTERP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    ok = (b < n_blocks)[:, None]
    at = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    v = tl.load(x_ptr + at, mask=ok, other=0.0)
    tl.store(out_ptr + at, round_trip(v, floor, inv_max, VMAX, VALUES, SCALE, INTERP), mask=ok)


@triton.jit
def round_trip(v, floor, inv_max, VMAX: tl.constexpr, VALUES: tl.constexpr, SCALE: tl.constexpr,
               INTERP: tl.constexpr):
    """The fake-quant of blocks v [blocks, block] (one per row): the kernels' shared body."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), floor)
    r = amax * inv_max
    if SCALE == 0:      # 2^ceil(log2 r) from the exponent bits (quant.pow2_ceil)
        bits = r.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (e << 23).to(tl.float32, bitcast=True)
    else:               # r rounded to E4M3 (torch saturates at 448, as the hardware's satfinite)
        s = _e4m3(tl.minimum(r, 448.0), INTERP)
    q = tl.div_rn(v, s[:, None])
    q = tl.where(q < -VMAX, -VMAX, tl.where(q > VMAX, VMAX, q))               # a NaN stays (torch.clamp)
    if VALUES == 0:
        q = _e4m3(q, INTERP)
    else:
        q = _e2m1(q)
    return q * s[:, None]


def _applies(x: torch.Tensor, block: int) -> bool:
    return x.device.type == "cuda" and x.dtype == torch.float32 and not block & (block - 1) and not x.shape[-1] % block


def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor | None:
    """quant.fp8_fake_quant for a float32 x on CUDA; None where it does not apply (the caller's torch function)."""
    return launch(x, block, FP8) if _applies(x, block) else None


def fp4_fake_quant_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor | None:
    """quant.fp4_fake_quant_ue8m0 for a float32 x on CUDA; None where it does not apply."""
    return launch(x, block, FP4_UE8M0) if _applies(x, block) else None


def fp4_fake_quant_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor | None:
    """quant.fp4_fake_quant_e4m3 for a float32 x on CUDA; None where it does not apply."""
    return launch(x, block, FP4_E4M3) if _applies(x, block) else None


def launch(x: torch.Tensor, block: int = 32, kind: tuple = FP8) -> torch.Tensor:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones; kind: FP8, FP4_UE8M0 or FP4_E4M3."""
    floor, vmax, values, scale = kind
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n_blocks = xc.numel() // block
    if n_blocks:
        _fake_quant_kernel[(triton.cdiv(n_blocks, BLOCKS),)](xc, out, n_blocks, _f32(floor), inv_count(vmax),
                                                            VMAX=vmax, BLOCK=block, BB=BLOCKS, VALUES=values,
                                                            SCALE=scale, INTERP=INTERPRET, num_warps=4, **LAUNCH)
    return out
