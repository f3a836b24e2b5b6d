"""Engram (arch.md §2.9): an n-gram lookup written into the residual streams before the block, gated per stream.

e = the hashed table rows of the position (24 = 3 n-gram sizes × heads, flattened); kv = wkv(e) splits into one
key per stream [hc, H] and one shared value [H]. Per stream k:
  d_k = Σ(h_k · w_k · key_k) · rsqrt(mean h_k² + ε) · rsqrt(mean key_k² + ε) · H^-½,   w = q_weight ⊙ k_weight
  g_k = σ(sign(d_k) · sqrt(max(|d_k|, 1e-6))),   h_k ← h_k + g_k · value
Image rows have the gate forced to 0. The hash ids come from dsv41.model.engram_hash.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsv41.model.device import host_to_device
from dsv41.model.linear import rsqrt, sigmoid
from dsv41.model.ops import Ops, reference_ops


@dataclass
class Engram:
    rows: Callable[[torch.Tensor], torch.Tensor]   # hash ids [n, cols] -> dequantised table rows [n, cols, head_dim]
    wkv: torch.Tensor                              # [(hc + 1) * H, cols * head_dim]
    weight: torch.Tensor                           # q_weight ⊙ k_weight [hc, H]
    eps: float
    ops: Ops = field(default_factory=reference_ops)   # the model's op set (given at load)

    def __call__(self, streams: torch.Tensor, hash_ids: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        return self.apply(streams, self.table_rows(hash_ids, streams.device), image)

    def table_rows(self, hash_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The rows' table entries [n, cols * head_dim] float32 on `device`: read on the host (a decode round reads
        them before its layers, so the layers can be one CUDA graph)."""
        e = self.rows(hash_ids.cpu())   # table rows are read on the host
        return host_to_device(e.reshape(hash_ids.shape[0], -1).float(), device)    # no wait for the GPU

    def apply(self, streams: torch.Tensor, e: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        """The streams with the table entries e (table_rows) written in."""
        n, hc, H = streams.shape
        ops = self.ops
        kv = ops.linear(e, self.wkv)
        key = kv[:, : hc * H].view(n, hc, H)
        value = kv[:, hc * H:]
        h = streams
        rstd = rsqrt(ops.row_mean(h.square())[..., 0] + self.eps) * rsqrt(ops.row_mean(key.square())[..., 0] + self.eps)
        dot = ops.row_sum(h * self.weight * key)[..., 0] * rstd * H ** -0.5
        gate = sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp_min(1e-6)), dot))
        if image is not None:
            gate = gate.masked_fill(image[:, None], 0.0)
        return h + gate[:, :, None] * value[:, None, :]
