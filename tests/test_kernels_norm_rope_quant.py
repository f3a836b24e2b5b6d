"""kernels/norm_rope_quant.py (norm, RoPE and fake-quant in one launch) against the CUDA path's three kernels launched
one after another (rowops.rms_norm, rope.rope_, fake_quant.launch), bitwise: under TRITON_INTERPRET=1 on CPU and,
with a GPU (marker gpu), against the CUDA op set's ops (its kernels and torch's bits)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import fake_quant, rope, rowops  # noqa: E402
from kernels import norm_rope_quant as nrq  # noqa: E402

needs_kernel = pytest.mark.skipif(not nrq.INTERPRET and not torch.cuda.is_available(),
                                  reason="the kernel runs on CUDA or under TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(n, heads, D, half, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (n, heads, D) if heads else (n, D)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 8
    x.view(-1, D)[0, :32] = 0.0                                   # a zero block (the fake-quant's floor)
    ang = torch.rand(n, half, generator=g) * 100
    w = torch.rand(D, generator=g) + 0.5
    return x.to(DEV), w.to(DEV), torch.cos(ang).to(DEV), torch.sin(ang).to(DEV)


def _three(x, w, eps, cos, sin, inverse, quant):
    y = rowops.rms_norm(x, w, eps) if w is not None else x.clone()
    y = rope.rope_(y, cos, sin, inverse)
    if quant:
        kind, block = nrq.KINDS[quant]
        y = fake_quant.launch(y, block, kind)
    return y


@needs_kernel
@pytest.mark.parametrize("heads,D,half,norm,quant", [
    (0, 512, 32, True, "fp8"),           # the window KV (and the DSpark stages')
    (32, 128, 32, False, "fp4_ue8m0"),   # the indexer's q
    (0, 128, 32, True, "fp4_ue8m0"),     # the indexer's keys
    (0, 512, 32, False, "fp4_e4m3"),     # the compressed entries
    (0, 512, 32, True, None),            # QAT off
    (3, 64, 16, False, None)])
@pytest.mark.parametrize("inverse", [False, True])
def test_one_launch_equals_the_three_kernels_bitwise(heads, D, half, norm, quant, inverse):
    x, w, cos, sin = _case(5, heads, D, half, D + heads)
    w = w if norm else None
    got = nrq.launch(x, w, 1e-6, cos, sin, inverse, quant)
    want = _three(x, w, 1e-6, cos, sin, inverse, quant)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    alone = nrq.launch(x[2:3], w, 1e-6, cos[2:3], sin[2:3], inverse, quant)       # a row alone == among 5
    assert torch.equal(alone[0], got[2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors: the wrapper declines them")
def test_on_cpu_tensors_each_op_set_composes_its_ops():
    from dsv41.model import quant as q
    from dsv41.model.ops import cuda_ops, reference_ops
    from dsv41.model.rope import apply_rope
    x, w, cos, sin = _case(4, 0, 512, 32, 1)
    assert nrq.norm_rope_quant(x, w, 1e-6, cos, sin, False, "fp8") is None
    for ops in (cuda_ops(), reference_ops()):
        got = ops.norm_rope_quant(x, w, 1e-6, cos, sin, "fp8", own=False)
        assert torch.equal(got, q.fp8_fake_quant(apply_rope(ops.rms_norm(x, w, 1e-6), cos, sin), 32))
        kept = x.clone()
        got = ops.norm_rope_quant(x, None, 0.0, cos, sin, "fp4_e4m3", own=False)
        assert torch.equal(x, kept)                                 # not the caller's: x is not rotated
        assert torch.equal(got, q.fp4_fake_quant_e4m3(apply_rope(x, cos, sin), 16))


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp8", "fp4_ue8m0", "fp4_e4m3", None])
def test_equals_the_cuda_op_set_on_the_gpu(quant):
    from dsv41.model.ops import cuda_ops
    ops = cuda_ops()
    x, w, cos, sin = _case(33, 0, 512, 32, 7)
    got = nrq.norm_rope_quant(x, w, 1e-6, cos, sin, False, quant)
    y = ops.rope_(ops.rms_norm(x, w, 1e-6), cos, sin)
    if quant:
        y = getattr(ops, {"fp8": "fp8_fake_quant", "fp4_ue8m0": "fp4_fake_quant_ue8m0",
                          "fp4_e4m3": "fp4_fake_quant_e4m3"}[quant])(y, nrq.KINDS[quant][1])
    assert torch.equal(got, y)
