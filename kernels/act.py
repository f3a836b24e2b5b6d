"""SwiGLU's elementwise part in one launch: h = silu(min(gate, limit)) · clamp(up, ±limit), = `dsv41.model.moe.
swiglu_h` run by torch on the GPU, bitwise: the same operations in the same order as torch's CUDA kernels run them,
one per element -- the clamps as compares (a NaN passes through, as torch's clamp lets it), silu as dsv41.model.
linear.silu, x / (1 + exp(-x)) with libdevice's expf (the function torch's `std::exp` compiles to), an IEEE add and
a correctly rounded division, then one IEEE multiply; FMA contraction and FTZ off. Run by torch that is seven
launches (the shared expert's, once a layer), each a few microseconds of a decode round's GPU time at one row.
The interpreter has no libdevice: numpy's exp stands in, so `swiglu_h` runs on CUDA tensors only (the op set's
torch function runs on CPU ones); the CPU tests launch the kernel itself (`launch`) and check it to float32
rounding, the GPU test checks `swiglu_h` against torch bitwise.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.mhc import _exp
from kernels.pdl import wait_inputs
from kernels.rowops import _f32

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024
LAUNCH = {} if INTERPRET else {"enable_fp_fusion": False, "enable_reflect_ftz": False}   # torch: no FTZ


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, h_ptr, n, limit, INTERP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0)
    u = tl.load(u_ptr + i, mask=ok, other=0.0)
    g = tl.where(g > limit, limit, g)
    u = tl.where(u < -limit, -limit, tl.where(u > limit, limit, u))
    e = _exp(-g, INTERP)                           # libdevice's expf (numpy's under the interpreter)
    tl.store(h_ptr + i, tl.div_rn(g, 1.0 + e) * u, mask=ok)


def swiglu_h(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor | None:
    """h for float32 gate, up of one shape on CUDA; None where it does not apply (the caller's torch function)."""
    if gate.device.type != "cuda" or gate.dtype != torch.float32 or up.dtype != torch.float32 or \
            gate.shape != up.shape:
        return None
    return launch(gate, up, limit)


def launch(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    g, u = gate.contiguous(), up.contiguous()
    h = torch.empty_like(g)
    n = g.numel()
    if n:
        # the limit as float32: torch's clamp compares in float32
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](g, u, h, n, _f32(limit), INTERP=INTERPRET, BLOCK=BLOCK,
                                                num_warps=4, **LAUNCH, **pdl.options(h))
    return h
