"""kernels/fake_quant.py (QAT's FP8 fake-quant in one launch) against dsv41.model.quant.fp8_fake_quant. torch's CUDA
`amax / 448.0` multiplies by float32(1 / 448), which the kernel does; on CPU (TRITON_INTERPRET=1, where the E4M3
rounding is written out) it is compared with that form of the torch function, on the GPU (marker gpu) with torch
itself, bitwise."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model import quant  # noqa: E402
from dsv41.model.ops import cuda_ops  # noqa: E402
from kernels import fake_quant as fq  # noqa: E402


def _x(device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 512, generator=g) * torch.rand(7, 3, 1, generator=g) * 50
    x[0, 0, :32] = 0.0                                              # amax at the floor
    x[0, 1, :32] = 1e-7
    x[1, 0, :32] = torch.linspace(-448 * 8, 448 * 8, 32)            # the clamp
    x[1, 1, :32] = torch.arange(32) * 2.0 ** -18                    # at a scale of 2^-8 (amax 1.0 below): E4M3
    x[1, 1, 0] = 1.0                                                # subnormals (2^-9 apart) and their ties
    return x.to(device)


def _with_cuda_division(x, block=32):
    """quant.fp8_fake_quant with torch's CUDA `amax / 448.0`: amax · float32(1 / 448)."""
    v = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(quant.FP8_ACT_AMAX_FLOOR)
    s = quant.pow2_ceil(amax * (torch.tensor(1.0) / torch.tensor(quant.E4M3_MAX)))
    q = (v / s).clamp(-quant.E4M3_MAX, quant.E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.reshape(x.shape)


@pytest.mark.skipif(not fq.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
def test_kernel_computes_the_fake_quant():
    x = _x()
    got = fq.launch(x)
    assert torch.equal(got, _with_cuda_division(x))
    assert torch.equal(fq.launch(x[4:5, 2:3])[0, 0], got[4, 2])                 # a row alone == among 21
    assert fq.fp8_fake_quant(x) is None                                          # CPU tensors: the torch function
    assert torch.equal(cuda_ops().fp8_fake_quant(x, 32), quant.fp8_fake_quant(x, 32))


@pytest.mark.gpu
def test_kernel_equals_torch_on_cuda():
    x = _x("cuda")
    got = fq.fp8_fake_quant(x, 32)
    assert got is not None and "fp8_fake_quant" in cuda_ops().kernels
    assert torch.equal(got, quant.fp8_fake_quant(x, 32))
    assert torch.equal(fq.fp8_fake_quant(x[:1], 32), got[:1])
