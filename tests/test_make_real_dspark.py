"""make_real --dspark (issue 10): the release's DSpark stages in the real-shaped partial checkpoint, so the H200 bench
measures the draft pass at release shape instead of estimating it. CPU, ~30 s: one backbone layer, 2 routed
experts, a 384-token vocabulary; everything else at release shape."""
from __future__ import annotations

import json

import torch

from dsv41.config import ModelConfig, release_config_dict
from dsv41.model.weights import expected_tensors
from dsv41.tools.make_real import _reusable, _stamp, make, real_config


def _mtp(inv: dict) -> dict:
    return {n: s for n, s in inv.items() if n.startswith("mtp.")}


def test_dspark_tensors_are_the_release_ones_and_tap_the_last_layers():
    release = _mtp(expected_tensors(ModelConfig.from_dict(release_config_dict())))
    assert len(release) > 3 * 128 * 6
    for k, taps in ((5, [2, 3, 4]), (3, [0, 1, 2]), (2, [0, 1]), (1, [0])):
        d = real_config(k, dspark=True)
        t = ModelConfig.from_dict(d).text
        assert t.num_nextn_predict_layers == 3 and list(t.dspark_target_layer_ids) == taps
        assert list(t.compress_ratios) == [(2, 1, 0)[i % 3] for i in range(k)] + [0, 0, 0]
        cut = _mtp(expected_tensors(ModelConfig.from_dict(d)))
        assert set(cut) == set(release)
        differ = {n for n in cut if cut[n] != release[n]}
        # main_proj reads one 5120-wide tap per target layer: the release's 3 when the cut has them
        assert differ == (set() if k >= 3 else {"mtp.0.main_proj.weight", "mtp.0.main_proj.scale"}), k
        if differ:
            assert cut["mtp.0.main_proj.weight"].shape == (5120, 5120 * k)
    t = ModelConfig.from_dict(real_config(2)).text
    assert t.num_nextn_predict_layers == 0 and list(t.dspark_target_layer_ids) == []


def test_a_dspark_checkpoint_beside_an_existing_one_loads_and_drafts(tmp_path):
    from dsv41.model.model import Model, SeqInput
    plain, ds = tmp_path / "plain", tmp_path / "dspark"
    make(plain, layers=1, experts=2, vocab=384)
    make(ds, layers=1, experts=2, vocab=384, dspark=True, reuse=plain)
    # the backbone shards are the plain checkpoint's (linked); only the stages were written
    for name in ("globals", "layers-000", "head"):
        f = ds / f"model-{name}.safetensors"
        assert f.is_symlink() and f.resolve() == (plain / f.name).resolve()
    for j in range(3):
        assert not (ds / f"model-mtp-{j}.safetensors").is_symlink()
    stamp = _stamp(0, "cpu", "layers-000")
    names = [n for n, s in json.loads((plain / "model.safetensors.index.json").read_text())["weight_map"].items()
             if s == "model-layers-000.safetensors"]
    inv = expected_tensors(ModelConfig.from_checkpoint(plain))
    assert _reusable(plain / "model-layers-000.safetensors", names, inv, stamp)
    assert not _reusable(plain / "model-layers-000.safetensors", names, inv, _stamp(1, "cpu", "layers-000"))
    assert not _reusable(plain / "model-layers-000.safetensors", names[1:], inv, stamp)

    m = Model.load(ds, keep_quant=True)                          # the loader's inventory check on every name
    assert m.dspark is not None and len(m.dspark.stages) == 3
    assert list(m.t.dspark_target_layer_ids) == [0] and m.t.dspark_n_routed_experts == 2
    assert tuple(m.dspark.markov_head.shape) == (384, 256)
    st = m.new_state()
    m.forward([SeqInput(st, torch.tensor([0, 5, 9, 11, 40, 41]), logits="none")])
    d = m.dspark.draft([(st, 7)])[0]
    assert d.tokens.shape == (5,) and bool(((d.tokens >= 0) & (d.tokens < 384)).all())
    assert torch.isfinite(d.logits).all() and torch.isfinite(d.confidence).all()
    assert torch.equal(d.tokens, d.logits.argmax(dim=1))
    assert len(set(d.logits.std(dim=1).tolist())) == 5 and bool((d.logits.std(dim=1) > 0.1).all())
