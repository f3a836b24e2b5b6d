"""kernels/router.py (the router's scores) and kernels/topk.py (the router's pick; the indexer's top-k selection)
against the torch functions they replace,
`torch.equal` on ids and values: selection does no arithmetic, so the kernels are bitwise those functions on any
device. On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on small shapes; with a GPU (marker gpu)
at V4.1's shapes (384 experts, top 6; T up to 65536 keys, top 512), rows 1..64.

The definitions: `linear.stable_topk` (a full stable sort) for the router, `indexer.select_topk_by_sort` (the same
sort, its picks in ascending index order) for the indexer, which `indexer.select_topk` (the torch path the CUDA op
set ran) equals too."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from dsv41.model.indexer import select_topk, select_topk_by_sort
from dsv41.model.linear import stable_topk
from dsv41.model.ops import cuda_ops, reference_ops
from dsv41.model.moe import router_scores
from kernels import router, topk

interp = pytest.mark.skipif(not topk.INTERPRET, reason="kernels on CPU tensors need TRITON_INTERPRET=1")
NEG_INF = float("-inf")


def _tied(g, shape, levels):
    """Random rows drawn from a few values: full of ties (and of -0.0 beside +0.0)."""
    vals = torch.tensor(levels, dtype=torch.float32)
    return vals[torch.randint(0, len(levels), shape, generator=g)]


def _check_router(s, k):
    got_v, got_i = topk.router_topk(s, k)
    want_v, want_i = stable_topk(s, k)
    assert torch.equal(got_i, want_i), (got_i, want_i)
    assert torch.equal(got_v, want_v) and torch.equal(got_v.signbit(), want_v.signbit())


def _check_select(s, k, split=None, bits=None):
    got = topk.select_topk(s, k, split=split, bits=bits)
    want = select_topk_by_sort(s, k)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), (s.shape, k)
    assert torch.equal(got, select_topk(s, k))


@interp
@pytest.mark.parametrize(("E", "k"), [(384, 6), (17, 4), (8, 8), (1, 1)])
def test_router_topk_equals_the_stable_sort(E, k):
    g = torch.Generator().manual_seed(E * 31 + k)
    _check_router(torch.randn(9, E, generator=g), k)
    _check_router(_tied(g, (9, E), [-1.5, -0.0, 0.0, 0.25, 2.0]), k)          # rows full of ties
    _check_router(torch.full((3, E), 0.5), k)                                    # one value: the lowest ids
    s = torch.randn(9, E, generator=g)
    assert torch.equal(topk.router_topk(s[4:5], k)[1][0], topk.router_topk(s, k)[1][4])   # a row alone


@interp
def test_router_topk_out_of_range_is_none():
    assert topk.router_topk(torch.zeros(2, 2000), 6) is None            # E past ROUTER_MAX_E
    assert topk.router_topk(torch.zeros(2, 4), 6) is None               # k > E
    assert topk.router_topk(torch.zeros(2, 8, dtype=torch.float64), 2) is None


@interp
@pytest.mark.parametrize(("T", "k"), [(100, 16), (40, 64), (5000, 64), (1, 3), (300, 300)])
def test_select_topk_equals_the_stable_sort(T, k):
    g = torch.Generator().manual_seed(T * 7 + k)
    s = torch.randn(4, T, generator=g)
    s[1, T // 3:] = NEG_INF                                # a short sequence's padding
    s[2] = NEG_INF                                         # a row with no keys
    _check_select(s, k)
    t = _tied(g, (4, T), [-3.0, -0.0, 0.0, 1.0, 7.5, float("inf")])              # ties everywhere, +inf kept
    t[0, T // 2:] = NEG_INF
    _check_select(t, k)
    _check_select(_tied(g, (3, T), [NEG_INF, 2.0]), k)                           # k past the finite count
    _check_select(torch.full((2, T), -1e-30), k)                                 # one value


@interp
def test_select_topk_rows_are_independent_and_values_span_the_keys():
    g = torch.Generator().manual_seed(5)
    s = torch.randn(6, 3000, generator=g) * torch.tensor([1e-30, 1.0, 1e30, 1e-40, 3e38, 1.0])[:, None]
    s[5] = s[5].abs().neg()                                  # all negative
    _check_select(s, 200)
    assert torch.equal(topk.select_topk(s[3:4], 200)[0], topk.select_topk(s, 200)[3])
    assert topk.select_topk(torch.zeros(0, 10), 4).shape == (0, 4)
    assert torch.equal(topk.select_topk(torch.zeros(2, 0), 4), torch.full((2, 4), -1))


@interp
@pytest.mark.parametrize("digit", [11, 8, None])
@pytest.mark.parametrize("base", [0x3F800000, 0xBF800000 - 0x3000, 0x00000000])
def test_select_topk_values_differing_in_their_low_bits(base, digit):
    """Values a few ulps apart (every digit of the radix select, every step of the register form's two-bit
    search decides; signs and zeros at base 0): the pick crosses the digits' boundaries. digit None: the
    served form for rows up to REG_T, the row in registers."""
    g = torch.Generator().manual_seed(base % 1000)
    bits = torch.randint(0, 0x3000, (4, 2500), generator=g, dtype=torch.int64) + base
    s = bits.to(torch.int32).view(torch.float32) if base < 2 ** 31 else (bits - 2 ** 32).to(torch.int32).view(
        torch.float32)
    s = torch.where(torch.isfinite(s), s, 0.0)
    for k in (1, 37, 512, 2400):
        _check_select(s, k, bits=digit)


@interp
@pytest.mark.parametrize(("T", "k", "chunk", "bits"), [(5000, 64, 1250, 11), (700, 300, 128, 8), (3000, 2, 1000, 11)])
def test_select_topk_split_rows_equal_the_stable_sort(T, k, chunk, bits, monkeypatch):
    """A long row's form: chunks of the row a program each (histograms summed across them, each chunk's place in
    the pick from the chunks before it), at small chunks so that a row has many."""
    monkeypatch.setattr(topk, "SPLIT_CHUNK", chunk)
    monkeypatch.setattr(topk, "RADIX_BITS", bits)
    monkeypatch.setattr(topk, "SELECT_BLOCK", 256)       # (the interpreter's time)
    g = torch.Generator().manual_seed(T + k)
    s = _tied(g, (4, T), [-3.0, -0.0, 0.0, 1.0, 7.5])
    s[1, T // 3:] = NEG_INF
    s[2] = NEG_INF
    _check_select(s, k, split=True)
    s = torch.randn(3, T, generator=g)
    s[0, : T // 2] = 1.0                                  # the ties span chunks
    _check_select(s, k, split=True)
    _check_select(_tied(g, (2, T), [NEG_INF, 2.0]), k, split=True)


@interp
def test_op_sets_route_and_select_with_the_same_picks():
    """The CUDA op set (kernels) against the reference op set (torch functions), through the model's call sites'
    ops: MoE.route and the indexer's selection."""
    from dsv41.model.moe import Expert, MoE
    g = torch.Generator().manual_seed(1)
    hidden = 32
    shared = Expert(torch.randn(8, hidden, generator=g), torch.randn(hidden, 8, generator=g),
                    torch.randn(8, hidden, generator=g))
    moe = MoE(gate=torch.randn(384, hidden, generator=g), bias=torch.randn(384, generator=g) * 0.1,
              bias_vl=torch.zeros(384), experts={}, shared=shared, top_k=6, gate_temp=1.0, scaling=1.5,
              limit=10.0, ops=cuda_ops())
    assert "router_topk" in cuda_ops().kernels and "select_topk" in cuda_ops().kernels
    x = torch.randn(11, hidden, generator=g)
    got = moe.route(x)[1]
    assert torch.equal(got, dataclasses.replace(moe, ops=cuda_ops(kernels=False)).route(x)[1])
    s = _tied(g, (5, 700), [NEG_INF, 0.0, 1.0, 2.0])
    assert torch.equal(cuda_ops().select_topk(s, 64), reference_ops().select_topk(s, 64))


def _logits(g, n, E):
    z = torch.randn(n, E, generator=g) * 4
    z[0, :6] = torch.tensor([-40.0, -104.0, 19.999998, 20.0, 20.000002, 35.0])   # exp underflow; the threshold
    return z


@interp
def test_router_scores_kernel_computes_the_router_scores():
    """The interpreter's stand-ins for libdevice's exp/log1p are not torch's CPU functions: s to float32 rounding
    here (bitwise on the GPU, below); the bias by row exactly; the wrapper leaves CPU tensors to torch."""
    g = torch.Generator().manual_seed(3)
    z = _logits(g, 9, 384)
    bias, bias_vl = torch.randn(384, generator=g) * 0.1, torch.randn(384, generator=g) * 0.1
    image = torch.tensor([True, False] * 4 + [True])
    for temp in (1.0, 2.0):
        for img in (None, image):
            s, sb = router.launch(z, temp, bias, bias_vl, img)
            ws, wsb = router_scores(z, temp, bias, bias_vl, img)
            torch.testing.assert_close(s, ws, rtol=3e-7, atol=0)
            assert torch.equal(sb, s + (bias if img is None else torch.where(img[:, None], bias_vl, bias)))
    assert router.router_scores(z, 1.0, bias, bias_vl, None) is None


# ---- on the GPU, V4.1's shapes --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 64])
def test_router_topk_gpu_release_shape(rows):
    g = torch.Generator().manual_seed(rows)
    s = torch.randn(rows, 384, generator=g).cuda()
    _check_router(s, 6)
    _check_router(_tied(g, (rows, 384), [0.1, 0.2, 0.3]).cuda(), 6)
    cpu_v, cpu_i = stable_topk(s.cpu(), 6)                        # and the CPU definition
    assert torch.equal(topk.router_topk(s, 6)[1].cpu(), cpu_i)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [512, 4096, 65536])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_select_topk_gpu_release_shape(T, rows):
    g = torch.Generator().manual_seed(T + rows)
    s = torch.randn(rows, T, generator=g)
    s[rows // 2:, T - T // 3:] = NEG_INF
    if rows > 1:
        s[-1] = NEG_INF
    _check_select(s.cuda(), 512)                          # the served form (registers up to REG_T)
    for split in (False, True):
        for bits in (11, 8):
            _check_select(s.cuda(), 512, split, bits)
    t = _tied(g, (rows, T), [NEG_INF, -1.0, 0.0, 0.5, 1.0])
    _check_select(t.cuda(), 512)
    for split in (False, True):
        for bits in (11, 8):
            _check_select(t.cuda(), 512, split, bits)
    assert torch.equal(topk.select_topk(t.cuda(), 512).cpu(), select_topk_by_sort(t, 512))   # the CPU definition


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 64])
def test_router_scores_gpu_bitwise_torch(rows):
    """libdevice's expf / log1pf are the functions torch's CUDA exp / log1p run: the kernel equals torch's ops
    on the GPU bit for bit (and a non-power-of-two temperature goes through the same float32 reciprocal)."""
    g = torch.Generator().manual_seed(rows)
    z = _logits(g, rows, 384).cuda()
    bias, bias_vl = (torch.randn(384, generator=g) * 0.1).cuda(), (torch.randn(384, generator=g) * 0.1).cuda()
    image = (torch.arange(rows) % 3 == 0).cuda()
    for temp in (1.0, 1.3):
        for img in (None, image):
            got = router.router_scores(z, temp, bias, bias_vl, img)
            want = router_scores(z, temp, bias, bias_vl, img)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (temp, img is None)


@interp
@pytest.mark.parametrize("E,k", [(384, 6), (256, 8), (16, 4)])
def test_the_route_in_one_launch_equals_the_three_kernels(E, k):
    """kernels/router.route: scores, pick and weights in one program per row block, the bits of router.launch,
    topk.router_topk and rowops.route_weights launched one after another (the interpreter's stand-ins on both
    sides), image rows with their own bias, a row alone == among others."""
    from kernels import rowops
    g = torch.Generator().manual_seed(E + k)
    z = _logits(g, 9, E)
    z[3] = 0.5                                                     # a row of ties: the lowest ids
    bias, bias_vl = torch.randn(E, generator=g) * 0.1, torch.randn(E, generator=g) * 0.1
    for img in (None, torch.tensor([i % 3 == 0 for i in range(9)])):
        w, ids = router.launch_route(z, 1.0, bias, bias_vl, img, k, 1.5)
        s, sb = router.launch(z, 1.0, bias, bias_vl, img)
        want_ids = topk.router_topk(sb, k)[1]
        assert torch.equal(ids, want_ids)
        assert torch.equal(w, rowops.route_weights(s, want_ids, 1.5))
        w1, ids1 = router.launch_route(z[4:5], 1.0, bias, bias_vl, None if img is None else img[4:5], k, 1.5)
        assert torch.equal(ids1[0], ids[4]) and torch.equal(w1[0], w[4])
    assert router.route(z, 1.0, bias, bias_vl, None, k, 1.5) is None         # CPU tensors: the three ops


@pytest.mark.gpu
def test_the_route_in_one_launch_equals_the_op_sets_three_on_cuda():
    from dsv41.model.moe import route_weights
    g = torch.Generator().manual_seed(2)
    z = _logits(g, 64, 384).cuda()
    bias, bias_vl = (torch.randn(384, generator=g) * 0.1).cuda(), (torch.randn(384, generator=g) * 0.1).cuda()
    img = (torch.arange(64) % 5 == 0).cuda()
    w, ids = router.route(z, 1.0, bias, bias_vl, img, 6, 1.5)
    s, sb = router_scores(z, 1.0, bias, bias_vl, img)
    want_ids = cuda_ops().router_topk(sb, 6)[1]
    assert torch.equal(ids, want_ids)
    assert torch.equal(w, route_weights(s, want_ids, 1.5))
