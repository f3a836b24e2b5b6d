"""dsv41/model/rope.py: apply_rope_ (in place, what the attention and the indexer run on their own fresh tensors)
gives apply_rope's bits, forward and inverse, on q-like [n, heads, D] and kv-like [n, D] shapes, leaves the nope
dims untouched, and round-trips; a non-float32 input keeps apply_rope's result (its cat promotes)."""
from __future__ import annotations

import pytest
import torch

from dsv41.model.rope import apply_rope, apply_rope_

DEVS = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dev", DEVS)
@pytest.mark.parametrize("shape", [(37, 8, 64), (5, 512), (3, 4, 96), (0, 2, 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_in_place_rope_has_the_same_bits(dev, shape, inverse):
    g = torch.Generator().manual_seed(sum(shape) + inverse)
    x = (torch.randn(*shape, generator=g) * 10).to(dev)
    ang = torch.randn(shape[0], 16, generator=g) * 100         # positions far out: the products round
    cos, sin = torch.cos(ang).to(dev), torch.sin(ang).to(dev)
    want = apply_rope(x, cos, sin, inverse)
    y = x.clone()
    got = apply_rope_(y, cos, sin, inverse)
    assert got.data_ptr() == y.data_ptr()                      # in place
    assert torch.equal(got, want)
    assert torch.equal(got[..., :-32], x[..., :-32])           # the nope dims untouched
    if shape[0]:
        assert not torch.equal(got[..., -32:], x[..., -32:])   # the rope dims rotated
        back = apply_rope_(got.clone(), cos, sin, not inverse)
        assert (back - x).abs().max().item() < 1e-3 * x.abs().max().item()


def test_other_dtypes_take_apply_rope():
    x = torch.randn(4, 64).bfloat16()
    ang = torch.randn(4, 16)
    got = apply_rope_(x, torch.cos(ang), torch.sin(ang))
    assert got.dtype == torch.float32
    assert torch.equal(got, apply_rope(x, torch.cos(ang), torch.sin(ang)))
