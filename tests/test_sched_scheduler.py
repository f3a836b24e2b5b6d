"""Scheduler bookkeeping without a model: plans are built from the queues and results are committed by hand (the
test plays the runner's part with chosen tokens), so admission, chunking, memory and cancellation are checked alone.
"""
import pytest

from dsv41.comm.plan import FreeSeq, NewSeq, StepPlan, decode, encode
from dsv41.sched.memory import MemoryBudget, StateCost, state_cost
from dsv41.sched.request import FinishEvent, Phase, Request, StopStrings, TokenEvent
from dsv41.sched.runner import RoundResult
from dsv41.sched.sampler import Sample, SamplingParams
from dsv41.sched.scheduler import QueueFull, Scheduler, ShuttingDown, TooLarge

COST = StateCost(fixed_bytes=1000, per_ratio=((2, 10),), per_token_bytes=1, margin=1.0)


def make(budget=10**9, **kw) -> Scheduler:
    return Scheduler(runner=None, budget=MemoryBudget(budget, COST), **kw)


def req(n_prompt: int, max_tokens: int = 4, **kw) -> Request:
    return Request(prompt_ids=list(range(3, 3 + n_prompt)), params=SamplingParams(), max_tokens=max_tokens,
                   eos_ids=frozenset({1}), **kw)


def answer(plan: StepPlan, token: int = 7) -> RoundResult:
    """Draw `token` for every row whose logits the plan asks for."""
    return RoundResult(plan.round, [(r.seq, Sample(token)) for r in plan.rows if r.logits], 0.0)


def events(r: Request) -> list:
    out = []
    while not r.events.empty():
        out.append(r.events.get_nowait())
    return out


def test_state_cost_from_config_counts_windows_and_compressed_entries():
    tc = {"num_hidden_layers": 4, "num_nextn_predict_layers": 1, "head_dim": 8, "index_head_dim": 4,
          "sliding_window": 2, "compress_ratios": [0, 2, 1, 0, 0], "kv_source_layer_ids": [1, 2],
          "engram_layer_ids": [0]}
    c = state_cost(tc, elem_bytes=4)
    base = c.bytes_for(0)
    # +2 positions: one ratio-2 entry and two ratio-1 entries of (8+4)*4 bytes, plus 2 Engram ids
    assert c.bytes_for(2) - base == int(((1 + 2) * 48 + 2 * 8) * c.margin)
    assert c.max_positions(c.bytes_for(1000)) == 1000


def test_prompt_chunks_interleave_with_decode_rows():
    s = make(prefill_chunk=8)
    short = s.submit(req(3, max_tokens=10))
    p1 = s.plan_round()
    assert [type(o) for o in p1.ops] == [NewSeq]
    assert [(r.seq, r.start, len(r.ids), r.logits) for r in p1.rows] == [(short.id, 0, 3, [2])]
    s.commit_round(p1, answer(p1))
    assert short.phase is Phase.DECODE and short.output_ids == [7]
    long = s.submit(req(20, max_tokens=3))
    seen_decode = 0
    for _ in range(3):                    # 20 rows in chunks of 8: 8, 8, 4; the short reply gets a row each round
        p = s.plan_round()
        kinds = {r.seq: r for r in p.rows}
        assert kinds[short.id].ids == [short.output_ids[-1]] and kinds[short.id].start == short.position - 1
        seen_decode += 1
        assert sum(len(r.ids) for r in p.rows if r.seq == long.id) <= 8
        s.commit_round(p, answer(p))
    assert long.filled == 20 and long.phase is Phase.DECODE and long.output_ids == [7]
    assert seen_decode == 3 and len(short.output_ids) == 4


def test_several_short_prompts_fill_in_one_pass():
    s = make(prefill_chunk=16)
    rs = [s.submit(req(5)) for _ in range(4)]
    p = s.plan_round()
    # 5 + 5 + 5 fit in 16; the fourth gets the 1 row left and continues next round
    assert [len(r.ids) for r in p.rows] == [5, 5, 5, 1]
    assert [r.logits for r in p.rows] == [[4], [4], [4], []]
    s.commit_round(p, answer(p))
    assert [r.phase for r in rs] == [Phase.DECODE] * 3 + [Phase.PROMPT]


def test_streams_bound_and_fifo_admission():
    s = make(max_streams=2)
    rs = [s.submit(req(2, max_tokens=1)) for _ in range(5)]
    p = s.plan_round()
    assert [o.seq for o in p.ops] == [rs[0].id, rs[1].id] and s.n_waiting == 3
    s.commit_round(p, answer(p))          # max_tokens 1: both finish on their first token
    assert all(isinstance(events(r)[-1], FinishEvent) for r in rs[:2])
    p = s.plan_round()
    assert [type(o) for o in p.ops] == [FreeSeq, FreeSeq, NewSeq, NewSeq]
    assert [o.seq for o in p.ops[2:]] == [rs[2].id, rs[3].id]


def test_memory_admission_waits_and_never_overtakes():
    need = COST.bytes_for(2 + 4)
    s = make(budget=2 * need + need // 2)          # room for two such requests, not three
    rs = [s.submit(req(2, max_tokens=4)) for _ in range(3)]
    p = s.plan_round()
    assert len([o for o in p.ops if isinstance(o, NewSeq)]) == 2
    assert s.budget.used == 2 * need
    # a smaller request behind the head does not overtake it
    small = s.submit(req(1, max_tokens=1))
    s.commit_round(p, answer(p))
    p = s.plan_round()
    assert not [o for o in p.ops if isinstance(o, NewSeq)]
    rs[0].cancel()
    p = s.plan_round()
    assert FreeSeq(rs[0].id) in p.ops
    assert [o.seq for o in p.ops if isinstance(o, NewSeq)] == [rs[2].id]
    assert s.budget.used == 2 * need and small.phase is Phase.WAITING


def test_cancel_frees_memory_and_closes_in_the_next_plan():
    s = make()
    a, b = s.submit(req(4, max_tokens=50)), s.submit(req(4, max_tokens=50))
    p = s.plan_round()
    s.commit_round(p, answer(p))
    used = s.budget.used
    s.cancel(a)
    p = s.plan_round()
    assert FreeSeq(a.id) in p.ops and [r.seq for r in p.rows] == [b.id]
    assert used == 2 * COST.bytes_for(54) and s.budget.used == COST.bytes_for(54) and a.reserved_bytes == 0
    assert isinstance(events(a)[-1], FinishEvent) and a.finish_reason == "cancelled"
    # a cancelled waiting request leaves the queue without ever opening a sequence
    w = s.submit(req(4))
    w.cancel()
    p = s.plan_round()
    assert w.finish_reason == "cancelled" and not any(getattr(o, "seq", None) == w.id for o in p.ops)


def test_a_shutdown_cancel_finishes_shutdown_not_cancelled():
    """The drain's cancels are the server's (finish "shutdown": 503), a client's are its own ("cancelled": 499), so
    the metrics tell them apart; a request cancelled by its client first keeps that reason."""
    s = make()
    a, b = s.submit(req(4, max_tokens=50)), s.submit(req(4, max_tokens=50))
    p = s.plan_round()
    s.commit_round(p, answer(p))
    s.cancel(a)                       # the client went away first
    a.cancel("shutdown")
    b.cancel("shutdown")
    w = s.submit(req(4))
    w.cancel("shutdown")
    s.plan_round()
    assert (a.finish_reason, b.finish_reason, w.finish_reason) == ("cancelled", "shutdown", "shutdown")
    assert isinstance(events(b)[-1], FinishEvent) and s.budget.used == 0


def test_finish_reasons_eos_length_ignore_eos():
    s = make()
    a = s.submit(req(2, max_tokens=5))
    b = s.submit(req(2, max_tokens=2, ignore_eos=True))
    p = s.plan_round()
    s.commit_round(p, RoundResult(p.round, [(a.id, Sample(1)), (b.id, Sample(1))], 0.0))
    assert a.finish_reason == "stop" and a.output_ids == [1]
    assert b.finish_reason is None
    p = s.plan_round()
    s.commit_round(p, answer(p, 1))
    assert b.finish_reason == "length" and b.output_ids == [1, 1]


def test_queue_bound_too_large_and_drain():
    s = make(budget=COST.bytes_for(100), max_waiting=2)
    s.submit(req(2))
    s.submit(req(2))
    with pytest.raises(QueueFull):
        s.submit(req(2))
    with pytest.raises(TooLarge):
        make(budget=COST.bytes_for(100)).submit(req(50, max_tokens=60))
    d = make()
    d.begin_drain()
    with pytest.raises(ShuttingDown):
        d.submit(req(2))


def test_plan_is_plain_data_on_the_wire():
    s = make()
    s.submit(req(3))
    p = s.plan_round()
    assert decode(encode(p)) == p


class _Detok:
    def push(self, tid):
        return {7: "ab", 8: "c", 9: "END", 10: "x"}.get(tid, "?")


def test_stop_strings_hold_back_prefixes_and_cut_the_match():
    st = StopStrings(["cEN", "zz"])
    assert st.push("ab") == ("ab", None)
    assert st.push("c") == ("", None)          # could start "cEN"
    assert st.push("E") == ("", None)
    assert st.push("ND") == ("", "cEN")
    st = StopStrings(["zz"])
    assert st.push("az") == ("a", None)
    assert st.push("b") == ("zb", None)
    assert st.flush() == ""
    s = make()
    r = s.submit(req(2, max_tokens=10, stop=["cEN"], detokenizer=_Detok()))
    for tok in (7, 8, 9):
        p = s.plan_round()
        s.commit_round(p, answer(p, tok))
    evs = events(r)
    text = "".join(e.text for e in evs)
    assert text == "ab" and evs[-1].stop_sequence == "cEN" and r.finish_reason == "stop"
    assert [e.token_id for e in evs if isinstance(e, TokenEvent)] == [7, 8, 9]


def test_short_prompt_is_not_stuck_behind_a_long_one():
    s = make(prefill_chunk=16)
    long = s.submit(req(100, max_tokens=2))
    p = s.plan_round()
    s.commit_round(p, answer(p))
    short = s.submit(req(6, max_tokens=2))
    p = s.plan_round()
    rows = {r.seq: len(r.ids) for r in p.rows}
    # the oldest keeps a quarter of the chunk at least, the short prompt fills whole, the rest goes to the oldest
    assert rows == {long.id: 10, short.id: 6}
    s.commit_round(p, answer(p))
    assert short.phase is Phase.DECODE and short.output_ids == [7]
    # a stream of short prompts never starves the oldest: it advances by at least chunk // 4 each round
    for k in range(5):
        s.submit(req(16, max_tokens=1))
        before = long.filled
        p = s.plan_round()
        s.commit_round(p, answer(p))
        assert long.filled - before >= 4


def test_prompt_rows_fit_the_stall_target_while_replies_decode():
    s = make(prefill_chunk=2048, stall_target_s=0.5)
    a = s.submit(req(4, max_tokens=50))
    p = s.plan_round()
    s.commit_round(p, answer(p))
    assert s.prompt_room(decoding=True) == 2048            # nothing measured yet
    s.row_cost_s = 0.005                                    # 5 ms a row: 0.5 s holds 100 rows
    assert s.prompt_room(decoding=True) == 100 and s.prompt_room(decoding=False) == 2048
    s.row_cost_s = 1.0
    assert s.prompt_room(decoding=True) == Scheduler.MIN_PROMPT_ROWS
    s.row_cost_s = 0.005
    long = s.submit(req(1000, max_tokens=2))
    p = s.plan_round()
    assert {r.seq: len(r.ids) for r in p.rows} == {a.id: 1, long.id: 100}
    s.stall_target_s = 0.0                                  # 0: always whole chunks
    assert s.prompt_room(decoding=True) == 2048
    # the estimate follows measured rounds with prompt rows
    s2 = make()
    s2.submit(req(10))
    p = s2.plan_round()
    s2._measure(p, 1.0)
    assert s2.row_cost_s == pytest.approx(0.1)


class _BrokenRunner:
    """A runner whose forward raises (as a model error would); it keeps no states."""

    def __init__(self):
        self.dropped = []

    def execute(self, plan, matchers=None):
        raise RuntimeError("boom")

    def drop(self, seqs):
        self.dropped.extend(seqs)


def test_a_failed_round_fails_its_requests_and_the_loop_goes_on():
    import asyncio

    async def run():
        s = Scheduler(runner=_BrokenRunner(), budget=MemoryBudget(10**9, COST))
        s.start()
        r = s.submit(req(3))
        evs = [ev async for ev in s.stream(r)]
        assert evs[-1].reason == "error" and "boom" in evs[-1].error
        assert s.budget.used == 0 and s.n_running == 0 and s.runner.dropped == [r.id]
        r2 = s.submit(req(2))                  # the loop is still alive
        evs2 = [ev async for ev in s.stream(r2)]
        assert evs2[-1].reason == "error"
        await s.stop()

    asyncio.run(asyncio.wait_for(run(), 30))


class _EchoRunner:
    """A runner that draws token 7 for every row wanting logits."""

    def execute(self, plan, matchers=None):
        return answer(plan)

    def drop(self, seqs):
        pass


def test_the_freed_heap_is_handed_back_once_after_an_idle_pause(monkeypatch):
    import asyncio
    import time

    from dsv41.sched import scheduler as sched_mod

    trims = []
    monkeypatch.setattr(sched_mod, "release_free_heap", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(sched_mod, "IDLE_TRIM_S", 0.3)

    async def reply(s):
        r = s.submit(req(3, max_tokens=2))
        return [ev async for ev in s.stream(r)]

    async def run():
        s = Scheduler(runner=_EchoRunner(), budget=MemoryBudget(10**9, COST))
        s.start()
        await asyncio.sleep(0.5)
        assert trims == []                      # idle from the start: nothing ran, nothing to hand back
        evs = await reply(s)
        assert evs[-1].reason == "length"
        await asyncio.sleep(0.1)
        evs = await reply(s)                    # inside the pause: served at once, no trim in its way
        done = time.monotonic()
        assert evs[-1].reason == "length" and trims == []
        await asyncio.sleep(0.6)
        assert len(trims) == 1 and trims[0] - done >= 0.3 - 0.05
        await asyncio.sleep(0.5)
        assert len(trims) == 1                  # once per busy spell, not once per pause
        await s.stop()

    asyncio.run(asyncio.wait_for(run(), 30))
