"""The batched round (Model._prepare_round / _keys_round): sequences that bring the same number of rows (decode,
drafted verify) run the history work (window rings, compressor groups, indexer, top-k, key gather) once for the whole
round. A row's bits must be what its sequence gives alone, whatever the other sequences' lengths (padding)."""
import dataclasses

import pytest
import torch

from dsv41.model import model as model_mod
from dsv41.model import ops as ops_mod
from dsv41.model.indexer import KEY_TILE, Indexer
from dsv41.model.model import Model, SeqInput
from dsv41.model.ops import cuda_ops
from kernels.indexer import index_scores, index_scores_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the kernel tests: the interpreter on CPU (conftest)


@pytest.fixture(scope="module")
def model(shared):
    return Model.load(shared / "vectors/model/tiny-a/checkpoint")


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g)


def _count_rounds(monkeypatch):
    calls = []
    orig = Model._round_keys             # every layer of a round, eager history or whole-layer piece, reads it

    def spy(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)
    monkeypatch.setattr(Model, "_round_keys", spy)
    return calls


def test_round_scores_equal_the_per_sequence_tiles():
    """The CPU round's one batched product gives each (row, key) the bits of the 64-key tiles x 16-row tiles of
    Indexer.scores, for 1, 3 and 17 rows per sequence and key counts inside, at and across tile edges."""
    g = torch.Generator().manual_seed(3)
    H, D = 4, 32
    ix = Indexer(layer=0, n_heads=H, head_dim=D, topk=8, wq_b=None, weights_proj=None, wk=None, k_norm=None,
                 eps=1e-6)
    for n in (1, 3, 17):
        counts = [1, KEY_TILE, 70, 200, 0]
        B = len(counts)
        tpad = -(-max(counts) // KEY_TILE) * KEY_TILE
        q = torch.randn(B * n, H, D, generator=g)
        w = torch.randn(B * n, H, generator=g)
        keys = torch.zeros(B, tpad, D)
        limit = []
        for b, c in enumerate(counts):
            keys[b, :c] = torch.randn(c, D, generator=g)
            limit += [min(c, 5 + 40 * i) for i in range(n)]
        got = ix.round_scores(q, w, [keys[b, :c] for b, c in enumerate(counts)], tpad, torch.tensor(limit))
        for b, c in enumerate(counts):
            rows = slice(b * n, (b + 1) * n)
            pos = torch.tensor(limit[rows]) - 1            # ratio 1: row sees entries < pos + 1
            ref = ix.scores(q[rows], w[rows], keys[b, :c], pos, 1)
            assert torch.equal(got[rows, :c], ref), (n, c)
            assert torch.isneginf(got[rows, c:]).all()


def test_round_of_different_lengths_equals_each_alone(model, monkeypatch):
    """Sequences at lengths 1..40 (inside the window, across ratio-2 groups, candidate blocks and the top-k) decode
    together for 6 steps, then verify 3 rows each: every row bitwise equals its sequence's one pass."""
    lens = [1, 6, 9, 17, 26, 40]
    total = max(lens) + 6 + 3
    seqs = [_tokens(total, 10 + i) for i in range(len(lens))]
    ref = [model.forward([SeqInput(model.new_state(), s)])[0] for s in seqs]
    states = [model.new_state() for _ in lens]
    model.forward([SeqInput(st, s[:n]) for st, s, n in zip(states, seqs, lens)])   # prompts: per sequence
    calls = _count_rounds(monkeypatch)
    for k in range(6):
        outs = model.forward([SeqInput(st, s[n + k:n + k + 1]) for st, s, n in zip(states, seqs, lens)])
        for o, r, n in zip(outs, ref, lens):
            assert torch.equal(o[0], r[n + k]), (n, k)
    outs = model.forward([SeqInput(st, s[n + 6:n + 9]) for st, s, n in zip(states, seqs, lens)])
    for o, r, n in zip(outs, ref, lens):
        assert torch.equal(o, r[n + 6:n + 9]), n
    assert len(calls) == 7 * len(model.blocks)            # every layer of every round took the batched path
    for st, s, n in zip(states, seqs, lens):               # and left each state as one pass leaves it
        one = model.new_state()
        model.forward([SeqInput(one, s[:n + 9])])
        for L in one.compressed:
            assert torch.equal(st.compressed[L], one.compressed[L]), L
            assert torch.equal(st.index_keys[L], one.index_keys[L]), L
        for L in one.windows:
            assert torch.equal(st.windows[L], one.windows[L]), L
        for L in one.partial_kv:
            assert torch.equal(st.partial_kv[L], one.partial_kv[L]), L


def test_round_row_does_not_depend_on_its_neighbours(model):
    """A decode row alone == beside 5 much longer sequences (more padded keys, other rings)."""
    s = _tokens(30, 1)
    alone = model.new_state()
    model.forward([SeqInput(alone, s[:20])])
    others = [model.new_state() for _ in range(5)]
    model.forward([SeqInput(o, _tokens(120, 50 + i)) for i, o in enumerate(others)])
    mixed = model.new_state()
    model.forward([SeqInput(mixed, s[:20])])
    for k in range(20, 24):
        a = model.forward([SeqInput(alone, s[k:k + 1])])[0]
        m = model.forward([SeqInput(o, _tokens(1, 90 + k + i)) for i, o in enumerate(others)] +
                          [SeqInput(mixed, s[k:k + 1])])[-1]
        assert torch.equal(a, m), k


def test_round_falls_back_when_rows_differ(model, monkeypatch):
    calls = _count_rounds(monkeypatch)
    a, b = model.new_state(), model.new_state()
    model.forward([SeqInput(a, _tokens(3, 1)), SeqInput(b, _tokens(4, 2))])
    assert not calls
    assert model._prepare_round([(0, 9, 0, a)]) is None    # more rows than the window (8): the per-sequence loop


def test_round_sends_its_integers_once(model):
    """The round's integers are built on the host from the states' metadata: one tensor (one copy on a GPU)."""
    st = model.new_state()
    model.forward([SeqInput(st, _tokens(13, 4))])
    rd = model._prepare_round([(0, 1, st.length, st)])
    assert rd.meta.shape[0] == 1 and rd.meta.dtype == torch.long       # one row-first table, one copy
    assert {f"limit{L}" for L in rd.idx} | {f"cslot{L}" for L in rd.srcs} <= set(rd.cols)


def test_round_ids_positions_and_logit_rows_cross_with_its_metadata(model):
    """A round's token ids, positions and the rows that want logits are part of its one copy (no other host to
    device copy: a pageable one waits for the GPU): columns "ids" and "pos" of the metadata, the rows its tail."""
    a, b = model.new_state(), model.new_state()
    model.forward([SeqInput(a, _tokens(13, 4)), SeqInput(b, _tokens(21, 5))])
    ids = torch.tensor([7, 8, 9, 10, 11, 12])
    rd = model._prepare_round([(0, 3, a.length, a), (3, 3, b.length, b)], ids, [2, 3, 4, 5])
    W = model.t.sliding_window
    assert torch.equal(rd.meta[:, rd.cols["ids"]], ids)
    assert rd.meta[:, rd.cols["pos"] + W - 1].tolist() == [13, 14, 15, 21, 22, 23]
    assert rd.rows.tolist() == [2, 3, 4, 5]
    assert rd.meta.untyped_storage().data_ptr() == rd.rows.untyped_storage().data_ptr()   # one buffer


def test_index_scores_table_kernel_equals_per_sequence_launches():
    """The round kernel reading each sequence's keys through a table of addresses (no padded copy) == index_scores
    per sequence, a sequence without keys included."""
    g = torch.Generator().manual_seed(8)
    H, D, n = 4, 32, 2
    srcs = [torch.randn(c, D, generator=g).to(DEVICE) for c in (5, 0, 64, 90)]
    q = torch.randn(len(srcs) * n, H, D, generator=g).to(DEVICE)
    w = torch.randn(len(srcs) * n, H, generator=g).to(DEVICE)
    table = torch.tensor([k.data_ptr() if k.shape[0] else 0 for k in srcs], dtype=torch.int64, device=DEVICE)
    got = index_scores_table(q, w, table, torch.tensor([k.shape[0] for k in srcs], device=DEVICE), 128, 0.125)
    for b, k in enumerate(srcs):
        if k.shape[0]:
            ref = index_scores(q[b * n:(b + 1) * n], w[b * n:(b + 1) * n], k, 0.125)
            assert torch.equal(got[b * n:(b + 1) * n, :k.shape[0]], ref), b


@pytest.mark.parametrize("kernels", [True, False])
def test_round_scores_on_the_cuda_path_equal_the_per_sequence_path(kernels):
    """Indexer.round_scores on the CUDA path (cuda_ops: on CUDA; on a CPU machine the same op set on CPU tensors with
    the kernels under the interpreter, or the torch fallbacks) gives each row the bits Indexer.scores gives its
    sequence alone on that path."""
    g = torch.Generator().manual_seed(9)
    H, D, n = 4, 32, 1
    ix = Indexer(layer=0, n_heads=H, head_dim=D, topk=8, wq_b=None, weights_proj=None, wk=None, k_norm=None,
                 eps=1e-6, ops=cuda_ops(kernels))
    srcs = [torch.randn(c, D, generator=g).to(DEVICE) for c in (3, 70, 0)]
    q = torch.randn(len(srcs) * n, H, D, generator=g).to(DEVICE)
    w = torch.randn(len(srcs) * n, H, generator=g).to(DEVICE)
    counts = torch.tensor([k.shape[0] for k in srcs], device=DEVICE)
    got = ix.round_scores(q, w, srcs, 128, counts, counts)
    for b, k in enumerate(srcs):
        if k.shape[0]:
            ref = ix.scores(q[b:b + 1], w[b:b + 1], k, torch.tensor([k.shape[0] - 1], device=DEVICE), 1)
            assert torch.equal(got[b:b + 1, :k.shape[0]], ref), b
        assert torch.isneginf(got[b, k.shape[0]:]).all()


def test_grow_rows_reuses_room():
    rows = torch.zeros((0, 4))
    out = model_mod._append_rows(rows, torch.ones(3, 4))
    out2, dst = model_mod._grow_rows(out, 2)
    assert out2.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    dst.copy_(torch.full((2, 4), 2.0))
    assert torch.equal(out2, torch.cat([torch.ones(3, 4), torch.full((2, 4), 2.0)]))


def test_round_gather_kernel_equals_index_select():
    """kernels/round_gather.py (one launch through a table of the sequences' addresses; TRITON interpreter on CPU)
    gives the rows index_select gives per sequence, zeros for -1 (a sequence without entries included)."""
    g = torch.Generator().manual_seed(6)
    D, n, K = 32, 2, 5
    srcs = [torch.randn(c, D, generator=g) for c in (7, 1, 0, 12)]
    idx = torch.full((len(srcs) * n, K), -1)
    for b, s in enumerate(srcs):
        if s.shape[0]:
            idx[b * n:(b + 1) * n, :3] = torch.randint(0, s.shape[0], (n, 3), generator=g)
    srcs, idx = [c.to(DEVICE) for c in srcs], idx.to(DEVICE)
    assert "gather_rows" in cuda_ops().kernels
    ref = ops_mod.gather_round(srcs, idx, n)
    got = cuda_ops().gather_round(srcs, idx, n)
    ok = (idx >= 0)[..., None]
    assert torch.equal(got * ok, ref * ok)
    assert not got[~(idx >= 0)].any()


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU model with the kernel under the interpreter; on a GPU "
                    "tests/test_gpu_cuda.py runs the round on CUDA")
def test_round_with_the_gather_kernel_equals_each_alone(model, monkeypatch):
    """The round's one-launch gather (the CUDA path with kernels on) in the model: rows bitwise as alone."""
    lens = [3, 14, 30]
    seqs = [_tokens(34, 70 + i) for i in range(len(lens))]
    ref = [model.forward([SeqInput(model.new_state(), s)])[0] for s in seqs]
    states = [model.new_state() for _ in lens]
    model.forward([SeqInput(st, s[:n]) for st, s, n in zip(states, seqs, lens)])
    used, wrote = [], []
    kernel = cuda_ops().gather_round         # the CUDA op set's gather, in the reference op set's model
    write = cuda_ops().ring_write            # and its ring writes through the round's table
    assert "scatter_rows" in cuda_ops().kernels
    scored = []
    score = cuda_ops().round_scores          # and the index scores through the round's per-row key addresses
    monkeypatch.setattr(model, "ops", dataclasses.replace(
        model.ops, gather_round=lambda *a: used.append(len(a) == 4) or kernel(*a),
        ring_write=lambda *a: wrote.append(len(a) == 5) or write(*a)))
    for blk in model.blocks:
        if blk.indexer is not None:
            monkeypatch.setattr(blk.indexer, "ops", dataclasses.replace(
                blk.indexer.ops, round_scores=lambda *a: scored.append(a[-1] is not None) or score(*a)))
    for k in range(3):
        outs = model.forward([SeqInput(st, s[n + k:n + k + 1]) for st, s, n in zip(states, seqs, lens)])
        for o, r, n in zip(outs, ref, lens):
            assert torch.equal(o[0], r[n + k]), (n, k)
    outs = model.forward([SeqInput(st, s[n + 3:n + 6]) for st, s, n in zip(states, seqs, lens)])  # verify rows
    for o, r, n in zip(outs, ref, lens):
        assert torch.equal(o, r[n + 3:n + 6]), n
    assert used and all(used) and wrote and all(wrote) and scored and all(scored)   # all through the round's tables


def test_ring_write_kernel_equals_index_copy():
    """kernels/round_gather.scatter_rows (each row to its own ring through a per-row, strided table) == the
    reference's index_copy_ per sequence; a slot of -1 writes nothing."""
    g = torch.Generator().manual_seed(7)
    W, D, n = 8, 32, 3
    rings = [torch.randn(W, D, generator=g).to(DEVICE) for _ in range(4)]
    want = [r.clone() for r in rings]
    rows = torch.randn(len(rings) * n, D, generator=g).to(DEVICE)
    slots = torch.tensor([(5 + b + i) % W for b in range(len(rings)) for i in range(n)], device=DEVICE)
    ops_mod.ring_write(want, rows, slots, n)
    meta = torch.stack([torch.tensor([r.data_ptr() for r in rings]).repeat_interleave(n).to(DEVICE), slots], 1)
    meta[n, 1] = -1                                          # sequence 1's first row: masked
    want[1][slots[n]] = rings[1][slots[n]]
    cuda_ops().ring_write(rings, rows, meta[:, 1], n, meta[:, 0])
    for a, b in zip(rings, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["intended", "quirk"])
def test_round_equals_the_per_sequence_loop_from_fresh_states(model, monkeypatch, mode):
    """From empty states, rounds of 1 and 3 rows per sequence == the per-sequence loop (forced) == a sequence fed
    alone the same way, in both index-key modes (quirk mode is not chunk-invariant by design: arch.md §2.8)."""
    monkeypatch.setattr(model, "index_keys", mode)
    prep = Model._prepare_round
    seqs = [_tokens(12, 30 + i) for i in range(3)]

    def feed(group, n, batched):
        monkeypatch.setattr(Model, "_prepare_round", prep if batched else (lambda self, segs, *a: None))
        sts = [model.new_state() for _ in group]
        outs = [model.forward([SeqInput(st, s[a:a + n]) for st, s in zip(sts, group)]) for a in range(0, 12, n)]
        monkeypatch.setattr(Model, "_prepare_round", prep)
        return [torch.cat([o[b] for o in outs]) for b in range(len(group))]

    for n in (1, 3):
        batched, loop = feed(seqs, n, True), feed(seqs, n, False)
        for b in range(len(seqs)):
            assert torch.equal(batched[b], loop[b]), (n, b)
        assert torch.equal(batched[1], feed(seqs[1:2], n, True)[0]), n
