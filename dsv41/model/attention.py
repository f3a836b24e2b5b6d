"""Attention of a DeepSeek-V4.1 block (arch.md §2.6).

q path: qr = q_norm(wq_a(x)); q = wq_b(qr) as [heads, D], RoPE on the last rope dims. No per-head norm.
One shared K=V latent per token: kv = kv_norm(wkv(x)), RoPE, FP8 fake-quant (QAT), kept in a window ring.
Each query row attends to its own key set: the window (positions p-W+1..p, ascending) followed by the compressed
entries its top-k list selects (ascending). Softmax scale D^-½; the per-head `attn_sink` adds exp(sink - max) to
the denominator only. The output's rope slice is rotated back at the query position, then the grouped low-rank
projection: wo_a per group of heads, wo_b to the hidden size.

Exactness: every row's key set has the fixed width W (+ index_topk) with masked slots, and the op set's `attend`
runs in fixed row tiles (the reference) or one program per row (the kernel), so a row's output does not depend on
its neighbours. Tensor parallelism: with `shards` > 1 (weights.TP_SHARDS) the heads, their wq_b rows, wo_a groups
and wo_b columns are computed shard by shard exactly as a rank of a wider world computes its own, and the wo_b
partials are added in shard order, so one rank and two give the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.device import FusedWeight, one_run
from dsv41.model.ops import Ops, reference_ops, shard_sum


@dataclass
class Attention:
    wq_a: torch.Tensor        # [q_lora, H]
    q_norm: torch.Tensor      # [q_lora]
    wq_b: torch.Tensor        # [heads * D, q_lora]  (this rank's heads)
    wkv: torch.Tensor         # [D, H]
    kv_norm: torch.Tensor     # [D]
    attn_sink: torch.Tensor   # [heads]
    wo_a: torch.Tensor        # [groups * o_lora, heads / groups * D] (this rank's groups)
    wo_b: torch.Tensor | None  # [H, groups * o_lora]  (this rank's columns; None once cut into wo_b_shards)
    head_dim: int
    o_lora: int
    eps: float
    shards: int = 1                         # TP shards computed apart (weights.tp_parts(world, shards) // world)
    wq_b_shards: list | None = None         # wq_b's rows per shard (views)
    wo_b_shards: list | None = None         # wo_b's columns per shard (contiguous copies)
    ops: Ops = field(default_factory=reference_ops)   # the model's op set (given at load; dsv41/model/ops.py)
    fused_in: FusedWeight | None = None     # wq_a and wkv (both take x) for one launch (Ops.fuse; made here)
    fused_q: FusedWeight | None = None      # wq_b over its TP shards' rows, one launch (Ops.fuse_parts; set with
    #                                         the shards)

    def __post_init__(self):
        if self.fused_in is None:
            self.fused_in = self.ops.fuse([self.wq_a, self.wkv])
            if self.fused_in is not None:      # hold the weights as views of the one copy
                self.wq_a, self.wkv = self.fused_in.part(0), self.fused_in.part(1)

    @property
    def n_heads(self) -> int:
        return self.wq_b.shape[0] // self.head_dim

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qat: bool):
        """x [n, H] (attn_norm'd) -> q_res [n, q_lora], q [n, heads, D] (roped), kv [n, D] (roped, fake-quant)."""
        ops = self.ops
        if self.fused_in is not None:     # one launch, each product's bits as its own launch has them
            qa, kva = ops.linear_parts(x, self.fused_in)
        else:
            qa, kva = ops.linear(x, self.wq_a), ops.linear(x, self.wkv)
        q_res = ops.rms_norm(qa, self.q_norm, self.eps)
        q = None
        if self.shards > 1 and self.fused_q is not None and q_res.shape[0] == 1:
            # one row: the shards' products in one launch, whose part blocks then lie side by side (each part's bits)
            q = one_run(ops.linear_parts(q_res, self.fused_q))
        if q is None:
            # the shards' products side by side (no cat copy), or the one product
            q = ops.linear_cat(q_res, self.wq_b_shards) if self.shards > 1 else ops.linear(q_res, self.wq_b)
        # in place: q and the normed kv are this call's own (apply_rope_: no copy of the nope dims)
        q = ops.rope_(q.view(-1, self.n_heads, self.head_dim), cos, sin)
        kv = ops.norm_rope_quant(kva, self.kv_norm, self.eps, cos, sin, "fp8" if qat else None, own=True)
        return q_res, q, kv

    def attend(self, q: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """q [n, heads, D] over each row's key set (K = V) -> o [n, heads, D]; the heads of each shard in their own
        products (a product's bits depend on its head count), or in one call where the op set computes each head
        apart (the kernel's `all_shards`). Two forms of the key sets, the same function:
        gathered, keys [n, K, D] with sel the bool validity [n, K] (a decode round's fixed shapes, its CUDA
        graphs); or a pool, keys [P, D] with sel the int64 indices [n, K] into it, -1 masked (a prompt pass: no
        [n, K, D] copy of the keys)."""
        attend = self.ops.attend_rows if sel.dtype == torch.bool else self.ops.attend
        sink = self.attn_sink.float()
        scale = self.head_dim ** -0.5
        h = self.n_heads // self.shards
        all_shards = getattr(self.ops.sparse_attend, "all_shards", None)   # the kernel: one launch, each shard's bits
        if self.shards == 1 or (all_shards is not None and all_shards(h, self.head_dim)):
            return attend(q, keys, sel, sink, scale)
        return torch.cat([attend(q[:, i * h:(i + 1) * h], keys, sel, sink[i * h:(i + 1) * h], scale)
                          for i in range(self.shards)], dim=1)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: bool = False):
        """Inverse RoPE at the query position, grouped wo_a, then wo_b: o [n, heads, D] -> [n, H] (this rank's
        partial sum when tensor-parallel). parts: the TP shards' wo_b products as a tuple, for the caller to add in
        shard order (one rank's round adds them in its next launch: Ops.expand_collapse_norm)."""
        n = o.shape[0]
        o = self.ops.rope_(o, cos, sin, True)       # o is the attend's own output
        groups = self.wo_a.shape[0] // self.o_lora
        lin = self.ops.linear
        mid = self.ops.grouped(o.reshape(n, -1), self.wo_a, groups)   # group g's wo_a rows x its heads' columns
        if self.shards == 1:
            return lin(mid, self.wo_b)
        c = mid.shape[1] // self.shards
        ys = tuple(lin(mid[:, i * c:(i + 1) * c], w) for i, w in enumerate(self.wo_b_shards))
        return ys if parts else shard_sum(ys)
