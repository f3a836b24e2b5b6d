"""The FP8 fake-quant of QAT (the window KV's, arch.md 2.1) in one launch: per block of `block` values along the
last dim, amax floored at 1e-4, the scale 2^ceil(log2(amax / 448)) from the exponent bits, the values divided by it,
clamped to ±448, rounded to E4M3 (nearest, ties to even) and multiplied back, = `dsv41.model.quant.fp8_fake_quant`
run by torch on the GPU, bitwise: torch's CUDA `amax / 448.0` multiplies by float32(1 / 448) (a CPU scalar
divisor), which this does too; the rest is exact (a power-of-two scale) but the E4M3 rounding, the hardware's
cvt.rn.satfinite as torch's software RNE for values within ±448. Run by torch that is ~13 launches a call (the
window KV once a layer). On CPU tensors the op set keeps the torch function (whose CPU division is a true
division); the CPU tests launch the kernel itself (`launch`) against that reciprocal form, the GPU test against
torch bitwise.
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
AMAX_FLOOR, E4M3_MAX = 1e-4, 448


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
def _fp8_fake_quant_kernel(x_ptr, out_ptr, n_blocks, floor, inv_max, BLOCK: tl.constexpr, BB: tl.constexpr,
                           INTERP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    ok = (b < n_blocks)[:, None]
    at = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    v = tl.load(x_ptr + at, mask=ok, other=0.0)
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), floor)
    r = amax * inv_max
    bits = r.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)        # biased exponent of 2^ceil(log2 r)
    s = (e << 23).to(tl.float32, bitcast=True)[:, None]
    q = tl.div_rn(v, s)
    q = tl.where(q < -448.0, -448.0, tl.where(q > 448.0, 448.0, q))
    tl.store(out_ptr + at, _e4m3(q, INTERP) * s, mask=ok)


def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor | None:
    """quant.fp8_fake_quant for a float32 x on CUDA; None where it does not apply (the caller's torch function)."""
    if x.device.type != "cuda" or x.dtype != torch.float32 or block & (block - 1) or x.shape[-1] % block:
        return None
    return launch(x, block)


def launch(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n_blocks = xc.numel() // block
    if n_blocks:
        _fp8_fake_quant_kernel[(triton.cdiv(n_blocks, BLOCKS),)](xc, out, n_blocks, _f32(AMAX_FLOOR),
                                                                inv_count(E4M3_MAX), BLOCK=block,
                                                                BB=BLOCKS, INTERP=INTERPRET, num_warps=4,
                                                                **LAUNCH)
    return out
