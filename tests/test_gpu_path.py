"""The GPU path's pieces that run anywhere (docs/gpu.md): weights kept in checkpoint form compute the same logits as
the dequantised reference, the fixed-order row sum, FP8 row slices, device errors. The CUDA runs are in
tests/test_gpu_cuda.py."""
import pytest
import torch

from dsv41.model import device as dev
from dsv41.model import quant
from dsv41.model.linear import linear, row_mean, row_sum
from dsv41.model.model import Model, SeqInput
from dsv41.model.ops import reference_ops
from kernels.numerics import tree_row_sum


@pytest.fixture(scope="module")
def ckpt(shared):
    return shared / "vectors/model/tiny-a/checkpoint"


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (n,), generator=g)
    ids[0] = 0
    return ids


def test_kept_quant_weights_give_the_reference_logits_bitwise(ckpt):
    """FP8/FP4 weights held as stored and dequantised per product (the GPU layout) equal the weights dequantised
    at load, bit for bit: dequantisation is exact, so only where it happens differs."""
    ref = Model.load(ckpt)
    kept = Model.load(ckpt, keep_quant=True)
    blk = kept.blocks[2]
    assert isinstance(blk.attn.wq_b, dev.Fp8Weight) and isinstance(blk.moe.shared.w1, dev.Fp8Weight)
    assert all(isinstance(e.w1, dev.Fp4Weight) for e in blk.moe.experts.values())
    ids = _ids(40, 3)
    for m in (ref, kept):
        m._st = m.new_state()
    a = ref.forward([SeqInput(ref._st, ids[:33])])[0]
    b = kept.forward([SeqInput(kept._st, ids[:33])])[0]
    assert torch.equal(a, b)
    for k in range(33, 40):   # decode steps, and the DSpark draft from the same states
        a = ref.forward([SeqInput(ref._st, ids[k:k + 1])])[0]
        b = kept.forward([SeqInput(kept._st, ids[k:k + 1])])[0]
        assert torch.equal(a, b), k
    da = ref.dspark.draft([(ref._st, 7)])[0]
    db = kept.dspark.draft([(kept._st, 7)])[0]
    assert torch.equal(da.tokens, db.tokens) and torch.equal(da.logits, db.logits)


def test_fp8_weight_row_slices_are_whole_blocks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    q, s = quant.quant_fp8(w)
    fw = dev.Fp8Weight(q, s)
    full = quant.dequant_fp8(q, s)
    assert torch.equal(fw[32:64].dequant(), full[32:64])
    assert torch.equal(fw[64:96].dequant(), full[64:96])
    x = torch.randn(5, 64, generator=g)
    assert torch.equal(reference_ops().linear(x, fw[32:64]), linear(x, full[32:64]))
    with pytest.raises(ValueError, match="32-row block"):
        fw[16:48]


def test_tree_row_sum_is_a_sum_and_row_invariant():
    g = torch.Generator().manual_seed(1)
    for width in (1, 5, 128, 1280, 5120, 20480):
        x = torch.randn(7, width, generator=g, dtype=torch.float64).float()
        got = tree_row_sum(x)
        assert got.shape == (7, 1)
        ref = x.double().sum(-1, keepdim=True)
        assert torch.allclose(got.double(), ref, rtol=0, atol=1e-5 * width ** 0.5)
        # a row's bits do not depend on the other rows
        for n in (1, 3, 64):
            rows = torch.randn(n, width, generator=g)
            rows[n - 1] = x[2]
            assert torch.equal(tree_row_sum(rows)[n - 1], got[2])


def test_row_sum_on_cpu_is_torch_sum():
    x = torch.randn(4, 3, 200)
    assert torch.equal(row_sum(x), x.sum(-1, keepdim=True))
    assert torch.equal(row_mean(x), x.mean(-1, keepdim=True))


def test_bad_device_is_a_clear_error(ckpt):
    with pytest.raises(ValueError, match="cpu or cuda"):
        Model.load(ckpt, device="meta")
    with pytest.raises(ValueError, match="float32"):
        Model.load(ckpt, dtype=torch.bfloat16)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            Model.load(ckpt, device="cuda")


def test_make_real_config_is_valid_and_cycles_layer_kinds():
    from dsv41.config import ModelConfig
    from dsv41.model.layout import Layout
    from dsv41.tools.make_real import real_config
    for k in (1, 2, 3, 5):
        cfg = ModelConfig.from_dict(real_config(k))
        t = cfg.text
        assert t.num_hidden_layers == k and t.hidden_size == 5120 and t.n_routed_experts == 384
        assert list(t.compress_ratios) == [(2, 1, 0)[i % 3] for i in range(k)]
        roles = Layout.from_config(t).layers
        assert [r.ratio for r in roles] == list(t.compress_ratios)
        assert all(r.index_source for r in roles if r.ratio)
    with pytest.raises(ValueError):
        real_config(0)


def test_make_real_writes_the_release_shapes(tmp_path):
    """One layer, 2 routed experts, a small vocabulary (the test's only shrink): the loader's inventory check passes
    on the release's names, dtypes and shapes, and the FP8/FP4 weights come back in checkpoint form."""
    from dsv41.config import ModelConfig
    from dsv41.model.weights import load_weights
    from dsv41.tools.make_real import make
    make(tmp_path, layers=1, experts=2, vocab=256)
    cfg = ModelConfig.from_checkpoint(tmp_path)
    W = load_weights(tmp_path, cfg, keep_quant=True)
    wq_b = W["layers.0.attn.wq_b.weight"]
    assert isinstance(wq_b, dev.Fp8Weight) and tuple(wq_b.shape) == (64 * 512, 1280)
    e = W["layers.0.ffn.experts.1.w2.weight"]
    assert isinstance(e, dev.Fp4Weight) and tuple(e.shape) == (5120, 2304)
    w = wq_b.dequant()
    assert torch.isfinite(w).all() and 0.3 / 1280 ** 0.5 < w.std() < 3 / 1280 ** 0.5
