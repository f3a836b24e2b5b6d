"""Speculative decoding with the DSpark head through the scheduler and runner in this process (docs/drafts.md):
drafted == serial token for token (greedy and seeded at T=0.6 / top-p 0.95, alone and as a 16-stream burst), on
random weights (acceptance near zero) and on a checkpoint whose head agrees with the target (acceptance high),
with forced tokens (thinking budget), stop strings and max_tokens landing inside accepted drafts."""
import asyncio

import pytest
import torch

from dsv41.model.model import Model
from dsv41.sched.controls import ControlledRequest, ReasoningControl
from dsv41.sched.drafting import DraftPolicy, RoundCosts
from dsv41.sched.memory import MemoryBudget, state_cost
from dsv41.sched.request import Request
from dsv41.sched.runner import ModelRunner
from dsv41.sched.sampler import SamplingParams
from dsv41.sched.scheduler import Scheduler
from dsv41.tools import make_tiny

GREEDY = SamplingParams(temperature=0.0)


def seeded(i):
    return SamplingParams(temperature=0.6, top_p=0.95, seed=1000 + i)


@pytest.fixture(scope="module")
def random_model(shared):
    m = Model.load(shared / "vectors/model/tiny-a/checkpoint")
    m.ckpt = shared / "vectors/model/tiny-a/checkpoint"
    return m


@pytest.fixture(scope="module")
def agree_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("agree")
    make_tiny.main(["--out", str(out), "--seed", "0", "--draft-agrees", "--vocab", "2048", "--layers", "7"])
    m = Model.load(out)
    m.ckpt = out
    return m


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, vocab - 1, (4 + (i * 5) % 17,), generator=g).tolist() for i in range(n)]


def run(model, reqs, *, drafts, draft_tokens=0, burst=True, costs=None, max_streams=16):
    """Run the requests (made fresh by `reqs()`) through a Scheduler; returns (requests, scheduler)."""
    async def go():
        sched = Scheduler(ModelRunner(model), MemoryBudget(1 << 40, _cost(model)), max_streams=max_streams,
                          drafts=drafts, draft_tokens=draft_tokens,
                          round_costs=costs or RoundCosts([1, 64], [1.0, 1.2]))
        sched.start()
        made = reqs()
        if burst:
            for r in made:
                sched.submit(r)
            await asyncio.gather(*[_drain(sched, r) for r in made])
        else:
            for r in made:
                sched.submit(r)
                await _drain(sched, r)
        await sched.stop()
        return made, sched
    return asyncio.run(go())


async def _drain(sched, r):
    async for _ in sched.stream(r):
        pass


def _cost(model):
    import json
    cfg = json.loads((model.ckpt / "config.json").read_text())
    return state_cost(cfg.get("text_config", cfg))


def _ids(reqs):
    return [list(r.output_ids) for r in reqs]


def _mixed(prompts, n_tokens):
    def make():
        return [Request(list(p), GREEDY if i % 2 == 0 else seeded(i), n_tokens, eos_ids=frozenset([1]),
                        ignore_eos=True) for i, p in enumerate(prompts)]
    return make


def test_random_weights_drafted_equals_serial(random_model):
    """16 prompts, greedy and seeded, as a burst: every round verifies 5 draft tokens per sequence (fixed length),
    almost none is accepted, and the replies are the serial ones. Cut for CI time: 24 tokens, not 128."""
    prompts = _prompts(16, random_model.t.vocab_size)
    serial, _ = run(random_model, _mixed(prompts, 24), drafts=False)
    drafted, sched = run(random_model, _mixed(prompts, 24), drafts=True, draft_tokens=5)
    assert _ids(drafted) == _ids(serial)
    assert all(len(r.output_ids) == 24 for r in drafted)
    st = sched.draft_stats
    assert st.drafted > 16 * 5 * 10
    assert st.accepted <= 0.2 * st.drafted
    # alone (one stream at a time) == the burst, drafted
    alone, _ = run(random_model, _mixed(prompts[:2], 24), drafts=True, draft_tokens=5, burst=False)
    assert _ids(alone) == _ids(serial)[:2]


def test_agreeing_head_accepts_most_and_equals_serial(agree_model):
    """The --draft-agrees checkpoint: 16 prompts x 128 tokens (greedy and seeded), burst and alone, adaptive draft
    lengths: replies equal serial decoding and most drafts are accepted (several tokens per round)."""
    prompts = _prompts(16, agree_model.t.vocab_size, seed=1)
    serial, _ = run(agree_model, _mixed(prompts, 128), drafts=False)
    drafted, sched = run(agree_model, _mixed(prompts, 128), drafts=True)
    assert _ids(drafted) == _ids(serial)
    st = sched.draft_stats
    assert st.drafted > 0 and st.accepted / st.drafted > 0.8, (st.accepted, st.drafted)
    assert st.tokens / st.rounds > 3.0
    for r in drafted:
        assert r.decode_rounds < 0.4 * len(r.output_ids)
    alone, _ = run(agree_model, _mixed(prompts[:3], 128), drafts=True, burst=False)
    assert _ids(alone) == _ids(serial)[:3]
    # per request: draft off gives the serial path (no drafts verified for it)
    def mixed_opt_out():
        rs = _mixed(prompts[:4], 40)()
        rs[1].draft = False
        return rs
    opt, _ = run(agree_model, mixed_opt_out, drafts=True)
    assert _ids(opt) == [x[:40] for x in _ids(serial)[:4]]
    assert opt[1].drafted == 0 and opt[0].drafted > 0


def test_forced_tokens_stops_and_limits_inside_drafts(agree_model):
    """A thinking budget forces a close in the middle of an accepted draft (the tokens after it and the draft made
    after the bonus are void, the state rolls back next round); max_tokens ends inside a draft; replies == serial."""
    prompts = _prompts(6, agree_model.t.vocab_size, seed=2)
    close = [5, 6, 7]

    def make():
        out = []
        for i, p in enumerate(prompts):
            ctl = ReasoningControl(close, 6, budget=3 + 2 * i)
            out.append(ControlledRequest(list(p), GREEDY if i % 2 else seeded(i), 17 + i, eos_ids=frozenset([1]),
                                         ignore_eos=True, control=ctl))
        return out

    serial, _ = run(agree_model, make, drafts=False)
    drafted, sched = run(agree_model, make, drafts=True)
    assert _ids(drafted) == _ids(serial)
    for r, i in zip(drafted, range(len(prompts))):
        b = 3 + 2 * i
        assert r.output_ids[b:b + 3] == close
        assert len(r.output_ids) == 17 + i
    assert sched.draft_stats.accepted > 0


def test_policy_shortens_drafts_with_more_streams():
    costs = RoundCosts([1, 16, 32, 64], [0.10, 0.12, 0.20, 0.40])
    pol = DraftPolicy(costs, round_rows=64)
    conf = [3.0, 2.0, 1.0, 0.0, -1.0]
    one = pol.lengths(1, 1, {0: (conf, 5)})
    many = pol.lengths(32, 32, {i: (conf, 5) for i in range(32)})
    assert one[0] >= 3
    assert sum(many.values()) <= 64 - 32
    assert max(many.values()) < one[0]
    assert pol.lengths(64, 64, {0: (conf, 5)}) == {0: 0}        # a full round takes no drafts
    fixed = DraftPolicy(costs, round_rows=10, fixed=5)
    assert fixed.lengths(4, 4, {0: (conf, 5), 1: (conf, 2)}) == {0: 5, 1: 1}


def test_policy_calibrates_by_acceptance():
    """A head that promises acceptance it does not deliver gets no rows; then proposals only every 8th round, one
    token deep, so the estimate can recover."""
    pol = DraftPolicy(RoundCosts([1, 64], [0.10, 0.12]), round_rows=64)
    conf = [4.0] * 5
    assert pol.lengths(2, 2, {0: (conf, 5), 1: (conf, 5)}) == {0: 5, 1: 5}
    pol.record(pol.expected_accepted(conf, 5) * 20, 0)
    assert pol.scale < 0.1
    assert pol.lengths(2, 2, {0: (conf, 5), 1: (conf, 5)}) == {0: 1, 1: 1}
    pol.record_pass(0.05, 1)                                # the DSpark pass: 50 ms per sequence
    pol.verified = 100                                      # none of 100 accepted: not worth a pass
    assert not pol.proposing(9, 2, 2) and pol.proposing(16, 2, 2)
    pol.record(0.0, 95, 0)                                  # 95 of 100 accepted after all
    assert pol.scale > 1 and pol.proposing(9, 2, 2)
    pol.record_pass(10.0, 1)                                # a pass dearer than any gain
    assert not pol.proposing(9, 2, 2)
