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

BLOCK_K = 16


@triton.jit(do_not_specialize=["n", "K", "ts", "ks"])
def _gather_rows_kernel(tab_ptr, idx_ptr, out_ptr, n, K, ts, ks, D: tl.constexpr, BK: tl.constexpr):
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
    _gather_rows_kernel[grid](table, idx, out, N // B, K, table.stride(0), idx.stride(0), D=d, BK=BLOCK_K)
    return out


@triton.jit(do_not_specialize=["ts", "ss"])
def _scatter_rows_kernel(tab_ptr, slot_ptr, src_ptr, ts, ss, D: tl.constexpr):
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
        _scatter_rows_kernel[(N,)](table, slots, src.contiguous(), table.stride(0), slots.stride(0), D=d)
