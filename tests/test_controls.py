"""dsv41.sched.controls: thinking budget, loop guard, background priority (pure logic, no model)."""
from __future__ import annotations

import asyncio
import random

import pytest

from dsv41.chat.tokenizer import Tokenizer
from dsv41.sched.controls import (
    THINK_CLOSE_TEXT,
    ControlError,
    ControlledRequest,
    LoopGuard,
    ReasoningControl,
    parse_controls,
    reasoning_control,
    wait_background_turn,
)
from dsv41.sched.request import Phase
from dsv41.sched.sampler import Sample, SamplingParams

END = 128822
CLOSE = [201, END, 271]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.builtin()


def drive(ctl: ReasoningControl, drawn: list[int]) -> list[int]:
    return [ctl.steer(t) for t in drawn]


def test_close_ids_are_the_reference_close(tok):
    assert tok.encode(THINK_CLOSE_TEXT, special=True) == CLOSE
    ctl = reasoning_control(tok, thinking=True, grammar=False, budget=5, loop_guard=False)
    assert ctl.close_ids == CLOSE
    assert reasoning_control(tok, thinking=True, grammar=True, budget=5, loop_guard=True).close_ids == [END]
    assert reasoning_control(tok, thinking=False, grammar=False, budget=5, loop_guard=True) is None
    assert reasoning_control(tok, thinking=True, grammar=False, budget=None, loop_guard=False) is None
    assert reasoning_control(tok, thinking=True, grammar=True, budget=None, loop_guard=True) is None  # off: grammar


@pytest.mark.parametrize("budget", [1, 7, 100])
def test_budget_closes_reasoning_at_the_budget_exactly(budget):
    ctl = ReasoningControl(CLOSE, END, budget=budget)
    drawn = [1000 + i for i in range(budget + 10)]
    out = drive(ctl, drawn)
    assert out[:budget] == drawn[:budget]                # the model's own reasoning, untouched
    assert out[budget:budget + 3] == CLOSE               # then the close, forced
    assert out[budget + 3:] == drawn[budget + 3:]        # then the answer, drawn again
    assert ctl.closed_by == "budget" and not ctl.active and ctl.reasoning == budget


def test_budget_untouched_when_the_model_closes_first():
    ctl = ReasoningControl(CLOSE, END, budget=10)
    drawn = [5, 6, END, 7, 8] + list(range(100, 120))
    assert drive(ctl, drawn) == drawn
    assert ctl.closed_by is None and not ctl.active


def looping(n: int, period: int = 13, prefix: int = 300, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    head = [rng.randrange(1000, 60000) for _ in range(prefix)]
    cycle = [rng.randrange(1000, 60000) for _ in range(period)]
    return head + [cycle[i % period] for i in range(n - prefix)]


def test_loop_guard_closes_a_looping_reply():
    drawn = looping(6000)
    ctl = ReasoningControl(CLOSE, END, loop_guard=True)
    out = drive(ctl, drawn)
    # window 1 is new (novelty 1); windows 2, 3, 4 repeat the cycle: the close follows token 4 * 1024
    at = 4 * 1024
    assert out[:at] == drawn[:at]
    assert out[at:at + 3] == CLOSE
    assert out[at + 3:] == drawn[at + 3:]
    assert ctl.closed_by == "loop_guard"
    assert ctl.guard.novelties[0] == 1.0 and max(ctl.guard.novelties[1:]) < 0.02


def test_loop_guard_never_touches_a_non_looping_reply():
    rng = random.Random(1)
    drawn = [rng.randrange(1000, 60000) for _ in range(8 * 1024)]
    ctl = ReasoningControl(CLOSE, END, loop_guard=True)
    assert drive(ctl, drawn) == drawn
    assert ctl.closed_by is None and min(ctl.guard.novelties) > 0.9


def test_loop_guard_needs_three_low_windows_in_a_row():
    g = LoopGuard(window=16, n=2, strikes=3)
    cyc = [1, 2] * 8
    fresh = list(range(1000, 1016))
    seq = list(range(100, 116)) + cyc + cyc + fresh + cyc + cyc
    assert not any(g.push(t) for t in seq)               # low, fresh, low-ish, low: never three in a row
    # window 2 is new, 3 repeats it, 4 is fresh, 5 has one new gram (1015, 1) of 16, 6 repeats
    assert [round(x, 4) for x in g.novelties] == [1.0, 1.0, 0.0, 1.0, 0.0625, 0.0]
    more = [g.push(t) for t in cyc + cyc]                # windows 7 and 8: the third low window in a row fires
    assert more[-1] and not any(more[:-1])


def test_loop_guard_is_a_function_of_the_tokens():
    drawn = looping(5000, period=97, seed=3)
    a, b = ReasoningControl(CLOSE, END, loop_guard=True), ReasoningControl(CLOSE, END, loop_guard=True)
    assert drive(a, drawn) == [b.steer(t) for t in drawn]


def test_loop_guard_stops_after_the_think_block_closes():
    drawn = [7, 8, END] + looping(6000)
    ctl = ReasoningControl(CLOSE, END, loop_guard=True)
    assert drive(ctl, drawn) == drawn


class RecordingMatcher:
    """Stands in for a grammar matcher: records consume/rollback (the real one is exercised by the live tests)."""

    def __init__(self):
        self.tokens: list[int] = []

    def consume(self, t: int) -> bool:
        self.tokens.append(t)
        return True

    def rollback(self, n: int) -> None:
        del self.tokens[-n:]


def test_controlled_request_commits_forced_tokens_and_fixes_the_matcher():
    async def run():
        m = RecordingMatcher()
        r = ControlledRequest(prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.0), max_tokens=20,
                              matcher=m, control=ReasoningControl([END], END, budget=2))
        for t in [50, 51, 52, 53]:
            m.consume(t)                                 # the runner consumes the drawn token
            assert r.commit(Sample(t)) is None
        return r, m

    r, m = asyncio.run(run())
    assert r.output_ids == [50, 51, END, 53]
    assert m.tokens == [50, 51, END, 53]


def test_parse_controls():
    assert parse_controls({}) == (None, False, False)
    assert parse_controls({}, default_budget=64, default_loop_guard=True) == (64, True, False)
    assert parse_controls({"thinking_budget": 0}, default_budget=64) == (64, False, False)
    assert parse_controls({"thinking_budget": 9, "loop_guard": True, "priority": "background"}) == (9, True, True)
    for body, param in [({"thinking_budget": -1}, "thinking_budget"), ({"thinking_budget": 1.5}, "thinking_budget"),
                        ({"thinking_budget": True}, "thinking_budget"), ({"loop_guard": "yes"}, "loop_guard"),
                        ({"priority": "urgent"}, "priority")]:
        with pytest.raises(ControlError) as e:
            parse_controls(body)
        assert e.value.param == param


class Sched:
    def __init__(self):
        self.waiting = []
        self.running = []


class Run:
    def __init__(self, phase):
        self.phase = phase


def test_background_waits_for_foreground_prompts():
    async def run():
        s = Sched()
        assert 0.14 < await wait_background_turn(s, 0.15, 2.0) < 0.5      # idle: the minimum wait only
        s.running = [Run(Phase.PROMPT)]

        async def later():
            await asyncio.sleep(0.4)
            s.running[0].phase = Phase.DECODE
        t = asyncio.ensure_future(later())
        waited = await wait_background_turn(s, 0.05, 2.0)
        await t
        assert 0.38 < waited < 1.0                       # held while a foreground prompt filled
        s.waiting = [object()]
        assert 0.28 < await wait_background_turn(s, 0.05, 0.3) < 0.6    # capped
    asyncio.run(run())
