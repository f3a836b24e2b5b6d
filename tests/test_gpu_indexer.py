"""kernels/indexer.py (the indexer's scores in one launch, used on CUDA by dsv41/model/indexer.py through device.py)
against the torch path, and its row/key invariance. On CPU the kernel runs under TRITON_INTERPRET=1 (conftest)."""
import pytest
import torch

from dsv41.model.indexer import Indexer
from kernels.indexer import index_scores, index_scores_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _indexer(H, D):
    return Indexer(layer=0, n_heads=H, head_dim=D, topk=8, wq_b=None, weights_proj=None, wk=None, k_norm=None, eps=1e-6)


def _inputs(n, T, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, D, generator=g)
    w = torch.randn(n, H, generator=g) * H ** -0.5
    k = torch.randn(T, D, generator=g)
    return q, w, k


@pytest.mark.parametrize("n,T,H,D", [(1, 5, 4, 32), (3, 64, 2, 64), (17, 130, 4, 32), (40, 70, 8, 128)])
def test_index_scores_equal_the_torch_path_to_float32_rounding(n, T, H, D):
    q, w, k = _inputs(n, T, H, D, n + T)
    ix = _indexer(H, D)
    pos = torch.full((n,), 10 ** 6)          # everything visible
    ref = ix.scores(q, w, k, pos, 1)         # the torch path (inputs on the CPU: no kernel)
    got = index_scores(q.to(DEVICE), w.to(DEVICE), k.to(DEVICE), D ** -0.5).cpu()
    assert got.shape == (n, T)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_index_scores_row_and_key_invariant():
    """A (row, key) score is the same bits alone, among 40 rows, and with 3x the keys (chunked == one pass)."""
    H, D = 4, 32
    q, w, k = _inputs(40, 150, H, D, 7)
    q, w, k = q.to(DEVICE), w.to(DEVICE), k.to(DEVICE)
    full = index_scores(q, w, k, 0.1)
    alone = index_scores(q[17:18], w[17:18], k[:50], 0.1)
    assert torch.equal(alone[0], full[17, :50])
    assert torch.equal(index_scores(q[3:9], w[3:9], k, 0.1), full[3:9])


def _round_equals_per_sequence(H, D, n, counts, seed):
    """index_scores_table over sequences of n rows (each reaching its own keys through the table) == index_scores
    per sequence, bit for bit: the round kernel's heads-as-rows product and in-order head sum against the
    per-sequence kernel's rows-as-rows product and head loop."""
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(c, D, generator=g).to(DEVICE) for c in counts]
    q = torch.randn(len(srcs) * n, H, D, generator=g).to(DEVICE)
    w = (torch.randn(len(srcs) * n, H, generator=g) * H ** -0.5).to(DEVICE)
    table = torch.tensor([k.data_ptr() for k in srcs], dtype=torch.int64, device=DEVICE)
    T = max(counts)
    got = index_scores_table(q, w, table, torch.tensor(counts, device=DEVICE), T, D ** -0.5)
    for b, k in enumerate(srcs):
        ref = index_scores(q[b * n:(b + 1) * n], w[b * n:(b + 1) * n], k, D ** -0.5)
        assert torch.equal(got[b * n:(b + 1) * n, :k.shape[0]], ref), b


@pytest.mark.parametrize("H,n", [(20, 1), (32, 3)])
def test_round_kernel_equals_per_sequence_kernel(H, n):
    _round_equals_per_sequence(H, 32, n, [70, 5, 128], seed=H + n)


@pytest.mark.gpu
def test_round_kernel_equals_per_sequence_kernel_at_v41_shapes():
    for n in (1, 2):
        _round_equals_per_sequence(32, 128, n, [1024, 700, 2048, 64, 1000, 1024, 512, 333], seed=n)


@pytest.mark.gpu
def test_one_tf32_pass_gives_the_three_passes_bits_for_qat_inputs():
    """QAT's indexer q and keys (FP4 values times powers of two) are exact in TF32: the one-pass products (the op
    set's choice under QAT) give the three passes' bits, per sequence and in a round, which stays equal to the
    per-sequence kernel. A control: for plain float32 inputs the two modes differ (the mode is really switched)."""
    from dsv41.model.quant import fp4_fake_quant_ue8m0
    g = torch.Generator().manual_seed(5)
    H, D, n, counts = 32, 128, 2, [700, 64, 1024]
    q = fp4_fake_quant_ue8m0(torch.randn(len(counts) * n, H, D, generator=g)).to(DEVICE)
    w = (torch.randn(len(counts) * n, H, generator=g) * H ** -0.5).to(DEVICE)
    srcs = [fp4_fake_quant_ue8m0(torch.randn(c, D, generator=g)).to(DEVICE) for c in counts]
    table = torch.tensor([k.data_ptr() for k in srcs], dtype=torch.int64, device=DEVICE)
    cnt = torch.tensor(counts, device=DEVICE)
    T = max(counts)
    three = index_scores_table(q, w, table, cnt, T, D ** -0.5)
    one = index_scores_table(q, w, table, cnt, T, D ** -0.5, one_pass=True)
    assert torch.equal(one, three)
    for b, k in enumerate(srcs):
        rows = slice(b * n, (b + 1) * n)
        ref = index_scores(q[rows], w[rows], k, D ** -0.5, one_pass=True)
        assert torch.equal(ref, index_scores(q[rows], w[rows], k, D ** -0.5))
        assert torch.equal(one[rows, :k.shape[0]], ref)
    x, kx = torch.randn(4, H, D, generator=g).to(DEVICE), torch.randn(300, D, generator=g).to(DEVICE)
    assert not torch.equal(index_scores(x, w[:4], kx, 0.1, one_pass=True), index_scores(x, w[:4], kx, 0.1))
