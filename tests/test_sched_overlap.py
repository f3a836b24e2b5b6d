"""Overlapped rounds (issue 25): round N+1 planned and queued while N runs, on the tiny-a model through the real
Scheduler + ModelRunner in this process. The replies equal the rounds run one after the other and each request run
alone, with replies that end early (EOS drawn, a stop inside the pipeline), max_tokens, forced reasoning closes and
penalties; and the rounds did overlap."""
import asyncio

import pytest

from dsv41.model.model import Model
from dsv41.sched.controls import ControlledRequest, ReasoningControl
from dsv41.sched.kept import KeptIndex
from dsv41.sched.memory import MemoryBudget, state_cost
from dsv41.sched.request import Request
from dsv41.sched.runner import ModelRunner
from dsv41.sched.sampler import SamplingParams
from dsv41.sched.scheduler import PENDING, Scheduler


@pytest.fixture(scope="module")
def model(shared):
    m = Model.load(shared / "vectors/model/tiny-a/checkpoint")
    m.ckpt = shared / "vectors/model/tiny-a/checkpoint"
    return m


def _cost(model):
    import json
    cfg = json.loads((model.ckpt / "config.json").read_text())
    return state_cost(cfg.get("text_config", cfg))


def run(model, make, *, overlap, burst=True, max_streams=16, kept=None, runner=None):
    async def go():
        sched = Scheduler(runner or ModelRunner(model), MemoryBudget(1 << 40, _cost(model)), max_streams=max_streams,
                          overlap=overlap, kept=kept)
        planned_ahead = []
        plan = sched.plan_round

        def watch():
            planned_ahead.append(sched._inflight is not None)
            return plan()
        sched.plan_round = watch
        sched.start()
        reqs = make()

        async def drain(r):
            async for _ in sched.stream(r):
                pass
        if burst:
            for r in reqs:
                sched.submit(r)
            await asyncio.gather(*[drain(r) for r in reqs])
        else:
            for r in reqs:
                sched.submit(r)
                await drain(r)
        await sched.stop()
        return reqs, sum(planned_ahead)
    return asyncio.run(go())


def _prompts(n, vocab, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, vocab - 1, (4 + (i * 5) % 17,), generator=g).tolist() for i in range(n)]


def _params(i):
    if i % 3 == 0:
        return SamplingParams(temperature=0.0)
    if i % 3 == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=50 + i)
    return SamplingParams(temperature=1.0, seed=70 + i, frequency_penalty=0.5, presence_penalty=0.3,
                          repetition_penalty=1.2, prompt_len=0)


def _ids(reqs):
    return [(list(r.output_ids), r.finish_reason) for r in reqs]


def test_overlapped_equals_serial_and_alone(model):
    prompts = _prompts(12, model.t.vocab_size)

    def plain():
        return [Request(list(p), _params(i), 10 + i % 7, eos_ids=frozenset([1]), ignore_eos=True)
                for i, p in enumerate(prompts)]

    serial, ahead0 = run(model, plain, overlap=False)
    assert ahead0 == 0
    over, ahead = run(model, plain, overlap=True)
    assert _ids(over) == _ids(serial)
    assert ahead > 10                      # rounds were planned while another ran
    alone, _ = run(model, lambda: plain()[:3], overlap=True, burst=False)
    assert _ids(alone) == _ids(serial)[:3]
    assert all(len(r.output_ids) == 10 + i % 7 for i, r in enumerate(over))

    # replies that end early: each one's EOS is a token its serial reply draws mid-way, so it stops there while
    # the round after it is already queued (its row in that round is void)
    stops = {i: serial[i].output_ids[2 + i % 4] for i in range(len(prompts))}

    def stopping():
        return [Request(list(p), _params(i), 10 + i % 7, eos_ids=frozenset([stops[i]]), ignore_eos=False)
                for i, p in enumerate(prompts)]

    serial_stop, _ = run(model, stopping, overlap=False)
    over_stop, _ = run(model, stopping, overlap=True)
    assert _ids(over_stop) == _ids(serial_stop)
    assert sum(r.finish_reason == "stop" for r in over_stop) >= 10
    # the next requests on the same runner after such stops: states freed and sequences fresh
    runner = ModelRunner(model)
    run(model, stopping, overlap=True, runner=runner)
    assert runner.states == {}


def test_forced_closes_are_named_in_the_next_plan(model):
    """A thinking budget forces `close` after N reasoning tokens; the overlapped plan made before the commit that
    forces a token names it (no PENDING): replies equal the serial ones."""
    prompts = _prompts(6, model.t.vocab_size, seed=3)
    close = [5, 6, 7]

    def make():
        return [ControlledRequest(list(p), _params(i), 14 + i, eos_ids=frozenset([1]), ignore_eos=True,
                                  control=ReasoningControl(close, 6, budget=2 + i)) for i, p in enumerate(prompts)]

    serial, _ = run(model, make, overlap=False)
    over, ahead = run(model, make, overlap=True)
    assert _ids(over) == _ids(serial) and ahead > 5
    forced = [i for i, r in enumerate(over) if r.control.closed_by == "budget"]   # the others drew `</think>` first
    assert len(forced) >= 4
    for i in forced:
        assert over[i].output_ids[2 + i:5 + i] == close


def test_kept_state_after_an_early_stop_resumes_exactly(model, tmp_path):
    """A reply that stops while the next round is queued leaves one row too many in its state; the kept snapshot
    takes it back, so the next turn resumed from it equals the same turn computed cold."""
    p = _prompts(1, model.t.vocab_size, seed=5)[0]
    first, _ = run(model, lambda: [Request(list(p), SamplingParams(temperature=0.0), 12, eos_ids=frozenset([1]),
                                           ignore_eos=True)], overlap=False)
    eos = first[0].output_ids[5]
    kept = KeptIndex(1 << 30, _cost(model).bytes_for, model_id="t", user_id=2, assistant_id=3, window=1 << 20,
                     chunk=2048)
    runner = ModelRunner(model)

    def turn(prompt):
        return lambda: [Request(list(prompt), SamplingParams(temperature=0.0), 8, eos_ids=frozenset([eos]))]

    got, _ = run(model, turn(p), overlap=True, kept=kept, runner=runner)
    assert got[0].finish_reason == "stop"
    follow = p + got[0].output_ids + [9, 10, 11]
    warm, _ = run(model, turn(follow), overlap=True, kept=kept, runner=runner)
    assert warm[0].cached_tokens == len(p) + len(got[0].output_ids)   # the overlapped row fed the last token too
    cold, _ = run(model, turn(follow), overlap=False)
    assert _ids(warm) == _ids(cold)


def test_pending_is_not_a_token():
    assert PENDING < 0


def test_drafts_on_overlap_while_the_policy_does_not_propose(model):
    """Random weights: almost no draft is accepted, so the adaptive policy proposes only now and then; the rounds in
    between overlap, a proposing or verifying round is committed first, and the replies equal serial decoding."""
    from dsv41.sched.drafting import RoundCosts
    prompts = _prompts(8, model.t.vocab_size, seed=7)

    def make():
        return [Request(list(p), _params(i), 30, eos_ids=frozenset([1]), ignore_eos=True)
                for i, p in enumerate(prompts)]

    serial, _ = run(model, make, overlap=False)

    async def go():
        sched = Scheduler(ModelRunner(model), MemoryBudget(1 << 40, _cost(model)), max_streams=16, drafts=True,
                          round_costs=RoundCosts([1, 64], [1.0, 1.2]))
        ahead = []
        plan = sched.plan_round

        def watch():
            ahead.append(sched._inflight is not None)
            return plan()
        sched.plan_round = watch
        sched.start()
        reqs = make()
        for r in reqs:
            sched.submit(r)

        async def drain(r):
            async for _ in sched.stream(r):
                pass
        await asyncio.gather(*[drain(r) for r in reqs])
        await sched.stop()
        return reqs, sum(ahead), sched.draft_stats
    drafted, ahead, stats = asyncio.run(go())
    assert _ids(drafted) == _ids(serial)
    assert stats.drafted > 0 and ahead > 5


class _SlowDevice(ModelRunner):
    """A runner whose draws report "not done" for 40 ms, as a GPU round would: the runner then waits for the plan the
    scheduler queues behind the round and prepares it ahead (on the CPU the forward has finished by then, so without
    this the prepare-ahead happens only when the loop was quick enough)."""

    def _draw_all(self, *a):
        import time
        drawn = super()._draw_all(*a)
        t0, done = time.monotonic(), drawn.done
        drawn.done = lambda: time.monotonic() - t0 > 0.04 and done()
        return drawn


def test_rounds_prepared_ahead_under_the_scheduler_equal_serial(model):
    """The scheduler's overlap with the runner's prepare-ahead taking nearly every decode round: replies (greedy,
    sampled, penalties; EOS drawn mid-way while the next round is already prepared) equal the serial ones."""
    prompts = _prompts(10, model.t.vocab_size, seed=11)

    def plain():
        return [Request(list(p), _params(i), 8 + i % 5, eos_ids=frozenset([1]), ignore_eos=True)
                for i, p in enumerate(prompts)]

    serial, _ = run(model, plain, overlap=False)
    runner = _SlowDevice(model)
    ahead, _ = run(model, plain, overlap=True, runner=runner)
    assert _ids(ahead) == _ids(serial)
    assert runner.rounds_ahead >= 5
    stops = {i: serial[i].output_ids[1 + i % 4] for i in range(len(prompts))}

    def stopping():
        return [Request(list(p), _params(i), 8 + i % 5, eos_ids=frozenset([stops[i]]), ignore_eos=False)
                for i, p in enumerate(prompts)]

    serial_stop, _ = run(model, stopping, overlap=False)
    runner = _SlowDevice(model)
    ahead_stop, _ = run(model, stopping, overlap=True, runner=runner)
    assert _ids(ahead_stop) == _ids(serial_stop)
    assert runner.rounds_ahead >= 2 and runner.states == {}
