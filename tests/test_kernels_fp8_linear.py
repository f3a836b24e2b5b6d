"""kernels/fp8_linear.py against its torch reference `linear(x, dequant_fp8(w, scale))`.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; with one (marker gpu) at
V4.1 shapes. Tolerance, against the float64 product: the kernel splits x into bf16 hi + lo (x to ~2^-17), W is
exact in bf16, the products are exact and the sums fp32, so |y - ref| <= 5e-5 · sqrt(x² · W²ᵀ) elementwise (the
root sum of squares of the terms; fp32 summation over K <= 8192 stays under it). Rounding x to bf16 alone would
be ~2^-9 of that root sum: the bound catches a missing lo part.
Batch invariance: a row's output is bit-identical alone, among 64 rows (decode path: chunk partials summed by the
reduction kernel) and in a prompt chunk (more than one row tile: each program sums its chunks itself).
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from dsv41.model import quant
from dsv41.model.linear import linear
from kernels.fp8_linear import BLOCK_M, fp8_linear, fp8_split

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(out_f, in_f, seed):
    """A random FP8 weight as the checkpoint stores it: E4M3 values and E8M0 codes that differ block to block."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(116, 124, (triton.cdiv(out_f, 32), in_f // 32), generator=g, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def _x(n, in_f, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, in_f, generator=g) + 0.1


def _check_close(y, x, w, s):
    """The module docstring's bound, in float64 on y's device."""
    dev = y.device
    W = quant.dequant_fp8(w.to(dev), s.to(dev)).double()
    x = x.to(dev).double()
    ref = x @ W.t()
    l2 = ((x * x) @ (W * W).t()).sqrt()
    err = (y.double() - ref).abs()
    bound = 5e-5 * l2 + 1e-30
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"
    ref32 = linear(x.float().cpu(), W.float().cpu()).to(dev)          # the model's float32 reference itself
    assert bool(((y - ref32).abs() <= 2 * bound).all())


# (out, in): partial column tile (96), K not a multiple of BLOCK_K (96), several K chunks (S > 1)
SHAPES = [(96, 256), (256, 192), (128, 96)]


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("n", [1, 3, 16, 64, 130])
def test_matches_reference(out_f, in_f, n):
    w, s = _weight(out_f, in_f, seed=out_f + in_f)
    x = _x(n, in_f, seed=n)
    y = fp8_linear(x.to(DEV), w.to(DEV), s.to(DEV))
    assert y.dtype == torch.float32 and y.shape == (n, out_f)
    _check_close(y, x, w, s)


def test_split_comes_from_the_weight_shape():
    assert fp8_split(96, 256) == 2 and fp8_split(128, 96) == 1 and fp8_split(64, 128) == 1   # chunks >= 2 blocks
    # V4.1: wide weights need no split; narrow ones are cut so one row tile still fills the GPU
    assert fp8_split(32768, 1280) == 1 and fp8_split(1280, 5120) == 16 and fp8_split(5120, 8192) == 4


@pytest.mark.parametrize("out_f,in_f", [(96, 256), (96, 512), (256, 192)])
def test_row_bits_do_not_depend_on_the_batch(out_f, in_f):
    w, s = _weight(out_f, in_f, seed=7)
    x = _x(2 * BLOCK_M + 2, in_f, seed=8).to(DEV)
    w, s = w.to(DEV), s.to(DEV)
    big = fp8_linear(x, w, s)                     # more than one row tile: chunks summed in-program
    mid = fp8_linear(x[:64], w, s)                # one row tile: chunk partials + reduction kernel
    for r in (0, 5, 63):
        alone = fp8_linear(x[r:r + 1], w, s)
        assert torch.equal(alone[0], mid[r]) and torch.equal(alone[0], big[r])
    moved = fp8_linear(torch.cat([x[100:], x[:100]]), w, s)  # same rows at other places among other rows
    assert torch.equal(moved[x.shape[0] - 100 + 5], big[5])


def test_bf16_input_and_column_slices():
    w, s = _weight(128, 256, seed=3)
    x = _x(5, 512, seed=4)
    y = fp8_linear(x[:, 256:].to(DEV), w.to(DEV), s.to(DEV))        # a strided slice, as wo_a's groups are
    _check_close(y, x[:, 256:], w, s)
    xb = x[:, 256:].bfloat16()
    yb = fp8_linear(xb.to(DEV), w.to(DEV), s.to(DEV))
    assert torch.equal(yb, fp8_linear(xb.float().to(DEV), w.to(DEV), s.to(DEV)))   # the same values either way


def test_empty_and_bad_input():
    w, s = _weight(64, 64, seed=1)
    w, s = w.to(DEV), s.to(DEV)
    assert fp8_linear(torch.zeros(0, 64, device=DEV), w, s).shape == (0, 64)
    with pytest.raises(TypeError):
        fp8_linear(torch.ones(2, 64, device=DEV), w.float(), s)
    with pytest.raises(ValueError):
        fp8_linear(torch.ones(2, 64, device=DEV), w, s[:, :1].contiguous())
    with pytest.raises(ValueError):
        fp8_linear(torch.ones(2, 32, device=DEV), w, s)


# --- V4.1 shapes on the GPU ---------------------------------------------------------------------------------------

V41 = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_a group", 1024, 4096),
       ("wo_b", 5120, 8192), ("shared w1", 2304, 5120), ("shared w2", 5120, 2304), ("indexer wq_b", 4096, 1280)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,out_f,in_f", V41)
def test_v41_shapes_on_gpu(name, out_f, in_f):
    wd, sd = (t.cuda() for t in _weight(out_f, in_f, seed=out_f ^ in_f))
    x = _x(2048, in_f, seed=1).cuda()
    big = fp8_linear(x, wd, sd)
    _check_close(big[:256], x[:256], wd, sd)
    for n in (1, 3, 16, 64):
        y = fp8_linear(x[:n], wd, sd)
        _check_close(y, x[:n], wd, sd)
        assert torch.equal(y, big[:n]), f"{name}: rows 0..{n} differ from the same rows among 2048"
    assert torch.equal(fp8_linear(x[37:38], wd, sd)[0], big[37])
