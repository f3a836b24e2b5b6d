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
