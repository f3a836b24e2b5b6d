"""kernels/mhc.py: `hc_mix` (an mHC site's mixes after the hc_fn product: pre, post, the Sinkhorn-normalised comb
in one launch) against dsv41.model.mhc.hc_mix; on CPU under TRITON_INTERPRET=1, where numpy's exp stands in for
libdevice's, to float32 rounding; with a GPU (marker gpu) bitwise torch's CUDA kernels. `hc_pre` (the hc_fn product
in arch.md 2.4's order, K in fixed chunks) against the formula in float64, and a row's bits alone == among others."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model import mhc  # noqa: E402
from dsv41.model.ops import cuda_ops  # noqa: E402
from kernels import mhc as kmhc  # noqa: E402

HC = 4


def _parts(n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, (2 + HC) * HC, generator=g) * 3
    m[0, :3] = torch.tensor([80.0, -80.0, 0.0])            # sigmoid's saturated ends and its midpoint
    m[1 % n, 2 * HC:2 * HC + 4] = torch.tensor([30.0, -30.0, 30.0, 0.0])   # a comb row with a tie at its max
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn((2 + HC) * HC, generator=g)
    return m.to(device), scale.to(device), base.to(device)


@pytest.mark.skipif(not kmhc.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("iters", [1, 20])
def test_kernel_computes_the_mixes(iters):
    m, scale, base = _parts(37, iters)
    got = kmhc.launch(m, scale, base, HC, iters, 1e-6)
    want = mhc.hc_mix(m, scale, base, HC, iters, 1e-6)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    alone = kmhc.launch(m[20:21], scale, base, HC, iters, 1e-6)       # a row alone == among 37
    for a, b in zip(alone, got):
        assert torch.equal(a[0], b[20])
    wide = torch.cat([m, torch.randn(37, 5)], dim=1)[:, :m.shape[1]]      # rows at a stride (a column slice)
    for a, b in zip(kmhc.launch(wide, scale, base, HC, iters, 1e-6), got):
        assert torch.equal(a, b)


def test_the_kernel_applies_only_where_it_is_written_for():
    m, scale, base = _parts(3, 0)
    assert kmhc.hc_mix(m, scale, base, HC, 20, 1e-6) is None                  # CPU tensors: the torch function
    ops = cuda_ops()
    if "hc_mix" in ops.kernels:
        pre, post, comb = ops.hc_mix(m, scale, base, HC, 20, 1e-6)            # the op set falls back on CPU
        for a, b in zip((pre, post, comb), mhc.hc_mix(m, scale, base, HC, 20, 1e-6)):
            assert torch.equal(a, b)


def _streams(n, seed, hidden=96, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HC, hidden, generator=g) * 2
    fn = torch.randn((2 + HC) * HC, HC * hidden, generator=g) * 0.05
    return x.to(device), fn.to(device)


def _pre_formula(x, fn, eps):
    """arch.md 2.4: m = (x̂ · fnᵀ) · rsqrt(mean(x̂²) + eps), in float64."""
    f = x.reshape(x.shape[0], -1).double()
    return (f @ fn.double().T) * torch.rsqrt(f.square().mean(-1, keepdim=True) + eps)


@pytest.mark.skipif(not kmhc.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
def test_pre_kernel_computes_the_mixes_and_a_row_alone_equals_it_among_others():
    x, fn = _streams(21, 1, hidden=200)              # K = 800: three full chunks and a partial one
    got = kmhc.launch_pre(x, fn, 1e-20)
    torch.testing.assert_close(got.double(), _pre_formula(x, fn, 1e-20), rtol=1e-5, atol=1e-5)
    for r in (0, 17, 20):
        assert torch.equal(kmhc.launch_pre(x[r:r + 1], fn, 1e-20)[0], got[r])
    assert kmhc.hc_pre(x, fn, 1e-20) is None                       # CPU tensors: the op set's torch order


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [5120, 96])
def test_pre_kernel_on_cuda_is_row_invariant(hidden):
    x, fn = _streams(64, hidden, hidden=hidden, device="cuda")
    got = kmhc.hc_pre(x, fn, 1e-20)
    assert got is not None
    torch.testing.assert_close(got.double(), _pre_formula(x, fn, 1e-20), rtol=1e-5, atol=1e-5)
    for rows in (1, 5, 33):
        assert torch.equal(kmhc.hc_pre(x[:rows], fn, 1e-20), got[:rows])
    assert torch.equal(kmhc.hc_pre(x[40:41], fn, 1e-20)[0], got[40])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5, 64, 300])
def test_kernel_equals_torch_on_cuda(n):
    m, scale, base = _parts(n, n, "cuda")
    got = kmhc.hc_mix(m, scale, base, HC, 20, 1e-6)
    assert got is not None
    want = mhc.hc_mix(m, scale, base, HC, 20, 1e-6)
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max().item()
    assert "hc_mix" in cuda_ops().kernels


@pytest.mark.skipif(not kmhc.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("n", [1, 21, 40])
def test_site_mixes_in_one_launch_equal_the_product_then_the_mixes(n):
    """hc_site_mixes: each row block's last program to arrive completes it; the bits of hc_pre's two launches then
    hc_mix's (under the interpreter, both with numpy's exp), a row alone == among others, the counters left zeroed."""
    x, fn = _streams(n, 7 + n, hidden=200)
    _, scale, base = _parts(2, 3)
    got = kmhc.launch_site(x, fn, scale, base, HC, 20, 1e-6, 1e-20)
    want = kmhc.launch(kmhc.launch_pre(x, fn, 1e-20), scale, base, HC, 20, 1e-6)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    alone = kmhc.launch_site(x[n - 1:], fn, scale, base, HC, 20, 1e-6, 1e-20)
    for a, b in zip(alone, got):
        assert torch.equal(a[0], b[n - 1])
    assert not kmhc._counters[x.device].any()
    assert kmhc.hc_site_mixes(x, fn, scale, base, HC, 20, 1e-6, 1e-20) is None     # CPU tensors: apart
    # the bench's m-only variant (hc_mix a launch of its own after it): the same bits; more warps: the same too
    for a, b in zip(kmhc.launch_site(x, fn, scale, base, HC, 20, 1e-6, 1e-20, warps=8, mix=False), got):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 33, 64])
def test_site_mixes_equal_the_two_kernels_on_cuda(n):
    x, fn = _streams(n, 5, hidden=5120, device="cuda")
    _, scale, base = _parts(2, 3, "cuda")
    got = kmhc.hc_site_mixes(x, fn, scale, base, HC, 20, 1e-6, 1e-20)
    assert got is not None and "hc_site_mixes" in cuda_ops().kernels
    want = kmhc.hc_mix(kmhc.hc_pre(x, fn, 1e-20), scale, base, HC, 20, 1e-6)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(kmhc.hc_site_mixes(x[:1], fn, scale, base, HC, 20, 1e-6, 1e-20), got):
        assert torch.equal(a[0], b[0])
