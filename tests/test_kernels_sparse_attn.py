"""kernels/sparse_attn.py against `Attention.attend` (dsv41/model/attention.py) on the gathered key sets.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; with one (marker gpu) at
V4.1 shapes (64 heads, D 512, W 128 + top-k 512 keys). The output is a convex combination of the row's latents, so
errors are stated against max|pool|:
- precise=True (q, k, P as bf16 hi + lo): against the float32 reference, max|o - ref| <= 5e-5 · max|pool|
  (rounding q, k or P to bf16 alone costs ~3e-3);
- precise=False (the release's bf16 numerics): against the reference on bf16-rounded q and pool only P's bf16
  rounding (2^-9 relative per weight) and the fp32 order differ, <= 2e-3 · max|pool|; against the plain float32
  reference q·k also sees the rounding of q and k, <= 1e-2 · max|pool|.
Batch invariance: a row's output is bit-identical alone and among other rows, in either form (split: a program per
64-key split and a fold kernel; whole: a program per row folding its splits as it goes), and a head's output is
bit-identical whichever heads share the launch (one launch over every TP shard == a launch per shard).
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


@pytest.mark.parametrize("precise", [False, True])
def test_forms_heads_and_rows_give_the_same_bits(precise):
    """Rows 1..64 (10 in the precise mode, the interpreter's time) with random non-zero inputs, masked slots,
    whole splits masked (the first split of a row, all but the first of another) and an all-masked row: the split
    form == the whole form bit for bit, rows alone == among the others, and the two 16-head halves launched apart
    == the 32 heads in one launch."""
    n = 10 if precise else 64
    q, pool, idx, sink = _case(n, 32, 16, 300, 40, 96, seed=11 + precise)    # 136 keys: 3 splits, the last 8 wide
    idx[3] = -1
    idx[7, :64] = -1
    idx[9, 64:] = -1
    q, pool, idx, sink = q.to(DEV), pool.to(DEV), idx.to(DEV), sink.to(DEV)
    sc = 16 ** -0.5
    whole = sparse_attn(q, pool, idx, sink, sc, precise=precise, form="whole")
    split = sparse_attn(q, pool, idx, sink, sc, precise=precise, form="split")
    assert torch.equal(whole, split)
    assert torch.equal((whole == 0).all(-1).all(-1), (idx < 0).all(-1)) and bool((idx[3] < 0).all())
    _close(whole, q, pool, idx, sink, precise)
    for r0, r1 in ((0, 1), (7, 10), (n - 5, n)):
        for form in ("whole", "split"):
            part = sparse_attn(q[r0:r1], pool, idx[r0:r1], sink, sc, precise=precise, form=form)
            assert torch.equal(part, whole[r0:r1]), (r0, r1, form)
    for i in (0, 1):
        hs = slice(16 * i, 16 * i + 16)
        for form in ("whole", "split"):
            shard = sparse_attn(q[:10, hs].contiguous(), pool, idx[:10], sink[hs], sc, precise=precise, form=form)
            assert torch.equal(shard, whole[:10, hs]), (i, form)


def test_empty_key_set_gives_zeros():
    q, pool, idx, sink = _case(3, 16, 16, 40, 4, 4, seed=3)
    o = sparse_attn(q.to(DEV), pool.to(DEV), idx[:, :0].to(DEV), sink.to(DEV), 0.25)
    assert o.shape == q.shape and bool((o == 0).all())


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
    with pytest.raises(ValueError):
        sparse_attn(q, pool, idx, sink, 0.1, form="tiled")


@pytest.mark.gpu
@pytest.mark.parametrize("precise", [True, False])
def test_v41_shapes_on_gpu(precise):
    """V4.1 shapes (64 heads = 2 TP shards of 32, D 512, 128 window + 512 top-k keys): 2048 rows against the
    reference, and rows 1..64 == the same rows among 2048, in each form and each shard's own launch, bit for bit."""
    heads, dim, window, topk = 64, 512, 128, 512
    q, pool, idx, sink = (t.cuda() for t in _case(2048, heads, dim, 8192, window, topk, seed=4))
    idx[5] = -1
    sc = dim ** -0.5
    big = sparse_attn(q, pool, idx, sink, sc, precise=precise)
    pick = [0, 1, 5, 1000, 2047]
    _close(big[pick], q[pick], pool, idx[pick], sink, precise)
    assert bool((big[5] == 0).all())
    assert torch.equal(sparse_attn(q, pool, idx, sink, sc, precise=precise, form="split"), big)
    for n in (1, 3, 8, 16, 32, 64):
        o = sparse_attn(q[:n], pool, idx[:n], sink, sc, precise=precise)
        assert torch.equal(o, big[:n]), f"rows 0..{n} differ from the same rows among 2048"
        assert torch.equal(sparse_attn(q[:n], pool, idx[:n], sink, sc, precise=precise, form="whole"), o)
        for i in (0, 1):
            hs = slice(32 * i, 32 * i + 32)
            shard = sparse_attn(q[:n, hs].contiguous(), pool, idx[:n], sink[hs], sc, precise=precise)
            assert torch.equal(shard, o[:, hs]), f"shard {i} launched apart differs at {n} rows"
    bf = sparse_attn(q[:64].bfloat16(), pool.bfloat16(), idx[:64], sink, sc, precise=precise)
    assert torch.equal(sparse_attn(q.bfloat16(), pool.bfloat16(), idx, sink, sc, precise=precise)[:64], bf)


@pytest.mark.parametrize("topk,form", [(12, "split"), (12, "whole"), (13, None)])
def test_keys_held_row_by_row_equal_the_index_form_bitwise(topk, form):
    """A decode round's gathered keys [n, K, D] with their bool validity (no index tensor; K a multiple of 4: the
    validity read 4 bytes at a time; else the wrapper makes the indices) give the index form's bits, row by row."""
    n, heads, dim, window = 5, 32, 64, 8
    q, pool, idx, sink = _case(n, heads, dim, 40, window, topk, 7 + topk)
    q, pool, idx, sink = q.to(DEV), pool.to(DEV), idx.to(DEV), sink.to(DEV)
    keys = pool[idx.clamp(0)]                                        # [n, K, D] as the round gathers them
    valid = idx >= 0
    flat = torch.where(valid, torch.arange(idx.numel(), device=DEV).view(idx.shape), -1)
    want = sparse_attn(q, keys.reshape(-1, dim), flat, sink, 0.125, form=form)
    got = sparse_attn(q, keys, valid, sink, 0.125, form=form)
    assert torch.equal(got, want)
    alone = sparse_attn(q[2:3], keys[2:3], valid[2:3], sink, 0.125, form=form)
    assert torch.equal(alone[0], got[2])
    _close(got, q, pool, idx, sink)
    with pytest.raises(ValueError):
        sparse_attn(q, keys[:, :-1], valid, sink, 0.125)            # the keys must be the validity's


def test_the_op_set_attends_gathered_keys_in_one_launch():
    """Ops.attend_rows: the kernel's row-by-row form where it applies; the reference's (indices) the same function."""
    from dsv41.model.ops import cuda_ops, reference_ops
    n, heads, dim = 3, 16, 32
    q, pool, idx, sink = _case(n, heads, dim, 30, 4, 8, 3)
    keys, valid = pool[idx.clamp(0)], idx >= 0
    ops, sc = cuda_ops(), dim ** -0.5
    got = ops.attend_rows(q.to(DEV), keys.to(DEV), valid.to(DEV), sink.to(DEV), sc)
    assert torch.equal(got, sparse_attn(q.to(DEV), keys.to(DEV), valid.to(DEV), sink.to(DEV), sc))
    ref = reference_ops().attend_rows(q, keys, valid, sink, sc)
    assert torch.equal(ref, _attention(sink, dim).attend(q, keys, valid))
    _close(got, q, pool, idx, sink)
