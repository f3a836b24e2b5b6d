"""dsv41/model/indexer.candidate_blocks against a row-by-row brute force: each block's max (the partial last block's
over its own entries), the newest visible block forced in, the n_blocks best blocks (ties to the lower block), a block
kept only when its value is finite; at key counts on and off a block boundary, with -inf rows and entries."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41.model.indexer import NEG_INF, candidate_blocks


def _brute(scores, positions, ratio, n_blocks, bs):
    n, T = scores.shape
    nb = -(-T // bs)
    out = torch.zeros(n, T, dtype=torch.bool)
    for r in range(n):
        newest = ((int(positions[r]) + 1) // ratio - 1) // bs
        vals = []
        for b in range(nb):
            v = max(float(x) for x in scores[r, b * bs:(b + 1) * bs])
            vals.append(math.inf if b == newest else v)
        order = sorted(range(nb), key=lambda b: (-vals[b], b))[:min(n_blocks, nb)]
        for b in order:
            if vals[b] > NEG_INF:
                out[r, b * bs:(b + 1) * bs] = True
    return out


@pytest.mark.parametrize("T", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("n_blocks", [1, 3, 16])
def test_candidate_blocks_match_the_brute_force(T, bs, n_blocks):
    """n_blocks below, at and above the block count (every block kept: no selection runs)."""
    g = torch.Generator().manual_seed(T * 31 + bs)
    scores = torch.randn(6, T, generator=g)
    scores[1] = NEG_INF                          # a row with no visible key
    scores[2, ::2] = NEG_INF
    scores[3] = scores[3].round()                # ties between blocks
    scores[4, : T // 2] = NEG_INF                # fewer finite blocks than n_blocks
    positions = torch.randint(0, 4 * T + 4, (6,), generator=g)
    got = candidate_blocks(scores, positions, 4, n_blocks, bs)
    assert got.shape == (6, T)
    assert torch.equal(got, _brute(scores, positions, 4, n_blocks, bs))
