"""kernels/prompt_gemm.py (the prompt chunks' tensor-core products) against the dequantised float products, its chunk
invariance, and (on the GPU) its bits against the decode kernels'.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; with one (marker gpu) at
V4.1 shapes. Bounds as tests/test_kernels_fp8_linear.py (FP8: |y - ref| <= K · 2^-23 · Σ|x̃ w| against the float64
product of bf16(x) and the exact weight; and a float32 product of unrounded x is measurably further off) and
tests/test_kernels_fp4_moe.py (experts: within 2e-3 · max|ref| of the float64 routed sum with x and h rounded to
bf16). Invariance: a row's bits are the same alone, in a 130-row chunk and in a 2048-row chunk.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import prompt_gemm as P
from kernels.fp4_moe import stack_experts
from kernels.fp8_linear import split_for
from test_kernels_fp4_moe import LIMIT, _close, _deq, _experts, _inputs, _routing
from test_kernels_fp8_linear import _check_close, _weight, _x
from test_kernels_fp8_linear import _deq as _deq8

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("out_f,in_f", [(256, 256), (96, 192)])   # two K chunks / one chunk and a partial tile
@pytest.mark.parametrize("n", [1, 70, 130])
def test_fp8_matches_reference(out_f, in_f, n):
    w, s = _weight(out_f, in_f, seed=out_f + in_f)
    x = _x(n, in_f, seed=n)
    y = P.prompt_fp8_linear(x.to(DEV), w.to(DEV), s.to(DEV))
    assert y.dtype == torch.float32 and y.shape == (n, out_f)
    _check_close(y, x, _deq8(w, s))


def test_fp8_uses_the_decode_kernels_chunks():
    from kernels.fp8_linear import CUDA
    assert split_for(256, 256, CUDA) == 2 and split_for(96, 192, CUDA) == 1


def test_fp8_row_bits_do_not_depend_on_the_chunk():
    w, s = (t.to(DEV) for t in _weight(256, 256, seed=3))
    x = _x(2048, 256, seed=4).to(DEV)
    big = P.prompt_fp8_linear(x, w, s)
    mid = P.prompt_fp8_linear(x[1900:2030], w, s)          # 130 rows: a full row tile and a partial one
    for r in (1900, 1977, 2029):
        alone = P.prompt_fp8_linear(x[r:r + 1], w, s)
        assert torch.equal(alone[0], big[r]) and torch.equal(mid[r - 1900], big[r])
    _check_close(big[::97], x[::97].cpu(), _deq8(w.cpu(), s.cpu()))


def test_fp8_configurations_give_the_same_bits():
    """Tiles, warps and where the K chunks' running sum lives change no bit (each element is its own chain)."""
    w, s = (t.to(DEV) for t in _weight(256, 256, seed=13))
    x = _x(150, 256, seed=14).to(DEV)
    want = P.prompt_fp8_linear(x, w, s)
    for cfg in (P.Config(tot_mem=True), P.Config(bm=64, bn=64, warps=4, tot_mem=True), P.Config(bm=64, bn=256),
                P.Config(swap=not P.FP8_DEFAULT.swap), P.Config(swap=True, tot_mem=True)):
        assert torch.equal(P.prompt_fp8_linear(x, w, s, cfg=cfg), want), cfg


def test_fp8_writes_a_column_block_of_a_wider_result():
    """out=: each product stored into its column block of one result at the result's row stride (the TP shards'
    wq_b side by side), the bits of its own result; out of the wrong shape, dtype or layout refused."""
    parts = [tuple(t.to(DEV) for t in _weight(o, 128, seed=30 + o)) for o in (128, 96)]
    x = _x(70, 128, seed=31).to(DEV)
    out = torch.full((70, 224), float("nan"), device=DEV)
    a = 0
    for w, s in parts:
        got = P.prompt_fp8_linear(x, w, s, out=out[:, a:a + w.shape[0]])
        assert got.data_ptr() == out[:, a:].data_ptr()
        a += w.shape[0]
    assert torch.equal(out, torch.cat([P.prompt_fp8_linear(x, w, s) for w, s in parts], dim=1))
    w, s = parts[0]
    for bad in (torch.empty(70, 96, device=DEV), torch.empty(70, 128, dtype=torch.float64, device=DEV),
                torch.empty(128, 70, device=DEV).t()):
        with pytest.raises(ValueError):
            P.prompt_fp8_linear(x, w, s, out=bad)


def test_fp8_grouped_equals_the_groups_one_by_one():
    w, s = (t.to(DEV) for t in _weight(2 * 128, 128, seed=9))
    x = _x(70, 2 * 128, seed=10).to(DEV)
    y = P.prompt_fp8_linear(x, w, s, groups=2)
    want = torch.cat([P.prompt_fp8_linear(x[:, g * 128:(g + 1) * 128], w[g * 128:(g + 1) * 128], s[g * 4:(g + 1) * 4])
                      for g in range(2)], dim=1)
    assert torch.equal(y, want)
    with pytest.raises(ValueError):
        P.prompt_fp8_linear(x[:, :200], w, s, groups=2)
    with pytest.raises(TypeError):
        P.prompt_fp8_linear(x[:, :128], w.float().bfloat16(), None)


def test_pack_rows_is_bf16_in_the_dot_order():
    """pack_rows permutes each K step as the decode kernels' MMA fragments read it: a permutation of x's bf16
    values (every value once), each MMA's fragment slots from the physical k decode.cu gives them."""
    x = _x(3, 256, seed=1)
    for step in (64, 128):
        xp = P.pack_rows(x.to(DEV), step).float().cpu()
        xb = x.bfloat16().float()
        for blk in range(256 // step):
            a, b = xp[:, blk * step:(blk + 1) * step], xb[:, blk * step:(blk + 1) * step]
            assert torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)
    xb = x.bfloat16().float()
    xp = P.pack_rows(x.to(DEV), 64).float().cpu()
    assert torch.equal(xp[:, [0, 1, 2, 3, 8, 16]], xb[:, [0, 2, 16, 18, 1, 4]])
    # experts (decode.cu's e2m1 MMA pairs): slots 0-3 from values 0, 4, 32, 36; slot 8 from 2; slice 1 from odd codes
    xp = P.pack_rows(x.to(DEV), 128).float().cpu()
    assert torch.equal(xp[:, [0, 1, 2, 3, 8, 16, 32]], xb[:, [0, 4, 32, 36, 2, 1, 8]])


E, H, I, K = 8, 256, 256, 3


@pytest.fixture(scope="module")
def small():
    raw = _experts(E, H, I, seed=11)
    return _deq(raw), [t.to(DEV) for t in stack_experts(raw)]


@pytest.mark.parametrize("n", [1, 70])
def test_moe_matches_reference(small, n):
    exps, W = small
    x = _inputs(n, H, seed=n)
    ids, wts = _routing(n, E, K, seed=n)
    if n > 1:
        ids[1, 2] = -1                   # another rank's expert: contributes nothing
    y = P.prompt_fp4_moe(x.to(DEV), *W, ids.to(DEV), wts.to(DEV), LIMIT)
    assert y.dtype == torch.float32 and y.shape == (n, H)
    _close(y, x, exps, ids, wts)


def test_moe_configurations_give_the_same_bits(small):
    exps, W = small
    x = _inputs(70, H, seed=17)
    ids, wts = _routing(70, E, K, seed=17, skew=True)
    xd, idd, wd = x.to(DEV), ids.to(DEV), wts.to(DEV)
    want = P.prompt_fp4_moe(xd, *W, idd, wd, LIMIT)
    for cfg in (P.Config(bm=64, bn=64, warps=4), P.Config(bm=64, bn=128, swap=not P.MOE_DEFAULT.swap),
                P.Config(bm=128, bn=64, swap=True)):
        assert torch.equal(P.prompt_fp4_moe(xd, *W, idd, wd, LIMIT, cfg=cfg), want), cfg


def test_moe_tp_shards_in_one_pass(small):
    """Every shard's sum from one pass == a pass per shard with the other shards' slots at -1, bitwise."""
    exps, W = small
    x = _inputs(70, H, seed=19).to(DEV)
    ids, wts = (t.to(DEV) for t in _routing(70, E, K, seed=19))
    shard_of = torch.tensor([0, 0, 0, 1, 1, -1, 2, 2], dtype=torch.int32, device=DEV)
    got = P.prompt_fp4_moe(x, *W, ids, wts, LIMIT, shard_of=shard_of, shards=3)
    assert got.shape == (3, 70, H)
    for s in range(3):
        masked = torch.where(shard_of[ids.clamp_min(0)] == s, ids, -1)
        assert torch.equal(got[s], P.prompt_fp4_moe(x, *W, masked, wts, LIMIT)), s


def test_moe_row_bits_do_not_depend_on_the_chunk(small):
    """Skewed routing (an expert's pairs fill several work-list tiles): a row alone == among 130 == among 300."""
    exps, W = small
    n = 300
    x = _inputs(n, H, seed=5)
    ids, wts = _routing(n, E, K, seed=5, skew=True)
    xd, idd, wd = x.to(DEV), ids.to(DEV), wts.to(DEV)
    y = P.prompt_fp4_moe(xd, *W, idd, wd, LIMIT)
    _close(y[::29], x[::29], exps, ids[::29], wts[::29])
    mid = P.prompt_fp4_moe(xd[150:280], *W, idd[150:280], wd[150:280], LIMIT)
    for r in (0, 151, 279):
        alone = P.prompt_fp4_moe(xd[r:r + 1], *W, idd[r:r + 1], wd[r:r + 1], LIMIT)
        assert torch.equal(alone[0], y[r])
        if r >= 150:
            assert torch.equal(mid[r - 150], y[r])


# --- V4.1 shapes on the GPU: the function, the invariance, and the decode kernels' bits ---------------------------

V41 = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_b", 5120, 8192),
       ("shared w1+w3", 4608, 5120), ("shared w2", 5120, 2304), ("indexer wq_b", 4096, 1280)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,out_f,in_f", V41)
def test_fp8_v41_on_gpu(name, out_f, in_f):
    from kernels import cuda
    from kernels import fp8_linear as F
    wd, sd = (t.cuda() for t in _weight(out_f, in_f, seed=out_f ^ in_f))
    x = _x(2048, in_f, seed=1).cuda()
    big = P.prompt_fp8_linear(x, wd, sd)
    _check_close(big[:256], x[:256], _deq8(wd, sd))
    for lo, n in ((0, 130), (37, 1), (1000, 65)):
        assert torch.equal(P.prompt_fp8_linear(x[lo:lo + n], wd, sd), big[lo:lo + n]), f"{name}: rows {lo}+{n}"
    if not cuda.available():
        pytest.skip("no CUDA C compiler: the decode kernel's bits not compared")
    dec = F.fp8_linear(x[:300], wd, sd, cfg=F.CUDA)
    same = (dec == big[:300]).all(dim=1).float().mean().item()
    assert torch.equal(dec, big[:300]), f"{name}: {same:.1%} of the rows have the decode kernel's bits"
    for n in (1, 17, 64, 65, 200):          # the decode kernel's row-tile counts and both of its K-chunk paths
        assert torch.equal(F.fp8_linear(x[:n], wd, sd, cfg=F.CUDA), big[:n]), f"{name}: decode at {n} rows"


@pytest.mark.gpu
def test_fp8_grouped_v41_on_gpu():
    from kernels import cuda
    from kernels import fp8_linear as F
    w, s = (t.cuda() for t in _weight(8 * 1024, 4096, seed=11))
    x = _x(300, 8 * 4096, seed=12).cuda()
    y = P.prompt_fp8_linear(x, w, s, groups=8)
    assert torch.equal(P.prompt_fp8_linear(x[5:6], w, s, groups=8)[0], y[5])
    if cuda.available():
        assert torch.equal(F.fp8_linear_grouped(x, w, s, 8), y)


@pytest.mark.gpu
def test_moe_v41_on_gpu():
    from kernels import cuda
    from kernels import fp4_moe as FM
    raw = _experts(8, 5120, 2304, seed=1)
    exps, W = _deq(raw), [t.cuda() for t in stack_experts(raw)]
    x = _inputs(2048, 5120, seed=2)
    ids, wts = _routing(2048, 8, 6, seed=3)
    xd, idd, wd = x.cuda(), ids.cuda(), wts.cuda()
    big = P.prompt_fp4_moe(xd, *W, idd, wd, LIMIT)
    pick = [0, 1, 700, 2047]
    _close(big[pick], x[pick], exps, ids[pick], wts[pick])
    for lo, n in ((0, 130), (700, 1), (1000, 65)):
        got = P.prompt_fp4_moe(xd[lo:lo + n], *W, idd[lo:lo + n], wd[lo:lo + n], LIMIT)
        assert torch.equal(got, big[lo:lo + n]), f"rows {lo}+{n}"
    if not cuda.available():
        pytest.skip("no CUDA C compiler: the decode kernels' bits not compared")
    dec = FM.fp4_moe(xd[:300], *W, idd[:300], wd[:300], LIMIT, cfg=FM.CUDA)
    same = (dec == big[:300]).all(dim=1).float().mean().item()
    assert torch.equal(dec, big[:300]), f"{same:.1%} of the rows have the decode kernels' bits"
    for n in (1, 9, 64, 65):
        assert torch.equal(FM.fp4_moe(xd[:n], *W, idd[:n], wd[:n], LIMIT, cfg=FM.CUDA), big[:n]), f"decode at {n}"


def test_the_cuda_op_set_has_the_prompt_kernels():
    from dsv41.model.ops import cuda_ops
    assert "prompt_fp8_linear" in cuda_ops(True).kernels


@pytest.mark.gpu
def test_the_device_gives_the_decode_kernels_bits():
    """The check the op set makes before routing rows > PROMPT_ROWS here (False would keep the decode kernels)."""
    from kernels import cuda
    if not cuda.available():
        pytest.skip("no CUDA C compiler: the decode kernels' bits not compared")
    assert P._decode_bits(torch.device("cuda", torch.cuda.current_device()))
    assert P.agrees_with_decode(torch.cuda.current_device())


@pytest.mark.gpu
def test_the_op_set_switches_by_rows_without_changing_a_bit():
    """The op set's FP8 product: the decode kernel up to PROMPT_ROWS rows, the prompt kernel above; a row's bits the
    same either way (wo_b's shape: 4 K chunks)."""
    from dsv41.model.device import Fp8Weight
    from dsv41.model.ops import cuda_ops
    w, s = (t.cuda() for t in _weight(5120, 8192, seed=5))
    x = _x(P.PROMPT_ROWS + 66, 8192, seed=6).cuda()
    ops = cuda_ops(True)
    big = ops.fp8_linear(x, Fp8Weight(w, s))
    assert torch.equal(big, P.prompt_fp8_linear(x, w, s))
    assert torch.equal(ops.fp8_linear(x[:P.PROMPT_ROWS], Fp8Weight(w, s)), big[:P.PROMPT_ROWS])
    # the TP shards' products side by side (Ops.linear_cat): each column block the bits of its own product
    halves = [Fp8Weight(w[:2560], s[:80]), Fp8Weight(w[2560:], s[80:])]
    assert torch.equal(ops.linear_cat(x, halves), torch.cat([ops.fp8_linear(x, h) for h in halves], dim=1))
    assert torch.equal(ops.linear_cat(x[:P.PROMPT_ROWS], halves),
                       torch.cat([ops.fp8_linear(x[:P.PROMPT_ROWS], h) for h in halves], dim=1))
    # projections fused for one decode launch (Ops.fuse): above PROMPT_ROWS each part through the prompt kernel
    w2, s2 = (t.cuda() for t in _weight(1024, 8192, seed=7))
    fw = ops.fuse([Fp8Weight(w, s), Fp8Weight(w2, s2)])
    if fw is not None:
        parts = ops.linear_parts(x, fw)
        assert torch.equal(parts[0], big) and torch.equal(parts[1], P.prompt_fp8_linear(x, w2, s2))
        small = ops.linear_parts(x[:P.PROMPT_ROWS], fw)
        assert torch.equal(small[0], big[:P.PROMPT_ROWS]) and torch.equal(small[1], parts[1][:P.PROMPT_ROWS])
