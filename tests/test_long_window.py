"""The shared window (docs/long.md): every stream reserves prompt + max_tokens positions of one window; requests that
do not fit wait and are served when room frees (never an out-of-memory), one larger than the window gets 400; the
memory plan's bytes per position follow arch.md §3; a long prompt is cancelled between chunks.

The live part starts the built-in tiny checkpoint with a 200-position window and tiny prompt chunks."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
from test_server import LiveServer

from dsv41.config import release_config_dict
from dsv41.sched.memory import MemoryBudget, StateCost, memory_plan, state_cost, window_that_fits
from dsv41.sched.request import Phase, Request
from dsv41.sched.runner import RoundResult
from dsv41.sched.sampler import Sample, SamplingParams
from dsv41.sched.scheduler import Scheduler, TooLarge

WINDOW = 200


# ------------------------------------------------------------------------------------------------ the plan
def test_plan_bytes_per_position_follow_arch_table():
    tc = release_config_dict()["text_config"]
    cost = state_cost(tc, elem_bytes=4)
    W, streams = 2_097_152, 32
    p = memory_plan(tc, cost, W, streams, 2048, kept_bytes=2 << 30)
    # arch.md §3: sources 2, 8, 14 keep ceil(T/2) entries, source 20 keeps T; 512-d compressed KV and 128-d indexer
    # keys, here in float32 reference storage (+ one rounding entry per stream and source)
    entries = 3 * (W // 2 + streams) + (W + streams)
    assert p.compressed_kv == entries * 512 * 4 and p.index_keys == entries * 128 * 4
    assert (p.compressed_kv + p.index_keys) / W == pytest.approx(2.5 * (512 + 128) * 4, rel=1e-3)  # 6400 B/token
    # window KV: 43 layers (40 + 3 DSpark) x 128 rows x 512 per stream; compressor partials 8 KiB per ratio-2 source
    assert p.window_kv == streams * 43 * 128 * 512 * 4
    assert p.compressor_partials == streams * (3 * 2 * 2 * 2 * 512 * 4 + 2 * 2 * 1 * 512 * 4)
    assert p.engram_history == W * 8 and p.kept_states == 2 << 30
    assert p.total == p.pool + p.fixed + p.kept_states + p.prompt_scratch
    assert any("compressed KV" in line for line in p.lines())
    # lowering the window to a byte limit: the largest window that fits, and the next one does not
    limit = p.total // 2
    w = window_that_fits(lambda n: memory_plan(tc, cost, n, streams, 2048, 2 << 30), limit, W)
    assert memory_plan(tc, cost, w, streams, 2048, 2 << 30).total <= limit
    assert memory_plan(tc, cost, w + 1, streams, 2048, 2 << 30).total > limit


def test_reservations_of_the_plan_never_exceed_its_bytes():
    """The byte budget the server gives (plan.pool + plan.fixed) never binds before the window or the streams."""
    tc = release_config_dict()["text_config"]
    cost = state_cost(tc, elem_bytes=4)
    p = memory_plan(tc, cost, 10_001, 3, 16)
    b = MemoryBudget(p.pool + p.fixed, cost, window=10_001)
    for n in (3_333, 3_333, 3_335):           # odd lengths: each rounds its compressed entries up
        assert b.try_reserve(n) is not None
    assert b.positions_used == 10_001 and b.used <= b.budget and b.usage == 1.0
    assert b.try_reserve(1) is None


# ------------------------------------------------------------------------------------------------ admission
COST = StateCost(fixed_bytes=1000, per_ratio=((2, 10),), per_token_bytes=1, margin=1.0)


def _req(n_prompt: int, max_tokens: int) -> Request:
    return Request(prompt_ids=list(range(3, 3 + n_prompt)), params=SamplingParams(), max_tokens=max_tokens,
                   eos_ids=frozenset({1}), ignore_eos=True)


def _answer(plan):
    return RoundResult(plan.round, [(r.seq, Sample(7)) for r in plan.rows if r.logits], 0.0)


def test_requests_that_do_not_fit_wait_and_run_when_room_frees():
    s = Scheduler(runner=None, budget=MemoryBudget(10**9, COST, window=100), prefill_chunk=64)
    with pytest.raises(TooLarge, match="100 positions all streams share"):
        s.submit(_req(60, 41))
    a, b, c = s.submit(_req(30, 30)), s.submit(_req(20, 20)), s.submit(_req(40, 20))
    p = s.plan_round()
    assert a.phase is Phase.PROMPT and b.phase is Phase.PROMPT and c.phase is Phase.WAITING
    assert s.budget.positions_used == 100
    while not a.finished:       # b ends first; c (60) still does not fit beside a (60): it waits, nothing fails
        assert c.phase is Phase.WAITING and s.budget.positions_used <= 100
        s.commit_round(p, _answer(p))
        p = s.plan_round()
    assert b.finish_reason == a.finish_reason == "length"
    assert c.phase is Phase.PROMPT and s.budget.positions_used == 60      # admitted in the plan after a's end
    while s.running:
        s.commit_round(p, _answer(p))
        p = s.plan_round()
    assert b.finish_reason == c.finish_reason == "length" and s.budget.positions_used == 0 and s.budget.used == 0


# ------------------------------------------------------------------------------------------------ live server
@pytest.fixture(scope="module")
def server():
    with LiveServer("--window", str(WINDOW), "--max-model-len", "1000", "--prefill-chunk", "2", "--max-streams", "4",
                    "--keepalive-s", "0.2", "--prompt-cache-gib", "0", "--name", "tiny",
                    env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def metric(url: str, name: str) -> float:
    m = re.search(rf"^dsv41:{name} (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _ids(i: int, n: int) -> list[int]:
    return [0] + [100 + (i * 37 + j * 11) % 300 for j in range(n - 1)]


async def _complete(http, url, prompt, max_tokens):
    r = await http.post(url + "/v1/completions", timeout=300,
                        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                              "return_token_ids": True})
    return r.status_code, r.json()


def test_plan_printed_and_context_is_the_window(server):
    out = "".join(server.lines)
    assert f"memory plan: {WINDOW:,} positions" in out and "compressed KV" in out and "total" in out
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == WINDOW          # --max-model-len 1000 lowered to the window


def test_requests_wait_for_room_in_the_window_and_equal_solo(server):
    prompts = [_ids(i, 30) for i in range(3)]                    # 30 + 60 = 90 positions: two fit at once, not three

    async def run(bodies):
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*[_complete(http, server.url, p, 60) for p in bodies])

    waited = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            waited.append(metric(server.url, "requests_waiting"))
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    try:
        burst = asyncio.run(run(prompts))
    finally:
        stop.set()
        t.join()
    assert all(code == 200 for code, _ in burst), burst
    assert max(waited) >= 1                                     # the third waited for room ...
    solo = [asyncio.run(run([p]))[0] for p in prompts]
    ids = [b["choices"][0]["token_ids"] for _, b in burst]
    assert all(len(x) == 60 for x in ids) and ids == [b["choices"][0]["token_ids"] for _, b in solo]  # ... exactly
    assert metric(server.url, "kv_cache_usage_ratio") == 0.0


def test_larger_than_the_window_is_400_and_omitted_max_tokens_fits_the_room(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": _ids(5, 30), "max_tokens": WINDOW - 29})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"prompt": _ids(6, WINDOW - 4), "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4


def test_long_prompt_is_cancelled_between_chunks(server):
    """A prompt of many chunks, streamed: keepalives while it fills; the client leaves; the server stops it at the
    next chunk boundary (its rows stop counting) and frees its positions."""
    n = WINDOW - 2
    before = metric(server.url, "prompt_tokens_total")
    saw_keepalive = False
    body = {"prompt": _ids(9, n), "max_tokens": 1, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            assert not line.startswith("data: "), "the prompt filled before the client left"
            if line.startswith(": keepalive"):
                saw_keepalive = True
                break
    assert saw_keepalive
    t0 = time.monotonic()
    while metric(server.url, "requests_running") != 0:
        assert time.monotonic() - t0 < 10, "the cancelled prompt kept its sequence"
        time.sleep(0.05)
    done = metric(server.url, "prompt_tokens_total") - before
    time.sleep(0.5)
    assert metric(server.url, "prompt_tokens_total") - before == done < n     # stopped part-way, and stays stopped
    assert metric(server.url, "kv_cache_usage_ratio") == 0.0
