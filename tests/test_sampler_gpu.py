"""The batched sampler on CUDA logits against the same rows sampled on the host (issue 25). Skips without a GPU.

On the GPU the draw runs torch's CUDA exp/log (within an ulp of numpy's, which the host uses), so a pick could differ
from the host's only where two perturbed logits or a top-p prefix sum and p are within an ulp or so of each other:
on these seeded rows (many exact ties among them) the tokens must be equal. What must hold exactly on the device
itself: a row alone == the row in a batch of 32, and a run == the next run.
"""
import numpy as np
import pytest
import torch

from dsv41.sched.sampler import SamplingParams, sample_rows
from tests.test_sched_sampler import _random_mask, _random_params, _tied_row

pytestmark = pytest.mark.gpu

VOCAB = 129280


def _batch(seed: int, n: int = 32, vocab: int = VOCAB):
    rng = np.random.default_rng(seed)
    rows = torch.stack([_tied_row(rng, vocab) for _ in range(n)])
    params = [_random_params(rng, vocab, seed + i) for i in range(n)]
    positions = [int(rng.integers(0, 2**40)) for _ in range(n)]
    replies = [tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 60)))) for _ in range(n)]
    mask = torch.stack([_random_mask(rng, vocab) for _ in range(n)])
    return rows, params, positions, replies, mask


def _close(a: float, b: float) -> bool:
    """Float64 logprobs of the same row on the device and the host (summation orders differ); a masked token's
    -inf on both sides is equal (abs(-inf - -inf) would be nan)."""
    return a == b or abs(a - b) <= 1e-9 * max(1.0, abs(b))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_cuda_draw_equals_host_draw(seed, masked):
    rows, params, positions, replies, mask = _batch(seed)
    m = mask if masked else None
    host = sample_rows(rows, positions, params, replies, m)
    dev = sample_rows(rows.cuda(), positions, params, replies, m)
    assert [s.token_id for s in dev] == [s.token_id for s in host]
    for d, h, p in zip(dev, host, params):
        if p.logprobs:
            assert _close(d.logprob, h.logprob)
            if h.top is not None:
                assert [i for i, _ in d.top] == [i for i, _ in h.top]
                assert all(_close(a, b) for (_, a), (_, b) in zip(d.top, h.top))
        else:
            assert d.logprob is None and h.logprob is None


def test_cuda_row_alone_equals_row_in_a_batch_of_32():
    rows, params, positions, replies, mask = _batch(99)
    rows = rows.cuda()
    together = sample_rows(rows, positions, params, replies, mask)
    again = sample_rows(rows, positions, params, replies, mask)
    assert [(s.token_id, s.logprob, s.top) for s in together] == [(s.token_id, s.logprob, s.top) for s in again]
    for i in range(32):
        alone = sample_rows(rows[i:i + 1].clone(), [positions[i]], [params[i]], [replies[i]], mask[i:i + 1].clone())
        assert (alone[0].token_id, alone[0].logprob, alone[0].top) == (together[i].token_id, together[i].logprob,
                                                                        together[i].top), i


def test_cuda_greedy_and_server_defaults_on_bf16_logits():
    """Logits in bf16 on the device are read as float32, as the host read them."""
    g = torch.Generator().manual_seed(5)
    rows = (torch.randn(32, VOCAB, generator=g) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, top_k=20, top_p=0.95, seed=i) for i in range(32)]
    host = sample_rows(rows.float(), list(range(32)), params)
    dev = sample_rows(rows.cuda(), list(range(32)), params)
    assert [s.token_id for s in dev] == [s.token_id for s in host]
