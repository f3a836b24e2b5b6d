"""kernels/compress_pool.py (the compressor's pooling and norm in one launch) against Compressor.pool: on CPU under
TRITON_INTERPRET=1 against the torch form with numpy's exp (the interpreter's), bitwise; with a GPU (marker gpu)
against the CUDA op set's torch form (torch's exp, rowops' norm), bitwise."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from dsv41.model.compressor import Compressor  # noqa: E402
from dsv41.model.ops import cuda_ops  # noqa: E402
from kernels import compress_pool, rowops  # noqa: E402


def _groups(g, r, D, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(g, r, D, generator=gen) * 3
    gate = torch.randn(g, r, D, generator=gen) * 4
    gate[0, :, :8] = 30.0                                    # ties at the max
    w = torch.rand(D, generator=gen) + 0.5
    return kv.to(device), gate.to(device), w.to(device)


def _pool_with(kv, gate, w, eps, exp):
    """Compressor.pool's operations with `exp` and rowops' norm."""
    r = kv.shape[1]
    top = gate[:, 0]
    for t in range(1, r):
        top = torch.maximum(top, gate[:, t])
    e = [exp(gate[:, t] - top) for t in range(r)]
    total = e[0]
    for t in range(1, r):
        total = total + e[t]
    latent = kv[:, 0] * (e[0] / total)
    for t in range(1, r):
        latent = latent + kv[:, t] * (e[t] / total)
    return rowops.rms_norm(latent, w, eps)


@pytest.mark.skipif(not compress_pool.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("r,D", [(4, 512), (2, 128)])
def test_kernel_is_the_pool_and_norm(r, D):
    kv, gate, w = _groups(5, r, D, r + D)
    got = compress_pool.launch(kv, gate, w, 1e-6)
    want = _pool_with(kv, gate, w, 1e-6, lambda v: torch.from_numpy(np.exp(v.numpy())))
    assert torch.equal(got, want)
    assert torch.equal(compress_pool.launch(kv[3:4], gate[3:4], w, 1e-6)[0], got[3])    # a group alone
    assert compress_pool.pool_norm(kv, gate, w, 1e-6) is None                          # CPU tensors: torch
    comp = Compressor(layer=0, ratio=r, wkv=None, wgate=None, norm=w, eps=1e-6, ops=cuda_ops())
    assert torch.equal(comp.pool(kv, gate), _pool_with(kv, gate, w, 1e-6, torch.exp))


@pytest.mark.gpu
@pytest.mark.parametrize("r", [4, 2, 128])
def test_kernel_equals_the_torch_pool_on_cuda(r):
    kv, gate, w = _groups(9, r, 512, r, "cuda")
    got = compress_pool.pool_norm(kv, gate, w, 1e-6)
    assert got is not None and "pool_norm" in cuda_ops().kernels
    assert torch.equal(got, _pool_with(kv, gate, w, 1e-6, torch.exp))
