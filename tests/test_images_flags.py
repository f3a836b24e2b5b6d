"""Image rows on several ranks without a per-round flag collective (issue 7): the scheduler flags the SeqRows that
cover image positions (SeqRows.images), and dsv41/sched/images.py sends rank 0's rows of the flagged rows only; a
round with no flagged row makes no collective. No model here: a stub with a counting Comm plays the ranks."""
from __future__ import annotations

import types

import pytest
import torch

from dsv41.comm.plan import PlanError, SeqRows, StepPlan
from dsv41.model.vision import EncodedImage, PromptImage
from dsv41.sched.images import attach_image_rows, chunk_rows, covers_images

H = 8


class CountingComm:
    """world 2 seen from one rank: all_reduce adds `other(call)` (the other rank's part; zeros by default) and
    records every part this rank contributed."""

    def __init__(self, other=None):
        self.world, self.calls, self.other = 2, [], other

    def all_reduce(self, t):
        self.calls.append(t.clone())
        return t + (self.other(len(self.calls) - 1) if self.other else torch.zeros_like(t))


def stub(comm):
    return types.SimpleNamespace(t=types.SimpleNamespace(hidden_size=H), comm=comm, device="cpu")


def image(n_tokens: int, seed: int) -> EncodedImage:
    g = torch.Generator().manual_seed(seed)
    tt = torch.randint(0, 4, (n_tokens,), generator=g)
    return EncodedImage(bytes(32), 1, 1, torch.randn(n_tokens, H, generator=g), tt)


def inputs(plan):
    return [types.SimpleNamespace(embeds=None, token_type=None) for _ in plan.rows]


SPANS = [PromptImage(5, image(6, 1)), PromptImage(20, image(3, 2))]      # positions 5..10 and 20..22


def test_covers_images_is_exactly_when_chunk_rows_has_rows():
    for a in range(0, 26):
        for n in (1, 2, 5, 9):
            assert covers_images(SPANS, a, n) == (chunk_rows(SPANS, a, n, H)[0] is not None), (a, n)
    assert not covers_images([], 0, 10) and not covers_images(None, 0, 10)


def test_a_text_only_tp_round_makes_no_collective_for_images():
    plan = StepPlan(3, rows=[SeqRows(1, 40, [7, 8, 9], [0, 1, 2], draft=5), SeqRows(2, 11, [1] * 9, [])])
    for images in ({}, {2: SPANS}):          # a follower; rank 0 holding spans this round's chunk does not reach
        comm = CountingComm()
        got = inputs(plan)
        attach_image_rows(plan, got, images, stub(comm))
        assert comm.calls == []
        assert all(i.embeds is None and i.token_type is None for i in got)


def test_unflagged_rows_that_cover_an_image_are_a_plan_error():
    plan = StepPlan(3, rows=[SeqRows(2, 0, list(range(16)), [])])      # [0, 16) covers the first span
    comm = CountingComm()
    with pytest.raises(PlanError, match="rows\\[0\\] \\(seq 2\\).*SeqRows.images"):
        attach_image_rows(plan, inputs(plan), {2: SPANS}, stub(comm))
    assert comm.calls == []


def test_flagged_rows_reach_the_follower_in_one_collective():
    plan = StepPlan(5, rows=[SeqRows(1, 40, [7], [0]), SeqRows(2, 3, [1] * 19, [], images=True),
                             SeqRows(3, 0, [1] * 4, [], images=True)])     # seq 3: flagged, rank 0 has no rows
    leader = CountingComm()
    got0 = inputs(plan)
    attach_image_rows(plan, got0, {2: SPANS}, stub(leader))
    assert len(leader.calls) == 1 and leader.calls[0].shape == (19 + 4, H + 1)
    e, t = chunk_rows(SPANS, 3, 19, H)
    assert torch.equal(got0[1].embeds, e) and torch.equal(got0[1].token_type, t)
    assert got0[0].embeds is None and got0[2].embeds is None and got0[2].token_type is None
    follower = CountingComm(other=lambda k: leader.calls[k])               # the sum: rank 0's part + its zeros
    got1 = inputs(plan)
    attach_image_rows(plan, got1, {}, stub(follower))
    assert len(follower.calls) == 1 and not follower.calls[0].any()
    for a, b in zip(got0, got1):
        assert (a.embeds is None) == (b.embeds is None)
        if a.embeds is not None:
            assert torch.equal(a.embeds, b.embeds) and torch.equal(a.token_type, b.token_type)


def test_the_scheduler_flags_exactly_the_chunks_that_cover_image_positions():
    from dsv41.sched.memory import MemoryBudget, StateCost
    from dsv41.sched.request import Request
    from dsv41.sched.runner import RoundResult
    from dsv41.sched.sampler import Sample, SamplingParams
    from dsv41.sched.scheduler import Scheduler

    class Runner:
        def drop(self, seqs):
            pass

    s = Scheduler(runner=Runner(), budget=MemoryBudget(10**9, StateCost(1000, (), 1, margin=1.0)), prefill_chunk=4)
    prompt = list(range(100, 126))
    r = s.submit(Request(prompt_ids=prompt, params=SamplingParams(temperature=0), max_tokens=3,
                         eos_ids=frozenset({1}), images=SPANS))
    t = s.submit(Request(prompt_ids=prompt[:9], params=SamplingParams(temperature=0), max_tokens=3,
                         eos_ids=frozenset({1})))
    seen = {r.id: [], t.id: []}
    for _ in range(20):
        p = s.plan_round()
        if not p.rows:
            break
        for x in p.rows:
            want = x.seq == r.id and covers_images(SPANS, x.start, len(x.ids))
            assert x.images == want, (x.seq, x.start, len(x.ids))
            seen[x.seq].append(x.images)
        s.commit_round(p, RoundResult(p.round, [(x.seq, Sample(5)) for x in p.rows if x.logits], 0.0))
    assert any(seen[r.id]) and not all(seen[r.id]) and not any(seen[t.id])
