"""DSpark draft head (arch.md §2.11) on the tiny checkpoint: no oracle vectors exist, so these pin the structure the
spec states: prefill fills the stage rings only, the block attends bidirectionally, the Markov step formula, and a
draft is a pure, batch-invariant function of the state."""
import pytest
import torch

from dsv41.model.linear import linear
from dsv41.model.model import Model, SeqInput


@pytest.fixture(scope="module")
def model(shared):
    return Model.load(shared / "vectors/model/tiny-a/checkpoint")


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (n,), generator=g)
    ids[0] = 0
    return ids


def _state(model, n, seed):
    st = model.new_state()
    model.forward([SeqInput(st, _ids(n, seed), logits="last")])
    return st


def test_prefill_writes_stage_rings_from_the_taps(model):
    ds, t = model.dspark, model.t
    ids = _ids(21, 1)
    st = model.new_state()
    tr = {}
    model.forward([SeqInput(st, ids)], trace=tr)
    assert tr["dspark_taps"].shape == (21, len(t.dspark_target_layer_ids) * t.hidden_size)
    x = ds.main_x(tr["dspark_taps"])
    pos = torch.arange(21)
    W = t.sliding_window
    for stage in ds.stages:
        ring = st.windows[stage.role.index]
        kv = ds._stage_kv(stage, x, pos)
        for p in range(21 - W, 21):
            assert torch.equal(ring[p % W], kv[p])


def test_draft_is_pure_deterministic_and_batch_invariant(model):
    states = [_state(model, n, s) for n, s in ((30, 2), (9, 3), (3, 4))]
    toks = [17, 250, 3]
    before = [s.snapshot() for s in states]
    alone = [model.dspark.draft([(s, k)])[0] for s, k in zip(states, toks)]
    together = model.dspark.draft(list(zip(states, toks)))
    again = model.dspark.draft(list(zip(states, toks)))
    S, V = model.t.dspark_block_size, model.t.vocab_size
    for a, b, c in zip(alone, together, again):
        assert a.tokens.shape == (S,) and a.logits.shape == (S, V) and a.confidence.shape == (S,)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
        assert torch.equal(a.confidence, b.confidence) and torch.equal(b.logits, c.logits)
    for s, b in zip(states, before):  # drafting reads the state, never writes it
        assert s.length == b.length
        for k in b.windows:
            assert torch.equal(s.windows[k], b.windows[k])


def test_markov_steps(model):
    ds = model.dspark
    st = _state(model, 12, 5)
    d = ds.draft([(st, 42)])[0]
    prev = 42
    for i in range(model.t.dspark_block_size):
        bias = linear(ds.markov_embed[[prev]], ds.markov_head)[0]
        assert torch.equal(d.logits[i], d.head_logits[i] + bias)
        assert int(d.tokens[i]) == int(torch.nonzero(d.logits[i] == d.logits[i].max())[0, 0])
        prev = int(d.tokens[i])


def test_block_attention_is_bidirectional(model):
    """Block position 0 (the real next token) sees the noise positions after it: a different noise id changes
    its head logits. In a causal block it could not."""
    ds = model.dspark
    st = _state(model, 10, 6)
    a = ds.draft([(st, 42)])[0]
    noise = ds.noise
    try:
        ds.noise = 7
        b = ds.draft([(st, 42)])[0]
    finally:
        ds.noise = noise
    assert not torch.equal(a.head_logits[0], b.head_logits[0])


def test_draft_input_errors(model):
    with pytest.raises(ValueError):
        model.dspark.draft([(model.new_state(), 1)])
    with pytest.raises(ValueError):
        model.dspark.draft([(_state(model, 4, 7), model.t.vocab_size)])
