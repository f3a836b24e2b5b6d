"""Bitwise exactness of the CPU float32 forward: a row's logits are a pure function of its sequence's tokens,
however rows are grouped into forwards (docs/architecture.md "Exactness"; docs/model.md)."""
import pytest
import torch

from dsv41.model.linear import ROW_TILE, linear, tiled
from dsv41.model.model import InputError, Model, SeqInput


@pytest.fixture(scope="module")
def model(shared):
    return Model.load(shared / "vectors/model/tiny-a/checkpoint")


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (n,), generator=g)
    ids[0] = 0
    if n >= 20:  # a recurring 4-gram, so Engram's longer n-grams hit
        ids[12:16] = ids[4:8]
    return ids


def _one_pass(model, ids):
    st = model.new_state()
    return model.forward([SeqInput(st, ids)])[0], st


def _chunked(model, ids, chunk):
    st = model.new_state()
    outs = [model.forward([SeqInput(st, ids[a:a + chunk])])[0] for a in range(0, len(ids), chunk)]
    return torch.cat(outs), st


# ---- the primitives -------------------------------------------------------------------------------------------

def test_linear_row_is_independent_of_tile_position_and_neighbours():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g)
    row = torch.randn(1, 160, generator=g)
    ref = linear(row, w)
    for n in (2, 5, ROW_TILE, ROW_TILE + 3, 3 * ROW_TILE + 1):
        for at in {0, n // 2, n - 1}:
            x = torch.randn(n, 160, generator=g) * 50
            x[at] = row[0]
            assert torch.equal(linear(x, w)[at], ref[0]), (n, at)


def test_tiled_bmm_row_is_independent_of_neighbours():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 128, generator=g)
    k = torch.randn(1, 14, 128, generator=g)
    f = lambda a, b: torch.bmm(a, b.transpose(1, 2))
    ref = tiled(f, q, k)
    for n, at in ((3, 2), (ROW_TILE, 7), (ROW_TILE + 5, ROW_TILE + 1)):
        qs, ks = torch.randn(n, 4, 128, generator=g), torch.randn(n, 14, 128, generator=g)
        qs[at], ks[at] = q[0], k[0]
        assert torch.equal(tiled(f, qs, ks)[at], ref[0])


# ---- the model ------------------------------------------------------------------------------------------------

def test_chunks_of_1_3_8_equal_one_pass(model):
    ids = _tokens(41, 1)  # > window 8, crosses ratio-2 groups, > topk 6 and > 3 candidate blocks of 4
    ref, ref_st = _one_pass(model, ids)
    for chunk in (1, 3, 8):
        out, st = _chunked(model, ids, chunk)
        assert torch.equal(out, ref), f"chunk {chunk}: max |d| {(out - ref).abs().max():.3g}"
        assert st.length == ref_st.length == len(ids)


def test_batch_of_four_equals_each_alone(model):
    lens = (37, 5, 23, 12)
    seqs = [_tokens(n, 10 + i) for i, n in enumerate(lens)]
    alone = [_one_pass(model, s)[0] for s in seqs]
    states = [model.new_state() for _ in seqs]
    together = model.forward([SeqInput(st, s) for st, s in zip(states, seqs)])
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


def test_mixed_round_prefill_chunk_with_decode_rows(model):
    """A forward holding one sequence's prompt chunk and other sequences' single decode rows."""
    a_ids, b_ids, c_ids = _tokens(30, 21), _tokens(19, 22), _tokens(26, 23)
    ref_a, ref_b, ref_c = (_one_pass(model, s)[0] for s in (a_ids, b_ids, c_ids))
    sa, sb, sc = model.new_state(), model.new_state(), model.new_state()
    model.forward([SeqInput(sb, b_ids[:18]), SeqInput(sc, c_ids[:20])])
    outs_a = []
    outs_a.append(model.forward([SeqInput(sa, a_ids[:11])])[0])
    mixed = model.forward([SeqInput(sa, a_ids[11:30], logits="all"), SeqInput(sb, b_ids[18:19], logits="last"),
                           SeqInput(sc, c_ids[20:21], logits="all")])
    outs_a.append(mixed[0])
    assert torch.equal(torch.cat(outs_a), ref_a)
    assert torch.equal(mixed[1][0], ref_b[18])
    assert torch.equal(mixed[2][0], ref_c[20])
    for k in range(21, 26):
        assert torch.equal(model.forward([SeqInput(sc, c_ids[k:k + 1])])[0][0], ref_c[k])


def test_prompt_then_decode_equals_one_pass(model):
    ids = _tokens(34, 3)
    ref, _ = _one_pass(model, ids)
    st = model.new_state()
    rows = [model.forward([SeqInput(st, ids[:17])])[0]]
    for k in range(17, len(ids)):
        rows.append(model.forward([SeqInput(st, ids[k:k + 1], logits="last")])[0])
    assert torch.equal(torch.cat(rows), ref)


def test_snapshot_restore_equals_cold(model):
    ids = _tokens(36, 4)
    ref, _ = _one_pass(model, ids)
    st = model.new_state()
    model.forward([SeqInput(st, ids[:15])])          # odd length: a ratio-2 group is left open in the snapshot
    snap = st.snapshot()
    nbytes = st.nbytes()
    other = model.forward([SeqInput(st, _tokens(9, 99))])[0]      # diverge
    assert st.length == 24
    st.restore(snap)
    assert st.length == 15 and st.nbytes() == nbytes
    out = model.forward([SeqInput(st, ids[15:])])[0]
    assert torch.equal(out, ref[15:])
    # the snapshot is still intact: restore it into a fresh state and decode token by token
    st2 = model.new_state()
    st2.restore(snap)
    rows = [model.forward([SeqInput(st2, ids[k:k + 1])])[0] for k in range(15, 20)]
    assert torch.equal(torch.cat(rows), ref[15:20])
    assert not torch.equal(other[:5], ref[15:20])


def test_state_grows_with_length(model):
    st = model.new_state()
    model.forward([SeqInput(st, _tokens(10, 5))])
    a = st.nbytes()
    model.forward([SeqInput(st, _tokens(20, 6))])
    assert st.nbytes() > a > 0


def test_bad_input_raises_typed_error(model):
    st = model.new_state()
    with pytest.raises(InputError):
        model.forward([SeqInput(st, torch.tensor([1, 512]))])
    with pytest.raises(InputError):
        model.forward([SeqInput(st, torch.tensor([], dtype=torch.long))])
    with pytest.raises(InputError):
        model.forward([SeqInput(st, torch.tensor([1]), logits="some")])
    with pytest.raises(InputError):
        model.forward([SeqInput(st, torch.tensor([1])), SeqInput(st, torch.tensor([2]))])
    assert st.length == 0


def test_image_rows(model):
    """Image positions: embedding replaced by the given rows, hashed as DEAD, routed with bias_vl; still batch-
    and chunk-invariant."""
    t = model.t
    ids = _tokens(20, 8)
    ids[5:10] = model.cfg.image_token_id
    tt = torch.full((20,), -1)
    tt[5:10] = torch.tensor([0, 1, 1, 2, 3])
    g = torch.Generator().manual_seed(9)
    emb = torch.randn(20, t.hidden_size, generator=g)
    st = model.new_state()
    ref = model.forward([SeqInput(st, ids, embeds=emb, token_type=tt)])[0]
    assert (st.engram_history[5:10] == -1).all() and (st.engram_history[:5] >= 0).all()
    st2, other = model.new_state(), model.new_state()
    parts = [model.forward([SeqInput(st2, ids[:7], embeds=emb[:7], token_type=tt[:7]),
                            SeqInput(other, _tokens(11, 12))])[0],
             model.forward([SeqInput(st2, ids[7:], embeds=emb[7:], token_type=tt[7:])])[0]]
    assert torch.equal(torch.cat(parts), ref)
    emb2 = emb.clone()
    emb2[6] += 1
    changed = model.forward([SeqInput(model.new_state(), ids, embeds=emb2, token_type=tt)])[0]
    assert torch.equal(changed[:6], ref[:6]) and not torch.equal(changed[6:], ref[6:])
    moe = model.blocks[0].moe
    x = torch.randn(8, t.hidden_size, generator=g)
    _, ids_vl = moe.route(x, torch.ones(8, dtype=torch.bool))
    s = torch.sqrt(torch.nn.functional.softplus(x @ moe.gate.t()))
    assert torch.equal(ids_vl, torch.sort(s + moe.bias_vl, dim=1, descending=True, stable=True).indices[:, :moe.top_k])


def test_logits_none_and_last(model):
    ids = _tokens(12, 13)
    ref, _ = _one_pass(model, ids)
    a, b = model.new_state(), model.new_state()
    out = model.forward([SeqInput(a, ids[:7], logits="none"), SeqInput(b, ids, logits="last")])
    assert out[0].shape == (0, model.t.vocab_size) and a.length == 7
    assert torch.equal(out[1], ref[-1:])
    assert torch.equal(model.forward([SeqInput(a, ids[7:], logits="last")])[0], ref[-1:])


def test_a_round_without_logits_skips_the_head(model, monkeypatch):
    """A round where no row wants logits (a prompt's earlier chunks) never calls the head: an empty call would still
    run one padded row tile, a full read of the head's weight (1.7 ms a round at release shapes on the H200)."""
    def no_head(x):
        raise AssertionError("head called")
    monkeypatch.setattr(model, "head_logits", no_head)
    out = model.forward([SeqInput(model.new_state(), _tokens(5, 3), logits="none")])
    assert out[0].shape == (0, model.t.vocab_size)
    with pytest.raises(AssertionError, match="head called"):
        model.forward([SeqInput(model.new_state(), _tokens(5, 3), logits="last")])


@pytest.mark.parametrize("kind", ["random", "few values", "masked ties", "signed zeros"])
def test_select_topk_equals_the_stable_sort(kind):
    """select_topk (k-th value by torch.topk, ties filled lowest index first, no full sort) picks exactly what the
    stable descending sort picks, on rows full of ties, -inf (not visible) and -0.0 == 0.0, for k below, at and
    above the row length."""
    from dsv41.model.indexer import select_topk, select_topk_by_sort
    g = torch.Generator().manual_seed(len(kind))
    for trial in range(60):
        n = 1 + trial % 5
        T = 1 + (trial * 37) % 250
        k = 1 + (trial * 11) % 40
        if kind == "random":
            s = torch.randn(n, T, generator=g)
        elif kind == "few values":
            s = torch.randint(0, 4, (n, T), generator=g).float()
        elif kind == "masked ties":
            s = torch.randint(0, 3, (n, T), generator=g).float()
            s[torch.rand(n, T, generator=g) < 0.5] = float("-inf")
        else:
            s = torch.full((n, T), float("-inf"))
            s[:, :T // 3] = torch.randint(0, 2, (n, T // 3), generator=g).float()
            s[torch.rand(n, T, generator=g) < 0.2] = -0.0
        got = select_topk(s, k)
        assert got.shape == (n, k)
        assert torch.equal(got, select_topk_by_sort(s, k)), (trial, n, T, k)


def test_index_rows_in_blocks_equal_one_block(model, monkeypatch):
    """A prompt pass scores its index rows in blocks when the keys are many (model.index_row_block): blocks of 16
    rows give the same logits and states as all rows at once."""
    from dsv41.model import model as model_mod
    ids = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(5))
    whole = model.new_state()
    ref = model.forward([SeqInput(whole, ids[:40])])[0]
    ref2 = model.forward([SeqInput(whole, ids[40:])])[0]
    monkeypatch.setattr(model_mod, "INDEX_BLOCK_BYTES", 1)
    assert model_mod.index_row_block(10 ** 6) == 16
    blocked = model.new_state()
    got = model.forward([SeqInput(blocked, ids[:40])])[0]
    got2 = model.forward([SeqInput(blocked, ids[40:])])[0]
    assert torch.equal(got, ref) and torch.equal(got2, ref2)
    for L in whole.compressed:
        assert torch.equal(whole.compressed[L], blocked.compressed[L])
