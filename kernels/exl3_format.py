"""The EXL3 format's parsing and constants, shared by the torch reference (dsv41/model/exl3.py) and the Triton
kernels (kernels/exl3.py): the codebook markers, the rate K from a trellis, the sign-scales (fp16 or legacy packed
bits), one linear's parts checked (`parse_exl3`) and the unscaled Sylvester Hadamard. Torch only (no Triton, nothing
from dsv41), so the reference imports it on any machine. See dsv41/model/exl3.py for the format.
"""
from __future__ import annotations

import math
from functools import cache

import torch


class Exl3FormatError(ValueError):
    """An EXL3 tensor set that is malformed (missing part, wrong dtype/shape, unknown rate or marker)."""


# Codebooks (exllamav3_ext/quant/codebook.cuh): index 0 = 3INST, 1 = MCG, 2 = MUL1.
CB_3INST, CB_MCG, CB_MUL1 = 0, 1, 2
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
# The markers are the multipliers stored as int32 (safetensors has no uint32).
MCG_MARKER = MCG_MULT - (1 << 32)     # -877912083
MUL1_MARKER = MUL1_MULT - (1 << 32)   # -2082680531
# 3INST: x = w * A + B (mod 2^32), then the two fp16 halves of (x & MASK) ^ XOR are summed.
INST3_MULT, INST3_ADD = 89226354, 64248484
LOP3_MASK, LOP3_XOR = 0x8FFF8FFF, 0x3B603B60
# MUL1: 1024 + byte sum of w * MUL1_MULT, read as fp16, times fp16(0x1eee) plus fp16(0xc931) (one fused rounding).
MUL1_ACC = 0x6400
MUL1_INV_BITS, MUL1_BIAS_BITS = 0x1EEE, 0xC931

# The 128-point Hadamard's scale: exllamav3 builds H as +-1 in fp32 and multiplies by the Python float 1/sqrt(128),
# so every entry is fp32(1/sqrt(128)).
HAD_DIM = 128
HAD_SCALE_F32 = float(torch.tensor(1.0 / math.sqrt(HAD_DIM), dtype=torch.float32))


def codebook_of(t: dict) -> int:
    """The codebook selected by the marker tensors; a marker with a wrong value is an error (as in the loader)."""
    has_mcg, has_mul1 = t.get("mcg") is not None, t.get("mul1") is not None
    if has_mcg and has_mul1:
        raise Exl3FormatError("both mcg and mul1 markers present")
    for name, want, cb in (("mcg", MCG_MARKER, CB_MCG), ("mul1", MUL1_MARKER, CB_MUL1)):
        m = t.get(name)
        if m is None:
            continue
        if m.numel() != 1 or m.dtype not in (torch.int32, torch.uint32):
            raise Exl3FormatError(f"{name} marker must be one int32, got {m.dtype} {tuple(m.shape)}")
        v = int(m.reshape(()).view(torch.int32).item()) if m.dtype == torch.uint32 else int(m.item())
        if v != want:
            raise Exl3FormatError(f"{name} marker is {v}, expected {want}")
        return cb
    return CB_3INST


def bits_of(trellis: torch.Tensor, cb: int) -> float:
    """K (bits per weight) from the tile width 16*K: an integer 1..8, or 1.5/2.5/3.5 with the mul1 codebook."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise Exl3FormatError(f"trellis must be int16 [in/16, out/16, 16K], got {trellis.dtype} {tuple(trellis.shape)}")
    w = trellis.shape[-1]
    if w % 8 or not 16 <= w <= 128:
        raise Exl3FormatError(f"trellis tile width {w} is not 16*K for K in 1..8 or a half-integer rate")
    K = w / 16
    if not K.is_integer():
        if K not in (1.5, 2.5, 3.5):
            raise Exl3FormatError(f"unsupported half-integer rate K={K} (only 1.5, 2.5, 3.5)")
        if cb != CB_MUL1:
            raise Exl3FormatError(f"half-integer rate K={K} requires the mul1 codebook")
        return K
    return int(K)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Legacy su/sv: bit i (lowest first) of int16 word j is element 16j+i; a set bit is -1. fp16 +-1."""
    if packed.dtype != torch.int16 or packed.dim() != 1:
        raise Exl3FormatError(f"packed signs must be int16 [n/16], got {packed.dtype} {tuple(packed.shape)}")
    bits = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).flatten().to(torch.float16)


def sign_scales(t: dict, side: str, n: int) -> torch.Tensor:
    """suh (side 'u', length in) or svh (side 'v', length out) as fp16, unpacking the legacy form if needed."""
    h, p = t.get(f"s{side}h"), t.get(f"s{side}")
    if h is not None:
        if h.dtype != torch.float16 or h.shape != (n,):
            raise Exl3FormatError(f"s{side}h must be fp16 [{n}], got {h.dtype} {tuple(h.shape)}")
        return h
    if p is None:
        raise Exl3FormatError(f"neither s{side}h nor s{side} present")
    if p.shape != (n // 16,):
        raise Exl3FormatError(f"s{side} must be int16 [{n // 16}], got {tuple(p.shape)}")
    return unpack_signs(p)


def parse_exl3(t: dict) -> tuple[torch.Tensor, float, int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(trellis on the host, K, codebook, suh, svh, bias) of one EXL3 linear's parts, checked."""
    if "trellis" not in t:
        raise Exl3FormatError("no trellis")
    trellis = t["trellis"]
    cb = codebook_of(t)
    K = bits_of(trellis, cb)
    n_in, n_out = trellis.shape[0] * 16, trellis.shape[1] * 16
    if n_in % HAD_DIM or n_out % HAD_DIM:
        raise Exl3FormatError(f"EXL3 dimensions must be multiples of 128, got {n_in} x {n_out}")
    suh, svh = sign_scales(t, "u", n_in), sign_scales(t, "v", n_out)
    bias = t.get("bias")
    if bias is not None and bias.shape != (n_out,):
        raise Exl3FormatError(f"bias must be [{n_out}], got {tuple(bias.shape)}")
    return trellis.cpu() if trellis.device.type != "cpu" else trellis, K, cb, suh, svh, bias


@cache
def sylvester(n: int) -> torch.Tensor:
    """Unscaled Sylvester Hadamard (+-1, float64): H[i, j] = (-1)^popcount(i & j)."""
    i = torch.arange(n)
    v = i.unsqueeze(1) & i.unsqueeze(0)
    par = torch.zeros_like(v)
    while bool(v.any()):
        par ^= v & 1
        v = v >> 1
    return (1 - 2 * par).double()
