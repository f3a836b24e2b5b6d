"""kernels/pdl.py: the decode kernels launched with programmatic dependent launch compute what they compute without
it (every kernel waits before it touches memory, so stream order holds); off the GPU nothing launches so."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import pdl  # noqa: E402


def test_no_pdl_off_an_sm90_gpu():
    assert pdl.options(torch.zeros(1)) == {"PDL": False}        # CPU tensors (and the interpreter): a plain launch
    assert not pdl.on(torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_rounds_with_pdl_equal_them_without():
    from dsv41.api.engine import builtin_checkpoint
    from dsv41.model.model import Model, SeqInput
    got = {}
    try:
        for on in (True, False):
            pdl.ENABLED = on
            model = Model.load(builtin_checkpoint(), device="cuda", kernels=True)     # its own graph captures
            states = [model.new_state() for _ in range(5)]
            g = torch.Generator().manual_seed(3)
            model.forward([SeqInput(st, torch.randint(3, 400, (40 + 7 * i,), generator=g), logits="none")
                           for i, st in enumerate(states)])
            rounds = []
            for _ in range(6):
                toks = torch.randint(3, 400, (5,), generator=g)
                out = model.forward([SeqInput(st, toks[i:i + 1], logits="last") for i, st in enumerate(states)])
                rounds.append(torch.cat(out).cpu())
            got[on] = rounds
    finally:
        pdl.ENABLED = True
    assert torch.cuda.get_device_capability()[0] < 9 or pdl.on(torch.zeros(1, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))
