"""CUDA graphs of a decode round's dense pieces (issue 8, docs/gpu.md "CUDA graphs").

A decode round on the GPU is host-bound: each layer dispatches a few hundred small ops, each costing the host tens
of microseconds, while the GPU work of the whole layer takes well under a millisecond. A layer's dense pieces (mHC
mixing, norms, the projections, attention over gathered keys, the output projection, the MoE) have shapes that
depend only on the round's row count, so each is captured once per (piece, layer, row bucket) and replayed.
Between them the history work (window ring, compressor, indexer, top-k, key gather) stays eager: its shapes change
with every sequence's context.

Rows are padded up to a bucket (ROW_BUCKETS) by repeating row 0, so a piece has a handful of graphs whatever the
number of live sequences, and padded rows touch the same experts as a real one (no extra weight bytes). A real row's
bits do not change: every op of the model is row-invariant (the exactness rules of docs/architecture.md), so what
the padded rows hold cannot reach it.

Contract for a piece (checked by tests/test_graphs.py, on the CPU through the emulation below):
- a pure function of its tensor arguments (weights are constant); every argument and result has the rows as dim 0;
- its results are views of static buffers that the next call of the same piece overwrites, so a caller copies what
  it keeps (the state writes already do) and uses the rest before it runs that piece again.

`PieceGraphs(mode="emulate")` runs the same bookkeeping on any device without capture (static input buffers,
padding, results copied into static outputs), so the CPU suite checks padding and aliasing; the GPU tests compare
real graphs with the eager round bit for bit.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("dsv41.graphs")

# Row counts a piece is captured for; a round of n rows replays the smallest bucket >= n. Larger rounds (prompt
# chunks) run eagerly: they are not host-bound. The buckets above 64 are drafted verify rounds of many streams
# (32 streams x 2..6 rows) and their DSpark passes (32 x 5 block rows); each bucket is captured when first used.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192)


def row_bucket(n: int) -> int | None:
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    return None


Args = tuple[torch.Tensor | None, ...]


@dataclass
class _Entry:
    inputs: list[torch.Tensor | None]       # static inputs, bucket rows
    outputs: tuple[torch.Tensor | None, ...]  # static outputs, bucket rows
    graph: torch.cuda.CUDAGraph | None      # None in emulation


class PieceGraphs:
    """Captured pieces by (key, row bucket). mode "cuda": CUDA graphs sharing one memory pool; "emulate": the
    same static buffers and padding, the piece run eagerly on them (tests on any device)."""

    def __init__(self, mode: str = "cuda"):
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"PieceGraphs mode must be 'cuda' or 'emulate', got {mode!r}")
        self.mode = mode
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.entries: dict[tuple, _Entry] = {}
        self.failed: dict[object, str] = {}     # key -> why capture failed (that piece then runs eagerly)
        self.stats: Counter = Counter()         # captures, replays, eager (calls that ran without a graph)
        # static buffers by address: another piece's outputs and the round's shared rows (rows()); a piece
        # captured with one of them as an argument reads it in place, with no copy on replay
        self._static: dict[int, torch.Tensor] = {}
        self._rows: dict[tuple, torch.Tensor] = {}
        self._inputs: dict[tuple, torch.Tensor] = {}   # shared input buffers (_static_for)

    def rows(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t [n, ...] copied into the round's static buffer `name` for its bucket (padded by repeating row 0),
        returned as that buffer's first n rows: every piece that takes it reads it in place (e.g. the RoPE
        rows, the same for all layers of a round). t itself when n has no bucket."""
        n = t.shape[0]
        b = row_bucket(n)
        if b is None:
            return t
        k = (name, b, tuple(t.shape[1:]), t.dtype, t.device)
        buf = self._rows.get(k)
        if buf is None:
            buf = self._rows[k] = torch.empty((b,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            self._static[buf.data_ptr()] = buf
        _fill([buf], (t,), n)
        return buf[:n]

    def run(self, key, fn: Callable[..., tuple], args: Args) -> tuple:
        """fn(*args) through the piece's graph for the bucket of args[0]'s rows (captured on first use)."""
        n = args[0].shape[0]
        b = row_bucket(n)
        if b is None or key in self.failed:
            self.stats["eager"] += 1
            return fn(*args)
        e = self.entries.get((key, b))
        if e is None:
            e = self._capture(key, b, fn, args)
            if e is None:
                self.stats["eager"] += 1
                return fn(*args)
        else:
            _fill(e.inputs, args, n)
        if e.graph is not None:
            e.graph.replay()
        else:
            res = fn(*e.inputs)
            for s, r in zip(e.outputs, res):
                if s is not None:
                    s.copy_(r)
        self.stats["replays"] += 1
        return tuple(None if o is None else o[:n] for o in e.outputs)

    def _capture(self, key, b: int, fn, args: Args) -> _Entry | None:
        n = args[0].shape[0]
        name = key[0] if isinstance(key, tuple) else key
        inputs = [None if a is None else self._static_for(a, b, (name, i)) for i, a in enumerate(args)]
        _fill(inputs, args, n)
        if self.mode == "emulate":
            outputs = tuple(None if r is None else r.clone() for r in fn(*inputs))
            e = _Entry(inputs, outputs, None)
        else:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):   # first calls: Triton compiles, cuBLAS workspaces
                    fn(*inputs)
                    shapes = [None if r is None else (r.shape, r.dtype) for r in fn(*inputs)]
                torch.cuda.current_stream().wait_stream(side)
                # The results live outside the graphs' shared pool, copied there inside the graph: a graph
                # captured later may be handed the pool memory of this one's temporaries (freed when its capture
                # ends), and this one's replay rewrites them, so a result held in the pool could be overwritten
                # by another piece's replay before it is read (graphs sharing a pool are safe only replayed in
                # capture order, and pieces are captured lazily, in any order). Only temporaries, dead between
                # replays, stay in the pool.
                outputs = tuple(None if sh is None else torch.empty(sh[0], dtype=sh[1], device=args[0].device)
                                for sh in shapes)
                _fill(inputs, args, n)          # as the caller gave them, whatever the warm-up runs wrote
                g = torch.cuda.CUDAGraph()
                # thread_local: only this thread's unsafe calls break the capture (the server's other threads
                # may use CUDA meanwhile)
                with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                    for o, r in zip(outputs, fn(*inputs)):
                        if (o is None) != (r is None):
                            raise ValueError("a piece's results changed between its warm-up and its capture")
                        if o is not None:
                            o.copy_(r)
            except Exception as exc:  # noqa: BLE001 - a piece that cannot be captured runs eagerly, said once
                torch.cuda.synchronize()
                self.failed[key] = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture of %s failed (%s); that piece runs eagerly", key, self.failed[key])
                return None
            e = _Entry(inputs, outputs, g)
        for o in outputs:
            if o is not None and o.shape[0] == b:
                self._static.setdefault(o.data_ptr(), o)
        self.entries[(key, b)] = e
        self.stats["captures"] += 1
        return e

    def _static_for(self, a: torch.Tensor, b: int, slot: tuple) -> torch.Tensor:
        """The static input for argument a: the static buffer a is the first rows of (read in place), else the
        input buffer of this argument `slot` (piece name, position) for the bucket, shared by the layers' pieces of
        that name: each replay fills it first and nothing reads it after (a decode round's gathered keys, ~1.3 MB
        a row, would otherwise be held once per layer and bucket)."""
        s = self._static.get(a.data_ptr())
        if (s is not None and s.shape[0] == b and s.shape[1:] == a.shape[1:] and s.dtype == a.dtype
                and s.stride() == a.stride()):
            return s
        k = (slot, b, tuple(a.shape[1:]), a.dtype, a.device)
        s = self._inputs.get(k)
        if s is None:
            s = self._inputs[k] = torch.empty((b,) + tuple(a.shape[1:]), dtype=a.dtype, device=a.device)
        return s


def _fill(static: list[torch.Tensor | None], args: Args, n: int) -> None:
    """static[:n] = args; the padded rows repeat row 0 (a real row: finite, and the same experts)."""
    for s, a in zip(static, args):
        if s is None:
            if a is not None:
                raise ValueError("a piece's argument was None when it was captured")
            continue
        if a is None or a.shape[1:] != s.shape[1:] or a.dtype != s.dtype:
            raise ValueError(f"a piece's argument changed: {None if a is None else (a.dtype, list(a.shape))} "
                             f"against {(s.dtype, list(s.shape))}")
        if a.data_ptr() == s.data_ptr() and a.stride() == s.stride():
            continue   # a is the first rows of this very buffer (another piece's output, a round row buffer)
        s[:n].copy_(a)
        if n < s.shape[0]:
            s[n:].copy_(a[:1].expand_as(s[n:]))
