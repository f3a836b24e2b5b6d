"""kernels/sparse_attn.py against `Attention.attend` (dsv41/model/attention.py) on the gathered key sets.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; with one (marker gpu) at
V4.1 shapes (64 heads, D 512, W 128 + top-k 512 keys). The output is a convex combination of the row's latents, so
errors are stated against max|pool|:
- precise=True (q, k, P as bf16 hi + lo): against the float32 reference, max|o - ref| <= 5e-5 · max|pool|
  (rounding q, k or P to bf16 alone costs ~3e-3);
- precise=False (the release's bf16 numerics): against the reference on bf16-rounded q and pool only P's bf16
  rounding (2^-9 relative per weight) and the fp32 order differ, <= 2e-3 · max|pool|; against the plain float32
  reference q·k also sees the rounding of q and k, <= 1e-2 · max|pool|.
Batch invariance: a row's output is bit-identical alone and among other rows.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from dsv41.model.attention import Attention
from kernels.sparse_attn import sparse_attn

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _attention(sink, dim):
    e = torch.empty(0)
    return Attention(e, e, e, e, e, sink, e, e, head_dim=dim, o_lora=1, eps=1e-20)


def _case(n, heads, dim, pool_rows, window, topk, seed):
    """q, a pool of latents, and per-row key sets in attention.py's order: the window positions (ascending, the
    first rows of a sequence with masked leading slots), then top-k compressed entries (masked tail)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=g) * 2
    pool = torch.randn(pool_rows, dim, generator=g)
    pos = torch.randint(0, pool_rows - topk, (n,), generator=g)
    win = pos[:, None] - window + 1 + torch.arange(window)[None, :]
    win = torch.where(win >= 0, win, -1)
    comp = torch.sort(torch.randint(0, pool_rows, (n, topk), generator=g), dim=1).values
    keep = torch.randint(0, topk + 1, (n,), generator=g)
    comp = torch.where(torch.arange(topk)[None, :] < keep[:, None], comp, -1)
    idx = torch.cat([win, comp], dim=1)
    sink = torch.randn(heads, generator=g)
    return q, pool, idx, sink


def _close(o, q, pool, idx, sink, precise=False):
    att = _attention(sink.cpu(), q.shape[2])
    o = o.cpu()
    q, pool, idx = q.cpu(), pool.cpu(), idx.cpu()
    big = pool.abs().max().item()
    ref = att.attend(q, pool[idx.clamp(0)], idx >= 0)
    if precise:
        assert (o - ref).abs().max().item() <= 5e-5 * big
        return
    refb = att.attend(q.bfloat16().float(), pool.bfloat16().float()[idx.clamp(0)], idx >= 0)
    assert (o - refb).abs().max().item() <= 2e-3 * big
    assert (o - ref).abs().max().item() <= 1e-2 * big


@pytest.mark.parametrize("precise", [True, False])
@pytest.mark.parametrize("n", [1, 3, 16])
def test_matches_reference(n, precise):
    q, pool, idx, sink = _case(n, 16, 64, 300, 24, 80, seed=n)   # 104 keys: two blocks, the second partial
    o = sparse_attn(q.to(DEV), pool.to(DEV), idx.to(DEV), sink.to(DEV), 64 ** -0.5, precise=precise)
    assert o.dtype == torch.float32 and o.shape == q.shape
    _close(o, q, pool, idx, sink, precise)


def test_all_masked_row_is_zero_and_rows_are_batch_invariant():
    q, pool, idx, sink = _case(6, 32, 32, 200, 16, 48, seed=9)
    idx[2] = -1                                                   # only the sink: softmax weight 1 on nothing
    o = sparse_attn(q.to(DEV), pool.to(DEV), idx.to(DEV), sink.to(DEV), 32 ** -0.5)
    _close(o, q, pool, idx, sink)
    assert bool((o[2] == 0).all())
    for r in (0, 5):
        alone = sparse_attn(q[r:r + 1].to(DEV), pool.to(DEV), idx[r:r + 1].to(DEV), sink.to(DEV), 32 ** -0.5)
        assert torch.equal(alone[0], o[r])


def test_bf16_inputs_and_bad_input():
    q, pool, idx, sink = _case(2, 16, 32, 64, 8, 8, seed=2)
    q, pool, idx, sink = q.to(DEV), pool.to(DEV), idx.to(DEV), sink.to(DEV)
    assert torch.equal(sparse_attn(q.bfloat16(), pool.bfloat16(), idx, sink, 0.1), sparse_attn(q, pool, idx, sink, 0.1))
    with pytest.raises(ValueError):
        sparse_attn(q[:, :8], pool, idx, sink[:8], 0.1)           # heads not a multiple of 16
    with pytest.raises(ValueError):
        sparse_attn(q, pool, idx.float(), sink, 0.1)
    with pytest.raises(ValueError):
        sparse_attn(q, pool[:, :16], idx, sink, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("precise", [True, False])
def test_v41_shapes_on_gpu(precise):
    heads, dim, window, topk = 64, 512, 128, 512
    q, pool, idx, sink = (t.cuda() for t in _case(2048, heads, dim, 8192, window, topk, seed=4))
    big = sparse_attn(q, pool, idx, sink, dim ** -0.5, precise=precise)
    pick = [0, 1, 1000, 2047]
    _close(big[pick], q[pick], pool, idx[pick], sink, precise)
    for n in (1, 3, 16, 64):
        o = sparse_attn(q[:n], pool, idx[:n], sink, dim ** -0.5, precise=precise)
        assert torch.equal(o, big[:n]), f"rows 0..{n} differ from the same rows among 2048"
