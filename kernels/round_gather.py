"""Gather rows from each sequence's own tensor in one launch: a decode round's top-k compressed KV (issue 8).

Reference: for each sequence b (rows b*n .. b*n+n-1 of the round), `torch.index_select(src_b, 0, idx[rows])`, with
-1 giving a zero row: one launch per sequence on the torch path. Here the sequences' tensors are reached through a
table of their addresses (int64 data pointers, float32 rows of D contiguous values), so the round's gather is one
launch whatever the number of sequences, and the table is data (a CUDA graph can replay it with new addresses).
A copy: the values are the source's bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_inputs

BLOCK_K = 16


@triton.jit(do_not_specialize=["n", "K", "ts", "ks"])
def _gather_rows_kernel(tab_ptr, idx_ptr, out_ptr, n, K, ts, ks, D: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1) * BK + tl.arange(0, BK)
    base = tl.load(tab_ptr + (row // n) * ts).to(tl.pointer_type(tl.float32))
    kmask = kb < K
    ix = tl.load(idx_ptr + row * ks + kb, mask=kmask, other=-1).to(tl.int64)
    d = tl.arange(0, D)
    ok = ix >= 0
    v = tl.load(base + ix[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    tl.store(out_ptr + (row * K + kb[:, None]) * D + d[None, :], v, mask=kmask[:, None])


def gather_rows(table: torch.Tensor, idx: torch.Tensor, d: int) -> torch.Tensor:
    """table [B] int64 (data pointers of B float32 [*, d] contiguous tensors), idx [B*n, K] int64 (a row of that
    row's sequence's tensor, -1: zeros) -> [B*n, K, d] float32. d must be a power of two. table and idx may be
    column slices of a larger table (a round's metadata): strided, read in place."""
    N, K = idx.shape
    B = table.shape[0]
    if d & (d - 1) or table.dtype != torch.int64 or table.dim() != 1 or (B and N % B):
        raise ValueError(f"gather_rows: table {list(table.shape)} {table.dtype}, idx {list(idx.shape)}, d {d}")
    out = torch.empty((N, K, d), dtype=torch.float32, device=idx.device)
    if N == 0 or K == 0:
        return out
    if idx.stride(1) != 1:
        idx = idx.contiguous()
    grid = (N, triton.cdiv(K, BLOCK_K))
    _gather_rows_kernel[grid](table, idx, out, N // B, K, table.stride(0), idx.stride(0), D=d, BK=BLOCK_K,
                              **pdl.options(out))
    return out


@triton.jit(do_not_specialize=["ts", "ss"])
def _scatter_rows_kernel(tab_ptr, slot_ptr, src_ptr, ts, ss, D: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row * ss)
    base = tl.load(tab_ptr + row * ts).to(tl.pointer_type(tl.float32))
    d = tl.arange(0, D)
    ok = (slot + d * 0) >= 0
    v = tl.load(src_ptr + row * D + d, mask=ok, other=0.0)
    tl.store(base + slot * D + d, v, mask=ok)


def scatter_rows(table: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """The inverse of gather_rows with one destination per row: row r of src [N, d] (float32, contiguous) goes to
    row slots[r] of the tensor whose address is table[r] (int64 [N]); slots[r] < 0 writes nothing (a masked row). A
    decode round's window-ring writes, every sequence's ring reached through its address, so the launch (and a CUDA
    graph holding it) is the same whatever the round's sequences and their tensors. table and slots may be strided
    (columns of the round's metadata). Rows that name the same place
    must carry the same bits (a round's padded rows repeat row 0). d must be a power of two."""
    N = src.shape[0]
    d = src.shape[1] if src.dim() == 2 else 0
    if (src.dim() != 2 or d & (d - 1) or table.dtype != torch.int64 or slots.dtype != torch.int64
            or table.shape != (N,) or slots.shape != (N,) or src.dtype != torch.float32):
        raise ValueError(f"scatter_rows: table {list(table.shape)} {table.dtype}, slots {list(slots.shape)} "
                         f"{slots.dtype}, src {list(src.shape)} {src.dtype}")
    if N:
        _scatter_rows_kernel[(N,)](table, slots, src.contiguous(), table.stride(0), slots.stride(0), D=d,
                                   **pdl.options(src))


@triton.jit(do_not_specialize=["W", "T", "rts", "ss", "cts", "ts", "ps"])
def _round_keys_kernel(ring_tab, rsel_ptr, nsel_ptr, kv_ptr, pos_ptr, comp_tab, topk_ptr, keys_ptr, valid_ptr, W, T,
                       rts, ss, cts, ts, ps, D: tl.constexpr, BK: tl.constexpr, COMP: tl.constexpr, PDL: tl.constexpr):
    """Row r's key set: its W window keys (from the round's own rows kv where nsel >= 0, else from its ring through
    ring_tab[r] at rsel, -1: zeros) then its T compressed entries (through comp_tab[r] at topk, -1: zeros), and
    their validity (pos >= 0; topk >= 0). rsel, nsel and pos share the row stride ss; ps: pos's."""
    wait_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BK + tl.arange(0, BK)
    K = W + T
    in_k = j < K
    win = j < W
    d = tl.arange(0, D)
    ns = tl.load(nsel_ptr + r * ss + j, mask=win, other=-1).to(tl.int64)
    rs = tl.load(rsel_ptr + r * ss + j, mask=win, other=-1).to(tl.int64)
    ring = tl.load(ring_tab + r * rts).to(tl.pointer_type(tl.float32))
    from_kv = win & (ns >= 0)
    from_ring = win & (ns < 0) & (rs >= 0)
    v = tl.load(kv_ptr + ns[:, None] * D + d[None, :], mask=from_kv[:, None], other=0.0)
    v = tl.where(from_ring[:, None], tl.load(ring + rs[:, None] * D + d[None, :], mask=from_ring[:, None], other=0.0),
                 v)
    ok = tl.load(pos_ptr + r * ps + j, mask=win, other=-1) >= 0
    if COMP:
        t = j - W
        cm = in_k & (j >= W)
        ix = tl.load(topk_ptr + r * ts + t, mask=cm, other=-1).to(tl.int64)
        comp = tl.load(comp_tab + r * cts).to(tl.pointer_type(tl.float32))
        from_comp = cm & (ix >= 0)
        v = tl.where(from_comp[:, None], tl.load(comp + ix[:, None] * D + d[None, :], mask=from_comp[:, None],
                                                 other=0.0), v)
        ok = tl.where(win, ok, ix >= 0)
    tl.store(keys_ptr + (r * K + j[:, None]) * D + d[None, :], v, mask=in_k[:, None])
    tl.store(valid_ptr + r * K + j, ok.to(tl.int8), mask=in_k)


def round_keys(ring_table: torch.Tensor, rsel: torch.Tensor, nsel: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor,
               comp_table: torch.Tensor | None, topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode round's key sets in one launch: row r's window keys [W] (kv[nsel] where nsel >= 0, else its ring's
    row rsel through ring_table[r], -1: a zero row) then, with comp_table and topk [N, T], its compressed entries
    (row topk of the tensor at comp_table[r], -1: a zero row) -> (keys [N, W + T, D] float32, valid [N, W + T] bool:
    pos >= 0 for the window, topk >= 0 after). A copy: the sources' bits. Tables and selections may be strided
    columns of the round's metadata (int64); kv float32 [*, D] contiguous, D a power of two."""
    N, W = nsel.shape
    D = kv.shape[1]
    T = 0 if topk is None else topk.shape[1]
    if (D & (D - 1) or kv.dtype != torch.float32 or rsel.shape != (N, W) or pos.shape != (N, W)
            or rsel.stride() != nsel.stride() or (topk is not None and (comp_table is None or topk.shape[0] != N))):
        raise ValueError(f"round_keys: rsel {list(rsel.shape)}, nsel {list(nsel.shape)}, kv {list(kv.shape)}, "
                         f"pos {list(pos.shape)}, topk {None if topk is None else list(topk.shape)}")
    keys = torch.empty((N, W + T, D), dtype=torch.float32, device=kv.device)
    valid = torch.empty((N, W + T), dtype=torch.bool, device=kv.device)
    if N == 0 or W + T == 0:
        return keys, valid
    kv = kv.contiguous()
    if topk is not None and topk.stride(1) != 1:
        topk = topk.contiguous()
    comp = comp_table if comp_table is not None else ring_table
    tk = topk if topk is not None else nsel
    _round_keys_kernel[(N, triton.cdiv(W + T, BLOCK_K))](
        ring_table, rsel, nsel, kv, pos, comp, tk, keys, valid.view(torch.int8), W, T, ring_table.stride(0),
        nsel.stride(0), comp.stride(0), tk.stride(0), pos.stride(0), D=D, BK=BLOCK_K, COMP=topk is not None,
        **pdl.options(keys))
    return keys, valid
