"""The op set (dsv41/model/ops.py): which function computes each op is a value chosen once at load, and two op sets
compute the same functions.

- Model.load picks the op set once (the CPU reference; the CUDA path with or without its kernels; EXL3's added) and
  every part of every block holds that one value.
- Two op sets compared op by op on random non-zero inputs, rows 1..64, small shapes: the CPU reference against the
  CUDA path's op set run on CPU tensors (its Triton kernels under TRITON_INTERPRET=1, tests/conftest.py), each within
  the bound its numerics allow (bitwise where both are the same operations in the same order), and the whole model.
- Nothing under dsv41/model reads the environment or a mutable module global inside the forward: a forward and a
  draft run with os.environ watched, and the modules' source is checked for global rebinding, environment reads
  outside load-time functions and module-level mutable state.
"""
from __future__ import annotations

import ast
import collections.abc
import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

from dsv41.model import device as dev
from dsv41.model import quant
from dsv41.model.model import Model, SeqInput
from dsv41.model.moe import Expert, MoE
from dsv41.model.ops import Ops, cuda_ops, ops_for, reference_ops

REF = reference_ops()
CUDA = cuda_ops()                       # the kernels of kernels/ (interpreted on a CPU machine)
FALLBACKS = cuda_ops(kernels=False)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 3, 17, 64]
MODEL_DIR = Path(__file__).resolve().parents[1] / "dsv41" / "model"

needs_kernels = pytest.mark.skipif(not CUDA.kernels, reason="no Triton kernels in kernels/")


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _x(n, k, seed):
    return (torch.randn(n, k, generator=_g(seed)) + 0.1).to(DEVICE)


# ---- chosen once at load -------------------------------------------------------------------------------------------

def test_the_factories_give_one_value_each():
    assert REF.name == "reference" and REF.row_tile == 16 and not REF.kernels and not REF.stacks_experts
    assert FALLBACKS.name == "cuda-fallbacks" and FALLBACKS.row_tile == dev.CUDA_ROW_TILE and not FALLBACKS.kernels
    assert FALLBACKS.stacks_experts and not FALLBACKS.graphs      # the per-expert MoE waits for the host
    assert reference_ops() is REF and cuda_ops() is CUDA          # built once
    assert ops_for("cpu") is REF and ops_for("cpu", kernels=False) is REF
    assert ops_for("cuda") is CUDA and ops_for(torch.device("cuda:1"), kernels=False) is FALLBACKS
    with pytest.raises(dataclasses.FrozenInstanceError):
        REF.row_tile = 64


def _holders(m: Model) -> list:
    out = [m]
    for blk in m.blocks + (m.dspark.stages if m.dspark is not None else []):
        out += [blk, blk.attn, blk.moe, blk.hc_attn, blk.hc_ffn]
        out += [p for p in (blk.compressor, blk.indexer, blk.engram) if p is not None]
    if m.dspark is not None:
        out.append(m.dspark)
    return out


@pytest.fixture(scope="module")
def ckpt():
    from dsv41.api.engine import builtin_checkpoint
    return builtin_checkpoint()


def test_model_load_picks_the_op_set_and_every_block_holds_it(ckpt, monkeypatch):
    monkeypatch.setenv("DSV41_KERNELS", "0")         # read by Model.load on CUDA only: the CPU takes the reference
    m = Model.load(ckpt)
    assert m.ops is REF and all(h.ops is REF for h in _holders(m))
    assert any(b.engram is not None for b in m.blocks) and any(b.indexer is not None for b in m.blocks)
    k = Model.load(ckpt, keep_quant=True, ops=FALLBACKS)
    assert k.ops is FALLBACKS and all(h.ops is FALLBACKS for h in _holders(k))
    assert all(isinstance(b.moe.stack, dev.ExpertStack) for b in k.blocks)     # the CUDA path's stacked experts


def test_an_exl3_pack_adds_its_kernels_at_load(tmp_path):
    from dsv41.model.exl3_load import Exl3Packed, exl3_routed
    from dsv41.tools.make_tiny import main as make_tiny
    make_tiny(["--out", str(tmp_path), "--layers", "7", "--vocab", "512", "--format", "exl3", "--seed", "3"])
    ref = Model.load(tmp_path, keep_quant=True, engram_tables=False)
    assert ref.ops is REF and isinstance(ref.head, Exl3Packed)          # the reference decodes the codes itself
    assert REF.with_exl3() is REF and FALLBACKS.with_exl3() is FALLBACKS
    if not CUDA.kernels:
        return
    ex = CUDA.with_exl3()
    assert ex.name == "cuda+exl3" and "exl3_linear" in ex.kernels and ex.exl3_routed is exl3_routed
    assert ex.with_exl3() is ex and CUDA.exl3_routed is None           # CUDA itself is not changed
    # on the GPU the kernels need the model there (on a CPU machine they run interpreted on CPU tensors)
    m = Model.load(tmp_path, device=DEVICE, keep_quant=True, engram_tables=False, ops=CUDA)
    assert m.ops == ex and all(h.ops == ex for h in _holders(m))
    x = _x(5, ref.head.shape[1], 1)
    want = REF.linear(x.cpu(), ref.head)
    got = ex.linear(x, m.head).cpu()
    assert (got - want).abs().max() <= 2e-3 * want.abs().max()


# ---- two op sets, op by op -------------------------------------------------------------------------------------

def _close(got, want, rtol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max().item() <= rtol * max(want.abs().max().item(), 1e-30), \
        (got - want).abs().max().item()


@pytest.mark.parametrize("n", ROWS)
def test_dense_linear_and_row_ops(n):
    """The reference's 16-row tiles and torch sums against the CUDA path's 64-row tiles and pairwise trees: float32
    results within summation-order rounding; each op row-invariant on both."""
    x = _x(n, 320, n)
    w = torch.randn(96, 320, generator=_g(1)).to(DEVICE)
    for ops in (CUDA, FALLBACKS):
        _close(ops.linear(x, w), REF.linear(x, w))
        _close(ops.row_sum(x), REF.row_sum(x))
        _close(ops.row_mean(x), REF.row_mean(x))
        nw = torch.rand(320, generator=_g(2)).to(DEVICE) + 0.5
        for weight in (nw, None):
            _close(ops.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6))
        # row invariance: the reference's own on the CPU (on CUDA tensors torch's reductions pick their order by the
        # row count, which is why the CUDA path has trees), the CUDA op sets' everywhere
        for o in ((REF, ops) if DEVICE == "cpu" else (ops,)):
            assert torch.equal(o.linear(x[-1:], w), o.linear(x, w)[-1:])
            assert torch.equal(o.rms_norm(x[-1:], nw, 1e-6), o.rms_norm(x, nw, 1e-6)[-1:])


def _fp8(out_f, in_f, seed):
    g = _g(seed)
    w = (torch.randn(out_f, in_f, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(116, 124, (-(-out_f // 32), in_f // 32), generator=g, dtype=torch.uint8)
    return dev.Fp8Weight(w.to(DEVICE), s.view(torch.float8_e8m0fnu).to(DEVICE))


@pytest.mark.parametrize("n", ROWS)
def test_fp8_and_fp4_linear(n):
    """Kept FP8 weights: the reference and the fallbacks dequantise (exact) and multiply in float32; the kernel
    rounds the activations to bf16 (docs/kernels.md): within 2^-8 of Σ|x||w| per output. FP4: both dequantise."""
    w = _fp8(128, 256, 5)
    x = _x(n, 256, 10 + n)
    want = REF.linear(x, w)
    assert torch.equal(want, REF.linear(x, w.dequant()))
    _close(FALLBACKS.linear(x, w), want)
    if "fp8_linear" in CUDA.kernels:
        got = CUDA.linear(x, w)
        bound = 2.0 ** -8 * (x.abs() @ w.dequant().abs().t()) + 1e-30
        assert got.dtype == torch.float32 and bool(((got - want).abs() <= bound).all())
        assert torch.equal(CUDA.linear(x[-1:], w), got[-1:])
    packed = torch.randint(-128, 128, (64, 128), generator=_g(6), dtype=torch.int8).to(DEVICE)
    sc = torch.randint(118, 124, (64, 8), generator=_g(7), dtype=torch.uint8).view(torch.float8_e8m0fnu).to(DEVICE)
    w4 = dev.Fp4Weight(packed, sc)
    want4 = REF.linear(x, w4)
    assert torch.equal(want4, REF.linear(x, quant.dequant_fp4(packed, sc, torch.float32)))
    _close(CUDA.linear(x, w4), want4)


@pytest.mark.parametrize("n", [1, 17])
def test_bf16_weights_and_grouped_products(n):
    """A bf16 weight kept as stored (weights.BF16_KEPT): the reference and the fallbacks widen it (exact: the same
    bits as its float32 copy); the kernel op set runs the bf16 decode product (x rounded to bf16), within 2^-8 of
    Σ|x||w|. wo_a's grouped product: group by group on the reference (the same bits as slicing by hand) and in one
    launch where the kernel runs (the same bits as its own groups one by one)."""
    wb = (torch.randn(96, 128, generator=_g(21)) * 0.05).bfloat16().to(DEVICE)
    x = _x(n, 128, 22 + n)
    want = REF.linear(x, wb.float())
    assert torch.equal(REF.linear(x, wb), want)
    assert torch.equal(FALLBACKS.linear(x, wb), FALLBACKS.linear(x, wb.float()))
    if "bf16_linear" in CUDA.kernels:
        got = CUDA.linear(x, wb)
        bound = 2.0 ** -8 * (x.abs() @ wb.float().abs().t()) + 1e-30
        assert bool(((got - want).abs() <= bound).all())
        assert (got - want).abs().max() > 0                   # the activations' bf16 rounding is the kernel's
    w = _fp8(4 * 64, 96, 23)
    xg = _x(n, 4 * 96, 24 + n)
    by_hand = torch.cat([REF.linear(xg[:, g * 96:(g + 1) * 96], w[g * 64:(g + 1) * 64]) for g in range(4)], dim=1)
    assert torch.equal(REF.grouped(xg, w, 4), by_hand)
    if "fp8_linear" in CUDA.kernels:
        ones = torch.cat([CUDA.linear(xg[:, g * 96:(g + 1) * 96], w[g * 64:(g + 1) * 64]) for g in range(4)], dim=1)
        assert torch.equal(CUDA.grouped(xg, w, 4), ones)


@needs_kernels
@pytest.mark.parametrize("n", [1, 17])
def test_products_of_a_column_slice_read_it_in_place(n, monkeypatch):
    """A column slice of x (wo_b's input of one TP shard) goes into the FP8 / bf16 products at its row stride, not
    copied first (ops._rows), with the bits of its contiguous copy."""
    if "fp8_linear" not in CUDA.kernels:
        pytest.skip("no fp8_linear kernel")
    wide = _x(n, 3 * 256, 40 + n)
    x = wide[:, 256:512]
    assert n == 1 or not x.is_contiguous()
    w = _fp8(128, 256, 41)
    wb = (torch.randn(64, 256, generator=_g(42)) * 0.05).bfloat16().to(DEVICE)
    want = [CUDA.linear(x.contiguous(), w), CUDA.linear(x.contiguous(), wb)]
    copies = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **k: copies.append(t.shape) or real(t, *a, **k))
    got = [CUDA.linear(x, w), CUDA.linear(x, wb)]
    monkeypatch.undo()
    assert all(torch.equal(g, e) for g, e in zip(got, want))
    assert tuple(x.shape) not in [tuple(c) for c in copies]


@pytest.mark.parametrize("n", [1, 17])
def test_products_side_by_side_are_the_cat_of_the_products(n):
    """Ops.linear_cat (the TP shards' wq_b): bitwise the products concatenated, on every op set (the CUDA op set's
    prompt kernel writes the blocks of one result above PROMPT_ROWS rows on a GPU: tests/test_kernels_prompt_gemm.py)."""
    ws = [_fp8(64, 128, 50), _fp8(96, 128, 51)]
    x = _x(n, 128, 52 + n)
    for ops in (REF, FALLBACKS, CUDA):
        assert torch.equal(ops.linear_cat(x, ws), torch.cat([ops.linear(x, w) for w in ws], dim=1)), ops.name


@pytest.mark.parametrize("n", ROWS)
def test_mhc_and_routing_ops_are_the_same_bits(n):
    """Sinkhorn, the stream collapse / expand and the routing weights: the kernels (kernels/rowops.py) and the torch
    functions are the same IEEE operations in the same order, so every op set gives the same bits."""
    g = _g(20 + n)
    hc, hidden = 4, 96
    comb = (torch.softmax(torch.randn(n, hc, hc, generator=g) * 3, dim=-1) + 1e-6).to(DEVICE)
    streams = torch.randn(n, hc, hidden, generator=g).to(DEVICE)
    pre = torch.rand(n, hc, generator=g).to(DEVICE)
    post = torch.rand(n, hc, generator=g).to(DEVICE) * 2
    y = torch.randn(n, hidden, generator=g).to(DEVICE)
    s = torch.randn(n, 64, generator=g).abs().to(DEVICE)
    ids = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(n)]).to(DEVICE)
    want = (REF.sinkhorn(comb, 20, 1e-6), REF.hc_collapse(streams, pre), REF.hc_expand(y, streams, post, comb),
            REF.route_weights(s, ids, 1.5))
    for ops in (CUDA, FALLBACKS):
        got = (ops.sinkhorn(comb, 20, 1e-6), ops.hc_collapse(streams, pre), ops.hc_expand(y, streams, post, comb),
               ops.route_weights(s, ids, 1.5))
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 5, 40])
def test_index_scores_and_a_rounds_scores(n):
    """The indexer's scores: the reference's 64-key x 16-row tiles, the CUDA path's kernel (3xTF32 products, about
    float32's accuracy) or its 64-row tiles; a round of three sequences (one without keys): the reference's padded
    batched product, the CUDA path's table kernel; each row as its sequence alone on the same op set."""
    g = _g(30 + n)
    H, D = 4, 32
    q = torch.randn(3 * n, H, D, generator=g).to(DEVICE)
    w = (torch.randn(3 * n, H, generator=g) * H ** -0.5).to(DEVICE)
    keys = [torch.randn(c, D, generator=g).to(DEVICE) for c in (70, 0, 5)]
    counts = torch.tensor([k.shape[0] for k in keys], device=DEVICE)
    for ops in (CUDA, FALLBACKS):
        rs = ops.round_scores(q, w, keys, 128, counts, D ** -0.5)
        want_r = REF.round_scores(q, w, keys, 128, counts, D ** -0.5)
        for b, k in enumerate(keys):
            if not k.shape[0]:
                continue
            rows = slice(b * n, (b + 1) * n)
            want = REF.index_scores(q[rows], w[rows], k, D ** -0.5)
            assert torch.equal(want_r[rows, :k.shape[0]], want)
            got = ops.index_scores(q[rows], w[rows], k, D ** -0.5)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            assert torch.equal(rs[rows, :k.shape[0]], got)


def test_a_rounds_key_gather():
    g = _g(40)
    D, n, K = 32, 2, 5
    srcs = [torch.randn(c, D, generator=g).to(DEVICE) for c in (7, 1, 0, 12)]
    idx = torch.full((len(srcs) * n, K), -1)
    for b, s in enumerate(srcs):
        if s.shape[0]:
            idx[b * n:(b + 1) * n, :3] = torch.randint(0, s.shape[0], (n, 3), generator=g)
    idx = idx.to(DEVICE)
    want = REF.gather_round(srcs, idx, n)
    ok = (idx >= 0)[..., None]
    for ops in (CUDA, FALLBACKS):
        assert torch.equal(ops.gather_round(srcs, idx, n) * ok, want * ok)


@needs_kernels
@pytest.mark.parametrize("n", [1, 9, 64])
def test_routed_experts_one_launch_against_the_reference_loop(n):
    """A layer's stacked FP4 experts: the CUDA path's grouped kernel (x and h rounded to bf16) against the
    reference's per-expert loop (float32), a TP shard's experts alone included; the reference has no grouped
    implementation (routed gives None: MoE runs the loop)."""
    H, inter, E, top_k = 128, 128, 8, 3
    g = _g(50 + n)

    def fp4(rows, cols):
        p = torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8).to(DEVICE)
        s = torch.randint(118, 122, (rows, cols // 32), generator=g, dtype=torch.uint8).to(DEVICE)
        return dev.Fp4Weight(p, s.view(torch.float8_e8m0fnu))

    experts = {e: Expert(fp4(inter, H), fp4(H, inter), fp4(inter, H)) for e in range(E)}
    stack = dev.stack_experts(experts, E)
    shared = Expert(*(torch.zeros(s, device=DEVICE) for s in ((inter, H), (H, inter), (inter, H))))
    moe = MoE(gate=torch.randn(E, H, generator=g).to(DEVICE), bias=torch.zeros(E, device=DEVICE),
              bias_vl=torch.zeros(E, device=DEVICE), experts=experts, shared=shared, top_k=top_k, gate_temp=1.0,
              scaling=1.5, limit=10.0, stack=stack, ops=REF)
    x = _x(n, H, 60 + n) * 0.3
    weights, ids = moe.route(x)
    assert REF.routed(stack, x, weights, ids, 10.0) is None
    for shard in (None, range(0, E // 2)):
        want = moe._routed(x, weights, ids, shard)
        got = CUDA.routed(stack, x, weights, ids, 10.0, shard)
        assert got.shape == want.shape and want.abs().max() > 0
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
        assert torch.equal(CUDA.routed(stack, x[-1:], weights[-1:], ids[-1:], 10.0, shard), got[-1:])


@needs_kernels
@pytest.mark.parametrize("n", [1, 9, 64])
def test_routed_shards_in_one_pass_equal_a_pass_per_shard(n):
    """Two (three) TP shards' routed sums from one grouped pass (one work list, gate/up, down; each shard's own slot
    sum) are bitwise the passes shard by shard with the other shards' slots masked (what 2 ranks compute), and a
    slot of an expert in no shard adds nothing; the reference and the fallbacks have no such pass."""
    H, inter, E, top_k = 128, 128, 8, 3
    g = _g(80 + n)

    def fp4(rows, cols):
        p = torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8).to(DEVICE)
        s = torch.randint(118, 122, (rows, cols // 32), generator=g, dtype=torch.uint8).to(DEVICE)
        return dev.Fp4Weight(p, s.view(torch.float8_e8m0fnu))

    experts = {e: Expert(fp4(inter, H), fp4(H, inter), fp4(inter, H)) for e in range(E)}
    x = _x(n, H, 90 + n) * 0.3
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(n)]).to(DEVICE)
    weights = (torch.rand(n, top_k, generator=g) + 0.1).to(DEVICE)
    for ranges in ([range(0, 4), range(4, 8)], [range(0, 3), range(3, 5), range(6, 8)]):   # expert 5: in none
        stack = dev.stack_experts(experts, E)
        assert REF.routed_shards(stack, x, weights, ids, 10.0, len(ranges)) is None     # no shard table yet
        dev.shard_stack(stack, ranges)
        assert REF.routed_shards(stack, x, weights, ids, 10.0, len(ranges)) is None
        assert FALLBACKS.routed_shards(stack, x, weights, ids, 10.0, len(ranges)) is None
        got = CUDA.routed_shards(stack, x, weights, ids, 10.0, len(ranges))
        assert got.shape == (len(ranges), n, H)
        for i, rng in enumerate(ranges):
            want = CUDA.routed(stack, x, weights, ids, 10.0, rng)
            assert torch.equal(got[i], want), f"shard {i} of {len(ranges)}"
        assert got.abs().amax() > 0


@pytest.mark.parametrize("ops", [FALLBACKS, pytest.param(CUDA, marks=[needs_kernels, pytest.mark.slow])],
                         ids=["fallbacks", "kernels"])
def test_the_model_on_two_op_sets(ckpt, ops):
    """The built-in tiny checkpoint (no QAT: its fake-quant roundings could flip on float32 noise) on the reference
    and on the CUDA path's op set (on the GPU when there is one), a prompt then a decode row: the logits agree to
    float32 summation noise (the kernels on a GPU: in direction, their bf16 operands move them by a few %) and the
    greedy picks are the same wherever the reference's top two are further apart than the difference."""
    ids = torch.randint(3, 4000, (9,), generator=_g(70))
    out = {}
    for o in (REF, ops):
        m = Model.load(ckpt, qat=False, ops=o, device="cpu" if o is REF else DEVICE)
        st = m.new_state()
        out[o.name] = torch.cat([m.forward([SeqInput(st, ids[:8])])[0], m.forward([SeqInput(st, ids[8:])])[0]])
    a, b = out[REF.name], out[ops.name].cpu()
    d = (a - b).abs().amax(-1)
    if DEVICE == "cuda" and ops.kernels:
        # bf16 operands through two layers of a random tiny model move logits by ~5 % of their range, and a router
        # near-tie flipped by that noise moves a position by O(1) (cosine 0.93 seen): the bound is statistical, as
        # the vectors' kernel test's. The rows still point the same way; a wiring bug (a wrong expert, scale or
        # head) would turn every position
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).median() >= 0.99
    else:
        assert d.max() <= 1e-5 * a.abs().max()
    top2 = a.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * d
    assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
    assert clear.any() or DEVICE == "cuda"


@pytest.mark.parametrize("n", [1, 5])
def test_attention_on_the_op_sets(n):
    """`Ops.attend` (each row's heads over its own key set, read from a pool through indices, the sink in the
    denominator only): the CUDA path's kernel (bf16 q, k and P) against the reference within their rounding (max|o -
    ref| <= 1e-2 · max|pool|), the reference bitwise its own form on the gathered keys (masked slots read anything),
    and a row alone == the same row among others, bit for bit."""
    heads, D, K, P = 16, 32, 40, 57
    g = _g(80 + n)
    q = (torch.randn(n, heads, D, generator=g) * 2).to(DEVICE)
    pool = torch.randn(P, D, generator=g).to(DEVICE)
    idx = torch.randint(0, P, (n, K), generator=g)
    idx = torch.where(torch.rand(n, K, generator=g) > 0.3, idx, -1)
    idx[:, 0] = 3
    idx = idx.to(DEVICE)
    sink = torch.randn(heads, generator=g).to(DEVICE)
    want = REF.attend(q, pool, idx, sink, D ** -0.5)
    keys = torch.where((idx >= 0)[..., None], pool[idx.clamp(min=0)], 1e3)          # gathered, junk where masked
    slots = torch.arange(n * K, device=DEVICE).view(n, K)
    assert torch.equal(REF.attend(q, keys.reshape(n * K, D), torch.where(idx >= 0, slots, -1), sink, D ** -0.5),
                       want)
    for ops in (FALLBACKS, CUDA):
        got = ops.attend(q, pool, idx, sink, D ** -0.5)
        assert (got - want).abs().max() <= 1e-2 * pool.abs().max()
        assert torch.equal(ops.attend(q[-1:], pool, idx[-1:], sink, D ** -0.5), got[-1:])


@pytest.mark.parametrize("n", [1, 6])
def test_attention_runs_every_shard_in_one_call_where_the_op_set_keeps_each_shards_bits(n):
    """`Attention.attend` with 2 TP shards of 16 heads: the CUDA op set's kernel computes every head apart, so the
    layer makes one call over all 32 heads, bit for bit the two shards' own calls (what two ranks compute); the
    reference keeps a call per shard (a product's bits depend on its head count), unchanged."""
    from dsv41.model.attention import Attention
    heads, D, K, P = 32, 16, 24, 40
    g = _g(90 + n)
    q = (torch.randn(n, heads, D, generator=g) * 2).to(DEVICE)
    pool = torch.randn(P, D, generator=g).to(DEVICE)
    idx = torch.where(torch.rand(n, K, generator=g) > 0.3, torch.randint(0, P, (n, K), generator=g), -1).to(DEVICE)
    sink = torch.randn(heads, generator=g)
    wq_b = torch.empty(heads * D, 1)
    e, w = torch.empty(0), torch.empty(0, 1)        # the projections attend does not use
    for ops in (CUDA, REF):
        att = Attention(w, e, wq_b, w, e, sink.to(DEVICE), e, e, head_dim=D, o_lora=1, eps=1e-20, shards=2,
                        ops=ops)
        calls = []
        real = ops.sparse_attend

        def counted(*a, real=real, calls=calls):
            calls.append(a[1].shape[1])
            return real(*a)
        att.ops = dataclasses.replace(ops, sparse_attend=counted)
        if hasattr(real, "all_shards"):
            counted.all_shards = real.all_shards
        got = att.attend(q, pool, idx)
        apart = torch.cat([ops.attend(q[:, i * 16:(i + 1) * 16].contiguous(), pool, idx,
                                      sink[i * 16:(i + 1) * 16].to(DEVICE).float(), D ** -0.5) for i in (0, 1)], 1)
        assert torch.equal(got, apart)
        assert calls == ([32] if ops is CUDA else [16, 16])


# ---- nothing inside the math reads the environment or a mutable global -----------------------------------------

class _WatchedEnviron(collections.abc.MutableMapping):
    """os.environ that notes every read made from a file under dsv41/model (the nearest frame outside os and
    collections.abc)."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def _note(self, key):
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename in (os.__file__, collections.abc.__file__, __file__):
            f = f.f_back
        name = f.f_code.co_filename if f is not None else ""
        if os.path.abspath(name).startswith(str(MODEL_DIR) + os.sep):
            self.reads.append(f"{os.path.basename(name)}:{f.f_lineno} {f.f_code.co_name}: {key}")

    def __getitem__(self, key):
        self._note(key)
        return self.real[key]

    def __contains__(self, key):
        self._note(key)
        return key in self.real

    def get(self, key, default=None):
        self._note(key)
        return self.real.get(key, default)

    def __iter__(self):
        self._note("*")
        return iter(self.real)

    def __len__(self):
        return len(self.real)

    def __setitem__(self, key, value):
        self.real[key] = value

    def __delitem__(self, key):
        del self.real[key]


def _exercise(m: Model) -> None:
    a, b = m.new_state(), m.new_state()
    m.forward([SeqInput(a, torch.randint(3, 4000, (12,), generator=_g(80)))])
    m.forward([SeqInput(b, torch.tensor([5, 6, 7])), SeqInput(a, torch.tensor([9]), logits="none")])
    for k in range(3):
        m.forward([SeqInput(s, torch.tensor([11 + k])) for s in (a, b)])
    if m.dspark is not None:
        m.dspark.draft([(a, 7), (b, 9)])


@pytest.mark.parametrize("ops", [REF, FALLBACKS], ids=["reference", "cuda-fallbacks"])
def test_the_forward_reads_no_environment(ckpt, ops, monkeypatch):
    watched = _WatchedEnviron(os.environ)
    monkeypatch.setattr(os, "environ", watched)
    Model.load(ckpt, ops=ops, cuda_graphs=True)       # the load reads its knobs (DSV41_GRAPHS): the watch sees them
    assert any("DSV41_GRAPHS" in r for r in watched.reads), watched.reads
    m = Model.load(ckpt, ops=ops)
    watched.reads.clear()
    _exercise(m)
    assert not watched.reads, watched.reads


def _model_sources():
    return sorted(MODEL_DIR.glob("*.py"))


# module-level names bound to mutable values that the forward never writes: constant tables, the logger, and the
# CUDA start-up check's memo (written by setup_cuda at load)
MUTABLE_OK = {("device.py", "_cuda_ready"), ("engram_store.py", "log"), ("engram_store.py", "_DTYPE_BYTES"),
              ("graphs.py", "log"), ("exl3.py", "V41_PACK_BITS"), ("exl3.py", "__all__"), ("vision.py", "__all__")}
# functions that may read the environment: start-up and load, never the forward
ENV_OK = {("device.py", "setup_cuda"), ("model.py", "load")}


def test_no_module_of_the_model_keeps_mutable_state_or_reads_the_environment_in_the_math():
    bad = []
    for path in _model_sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:                       # module-level bindings of mutable values
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                v = node.value
                mutable = isinstance(v, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp,
                                         ast.Call)) and not (isinstance(v, ast.Call) and _immutable_call(v))
                for t in targets:
                    name = ast.unparse(t)
                    if mutable and (path.name, name) not in MUTABLE_OK:
                        bad.append(f"{path.name}: module-level mutable {name} = {ast.unparse(v)[:60]}")
        outer = {}                                   # node -> the module-level function (or method) holding it
        for top in tree.body:
            fns = [top] if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                [f for f in top.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))] \
                if isinstance(top, ast.ClassDef) else []
            for fn in fns:
                for node in ast.walk(fn):
                    outer[node] = fn.name
        for node in ast.walk(tree):
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                bad.append(f"{path.name}:{node.lineno}: rebinds {node.names}")
            if isinstance(node, ast.Attribute) and ast.unparse(node) in ("os.environ", "os.getenv", "os.environb") \
                    and (path.name, outer.get(node)) not in ENV_OK:
                bad.append(f"{path.name}:{node.lineno} {outer.get(node) or '(module level)'}: reads "
                           f"{ast.unparse(node)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                    {a.name for a in node.names} & {"environ", "getenv", "environb"}:
                bad.append(f"{path.name}:{node.lineno}: imports the environment")
    assert not bad, "\n".join(bad)


def _immutable_call(call: ast.Call) -> bool:
    """Calls whose value is immutable (or a compiled pattern / a type alias): float(), tuple(), range(), re.compile,
    frozenset(), torch tensors kept as constants (never written), logging.getLogger (allow-listed by name)."""
    f = ast.unparse(call.func)
    return f in ("float", "int", "tuple", "frozenset", "range", "re.compile", "_fp4_byte_table") or \
        f.endswith(".to") or f.startswith("torch.")


def test_the_op_set_is_frozen_and_its_fields_are_functions():
    for ops in (REF, CUDA, FALLBACKS):
        for f in dataclasses.fields(Ops):
            v = getattr(ops, f.name)
            if f.name in ("name",):
                assert isinstance(v, str)
            elif f.name == "row_tile":
                assert isinstance(v, int)
            elif f.name in ("stacks_experts", "graphs"):
                assert isinstance(v, bool)
            elif f.name == "kernels":
                assert isinstance(v, tuple)
            else:
                assert v is None or callable(v), f.name


@needs_kernels
def test_projections_sharing_an_input_in_one_launch():
    """The kernel op set builds one FusedWeight at load for wq_a + wkv, the compressor's wkv + wgate and the shared
    expert's w1 + w3 of every TP shard (the blocks then hold views of it), and a fused block's outputs are bitwise
    those of the same block with each product in its own launch; the reference fuses nothing."""
    from dsv41.model.attention import Attention
    from dsv41.model.compressor import Compressor
    H, g = 256, _g(120)
    unfused = dataclasses.replace(CUDA, fuse_linears=None, fused_linear=None)

    def fp8(rows, cols):
        q = (torch.randn(rows, cols, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.randint(118, 124, (rows // 32, cols // 32), generator=g, dtype=torch.uint8)
        return dev.Fp8Weight(q.to(DEVICE), s.view(torch.float8_e8m0fnu).to(DEVICE))

    x = _x(5, H, 121) * 0.2
    # attention: q_lora 128, head_dim 64, 2 heads
    parts = dict(wq_a=fp8(128, H), q_norm=torch.ones(128, device=DEVICE), wq_b=fp8(128, 128), wkv=fp8(64, H),
                 kv_norm=torch.ones(64, device=DEVICE), attn_sink=torch.zeros(2, device=DEVICE), wo_a=fp8(64, 128),
                 wo_b=fp8(H, 64), head_dim=64, o_lora=64, eps=1e-6)
    a, b = Attention(**parts, ops=CUDA), Attention(**parts, ops=unfused)
    assert a.fused_in is not None and b.fused_in is None and Attention(**parts, ops=REF).fused_in is None
    assert a.wq_a.q.data_ptr() == a.fused_in.w.q.data_ptr()                 # a view of the one copy
    cos, sin = torch.ones(5, 16, device=DEVICE) * 0.6, torch.ones(5, 16, device=DEVICE) * 0.8
    for u, v in zip(a.project(x, cos, sin, False), b.project(x, cos, sin, False)):
        assert torch.equal(u, v)
    # wq_b over two TP shards (views of its rows): one launch at one row, the shards' products side by side
    wq_b = parts["wq_b"]
    a.shards, a.wq_b_shards = 2, [wq_b[:64], wq_b[64:]]
    a.fused_q = CUDA.fuse_parts(wq_b, (64, 64))
    assert a.fused_q is not None and a.fused_q.w is wq_b and REF.fuse_parts is None
    many = a.project(x, cos, sin, False)                    # 5 rows: the shards' products apart (linear_cat)
    for r in (0, 3):
        one = a.project(x[r:r + 1], cos[r:r + 1], sin[r:r + 1], False)
        for u, v in zip(one, many):
            assert torch.equal(u[0], v[r])                  # a row alone (one launch) == among five
    # compressor (bf16 weights)
    bf = [(torch.randn(64, H, generator=g) / 16).bfloat16().to(DEVICE) for _ in range(2)]
    ca = Compressor(layer=0, ratio=2, wkv=bf[0], wgate=bf[1], norm=torch.ones(64, device=DEVICE), eps=1e-6, ops=CUDA)
    cb = Compressor(layer=0, ratio=2, wkv=bf[0], wgate=bf[1], norm=torch.ones(64, device=DEVICE), eps=1e-6,
                    ops=unfused)
    assert ca.fused_in is not None and cb.fused_in is None
    for u, v in zip(ca.project(x), cb.project(x)):
        assert torch.equal(u, v)
    # the shared expert over 2 TP shards (w1/w3 rows, w2 columns), no routed experts picked
    inter = 256
    w1, w3, w2 = fp8(inter, H), fp8(inter, H), fp8(H, inter)
    E = 4
    outs = []
    for ops in (CUDA, unfused):
        sh = Expert(w1=w1, w2=w2, w3=w3)
        shards = [Expert(w1=a_, w2=c_, w3=b_) for a_, b_, c_ in zip(dev.shard_rows(w1, 2), dev.shard_rows(w3, 2),
                                                                    dev.shard_cols(w2, 2))]
        moe = MoE(gate=torch.randn(E, H, generator=_g(7)).to(DEVICE), bias=torch.zeros(E, device=DEVICE),
                  bias_vl=torch.zeros(E, device=DEVICE), experts={}, shared=sh, top_k=2, gate_temp=1.0,
                  scaling=1.0, limit=10.0, ops=ops, shards=2, shard_ranges=[range(0, 2), range(2, 4)],
                  shared_shards=shards)
        moe.fuse_shared()
        assert (moe.shared_in is not None) == (ops is CUDA)
        if ops is CUDA:
            assert moe.shared_in.outs == (128, 128, 128, 128)
            assert sh.w1.q.data_ptr() == moe.shared_in.w.q.data_ptr() == shards[0].w1.q.data_ptr()
            from dsv41.model.device import one_run
            parts = CUDA.linear_parts(x, moe.shared_in)            # the shards' gates (and ups) lie one after another:
            assert one_run(parts[:2]) is not None                   # their SwiGLU in one launch
            assert one_run([parts[0], parts[2]]) is None
        outs.append(moe(x))
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().amax() > 0


def test_qat_picks_the_one_pass_index_scores_at_load():
    """Under QAT the indexer's q and keys are exact in TF32, so the CUDA op set's index-score kernels run one TF32
    pass (kernels/indexer.py; the GPU test checks the bits are the three passes'): an op set of its own, chosen once
    at load; one without those kernels is unchanged."""
    assert REF.with_exact_index_inputs() is REF and FALLBACKS.with_exact_index_inputs() is FALLBACKS
    if "index_scores" not in CUDA.kernels:
        return
    one = CUDA.with_exact_index_inputs()
    assert one.name == "cuda+tf32-index" and one.kernels == CUDA.kernels and one is CUDA.with_exact_index_inputs()
    assert one.index_scores is not CUDA.index_scores and one.round_scores is not CUDA.round_scores
    assert one.fp8_linear is CUDA.fp8_linear                       # nothing else changes
