"""Top-k selections in one launch each: the MoE router's pick and the indexer's key selection. Selection only (no
arithmetic on the values), so each is bitwise the torch function it replaces, on any device.

- `router_topk(scores, k)` = `dsv41.model.linear.stable_topk` for a float32 [n, E] (E <= 1024): each row's k largest
  values, descending, ties to the lower index, as (values, ids int64). One program per row block: the row is loaded
  once and the pick repeated k times (the maximum of the entries not yet taken, then the lowest index holding it).
  torch's CUDA path runs a full stable radix sort of each row (radixSortKVInPlace) for 6 of 384 entries.
- `select_topk(scores, k)` = `dsv41.model.indexer.select_topk`: the indices of each row's k largest entries above
  -inf (value descending, ties to the lower index), listed in ascending index order, -1 padded to width k. One program
  per row: a radix select over the order-preserving uint32 image of the float32 bits (three passes of an 11-, 11-
  and 10-bit digit's histogram over the entries whose higher digits equal the prefix found so far) finds the k-th value t and how many of
  the entries equal to t the pick holds; one more pass lists the entries above t and the first `need` entries equal
  to t in index order (prefix counts within each block, running counts across blocks). torch's path is three
  torch.topk calls (radix sorts + gathers) and the compares between them.

Comparison semantics, as torch's compares and the CPU sort have them: -0.0 and +0.0 are one value (the key maps
both to +0.0's image); values are NaN-free (scores and router logits are finite; the indexer pads with -inf).
A row's result depends on its row only, whatever the row count.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROUTER_MAX_E = 1024          # the router's row is held in registers: E up to this (V4.1: 384 or 256)
ROUTER_ROWS = 4              # rows per program of the router pick
SELECT_BLOCK = 2048          # entries per step of the indexer selection's passes
SELECT_WARPS = 8
NEG_INF_KEY = tl.constexpr(0x007FFFFF)   # the key of -inf: entries at or below it are never taken


@triton.jit
def _router_topk_kernel(s_ptr, val_ptr, ids_ptr, n, E, K: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < n
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BE)
    valid = ok[:, None] & (cols < E)[None, :]
    v = tl.load(s_ptr + rows[:, None] * E + cols[None, :], mask=valid, other=float("-inf"))
    v = tl.where(v == 0.0, 0.0, v)               # -0.0 and +0.0: one value (the sort compares them equal)
    left = valid                                 # entries not yet taken
    for j in tl.static_range(K):
        m = tl.max(tl.where(left, v, float("-inf")), axis=1)
        i = tl.min(tl.where(left & (v == m[:, None]), cols[None, :], BE), axis=1)
        left = left & (cols[None, :] != i[:, None])
        i = tl.minimum(i, E - 1)                 # (rows past n: a harmless in-row address, nothing stored)
        val = tl.load(s_ptr + rows * E + i, mask=ok, other=0.0)   # the stored value itself (its sign of zero)
        tl.store(val_ptr + rows * K + j, val, mask=ok)
        tl.store(ids_ptr + rows * K + j, i.to(tl.int64), mask=ok)


def router_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values [n, k] float32, ids [n, k] int64): bitwise `stable_topk(scores, k)` for a float32 [n, E] with
    k <= E <= ROUTER_MAX_E; None where it does not apply (the caller's torch function runs)."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or not 0 < k <= scores.shape[1] <= ROUTER_MAX_E:
        return None
    if scores.device.type != "cuda" and not INTERPRET:
        return None
    s = scores.contiguous()
    n, E = s.shape
    vals = torch.empty((n, k), dtype=torch.float32, device=s.device)
    ids = torch.empty((n, k), dtype=torch.long, device=s.device)
    if n:
        be = triton.next_power_of_2(E)
        _router_topk_kernel[(triton.cdiv(n, ROUTER_ROWS),)](s, vals, ids, n, E, K=k, BE=be, BR=ROUTER_ROWS,
                                                          num_warps=4 if be >= 512 else 2)
    return vals, ids


@triton.jit
def _key(x):
    """The order-preserving uint32 image of float32 x (a larger x, a larger key; -0.0 as +0.0)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, ~b, b | 0x80000000)


@triton.jit
def _pick_bin(hist, bins, want, prefix, shift):
    """The bin holding the want-th largest of a digit's histogram (the highest bin whose count from the top reaches
    want): (want less the entries in the bins above it, prefix with the bin's digit at `shift`)."""
    at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
    b = tl.max(tl.where(at_or_above >= want, bins, 0))
    return want - tl.sum(tl.where(bins > b, hist, 0)), prefix | (b.to(tl.uint32) << shift)


@triton.jit
def _select_topk_kernel(s_ptr, out_ptr, T, k, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = s_ptr + r * T
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 2048)
    # the k-th key by radix select, a digit at a time from the top: `prefix` holds the digits found, `want` how many
    # of the entries matching it the pick still needs (the entries above the prefix are all taken)
    prefix = tl.zeros((), dtype=tl.uint32)
    valid_n = tl.zeros((), dtype=tl.int32)
    want = tl.full((), 0, tl.int32)
    for p in tl.static_range(3):
        shift = 21 - 11 * p + p // 2                   # digits: bits 31..21, 20..10, 9..0
        width = 11 - p // 2
        hist = tl.zeros((2048,), dtype=tl.int32)
        for c in range(0, T, BLOCK):
            idx = c + offs
            key = _key(tl.load(row + idx, mask=idx < T, other=float("-inf")))
            m = key > NEG_INF_KEY
            if p > 0:
                m = m & ((key >> (shift + width)) == (prefix >> (shift + width)))
            hist += tl.histogram(((key >> shift) & ((1 << width) - 1)).to(tl.int32), 2048, mask=m)
        if p == 0:
            valid_n = tl.sum(hist)
            want = tl.maximum(tl.minimum(valid_n, k), 1)
        want, prefix = _pick_bin(hist, bins, want, prefix, shift)
    taken = tl.minimum(valid_n, k)
    # every valid entry when the row holds no more than k: the threshold drops to -inf's key, no ties
    thresh = tl.where(valid_n <= k, NEG_INF_KEY, prefix)
    need = tl.where(valid_n <= k, 0, want)
    # the pick in index order: above the threshold, or the first `need` entries equal to it
    pos = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    orow = out_ptr + r * k
    for c in range(0, T, BLOCK):
        idx = c + offs
        key = _key(tl.load(row + idx, mask=idx < T, other=float("-inf")))
        tie = (key == thresh) & (idx < T)
        tie_i = tie.to(tl.int32)
        tie_rank = ties + tl.cumsum(tie_i, axis=0) - tie_i
        take = ((key > thresh) | (tie & (tie_rank < need))) & (idx < T)
        take_i = take.to(tl.int32)
        at = pos + tl.cumsum(take_i, axis=0) - take_i
        tl.store(orow + at, idx.to(tl.int64), mask=take)
        pos += tl.sum(take_i)
        ties += tl.sum(tie_i)
    for c in range(0, k, BLOCK):                  # -1 past the pick
        j = c + offs
        tl.store(orow + j, tl.full((BLOCK,), -1, tl.int64), mask=(j >= taken) & (j < k))


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor | None:
    """[n, k] int64: bitwise `indexer.select_topk(scores, k)` for a float32 [n, T]; None where it does not apply
    (the caller's torch function runs)."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or k <= 0 or scores.shape[1] >= 2 ** 31 - SELECT_BLOCK:
        return None
    if scores.device.type != "cuda" and not INTERPRET:
        return None
    s = scores.contiguous()
    n, T = s.shape
    out = torch.empty((n, k), dtype=torch.long, device=s.device)
    if n:
        _select_topk_kernel[(n,)](s, out, T, k, BLOCK=SELECT_BLOCK, num_warps=SELECT_WARPS)
    return out
