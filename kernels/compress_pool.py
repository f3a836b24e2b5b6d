"""The compressor's pooling of its closed groups and the latent's norm in one launch: `Compressor.pool` run by torch
on the GPU (a softmax over a group's r tokens channel by channel, written out -- the running max, exp(gate - max),
the sum in token order, kv · (e / sum) summed in token order -- then rms_norm), ~5·r launches a call there (a
ratio-4 layer's closing groups: 22). Bitwise: the same operations in the same order, one per element, with
libdevice's expf (the CUDA math library's function torch's `std::exp` compiles to; no FTZ, FMA contraction off)
and the norm of rowops (norm_rope_quant.row_norm: its tree). The interpreter has numpy's exp instead, so `pool_norm`
runs on CUDA tensors only (the op set's torch function runs on CPU ones); the CPU test launches the kernel itself
against the torch form with numpy's exp. One program per group: a group's result depends on its own rows only.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.mhc import LAUNCH, _exp   # libdevice's expf (numpy's under the interpreter), no FTZ
from kernels.norm_rope_quant import row_norm
from kernels.numerics import inv_count
from kernels.rowops import _f32

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _pool_norm_kernel(kv_ptr, gate_ptr, w_ptr, out_ptr, inv_n, eps, R: tl.constexpr, D: tl.constexpr,
                      LOG2D: tl.constexpr, INTERP: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    base = g * R * D + d
    top = tl.load(gate_ptr + base)
    for t in range(1, R):
        top = tl.maximum(top, tl.load(gate_ptr + base + t * D))
    total = _exp(tl.load(gate_ptr + base) - top, INTERP)
    for t in range(1, R):
        total = total + _exp(tl.load(gate_ptr + base + t * D) - top, INTERP)
    latent = tl.load(kv_ptr + base) * tl.div_rn(_exp(tl.load(gate_ptr + base) - top, INTERP), total)
    for t in range(1, R):
        latent = latent + tl.load(kv_ptr + base + t * D) * tl.div_rn(
            _exp(tl.load(gate_ptr + base + t * D) - top, INTERP), total)
    tl.store(out_ptr + g * D + d, row_norm(latent, w_ptr, inv_n, eps, D, LOG2D))


def pool_norm(kv: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Compressor.pool of closed groups kv, gate [g, r, D] (float32) with its norm's float32 weight [D] (D a power of
    two <= 1024) on CUDA -> latents [g, D]; None where it does not apply (the caller's torch function)."""
    if (kv.device.type != "cuda" or kv.dim() != 3 or gate.shape != kv.shape or kv.dtype != torch.float32
            or gate.dtype != torch.float32 or weight is None or weight.dtype != torch.float32
            or tuple(weight.shape) != (kv.shape[2],) or kv.shape[2] & (kv.shape[2] - 1) or kv.shape[2] > 1024):
        return None
    return launch(kv, gate, weight, eps)


def launch(kv: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel itself, on CUDA tensors or (TRITON_INTERPRET=1) CPU ones."""
    g, r, D = kv.shape
    out = torch.empty((g, D), dtype=torch.float32, device=kv.device)
    if g:
        _pool_norm_kernel[(g,)](kv.contiguous(), gate.contiguous(), weight.contiguous(), out, inv_count(D), _f32(eps),
                                R=r, D=D, LOG2D=D.bit_length() - 1, INTERP=INTERPRET, num_warps=4, **LAUNCH)
    return out
