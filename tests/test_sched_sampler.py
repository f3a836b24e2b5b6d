"""The sampler is a pure function of (seed, position, logits row, params): no global RNG, no batch dependence."""
import math

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from dsv41.sched.sampler import (CANDIDATE_WIDTH, SamplingParams, adjust_row, clamp_top_k, gumbel, prompt_seed,
                                 sample_row, uniform_keys)


def _row(seed: int, vocab: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 3


def test_greedy_is_argmax_with_ties_to_lower_id():
    row = torch.zeros(50)
    row[7] = 5.0
    row[3] = 5.0
    row[40] = 5.0
    assert sample_row(row, 0, SamplingParams(temperature=0.0)).token_id == 3
    assert sample_row(row, 0, SamplingParams(temperature=-1.0)).token_id == 3


def test_pure_function_of_seed_position_row():
    row = _row(0)
    p = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=1234)
    a = [sample_row(row, pos, p).token_id for pos in range(40)]
    b = [sample_row(row.clone(), pos, p).token_id for pos in range(40)]
    assert a == b
    # the global RNG does not matter
    torch.manual_seed(99)
    np.random.seed(5)
    assert [sample_row(row, pos, p).token_id for pos in range(40)] == a
    # position and seed do matter (a flat-ish row gives many different tokens)
    assert len(set(a)) > 5
    other = [sample_row(row, pos, SamplingParams(temperature=1.0, top_p=1.0, seed=1235)).token_id for pos in range(40)]
    assert other != a


def test_row_in_a_batch_equals_row_alone():
    batch = torch.stack([_row(i) for i in range(8)])
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=7)
    alone = [sample_row(_row(i), 10 + i, p).token_id for i in range(8)]
    together = [sample_row(batch[i], 10 + i, p).token_id for i in range(8)]
    assert alone == together


def test_frequencies_follow_the_softmax():
    # 3 tokens with probabilities 0.5 / 0.3 / 0.2 at T=1: keyed draws over many positions match them
    probs = np.array([0.5, 0.3, 0.2])
    row = torch.tensor(np.log(probs), dtype=torch.float32)
    p = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=42)
    n = 6000
    counts = np.bincount([sample_row(row, pos, p).token_id for pos in range(n)], minlength=3) / n
    assert np.allclose(counts, probs, atol=0.025), counts


def test_top_k_top_p_min_p_truncate():
    row = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    draws = lambda p: {sample_row(row, pos, p).token_id for pos in range(400)}  # noqa: E731
    assert draws(SamplingParams(temperature=5.0, top_p=1.0, top_k=2, seed=1)) == {0, 1}
    # softmax at T=1: 0.636, 0.234, 0.086, ...; top_p 0.8 keeps ids 0 and 1
    assert draws(SamplingParams(temperature=1.0, top_p=0.8, seed=1)) == {0, 1}
    # min_p 0.3 at T=1 keeps logits within ln(0.3) = -1.2 of the top: only id 0... and id 1 is 1.0 below -> kept
    assert draws(SamplingParams(temperature=1.0, top_p=1.0, min_p=0.3, seed=1)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=1.0, min_p=0.5, seed=1)) == {0}


def test_top_k_clamped_to_candidate_width():
    assert clamp_top_k(0) == CANDIDATE_WIDTH
    assert clamp_top_k(-3) == CANDIDATE_WIDTH
    assert clamp_top_k(10**9) == CANDIDATE_WIDTH
    assert clamp_top_k(20) == 20
    # a token ranked past the candidate width is never drawn, even at a huge temperature
    row = torch.linspace(1.0, 0.0, CANDIDATE_WIDTH + 500)
    got = {sample_row(row, pos, SamplingParams(temperature=1e6, top_p=1.0, top_k=0, seed=3)).token_id
           for pos in range(3000)}
    assert max(got) < CANDIDATE_WIDTH


def test_uniform_keys_in_open_interval_and_distinct():
    u = uniform_keys(1, 2, np.arange(5000))
    assert np.all(u > 0) and np.all(u < 1)
    assert len(np.unique(u)) == 5000
    assert np.isfinite(gumbel(1, 2, np.arange(5000))).all()
    assert abs(u.mean() - 0.5) < 0.02


def test_prompt_seed_is_stable_and_63_bit():
    s = prompt_seed([0, 5, 9], "0")
    assert s == prompt_seed([0, 5, 9], "0")
    assert s != prompt_seed([0, 5, 10], "0") and s != prompt_seed([0, 5, 9], "1")
    assert 0 <= s < 2**63


def test_logprobs_are_raw_log_softmax():
    row = _row(3, 40)
    s = sample_row(row, 0, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5))
    ref = torch.log_softmax(row.double(), -1)
    assert s.token_id == int(torch.argmax(row))
    assert math.isclose(s.logprob, float(ref[s.token_id]), rel_tol=1e-12)
    assert [i for i, _ in s.top] == torch.argsort(-ref, stable=True)[:5].tolist()
    assert s.top[0][0] == s.token_id


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), pos=st.integers(0, 2**20), t=st.floats(0.05, 3.0),
       top_p=st.floats(0.05, 1.0), top_k=st.integers(0, 64), min_p=st.floats(0.0, 0.9))
def test_draw_is_a_kept_candidate(seed, pos, t, top_p, top_k, min_p):
    row = _row(seed % 1000, 128)
    p = SamplingParams(temperature=t, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    tok = sample_row(row, pos, p).token_id
    assert tok == sample_row(row, pos, p).token_id
    k = clamp_top_k(top_k)
    rank = int((row > row[tok]).sum())
    assert rank < k
    assert row[tok] / t >= row.max() / t + math.log(min_p) - 1e-9 if min_p > 0 else True


def test_adjust_row_is_vllms_order_and_arithmetic():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    p = SamplingParams(temperature=0, logit_bias=((1, 5.0),), repetition_penalty=2.0, prompt_tokens=(0,),
                       frequency_penalty=0.5, presence_penalty=0.25, prompt_len=4)
    out = adjust_row(row, p, [3, 3, 4])
    # 0: in the prompt, > 0: halved. 1: bias first (-1 + 5 = 4 > 0), not seen. 2: untouched.
    # 3: seen twice: 3 / 2 - 0.5 * 2 - 0.25. 4: seen once, < 0: doubled, - 0.5 - 0.25
    assert out.tolist() == [1.0, 4.0, 0.5, 1.5 - 1.0 - 0.25, -4.0 - 0.5 - 0.25]
    assert row.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]                    # the input is left alone
    assert sample_row(row, 4, p, [3, 3, 4]).token_id == 1                 # greedy reads the adjusted row
    s = sample_row(row, 4, SamplingParams(temperature=0, logprobs=True, logit_bias=((1, 5.0),)))
    assert s.token_id == 1                                                # the bias decides the draw,
    assert math.isclose(s.logprob, float(torch.log_softmax(row.double(), 0)[1]))   # logprobs stay the raw row's


# --- the batched sampler (sample_rows) against the host sampler it replaced (tests/sampler_reference.py) ---------

from dsv41.sched.sampler import (_cumsum, _gumbel_t, _ordered_top, _pairwise_sum,  # noqa: E402
                                 _row_keys, sample_rows)
from tests.sampler_reference import reference_adjust_row, reference_sample_row  # noqa: E402


def _tied_row(rng: np.random.Generator, vocab: int) -> torch.Tensor:
    """Logits with many exact ties (a few levels), some -0.0 and +0.0, a spread top."""
    kind = rng.integers(0, 3)
    if kind == 0:
        x = rng.integers(-6, 6, vocab).astype(np.float32) / 2       # ~24 levels: ties everywhere
    elif kind == 1:
        x = (rng.standard_normal(vocab) * 3).astype(np.float32)
    else:
        x = np.round(rng.standard_normal(vocab) * 4).astype(np.float32) / 4
    x[rng.integers(0, vocab, 5)] = -0.0
    x[rng.integers(0, vocab, 5)] = 0.0
    return torch.from_numpy(x)


def _random_params(rng: np.random.Generator, vocab: int, draw) -> SamplingParams:
    greedy = rng.random() < 0.2
    bias = tuple((int(i), float(rng.choice([-100.0, -1.5, 0.5, 3.0]))) for i in
                 rng.choice(vocab, int(rng.integers(0, 4)), replace=False)) if rng.random() < 0.3 else ()
    return SamplingParams(
        temperature=0.0 if greedy else float(rng.choice([0.05, 0.7, 1.0, 1.3, 4.0])),
        top_p=float(rng.choice([1.0, 1.0, 0.9, 0.5, 0.1, 0.999])),
        top_k=int(rng.choice([0, 0, 1, 2, 7, 8, 9, 20, 50, 127, 128, 129, 300, 2000])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
        seed=int(rng.integers(0, 2**63)) if rng.random() < 0.9 else draw,
        logprobs=bool(rng.random() < 0.4), top_logprobs=int(rng.choice([0, 1, 5, 20, 25])),
        frequency_penalty=float(rng.choice([0.0, 0.0, 0.5, -0.3])),
        presence_penalty=float(rng.choice([0.0, 0.0, 0.25, 1.0])),
        repetition_penalty=float(rng.choice([1.0, 1.0, 1.3, 0.8])),
        logit_bias=bias, prompt_len=10, prompt_tokens=tuple(int(t) for t in rng.integers(0, vocab, 6)))


def _random_mask(rng: np.random.Generator, vocab: int) -> torch.Tensor:
    """One bitmask row (llguidance's packing): all allowed, a few allowed, or most allowed."""
    from dsv41.grammar.matchers import allocate_bitmask
    m = allocate_bitmask(1, vocab)
    kind = rng.integers(0, 3)
    if kind == 1:
        m.zero_()
        for t in rng.integers(0, vocab, int(rng.integers(1, 12))):
            m[0, t // 32] |= int(np.int32(np.uint32(1 << (t % 32)).view(np.int32)))
    elif kind == 2:
        m[0] = torch.from_numpy(rng.integers(-2**31, 2**31, m.shape[1], dtype=np.int64).astype(np.int32))
    return m[0]


def _reference(row, pos, p, reply, mask):
    if mask is not None:
        from dsv41.grammar.matchers import apply_mask
        row = row.clone()
        apply_mask(row, mask[None])
    return reference_sample_row(row, pos, p, reply)


def _same(a, b) -> bool:
    """Every field equal; floats by repr (a fully masked row's logprobs are NaN in both)."""
    return repr((a.token_id, a.logprob, a.top)) == repr((b.token_id, b.logprob, b.top))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([3, 40, 300, 1100, 3000]), n=st.integers(1, 9),
       masked=st.booleans())
def test_batched_draw_equals_the_host_sampler_bit_for_bit(seed, vocab, n, masked):
    """Every field of every Sample (token, logprob, top logprobs) equals the numpy row-by-row sampler's, over rows
    with exact ties, signed zeros, masks, and every parameter mix (greedy, top-k below/at/above the width and the
    vocabulary, top-p, min-p, bias, penalties)."""
    rng = np.random.default_rng(seed)
    rows = torch.stack([_tied_row(rng, vocab) for _ in range(n)])
    params = [_random_params(rng, vocab, seed) for _ in range(n)]
    positions = [int(rng.integers(0, 2**40)) for _ in range(n)]
    replies = [tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 30)))) for _ in range(n)]
    mask = torch.stack([_random_mask(rng, vocab) for _ in range(n)]) if masked else None
    got = sample_rows(rows, positions, params, replies, mask)
    for i in range(n):
        want = _reference(rows[i], positions[i], params[i], replies[i], None if mask is None else mask[i])
        assert _same(got[i], want), (i, params[i], got[i], want)


def test_batched_draw_on_the_full_vocabulary():
    """32 rows of 129,280 logits, sampled and greedy, masked and not: the batched draw == the host sampler."""
    rng = np.random.default_rng(7)
    vocab = 129280
    rows = torch.from_numpy((rng.standard_normal((32, vocab)) * 2.5).astype(np.float32))
    rows[3, 1000:1100] = rows[3].max()                      # a wide tie at the top
    params = [SamplingParams(temperature=[0.0, 0.6, 1.0][i % 3], top_p=[1.0, 0.95, 0.8][i % 3 - 1],
                             top_k=[0, 20, 1024, 50][i % 4], min_p=0.02 * (i % 2), seed=1000 + i,
                             logprobs=i % 5 == 0, top_logprobs=5 if i % 10 == 0 else 0) for i in range(32)]
    mask = torch.stack([_random_mask(rng, vocab) for _ in range(32)])
    positions = list(range(500, 532))
    for m in (None, mask):
        got = sample_rows(rows, positions, params, None, m)
        for i in range(32):
            assert _same(got[i], _reference(rows[i], positions[i], params[i], (), None if m is None else m[i]))


def test_row_alone_equals_row_in_a_batch_of_32():
    rng = np.random.default_rng(11)
    vocab = 5000
    rows = torch.stack([_tied_row(rng, vocab) for _ in range(32)])
    params = [_random_params(rng, vocab, i) for i in range(32)]
    replies = [tuple(int(t) for t in rng.integers(0, vocab, 20)) for _ in range(32)]
    mask = torch.stack([_random_mask(rng, vocab) for _ in range(32)])
    together = sample_rows(rows, list(range(32)), params, replies, mask)
    for i in range(32):
        alone = sample_rows(rows[i:i + 1].clone(), [i], [params[i]], [replies[i]], mask[i:i + 1].clone())[0]
        assert _same(alone, together[i])
    # and in another batch order, beside other rows
    perm = rng.permutation(32).tolist()
    shuffled = sample_rows(rows[perm], perm, [params[i] for i in perm], [replies[i] for i in perm], mask[perm])
    assert all(_same(shuffled[j], together[i]) for j, i in enumerate(perm))


def test_pieces_equal_numpy():
    rng = np.random.default_rng(3)
    for n in list(range(1, 140)) + [255, 256, 257, 1000, 1023, 1024]:
        a = np.exp(-np.abs(rng.standard_normal((3, n))) * 3)
        got = _pairwise_sum(torch.from_numpy(a)).numpy()
        assert [float(x) for x in got] == [float(r.sum()) for r in a], n
    for n in (1, 2, 20, 1024):                  # the device's column-by-column prefix sums == numpy's cumsum
        a = np.exp(-np.abs(rng.standard_normal((3, n))) * 3)
        a[0] = 0.05                             # tied candidates: a tree would give 0.5 at the tenth sum
        assert np.array_equal(_cumsum(torch.from_numpy(a), by_columns=True).numpy(), np.cumsum(a, axis=1))
    ids = torch.from_numpy(rng.integers(0, 129280, (4, 1024)))
    params = [SamplingParams(seed=s) for s in (0, 1, 2**63 - 1, 12345)]
    positions = [0, 7, 2**40, 3]
    g = _gumbel_t(torch.from_numpy(_row_keys(params, positions)), ids).numpy()
    for i in range(4):
        assert np.array_equal(g[i], gumbel(params[i].seed, positions[i], ids[i].numpy()))
    for _ in range(20):
        x = torch.stack([_tied_row(rng, 2000) for _ in range(3)])
        x[0, :50] = float("-inf")
        for all_keys in (False, True):          # the host's way and the GPU's
            cand, vals = _ordered_top(x, 300, all_keys)
            for i in range(3):
                order = torch.sort(-x[i], stable=True).indices[:300]
                assert torch.equal(cand[i], order) and torch.equal(vals[i], x[i][order])


def test_adjust_equals_the_host_adjust():
    rng = np.random.default_rng(5)
    for _ in range(200):
        vocab = int(rng.integers(5, 400))
        row = _tied_row(rng, vocab)
        p = _random_params(rng, vocab, 0)
        reply = [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 40)))]
        want = reference_adjust_row(row, p, reply) if p.adjusts else row
        assert torch.equal(adjust_row(row, p, reply), want)
