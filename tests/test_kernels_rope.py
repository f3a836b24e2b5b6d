"""kernels/rope.py (RoPE in place, one launch) against dsv41.model.rope.apply_rope / apply_rope_, bitwise: under
TRITON_INTERPRET=1 on CPU (IEEE float32 multiplies and adds, as torch's CPU ones) and on the GPU (marker gpu)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model.rope import apply_rope  # noqa: E402
from kernels import rope  # noqa: E402

needs_kernel = pytest.mark.skipif(not rope.INTERPRET and not torch.cuda.is_available(),
                                  reason="the kernel runs on CUDA or under TRITON_INTERPRET=1")


def _case(n, heads, D, half, seed, device):
    g = torch.Generator().manual_seed(seed)
    shape = (n, heads, D) if heads else (n, D)
    x = (torch.randn(shape, generator=g) * 4).to(device)
    ang = torch.rand(n, half, generator=g) * 100
    return x, torch.cos(ang).to(device), torch.sin(ang).to(device)


@needs_kernel
@pytest.mark.parametrize("heads,D,half", [(0, 512, 32), (3, 512, 32), (64, 512, 32), (17, 128, 32), (1, 64, 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_in_place_equals_apply_rope_bitwise(heads, D, half, inverse):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, cos, sin = _case(5, heads, D, half, heads + D, dev)
    want = apply_rope(x, cos, sin, inverse)
    got = x.clone()
    assert rope.rope_(got, cos, sin, inverse) is got
    assert torch.equal(got, want)
    one = x[3:4].clone()                                  # a row alone == among 5
    rope.rope_(one, cos[3:4], sin[3:4], inverse)
    assert torch.equal(one[0], got[3])


@needs_kernel
def test_rows_at_a_stride_and_what_the_kernel_does_not_take():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, cos, sin = _case(4, 8, 256, 32, 1, dev)
    wide = torch.cat([x, torch.zeros(4, 8, 16, device=dev)], dim=2)[:, :, :256]     # heads at a stride
    want = apply_rope(x, cos, sin)
    assert torch.equal(rope.rope_(wide, cos, sin), want)
    assert rope.rope_(x.double(), cos, sin) is None                       # other dtypes
    assert rope.rope_(x, cos[:, :24], sin[:, :24]) is None                # d not a power of two
    assert rope.rope_(x[:, :, ::2], cos, sin) is None                     # last dim not contiguous


def _positions(device):
    g = torch.Generator().manual_seed(9)
    return torch.cat([torch.arange(0, 40), torch.randint(0, 1 << 20, (60,), generator=g),
                      torch.tensor([(1 << 20) - 1, 65536, 1 << 24])]).to(device)


@pytest.mark.skipif(not rope.INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")
def test_cos_sin_kernel_computes_the_angles():
    """The interpreter's numpy cos / sin are not torch's CPU ones: the kernel to float32 rounding on CPU (the op set
    keeps torch's function there), a row alone == among 103."""
    from dsv41.model.ops import cuda_ops
    from dsv41.model.rope import cos_sin
    pos = _positions("cpu")
    freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    c, s = rope.launch_cos_sin(pos, freq)
    want_c, want_s = cos_sin(pos, freq)
    assert torch.allclose(c, want_c, atol=2e-6, rtol=0) and torch.allclose(s, want_s, atol=2e-6, rtol=0)
    c1, s1 = rope.launch_cos_sin(pos[50:51], freq)
    assert torch.equal(c1[0], c[50]) and torch.equal(s1[0], s[50])
    assert rope.cos_sin(pos, freq) is None                                  # CPU tensors: torch's function
    assert all(torch.equal(a, b) for a, b in zip(cuda_ops().cos_sin(pos, freq), (want_c, want_s)))


@pytest.mark.gpu
def test_cos_sin_kernel_equals_torch_on_cuda():
    from dsv41.model.ops import cuda_ops
    from dsv41.model.rope import cos_sin
    pos = _positions("cuda")
    for freq in (1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)),
                 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)) / 16):
        freq = freq.cuda()
        got = cuda_ops().cos_sin(pos, freq)
        assert "cos_sin" in cuda_ops().kernels
        want = cos_sin(pos, freq)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
