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
        kv = ds._stage_kv(stage, x, *model.rope.cos_sin("main", pos))
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


def test_block_keys_are_each_sequences_last_window_then_the_block(model):
    """The stage keys of a draft (one gather over every sequence's ring and the block rows): for each block row, the
    sequence's last min(L, W) context positions in ascending order, then the S block rows, valid exactly there;
    contexts shorter than, equal to and longer than the window in one batch."""
    W, S = model.t.sliding_window, model.t.dspark_block_size
    states = [_state(model, n, 40 + n) for n in (3, W, W + 5, 2 * W + 1)]
    items = [(st, 7) for st in states]
    idx, ok = model.dspark._ring_index(items, torch.device("cpu"))
    L = model.dspark.stages[0].role.index
    rings = [st.windows[L] for st in states]
    kv = torch.randn(len(states) * S, rings[0].shape[1])
    keys = torch.cat(rings + [kv])[idx]
    for b, st in enumerate(states):
        lead = min(st.length, W)
        for i in range(S):
            row = b * S + i
            assert ok[row].tolist() == [False] * (W - lead) + [True] * (lead + S)
            for j in range(W - lead, W):
                assert torch.equal(keys[row, j], rings[b][(st.length - W + j) % W])
            assert torch.equal(keys[row, W:], kv[b * S:(b + 1) * S])


def test_draft_through_emulated_graphs_gives_the_eager_bits(model):
    """The stages' pieces through the model's graphs (emulated on the CPU: static buffers, rows padded to a bucket)
    give the eager draft's bits, for 1 and 3 sequences (3 x 5 rows pad to 16), one world and the TP split pieces."""
    from dsv41.model.graphs import PieceGraphs
    from dsv41.model.model import Comm
    states = [_state(model, n, s) for n, s in ((30, 5), (9, 6), (4, 7))]
    toks = [11, 42, 9]
    for batch in ([0], [0, 1, 2]):
        items = [(states[i], toks[i]) for i in batch]
        eager = model.dspark.draft(items)
        for comm in (None, Comm(world=2)):
            before = model.comm
            model.graphs = G = PieceGraphs("emulate")
            if comm is not None:
                model.comm = comm
            try:
                got = model.dspark.draft(items)
                again = model.dspark.draft(items)
            finally:
                model.graphs, model.comm = None, before
            assert G.stats["replays"] > 0 and G.stats["eager"] == 0 and not G.failed
            for a, b, c in zip(eager, got, again):
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
                assert torch.equal(a.confidence, b.confidence) and torch.equal(b.logits, c.logits)


def test_decode_rounds_through_emulated_graphs_fill_the_stage_rings_alike(model):
    """A decode round through the graphs writes the stages' rings from its piece (dspark_fill) and one copy list:
    the same ring bits as the eager rounds, sequences longer and shorter than the window, wrapping slots."""
    from dsv41.model.graphs import PieceGraphs
    W = model.t.sliding_window
    rings = []
    for G in (None, PieceGraphs("emulate")):
        states = [_state(model, n, 60 + n) for n in (5, W - 1, 2 * W + 3)]
        model.graphs = G
        try:
            for k in range(3):
                model.forward([SeqInput(st, _ids(2, 70 + k + i)) for i, st in enumerate(states)])
        finally:
            model.graphs = None
        if G is not None:
            assert G.stats["eager"] == 0 and ("dspark_fill", 0) in {k for k, _ in G.entries}
        rings.append([{L: st.windows[L].clone() for L in (s.role.index for s in model.dspark.stages)}
                      for st in states])
    for a, b in zip(*rings):
        assert all(torch.equal(a[L], b[L]) for L in a)
