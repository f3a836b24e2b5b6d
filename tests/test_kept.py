"""Kept prompt states (dsv41/sched/kept.py): the index's bookkeeping, and resume == cold on the real model."""
import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from dsv41.model.model import Model, SeqInput
from dsv41.sched.kept import (MIN_BOUNDARY, ImageSpan, KeptError, KeptIndex, KeptStates, image_digest,
                              namespace, state_key)
from dsv41.sched.memory import state_cost
from dsv41.sched.sampler import SamplingParams, sample_row


def _index(budget=10_000, per_token=10, **kw):
    return KeptIndex(budget, lambda n: 100 + per_token * n, model_id="m", **kw)


# ---- the index ------------------------------------------------------------------------------------------------

def test_longest_prefix_wins_and_leaves_a_row_to_compute():
    ix = _index()
    base = list(range(100, 140))
    for n in (10, 20, 30):
        ix.plan_save(base[:n])
    ix.check()
    assert ix.lookup(base).length == 30
    assert ix.lookup(base[:25] + [7, 7, 7]).length == 20
    assert ix.lookup(base[:30]).length == 20          # 30 would leave no row to compute
    assert ix.lookup(base[:31]).length == 30
    assert ix.lookup([1] + base) is None
    assert ix.lookup(base[:12] + [5] * 20).length == 10
    assert (ix.hits, ix.misses) == (5, 1)
    ix.check()


def test_salts_never_share_a_state():
    ix = _index()
    ids = list(range(200, 240))
    ix.plan_save(ids[:20], salt="alice")
    assert ix.lookup(ids, salt="alice").length == 20     # a hit within the salt
    assert ix.lookup(ids, salt="bob") is None            # a miss across salts
    assert ix.lookup(ids) is None                        # no salt is its own namespace
    ix.plan_save(ids[:20])
    assert ix.lookup(ids).key != ix.lookup(ids, salt="alice").key
    assert namespace("m", None) != namespace("m", "") != namespace("other", "")
    assert state_key(namespace("m", "a"), ids) != state_key(namespace("n", "a"), ids)   # model identity
    ix.check()


def test_already_kept_is_not_saved_twice_and_too_large_is_refused():
    ix = _index(budget=1000)
    ids = list(range(50))
    assert ix.plan_save(ids[:20]) is not None
    assert ix.plan_save(ids[:20]) is None
    assert ix.plan_save(list(range(5000, 5100))) is None      # 1100 bytes > the whole budget
    assert ix.plan_save(ids[:MIN_BOUNDARY - 1]) is None
    ix.check()


def test_eviction_least_recently_used_first_and_longest_first_within_a_conversation():
    ix = _index(budget=100 * 3 + 10 * 90)          # room for three short-ish states
    a = [1] * 5 + list(range(10, 60))
    b = [2] * 5 + list(range(10, 60))
    ix.plan_save(a[:10])
    ix.plan_save(a[:30])         # a's two boundaries: one recency group
    ix.plan_save(b[:20])
    ix.check()
    assert ix.bytes == 100 * 3 + 10 * 60
    ix.lookup(b)                  # b is now the most recent
    # a new 40-token state needs 500: evict from a first, its longest boundary first (a shrink, not a drop)
    _, evicted = ix.plan_save(b[:40])
    assert [e.length for e in evicted] == [30]
    assert ix.lookup(a).length == 10
    assert ix.bytes <= ix.budget
    ix.check()


def test_images_resume_only_up_to_the_first_image_unless_bytes_match():
    ix = _index()
    ids = list(range(300, 340))
    cat = [ImageSpan(12, 20, image_digest(b"cat"))]
    dog = [ImageSpan(12, 20, image_digest(b"dog"))]
    assert ix.plan_save(ids[:15], images=cat) is None         # inside the image span: never kept
    ix.plan_save(ids[:10], images=cat)
    ix.plan_save(ids[:30], images=cat)
    assert ix.lookup(ids, images=cat).length == 30
    assert ix.lookup(ids, images=dog).length == 10             # before the first image only
    assert ix.marks(ids, images=cat) == []                     # no chat markers, no chunk marks
    ix.check()


def test_marks_from_the_chat_prompt():
    ix = _index(user_id=9, assistant_id=8, window=8, chunk=16)
    ids = [0] + [5] * 19 + [9] + [5] * 10 + [8, 4]            # system 0..19, user at 20, assistant at 31, header 4
    assert ix.marks(ids) == [16, 20, 32]


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from(["save", "lookup", "forget"]), hs.integers(0, 3),
                          hs.integers(0, 40), hs.sampled_from([None, "s"])), max_size=60))
def test_random_operations_keep_the_index_consistent(ops):
    ix = _index(budget=1500, per_token=20)
    rng = random.Random(0)
    stems = [[rng.randrange(4) for _ in range(60)] for _ in range(4)]
    kept = {}
    for op, stem, n, salt in ops:
        ids = stems[stem][:n]
        if op == "save":
            r = ix.plan_save(ids, salt)
            if r is not None:
                e, evicted = r
                kept[e.key] = (e.ids, salt)
                for v in evicted:
                    kept.pop(v.key)
        elif op == "lookup":
            e = ix.lookup(ids, salt)
            cands = [len(i) for i, s in kept.values() if s == salt and len(i) < len(ids) and tuple(ids[:len(i)]) == i]
            assert (e.length if e else None) == (max(cands) if cands else None)
        elif kept:
            key = sorted(kept)[n % len(kept)]
            ix.forget(key)
            kept.pop(key)
        ix.check()
        assert set(kept) == {k for k in kept if k in ix} and len(ix) == len(kept)


# ---- the snapshots on the real model --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(shared):
    torch.set_num_threads(1)        # 2 shared cores: more threads only contend (25x slower measured)
    return shared / "vectors/model/tiny-a/checkpoint"


@pytest.fixture(scope="module")
def model(ckpt):
    return Model.load(ckpt)


def _ids(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (n,), generator=g)
    ids[0] = 0
    if n >= 24:
        ids[20:24] = ids[4:8]       # a recurring 4-gram so Engram's longer n-grams hit
    return ids


def _fill(model, st, ids, chunk):
    outs = [model.forward([SeqInput(st, ids[a:a + chunk])])[0] for a in range(0, len(ids), chunk)]
    return torch.cat(outs)


def _decode(model, st, last_row, n, params):
    toks = []
    row = last_row
    for _ in range(n):
        t = sample_row(row, st.length, params).token_id
        toks.append(t)
        row = model.forward([SeqInput(st, torch.tensor([t]))])[0][-1]
    return toks


GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=1234)


def test_resume_equals_cold_at_every_kind_of_boundary(model, ckpt):
    """Window 8, compression ratios 2 and 1: boundaries off the window and the ratio (odd, ring mid-way, past
    candidate blocks), each restored into a fresh state; the rest prefilled; logits, greedy and seeded sampled
    replies and the DSpark draft equal the cold run bit for bit."""
    import json
    ids = _ids(41)
    cold = model.new_state()
    cold_logits = _fill(model, cold, ids, 41)
    draft_cold = model.dspark.draft([(cold, 7)])[0]
    ref = {}
    for params in (GREEDY, SAMPLED):
        st = model.new_state()
        st.restore(cold)
        ref[params] = _decode(model, st, cold_logits[-1], 4, params)
    text = json.loads((ckpt / "config.json").read_text())
    cost = dataclasses.replace(state_cost(text.get("text_config", text)), margin=1.0)
    store = KeptStates()
    boundaries = (1, 7, 8, 9, 13, 16, 23, 40)
    writer = model.new_state()
    done = 0
    for b in boundaries:            # one pass, saving at each boundary on the way (as the scheduler does)
        _fill(model, writer, ids[done:b], 3)
        done = b
        store.save(b.to_bytes(4, "little"), writer)
        assert store._states[b.to_bytes(4, "little")].nbytes() <= cost.bytes_for(b)
    assert store.bytes == sum(s.nbytes() for s in store._states.values())
    for b in boundaries:
        st = model.new_state()
        assert store.restore(b.to_bytes(4, "little"), st) == b
        rest = _fill(model, st, ids[b:], 5)
        assert torch.equal(rest, cold_logits[b:]), b
        if b in (9, 13, 40):
            snap = st.snapshot()
            for params in (GREEDY, SAMPLED):
                st.restore(snap)
                assert _decode(model, st, rest[-1], 4, params) == ref[params], (b, params)
            st.restore(snap)
            d = model.dspark.draft([(st, 7)])[0]
            assert torch.equal(d.tokens, draft_cold.tokens) and torch.equal(d.logits, draft_cold.logits)
    # the snapshot stays usable after its state moved on and was restored from twice
    st = model.new_state()
    store.restore((13).to_bytes(4, "little"), st)
    assert torch.equal(_fill(model, st, ids[13:], 28), cold_logits[13:])
    with pytest.raises(KeptError):
        store.restore(b"nope", st)
    store.drop((13).to_bytes(4, "little"))
    assert store.bytes == sum(s.nbytes() for s in store._states.values())


def test_resume_equals_cold_in_the_release_quirk_mode(ckpt):
    """The quirk's published-keys record is part of the state: a resume at an odd boundary decodes as cold."""
    model = Model.load(ckpt, index_keys="quirk")
    ids = _ids(23, seed=5)
    cold = model.new_state()
    cold_logits = _fill(model, cold, ids, 23)
    want = _decode(model, cold, cold_logits[-1], 3, GREEDY)
    st = model.new_state()
    _fill(model, st, ids[:11], 11)
    store = KeptStates()
    store.save(b"k", st)
    _fill(model, st, ids[11:12], 1)        # the writer moves on; the snapshot does not
    st2 = model.new_state()
    store.restore(b"k", st2)
    rest = _fill(model, st2, ids[11:], 4)
    assert torch.equal(rest, cold_logits[11:])
    assert _decode(model, st2, rest[-1], 3, GREEDY) == want


# ---- the scheduler's use of the index (no model: the test plays the runner) -----------------------------------

def test_scheduler_cuts_at_marks_saves_on_finish_and_resumes():
    from dsv41.comm.plan import DropState, FreeSeq, NewSeq, RestoreState, SaveState
    from dsv41.sched.memory import MemoryBudget, StateCost
    from dsv41.sched.request import Request
    from dsv41.sched.runner import RoundResult
    from dsv41.sched.sampler import Sample
    from dsv41.sched.scheduler import Scheduler

    USER, ASSISTANT = 9, 8
    kept = KeptIndex(10**6, lambda n: 100 + n, model_id="m", user_id=USER, assistant_id=ASSISTANT)
    class Runner:                 # only `drop` is called here (the failed round); plans are answered by hand
        def drop(self, seqs):
            pass

    s = Scheduler(runner=Runner(), budget=MemoryBudget(10**9, StateCost(1000, (), 1, margin=1.0)), prefill_chunk=64,
                  kept=kept)

    def run(r, token=5, rounds=20):
        plans = []
        for _ in range(rounds):
            p = s.plan_round()
            plans.append(p)
            if not p.rows:
                break
            s.commit_round(p, RoundResult(p.round, [(x.seq, Sample(token)) for x in p.rows if x.logits], 0.0))
        return plans

    prompt = [0] + [3] * 15 + [USER] + [4] * 10 + [ASSISTANT, 6]             # user at 16, assistant at 27
    r1 = s.submit(Request(prompt_ids=prompt, params=SamplingParams(temperature=0), max_tokens=3,
                          eos_ids=frozenset({1}), cache_salt="a"))
    plans = run(r1)
    first = plans[0]
    assert [type(o) for o in first.ops] == [NewSeq]
    assert [len(x.ids) for x in first.rows] == [16]                        # cut at the system prefix
    assert [type(o) for o in first.after] == [SaveState]
    assert [len(x.ids) for x in plans[1].rows] == [12] and [type(o) for o in plans[1].after] == [SaveState]
    assert [len(x.ids) for x in plans[2].rows] == [1]                       # the header row, whose logits draw
    assert r1.output_ids == [5, 5, 5] and r1.cached_tokens == 0
    fin = next(p for p in plans if any(isinstance(o, FreeSeq) for o in p.ops))
    assert [type(o) for o in fin.ops] == [SaveState, FreeSeq]               # prompt + reply[:-1] before the free
    assert kept.lookup(prompt + [5, 5, 9], "a").length == len(prompt) + 2
    assert kept.lookup(prompt + [5, 5, 9]) is None
    kept.check()
    # the next turn resumes at prompt + reply[:-1], rows from there
    nxt = prompt + [5, 5, 5, USER, 4, ASSISTANT, 6]
    r2 = s.submit(Request(prompt_ids=nxt, params=SamplingParams(temperature=0), max_tokens=1,
                          eos_ids=frozenset({1}), cache_salt="a"))
    p = s.plan_round()
    assert [type(o) for o in p.ops] == [NewSeq, RestoreState]
    assert r2.cached_tokens == r2.filled == len(prompt) + 2 and p.rows[0].start == len(prompt) + 2
    # another salt starts cold
    r3 = s.submit(Request(prompt_ids=nxt, params=SamplingParams(temperature=0), max_tokens=1,
                          eos_ids=frozenset({1}), cache_salt="b"))
    s.commit_round(p, RoundResult(p.round, [(x.seq, Sample(1)) for x in p.rows if x.logits], 0.0))
    p = s.plan_round()
    assert RestoreState not in [type(o) for o in p.ops] and r3.cached_tokens == 0
    # a failed round forgets the saves it planned and drops their snapshots next round
    saves = [o.key for o in p.ops + p.after if isinstance(o, SaveState)]
    assert saves
    s._fail_round(p, RuntimeError("boom"))
    assert all(k not in kept for k in saves)
    p = s.plan_round()
    assert [o.key for o in p.ops if isinstance(o, DropState)] == saves
    kept.check()
