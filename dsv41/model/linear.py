"""Row-invariant numerics: every computation whose per-row result could depend on how many rows share a call.

torch's CPU GEMM picks kernels (and K-splits) by row count, so a row's float32 result changes with the number of
rows in the call. A GEMM on a FIXED number of rows gives bit-identical rows whatever the other rows hold and
wherever the row sits in the tile (tests/test_model_exact.py checks both). So every product whose row count depends
on batching or chunking goes through `linear` / `tiled`, which cut the rows into tiles of exactly ROW_TILE rows,
zero-padding the last one.

Elementwise transcendental ops have the same problem in a subtler form: torch runs the bulk of a tensor through a
SIMD path and the tail through a scalar path, and for sigmoid, silu, softplus, rsqrt and exp2 the two round
differently, so an element's value depends on where it falls in the flattened tensor. exp, log, log1p, sqrt, sin,
cos, division and the basic arithmetic agree on both paths, so the functions below are written in those terms.
Last-dim reductions (sum, mean, amax) and last-dim softmax run row by row and are row-invariant as they are.

These are the CPU float32 reference's functions (`ops.reference_ops()`); the CUDA path's op set (`ops.cuda_ops()`)
runs the same `tiled` with its own row tile and its own row sums (dsv41/model/ops.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

ROW_TILE = 16


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad], dim=0)


def tiled(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, rows: int = ROW_TILE) -> torch.Tensor:
    """Apply `fn` to fixed tiles of `rows` rows of the row-aligned inputs `xs` (dim 0 is the row) and concatenate
    the outputs' first n rows. `fn` sees exactly `rows` rows every call, so its per-row results cannot depend on
    the total row count. The op set names the tile (`Ops.tiled`): ROW_TILE on the CPU reference,
    device.CUDA_ROW_TILE (one shape for cuBLAS) on the CUDA path."""
    n = xs[0].shape[0]
    if n == 0:
        probe = fn(*[_pad_rows(x[:0], rows) for x in xs])
        return probe[:0]
    outs = []
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        # contiguous: a full tile of a strided view and a padded last tile must reach the GEMM in one layout
        tile = [_pad_rows(x[start:stop], rows).contiguous() for x in xs]
        outs.append(fn(*tile)[: stop - start])
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def linear(x: torch.Tensor, weight: torch.Tensor, rows: int = ROW_TILE) -> torch.Tensor:
    """y = x · weightᵀ for x [n, in] and a float weight [out, in], computed in tiles of `rows` rows. (A weight kept
    in its checkpoint form goes through the op set's `linear`, which dispatches on the weight's type: ops.py.)"""
    wt = weight.t()
    return tiled(lambda t: t @ wt, x, rows=rows)


# ---- elementwise functions that round the same on the SIMD and the scalar path ------------------------------------

def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / torch.sqrt(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), linear above 20 like torch's default threshold."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim, keepdim: torch's sum (row by row on the CPU, row-invariant). The CUDA path's op set sums
    with a fixed pairwise tree instead (kernels.numerics.tree_row_sum), since a CUDA reduction's summation order
    depends on the tensor's row count."""
    return x.sum(-1, keepdim=True)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim, keepdim (see row_sum). The CUDA path's op set writes it as tree Σ · float32(1/n):
    the same bits as torch's CUDA `Σ / n` (kernels/rowops.py)."""
    return x.mean(-1, keepdim=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             mean: Callable[[torch.Tensor], torch.Tensor] = row_mean) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · weight over the last dim, in float32; `mean`: the op set's row mean."""
    x = x.float()
    y = x * rsqrt(mean(x.square()) + eps)
    return y if weight is None else y * weight


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, sorted by score descending, ties to the lower index. A stable sort makes the pick a
    pure function of the row (torch.topk's tie order is unspecified)."""
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], order[..., :k]
