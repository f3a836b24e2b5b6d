"""Manifold-constrained hyper-connections, single-pass (arch.md §2.4).

The residual is hc_mult (4) parallel streams [n, 4, H]. Each site (attention, FFN) projects the RMS-normalised
flattened streams once into 24 mixes: pre (4), post (4) and a 4x4 comb made doubly stochastic by Sinkhorn.
Single-pass: a site collapses its input with the PREVIOUS site's `pre` and hands its own `pre` on; the final
collapse uses the last site's `pre`. Small sums over the 4 streams are written out term by term so the summation
order is fixed (and so bit-identical whatever the row count).

The functions below are the ops' torch form (the reference, and the CUDA path's fallbacks); a site computes through
its op set (`HcSite.ops`, dsv41/model/ops.py), which may run kernels/rowops.py's one-launch forms instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.linear import sigmoid
from dsv41.model.ops import Ops, reference_ops


@dataclass
class HcSite:
    fn: torch.Tensor      # [(2 + hc) * hc, hc * H] float32
    base: torch.Tensor    # [(2 + hc) * hc]
    scale: torch.Tensor   # [3]
    ops: Ops = field(default_factory=reference_ops)   # the model's op set (given at load)


def _sum(terms):
    acc = terms[0]
    for t in terms[1:]:
        acc = acc + t
    return acc


def hc_mixes(streams: torch.Tensor, site: HcSite, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """streams [n, hc, H] -> pre [n, hc], post [n, hc], comb [n, hc, hc] (comb[:, j, k]: stream j -> k)."""
    ops = site.ops
    n, hc, _ = streams.shape
    if ops.hc_site_mixes is not None:     # the product and the mixes in one launch (the same bits)
        got = ops.hc_site_mixes(streams, site.fn, site.scale, site.base, hc, sinkhorn_iters, hc_eps, norm_eps)
        if got is not None:
            return got
    m = ops.hc_pre(streams, site.fn, norm_eps) if ops.hc_pre is not None else None
    if m is None:       # the reference's order: the normalised streams times hc_fn
        m = ops.linear(ops.rms_norm(streams.reshape(n, -1), None, norm_eps), site.fn)
    return ops.hc_mix(m, site.scale, site.base, hc, sinkhorn_iters, hc_eps)


def hc_mix(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, sinkhorn_iters: int, hc_eps: float,
           sinkhorn_fn=None):
    """The mixes m [n, (2 + hc) * hc] -> pre [n, hc], post [n, hc], comb [n, hc, hc] (the Sinkhorn-normalised
    softmax). sinkhorn_fn: the op set's Sinkhorn (default: the torch loop below; kernels/rowops.py's gives its bits)."""
    n = m.shape[0]
    s, b = scale, base
    pre = sigmoid(m[:, :hc] * s[0] + b[:hc]) + hc_eps
    post = 2 * sigmoid(m[:, hc:2 * hc] * s[1] + b[hc:2 * hc])
    logits = (m[:, 2 * hc:] * s[2] + b[2 * hc:]).view(n, hc, hc)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    return pre, post, (sinkhorn_fn or sinkhorn)(comb, sinkhorn_iters, hc_eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [n, hc, hc] (softmax + eps) -> doubly stochastic: norm_cols, then (iters - 1) × (norm_rows, norm_cols),
    each sum over the streams written out left to right (kernels/rowops.py's `sinkhorn`: the same in one launch)."""
    def norm_cols(c):
        col = _sum(c.unbind(1))                                     # [n, hc]: Σ_j c[:, j, k]
        return c / (col[:, None, :] + eps)

    def norm_rows(c):
        row = _sum(c.unbind(2))                                     # [n, hc]: Σ_k c[:, j, k]
        return c / (row[:, :, None] + eps)

    comb = norm_cols(comb)
    for _ in range(iters - 1):
        comb = norm_cols(norm_rows(comb))
    return comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """u = Σ_j pre[j]·x_j: [n, hc, H] -> [n, H]. All products in one op, then the sum over j left to right (each
    element: the same product and the same additions as a loop over j)."""
    return _sum((pre[:, :, None] * streams).unbind(1))


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k·y + Σ_j comb[j, k]·residual_j: -> [n, hc, H]. Vectorised over k (one product per stream j
    for all k, summed over j left to right, then post·y added): each element's operations as in a loop over k."""
    hc = residual.shape[1]
    mixed = _sum([comb[:, j, :, None] * residual[:, j, None, :] for j in range(hc)])
    return post[:, :, None] * y[:, None, :] + mixed
