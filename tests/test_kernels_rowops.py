"""kernels/rowops.py (RMSNorm with the fixed-tree row sum; the mHC Sinkhorn) against their torch fallbacks, bitwise,
and the vectorised mHC stream mixes against the loops they replaced, bitwise.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) against the CUDA path's torch functions run on
CPU tensors (the op sets cuda_ops() and cuda_ops(kernels=False), dsv41/model/ops.py). One difference is the CPU's, not the kernel's: torch's CPU sqrt is not correctly
rounded (torch's CUDA sqrt is: sqrt.rn), so on CPU the norm kernel is compared with the fallback's operations
written out with a correctly rounded sqrt, and that write-out with torch.sqrt is checked to be the fallback itself.
With a GPU (marker gpu) the kernels are compared with the fallbacks directly, at V4.1 shapes. A PTX check compiles
the kernels for sm_90 (no GPU needed) and asserts they use only correctly rounded float32 division and square root
and no fused multiply-add (which the torch fallbacks never use).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model import linear, mhc
from dsv41.model.ops import cuda_ops, reference_ops
from kernels import rowops
from kernels.numerics import inv_count, tree_row_sum

ROOT = Path(__file__).resolve().parent.parent
# the kernels on CPU tensors need the interpreter (tests/conftest.py sets it where there is no GPU)
interp = pytest.mark.skipif(not rowops.INTERPRET, reason="kernels on CPU tensors need TRITON_INTERPRET=1")


def _sum(terms):
    acc = terms[0]
    for t in terms[1:]:
        acc = acc + t
    return acc


def _sinkhorn_loop(comb, iters, eps):
    """mhc.hc_mixes' Sinkhorn as it stands (the fallback), on comb = softmax + eps."""
    def norm_cols(c):
        return c / (_sum(c.unbind(1))[:, None, :] + eps)

    def norm_rows(c):
        return c / (_sum(c.unbind(2))[:, :, None] + eps)
    comb = norm_cols(comb)
    for _ in range(iters - 1):
        comb = norm_cols(norm_rows(comb))
    return comb


def _collapse_loop(streams, pre):
    return _sum([pre[:, j:j + 1] * streams[:, j] for j in range(streams.shape[1])])


def _expand_loop(y, residual, post, comb):
    hc = residual.shape[1]
    outs = []
    for k in range(hc):
        mixed = _sum([comb[:, j, k:k + 1] * residual[:, j] for j in range(hc)])
        outs.append(post[:, k:k + 1] * y + mixed)
    return torch.stack(outs, dim=1)


def _sqrt_rn(x):
    """float32 sqrt correctly rounded (via float64: exact for sqrt), as CUDA's sqrt.rn and the kernel's sqrt_rn."""
    return torch.sqrt(x.double()).float()


def _norm_written_out(x, w, eps, sqrt):
    """linear.rms_norm's CUDA path, operation by operation (rsqrt(t) = reciprocal(t) * 1 as torch's 1.0 / t)."""
    mean = tree_row_sum(x * x) * inv_count(x.shape[-1])
    y = x * (torch.reciprocal(sqrt(mean + eps)) * 1.0)
    return y if w is None else y * w


def _combs(n, hc, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, hc, hc, generator=g) * 3, dim=-1) + 1e-6


# ---- CPU (interpreter) ---------------------------------------------------------------------------------------------

def test_written_out_norm_is_the_cuda_path_fallback():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5120, generator=g) * 4, torch.rand(5120, generator=g)
    for weight in (w, None):
        assert torch.equal(cuda_ops(kernels=False).rms_norm(x, weight, 1e-6),
                           _norm_written_out(x, weight, 1e-6, torch.sqrt))


@interp
@pytest.mark.parametrize("width", [1, 3, 5, 7, 64, 1280, 5120, 20480])
def test_norm_kernel_equals_the_tree_norm_bitwise(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(3, width, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    w = torch.rand(width, generator=g) + 0.5
    for weight, eps in ((w, 1e-6), (None, 1e-20)):
        got = rowops.rms_norm(x, weight, eps)
        want = _norm_written_out(x, weight, eps, _sqrt_rn)
        assert torch.equal(got, want), (width, (got - want).abs().max())


@interp
def test_norm_kernel_is_what_rms_norm_runs_and_row_invariant():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 640, generator=g)        # leading dims flattened into rows
    w = torch.rand(640, generator=g)
    got = cuda_ops().rms_norm(x, w, 1e-6)
    assert torch.equal(got, rowops.rms_norm(x, w, 1e-6))
    assert got.shape == x.shape
    assert torch.equal(rowops.rms_norm(x[2, 1:2], w, 1e-6)[0], got[2, 1])     # a row alone == among 15
    # the CPU reference does not take the kernel (or the tree)
    ref = reference_ops().rms_norm(x, w, 1e-6)
    assert torch.equal(ref, linear.rms_norm(x, w, 1e-6))
    xf = x.float()
    assert torch.equal(ref, xf * linear.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w)


@interp
@pytest.mark.parametrize("n,iters", [(1, 20), (5, 20), (70, 20), (3, 1), (4, 2)])
def test_sinkhorn_kernel_equals_the_loop_bitwise(n, iters):
    comb = _combs(n, 4, n * 100 + iters)
    got = rowops.sinkhorn(comb, iters, 1e-6)
    assert torch.equal(got, _sinkhorn_loop(comb, iters, 1e-6))
    assert torch.equal(rowops.sinkhorn(comb[n - 1:], iters, 1e-6)[0], got[n - 1])   # alone == among n


@interp
def test_hc_mixes_takes_the_sinkhorn_kernel_on_the_cuda_path():
    g = torch.Generator().manual_seed(2)
    hc, hidden = 4, 64
    parts = {"fn": torch.randn((2 + hc) * hc, hc * hidden, generator=g) * 0.1,
             "base": torch.randn((2 + hc) * hc, generator=g), "scale": torch.rand(3, generator=g) + 0.5}
    streams = torch.randn(6, hc, hidden, generator=g)
    fallbacks = cuda_ops(kernels=False)
    # the kernels' op set but the fallbacks' norm: the same flat norm on both sides (torch's CPU sqrt, see above)
    kernels = dataclasses.replace(cuda_ops(), rms_norm=fallbacks.rms_norm)
    assert kernels.sinkhorn is not fallbacks.sinkhorn
    got = mhc.hc_mixes(streams, mhc.HcSite(**parts, ops=kernels), 20, 1e-6, 1e-6)
    want = mhc.hc_mixes(streams, mhc.HcSite(**parts, ops=fallbacks), 20, 1e-6, 1e-6)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_vectorised_collapse_and_expand_equal_the_loops_bitwise():
    g = torch.Generator().manual_seed(3)
    n, hc, hidden = 7, 4, 96
    streams = torch.randn(n, hc, hidden, generator=g)
    pre = torch.rand(n, hc, generator=g)
    post = torch.rand(n, hc, generator=g) * 2
    comb = _sinkhorn_loop(_combs(n, hc, 4), 20, 1e-6)
    y = torch.randn(n, hidden, generator=g)
    assert torch.equal(mhc.hc_collapse(streams, pre), _collapse_loop(streams, pre))
    got = mhc.hc_expand(y, streams, post, comb)
    assert got.is_contiguous()
    assert torch.equal(got, _expand_loop(y, streams, post, comb))


@interp
@pytest.mark.parametrize("hidden", [96, 1000, 2500])
def test_collapse_and_expand_kernels_equal_the_loops_bitwise(hidden):
    g = torch.Generator().manual_seed(hidden)
    n, hc = 5, 4
    streams = torch.randn(n, hc, hidden, generator=g)
    streams[0, 1, :7] = -0.0                        # signed zeros and zero weights keep their signs as in torch
    pre = torch.rand(n, hc, generator=g)
    pre[1, 2] = 0.0
    post = torch.rand(n, hc, generator=g) * 2
    comb = _sinkhorn_loop(_combs(n, hc, 6), 20, 1e-6)
    y = torch.randn(n, hidden, generator=g)
    got_c = cuda_ops().hc_collapse(streams, pre)
    got_e = cuda_ops().hc_expand(y, streams, post, comb)
    assert torch.equal(rowops.hc_collapse(streams, pre), got_c)        # the kernels ran
    assert torch.equal(rowops.hc_expand(y, streams, post, comb), got_e)
    want_c, want_e = _collapse_loop(streams, pre), _expand_loop(y, streams, post, comb)
    assert torch.equal(got_c, want_c) and torch.equal(got_c.signbit(), want_c.signbit())
    assert torch.equal(got_e, want_e) and torch.equal(got_e.signbit(), want_e.signbit())
    assert torch.equal(rowops.hc_expand(y[3:4], streams[3:4], post[3:4], comb[3:4])[0], got_e[3])   # alone


@pytest.mark.skipif(not rowops.INTERPRET and not torch.cuda.is_available(),
                    reason="the kernels run on CUDA or under TRITON_INTERPRET=1")
@pytest.mark.parametrize("hidden", [96, 1001, 4096])
@pytest.mark.parametrize("weighted", [True, False])
def test_site_input_in_one_launch_equals_the_three_kernels_bitwise(hidden, weighted):
    """hc_site_in: (expand,) collapse and norm in one program a row, the bits of rowops' three kernels; each row's
    bits its own (a row alone == among 5); the op set's collapse_norm / expand_collapse_norm take it."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(hidden + weighted)
    n, hc = 5, 4
    streams = torch.randn(n, hc, hidden, generator=g)
    streams[0, :, :7] = -0.0                        # signed zeros keep their signs as in the separate kernels
    pre = torch.rand(n, hc, generator=g)
    pre[1, 2] = 0.0
    post = torch.rand(n, hc, generator=g) * 2
    comb = _sinkhorn_loop(_combs(n, hc, 6), 20, 1e-6)
    y = torch.randn(n, hidden, generator=g)
    y[0, :7] = -0.0
    w = torch.rand(hidden, generator=g) + 0.5 if weighted else None
    streams, pre, post, comb, y = (t.to(dev) for t in (streams, pre, post, comb, y))
    w = w.to(dev) if w is not None else None
    eps = 1e-6
    s1, x1 = rowops.hc_site_in(None, streams, None, None, pre, w, eps)
    want = rowops.rms_norm(rowops.hc_collapse(streams, pre), w, eps)
    assert torch.equal(s1, streams) and torch.equal(x1, want) and torch.equal(x1.signbit(), want.signbit())
    s2, x2 = rowops.hc_site_in(y, streams, post, comb, pre, w, eps)
    want_s = rowops.hc_expand(y, streams, post, comb)
    want_x = rowops.rms_norm(rowops.hc_collapse(want_s, pre), w, eps)
    assert torch.equal(s2, want_s) and torch.equal(s2.signbit(), want_s.signbit())
    assert torch.equal(x2, want_x) and torch.equal(x2.signbit(), want_x.signbit())
    ya = torch.randn(y.shape, generator=g).to(dev)                    # two TP shards' partials, added first
    s3, x3 = rowops.hc_site_in((ya, y - ya), streams, post, comb, pre, w, eps)
    want_s3 = rowops.hc_expand(ya + (y - ya), streams, post, comb)
    assert torch.equal(s3, want_s3) and torch.equal(x3, rowops.rms_norm(rowops.hc_collapse(want_s3, pre), w, eps))
    got3 = reference_ops().expand_collapse_norm((ya, y - ya), streams, post, comb, pre, w, eps)
    assert torch.equal(got3[0], reference_ops().hc_expand(ya + (y - ya), streams, post, comb))
    a_s, a_x = rowops.hc_site_in(y[2:3], streams[2:3], post[2:3], comb[2:3], pre[2:3], w, eps)   # a row alone
    assert torch.equal(a_s[0], s2[2]) and torch.equal(a_x[0], x2[2])
    ops = cuda_ops()
    assert torch.equal(ops.collapse_norm(streams, pre, w, eps), x1)
    got = ops.expand_collapse_norm(y, streams, post, comb, pre, w, eps)
    assert torch.equal(got[0], s2) and torch.equal(got[1], x2)
    if dev == "cuda":           # the torch forms of the CUDA op set, bitwise (torch's CUDA sqrt is rounded)
        fb = cuda_ops(kernels=False)
        assert torch.equal(fb.collapse_norm(streams, pre, w, eps), x1)
        assert all(torch.equal(a, b) for a, b in zip(fb.expand_collapse_norm(y, streams, post, comb, pre, w, eps),
                                                     (s2, x2)))
    bf = w.bfloat16() if w is not None else None        # a bf16 weight: not the kernel's (the ops compose)
    if bf is not None:
        assert rowops.hc_site_in(None, streams, None, None, pre, bf, eps) is None


def _moe(g, n_exp, hidden, top_k, ops=None):
    from dsv41.model.moe import Expert, MoE
    shared = Expert(torch.randn(8, hidden, generator=g), torch.randn(hidden, 8, generator=g),
                    torch.randn(8, hidden, generator=g))
    return MoE(gate=torch.randn(n_exp, hidden, generator=g), bias=torch.randn(n_exp, generator=g) * 0.1,
               bias_vl=torch.zeros(n_exp), experts={}, shared=shared, top_k=top_k, gate_temp=1.0, scaling=1.5,
               limit=10.0, ops=ops or reference_ops())


@interp
@pytest.mark.parametrize("top_k", [6, 2, 3])
def test_route_weights_kernel_equals_the_route_bitwise(top_k):
    g = torch.Generator().manual_seed(top_k)
    moe = _moe(g, 384, 32, top_k, cuda_ops())
    x = torch.randn(37, 32, generator=g) * 2
    x[3] = -40.0                                     # scores near 0 (softplus of very negative logits)
    got_w, got_ids = moe.route(x)
    want_w, want_ids = dataclasses.replace(moe, ops=cuda_ops(kernels=False)).route(x)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)
    s = torch.randn(5, 384, generator=g).abs()
    ids = torch.stack([torch.randperm(384, generator=g)[:top_k] for _ in range(5)])
    assert torch.equal(rowops.route_weights(s, ids, 1.5)[2], rowops.route_weights(s[2:3], ids[2:3], 1.5)[0])


def test_kernel_ptx_uses_only_correctly_rounded_ops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "kernels.rowops_check"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.count("ok ") == 13, r.stdout


# ---- CUDA --------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("width", [5120, 20480, 1280, 7])
def test_norm_kernel_equals_the_fallback_on_cuda(width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(64, width, generator=g) * 3).cuda()
    w = (torch.rand(width, generator=g) + 0.5).cuda()
    for weight, eps in ((w, 1e-20), (None, 1e-20), (w, 1e-6)):
        want = cuda_ops(kernels=False).rms_norm(x, weight, eps)
        assert torch.equal(want, _norm_written_out(x, weight, eps, torch.sqrt))
        got = cuda_ops().rms_norm(x, weight, eps)
        assert torch.equal(got, want), (width, (got - want).abs().max().item())
        for rows in (1, 8, 33):
            assert torch.equal(cuda_ops().rms_norm(x[:rows], weight, eps), got[:rows])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64, 2048])
def test_sinkhorn_kernel_equals_the_loop_on_cuda(n):
    comb = _combs(n, 4, n).cuda()
    got = rowops.sinkhorn(comb, 20, 1e-6)
    assert torch.equal(got, _sinkhorn_loop(comb, 20, 1e-6))
    assert torch.equal(rowops.sinkhorn(comb[:1], 20, 1e-6)[0], got[0])


@pytest.mark.gpu
def test_hc_mixes_kernels_equal_fallbacks_on_cuda():
    g = torch.Generator().manual_seed(5)
    hc, hidden = 4, 5120
    parts = {"fn": (torch.randn((2 + hc) * hc, hc * hidden, generator=g) * 0.01).cuda(),
             "base": torch.randn((2 + hc) * hc, generator=g).cuda(),
             "scale": (torch.rand(3, generator=g) + 0.5).cuda()}
    streams = torch.randn(64, hc, hidden, generator=g).cuda()
    from kernels import mhc as mhc_k
    got = mhc.hc_mixes(streams, mhc.HcSite(**parts, ops=cuda_ops()), 20, 1e-6, 1e-20)
    # the site's one launch: hc_pre's product (the kernels' own order: the raw streams' product, then the row's
    # statistic; arch.md 2.4) and hc_mix, the bits of the two launches; hc_mix's kernel: the torch function's bits
    m = mhc_k.hc_pre(streams, parts["fn"], 1e-20)
    assert all(torch.equal(a, b) for a, b in zip(got, mhc_k.hc_mix(m, parts["scale"], parts["base"], 4, 20, 1e-6)))
    fb = cuda_ops(kernels=False)
    want = fb.hc_mix(m, parts["scale"], parts["base"], 4, 20, 1e-6)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # the fallbacks' product runs in the other order (the normalised streams times hc_fn): float32-close
    m_fb = fb.linear(fb.rms_norm(streams.reshape(64, -1), None, 1e-20), parts["fn"])
    assert torch.allclose(m, m_fb, rtol=1e-4, atol=1e-5)
    assert torch.equal(mhc_k.hc_pre(streams[5:6], parts["fn"], 1e-20)[0], m[5])       # a row alone == among 64
    y = torch.randn(64, hidden, generator=g).cuda()
    ops = cuda_ops()
    assert torch.equal(ops.hc_expand(y, streams, got[1], got[2]), _expand_loop(y, streams, got[1], got[2]))
    assert torch.equal(ops.hc_collapse(streams, got[0]), _collapse_loop(streams, got[0]))


@pytest.mark.gpu
def test_route_weights_kernel_equals_the_route_on_cuda():
    g = torch.Generator().manual_seed(7)
    moe = _moe(g, 384, 5120, 6, cuda_ops())
    for name in ("gate", "bias", "bias_vl"):
        setattr(moe, name, getattr(moe, name).cuda())
    x = torch.randn(64, 5120, generator=g).cuda()
    got_w, got_ids = moe.route(x)
    want_w, want_ids = dataclasses.replace(moe, ops=cuda_ops(kernels=False)).route(x)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)
    assert torch.equal(moe.route(x[5:6])[0][0], got_w[5])
