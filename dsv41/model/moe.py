"""Mixture of experts (arch.md §2.10).

Router: s = sqrt(softplus(x·Wᵀ / gate_temp)) in float32; experts picked by top-k of s + bias (bias_vl on image
rows; ties to the lower expert id); weights = s at the picks, divided by their sum (+1e-20), × routed_scaling_factor.
Expert: w2(weight · silu(min(w1x, limit)) · clamp(w3x, ±limit)); the routing weight multiplies before w2.
Shared expert: same clamps, unweighted. Output = Σ over slots (in slot order) of the routed outputs, + shared.

Exactness: each expert runs on its rows through the fixed-tile `linear`; a row's slot outputs are summed in slot
order, so the sum does not depend on which other rows picked the same experts. Tensor parallelism: with `shards` >
1 (weights.TP_SHARDS) the output is Σ over shards, in order, of (that shard's experts' slots + its part of the
shared expert), each computed as the rank holding that shard alone computes it, so one rank and two give the same
bits. The grouped kernel computes every shard's slots in one pass (`ops.routed_shards`: a pair's output does not
depend on the other pairs of the launch) and sums each shard's apart.

The products and the routing weights go through the op set (`MoE.ops`, dsv41/model/ops.py); `ops.routed` runs a
layer's stacked experts in one grouped kernel launch where the op set has one (the CUDA path), else the per-expert
loop below runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.device import ExpertStack, FusedWeight, one_run
from dsv41.model.linear import silu, softplus
from dsv41.model.ops import Ops, reference_ops


@dataclass
class Expert:
    w1: torch.Tensor   # [inter, H]
    w2: torch.Tensor   # [H, inter]
    w3: torch.Tensor   # [inter, H]


def swiglu_h(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) · clamp(up, ±limit) (kernels/act.py: the same in one launch)."""
    return silu(torch.clamp(gate, max=limit)) * torch.clamp(up, min=-limit, max=limit)


def swiglu(x: torch.Tensor, e: Expert, limit: float, weight: torch.Tensor | None = None,
           ops: Ops | None = None) -> torch.Tensor:
    """w2(weight · silu(min(w1x, limit)) · clamp(w3x, ±limit)), the products and SwiGLU through `ops` (default: the
    reference)."""
    ops = ops or reference_ops()
    h = ops.swiglu_h(ops.linear(x, e.w1), ops.linear(x, e.w3), limit)
    if weight is not None:
        h = h * weight
    return ops.linear(h, e.w2)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, e: Expert, limit: float, ops: Ops) -> torch.Tensor:
    """`swiglu` from its two products w1x, w3x already computed (a fused launch: MoE.shared_in)."""
    return ops.linear(ops.swiglu_h(gate, up, limit), e.w2)


def router_scores(z: torch.Tensor, temp: float, bias: torch.Tensor, bias_vl: torch.Tensor,
                  image: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's scores from its logits z [n, E]: s = sqrt(softplus(z / temp)), and the selection's input
    s + bias (bias_vl on the rows image marks) -> (s, s + bias) (kernels/router.py: the same in one launch)."""
    s = torch.sqrt(softplus(z / temp))
    return s, s + (bias if image is None else torch.where(image[:, None], bias_vl, bias))


def route_weights(s: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    """The routing weights of the picks ids [n, k] from the scores s [n, E]: s at the picks, divided by their
    slot-order sum + 1e-20 (when k > 1), × scaling (kernels/rowops.py's `route_weights`: the same in one launch)."""
    w = s.gather(1, ids)
    top_k = ids.shape[1]
    if top_k > 1:
        total = w[:, 0]
        for j in range(1, top_k):
            total = total + w[:, j]
        w = w / (total[:, None] + 1e-20)
    return w * scaling


@dataclass
class MoE:
    gate: torch.Tensor             # [E, H]
    bias: torch.Tensor             # [E]
    bias_vl: torch.Tensor          # [E]
    experts: dict[int, Expert]     # this rank's routed experts by id
    shared: Expert | None          # None on a rank > 0 when the shared expert is not cut (weights.SplitPlan)
    top_k: int
    gate_temp: float
    scaling: float
    limit: float
    stack: ExpertStack | None = None   # on the GPU: the experts in the grouped kernel's layout (device.py)
    shards: int = 1                    # TP shards computed apart (weights.tp_parts(world, shards) // world)
    shard_ranges: list[range] | None = None     # each shard's routed experts (global ids)
    shared_shards: list[Expert | None] | None = None   # each shard's part of the shared expert (w1/w3 rows, w2
    #                                                    columns); None: a part without one (weights.SplitPlan)
    ops: Ops = field(default_factory=reference_ops)   # the model's op set (given at load)
    shared_in: FusedWeight | None = None   # w1 of each shard's shared part, then w3 of each, for one launch
    #                                        (fuse_shared, at load; None: the products one by one)

    def fuse_shared(self) -> None:
        """At load, once the shards are set: the shared expert's w1 and w3 rows (of every shard this rank computes)
        concatenated for one launch where the op set takes them so (Ops.fuse); the experts then hold views of it
        (w1 of the shards in order then w3: the whole w1 and w3 stay views too, nothing is held twice)."""
        live = self._shared_parts()
        if not live:
            return
        fused = self.ops.fuse([e.w1 for e in live] + [e.w3 for e in live])
        if fused is None:
            return
        k = len(live)
        whole = self.shared
        if self.shards > 1 and whole is not None and all(whole is not e for e in live):     # the shards are cut from it
            whole.w1, whole.w3 = fused.rows(0, k), fused.rows(k, 2 * k)
        for i, e in enumerate(live):
            e.w1, e.w3 = fused.part(i), fused.part(k + i)
        self.shared_in = fused

    def _shared_parts(self) -> list[Expert]:
        if self.shards == 1:
            return [] if self.shared is None else [self.shared]
        return [e for e in self.shared_shards if e is not None]

    def _shared(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each shared part's output (_shared_parts' order): one launch for all the w1/w3 products where fused."""
        live = self._shared_parts()
        if self.shared_in is None:
            return [swiglu(x, e, self.limit, ops=self.ops) for e in live]
        outs = self.ops.linear_parts(x, self.shared_in)
        k = len(live)
        gates, ups = one_run(outs[:k]), one_run(outs[k:])
        if k > 1 and gates is not None and ups is not None:   # every shard's SwiGLU in one elementwise launch
            h = self.ops.swiglu_h(gates, ups, self.limit).view(k, *outs[0].shape)
            return [self.ops.linear(h[i], e.w2) for i, e in enumerate(live)]
        return [swiglu_down(outs[i], outs[k + i], e, self.limit, self.ops) for i, e in enumerate(live)]

    def route(self, x: torch.Tensor, image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [n, k] float32, expert ids [n, k]) in slot order."""
        logits = self.ops.linear(x, self.gate)
        if self.ops.route_fn is not None and self.top_k > 1:     # the three ops in one launch (the same bits)
            got = self.ops.route_fn(logits, self.gate_temp, self.bias, self.bias_vl, image, self.top_k, self.scaling)
            if got is not None:
                return got
        s, biased = self.ops.router_scores(logits, self.gate_temp, self.bias, self.bias_vl, image)
        _, ids = self.ops.router_topk(biased, self.top_k)
        return self.ops.route_weights(s, ids, self.scaling), ids

    def __call__(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, H] (ffn_norm'd) -> [n, H]: this rank's routed slots (in slot order) + its shared-expert part."""
        weights, ids = self.route(x, image)
        shared_out = iter(self._shared(x))
        if self.shards == 1:
            y = self._routed(x, weights, ids)
            return y if self.shared is None else y + next(shared_out)
        if self.stack is not None and self.shards == 2:    # the shards' parts and their sum in the grouped pass
            shared = [next(shared_out) if e is not None else None for e in self.shared_shards]
            total = self.ops.routed_total(self.stack, x, weights, ids, self.limit, shared)
            if total is not None:
                return total
            shared_out = iter([e for e in shared if e is not None])
        # every shard's routed sum from one grouped pass where the op set has one, else a pass per shard
        routed = None if self.stack is None else self.ops.routed_shards(self.stack, x, weights, ids, self.limit,
                                                                        self.shards)
        y = None
        for i, (rng, shared) in enumerate(zip(self.shard_ranges, self.shared_shards)):
            part = self._routed(x, weights, ids, rng) if routed is None else routed[i]
            if shared is not None:     # None: a shared expert not cut is part 0's (weights.SplitPlan)
                part = part + next(shared_out)
            y = part if y is None else y + part
        return y

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shard: range | None = None) -> torch.Tensor:
        """Σ over slots (slot order) of the picked experts this rank holds (within `shard`, a TP shard's expert
        ids, when given; the others add nothing)."""
        n = x.shape[0]
        if self.stack is not None:   # (an EXL3 stack takes no shard: EXL3 blocks are never sharded)
            routed = self.ops.routed(self.stack, x, weights, ids, self.limit, shard)
            if routed is not None:   # the grouped kernel: the same slot sum in one launch
                return routed
        slots = x.new_zeros((n, self.top_k, x.shape[1]))
        for e in ids.unique().tolist():   # only the experts some row picked (one host sync)
            expert = self.experts.get(e)
            if expert is None or (shard is not None and e not in shard):   # another rank's or shard's expert
                continue
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            slots[rows, slot] = swiglu(x[rows], expert, self.limit, weights[rows, slot][:, None], self.ops)
        y = slots[:, 0]
        for j in range(1, self.top_k):
            y = y + slots[:, j]
        return y
