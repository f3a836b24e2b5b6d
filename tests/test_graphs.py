"""CUDA graphs of a round's row-only pieces (dsv41/model/graphs.py): the same bits as the eager round.

On the CPU the graphs are emulated (the same static buffers, row padding and reuse of another piece's outputs, the
piece run eagerly on them), which checks everything but the capture itself; the CUDA tests capture for real."""
import pytest
import torch

from dsv41.model.graphs import ROW_BUCKETS, PieceGraphs, row_bucket
from dsv41.model.model import Comm, Model, SeqInput
from test_model_round import _tokens, model  # noqa: F401 - the tiny-a model fixture and its token helper


def _decode(model, graphs, lens, steps, rows=1):
    """Prompts of `lens` (different lengths, or more rows than the window: no round, so eager), then `steps`
    rounds of `rows` tokens per sequence; all logits."""
    model.graphs = graphs
    try:
        seqs = [_tokens(max(lens) + steps * rows, 20 + i) for i in range(len(lens))]
        states = [model.new_state() for _ in lens]
        out = model.forward([SeqInput(st, s[:n]) for st, s, n in zip(states, seqs, lens)])
        for k in range(steps):
            out += model.forward([SeqInput(st, s[n + k * rows:n + (k + 1) * rows])
                                  for st, s, n in zip(states, seqs, lens)])
        return out
    finally:
        model.graphs = None


def test_row_bucket():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 17, 24, 25, 64, 65, 160, 192)] == [1, 2, 4, 8, 24, 24, 32, 64, 96,
                                                                                      160, 192]
    assert row_bucket(193) is None and row_bucket(2048) is None
    assert list(ROW_BUCKETS) == sorted(ROW_BUCKETS)


@pytest.mark.parametrize("lens,rows", [([9], 1), ([3, 9, 14], 1), ([2, 7, 11, 16, 23], 1), ([4, 12, 20], 3)])
def test_emulated_graphs_give_the_eager_bits(model, lens, rows):
    """1, 3 and 5 sequences (buckets 1, 4 and 8: padded rows), and 3-row verify rounds (9 rows -> 16), over 4
    rounds each: every logit row is bitwise the eager round's, and the rounds replayed pieces only."""
    eager = _decode(model, None, lens, 4, rows)
    G = PieceGraphs("emulate")
    got = _decode(model, G, lens, 4, rows)
    assert len(got) == len(eager)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    # attn_in and attn_out_ffn per layer, and the DSpark stages' ring KV (dspark_fill) where the model has them
    per_round = 2 * len(model.blocks) + (model.dspark is not None)
    assert G.stats["replays"] == 4 * per_round and G.stats["eager"] == 0
    assert G.stats["captures"] == per_round             # one bucket: captured in the first round only
    assert not G.failed
    # the history's gathered keys (attn_out_ffn's 2nd argument) go through one input buffer for all layers with
    # the same key count (window-only layers have fewer)
    keys = {(e.inputs[1].data_ptr(), tuple(e.inputs[1].shape)) for (k, _), e in G.entries.items()
            if k[0] == "attn_out_ffn"}
    assert len({p for p, _ in keys}) == len({s for _, s in keys}) < len(model.blocks)


def test_emulated_graphs_split_pieces_for_tensor_parallel(model):
    """With world > 1 the layer runs as attn_out, ffn, ffn_out with the (here identity) reductions between them:
    the same bits as the merged piece, with and without graphs."""
    lens = [3, 8]
    eager = _decode(model, None, lens, 3)
    before = model.comm
    model.comm = Comm(world=2)       # identity exchanges: a full-share model through the TP code path
    try:
        split = _decode(model, None, lens, 3)
        G = PieceGraphs("emulate")
        split_g = _decode(model, G, lens, 3)
    finally:
        model.comm = before
    for a, b, c in zip(eager, split, split_g):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert G.stats["captures"] == 4 * len(model.blocks) + (model.dspark is not None)   # + dspark_fill


def test_a_piece_reads_another_pieces_outputs_in_place():
    """A piece given another piece's result reads that static buffer (no copy); results are views of static
    buffers that the next call overwrites (the contract callers keep)."""
    G = PieceGraphs("emulate")
    x = torch.arange(6.0).view(3, 2)
    a, = G.run("double", lambda t: (t * 2,), (x,))
    b, = G.run("plus1", lambda t: (t + 1,), (a,))
    assert torch.equal(b, x * 2 + 1)
    assert G.entries[("plus1", 4)].inputs[0] is G.entries[("double", 4)].outputs[0]
    assert torch.equal(G.entries[("double", 4)].inputs[0][3], x[0])     # the padded row repeats row 0
    a2, = G.run("double", lambda t: (t * 2,), (x + 10,))
    assert a2.data_ptr() == a.data_ptr() and torch.equal(a, (x + 10) * 2)


def test_a_changed_argument_is_refused():
    G = PieceGraphs("emulate")
    G.run("p", lambda t: (t,), (torch.zeros(2, 3),))
    with pytest.raises(ValueError, match="changed"):
        G.run("p", lambda t: (t,), (torch.zeros(2, 4),))
    with pytest.raises(ValueError, match="changed"):
        G.run("p", lambda t: (t,), (torch.zeros(2, 3, dtype=torch.float64),))


def test_rounds_past_the_largest_bucket_run_eagerly():
    G = PieceGraphs("emulate")
    x = torch.ones(ROW_BUCKETS[-1] + 1, 2)
    y, = G.run("p", lambda t: (t * 3,), (x,))
    assert torch.equal(y, x * 3) and G.stats["eager"] == 1 and not G.entries


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        PieceGraphs("sometimes")


def test_scheduler_with_emulated_graphs_equals_eager(model, shared):
    """The scheduler's rounds (bursts whose streams start and finish at different times, drafted verify rounds
    that roll back, greedy and seeded sampling) through emulated graphs give the eager serial replies: nothing
    downstream keeps a piece's result past the next round."""
    from test_drafts import _ids, _mixed, _prompts, run
    model.ckpt = shared / "vectors/model/tiny-a/checkpoint"
    prompts = _prompts(8, model.t.vocab_size, seed=3)
    serial, _ = run(model, _mixed(prompts, 16), drafts=False)
    G = model.graphs = PieceGraphs("emulate")
    try:
        plain, _ = run(model, _mixed(prompts, 16), drafts=False)
        drafted, _ = run(model, _mixed(prompts, 16), drafts=True, draft_tokens=3)
    finally:
        model.graphs = None
    assert _ids(plain) == _ids(serial) and _ids(drafted) == _ids(serial)
    assert G.stats["replays"] > 0 and len({b for (_, b) in G.entries}) >= 3, G.stats


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_bits(shared):
    """On the GPU: rounds of 1, 3 and 5 sequences replayed from real CUDA graphs == the eager rounds bitwise."""
    m = Model.load(shared / "vectors/model/tiny-a/checkpoint", device="cuda")
    assert isinstance(m.graphs, PieceGraphs)
    for lens in ([9], [3, 9, 14], [2, 7, 11, 16, 23]):
        eager = _decode(m, None, lens, 4)
        G = PieceGraphs("cuda")
        got = _decode(m, G, lens, 4)
        assert not G.failed, G.failed
        per_round = 2 * len(m.blocks) + (m.dspark is not None)      # + the DSpark ring fill piece
        assert G.stats["replays"] == 4 * per_round and G.stats["eager"] == 0
        for a, b in zip(got, eager):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_scheduler_with_graphs_equals_eager(shared):
    """On the GPU: the scheduler's bursts and drafted verify rounds replayed from real CUDA graphs give the eager
    serial replies (greedy and seeded)."""
    from test_drafts import _ids, _mixed, _prompts, run
    m = Model.load(shared / "vectors/model/tiny-a/checkpoint", device="cuda")
    m.ckpt = shared / "vectors/model/tiny-a/checkpoint"
    G, m.graphs = m.graphs, None
    prompts = _prompts(8, m.t.vocab_size, seed=3)
    serial, _ = run(m, _mixed(prompts, 16), drafts=False)
    m.graphs = G
    plain, _ = run(m, _mixed(prompts, 16), drafts=False)
    drafted, _ = run(m, _mixed(prompts, 16), drafts=True, draft_tokens=3)
    m.comm = Comm(world=2)      # the tensor-parallel pieces (identity exchanges), graphed
    split, _ = run(m, _mixed(prompts, 16), drafts=True, draft_tokens=3)
    assert not G.failed, G.failed
    assert _ids(plain) == _ids(serial) and _ids(drafted) == _ids(serial) and _ids(split) == _ids(serial)
    assert G.stats["replays"] > 0


@pytest.mark.gpu
def test_a_piece_result_survives_the_replay_of_a_piece_captured_before_it():
    """Pieces are captured lazily, in any order, into one memory pool, and a round replays several of them. A piece
    captured after another may be handed the memory of the other's temporaries (freed when its capture ended), which
    the other's replay rewrites: its results must not live there (graphs.py keeps them outside the pool)."""
    G = PieceGraphs("cuda")
    a = torch.randn(8, 1 << 16, device="cuda")

    def first(x):     # 2 MB temporaries, a small result
        t = x * 2 + 1
        return (t.exp().sum(-1, keepdim=True),)

    def second(x):    # a result the size of first's temporaries
        return (x * 3,)
    G.run("first", first, (a,))
    got, = G.run("second", second, (a,))
    G.run("first", first, (a + 1,))
    torch.cuda.synchronize()
    assert G.stats["captures"] == 2 and not G.failed
    assert torch.equal(got, a * 3)
