"""Top-k selections in one launch each: the MoE router's pick and the indexer's key selection. Selection only (no
arithmetic on the values), so each is bitwise the torch function it replaces, on any device.

- `router_topk(scores, k)` = `dsv41.model.linear.stable_topk` for a float32 [n, E] (E <= 1024): each row's k largest
  values, descending, ties to the lower index, as (values, ids int64). One program per row block: the row is loaded
  once and the pick repeated k times (the maximum of the entries not yet taken, then the lowest index holding it).
  torch's CUDA path runs a full stable radix sort of each row (radixSortKVInPlace) for 6 of 384 entries.
- `select_topk(scores, k)` = `dsv41.model.indexer.select_topk`: the indices of each row's k largest entries above
  -inf (value descending, ties to the lower index), listed in ascending index order, -1 padded to width k. A row
  of up to REG_T entries (a decode round's up to 4K compressed keys) is one program's registers: the k-th largest
  key found two bits at a time by counts (sixteen reductions), then the compaction. Longer rows: a radix
  select over the order-preserving uint32 image of the float32 bits (three passes of an 11-, 11- and 10-bit digit's
  histogram over the entries whose higher digits equal the prefix found so far) finds the k-th value t and how many
  of the entries equal to t the pick holds; one more pass lists the entries above t and the first `need` entries
  equal to t in index order (prefix counts within each block, running counts across blocks). One program per row;
  a row of more than SPLIT_T entries in SPLIT_CHUNK-entry chunks, a program each (the histograms summed across
  them, each chunk's place in the pick from the counts of the chunks before it: five launches). torch's path is
  three torch.topk calls (radix sorts + gathers) and the compares between them.

Comparison semantics, as torch's compares and the CPU sort have them: -0.0 and +0.0 are one value (the key maps
both to +0.0's image; torch's CUDA radix sort may order them, but the router's s + bias is never -0.0: s >= +0.0);
values are NaN-free (scores and router logits are finite; the indexer pads with -inf). A row's result depends on
its row only, whatever the row count.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_inputs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROUTER_MAX_E = 1024          # the router's row is held in registers: E up to this (V4.1: 384 or 256)
ROUTER_ROWS = 4              # rows per program of the router pick
SELECT_BLOCK = 2048          # entries per step of the indexer selection's passes
SELECT_WARPS = 8
RADIX_BITS = 11              # the select's digit: 11 bits (3 passes, 2048 bins) or 8 (4 passes, 256 bins)
REG_T = 4096                 # rows up to this: _select_reg_kernel (the row in registers, 16 entries a thread)
SPLIT_T = 2048               # longer rows of the radix passes: SPLIT_CHUNK-entry chunks, a program each
SPLIT_CHUNK = 2048           # one block step per program and pass: a step is ~10 us of latency (topk.md)
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


@triton.constexpr_function
def _shift(p, bits):
    """The low bit of radix pass p's digit: digits of `bits` bits from the top, the last one narrower (11: bits
    31..21, 20..10, 9..0)."""
    return max(32 - bits * (p + 1), 0)


@triton.constexpr_function
def _width(p, bits):
    return 32 - bits * p - max(32 - bits * (p + 1), 0)


@triton.jit
def _digit_hist(row, lo, hi, prefix, p: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The histogram of radix pass p's digit over entries [lo, hi) of a row: the valid entries (above -inf) whose
    higher digits equal `prefix`'s."""
    shift: tl.constexpr = _shift(p, BITS)
    width: tl.constexpr = _width(p, BITS)
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros((1 << BITS,), dtype=tl.int32)
    for c in range(lo, hi, BLOCK):
        idx = c + offs
        key = _key(tl.load(row + idx, mask=idx < hi, other=float("-inf")))
        m = key > NEG_INF_KEY
        if p > 0:
            m = m & ((key >> (shift + width)) == (prefix >> (shift + width)))
        hist += tl.histogram(((key >> shift) & ((1 << width) - 1)).to(tl.int32), 1 << BITS, mask=m)
    return hist


@triton.jit
def _radix_step(hist, p: tl.constexpr, valid_n, want, prefix, k, BITS: tl.constexpr):
    """Radix pass p's digit from its histogram: the bin holding the want-th largest (the highest bin whose count
    from the top reaches want) -> (valid_n, want less the entries in the bins above it, prefix with the digit).
    Pass 0's histogram counts the row's valid entries: want starts at min(valid_n, k) (at least 1)."""
    if p == 0:
        valid_n = tl.sum(hist)
        want = tl.maximum(tl.minimum(valid_n, k), 1)
    bins = tl.arange(0, 1 << BITS)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
    b = tl.max(tl.where(at_or_above >= want, bins, 0))
    shift: tl.constexpr = _shift(p, BITS)
    return valid_n, want - tl.sum(tl.where(bins > b, hist, 0)), prefix | (b.to(tl.uint32) << shift)


@triton.jit
def _threshold(valid_n, want, prefix, k):
    """(thresh, need): the pick = the keys above thresh and the first `need` (in index order) equal to it; every
    valid entry when the row holds no more than k (thresh = -inf's key, no ties)."""
    few = valid_n <= k
    return tl.where(few, NEG_INF_KEY, prefix), tl.where(few, 0, want)


@triton.jit
def _state_from(hist_ptr, k, P: tl.constexpr, BITS: tl.constexpr):
    """The radix state after passes 0..P-1 from their histograms in global memory ([passes, 2^BITS] int32 of a
    row)."""
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.zeros((), dtype=tl.uint32)
    valid_n = tl.zeros((), dtype=tl.int32)
    want = tl.zeros((), dtype=tl.int32)
    for q in tl.static_range(P):
        valid_n, want, prefix = _radix_step(tl.load(hist_ptr + q * (1 << BITS) + bins), q, valid_n, want, prefix,
                                            k, BITS)
    return valid_n, want, prefix


@triton.jit
def _compact(row, orow, lo, hi, thresh, need, pos, ties, BLOCK: tl.constexpr):
    """Entries [lo, hi) of the pick written in index order from position `pos` (`ties`: the entries equal to
    thresh before lo)."""
    offs = tl.arange(0, BLOCK)
    for c in range(lo, hi, BLOCK):
        idx = c + offs
        key = _key(tl.load(row + idx, mask=idx < hi, other=float("-inf")))
        tie = (key == thresh) & (idx < hi)
        tie_i = tie.to(tl.int32)
        tie_rank = ties + tl.cumsum(tie_i, axis=0) - tie_i
        take = ((key > thresh) | (tie & (tie_rank < need))) & (idx < hi)
        take_i = take.to(tl.int32)
        at = pos + tl.cumsum(take_i, axis=0) - take_i
        tl.store(orow + at, idx.to(tl.int64), mask=take)
        pos += tl.sum(take_i)
        ties += tl.sum(tie_i)
    return pos


@triton.jit
def _pad(orow, taken, k, BLOCK: tl.constexpr):
    """-1 past the pick."""
    offs = tl.arange(0, BLOCK)
    for c in range(0, k, BLOCK):
        j = c + offs
        tl.store(orow + j, tl.full((BLOCK,), -1, tl.int64), mask=(j >= taken) & (j < k))


@triton.jit
def _select_topk_kernel(s_ptr, out_ptr, T, k, BITS: tl.constexpr, BLOCK: tl.constexpr, ALL: tl.constexpr):
    """One program per row: the radix passes, the compaction, the padding. ALL (T <= k: every valid entry is
    picked, as _threshold's `few` case): the compaction alone, no radix pass."""
    r = tl.program_id(0).to(tl.int64)
    row = s_ptr + r * T
    orow = out_ptr + r * k
    zero = tl.zeros((), dtype=tl.int32)
    if ALL:
        taken = _compact(row, orow, 0, T, NEG_INF_KEY, zero, zero, zero, BLOCK)
    else:
        prefix = tl.zeros((), dtype=tl.uint32)
        valid_n = zero
        want = zero
        for p in tl.static_range((32 + BITS - 1) // BITS):
            valid_n, want, prefix = _radix_step(_digit_hist(row, 0, T, prefix, p, BITS, BLOCK), p, valid_n, want,
                                                prefix, k, BITS)
        thresh, need = _threshold(valid_n, want, prefix, k)
        taken = _compact(row, orow, 0, T, thresh, need, zero, zero, BLOCK)
    _pad(orow, taken, k, BLOCK)


@triton.jit
def _select_reg_kernel(s_ptr, out_ptr, T, k, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row of T <= BLOCK entries (REG_T), the row held in registers: the k-th largest key found
    two bits at a time from the top (sixteen steps, each one reduction: the counts of entries at or above the three
    candidates packed into one int64 sum), then the radix form's compaction (one step: the row re-read). The same
    pick as the radix passes (integers only, exact); their tl.histogram over 2048 bins took ~10 us a pass on the
    H200 (three passes, and five launches for a row of more than SPLIT_T entries)."""
    wait_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < T
    key = _key(tl.load(s_ptr + r * T + offs, mask=inside, other=float("-inf")))
    valid_n = tl.sum((key > NEG_INF_KEY).to(tl.int32))
    want = tl.minimum(valid_n, k)
    t = tl.zeros((), dtype=tl.uint32)
    for b in tl.static_range(15, -1, -1):
        d1 = t | (tl.full((), 1, tl.uint32) << (2 * b))
        d2 = t | (tl.full((), 2, tl.uint32) << (2 * b))
        d3 = d1 | d2
        packed = tl.sum((key >= d1).to(tl.int64) + ((key >= d2).to(tl.int64) << 16)
                        + ((key >= d3).to(tl.int64) << 32))
        t = tl.where((packed >> 32) >= want, d3,
                     tl.where(((packed >> 16) & 0xFFFF) >= want, d2, tl.where((packed & 0xFFFF) >= want, d1, t)))
    thresh, need = _threshold(valid_n, want - tl.sum((key > t).to(tl.int32)), t, k)
    orow = out_ptr + r * k
    zero = tl.zeros((), dtype=tl.int32)
    _pad(orow, _compact(s_ptr + r * T, orow, 0, T, thresh, need, zero, zero, BLOCK), k, BLOCK)


@triton.jit
def _split_hist_kernel(s_ptr, hist_ptr, T, k, CHUNK, P: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Radix pass P of a long row, program (row, chunk): the chunk's digit histogram added to the row's (integer
    atomics: the sum does not depend on their order)."""
    r = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * CHUNK
    NP: tl.constexpr = (32 + BITS - 1) // BITS
    hrow = hist_ptr + r * (NP << BITS)
    valid_n, want, prefix = _state_from(hrow, k, P, BITS)
    hist = _digit_hist(s_ptr + r * T, lo, tl.minimum(lo + CHUNK, T), prefix, P, BITS, BLOCK)
    bins = tl.arange(0, 1 << BITS)
    tl.atomic_add(hrow + (P << BITS) + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _split_count_kernel(s_ptr, hist_ptr, cnt_ptr, T, k, CHUNK, C, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): how many of the chunk's entries lie above the threshold and how many equal it."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    NP: tl.constexpr = (32 + BITS - 1) // BITS
    valid_n, want, prefix = _state_from(hist_ptr + r * (NP << BITS), k, NP, BITS)
    thresh, need = _threshold(valid_n, want, prefix, k)
    row = s_ptr + r * T
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, T)
    offs = tl.arange(0, BLOCK)
    above = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for b in range(lo, hi, BLOCK):
        idx = b + offs
        key = _key(tl.load(row + idx, mask=idx < hi, other=float("-inf")))
        above += tl.sum((key > thresh).to(tl.int32))
        ties += tl.sum(((key == thresh) & (idx < hi)).to(tl.int32))
    tl.store(cnt_ptr + (r * C + c) * 2, above)
    tl.store(cnt_ptr + (r * C + c) * 2 + 1, ties)


@triton.jit
def _split_write_kernel(s_ptr, hist_ptr, cnt_ptr, out_ptr, T, k, CHUNK, C, BITS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's part of the pick, from the position the chunks before it fill (their
    entries above the threshold, and their ties up to `need`)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    NP: tl.constexpr = (32 + BITS - 1) // BITS
    valid_n, want, prefix = _state_from(hist_ptr + r * (NP << BITS), k, NP, BITS)
    thresh, need = _threshold(valid_n, want, prefix, k)
    offs = tl.arange(0, 1024)
    above = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for j in range(0, c, 1024):
        m = j + offs < c
        above += tl.sum(tl.load(cnt_ptr + (r * C + j + offs) * 2, mask=m, other=0))
        ties += tl.sum(tl.load(cnt_ptr + (r * C + j + offs) * 2 + 1, mask=m, other=0))
    orow = out_ptr + r * k
    lo = c * CHUNK
    _compact(s_ptr + r * T, orow, lo, tl.minimum(lo + CHUNK, T), thresh, need, above + tl.minimum(ties, need),
             ties, BLOCK)
    if c == 0:
        _pad(orow, tl.minimum(valid_n, k), k, BLOCK)


def select_topk(scores: torch.Tensor, k: int, split: bool | None = None, bits: int | None = None) -> torch.Tensor | None:
    """[n, k] int64: bitwise `indexer.select_topk(scores, k)` for a float32 [n, T]; None where it does not apply
    (the caller's torch function runs). A row of up to REG_T entries: one program, the row in registers
    (_select_reg_kernel). Longer: the radix passes; a row of more than SPLIT_T entries is split into
    SPLIT_CHUNK-entry chunks, a program each, over five or six launches (the radix passes, the chunks' counts, the
    compaction), a shorter row one program's. `split` or `bits` (the radix digit's width, RADIX_BITS; 8 or 11) ask
    for the radix form (split: chunked or not); every form gives the same result (the bench times them)."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or k <= 0 or scores.shape[1] >= 2 ** 31 - SPLIT_CHUNK:
        return None
    if scores.device.type != "cuda" and not INTERPRET:
        return None
    s = scores.contiguous()
    n, T = s.shape
    out = torch.empty((n, k), dtype=torch.long, device=s.device)
    if n == 0:
        return out
    if split is None and bits is None and T <= REG_T:
        _select_reg_kernel[(n,)](s, out, T, k, BLOCK=max(16, triton.next_power_of_2(T)), num_warps=SELECT_WARPS,
                                 **pdl.options(s))
        return out
    bits = RADIX_BITS if bits is None else bits
    if T <= k or not (T > SPLIT_T if split is None else split):    # (T <= k: every valid entry, one pass)
        _select_topk_kernel[(n,)](s, out, T, k, BITS=bits, BLOCK=SELECT_BLOCK, ALL=T <= k, num_warps=SELECT_WARPS)
        return out
    C = triton.cdiv(T, SPLIT_CHUNK)
    hist = torch.zeros((n, -(-32 // bits), 1 << bits), dtype=torch.int32, device=s.device)
    cnt = torch.empty((n, C, 2), dtype=torch.int32, device=s.device)
    for p in range(hist.shape[1]):
        _split_hist_kernel[(n, C)](s, hist, T, k, SPLIT_CHUNK, P=p, BITS=bits, BLOCK=SELECT_BLOCK,
                                   num_warps=SELECT_WARPS)
    _split_count_kernel[(n, C)](s, hist, cnt, T, k, SPLIT_CHUNK, C, BITS=bits, BLOCK=SELECT_BLOCK,
                                num_warps=SELECT_WARPS)
    _split_write_kernel[(n, C)](s, hist, cnt, out, T, k, SPLIT_CHUNK, C, BITS=bits, BLOCK=SELECT_BLOCK,
                                num_warps=SELECT_WARPS)
    return out
