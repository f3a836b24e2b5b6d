"""Request (what the API hands the scheduler), its events, and the per-request text stop logic.

A Request is created by the API layer with token ids and sampling params; the scheduler owns it from `submit` on.
Events go to the request's asyncio queue: TokenEvent for each committed token (with the text it adds, stop strings
held back), then exactly one FinishEvent (finish_reason "stop" / "length" / "cancelled" (its client went away) /
"shutdown" (cancelled by the server's drain) / "error").
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import time
from dataclasses import dataclass, field

from dsv41.sched.sampler import Sample, SamplingParams

_ids = itertools.count(1)


class Phase(enum.Enum):
    WAITING = "waiting"      # queued, no state yet
    PROMPT = "prompt"        # admitted; prompt rows being filled chunk by chunk
    DECODE = "decode"        # one row a round
    DONE = "done"


@dataclass
class TokenEvent:
    token_id: int
    text: str                 # text this token releases (may be "" while UTF-8 or a stop-string prefix is held)
    sample: Sample            # logprob info when asked


@dataclass
class FinishEvent:
    reason: str               # "stop" | "length" | "cancelled" (by its client) | "shutdown" | "error"
    text: str = ""            # held-back text released at the end (never a matched stop string)
    stop_sequence: str | None = None
    error: str | None = None


class StopStrings:
    """Checks stop strings on the decoded text (reasoning included); holds back any tail that could start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""          # text decoded but not yet released

    def push(self, piece: str) -> tuple[str, str | None]:
        """Add decoded text; return (text safe to release, matched stop or None). After a match the text before it
        is released and the rest (the stop string and anything after) dropped."""
        if not self.stops:
            return piece, None
        self.pending += piece
        first: tuple[int, str] | None = None
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            out = self.pending[: first[0]]
            self.pending = ""
            return out, first[1]
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    detokenizer: object | None = None       # IncrementalDetokenizer-like: push(id) -> str; None = no text
    matcher: object | None = None           # dsv41.grammar Matcher when the reply is constrained
    cache_salt: str | None = None           # kept states are shared only between requests of one salt (kept.py)
    draft: bool = True                      # speculative decoding for this request (when the server drafts)
    images: list = field(default_factory=list)  # dsv41.model.vision.PromptImage spans of prompt_ids, in order
    tag: str = ""                           # the reply's id (chatcmpl-..., resp_...): named on the `done` log line
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)

    # filled by the scheduler
    phase: Phase = Phase.WAITING
    filled: int = 0                          # prompt rows already in the state
    cached_tokens: int = 0                   # prompt rows resumed from a kept state (usage.cached_tokens)
    output_ids: list[int] = field(default_factory=list)
    reserved_bytes: int = 0
    first_token_time: float | None = None
    admit_time: float | None = None
    prompt_done_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    cancel_reason: str = ""                  # "client" (it went away) or "shutdown" (the server's drain)
    drafted: int = 0                         # draft tokens verified for this reply (docs/drafts.md)
    draft_accepted: int = 0                  # of them, accepted
    decode_rounds: int = 0                   # rounds that added reply tokens

    def __post_init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self._stops = StopStrings(self.stop)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def position(self) -> int:
        """Absolute position of the next token to be drawn."""
        return self.prompt_len + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.DONE

    def cancel(self, why: str = "client") -> None:
        """Ask the scheduler to drop this request at the next round boundary: its client went away ("client"; it
        finishes "cancelled") or the server shuts down ("shutdown"; it finishes "shutdown")."""
        if not self.cancelled:
            self.cancel_reason = why
        self.cancelled = True

    # --- called by the scheduler on the event loop -------------------------------------------------------------
    def commit(self, sample: Sample) -> FinishEvent | None:
        """Append a drawn token, emit its TokenEvent; return the FinishEvent if this token ends the request."""
        tid = sample.token_id
        self.output_ids.append(tid)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        is_eos = tid in self.eos_ids
        if is_eos and not self.ignore_eos:
            self.events.put_nowait(TokenEvent(tid, "", sample))
            return self._end("stop")
        piece = self.detokenizer.push(tid) if self.detokenizer is not None else ""
        text, matched = self._stops.push(piece)
        self.events.put_nowait(TokenEvent(tid, text, sample))
        if matched is not None:
            return FinishEvent("stop", "", stop_sequence=matched)
        if len(self.output_ids) >= self.max_tokens:
            return self._end("length")
        return None

    def _end(self, reason: str) -> FinishEvent:
        """The reply ends without a stop string so far: release held text (an unfinished UTF-8 tail comes out as
        U+FFFD), unless that tail completes a stop string."""
        tail = ""
        finish = getattr(self.detokenizer, "finish", None)
        if finish is not None:
            tail = finish()
        text, matched = self._stops.push(tail)
        if matched is not None:
            return FinishEvent("stop", text, stop_sequence=matched)
        return FinishEvent(reason, text + self._stops.flush())

    async def stream(self, idle_s: float | None = None, idle=None):
        """This request's events, ending with its FinishEvent. With idle_s, `idle` comes after every idle_s without
        an event (an SSE keepalive): a timer armed only while the queue is empty, cancelled by the next event. (A
        task and an asyncio.wait per event around the queue were a visible share of the event loop's work per
        streamed token: bench/http_rate.py, 203 -> 177 us a token at 32 streams on a 2-core VM.)"""
        q = self.events
        timer = None
        try:
            while True:
                if idle_s is not None and q.empty():
                    timer = asyncio.get_running_loop().call_later(idle_s, q.put_nowait, idle)
                    ev = await q.get()
                    timer.cancel()
                    timer = None
                else:
                    ev = await q.get()
                yield ev
                if isinstance(ev, FinishEvent):
                    return
        finally:
            if timer is not None:            # the consumer went away while waiting
                timer.cancel()

    def finish(self, ev: FinishEvent) -> None:
        if self.phase is Phase.DONE:
            return
        self.phase = Phase.DONE
        self.finish_reason = ev.reason
        self.finish_time = time.monotonic()
        self.events.put_nowait(ev)
