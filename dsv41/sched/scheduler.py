"""The scheduler: continuous batching on the event loop.

One task (`run`) loops over rounds. Each round:
1. `plan_round` (on the loop, pure bookkeeping): drop cancelled requests (their memory is released and their state
   closed in this very plan), admit waiting requests in arrival order while a stream is free and their state fits the
   memory budget, give every decoding sequence one row, then fill prompt rows up to `prefill_chunk` (a long prompt
   takes the whole chunk and goes on next round; short ones share it);
2. the runner executes the plan in a worker thread (one batched Model.forward + sampling) while the loop keeps
   serving sockets and keepalives;
3. `commit_round` appends the drawn tokens to their requests, which emit events; finished requests release their
   memory and are closed in the next plan.

Every round carries all decode rows, so a running reply waits at most one prompt chunk between its tokens.

Overlap (issue 25; SGLang's overlap scheduler, vLLM's async scheduling): round N+1 is planned on the loop and queued
to the round thread while round N runs, and round N is committed while N+1 runs, so the round thread goes from one
forward to the next without waiting for the event loop (its HTTP/SSE work, commits, planning). A decode row of round N+1 cannot
name the token round N draws: it carries PENDING, which the round thread replaces by round N's draw just before
N+1 runs (before a tensor-parallel plan is sent). What a commit decides is known one round late, so:
- a reply that ends at round N (a stop, EOS, a grammar error) still has a row in N+1, whose draw is thrown away;
  its state then holds the reply's last token too (`_fed` counts rows fed at plan time): a kept state keeps the
  whole reply instead of all but its last token (an unmarked row cannot be taken back), and FreeSeq drops it;
- max_tokens is known: a reply whose last token round N draws gets no row in N+1;
- a token forced by a reasoning control is known when N+1 is planned (the control decided it at N-1's commit): the
  row names it;
- a round whose rows propose drafts or verify them is committed before the next is planned (the proposals and the
  accepted count decide the next rows), and a proposal older than the round in flight is dropped; so with drafts
  on, rounds overlap while the draft policy does not propose;
- rounds are not overlapped while a constrained request's reasoning control is active (a forced token rewinds its
  grammar matcher on the loop, which the round thread reads for masks).
The replies are the same bytes overlapped or not: every row computes what it would have (row-invariant forward,
batch-invariant sampler); only which round a request is admitted in or a prompt is cut at may move.

Speculative decoding (docs/drafts.md): a decoding sequence's row may carry the draft the DSpark head proposed last
round, cut to what its grammar allows and to the length `drafting.DraftPolicy` picks; the runner verifies it and
returns the accepted tokens plus the bonus token, which `commit_round` commits one by one exactly as serial decoding
would (stops, max_tokens, reasoning controls, grammar). Where a commit ends early (a stop, a forced token) the
state holds rows past the reply; the next plan takes them back (`Rollback`) before anything else runs on it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from dsv41.comm.plan import (PENDING, DropState, FreeSeq, NewSeq, RestoreState, Rollback, SaveState, SeqRows,
                             StepPlan)
from dsv41.sched.drafting import MEASURE_ROWS, DraftPolicy, DraftStats, RoundCosts
from dsv41.sched.host import IDLE_TRIM_S, name_os_thread, release_free_heap
from dsv41.sched.images import covers_images
from dsv41.sched.kept import ImageSpan
from dsv41.sched.memory import MemoryBudget
from dsv41.sched.request import FinishEvent, Phase, Request, TokenEvent
from dsv41.sched.runner import RoundResult, encode_params

log = logging.getLogger("dsv41.sched")


class SchedulerError(Exception):
    """Base of the errors `submit` raises; the API maps each to a status code."""


class QueueFull(SchedulerError):
    """The waiting queue is at its bound (HTTP 503)."""


class ShuttingDown(SchedulerError):
    """The server is draining (HTTP 503)."""


class TooLarge(SchedulerError):
    """The request's state can never fit the memory budget (HTTP 400)."""


class Scheduler:
    def __init__(self, runner, budget: MemoryBudget, *, max_streams: int = 32, max_waiting: int = 1024,
                 prefill_chunk: int = 2048, stall_target_s: float = 1.0, metrics=None, kept=None,
                 drafts: bool = False, round_rows: int = 64, draft_tokens: int = 0,
                 round_costs: RoundCosts | None = None, overlap: bool = True):
        self.runner = runner
        self.overlap = overlap                    # plan round N+1 while round N runs (module docstring)
        self.budget = budget
        self.max_streams = max_streams
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.stall_target_s = stall_target_s
        self.row_cost_s = 0.0                   # running estimate of a round's seconds per row (0: none measured yet)
        self.metrics = metrics
        self.kept = kept                          # dsv41.sched.kept.KeptIndex, or None: no kept prompt states
        self._to_keep: list[Request] = []         # finished replies whose prompt + reply state is to be kept
        self._marks: dict[int, list[int]] = {}    # per filling sequence: boundaries still to keep, ascending
        self._drop_keys: list[bytes] = []         # kept snapshots to drop (their save may not have happened)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []          # admitted, in admission order
        self._to_close: list[int] = []
        self._round = 0
        self._wake = asyncio.Event()
        self._draining = False
        self._stopped = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv41-round",
                                            initializer=name_os_thread)
        self._task: asyncio.Task | None = None
        self._prompt_rows: dict[int, int] = {}    # the last planned round's prompt rows per sequence
        self._plan_has_decode = False
        self._planned: dict[int, list] = {}      # round -> [prompt rows, decode rows?, advanced?] till its commit
        self._inflight: tuple | None = None       # (plan, future, submit time) of the round running, not committed
        self._last_result_t = 0.0
        self._drawn: dict[int, int] = {}          # seq -> its last drawn token (round thread only: resolves PENDING)
        self._ahead: set[int] = set()             # sequences whose latest row was planned ahead (unmarked, PENDING)
        self._trim_when_idle = False              # rounds ran since the loop last went idle
        # figures for /metrics and /health
        self.rounds_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.worst_round_s = 0.0             # longest round that carried decode rows: the worst stall of a reply
        self.last_round_s = 0.0
        # speculative decoding (docs/drafts.md): on when asked and the model has a DSpark head whose verification
        # is exact (the release's "quirk" index keys make a chunk differ from serial decoding, so not there)
        model = getattr(runner, "model", None)
        self.block_size = 0
        if drafts and getattr(model, "dspark", None) is not None and \
                getattr(model, "index_keys", "intended") == "intended":
            self.block_size = int(model.t.dspark_block_size)
        self.round_rows = round_rows
        self.policy = DraftPolicy(round_costs or RoundCosts(), round_rows, draft_tokens) if self.block_size else None
        self._costs_measured = round_costs is not None or draft_tokens > 0
        self.draft_stats = DraftStats()
        self._drafts: dict[int, tuple[list[int], list[float]]] = {}   # seq -> the draft proposed for its next row
        self._fed: dict[int, int] = {}            # seq -> tokens its state holds (may run past the reply: Rollback)
        self._expect: dict[int, float] = {}       # seq -> accepted drafts its confidence expected this round
        self._propose_now = False                 # this round's sequences propose drafts (DraftPolicy.proposing)

    # --- API side ------------------------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request (non-blocking). Raises QueueFull / ShuttingDown / TooLarge."""
        if self._draining or self._stopped:
            raise ShuttingDown("the server is shutting down; retry on another instance")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull("the engine is busy; retry shortly")
        if not self.budget.fits_ever(req.prompt_len + req.max_tokens):
            n = req.prompt_len + req.max_tokens
            room = f"the {self.budget.window} positions all streams share" if self.budget.window and \
                n > self.budget.window else f"the server's state budget of {self.budget.budget} bytes"
            raise TooLarge(f"prompt + max_tokens = {n} positions do not fit {room}; lower max_tokens or shorten "
                           f"the prompt")
        self.waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        """Drop a request at the next round boundary (client disconnected)."""
        if not req.finished:
            req.cancel()
            self._wake.set()

    def stream(self, req: Request, idle_s: float | None = None, idle=None):
        """Async iterator over a submitted request's events, ending with its FinishEvent (Request.stream)."""
        return req.stream(idle_s, idle)

    @property
    def n_running(self) -> int:
        return len(self.running)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    # --- life cycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="dsv41-scheduler")

    def begin_drain(self) -> None:
        """Stop admitting new requests; queued and running ones go on."""
        self._draining = True
        self._wake.set()

    async def drain(self, grace_s: float) -> None:
        """Stop admitting, wait up to grace_s for all requests to finish, then cancel the rest and stop."""
        self.begin_drain()
        deadline = time.monotonic() + grace_s
        while (self.running or self.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for r in list(self.waiting) + list(self.running):
            r.cancel("shutdown")
        self._wake.set()
        while self.running or self.waiting:
            await asyncio.sleep(0.01)
        await self.stop()

    async def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=30)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- the round loop ------------------------------------------------------------------------------------------
    async def run(self) -> None:
        if self.policy is not None and not self._costs_measured:
            try:
                costs = await asyncio.get_running_loop().run_in_executor(self._executor, self._measure_costs)
                self.policy.costs = costs
                log.info("round cost table (rows, seconds): %s",
                         ", ".join(f"{n}: {t:.4f}" for n, t in costs.table()))
            except Exception:  # noqa: BLE001 - without a table drafts still work, with a flat cost guess
                log.exception("measuring the round cost table failed")
            self._costs_measured = True
        while True:
            try:
                if not await self._one_round():
                    return
            except Exception as e:  # noqa: BLE001 - a bug in one round must not leave every request hanging
                log.exception("scheduler round failed; failing the running requests")
                await self._quiesce()
                self._fail_all(e)
                await asyncio.sleep(0.05)      # a failure that repeats must not spin the loop

    async def _one_round(self) -> bool:
        """Plan and queue one round, then commit the round queued before it (or wait for work). False once stopped.
        Without overlap a round is committed before the next is planned."""
        loop = asyncio.get_running_loop()
        if self._inflight is not None and not self._can_overlap():
            await self._settle()
        plan = self.plan_round()
        if not plan.rows:
            self._planned.pop(plan.round, None)
            running = self._inflight is not None
            if running:                         # the round in flight first: its commit may make work
                await self._settle()
            if plan.ops:                        # only frees: still tell the runner
                await loop.run_in_executor(self._executor, self._execute, plan, None, None)
            if running:
                return True
            if self._stopped:
                return False
            self._wake.clear()
            if not self._work_pending():
                if self._trim_when_idle:
                    # idle for a while after a busy spell: give the heap it freed back (a trim takes up to ~0.1 s,
                    # so not at every pause between requests; one that comes meanwhile is planned right after)
                    try:
                        await asyncio.wait_for(self._wake.wait(), IDLE_TRIM_S)
                        return True
                    except asyncio.TimeoutError:
                        self._trim_when_idle = False
                        await loop.run_in_executor(self._executor, release_free_heap)
                await self._wake.wait()
            return True
        self._trim_when_idle = True
        self._read_ahead()
        matchers = {r.id: r.matcher for r in self.running if r.matcher is not None}
        images = {r.id: r.images for r in self.running if r.images and r.id in self._prompt_rows}
        fut = loop.run_in_executor(self._executor, self._execute, plan, matchers or None, images or None)
        upcoming = getattr(self.runner, "upcoming", None)
        if self._inflight is not None and upcoming is not None:
            upcoming(plan)          # queued behind a running round: the runner may prepare its host side early
        self._advance(plan)
        earlier, self._inflight = self._inflight, (plan, fut, time.perf_counter())
        if earlier is not None:
            await self._settle(earlier)
        if not self._can_overlap():
            await self._settle()
        return True

    def _execute(self, plan: StepPlan, matchers: dict | None, images: dict | None) -> RoundResult:
        """The round thread's side of a round: PENDING ids become the tokens the round before drew, then the runner
        runs the plan (on several ranks the resolved plan is what is sent)."""
        for op in plan.ops:
            if isinstance(op, FreeSeq):
                self._drawn.pop(op.seq, None)
        for r in plan.rows:
            if r.ids[0] == PENDING:
                # a reply that ended at the round before (no draw: a grammar error) has a row whose draw is void
                r.ids[0] = self._drawn.get(r.seq, 0)
        extra = (images,) if images else ()        # runners without image rows take (plan, matchers)
        result = self.runner.execute(plan, matchers, *extra)
        for seq, sample in result.samples:
            self._drawn[seq] = sample.token_id
        return result

    async def _settle(self, entry: tuple | None = None) -> None:
        """Wait for a queued round (default: the one in flight) and commit it; a failed forward fails its requests
        (and, overlapped, the round queued behind it, which ran on the same states)."""
        if entry is None:
            entry, self._inflight = self._inflight, None
        plan, fut, submitted = entry
        try:
            result = await fut
        except Exception as e:  # noqa: BLE001 - a failed forward fails its requests, not the server
            log.exception("round %d failed", plan.round)
            later, self._inflight = self._inflight, None
            if later is not None:
                try:
                    await later[1]
                except Exception:  # noqa: BLE001 - it fails with this one either way
                    log.exception("round %d failed", later[0].round)
            self._fail_round(plan, e, *([later[0]] if later is not None else []))
            return
        now = time.perf_counter()
        self.last_round_s = now - max(submitted, self._last_result_t)
        self._last_result_t = now
        prompt_rows, has_decode, _ = self._planned.get(plan.round, ({}, False, False))
        self._measure(plan, self.last_round_s, prompt_rows)
        if has_decode:
            self.worst_round_s = max(self.worst_round_s, self.last_round_s)
        self.commit_round(plan, result)

    async def _quiesce(self) -> None:
        """No round left running (before the runner's tables are touched from the loop)."""
        entry, self._inflight = self._inflight, None
        if entry is not None:
            try:
                await entry[1]
            except Exception:  # noqa: BLE001 - its requests are failed by the caller
                log.exception("round %d failed", entry[0].round)

    def _can_overlap(self) -> bool:
        """Whether the next round may be planned before the running one is committed (module docstring)."""
        if not self.overlap:
            return False
        if self._inflight is not None and any(r.draft or len(r.logits) > 1 for r in self._inflight[0].rows):
            return False        # its proposals or its accepted drafts decide the next rows
        for r in self.running:
            ctl = getattr(r, "control", None)
            if r.matcher is not None and ctl is not None and ctl.active:
                return False
        return True

    def _read_ahead(self) -> None:
        """Each filling prompt's next chunk: its Engram rows are read while this round runs (hash ids depend only on
        token ids). A guess longer than the next cut costs only reads; values never change."""
        ahead = getattr(self.runner, "read_ahead", None)
        if ahead is None:
            return
        hints = []
        for r in self.running:
            n = self._prompt_rows.get(r.id)
            end = r.filled + (n or 0)
            if n and end < r.prompt_len:
                hints.append((r.prompt_ids[max(0, end - 3):end], end, r.prompt_ids[end:end + self.prefill_chunk]))
        if hints:
            ahead(hints)

    SCRATCH_SEQ = (1 << 48) - 1                     # a sequence id no request gets (ids count from 1)

    def _measure_costs(self) -> RoundCosts:
        """The round cost table: one forward per row count on a scratch sequence, through the runner's plans (so on
        several ranks every rank runs them). Runs in the round thread before the first round."""
        from dsv41.sched.sampler import SamplingParams
        seq, pos = self.SCRATCH_SEQ, 0
        self._round += 1
        self.runner.execute(StepPlan(self._round, ops=[NewSeq(seq, encode_params(SamplingParams(temperature=0)))]))

        def run_rows(n: int) -> None:
            nonlocal pos
            self._round += 1
            self.runner.execute(StepPlan(self._round, rows=[SeqRows(seq, pos, [100 + i % 50 for i in range(n)],
                                                                    [n - 1])]))
            pos += n

        try:
            rows = [n for n in MEASURE_ROWS if n <= max(self.round_rows, 1)]
            return RoundCosts.measure(run_rows, rows=rows, repeat=1)
        finally:
            self._round += 1
            self.runner.execute(StepPlan(self._round, ops=[FreeSeq(seq)]))

    def _drafting(self, req: Request) -> bool:
        return self.policy is not None and req.draft

    def _proposing(self, req: Request) -> bool:
        return self._drafting(req) and self._propose_now

    def _fail_all(self, err: Exception) -> None:
        """Drop every running sequence (their states may be out of step with the bookkeeping) and fail them."""
        self.runner.drop([r.id for r in self.running])
        for req in list(self.running):
            self._finish(req, FinishEvent("error", error=f"the engine failed: {type(err).__name__}: {err}"))
        self._to_close = []

    def _work_pending(self) -> bool:
        return any(r.cancelled for r in self.waiting) or any(r.cancelled for r in self.running) or (
            bool(self.waiting) and len(self.running) < self.max_streams and self._head_fits())

    def _head_fits(self) -> bool:
        head = self.waiting[0]
        return self.budget.fits_now(head.prompt_len + head.max_tokens)

    def plan_round(self) -> StepPlan:
        """Build the next round's plan from the queues (no I/O; mutates bookkeeping only).

        ops: FreeSeq for every sequence finished or cancelled since the last plan, NewSeq for each admitted one;
        rows: one decode row per decoding sequence (logits of its row wanted), then prompt chunks (logits wanted only
        on a prompt's last row, whose draw is the reply's first token)."""
        self._round += 1
        # cancelled requests: finish them, release memory, close their states in this plan
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            self._finish(r, FinishEvent(_cancel_reason(r)), admitted=False)
        for r in [r for r in self.running if r.cancelled]:
            self._finish(r, FinishEvent(_cancel_reason(r)))
        close, self._to_close = self._to_close, []
        kept_ops = self._kept_finished()
        # admission: arrival order; the head waits if its state does not fit yet (no overtaking: no starvation)
        opened = []
        while self.waiting and len(self.running) < self.max_streams:
            head = self.waiting[0]
            got = self.budget.try_reserve(head.prompt_len + head.max_tokens)
            if got is None:
                break
            self.waiting.popleft()
            head.reserved_bytes = got
            head.phase = Phase.PROMPT
            head.admit_time = time.monotonic()
            self.running.append(head)
            opened.append(NewSeq(head.id, encode_params(head.params)))
            opened += self._kept_resume(head)
        rows = []
        after = []
        self._prompt_rows = {}
        decoding = [r for r in self.running if r.phase is Phase.DECODE]
        # sequences whose token the round in flight draws (overlap): their rows come one position later
        pending = {r.seq for r in self._inflight[0].rows if r.logits} if self._inflight is not None else set()
        takeback = self._takebacks(decoding, pending)
        room = self.prompt_room(decoding=bool(decoding))
        shares = self._prompt_shares(room)
        self._propose_now = self.policy is not None and self.policy.proposing(
            self._round, max(1, len(decoding)), len(decoding) + sum(n for _, n in shares), self.block_size)
        for r in decoding:
            if r.id in pending:                 # a proposal older than the round in flight: past its positions
                self._drafts.pop(r.id, None)
        lengths = self._draft_lengths([r for r in decoding if r.id not in pending], sum(n for _, n in shares))
        for r in decoding:
            d = lengths.get(r.id, [])
            ahead = int(r.id in pending)
            left = r.max_tokens - len(r.output_ids) - ahead   # tokens this reply may still add, this round included
            if left <= 0:                                     # its last token is being drawn now
                continue
            if ahead:
                ctl = getattr(r, "control", None)
                tok = ctl.forcing[0] if ctl is not None and ctl.forcing else PENDING
            else:
                tok = r.output_ids[-1]
            rows.append(SeqRows(r.id, r.position + ahead - 1, [tok] + d, list(range(len(d) + 1)),
                                draft=self.block_size if self._proposing(r) and left - 1 - len(d) >= 2 else 0))
            self._fed[r.id] = rows[-1].start + len(rows[-1].ids)
            if ahead:
                self._ahead.add(r.id)
            else:
                self._ahead.discard(r.id)
        for r, n in shares:
            n, saves = self._kept_cut(r, n)
            after += saves
            last = r.filled + n == r.prompt_len
            ahead = self.block_size if last and self._proposing(r) and r.max_tokens >= 3 else 0
            rows.append(SeqRows(r.id, r.filled, r.prompt_ids[r.filled:r.filled + n], [n - 1] if last else [],
                                draft=ahead, images=covers_images(r.images, r.filled, n)))
            self._prompt_rows[r.id] = n
            if last:
                self._fed[r.id] = r.prompt_len
        ops = kept_ops + [FreeSeq(s) for s in close] + opened + takeback
        self._plan_has_decode = any(r.seq not in self._prompt_rows for r in rows)
        self._planned[self._round] = [self._prompt_rows, self._plan_has_decode, False]
        return StepPlan(self._round, ops=ops, rows=rows, after=after)

    # --- drafts (docs/drafts.md) -----------------------------------------------------------------------------------
    def _takebacks(self, decoding: list[Request], pending: set[int]) -> list:
        """Rollback ops for states that hold rows past their reply (a commit that ended early last round). `pending`:
        sequences whose next token the round in flight draws (their state will then hold one more row)."""
        ops = []
        for r in decoding:
            fed = r.position - 1 + int(r.id in pending)
            extra = self._fed.get(r.id, fed) - fed
            if extra > 0:
                ops.append(Rollback(r.id, extra))
            self._fed[r.id] = fed
        return ops

    def _draft_lengths(self, decoding: list[Request], prompt_rows: int) -> dict[int, list[int]]:
        """Each decoding sequence's draft tokens to verify this round: last round's proposal, cut to what the
        grammar allows and to the reply's room, at the length the policy picks."""
        if self.policy is None:
            return {}
        cands, toks = {}, {}
        for r in decoding:
            got = self._drafts.pop(r.id, None)
            if got is None or not self._drafting(r):
                continue
            ctl = getattr(r, "control", None)
            if ctl is not None and ctl.forcing:          # the next token is forced: a draft cannot be used
                continue
            d, conf = got
            d = d[:max(0, r.max_tokens - len(r.output_ids) - 1)]
            if r.matcher is not None and d:
                d = r.matcher.cut_draft(d)
            if d:
                cands[r.id] = (conf, len(d))
                toks[r.id] = d
        if not cands:
            return {}
        n = self.policy.lengths(len(decoding) + prompt_rows, len(decoding), cands)
        for s, k in n.items():
            if k > 0:
                self._expect[s] = self.policy.expected_accepted(cands[s][0], k)
        return {s: toks[s][:k] for s, k in n.items() if k > 0}

    # --- kept prompt states (dsv41/sched/kept.py) -----------------------------------------------------------------
    def _kept_save(self, seq: int, ids: list[int], salt: str | None, images: list = ()) -> list:
        """Ops that keep sequence `seq`'s state after `ids` (drops of the states evicted for it first); `images`:
        the ImageSpans of the prompt (a boundary inside one is not kept; the key holds the image digests)."""
        got = self.kept.plan_save(ids, salt, images)
        if got is None:
            return []
        e, evicted = got
        return [DropState(v.key) for v in evicted] + [SaveState(seq, e.key)]

    def _kept_finished(self) -> list:
        """Before finished sequences are freed: drops still owed, then keep each finished reply's prompt + reply
        (all but the last drawn token, which was never fed): the next turn's prompt starts with it. Overlapped, the
        round queued after the last token may have fed it (an unmarked row, which cannot be taken back): then the
        whole reply is kept."""
        ops: list = [DropState(k) for k in self._drop_keys]
        self._drop_keys = []
        keep, self._to_keep = self._to_keep, []
        if self.kept is not None:
            for r in keep:
                ids = r.prompt_ids + r.output_ids[:-1]
                extra = self._fed.pop(r.id, 0) - (r.position - 1)
                if extra == 1 and r.id in self._ahead:   # the overlapped row after its last token
                    ids = r.prompt_ids + r.output_ids
                elif extra > 0:                  # the state ran past the reply's end (drafts): take those rows back
                    ops.append(Rollback(r.id, extra))
                ops += self._kept_save(r.id, ids, r.cache_salt, _image_spans(r))
                self._ahead.discard(r.id)
        return ops

    def _kept_resume(self, req: Request) -> list:
        """At admission: resume from the longest kept boundary of the prompt, and note the boundaries to keep."""
        if self.kept is None:
            return []
        ops = []
        spans = _image_spans(req)
        e = self.kept.lookup(req.prompt_ids, req.cache_salt, spans)
        if e is not None:
            req.filled = req.cached_tokens = e.length
            ops.append(RestoreState(req.id, e.key))
        self._marks[req.id] = [m for m in self.kept.marks(req.prompt_ids, spans) if m > req.filled]
        return ops

    def _kept_cut(self, req: Request, n: int) -> tuple[int, list]:
        """End this round's prompt chunk at the next boundary to keep (chunking never changes results) and keep
        the state there after the forward."""
        marks = self._marks.get(req.id)
        if not marks:
            return n, []
        m = marks[0]
        if req.filled + n < m:
            return n, []
        marks.pop(0)
        return m - req.filled, self._kept_save(req.id, req.prompt_ids[:m], req.cache_salt, _image_spans(req))

    MIN_PROMPT_ROWS = 16

    def prompt_room(self, decoding: bool) -> int:
        """Prompt rows this round may carry: the chunk; while replies are decoding, also no more rows than fit the
        stall target at the measured seconds per row (at least MIN_PROMPT_ROWS), so a running reply waits about
        stall_target_s between tokens however long the prompts behind it are. Only where prompts are cut
        changes, never what they compute (Exactness)."""
        room = self.prefill_chunk
        if decoding and self.stall_target_s > 0 and self.row_cost_s > 0:
            room = min(room, max(self.MIN_PROMPT_ROWS, int(self.stall_target_s / self.row_cost_s)))
        return room

    def _measure(self, plan: StepPlan, seconds: float, prompt_rows: dict[int, int] | None = None) -> None:
        """Fold a round's seconds per row into row_cost_s (rounds with prompt rows only: they set the stall).
        prompt_rows: the plan's (default: the last planned round's)."""
        if not (self._prompt_rows if prompt_rows is None else prompt_rows):
            return
        per_row = seconds / max(1, plan.n_rows)
        self.row_cost_s = per_row if self.row_cost_s == 0 else 0.7 * self.row_cost_s + 0.3 * per_row

    def _prompt_shares(self, room: int) -> list[tuple[Request, int]]:
        """How this round's prompt rows are shared: the oldest filling prompt first gets up to a quarter of the
        chunk (so it always advances), then prompts take what they still need, fewest remaining rows first (a short
        request behind a long prompt gets its first token after one round, not after the whole long prompt), then
        any room left goes back to the oldest. How a prompt is cut never changes its result (Exactness)."""
        filling = [r for r in self.running if r.phase is Phase.PROMPT]
        if not filling:
            return []
        share = {r.id: 0 for r in filling}

        def give(r: Request, most: int) -> None:
            nonlocal room
            n = min(r.prompt_len - r.filled - share[r.id], most, room)
            share[r.id] += n
            room -= n

        oldest = filling[0]
        give(oldest, max(1, room // 4))
        for r in sorted(filling, key=lambda r: r.prompt_len - r.filled):
            give(r, room)
        give(oldest, room)
        return [(r, share[r.id]) for r in filling if share[r.id] > 0]

    def _advance(self, plan: StepPlan) -> None:
        """What a round does to the bookkeeping whatever it draws: its prompt rows are in the states (a prompt whose
        last chunk it runs decodes from the next round on). Done when the round is queued (overlap: the next plan
        sees it) or at its commit, once."""
        got = self._planned.get(plan.round)
        if got is None or got[2]:
            return
        got[2] = True
        prompt_rows = got[0]
        by_id = {r.id: r for r in self.running}
        for seq, n in prompt_rows.items():
            req = by_id.get(seq)
            if req is None:
                continue
            req.filled += n
            self.prompt_tokens_total += n
            if req.filled == req.prompt_len:
                req.phase = Phase.DECODE
                req.prompt_done_time = time.monotonic()

    def commit_round(self, plan: StepPlan, result: RoundResult) -> None:
        self._advance(plan)
        self._planned.pop(plan.round, None)
        by_id = {r.id: r for r in self.running}
        self.rounds_total += 1
        if self.policy is not None:
            self.policy.observe_round(plan.n_rows, len(plan.rows), result.seconds - result.draft_seconds)
            if result.drafts:
                self.policy.record_pass(result.draft_seconds, len(result.drafts))
        got: dict[int, list] = {}
        for seq, sample in result.samples:
            got.setdefault(seq, []).append(sample)
        for row in plan.rows:
            req = by_id.get(row.seq)
            if req is None or req.finished or not row.logits:
                continue
            drafted = len(row.ids) - 1 if len(row.logits) > 1 else 0
            accepted = result.accepted.get(row.seq, 0)
            if drafted:          # the rows past the first rejected draft were rolled back (plan time counted them)
                self._fed[row.seq] = row.start + len(row.ids) - (drafted - accepted)
            samples = got.get(row.seq, [])
            if drafted:
                self.draft_stats.add(drafted, accepted, len(samples))
                self.policy.record(self._expect.pop(row.seq, 0.0), accepted, drafted)
                req.drafted += drafted
                req.draft_accepted += accepted
            if samples:
                req.decode_rounds += 1
            if self._commit_tokens(req, samples):
                continue
            if row.seq in result.grammar_errors:
                self._finish(req, FinishEvent("error", error=result.grammar_errors[row.seq]))
            elif row.seq in result.drafts:
                self._drafts[row.seq] = result.drafts[row.seq]

    def _commit_tokens(self, req: Request, samples: list) -> bool:
        """Commit a row's tokens in order, as serial decoding would one per round. True when the reply finished or
        a token was forced (then the tokens after it, and the draft proposed after the last, are void)."""
        ctl = getattr(req, "control", None)
        for i, sample in enumerate(samples):
            later = len(samples) - 1 - i
            if ctl is not None and ctl.forcing and ctl.forcing[0] != sample.token_id and later and \
                    req.matcher is not None:
                req.matcher.rollback(later)    # the runner consumed the later tokens; this one is replaced
            self.generation_tokens_total += 1
            ev = req.commit(sample)
            if ev is not None:
                self._finish(req, ev)
                return True
            if req.output_ids[-1] != sample.token_id:
                self._drafts.pop(req.id, None)
                return True
        return False

    def _finish(self, req: Request, ev: FinishEvent, admitted: bool = True) -> None:
        req.finish(ev)
        ttft = f"{req.first_token_time - req.arrival:.3f}" if req.first_token_time else "-"
        log.info("done %d%s prompt=%d cached=%d reply=%d finish=%s ttft=%s seconds=%.3f", req.id,
                 f" reply_id={req.tag}" if req.tag else "", req.prompt_len, req.cached_tokens, len(req.output_ids),
                 ev.reason, ttft, req.finish_time - req.arrival)
        self._marks.pop(req.id, None)
        self._drafts.pop(req.id, None)
        if not (admitted and self.kept is not None and ev.reason in ("stop", "length")):
            self._ahead.discard(req.id)
        self._expect.pop(req.id, None)
        if admitted and self.kept is not None and ev.reason in ("stop", "length"):
            self._to_keep.append(req)
        else:
            self._fed.pop(req.id, None)
        if admitted:
            self.running.remove(req)
            self.budget.release(req.reserved_bytes, req.prompt_len + req.max_tokens)
            req.reserved_bytes = 0
            self._to_close.append(req.id)
        if self.metrics is not None:
            self.metrics.request_finished(req)

    def _fail_round(self, plan: StepPlan, err: Exception, *also: StepPlan) -> None:
        """A forward raised: its sequences' states may be half-advanced, so every request in it fails (and in `also`,
        the round queued behind it, which ran on those states)."""
        plans = (plan, *also)
        seqs = set()
        for p in plans:
            self._planned.pop(p.round, None)
            seqs |= {r.seq for r in p.rows} | {o.seq for o in p.ops if isinstance(o, NewSeq)}
        self.runner.drop(sorted(seqs))
        for req in [r for r in self.running if r.id in seqs]:
            self._finish(req, FinishEvent("error", error=f"the engine failed: {type(err).__name__}: {err}"))
        self._to_close = [s for s in self._to_close if s not in seqs]
        self._to_keep = [r for r in self._to_keep if r.id not in seqs]
        for p in plans:
            for op in p.ops + p.after:      # saves of a failed round may not have happened: forget them
                if isinstance(op, (SaveState, RestoreState)) and self.kept is not None:
                    self.kept.forget(op.key)
                    self._drop_keys.append(op.key)

def _cancel_reason(req: Request) -> str:
    """A cancelled request's finish reason: "shutdown" when the drain cancelled it, else "cancelled" (its client)."""
    return "shutdown" if req.cancel_reason == "shutdown" else "cancelled"


def _image_spans(req: Request) -> list[ImageSpan]:
    """The request's images as the kept index sees them: span positions and the digest of the bytes."""
    return [ImageSpan(p.start, p.end, p.image.digest) for p in req.images]


__all__ = ["Scheduler", "SchedulerError", "QueueFull", "ShuttingDown", "TooLarge", "Request", "TokenEvent",
           "FinishEvent"]
