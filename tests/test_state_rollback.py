"""SeqState.mark / rollback: after a forward of k rows, taking back the last n leaves the state equal (torch.equal on
every tensor) to one fed only the kept rows, and the next forward's logits equal serial decoding. Tested at ratio-2
group boundaries (odd and even starts), across the window wrap (window 8) and past the indexer's top-k (6)."""
import pytest
import torch

from dsv41.model.model import Model, SeqInput


@pytest.fixture(scope="module")
def model(shared):
    return Model.load(shared / "vectors/model/tiny-a/checkpoint")


def _ratios(model):
    return {r.index: r.ratio for r in model.layout.layers if r.owns_compressor}


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (n,), generator=g)
    ids[0] = 0
    return ids


def assert_states_equal(a, b):
    assert a.length == b.length
    assert a.published_keys == b.published_keys
    assert torch.equal(a.engram_history, b.engram_history)
    for name in ("windows", "compressed", "index_keys", "partial_kv", "partial_gate"):
        da, db = getattr(a, name), getattr(b, name)
        assert da.keys() == db.keys(), name
        for k in da:
            assert da[k].shape == db[k].shape and torch.equal(da[k], db[k]), (name, k)


@pytest.mark.parametrize("prompt", [9, 14, 15])
def test_rollback_equals_serial(model, prompt):
    """Prompt lengths: 9 (odd start: the forward closes the open ratio-2 group first), 14 (past the wrap, even),
    15 (>= top-k compressed entries at ratio 2 only from here on)."""
    ids = _ids(prompt + 6, prompt)
    base = model.new_state()
    model.forward([SeqInput(base, ids[:prompt], logits="none")])
    ratios, W = _ratios(model), model.t.sliding_window
    for keep in range(7):
        st = base.snapshot()
        st.mark(6, W)
        model.forward([SeqInput(st, ids[prompt:prompt + 6], logits="all")])
        st.rollback(6 - keep, ratios)
        ref = base.snapshot()
        for j in range(keep):                           # serial: one token per forward
            model.forward([SeqInput(ref, ids[prompt + j:prompt + j + 1], logits="last")])
        assert_states_equal(st, ref)
        # and the next step computes the same logits from both
        nxt = torch.tensor([7])
        assert torch.equal(model.forward([SeqInput(st, nxt, logits="last")])[0],
                           model.forward([SeqInput(ref, nxt, logits="last")])[0])


def test_two_rollbacks_after_one_mark(model):
    """A forced token in the scheduler takes back more rows in the next round, before any forward."""
    ids = _ids(20, 3)
    base = model.new_state()
    model.forward([SeqInput(base, ids[:11], logits="none")])
    st = base.snapshot()
    st.mark(5, model.t.sliding_window)
    model.forward([SeqInput(st, ids[11:16], logits="all")])
    st.rollback(1, _ratios(model))
    st.rollback(2, _ratios(model))
    ref = base.snapshot()
    model.forward([SeqInput(ref, ids[11:13], logits="all")])
    assert_states_equal(st, ref)


def test_rollback_errors(model):
    st = model.new_state()
    model.forward([SeqInput(st, _ids(4, 1), logits="none")])
    with pytest.raises(ValueError, match="without a mark"):
        st.rollback(1, _ratios(model))
    st.mark(2, model.t.sliding_window)
    model.forward([SeqInput(st, torch.tensor([5, 6]), logits="none")])
    with pytest.raises(ValueError, match="cannot take back 3"):
        st.rollback(3, _ratios(model))
    snap = st.snapshot()
    assert snap.undo is None                     # a snapshot carries no mark
