"""kernels/round_gather.round_keys (a decode round's key sets in one launch: the window from the round's own rows or
the rings, then the compressed entries) against the CUDA op set's composition (the address-table gathers, where,
cat), bitwise: a copy (a masked slot a zero row, as the gathers give it; the reference's gathers pick row 0 there,
which attention weighs by an exact zero: the valid slots agree with it). Under TRITON_INTERPRET=1 on CPU, on CUDA
with a GPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model.device import address_table  # noqa: E402
from dsv41.model.ops import cuda_ops, reference_ops  # noqa: E402
from kernels import round_gather  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _round(B, n, W, T, D, seed):
    """B sequences of n rows each: rings [W, D], compressed buffers of different lengths, the round's kv, and a
    metadata-like table [N, M] whose column slices are the selections (as the model's round reads them)."""
    g = torch.Generator().manual_seed(seed)
    N = B * n
    rings = [torch.randn(W, D, generator=g).to(DEV) for _ in range(B)]
    comps = [torch.randn(5 + 7 * b, D, generator=g).to(DEV) for b in range(B)]
    kv = torch.randn(N, D, generator=g).to(DEV)
    nsel = torch.where(torch.rand(N, W, generator=g) < 0.3, torch.randint(0, N, (N, W), generator=g), -1)
    rsel = torch.where(torch.rand(N, W, generator=g) < 0.8, torch.randint(0, W, (N, W), generator=g), -1)
    pos = torch.where(torch.rand(N, W, generator=g) < 0.9, torch.randint(0, 99, (N, W), generator=g), -1)
    rsel = torch.where((pos >= 0) & (nsel < 0) & (rsel < 0), 3, rsel)        # a valid slot has a source
    topk = torch.stack([torch.where(torch.rand(T, generator=g) < 0.7,
                                    torch.randint(0, comps[r // n].shape[0], (T,), generator=g), -1)
                        for r in range(N)])
    meta = torch.cat([rsel, nsel, pos, topk], dim=1).to(DEV)                    # strided column slices
    tabs = (address_table(rings, torch.device(DEV)).repeat_interleave(n),
            address_table(comps, torch.device(DEV)).repeat_interleave(n))
    return rings, comps, kv, meta[:, :W], meta[:, W:2 * W], meta[:, 2 * W:3 * W], meta[:, 3 * W:], tabs


@pytest.mark.parametrize("T", [0, 6])
def test_one_launch_equals_the_composition_bitwise(T):
    B, n, W, D = 3, 2, 8, 32
    rings, comps, kv, rsel, nsel, pos, topk, (rt, ct) = _round(B, n, W, max(T, 1), D, 11 + T)
    topk = topk if T else None
    ops = cuda_ops()
    composed = dataclasses.replace(ops, round_keys_fn=None)
    want = composed.round_keys(rings, rt, rsel, nsel, kv, pos, n, *((comps, ct, topk) if T else ()))
    ref = reference_ops().round_keys(rings, rt, rsel, nsel, kv, pos, n, *((comps, ct, topk) if T else ()))
    assert torch.equal(ref[1], want[1]) and torch.equal(ref[0][want[1]], want[0][want[1]])
    got = round_gather.round_keys(rt, rsel, nsel, kv, pos, ct if T else None, topk)
    assert got[0].shape == (B * n, W + T, D) and got[1].dtype == torch.bool
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ops.round_keys_fn is not None
    via = ops.round_keys(rings, rt, rsel, nsel, kv, pos, n, *((comps, ct, topk) if T else ()))
    assert torch.equal(via[0], want[0]) and torch.equal(via[1], want[1])
    alone = round_gather.round_keys(rt[3:4], rsel[3:4], nsel[3:4], kv, pos[3:4], ct[3:4] if T else None,
                                    topk[3:4] if T else None)
    assert torch.equal(alone[0][0], got[0][3])                              # a row alone == among 6
