"""Per-request reasoning controls: the thinking budget, the loop guard, background priority.

Both reasoning controls end an open think block by *forcing* the close (`\\n</think>\\n\\n`, or `</think>` alone under
a grammar) as the next reply tokens: the token drawn at that step is replaced by the forced one, the sequence goes on
from prompt + reply + close (nothing is replayed), and the reply continues into its answer. Every decision is a
function of the committed reply tokens only, so a controlled reply is as exact as any other (batch == solo).

- Thinking budget N: after N reply tokens of open reasoning the close is forced (reasoning = N drawn tokens + close).
- Loop guard (serving.md §3.7): the reasoning is cut into 1,024-token windows; a window's novelty is the share of its
  token 8-grams (those ending in it, so they span the edge) not seen in any earlier window. Three windows in a row
  under 2 % novelty force the close. A normal reply sits near 0.9, a loop near 0.
- Background priority: such a request is handed to the scheduler only after 150 ms and while foreground work is still
  queued or filling its prompt (at most 2 s), so foreground requests arriving together go first.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from dsv41.sched.request import FinishEvent, Request
from dsv41.sched.sampler import Sample

THINK_CLOSE_TEXT = "\n</think>\n\n"
LOOP_WINDOW = 1024
LOOP_NGRAM = 8
LOOP_MIN_NOVELTY = 0.02
LOOP_STRIKES = 3
BACKGROUND_MIN_WAIT_S = 0.15
BACKGROUND_MAX_WAIT_S = 2.0


class ControlError(ValueError):
    """A control field of the wrong type or value (the API answers 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


class LoopGuard:
    """Counts 8-gram novelty per 1,024-token window of reasoning; `push` says when the reasoning loops."""

    def __init__(self, window: int = LOOP_WINDOW, n: int = LOOP_NGRAM, min_novelty: float = LOOP_MIN_NOVELTY,
                 strikes: int = LOOP_STRIKES):
        self.window, self.n, self.min_novelty, self.strikes = window, n, min_novelty, strikes
        self.tail: list[int] = []            # the last n-1 tokens (8-grams span window edges)
        self.seen: set[tuple[int, ...]] = set()   # 8-grams of the finished windows
        self.current: list[tuple[int, ...]] = []  # 8-grams ending in the open window
        self.count = 0                       # tokens in the open window
        self.low = 0                         # finished windows in a row under min_novelty
        self.novelties: list[float] = []     # per finished window (diagnostics, tests)

    def push(self, token: int) -> bool:
        """Add one reasoning token; True when this token ends the third low-novelty window in a row."""
        self.tail.append(token)
        if len(self.tail) == self.n:
            self.current.append(tuple(self.tail))
            del self.tail[0]
        self.count += 1
        if self.count < self.window:
            return False
        novelty = (sum(g not in self.seen for g in self.current) / len(self.current)) if self.current else 1.0
        self.novelties.append(novelty)
        self.seen.update(self.current)
        self.current = []
        self.count = 0
        self.low = self.low + 1 if novelty < self.min_novelty else 0
        return self.low >= self.strikes


class ReasoningControl:
    """Decides, token by token, whether the next reply token is forced to close an open think block.

    `steer(drawn)` is called with each drawn token before it is committed and returns the token to commit (the drawn
    one, or the next token of a forced close); it also records the committed token."""

    def __init__(self, close_ids: list[int], think_end_id: int, *, budget: int | None = None,
                 loop_guard: bool = False):
        if not close_ids or think_end_id not in close_ids:
            raise ValueError("the close must hold the </think> token")
        self.close_ids = list(close_ids)
        self.think_end_id = think_end_id
        self.budget = budget if budget and budget > 0 else None
        self.guard = LoopGuard() if loop_guard else None
        self.open = True                     # the reply is still inside its think block
        self.reasoning = 0                   # reasoning tokens committed (drawn ones, before any close)
        self.forcing: list[int] = []         # close tokens still to force
        self.closed_by: str | None = None    # "budget" | "loop_guard" when the control closed the reasoning

    @property
    def active(self) -> bool:
        return self.open or bool(self.forcing)

    def steer(self, drawn: int) -> int:
        if self.forcing:
            tok = self.forcing.pop(0)
        else:
            tok = drawn
        self._observe(tok)
        return tok

    def _observe(self, tok: int) -> None:
        if not self.open:
            return
        if tok == self.think_end_id:
            self.open = False
            return
        if self.forcing:                     # the "\n" of a forced close: not reasoning of the model's own
            return
        self.reasoning += 1
        why = None
        if self.guard is not None and self.guard.push(tok):
            why = "loop_guard"
        if self.budget is not None and self.reasoning >= self.budget:
            why = why or "budget"
        if why is not None:
            self.closed_by = why
            self.forcing = list(self.close_ids)


def reasoning_control(tok, *, thinking: bool, grammar: bool, budget: int | None, loop_guard: bool
                      ) -> ReasoningControl | None:
    """The control a request needs, or None (thinking off, or neither control asked). The loop guard is off under a
    grammar (structured output / forced calls); the budget then closes with `</think>` alone, which the grammar
    admits in its reasoning part."""
    loop_guard = loop_guard and not grammar
    if not thinking or (not budget and not loop_guard):
        return None
    end = tok.think_end_id
    if end is None:
        return None
    close = [end] if grammar else tok.encode(THINK_CLOSE_TEXT, special=True)
    return ReasoningControl(close, end, budget=budget, loop_guard=loop_guard)


@dataclass
class ControlledRequest(Request):
    """A scheduler Request whose drawn tokens pass through a ReasoningControl before they are committed.

    The scheduler commits every drawn token through `commit`; a forced token replaces the drawn one there (the
    grammar matcher, which consumed the drawn token in the runner, is rolled back one token and fed the forced one).
    The next round's decode row feeds the committed token, so the sequence continues from the close."""
    control: Any = None                      # ReasoningControl | None

    def commit(self, sample: Sample) -> FinishEvent | None:
        ctl = self.control
        if ctl is not None and ctl.active:
            tok = ctl.steer(sample.token_id)
            if tok != sample.token_id:
                if self.matcher is not None:
                    self.matcher.rollback(1)
                    if not self.matcher.consume(tok):
                        self.output_ids.append(tok)
                        return FinishEvent("error", error=f"the grammar refused the forced close token {tok}")
                sample = Sample(tok)            # forced: no logprob of its own
        return super().commit(sample)


def parse_controls(raw: dict, *, default_budget: int = 0, default_loop_guard: bool = False
                   ) -> tuple[int | None, bool, bool]:
    """(thinking_budget, loop_guard, background) of a request body; ControlError on a bad value.

    `thinking_budget`: a positive integer, or 0 / null for the server's default (`--thinking-budget`, 0 = none).
    `loop_guard`: a boolean, null for the server's default. `priority`: "background", "foreground"/"normal"/null."""
    b = raw.get("thinking_budget")
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
        raise ControlError(f"`thinking_budget` must be a non-negative integer, got {b!r}", "thinking_budget")
    budget = b or default_budget or None
    lg = raw.get("loop_guard")
    if lg is not None and not isinstance(lg, bool):
        raise ControlError(f"`loop_guard` must be a boolean, got {lg!r}", "loop_guard")
    loop_guard = default_loop_guard if lg is None else lg
    p = raw.get("priority")
    if p is not None and p not in ("background", "foreground", "normal", "default"):
        raise ControlError(f"`priority` must be \"background\" or \"foreground\", got {p!r}", "priority")
    return budget, loop_guard, p == "background"


def foreground_busy(sched) -> bool:
    """Foreground work still queued or filling its prompt."""
    from dsv41.sched.request import Phase
    return bool(getattr(sched, "waiting", None)) or any(
        r.phase is Phase.PROMPT for r in getattr(sched, "running", ()))


async def wait_background_turn(sched, min_wait_s: float = BACKGROUND_MIN_WAIT_S,
                               max_wait_s: float = BACKGROUND_MAX_WAIT_S, poll_s: float = 0.02) -> float:
    """Hold a background request before it is submitted: at least min_wait_s, then while foreground work is queued or
    filling (at most max_wait_s in all). Returns the seconds waited."""
    t0 = time.monotonic()
    await asyncio.sleep(min_wait_s)
    while time.monotonic() - t0 < max_wait_s and foreground_busy(sched):
        await asyncio.sleep(poll_s)
    return time.monotonic() - t0


__all__ = [
    "THINK_CLOSE_TEXT",
    "ControlError",
    "ControlledRequest",
    "LoopGuard",
    "ReasoningControl",
    "foreground_busy",
    "parse_controls",
    "reasoning_control",
    "wait_background_turn",
]
