"""Tensor-parallel forward (two ranks in one process, threads): each rank holds half the heads, experts, shared
expert and vocabulary; partials are summed in rank order. Both ranks produce the same bits, and so does the whole
model, which computes its split products in the same two shards (weights.TP_SHARDS); with whole products
(tp_shards=1) it differs only by float32 summation order."""
import threading

import pytest
import torch

from dsv41.model.model import Comm, Model, SeqInput
from dsv41.model.weights import RankShare


class _ThreadComm:
    def __init__(self, world):
        self.world = world
        self.slots = [None] * world
        self.barrier = threading.Barrier(world, timeout=120)  # a failing rank breaks it instead of hanging

    def for_rank(self, rank):
        def exchange(t):
            self.slots[rank] = t
            self.barrier.wait()
            parts = list(self.slots)
            self.barrier.wait()
            return parts

        def all_reduce(t):
            parts = exchange(t)
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            return total

        return Comm(world=self.world, all_reduce=all_reduce,
                    all_gather_cols=lambda t: torch.cat(exchange(t), dim=1))


def test_two_ranks_agree_with_each_other_and_with_one(shared):
    ck = shared / "vectors/model/tiny-a/checkpoint"
    whole = Model.load(ck, qat=False)
    tc = _ThreadComm(2)
    ranks = [Model.load(ck, qat=False, share=RankShare(r, 2), comm=tc.for_rank(r)) for r in range(2)]
    assert ranks[0].blocks[0].attn.n_heads == whole.blocks[0].attn.n_heads // 2
    assert len(ranks[0].blocks[0].moe.experts) == whole.t.n_routed_experts // 2
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (27,), generator=g)
    out = [None, None]

    def go(r):
        st = ranks[r].new_state()
        a = ranks[r].forward([SeqInput(st, ids[:20])])[0]
        b = ranks[r].forward([SeqInput(st, ids[20:])])[0]
        out[r] = torch.cat([a, b])

    threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert torch.equal(out[0], out[1])
    st = whole.new_state()
    ref = torch.cat([whole.forward([SeqInput(st, ids[:20])])[0], whole.forward([SeqInput(st, ids[20:])])[0]])
    assert torch.equal(out[0], ref)                     # one rank == two, bit for bit
    plain = Model.load(ck, qat=False, tp_shards=1)      # whole products: the reference's order
    st = plain.new_state()
    far = torch.cat([plain.forward([SeqInput(st, ids[:20])])[0], plain.forward([SeqInput(st, ids[20:])])[0]])
    assert 0 < (far - ref).abs().max() < 1e-4


def test_tp_share_needs_a_comm(shared):
    with pytest.raises(ValueError):
        Model.load(shared / "vectors/model/tiny-a/checkpoint", share=RankShare(0, 2))
