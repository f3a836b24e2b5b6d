"""FP8 / FP4 / E8M0 formats of DeepSeek-V4.1 (arch.md §2.1, §4): weight dequantisation, the quantisers that write
them (make_tiny), and the QAT fake-quant the forward applies to the window KV, compressed KV and indexer q/k.

Every function computes in float32 and is exact where the format allows: a power-of-two scale times an E4M3 or
E2M1 value is representable in float32 (and in bfloat16), so dequantised weights are bit-exact whatever the
target dtype among float32/bfloat16.
"""
from __future__ import annotations

import functools
import math

import torch

F32 = torch.float32
BLOCK = 32  # the FP8 weight block (32x32), the FP4 expert scale group (32 along K) and the Engram row group

# E2M1 magnitudes by code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_ACT_AMAX_FLOOR = 1e-4           # the reference act_quant floors amax at 1e-4 (window KV, GEMM inputs)
FP4_KV_AMAX_FLOOR = 6 * 2.0 ** -9   # compressed KV: amax/6 >= 2^-9, the smallest E4M3 subnormal
FP4_INDEX_AMAX_FLOOR = 6 * 2.0 ** -126  # indexer q/k: scale >= 2^-126, the smallest normal float32


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The E2M1 magnitudes on `device`, made once: a fresh list-to-GPU copy per call would make the host wait,
    and cannot be captured in a CUDA graph."""
    return torch.tensor(E2M1_VALUES, dtype=F32, device=device)


# --------------------------------------------------------------------------------------------------------------
# E8M0 scales

def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 (torch.float8_e8m0fnu or its uint8 bits) -> float32 2^(e-127). Code 255 is NaN."""
    bits = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    if bits.dtype != torch.uint8:
        raise TypeError(f"E8M0 scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    e = bits.to(torch.int32)
    out = torch.ldexp(torch.ones(e.shape, dtype=F32, device=e.device), e - 127)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) for positive normal float32 v, from the exponent bits (as DeepSeek's kernels do).
    torch.log2 can round v = 2^k(1+2^-23) down to exactly k, so a float log2 would pick the wrong power."""
    v = v.to(F32)
    bits = v.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(v), exp)


def float_to_e8m0(pow2: torch.Tensor) -> torch.Tensor:
    """A float32 power of two -> its E8M0 code e (value 2^(e-127)), as torch.float8_e8m0fnu."""
    mant, exp = torch.frexp(pow2.to(F32))  # pow2 = 0.5 * 2^exp, subnormals (2^-127) included
    code = exp.to(torch.int32) + 126
    if bool((mant != 0.5).any()) or bool(((code < 0) | (code > 254)).any()):
        raise ValueError("E8M0 can only hold powers of two 2^-127 .. 2^127")
    return code.to(torch.uint8).view(torch.float8_e8m0fnu)


# --------------------------------------------------------------------------------------------------------------
# Weight dequantisation

def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = F32) -> torch.Tensor:
    """FP8 E4M3 weight [out, in] with E8M0 32x32 block scales [ceil(out/32), in/32]: w = q * 2^(e-127)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    out_f, in_f = weight.shape
    want = ((out_f + BLOCK - 1) // BLOCK, in_f // BLOCK)
    if in_f % BLOCK or tuple(scale.shape) != want:
        raise ValueError(f"FP8 weight {list(weight.shape)} needs scale {list(want)}, got {list(scale.shape)}")
    s = e8m0_to_float(scale).repeat_interleave(BLOCK, 0)[:out_f]  # [out, in/32]
    return (weight.to(F32).view(out_f, in_f // BLOCK, BLOCK) * s[..., None]).view(out_f, in_f).to(dtype)


def _fp4_byte_table() -> torch.Tensor:
    """[256, 2]: the two E2M1 values of each byte, low nibble (even element) first."""
    mag = torch.tensor(E2M1_VALUES, dtype=F32)
    val = torch.cat([mag, -mag])  # code -> value (code 8 is -0.0)
    b = torch.arange(256)
    return torch.stack([val[b & 0xF], val[b >> 4]], dim=-1)


_FP4_BYTES = _fp4_byte_table()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 (int8/uint8 [..., n/2], low nibble = even element) -> float32 values [..., n]."""
    idx = packed.view(torch.uint8).to(torch.int64)
    return _FP4_BYTES.to(packed.device)[idx].flatten(-2)


def dequant_fp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = F32) -> torch.Tensor:
    """Routed-expert FP4 weight (I8 [out, in/2], two E2M1 codes per byte) with E8M0 scales [out, in/32]."""
    if weight.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"packed FP4 weight must be int8, got {weight.dtype}")
    out_f, half = weight.shape
    want = (out_f, 2 * half // BLOCK)
    if (2 * half) % BLOCK or tuple(scale.shape) != want:
        raise ValueError(f"FP4 weight {list(weight.shape)} needs scale {list(want)}, got {list(scale.shape)}")
    v = unpack_fp4(weight).view(out_f, 2 * half // BLOCK, BLOCK)
    return (v * e8m0_to_float(scale)[..., None]).view(out_f, 2 * half).to(dtype)


def dequant_fp8_rows(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = F32) -> torch.Tensor:
    """Engram table rows: F8_E4M3 [n, d] with one E8M0 scale per row per 32 channels [n, d/32]."""
    if rows.dtype != torch.float8_e4m3fn:
        raise TypeError(f"Engram rows must be float8_e4m3fn, got {rows.dtype}")
    n, d = rows.shape
    if d % BLOCK or tuple(scale.shape) != (n, d // BLOCK):
        raise ValueError(f"Engram rows {list(rows.shape)} need scale {[n, d // BLOCK]}, got {list(scale.shape)}")
    v = rows.to(F32).view(n, d // BLOCK, BLOCK) * e8m0_to_float(scale)[..., None]
    return v.view(n, d).to(dtype)


# --------------------------------------------------------------------------------------------------------------
# Quantisers for writing checkpoints (make_tiny) in the release's scale rules

def quant_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (E4M3 [out, in], E8M0 [ceil(out/32), in/32]); scale 2^ceil(log2(amax/448)) per block."""
    out_f, in_f = w.shape
    if in_f % BLOCK:
        raise ValueError(f"in features {in_f} must be a multiple of {BLOCK}")
    nb = (out_f + BLOCK - 1) // BLOCK
    pad = torch.zeros(nb * BLOCK, in_f, dtype=F32)
    pad[:out_f] = w.to(F32)
    blocks = pad.view(nb, BLOCK, in_f // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(2.0 ** -100)
    s = pow2_ceil(amax / E4M3_MAX)
    q = (blocks / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(nb * BLOCK, in_f)[:out_f]
    return q.to(torch.float8_e4m3fn), float_to_e8m0(s)


def quant_fp8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [n, d] -> (E4M3 [n, d], E8M0 [n, d/32]): the Engram table layout."""
    n, d = rows.shape
    g = rows.to(F32).view(n, d // BLOCK, BLOCK)
    s = pow2_ceil(g.abs().amax(-1).clamp_min(2.0 ** -100) / E4M3_MAX)
    q = (g / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(n, d)
    return q.to(torch.float8_e4m3fn), float_to_e8m0(s)


# Midpoints between neighbouring E2M1 magnitudes, and which way a tie goes: to the even code, so ties after an
# even code (0.25, 1.25, 2.5, 5) stay below (strict >) and ties after an odd code (0.75, 1.75, 3.5) go up (>=).
_E2M1_MIDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@functools.cache
def _e2m1_bounds(device: torch.device) -> torch.Tensor:
    """The least magnitude of each E2M1 code 1..7: its midpoint where a tie goes up, else the float32 after it (made
    once per device, as _e2m1_table)."""
    mids = torch.tensor([m for m, _ in _E2M1_MIDS], dtype=F32, device="cpu")
    up = torch.tensor([u for _, u in _E2M1_MIDS], device="cpu")
    return torch.where(up, mids, torch.nextafter(mids, torch.full_like(mids, math.inf))).to(device)


def _e2m1_index(a: torch.Tensor) -> torch.Tensor:
    """Magnitudes a >= 0 -> their E2M1 magnitude codes 0..7 (int64): how many of the codes' least magnitudes a
    reaches, in one search (counting seven comparisons into an int64 took fifteen passes over an indexer q of
    [rows, 64, 128]). A NaN gets code 0, as the comparisons gave it."""
    return torch.bucketize(torch.nan_to_num(a, nan=0.0, posinf=math.inf), _e2m1_bounds(a.device), right=True)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round float32 v (already within [-6, 6]) to E2M1 codes (int64 0..15), nearest, ties to the even code:
    ties at 0.25, 1.25, 2.5, 5 go down and at 0.75, 1.75, 3.5 go up. Values rounding to 0 get code 0 (no -0)."""
    idx = _e2m1_index(v.abs())
    return idx | torch.where((v < 0) & (idx > 0), 8, 0)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round float32 v (within [-6, 6]) to the nearest E2M1 value, ties to even (see e2m1_codes); keeps the sign."""
    return torch.copysign(_e2m1_table(v.device)[_e2m1_index(v.abs())], v)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., n] -> int8 [..., n/2], low nibble = even element."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (packed I8 [out, in/2], E8M0 [out, in/32]); scale 2^ceil(log2(amax/6)) per 32 along K."""
    out_f, in_f = w.shape
    g = w.to(F32).view(out_f, in_f // BLOCK, BLOCK)
    s = pow2_ceil(g.abs().amax(-1).clamp_min(2.0 ** -100) / E2M1_MAX)
    codes = e2m1_codes((g / s[..., None]).clamp(-E2M1_MAX, E2M1_MAX)).view(out_f, in_f)
    return pack_fp4(codes), float_to_e8m0(s)


# --------------------------------------------------------------------------------------------------------------
# QAT fake-quant inside the forward (arch.md §2.1). Each returns x's dtype; blocks run along the last dim.

def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quant block {block}")
    return x.to(F32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 E4M3 quantise-dequantise with a ue8m0 scale 2^ceil(log2(amax/448)) per block, amax floored at 1e-4
    (the reference act_quant). Used for the window KV (all head dims, RoPE tail included) and for GEMM inputs."""
    v = _blocks(x, block)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(FP8_ACT_AMAX_FLOOR)
    s = pow2_ceil(amax / E4M3_MAX)
    q = (v / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(F32) * s
    return q.reshape(x.shape).to(x.dtype)


def fp4_fake_quant_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Compressed-KV FP4: E2M1 per block of 16 with scale (amax/6) rounded to E4M3, amax floored at 6*2^-9.
    The E4M3 scale can round below amax/6, so values are clamped to +-6 before rounding."""
    v = _blocks(x, block)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(FP4_KV_AMAX_FLOOR)
    # the scale saturates at 448 (a block's amax past 2688): torch's own cast saturates in some versions and gave
    # NaN from 480 up in others (c10's fp8e4m3fn_from_fp32_value), so the clamp is written out (kernels: satfinite)
    s = (amax / E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn).to(F32)
    q = round_e2m1((v / s).clamp(-E2M1_MAX, E2M1_MAX)) * s
    return q.reshape(x.shape).to(x.dtype)


def fp4_fake_quant_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Indexer q/k FP4: E2M1 per block of 32 with scale 2^ceil(log2(amax/6)), amax floored at 6*2^-126."""
    v = _blocks(x, block)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(FP4_INDEX_AMAX_FLOOR)
    s = pow2_ceil(amax / E2M1_MAX)
    q = round_e2m1((v / s).clamp(-E2M1_MAX, E2M1_MAX)) * s
    return q.reshape(x.shape).to(x.dtype)
