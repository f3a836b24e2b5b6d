"""kernels/fp4_moe.py's work list in one launch (work_list_launch, what fp4_moe runs) against the torch version
(work_list): the same four tensors exactly, for decode and prompt-sized rounds, slots of another rank (id < 0),
one expert taking every pair (several tiles), and no real pair at all. CPU: the Triton interpreter; GPU: marker gpu."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.fp4_moe import INTERPRET, work_list, work_list_cuda, work_list_launch

CASES = [(1, 6, 384), (8, 6, 384), (64, 6, 384), (37, 6, 16), (100, 6, 6), (3, 2, 5)]


def _same(ids, n_exp):
    want = work_list(ids, n_exp)
    got = work_list_launch(ids, n_exp)
    for w, g in zip(want, got):
        assert g.dtype == torch.int32 and w.dtype == torch.int32
        assert torch.equal(g, w)


def _cases(dev):
    g = torch.Generator().manual_seed(0)
    for n, k, n_exp in CASES:
        yield torch.randint(-1, n_exp, (n, k), generator=g).to(dev), n_exp
    yield torch.full((50, 6), 3).to(dev), 8          # one expert, five tiles
    yield torch.full((5, 6), -1).to(dev), 8          # every slot on another rank


@pytest.mark.skipif(not INTERPRET, reason="kernels on CPU tensors need TRITON_INTERPRET=1")
def test_work_list_launch_equals_work_list():
    for ids, n_exp in _cases("cpu"):
        _same(ids, n_exp)


@pytest.mark.gpu
def test_work_list_launch_equals_work_list_on_cuda():
    for ids, n_exp in _cases("cuda"):
        _same(ids, n_exp)
    g = torch.Generator().manual_seed(1)
    _same(torch.randint(-1, 384, (2048, 6), generator=g).cuda(), 384)   # a prompt chunk's pairs


@pytest.mark.gpu
def test_work_list_in_one_cuda_block_equals_work_list():
    """The CUDA C version the decode rounds use (up to 1024 pairs): the same four tensors exactly."""
    from kernels import cuda
    if not cuda.available():
        pytest.skip("no CUDA C compiler here")
    for ids, n_exp in _cases("cuda"):
        if ids.numel() <= 1024:
            want, got = work_list(ids, n_exp), work_list_cuda(ids, n_exp)
            for w, g in zip(want, got):
                assert torch.equal(g, w)
    g = torch.Generator().manual_seed(2)
    for n in (1, 8, 32, 64, 170):
        ids = torch.stack([torch.randperm(384, generator=g)[:6] for _ in range(n)]).cuda()
        ids[0, 1] = -1
        for w, got in zip(work_list(ids, 384), work_list_cuda(ids, 384)):
            assert torch.equal(got, w), n
