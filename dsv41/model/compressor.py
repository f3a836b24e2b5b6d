"""KV compressor of a KV-source layer (arch.md §2.7).

Ratio r > 1: every r consecutive tokens pool into one latent, latent = Σ_t kv_t · softmax_t(gate) per channel,
then `compressor.norm`. A group that has not closed yet waits in the state (partial_kv / partial_gate) across
calls, so chunked prefill and decode close exactly the groups a one-shot prefill closes, from the same rows.
Ratio 1: latent = norm(wkv(x)), no gate. Latents are returned pre-RoPE: the indexer keys derive from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.device import FusedWeight
from dsv41.model.ops import Ops, reference_ops
from dsv41.model.state import SeqState


@dataclass
class Compressor:
    layer: int
    ratio: int
    wkv: torch.Tensor            # [D, H]
    wgate: torch.Tensor | None   # [D, H] (ratio > 1)
    norm: torch.Tensor           # [D]
    eps: float
    ops: Ops = field(default_factory=reference_ops)   # the model's op set (given at load)
    fused_in: FusedWeight | None = None   # wkv and wgate (both take x) for one launch (Ops.fuse; made here)

    def __post_init__(self):
        if self.fused_in is None and self.wgate is not None:
            self.fused_in = self.ops.fuse([self.wkv, self.wgate])
            if self.fused_in is not None:      # hold the weights as views of the one copy
                self.wkv, self.wgate = self.fused_in.part(0), self.fused_in.part(1)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token kv (and gate) for all rows of the forward [n, D], float32."""
        if self.fused_in is not None:      # one launch, each product's bits as its own launch has them
            kv, gate = self.ops.linear_parts(x, self.fused_in)
            return kv, gate
        kv = self.ops.linear(x, self.wkv)
        gate = self.ops.linear(x, self.wgate) if self.wgate is not None else None
        return kv, gate

    def close_groups(self, st: SeqState, kv: torch.Tensor, gate: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """Append one sequence's new rows to its open group and pool every group that closes.
        Returns (latents [g, D] pre-RoPE, position of the first returned group's first token)."""
        first = st.compressed[self.layer].shape[0] * self.ratio if self.layer in st.compressed else 0
        if self.ratio == 1:
            return self.ops.rms_norm(kv, self.norm, self.eps), first
        pending_kv = st.partial_kv.get(self.layer)
        if pending_kv is not None and pending_kv.shape[0]:
            kv = torch.cat([pending_kv, kv], dim=0)
            gate = torch.cat([st.partial_gate[self.layer], gate], dim=0)
        st.note_group_rows(self.layer, first, kv, gate)        # a marked forward can reopen the group (rollback)
        usable = kv.shape[0] // self.ratio * self.ratio
        st.partial_kv[self.layer] = kv[usable:].clone()
        st.partial_gate[self.layer] = gate[usable:].clone()
        g = usable // self.ratio
        kv = kv[:usable].view(g, self.ratio, kv.shape[1])
        gate = gate[:usable].view(g, self.ratio, gate.shape[1])
        return self.pool(kv, gate), first

    def pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Closed groups kv, gate [g, ratio, D] -> latents [g, D] pre-RoPE (elementwise per group: a group's bits
        do not depend on the others); in one launch where the op set can (kernels/compress_pool.py: the same
        bits)."""
        if self.ops.pool_norm is not None:
            got = self.ops.pool_norm(kv, gate, self.norm, self.eps)
            if got is not None:
                return got
        # Softmax over the r tokens of a group, channel by channel, written out so the order is fixed.
        top = gate[:, 0]
        for t in range(1, self.ratio):
            top = torch.maximum(top, gate[:, t])
        e = [torch.exp(gate[:, t] - top) for t in range(self.ratio)]
        total = e[0]
        for t in range(1, self.ratio):
            total = total + e[t]
        latent = kv[:, 0] * (e[0] / total)
        for t in range(1, self.ratio):
            latent = latent + kv[:, t] * (e[t] / total)
        return self.ops.rms_norm(latent, self.norm, self.eps)
