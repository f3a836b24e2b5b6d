"""kernels/act.py (SwiGLU's elementwise part in one launch) against dsv41.model.moe.swiglu_h: on CPU under
TRITON_INTERPRET=1 (numpy's exp for libdevice's) to float32 rounding, with a GPU (marker gpu) bitwise torch."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model.moe import swiglu_h  # noqa: E402
from dsv41.model.ops import cuda_ops  # noqa: E402
from kernels import act  # noqa: E402

LIMIT = 10.0


def _parts(n, device="cpu"):
    g = torch.Generator().manual_seed(n)
    gate = torch.randn(n, 300, generator=g) * 6
    up = torch.randn(n, 300, generator=g) * 6
    gate[0, :5] = torch.tensor([LIMIT, LIMIT + 1e-3, -90.0, 90.0, 0.0])    # at, above the limit; exp's far ends
    up[0, :4] = torch.tensor([LIMIT, -LIMIT, -LIMIT - 1.0, LIMIT + 1.0])
    gate[0, 5], up[0, 6] = float("nan"), float("nan")                       # NaN passes the clamps
    return gate.to(device), up.to(device)


@pytest.mark.skipif(not act.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
def test_kernel_computes_swiglu():
    gate, up = _parts(7)
    got, want = act.launch(gate, up, LIMIT), swiglu_h(gate, up, LIMIT)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7, equal_nan=True)
    assert torch.equal(act.launch(gate[3:4], up[3:4], LIMIT)[0], got[3])       # a row alone == among 7
    assert act.swiglu_h(gate, up, LIMIT) is None                               # CPU tensors: the torch function


def test_the_op_set_falls_back_on_cpu_tensors():
    gate, up = _parts(3)
    assert torch.equal(cuda_ops().swiglu_h(gate, up, LIMIT).nan_to_num(), swiglu_h(gate, up, LIMIT).nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_kernel_equals_torch_on_cuda(n):
    gate, up = _parts(n, "cuda")
    got = act.swiglu_h(gate, up, LIMIT)
    assert got is not None and "swiglu_h" in cuda_ops().kernels
    want = swiglu_h(gate, up, LIMIT)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
