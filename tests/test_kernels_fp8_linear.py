"""kernels/fp8_linear.py against its reference: bf16(x) · dequant_fp8(w, scale)ᵀ (and bf16 weights as they are).

Without a GPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; with one (marker
gpu) the CUDA C kernel (csrc/decode.cu) and the Triton kernel at V4.1 shapes.
Tolerance, against the float64 product of the bf16-rounded x and the exact weight: the products are exact and the
sums fp32, so |y - ref| <= K · 2^-23 · Σ|x̃ w| elementwise (recursive summation's bound, a tensor-core step's
internal sum included). Not rounding x to bf16 would miss it by ~2^-9 / (K · 2^-23) (x's rounding is part of the
function: a float32 product fails these tests).
Batch invariance: a row's output is bit-identical alone, among up to 64 rows (the K chunks in blocks of their own,
summed in order by the last) and in a prompt chunk (every chunk in one block, the same order).
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from dsv41.model import quant
from kernels import fp8_linear as fp8_module
from kernels.fp8_linear import (DEFAULT, Config, fp8_linear, fp8_linear_grouped, fp8_linear_multi, multi_config,
                                split_for)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(out_f, in_f, seed):
    """A random FP8 weight as the checkpoint stores it: E4M3 values (subnormals included) and E8M0 codes that
    differ block to block."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(116, 124, (triton.cdiv(out_f, 32), in_f // 32), generator=g, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def _x(n, in_f, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, in_f, generator=g) + 0.1


def _check_close(y, x, W):
    """The module docstring's bound, in float64 on y's device; W the exact weight (float)."""
    dev = y.device
    W = W.to(dev).double()
    xb = x.to(dev).bfloat16().double()
    ref = xb @ W.t()
    l1 = xb.abs() @ W.abs().t()
    err = (y.double() - ref).abs()
    bound = x.shape[1] * 2.0 ** -23 * l1 + 1e-30
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"
    # and a float32 product (x not rounded) is measurably further off: the bf16 rounding is the function
    far = (x.to(dev).double() @ W.t() - ref).abs().max().item()
    assert far > 10 * err.max().item()


def _deq(w, s):
    return quant.dequant_fp8(w, s, torch.float32)


# (out, in): partial column tile (96), K not a multiple of the K step (96), several K chunks (S > 1)
SHAPES = [(96, 256), (256, 192), (128, 96)]
CFG = Config(bn=32, bk=32)                 # small tiles: several chunks and column tiles at these shapes


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("n", [1, 3, 16, 64, 130])
def test_matches_reference(out_f, in_f, n):
    w, s = _weight(out_f, in_f, seed=out_f + in_f)
    x = _x(n, in_f, seed=n)
    y = fp8_linear(x.to(DEV), w.to(DEV), s.to(DEV), cfg=CFG)
    assert y.dtype == torch.float32 and y.shape == (n, out_f)
    _check_close(y, x, _deq(w, s))


def test_split_comes_from_the_weight_shape():
    assert split_for(96, 256, CFG) == 4 and split_for(128, 96, CFG) == 1 and split_for(64, 128, CFG) == 2
    # V4.1 (the CUDA C kernel's 64-row blocks): wide weights need no split; narrow ones are cut so a decode round
    # fills the GPU
    cu = Config(impl="cuda")
    assert split_for(32768, 1280, cu) == 1 and split_for(512, 5120, cu) == 40 and split_for(5120, 8192, cu) == 4


@pytest.mark.parametrize("cfg", [CFG, Config(bn=32, bk=32, swap=False, mt=2), Config(bn=32, bk=32, post=True)])
@pytest.mark.parametrize("out_f,in_f", [(96, 256), (256, 192)])
def test_row_bits_do_not_depend_on_the_batch(cfg, out_f, in_f):
    w, s = _weight(out_f, in_f, seed=7)
    x = _x(300, in_f, seed=8).to(DEV)
    w, s = w.to(DEV), s.to(DEV)
    big = fp8_linear(x, w, s, cfg=cfg)             # more rows than SPLIT_ROWS: every chunk in one program
    mid = fp8_linear(x[:64], w, s, cfg=cfg)        # chunk partials in programs of their own, summed by the last
    _check_close(mid, x[:64].cpu(), _deq(w.cpu(), s.cpu()))
    for r in (0, 5, 63):
        alone = fp8_linear(x[r:r + 1], w, s, cfg=cfg)
        assert torch.equal(alone[0], mid[r]) and torch.equal(alone[0], big[r])
    moved = fp8_linear(torch.cat([x[200:], x[:200]]), w, s, cfg=cfg)   # the same rows at other places
    assert torch.equal(moved[100 + 5], big[5])


def test_bf16_weights_input_and_column_slices():
    g = torch.Generator().manual_seed(3)
    wb = torch.randn(64, 256, generator=g).bfloat16()
    x = _x(5, 512, seed=4)
    y = fp8_linear(x[:, 256:].to(DEV), wb.to(DEV), None, cfg=CFG)    # a strided slice, as wo_a's groups are
    _check_close(y, x[:, 256:], wb.float())
    xb = x[:, 256:].bfloat16()
    assert torch.equal(fp8_linear(xb.to(DEV), wb.to(DEV), None, cfg=CFG),
                       fp8_linear(xb.float().to(DEV), wb.to(DEV), None, cfg=CFG))   # bf16 x: the same values


def test_empty_and_bad_input():
    w, s = _weight(64, 64, seed=1)
    w, s = w.to(DEV), s.to(DEV)
    assert fp8_linear(torch.zeros(0, 64, device=DEV), w, s).shape == (0, 64)
    with pytest.raises(TypeError):
        fp8_linear(torch.ones(2, 64, device=DEV), w.float(), s)
    with pytest.raises(TypeError):
        fp8_linear(torch.ones(2, 64, device=DEV), w, None)
    with pytest.raises(ValueError):
        fp8_linear(torch.ones(2, 64, device=DEV), w, s[:, :1].contiguous())
    with pytest.raises(ValueError):
        fp8_linear(torch.ones(2, 32, device=DEV), w, s)
    with pytest.raises(ValueError):
        fp8_linear(torch.ones(2, 64, device=DEV), w, s, cfg=Config(bk=64, post=True))


# --- V4.1 shapes on the GPU: the CUDA C kernel (what the model runs there) and the Triton one ----------------------

V41 = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_a group", 1024, 4096),
       ("wo_b", 5120, 8192), ("shared w1+w3", 4608, 5120), ("shared w2", 5120, 2304), ("indexer wq_b", 4096, 1280)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("name,out_f,in_f", V41)
def test_v41_shapes_on_gpu(impl, name, out_f, in_f):
    from kernels import cuda
    if impl == "cuda" and not cuda.available():
        pytest.skip("no CUDA C compiler here")
    cfg = Config(impl="cuda") if impl == "cuda" else DEFAULT
    wd, sd = (t.cuda() for t in _weight(out_f, in_f, seed=out_f ^ in_f))
    W = _deq(wd, sd)
    x = _x(2048, in_f, seed=1).cuda()
    big = fp8_linear(x, wd, sd, cfg=cfg)
    _check_close(big[:256], x[:256], W)
    for n in (1, 3, 9, 17, 33, 64):          # every row-tile count of the CUDA kernel
        y = fp8_linear(x[:n], wd, sd, cfg=cfg)
        assert torch.equal(y, big[:n]), f"{name}: rows 0..{n} differ from the same rows among 2048"
    assert torch.equal(fp8_linear(x[37:38], wd, sd, cfg=cfg)[0], big[37])
    wb = W.bfloat16()                        # and the same product with the weight held as bf16 (exact)
    yb = fp8_linear(x[:40], wb, None, cfg=cfg)
    _check_close(yb, x[:40], W)
    assert torch.equal(fp8_linear(x[7:8], wb, None, cfg=cfg)[0], yb[7])


def test_grouped_equals_the_groups_one_by_one():
    """wo_a's block-diagonal product: group g's weight rows times x's group g columns, concatenated."""
    w, s = _weight(4 * 64, 128, seed=9)
    x = _x(5, 4 * 128, seed=10)
    y = fp8_linear_grouped(x.to(DEV), w.to(DEV), s.to(DEV), 4)
    want = torch.cat([fp8_linear(x[:, g * 128:(g + 1) * 128].to(DEV), w[g * 64:(g + 1) * 64].to(DEV),
                                 s[g * 2:(g + 1) * 2].to(DEV)) for g in range(4)], dim=1)
    assert torch.equal(y, want)
    with pytest.raises(ValueError):
        fp8_linear_grouped(x[:, :300].to(DEV), w.to(DEV), s.to(DEV), 4)


@pytest.mark.gpu
def test_grouped_in_one_launch_equals_the_groups_on_gpu():
    """The CUDA C kernel's grouped launch (wo_a at V4.1 shapes: 8 groups of 1024 rows x 4096) gives each group's
    bits exactly, for every row-tile count."""
    from kernels import cuda
    if not cuda.available():
        pytest.skip("no CUDA C compiler here")
    w, s = (t.cuda() for t in _weight(8 * 1024, 4096, seed=11))
    x = _x(40, 8 * 4096, seed=12).cuda()
    for n in (1, 9, 40):
        y = fp8_linear_grouped(x[:n], w, s, 8)
        want = torch.cat([fp8_linear(x[:n, g * 4096:(g + 1) * 4096], w[g * 1024:(g + 1) * 1024],
                                     s[g * 32:(g + 1) * 32]) for g in range(8)], dim=1)
        assert torch.equal(y, want), n


def _bits(t):
    return t.contiguous().view(torch.int32)


def _multi_equals_alone(outs, in_f, rows, seed, device, bf16=False):
    """fp8_linear_multi over weights concatenated along out == each weight through fp8_linear alone, bit for bit
    (signed zeros included), each output contiguous."""
    parts = [_weight(o, in_f, seed=seed + i) for i, o in enumerate(outs)]
    if bf16:
        parts = [(_deq(w, s).bfloat16(), None) for w, s in parts]
    w = torch.cat([p[0] for p in parts]).to(device)
    s = None if bf16 else torch.cat([p[1] for p in parts]).to(device)
    cfg = multi_config(tuple(outs), in_f, torch.device(device), not bf16)
    assert cfg is not None
    x = _x(max(rows), in_f, seed=seed + 9).to(device)
    for n in rows:
        got = fp8_linear_multi(x[:n], w, s, tuple(outs), cfg)
        for i, (wi, si) in enumerate(parts):
            want = fp8_linear(x[:n], wi.to(device), None if si is None else si.to(device))
            assert got[i].is_contiguous() and got[i].shape == (n, outs[i])
            assert torch.equal(_bits(got[i]), _bits(want)), f"part {i} at {n} rows"


def test_multi_equals_each_weight_alone(monkeypatch):
    """Several weights in one launch, each part with its own split: a narrow launch target gives the parts
    splits 2, 4, 1 and 4 at these shapes (one of them whole, one ragged at the end), so the part table is what makes
    the bits equal; decode rows (split programs) and a prompt's (> SPLIT_ROWS: the chunks in one program)."""
    monkeypatch.setattr(fp8_module, "TARGET_PROGRAMS", 4)
    split_for.cache_clear()
    try:
        outs = (128, 64, 256, 32)
        assert [split_for(o, 512) for o in outs] == [2, 4, 1, 4]
        _multi_equals_alone(outs, 512, [1, 3, 17, 300], seed=20, device=DEV)
        _multi_equals_alone((64, 128, 32), 256, [1, 5], seed=30, device=DEV, bf16=True)
    finally:
        split_for.cache_clear()


def test_multi_config_refuses_what_one_launch_cannot_take():
    dev = torch.device(DEV)
    assert multi_config((128,), 512, dev, True) is None                  # one weight: nothing to fuse
    assert multi_config((64,) * 5, 512, dev, True) is None               # more parts than the kernel's table
    assert multi_config((96, 64), 512, dev, True) is None                # a part ending inside a column tile
    assert multi_config((64, 96), 512, dev, True) is not None            # ... but the last may be ragged
    assert multi_config((64, 48), 512, dev, True) is None                # FP8: whole 32-row scale blocks


# V4.1's projections that share an input: the attention site's FP8 wq_a + wkv, the shared expert's w1 + w3 over 2
# TP shards (w1 of each shard, then w3 of each), the compressor's wkv + wgate with the indexer's weights_proj (bf16)
V41_MULTI = [("attn wq_a+wkv", (1280, 512), False), ("shared w1+w3, 2 shards", (1152,) * 4, False),
             ("shared w1+w3", (2304, 2304), False), ("compressor+indexer bf16", (512, 512, 32), True)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,outs,bf16", V41_MULTI)
def test_v41_multi_equals_each_weight_alone_on_gpu(name, outs, bf16):
    """At V4.1 shapes on the GPU (the CUDA C kernel where it runs: the parts' splits differ, e.g. 20 and 40 for
    wq_a and wkv), every row-tile count and a prompt's rows."""
    _multi_equals_alone(outs, 5120, [1, 3, 9, 17, 33, 64, 300], seed=40, device="cuda", bf16=bf16)
