"""Memory accounting: what one sequence's state costs, the memory plan printed at start, and admission.

All streams share one window of `--window` positions. A sequence reserves, at admission, prompt + max_tokens
positions of it (at the state bytes per position); the reservation is returned when it finishes or is cancelled.
The sum of reservations never exceeds the window, so states never grow past the plan at run time (a request that
does not fit waits for room; one larger than the whole window is refused with 400 at the door). What does not grow
with positions (each stream's window-KV rings and compressor partials, kept prompt states, one prompt pass's
scratch) is reserved whole in the plan, for `max_streams` streams.

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


def bytes_per_position(cost: StateCost) -> int:
    """State bytes one position adds, amortised (compressed KV + indexer keys at 1/ratio, Engram history), margin
    included, rounded up to whole bytes (so reservations add up exactly)."""
    return math.ceil((cost.per_token_bytes + sum(entry / r for r, entry in cost.per_ratio)) * cost.margin)


@dataclass(frozen=True)
class MemoryPlan:
    """Where the state memory goes (bytes), for `window` shared positions and `max_streams` streams."""
    window: int                 # positions shared by all streams
    max_streams: int
    prompt_chunk: int
    window_kv: int              # every stream's window-KV rings (all layers + DSpark), fixed per stream
    compressor_partials: int    # every stream's open compressor groups
    compressed_kv: int          # compressed KV entries of `window` positions (+ one rounding entry per stream)
    index_keys: int             # indexer keys, the same entries
    engram_history: int         # one int64 compressed id per position
    kept_states: int            # --prompt-cache-gib
    prompt_scratch: int         # activations of one prompt pass of `prompt_chunk` rows (estimate)
    margin: float               # on the state lines (allocator rounding, growth slack of the state buffers)

    @property
    def pool(self) -> int:
        """Bytes the window's positions may hold: what admission reserves against."""
        return int((self.compressed_kv + self.index_keys + self.engram_history) * self.margin)

    @property
    def fixed(self) -> int:
        return int((self.window_kv + self.compressor_partials) * self.margin)

    @property
    def total(self) -> int:
        return self.pool + self.fixed + self.kept_states + self.prompt_scratch

    def lines(self) -> list[str]:
        g = 1 << 30

        def row(name, b, note):
            return f"  {name:<22}{b / g:10.3f} GiB  {note}"
        m = f"x{self.margin:g}"
        per_pos = (self.compressed_kv + self.index_keys + self.engram_history) * self.margin / max(1, self.window)
        return [(f"memory plan: {self.window:,} positions shared by up to {self.max_streams} streams "
                 f"(~{per_pos:,.0f} B of state per position), prompt passes of {self.prompt_chunk} rows"),
                row("window KV", int(self.window_kv * self.margin), f"{self.max_streams} streams, fixed per stream, {m}"),
                row("compressor partials", int(self.compressor_partials * self.margin), f"per stream, {m}"),
                row("compressed KV", int(self.compressed_kv * self.margin), f"{self.window:,} positions, {m}"),
                row("indexer keys", int(self.index_keys * self.margin), f"{self.window:,} positions, {m}"),
                row("Engram history", int(self.engram_history * self.margin), f"{self.window:,} positions, {m}"),
                row("kept prompt states", self.kept_states, "--prompt-cache-gib"),
                row("prompt-pass scratch", self.prompt_scratch, f"{self.prompt_chunk} rows (estimate)"),
                row("total", self.total, "")]


def prompt_scratch_bytes(text_config: dict, rows: int, positions: int = 0) -> int:
    """An estimate of one prompt pass's activations: per row the hyper-connection streams and their mixes, the
    attention's queries, the routed experts' intermediates and slot sums, float32, with a factor 2.25 for
    temporaries; the attention's key sets for one row tile only (a prompt pass reads each row's keys from the pool
    through its indices: the GPU kernel gathers none, the reference gathers one tile of rows at a time,
    ops.attend_tiled; until session 16 this counted every row's gathered keys, ~1.3 MB a row at the release's
    sizes, the largest term). (The forward frees them between layers; one pass is alive at a time.)
    positions: the longest sequence (up to one index key per position): the indexer's scores and top-k temporaries
    for one block of rows (dsv41.model.model.index_row_block), ~24 bytes per (row, key), and the candidate mask of
    the whole chunk, 1 byte per (row, key).
    Checked on GPUs (real shapes, 4096-row chunks, bench/results/long-h200*.md): the H100 at 536,576 positions
    (session 15) peaked 5.7 GiB above weights and state, against 28.9 estimated with every row's keys and 16.5
    without them; the H200's earlier peaks (21.06 GiB at 16,384 positions, 24.98 at 1,048,560) predate the pool
    form of the prompt attention."""
    tc = text_config
    H, hc = int(tc["hidden_size"]), int(tc.get("hc_mult", 4))
    heads, hd = int(tc["num_attention_heads"]), int(tc["head_dim"])
    keys = int(tc.get("sliding_window", 0)) + int(tc.get("index_topk", 0))
    top_k = int(tc.get("num_experts_per_tok", 1))
    moe = int(tc.get("moe_intermediate_size", 0)) * top_k
    per_row = 4 * (hc * H * 4 + heads * hd * 2 + moe * 3 + top_k * H + H * 4)
    # one tile of the reference's attention (the largest op set row tile, the GPU's): its rows' keys [R, K, D], the
    # scores and the softmax's [R, heads, K + 1]
    from dsv41.model.device import CUDA_ROW_TILE
    tile = 4 * min(rows, CUDA_ROW_TILE) * (keys * hd + 3 * heads * (keys + 1))
    index = 0
    if positions > 0 and int(tc.get("index_topk", 0)):
        from dsv41.model.model import index_row_block
        index = min(rows, index_row_block(positions)) * positions * 24 + rows * positions
    return 9 * (rows * per_row + tile) // 4 + index


def memory_plan(text_config: dict, cost: StateCost, window: int, max_streams: int, prompt_chunk: int,
                kept_bytes: int = 0, elem_bytes: int = 4) -> MemoryPlan:
    tc = text_config
    head_dim, index_dim = int(tc["head_dim"]), int(tc.get("index_head_dim", 0))
    partials = 0
    ckv = ikeys = 0
    for r, _ in cost.per_ratio:
        entries = math.ceil(window / r) + max_streams       # each stream may round one entry up
        ckv += entries * head_dim * elem_bytes
        ikeys += entries * index_dim * elem_bytes
        partials += 2 * 2 * r * head_dim * 4
    window_kv = cost.fixed_bytes - partials
    return MemoryPlan(window=window, max_streams=max_streams, prompt_chunk=prompt_chunk,
                      window_kv=max_streams * window_kv, compressor_partials=max_streams * partials,
                      compressed_kv=ckv, index_keys=ikeys, engram_history=window * cost.per_token_bytes,
                      kept_states=int(kept_bytes), prompt_scratch=prompt_scratch_bytes(tc, prompt_chunk, window),
                      margin=cost.margin)


def window_that_fits(plan_for, nbytes: int, most: int, part=lambda p: p.total) -> int:
    """The largest window <= most whose plan (plan_for(window)) has part(plan) <= nbytes; 0 if none does."""
    if part(plan_for(0)) > nbytes:
        return 0
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if part(plan_for(mid)) <= nbytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


class MemoryBudget:
    """Reservations against a byte budget and, with `window` > 0, against the window of positions all streams share
    (the server's plan sizes the bytes so that the positions bind first). Plain bookkeeping, on the event loop only."""

    def __init__(self, budget_bytes: int, cost: StateCost, window: int = 0):
        self.budget = int(budget_bytes)
        self.cost = cost
        self.window = int(window)
        self.used = 0
        self.positions_used = 0

    def need(self, positions: int) -> int:
        return self.cost.bytes_for(positions)

    def fits_ever(self, positions: int) -> bool:
        return self.need(positions) <= self.budget and (not self.window or positions <= self.window)

    def fits_now(self, positions: int) -> bool:
        return self.used + self.need(positions) <= self.budget and (
            not self.window or self.positions_used + positions <= self.window)

    def try_reserve(self, positions: int) -> int | None:
        """Reserve; returns the bytes reserved (give them back with release(bytes, positions)), None if no room."""
        if not self.fits_now(positions):
            return None
        n = self.need(positions)
        self.used += n
        self.positions_used += positions
        return n

    def release(self, nbytes: int, positions: int = 0) -> None:
        self.used -= nbytes
        self.positions_used -= positions
        assert self.used >= 0 and self.positions_used >= 0, "memory accounting went negative"

    @property
    def usage(self) -> float:
        """Share reserved: of the window's positions when there is a window, else of the bytes."""
        if self.window:
            return self.positions_used / self.window
        return self.used / self.budget if self.budget else 0.0
