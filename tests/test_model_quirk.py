"""Indexer-key publication: "intended" (default) vs the release's "quirk" (arch.md §2.8), and the logits tool."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from dsv41.model.model import Model, SeqInput
from dsv41.tools.logits import run


@pytest.fixture(scope="module")
def ckpt(shared):
    return shared / "vectors/model/tiny-a/checkpoint"


@pytest.fixture(scope="module")
def models(ckpt):
    return Model.load(ckpt), Model.load(ckpt, index_keys="quirk")


def _ids(n):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 500, (n,), generator=g)
    ids[0] = 0
    return ids


def _step(model, st, tok):
    tr = {}
    out = model.forward([SeqInput(st, torch.tensor([tok]))], trace=tr)[0]
    return out, tr


def test_quirk_differs_only_on_decode_steps_that_close_no_ratio2_group(models):
    intended, quirk = models
    ids = _ids(24)
    # Prefill: every multi-token call closes a group, so the two modes agree bitwise.
    s_int, s_q = intended.new_state(), quirk.new_state()
    assert torch.equal(intended.forward([SeqInput(s_int, ids[:20])])[0], quirk.forward([SeqInput(s_q, ids[:20])])[0])

    # Position 20 closes no ratio-2 group: the quirk scores layers 2 and 4 against layer 6's keys of the last step.
    snap = s_int.snapshot()
    a, tr_a = _step(intended, s_int, int(ids[20]))
    b_state = intended.new_state()
    b_state.restore(snap)
    b, tr_b = _step(quirk, b_state, int(ids[20]))
    assert not torch.equal(a, b)
    assert not torch.equal(tr_a["topk.layer2"][0], tr_b["topk.layer2"][0])

    # Position 21 closes a group: from the same state the two modes agree bitwise.
    snap = s_int.snapshot()
    a, _ = _step(intended, s_int, int(ids[21]))
    b_state.restore(snap)
    b, _ = _step(quirk, b_state, int(ids[21]))
    assert torch.equal(a, b)


def test_logits_tool_matches_forward_and_cli(models, ckpt, tmp_path):
    intended, _ = models
    ids = _ids(13).tolist()
    res = run(intended, ids, decode=3, chunk=3)
    ref = intended.forward([SeqInput(intended.new_state(), torch.tensor(ids + res["decode_tokens"].tolist()))])[0]
    assert torch.equal(res["prompt_logits"], ref[:13])
    assert torch.equal(res["decode_logits"], ref[13:])
    assert int(res["decode_tokens"][0]) == int(ref[12].argmax())
    out = tmp_path / "o.npz"
    cmd = [sys.executable, "-m", "dsv41.tools.logits", "--checkpoint", str(ckpt), "--tokens",
           ",".join(map(str, ids)), "--feed", ",".join(map(str, res["decode_tokens"].tolist())), "--chunk", "5",
           "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    z = np.load(out)
    assert z["prompt_logits"].dtype == np.float32 and z["prompt_logits"].shape == (13, 512)
    assert np.array_equal(z["prompt_logits"], res["prompt_logits"].numpy())
    assert np.array_equal(z["decode_logits"], res["decode_logits"].numpy())
    assert np.array_equal(z["decode_tokens"], res["decode_tokens"].numpy())
    bad = subprocess.run(cmd[:-2] + ["--chunk", "0", "--out", str(out)], check=False, capture_output=True,
                         timeout=300)
    assert bad.returncode != 0 and b"--chunk" in bad.stderr
