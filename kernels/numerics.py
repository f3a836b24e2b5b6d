"""Float32 helpers shared by the kernels and the model's torch code (dsv41/model imports them from here; kernels/
imports nothing from dsv41). Torch only, no Triton."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def inv_count(n: int) -> float:
    """float32(1) / float32(n), the factor torch's CUDA division by a host scalar multiplies by (its
    div_true_kernel_cuda computes a / s as a · (1/s) in float32); exactly representable as a Python float."""
    one = torch.tensor(1.0, dtype=torch.float32, device="cpu")
    return float(one / torch.tensor(float(n), dtype=torch.float32, device="cpu"))


def tree_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim (keepdim) as a fixed pairwise tree of elementwise adds: every element is computed by
    itself, so a row's sum is the same bits whatever the tensor's row count (a CUDA reduction's is not). Level by
    level: s[i] = s[i] + s[i + L//2] for i < L//2, an odd length's last element carried (kernels/rowops.py's norm
    runs the same tree)."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        s = x[..., :half] + x[..., half:2 * half]
        x = torch.cat([s, x[..., 2 * half:]], dim=-1) if n % 2 else s
    return x
