"""Tensor-parallel forward (two, four or eight ranks in one process, threads): each rank holds its part of the heads,
experts, shared expert and vocabulary; partials are summed in rank order. Every rank produces the same bits, and so
does the whole model computing its split products in as many shards (tp_shards = the world; the default,
weights.TP_SHARDS, is two); with whole products (tp_shards=1) it differs only by float32 summation order. tiny-a's
4 heads in 2 o_groups and 64-wide shared expert cannot be cut in 4 or 8 (weights.SplitPlan): there every rank
computes the whole attention and rank 0 alone the shared expert."""
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


def _run_ranks(ranks, ids):
    """Two forwards (a prompt, then the rest) on every rank at once; -> each rank's logits."""
    out = [None] * len(ranks)

    def go(r):
        st = ranks[r].new_state()
        a = ranks[r].forward([SeqInput(st, ids[:20])])[0]
        b = ranks[r].forward([SeqInput(st, ids[20:])])[0]
        out[r] = torch.cat([a, b])

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(ranks))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    return out


@pytest.mark.parametrize("world", [8])     # 4 ranks: tests/test_tp4_serve.py, through the server
def test_wider_worlds_equal_one_rank_with_as_many_shards(shared, world):
    ck = shared / "vectors/model/tiny-a/checkpoint"
    tc = _ThreadComm(world)
    ranks = [Model.load(ck, qat=False, share=RankShare(r, world), comm=tc.for_rank(r)) for r in range(world)]
    plan = ranks[0].plan
    assert (plan.parts, plan.heads, plan.shared, plan.vocab) == (world, False, False, True)
    assert all(m.blocks[0].attn.n_heads == 4 for m in ranks)                # whole attention on every rank
    assert [m.blocks[0].moe.shared is not None for m in ranks] == [True] + [False] * (world - 1)
    assert [sorted(m.blocks[0].moe.experts) for m in ranks] == [
        list(range(r * 16 // world, (r + 1) * 16 // world)) for r in range(world)]
    assert ranks[1].head.shape[0] == 512 // world
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 500, (27,), generator=g)
    out = _run_ranks(ranks, ids)
    assert all(torch.equal(o, out[0]) for o in out[1:])
    whole = Model.load(ck, qat=False, tp_shards=world)     # one rank computing the world's shards
    st = whole.new_state()
    ref = torch.cat([whole.forward([SeqInput(st, ids[:20])])[0], whole.forward([SeqInput(st, ids[20:])])[0]])
    assert torch.equal(out[0], ref)
    default = Model.load(ck, qat=False)                    # two shards: the sums group differently
    st = default.new_state()
    near = torch.cat([default.forward([SeqInput(st, ids[:20])])[0], default.forward([SeqInput(st, ids[20:])])[0]])
    assert 0 < (near - ref).abs().max() < 1e-4


def test_two_ranks_with_four_shards_each_compute_two(shared):
    """--tp 2 --tp-shards 4: each rank computes two of the four parts; both ranks agree bit for bit."""
    ck = shared / "vectors/model/tiny-a/checkpoint"
    tc = _ThreadComm(2)
    ranks = [Model.load(ck, qat=False, share=RankShare(r, 2), comm=tc.for_rank(r), tp_shards=4) for r in range(2)]
    assert ranks[1].shards == 2 and [list(x) for x in ranks[1].blocks[0].moe.shard_ranges] == [
        list(range(8, 12)), list(range(12, 16))]
    out = _run_ranks(ranks, torch.randint(3, 500, (27,), generator=torch.Generator().manual_seed(6)))
    assert torch.equal(out[0], out[1])


def test_tp_share_needs_a_comm(shared):
    with pytest.raises(ValueError):
        Model.load(shared / "vectors/model/tiny-a/checkpoint", share=RankShare(0, 2))
