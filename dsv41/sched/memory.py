"""Memory accounting: what one sequence's state costs, and admission against a fixed budget.

A sequence reserves, at admission, the state bytes for prompt + max_tokens positions; the reservation is returned when
it finishes or is cancelled. The sum of reservations never exceeds the budget, so states never grow past memory at
run time (a request that would not fit waits; one that could never fit is refused with 400 at the door).

State size from the config (arch.md §3, reference storage in the compute dtype):
- window KV: every layer (backbone + DSpark) keeps `sliding_window` rows of `head_dim` (fixed per sequence);
- compressed KV: each KV-source layer with ratio r keeps ceil(T / r) entries of `head_dim`;
- indexer keys: the same owners, ceil(T / r) entries of `index_head_dim`;
- compressor partials: per source, kv + score [r, head_dim] (fixed, counted as 2 * 2 * head_dim);
- Engram history: T int64 ids.
A 25% margin covers allocator rounding and growth slack of the state's buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StateCost:
    fixed_bytes: int          # per sequence, whatever its length
    per_ratio: tuple[tuple[int, int], ...]   # (ratio, bytes per entry) for each compressed owner
    per_token_bytes: int      # bytes per position not covered by per_ratio (Engram history)
    margin: float = 1.25

    def bytes_for(self, positions: int) -> int:
        t = max(0, positions)
        b = self.fixed_bytes + self.per_token_bytes * t
        for r, entry in self.per_ratio:
            b += math.ceil(t / r) * entry
        return int(b * self.margin)

    def max_positions(self, budget: int) -> int:
        """The most positions one sequence can hold within `budget` bytes (0 if not even the fixed part fits)."""
        lo, hi = 0, 1 << 31
        if self.bytes_for(0) > budget:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bytes_for(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo


def state_cost(text_config: dict, elem_bytes: int = 4) -> StateCost:
    """Cost model of one sequence's state from a checkpoint's text_config (the dict in config.json)."""
    tc = text_config
    ratios = list(tc.get("compress_ratios") or [])
    n_layers = max(len(ratios), int(tc["num_hidden_layers"]) + int(tc.get("num_nextn_predict_layers", 0)))
    head_dim = int(tc["head_dim"])
    index_dim = int(tc.get("index_head_dim", 0))
    window = int(tc.get("sliding_window", 0))
    fixed = n_layers * window * head_dim * elem_bytes
    sources = tc.get("kv_source_layer_ids")
    if sources is None:    # no explicit owners: every compressed layer keeps its own
        sources = [i for i, r in enumerate(ratios) if r > 0]
    per_ratio = []
    for i in sources:
        r = int(ratios[i]) if i < len(ratios) else 0
        if r <= 0:
            continue
        per_ratio.append((r, (head_dim + index_dim) * elem_bytes))
        fixed += 2 * 2 * r * head_dim * 4       # compressor kv + score partials, float32
    engram = 8 if tc.get("engram_layer_ids") else 0
    return StateCost(fixed_bytes=fixed, per_ratio=tuple(per_ratio), per_token_bytes=engram)


class MemoryBudget:
    """Reservations against a byte budget. Plain bookkeeping, used only on the event loop."""

    def __init__(self, budget_bytes: int, cost: StateCost):
        self.budget = int(budget_bytes)
        self.cost = cost
        self.used = 0

    def need(self, positions: int) -> int:
        return self.cost.bytes_for(positions)

    def fits_ever(self, positions: int) -> bool:
        return self.need(positions) <= self.budget

    def try_reserve(self, positions: int) -> int | None:
        n = self.need(positions)
        if self.used + n > self.budget:
            return None
        self.used += n
        return n

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, "memory accounting went negative"

    @property
    def usage(self) -> float:
        return self.used / self.budget if self.budget else 0.0
