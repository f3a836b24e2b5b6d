"""How long each sequence's draft is this round (speculative decoding with the DSpark head, docs/drafts.md).

A round's rows: one per decoding sequence, the prompt rows, and the draft tokens to verify. More verified draft
tokens give more reply tokens per round when they are accepted, and cost rows. The policy picks draft lengths to
maximise the expected reply tokens per second of the round:

- the expected tokens a draft of length n adds are sum_{i<=n} prod_{j<=i} p_j, p_j = sigmoid(confidence_j) (the
  DSpark confidence head's logit for draft position j; arch.md leaves its use open, so it is read as the chance
  the token is accepted given the ones before it);
- a round of R rows over B sequences costs `costs(R) + B * per_seq` seconds: `costs` is a table measured when the
  server starts (`RoundCosts.measure`: one forward of R rows of one sequence per row count, linear in between) and
  `per_seq` the work each extra sequence adds (its own attention / indexer / ring bookkeeping), learnt from the
  rounds the server runs (what the table does not explain, per sequence);
- greedily add the draft token with the largest expected gain, remember the expected tokens per second after each
  addition, and keep the best prefix; a round never exceeds `round_rows`;
- calibration: the server counts the drafts it expected to be accepted and those that were; p_j is scaled by
  (accepted + 2) / (expected + 2), so a head whose confidence overstates (random weights: acceptance near zero)
  soon gets no rows. While that scale is below EXPLORE_BELOW, drafts are verified at least one token deep, so the
  estimate can recover;
- proposing: the DSpark pass itself costs time (seconds per drafting sequence, measured on the rounds that ran it), so
  a round proposes drafts only when, at the acceptance rate seen so far, the best draft length would give more
  tokens per second than serial decoding after paying for the pass; every EXPLORE_EVERY-th round proposes anyway.

More live sequences leave fewer rows and make each row's share of the round smaller, so drafts get shorter. With
`fixed` > 0 every sequence verifies min(fixed, what fits) draft tokens instead (a knob for measuring and testing).
Nothing here changes what a reply is: drafted == serial whatever lengths are picked.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

MEASURE_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192)
EXPLORE_BELOW = 0.1
EXPLORE_EVERY = 8


@dataclass
class RoundCosts:
    """Seconds a round takes by its row count (measured points, linear in between, flat beyond the ends)."""
    rows: list[int] = field(default_factory=lambda: [1])
    seconds: list[float] = field(default_factory=lambda: [1.0])

    def __call__(self, n: int) -> float:
        i = bisect.bisect_left(self.rows, n)
        if i < len(self.rows) and self.rows[i] == n:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.rows):
            r0, s0 = self.rows[-1], self.seconds[-1]
            slope = (s0 - self.seconds[-2]) / (r0 - self.rows[-2]) if len(self.rows) > 1 else 0.0
            return s0 + max(slope, 0.0) * (n - r0)
        r0, r1, s0, s1 = self.rows[i - 1], self.rows[i], self.seconds[i - 1], self.seconds[i]
        return s0 + (s1 - s0) * (n - r0) / (r1 - r0)

    @classmethod
    def measure(cls, run_rows, rows=MEASURE_ROWS, repeat: int = 2) -> RoundCosts:
        """`run_rows(n)` runs one round of n rows; the best of `repeat` timings per row count (a warm-up first)."""
        run_rows(rows[0])
        out = []
        for n in rows:
            best = math.inf
            for _ in range(repeat):
                t0 = time.perf_counter()
                run_rows(n)
                best = min(best, time.perf_counter() - t0)
            out.append(best)
        # a round of more rows never costs less (timing noise on a shared machine)
        for i in range(1, len(out)):
            out[i] = max(out[i], out[i - 1])
        return cls(list(rows), out)

    def table(self) -> list[tuple[int, float]]:
        return list(zip(self.rows, self.seconds))


def accept_probs(confidence: list[float]) -> list[float]:
    out = []
    for c in confidence:
        c = max(-60.0, min(60.0, float(c)))
        out.append(1.0 / (1.0 + math.exp(-c)))
    return out


class DraftPolicy:
    def __init__(self, costs: RoundCosts, round_rows: int = 64, fixed: int = 0):
        self.costs = costs
        self.round_rows = round_rows
        self.fixed = fixed
        self.expected = 0.0          # draft tokens the confidence head expected accepted (verified ones)
        self.accepted = 0            # and those accepted
        self.verified = 0            # draft tokens verified
        self.pass_s = 0.0            # seconds of the DSpark pass per drafting sequence (running estimate)
        self.per_seq = 0.0           # seconds each sequence of a round adds beyond the table (running estimate)

    def round_s(self, rows: int, streams: int) -> float:
        return self.costs(rows) + self.per_seq * streams

    def observe_round(self, rows: int, streams: int, seconds: float) -> None:
        """A round's forward + sampling seconds (without the DSpark pass): refine per_seq."""
        if streams > 1 and rows > 0:
            per = max(0.0, seconds - self.costs(rows)) / streams
            self.per_seq = per if self.per_seq == 0 else 0.8 * self.per_seq + 0.2 * per

    @property
    def scale(self) -> float:
        return (self.accepted + 2.0) / (self.expected + 2.0)

    def record(self, expected: float, accepted: int, verified: int = 0) -> None:
        self.expected += expected
        self.accepted += accepted
        self.verified += verified

    def record_pass(self, seconds: float, sequences: int) -> None:
        if sequences > 0:
            per = seconds / sequences
            self.pass_s = per if self.pass_s == 0 else 0.8 * self.pass_s + 0.2 * per

    def proposing(self, round_no: int, streams: int = 1, base_rows: int = 1, block: int = 5) -> bool:
        """Whether the round's sequences propose drafts (for the next round): worth the DSpark pass at the acceptance
        rate seen so far (each draft token accepted with that chance given the ones before it)?"""
        if self.fixed > 0 or round_no % EXPLORE_EVERY == 0 or self.pass_s == 0:
            return True
        a = (self.accepted + 1.0) / (self.verified + 2.0)
        serial = streams / self.round_s(base_rows, streams)
        for n in range(1, block + 1):
            rows = base_rows + min(streams * n, max(0, self.round_rows - base_rows))
            tokens = streams * sum(a ** i for i in range(min(n, (rows - base_rows) // max(streams, 1)) + 1))
            if tokens / (self.round_s(rows, streams) + self.pass_s * streams) > serial:
                return True
        return False

    def expected_accepted(self, confidence: list[float], n: int) -> float:
        """Accepted draft tokens the (uncalibrated) confidence expects from the first n."""
        total, reach = 0.0, 1.0
        for p in accept_probs(confidence[:n]):
            reach *= p
            total += reach
        return total

    def lengths(self, base_rows: int, base_tokens: int, cands: dict[int, tuple[list[float], int]]) -> dict[int, int]:
        """Draft tokens to verify per sequence. base_rows: rows the round has without drafts; base_tokens: reply
        tokens it yields without drafts (one per decoding sequence); cands: seq -> (confidence logits of its draft,
        the most draft tokens it may verify)."""
        room = self.round_rows - base_rows
        out = {s: 0 for s in cands}
        if room <= 0 or not cands:
            return out
        if self.fixed > 0:
            for s, (conf, most) in cands.items():
                n = min(self.fixed, most, len(conf), room)
                out[s] = n
                room -= n
            return out
        k = self.scale
        probs = {s: [min(0.999, p * k) for p in accept_probs(conf[:most])] for s, (conf, most) in cands.items()}
        reach = {s: 1.0 for s in cands}          # P(every draft token so far accepted)
        order = []                               # additions, best expected gain first
        tokens = float(base_tokens)
        best_rate, best_k = tokens / self.round_s(base_rows, base_tokens), 0
        for k in range(1, room + 1):
            pick, gain = None, 0.0
            for s, p in probs.items():
                i = out[s]
                if i < len(p) and reach[s] * p[i] > gain:
                    pick, gain = s, reach[s] * p[i]
            if pick is None:
                break
            out[pick] += 1
            reach[pick] *= probs[pick][out[pick] - 1]
            order.append(pick)
            tokens += gain
            rate = tokens / self.round_s(base_rows + k, base_tokens)
            if rate > best_rate:
                best_rate, best_k = rate, k
        final = {s: 0 for s in cands}
        for s in order[:best_k]:
            final[s] += 1
        if k < EXPLORE_BELOW:                    # exploring: one token deep where the round has room
            for s, n in list(final.items()):
                if room > 0 and n == 0:
                    final[s] = 1
                    room -= 1
        return final


@dataclass
class DraftStats:
    """Counters for /metrics and the reply's usage: draft tokens verified, accepted, and verify rounds."""
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0          # rounds with at least one draft token verified
    tokens: int = 0          # reply tokens those rounds yielded

    def add(self, drafted: int, accepted: int, tokens: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.rounds += 1
        self.tokens += tokens
