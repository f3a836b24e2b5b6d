"""kernels/fake_quant.py (QAT's FP8 and FP4 fake-quants, one launch each) against dsv41.model.quant's functions.
torch's CUDA `amax / 448.0` (or / 6.0) multiplies by float32(1 / max), which the kernel does; on CPU
(TRITON_INTERPRET=1, where the E4M3 rounding is written out) it is compared with that form of the torch function,
on the GPU (marker gpu) with torch itself, bitwise."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model import quant  # noqa: E402
from dsv41.model.ops import cuda_ops  # noqa: E402
from kernels import fake_quant as fq  # noqa: E402

TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])     # E2M1's midpoints (ties) at a scale of 1


def _x(device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 512, generator=g) * torch.rand(7, 3, 1, generator=g) * 50
    x[0, 0, :32] = 0.0                                              # amax at the floor
    x[0, 1, :32] = 1e-7
    x[1, 0, :32] = torch.linspace(-448 * 8, 448 * 8, 32)            # the clamp
    x[1, 1, :32] = torch.arange(32) * 2.0 ** -18                    # at a scale of 2^-8 (amax 1.0 below): E4M3
    x[1, 1, 0] = 1.0                                                # subnormals (2^-9 apart) and their ties
    x[2, 0, :16] = torch.cat([TIES, -TIES])                         # amax 6: scale 1 (both FP4 forms), the ties
    x[2, 0, 16:32] = torch.cat([TIES, -TIES]) * 0.999999            # just below them
    x[2, 1, :16] = torch.cat([TIES, -TIES]) * 1.000001              # just above
    x[2, 1, 16:20] = torch.tensor([-0.1, 0.1, -0.2, 6.0])           # rounding to zero keeps the sign (copysign)
    x[2, 2, :16] = 2.0 ** -12                                       # an E4M3 scale in its subnormal range
    x[3, 0, :16] = 1e5                                              # an E4M3 scale saturating at 448
    return x.to(device)


def _with_cuda_division(x, kind):
    """quant's fake-quant with torch's CUDA `amax / max`: amax · float32(1 / max)."""
    floor, vmax, values, scale = kind
    block = 32 if kind is not fq.FP4_E4M3 else 16
    v = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(floor)
    r = amax * (torch.tensor(1.0) / torch.tensor(vmax))
    s = quant.pow2_ceil(r) if scale == fq.POW2 else r.to(torch.float8_e4m3fn).float()
    q = (v / s).clamp(-vmax, vmax)
    q = q.to(torch.float8_e4m3fn).float() if values == fq.E4M3 else quant.round_e2m1(q)
    return (q * s).reshape(x.shape)


KINDS = {"fp8": (fq.FP8, 32, quant.fp8_fake_quant), "fp4_ue8m0": (fq.FP4_UE8M0, 32, quant.fp4_fake_quant_ue8m0),
         "fp4_e4m3": (fq.FP4_E4M3, 16, quant.fp4_fake_quant_e4m3)}


@pytest.mark.skipif(not fq.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", sorted(KINDS))
def test_kernel_computes_the_fake_quant(name):
    kind, block, torch_fn = KINDS[name]
    x = _x()
    got = fq.launch(x, block, kind)
    assert torch.equal(got, _with_cuda_division(x, kind))
    assert torch.equal(fq.launch(x[4:5, 2:3], block, kind)[0, 0], got[4, 2])   # a row alone == among 21
    assert getattr(fq, torch_fn.__name__)(x, block) is None                     # CPU tensors: the torch function
    op = getattr(cuda_ops(), torch_fn.__name__)
    assert torch.equal(op(x, block), torch_fn(x, block))


@pytest.mark.skipif(not fq.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
def test_e2m1_rounds_the_ties_to_the_even_code():
    x = torch.zeros(1, 32)
    x[0, :16] = torch.cat([TIES, -TIES])
    got = fq.launch(x, 32, fq.FP4_UE8M0)[0, :16]
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])
    assert torch.equal(got, torch.cat([want, -want]))
    small = torch.zeros(1, 32)
    small[0, :2] = torch.tensor([-0.1, 6.0])
    assert torch.signbit(fq.launch(small, 32, fq.FP4_UE8M0)[0, 0])       # -0.1 -> -0.0, as torch.copysign


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(KINDS))
def test_kernel_equals_torch_on_cuda(name):
    kind, block, torch_fn = KINDS[name]
    x = _x("cuda")
    got = getattr(cuda_ops(), torch_fn.__name__)(x, block)
    assert torch_fn.__name__ in cuda_ops().kernels
    assert torch.equal(got, torch_fn(x, block))
    assert torch.equal(fq.launch(x[:1], block, kind), got[:1])
