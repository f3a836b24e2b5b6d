"""make_tiny: a loadable, deterministic checkpoint with every layer role, real names/dtypes/scale rules."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv41 import BUILTIN_TOKENIZER_DIR
from dsv41.config import ConfigError, ModelConfig
from dsv41.model.engram_hash import EngramHasher, build_token_map
from dsv41.model.engram_store import EngramStore, read_safetensors_header
from dsv41.model.weights import WeightError, expected_tensors, load_weights, read_weight_map
from dsv41.tools.make_tiny import layer_layout, main


def _make(out: Path, *args) -> Path:
    assert main(["--out", str(out), *args]) == 0
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("tiny") / "ck", "--seed", "3", "--vocab", "512")


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_loads_and_has_every_role(small):
    cfg = ModelConfig.from_checkpoint(small)
    t = cfg.text
    w = load_weights(small, cfg)
    wm = read_weight_map(small)
    assert t.compress_ratios == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0)
    assert (t.kv_source_layer_ids, t.index_source_layer_ids, t.candidate_source_layer_id) == ((2, 4, 6), (2, 4, 6, 8), 6)
    assert t.engram_layer_ids == (1, 4) and t.dspark_target_layer_ids == (7, 8, 9)
    roles = {
        "ratio-2 source": ["layers.2.attn.compressor.wgate.weight", "layers.2.attn.indexer.wk.weight"],
        "ratio-1 source / candidate": ["layers.6.attn.compressor.wkv.weight", "layers.6.attn.indexer.k_norm.weight"],
        "re-index": ["layers.8.attn.indexer.wq_b.weight", "layers.8.attn.indexer.weights_proj.weight"],
        "engram": ["layers.1.engram.wkv.weight", "layers.4.engram.q_weight"],
        "dspark": ["mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
                   "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
                   "mtp.2.confidence_head.proj.weight", "mtp.1.ffn.experts.7.w2.weight"],
        "image": ["image_start", "image_newline", "image_end"],
    }
    for role, names in roles.items():
        for n in names:
            assert n in w, (role, n)
    assert "layers.6.attn.compressor.wgate.weight" not in wm and "layers.8.attn.indexer.wk.weight" not in wm
    assert "layers.3.attn.compressor.wkv.weight" not in wm and "layers.3.attn.indexer.wq_b.weight" not in wm
    assert "layers.1.engram.embed.weight" in wm and "layers.1.engram.embed.weight" not in w
    # Engram tensors sit alone in the last shards, like the release's model-00047/48
    shards = sorted(set(wm.values()))
    assert {n for n, f in wm.items() if f == shards[-2]} == {n for n in wm if n.startswith("layers.1.engram.")}
    assert {n for n, f in wm.items() if f == shards[-1]} == {n for n in wm if n.startswith("layers.4.engram.")}
    idx = json.loads((small / "model.safetensors.index.json").read_text())
    headers = {f: read_safetensors_header(small / f)[0] for f in set(wm.values())}
    assert idx["metadata"]["total_size"] == sum(
        math_prod(headers[f][n]["shape"]) * _width(headers[f][n]["dtype"]) for n, f in wm.items())
    # scale rules: FP8 scales are powers of two chosen by 2^ceil(log2(amax/448)) -> some block reaches >= 224
    with safe_open(small / wm["layers.3.attn.wq_a.weight"], "pt") as f:
        q = f.get_tensor("layers.3.attn.wq_a.weight").float()
        assert q.abs().max() >= 224 and q.abs().max() <= 448
    # sane magnitudes, as tiny-a
    assert abs(w["layers.3.attn.wq_a.weight"].std().item() - 128 ** -0.5) < 0.01
    assert abs(w["embed.weight"].std().item() - 1.0) < 0.02
    assert (w["layers.0.attn_norm.weight"] - 1).abs().max() < 0.6


def math_prod(shape):
    out = 1
    for s in shape:
        out *= s
    return out


def _width(dtype: str) -> int:
    return {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}[dtype]


def test_deterministic_for_a_seed(small, tmp_path):
    again = _make(tmp_path / "again", "--seed", "3", "--vocab", "512")
    assert _digest(again) == _digest(small)
    other = _make(tmp_path / "other", "--seed", "4", "--vocab", "512")
    a, b = _digest(other), _digest(small)
    assert a["config.json"] == b["config.json"] and a["model-00002-of-00017.safetensors"] != b["model-00002-of-00017.safetensors"]


def test_engram_pieces_fit(small):
    cfg = ModelConfig.from_checkpoint(small)
    tm = build_token_map(small / "tokenizer.json")
    h = EngramHasher(cfg, tm)  # class count and prime sums agree with the config
    ids = h.hash_ids(torch.arange(40) % cfg.text.vocab_size)
    with EngramStore(small, cfg) as st:
        rows = st.lookup(4, ids[:, 1])
    assert rows.shape == (40, 12, 64) and torch.isfinite(rows).all() and rows.abs().max() > 0


@pytest.mark.parametrize("n", [7, 8, 12, 40])
def test_layer_layout_roles(n):
    lay = layer_layout(n)
    cr = lay["compress_ratios"]
    assert len(cr) == n and cr[:2] == [0, 0]
    src = lay["kv_source_layer_ids"]
    assert any(cr[i] == 2 for i in src) and lay["candidate_source_layer_id"] in src
    reuse2 = [i for i in range(n) if cr[i] == 2 and i not in src]
    reindex = [i for i in lay["index_source_layer_ids"] if i not in src]
    reuse1 = [i for i in range(n) if cr[i] == 1 and i not in lay["index_source_layer_ids"]]
    assert reuse2 and reindex and reuse1
    with pytest.raises(ValueError):
        layer_layout(6)


def test_errors_on_make_tiny_output(small, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(small, ck)
    cfg_json = json.loads((ck / "config.json").read_text())
    cfg_json["text_config"]["compress_ratios"][3] = 4
    (ck / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(ConfigError, match="text_config.compress_ratios"):
        ModelConfig.from_checkpoint(ck)
    cfg = ModelConfig.from_checkpoint(small)
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["mtp.2.markov_head.head.weight"]
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(WeightError, match="mtp.2.markov_head.head.weight: missing"):
        load_weights(ck, cfg)


def test_real_tokenizer_with_vision(tmp_path, shared):
    """The default checkpoint: bundled V4.1 tokenizer, well under 200 MB; --vision adds the tower."""
    ck = _make(tmp_path / "real", "--seed", "0", "--vision")
    cfg = ModelConfig.from_checkpoint(ck)
    t = cfg.text
    assert (t.vocab_size, cfg.image_token_id, t.dspark_noise_token_id) == (129280, 129264, 128799)
    assert t.engram_compressed_vocab_size == 99092
    assert (ck / "tokenizer.json").read_bytes() == (BUILTIN_TOKENIZER_DIR / "tokenizer.json").read_bytes()
    assert (ck / "tokenizer_config.json").is_file()
    assert sum(p.stat().st_size for p in ck.iterdir()) < 200e6
    w = load_weights(ck, cfg)
    # vision names and shapes follow the vision vectors' tiny tower (its aligner maps to a 48-d text model)
    with safe_open(shared / "vectors" / "vision" / "tiny_vision.safetensors", "pt") as f:
        names = set(f.keys())
        for n in names:
            assert n in w, n
            if not n.startswith("aligner."):
                assert tuple(w[n].shape) == tuple(f.get_slice(n).get_shape()), n
    assert set(n for n in w if n.startswith(("vision.", "aligner."))) == names
    assert w["aligner.w1.weight"].shape == (128, 576)
    assert len(expected_tensors(cfg, vision=True)) == len(read_weight_map(ck))


def test_smallest_layout_writes_and_loads(tmp_path):
    ck = _make(tmp_path / "seven", "--seed", "1", "--vocab", "64", "--layers", "7", "--hidden", "96")
    cfg = ModelConfig.from_checkpoint(ck)
    assert cfg.text.compress_ratios == (0, 0, 2, 2, 1, 1, 1, 0, 0, 0) and cfg.text.hidden_size == 96
    assert cfg.text.index_source_layer_ids == (2, 4, 6) and cfg.text.engram_layer_ids == (1, 3)
    w = load_weights(ck, cfg)
    assert "layers.6.attn.indexer.wq_b.weight" in w and "layers.3.engram.wkv.weight" in w
