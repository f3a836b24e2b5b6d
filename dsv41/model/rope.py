"""RoPE / YaRN of DeepSeek-V4.1 (arch.md §2.5).

Interleaved (adjacent-pair complex) rotation of the LAST `qk_rope_head_dim` dims of a vector. Two tables:
- main: θ = rope_theta, no scaling (window-only layers and the DSpark stages);
- compress: θ = compress_rope_theta with YaRN (layers with ratio > 0: q, window KV, compressed KV, indexer).
Inverse frequencies are computed in float32 the way the HF port does, so they match its tables bit for bit.
"""
from __future__ import annotations

import math

import torch

from dsv41.config import TextConfig


def main_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def yarn_inv_freq(theta: float, dim: int, factor: float, beta_fast: float, beta_slow: float,
                  original_max: int) -> torch.Tensor:
    """YaRN: blend interpolated (f/factor) and extrapolated (f) frequencies with a linear ramp between the
    correction dims of beta_fast and beta_slow rotations. No mscale (attention factor 1)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


class Rope:
    """Both inverse-frequency tables of a config and the cos/sin at given positions."""

    def __init__(self, t: TextConfig, cos_sin_fn=None):
        self.cos_sin_fn = cos_sin_fn or cos_sin     # the op set's (Ops.cos_sin), given at load
        d = t.qk_rope_head_dim
        rs = t.rope_scaling
        self.dim = d
        self.inv_freq = {
            "main": main_inv_freq(float(t.rope_theta), d),
            "compress": yarn_inv_freq(float(t.compress_rope_theta), d, float(rs.factor), float(rs.beta_fast),
                                      float(rs.beta_slow), int(rs.original_max_position_embeddings)),
        }

    def cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, dim/2] float32 at integer positions [n] of the table `kind`."""
        return self.cos_sin_fn(positions, self.inv_freq[kind])


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the angles positions [n] (as float32) times inv_freq [d] -> [n, d] each (cos and sin round alike
    on every SIMD path)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs (even, odd) of the last 2·cos.shape[-1] dims of x [n, ..., D] by the angles of its row
    (cos/sin [n, d/2]); the leading ("nope") dims pass through. inverse=True rotates back (conjugate)."""
    _, _, new_even, new_odd = _rotation(x, cos, sin, inverse)
    rotated = torch.stack([new_even, new_odd], dim=-1).flatten(-2)
    return torch.cat([x[..., :-2 * cos.shape[-1]], rotated], dim=-1)


def _rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool):
    """x's rotated pairs as views (even, odd) of its last 2·cos.shape[-1] dims, and their rotations (new_even,
    new_odd): the products and sums of apply_rope and apply_rope_."""
    rd = cos.shape[-1] * 2
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    rot = x[..., -rd:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    return even, odd, even * cos - odd * sin, even * sin + odd * cos


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """apply_rope in place on a float32 x the caller owns (a fresh product or norm output), returned: the same
    products and sums, so the same bits, but only the rope dims are written. apply_rope's cat copies the whole of x
    (the nope dims are 7/8 of a [rows, 64, 512] q: a 2048-row prompt chunk's q and attention output are 268 MB
    each, bench/results/round-profile.md's CatArrayBatchedCopy) and its stack interleaves the pairs in another
    pass. Another dtype takes apply_rope (its cat promotes to float32)."""
    if x.dtype != torch.float32:
        return apply_rope(x, cos, sin, inverse)
    even, odd, new_even, new_odd = _rotation(x, cos, sin, inverse)    # both read before either is written
    even.copy_(new_even)
    odd.copy_(new_odd)
    return x
