"""config.json parsing/validation and the weight loader, on tiny-a (shared vectors) and the release config."""
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41.config import ConfigError, ModelConfig, release_config_dict
from dsv41.model import quant as Q
from dsv41.model.weights import RankShare, WeightError, expected_tensors, load_weights, read_weight_map


@pytest.fixture(scope="module")
def tiny_a(shared) -> Path:
    return shared / "vectors" / "model" / "tiny-a" / "checkpoint"


@pytest.fixture(scope="module")
def tiny_cfg(tiny_a) -> ModelConfig:
    return ModelConfig.from_checkpoint(tiny_a)


@pytest.fixture(scope="module")
def tiny_weights(tiny_a, tiny_cfg):
    return load_weights(tiny_a, tiny_cfg)


# ---------------------------------------------------------------------------------------------- config

def test_tiny_a_config(tiny_cfg):
    t = tiny_cfg.text
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_nextn_predict_layers) == (512, 128, 10, 3)
    assert t.compress_ratios == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0)
    assert t.engram_pad_id == 2 and tiny_cfg.image_token_id == 511
    assert t.rope_scaling.rope_type == "yarn" and t.rope_scaling.factor == 16
    assert tiny_cfg.vision.hidden_size == 64
    assert tiny_cfg.quant.weight_block_size == (32, 32)
    # round trip through the config.json form
    assert ModelConfig.from_dict(tiny_cfg.to_dict()) == tiny_cfg


def test_release_config_parses():
    cfg = ModelConfig.from_dict(release_config_dict())
    assert cfg.text.n_layers == 40 and cfg.text.engram_compressed_vocab_size == 99092
    assert len(cfg.text.compress_ratios) == 43


def test_engram_pad_alias():
    d = release_config_dict()
    del d["text_config"]["engram_pad_token_id"]
    d["text_config"]["engram_pad_id"] = 2
    assert ModelConfig.from_dict(d).text.engram_pad_token_id == 2
    d["text_config"]["engram_pad_token_id"] = 3
    with pytest.raises(ConfigError, match="engram_pad_id"):
        ModelConfig.from_dict(d)


def test_harmless_fields_ignored():
    d = release_config_dict()
    d["transformers_version"] = "5.23.0"
    d["text_config"]["initializer_range"] = 0.02
    d["text_config"]["attention_dropout"] = 0.0
    ModelConfig.from_dict(d)


def _mut(path, value):
    d = release_config_dict()
    node = d
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize("path,value,field", [
    (("model_type",), "deepseek_v4", "model_type"),
    (("architectures",), ["DeepseekV4ForCausalLM"], "architectures"),
    (("text_config", "model_type"), "deepseek_v4", "text_config.model_type"),
    (("text_config", "compress_ratios"), [0, 0] + [2] * 18 + [1] * 20, "text_config.compress_ratios"),
    (("text_config", "compress_ratios"), [0, 0] + [4] * 18 + [1] * 20 + [0] * 3, "text_config.compress_ratios"),
    (("text_config", "compress_ratios"), [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 1], "text_config.compress_ratios"),
    (("text_config", "kv_source_layer_ids"), [2, 8, 14, 24], "text_config.kv_source_layer_ids"),
    (("text_config", "kv_source_layer_ids"), [3, 8, 14, 20], "text_config.kv_source_layer_ids"),
    (("text_config", "candidate_source_layer_id"), 7, "text_config.candidate_source_layer_id"),
    (("text_config", "index_source_layer_ids"), [2, 8, 14, 18, 20], "text_config.index_source_layer_ids"),
    (("text_config", "head_dim"), 500, "text_config.head_dim"),
    (("text_config", "hidden_size"), 5000, "text_config.hidden_size"),
    (("text_config", "moe_intermediate_size"), 2300, "text_config.moe_intermediate_size"),
    (("text_config", "head_dim"), "512", "text_config.head_dim"),
    (("text_config", "num_key_value_heads"), 8, "text_config.num_key_value_heads"),
    (("text_config", "scoring_func"), "softmax", "text_config.scoring_func"),
    (("text_config", "norm_topk_prob"), False, "text_config.norm_topk_prob"),
    (("text_config", "tie_word_embeddings"), True, "text_config.tie_word_embeddings"),
    (("text_config", "num_hash_layers"), 3, "text_config.num_hash_layers"),
    (("text_config", "q_head_norm"), True, "text_config.q_head_norm"),
    (("text_config", "hc_sinkhorn_iters"), KeyError, "text_config.hc_sinkhorn_iters"),
    (("text_config", "rope_scaling", "rope_type"), "linear", "text_config.rope_scaling.rope_type"),
    (("text_config", "rope_scaling", "mscale"), 1.0, "text_config.rope_scaling.mscale"),
    (("text_config", "rope_scaling"), None, "text_config.rope_scaling"),
    (("text_config", "engram_num_embeddings"), [384006168], "text_config.engram_num_embeddings"),
    (("text_config", "dspark_noise_token_id"), 200000, "text_config.dspark_noise_token_id"),
    (("quantization_config", "quant_method"), "exl3", "quantization_config.quant_method"),
    (("quantization_config", "quant_method"), "gptq", "quantization_config.quant_method"),
    (("quantization_config", "weight_block_size"), [128, 128], "quantization_config.weight_block_size"),
    (("quantization_config", "scale_fmt"), None, "quantization_config.scale_fmt"),
    (("quantization_config", "expert_dtype"), "fp8", "quantization_config.expert_dtype"),
    (("quantization_config",), KeyError, "quantization_config"),
    (("text_config",), KeyError, "text_config"),
    (("image_token_id",), 129280, "image_token_id"),
    (("eos_token_id",), 7, "eos_token_id"),
    (("some_new_feature",), True, "some_new_feature"),
    (("vision_config", "num_attention_heads"), 15, "vision_config.num_attention_heads"),
    (("vision_config", "model_type"), "siglip", "vision_config.model_type"),
])
def test_config_errors_name_the_field(path, value, field):
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(_mut(path, value))
    assert ei.value.field == field, str(ei.value)
    assert field in str(ei.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------- inventory

def test_release_inventory_matches_the_index_census():
    """arch.md §4: the release index has 96,085 tensors and total_size 510,286,023,000 bytes."""
    cfg = ModelConfig.from_dict(release_config_dict())
    inv = expected_tensors(cfg, vision=True)
    assert len(inv) == 96085
    width = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
    assert sum(math.prod(s.shape) * width[s.dtype] for s in inv.values()) == 510_286_023_000
    assert inv["layers.0.attn.wq_a.scale"].shape == (40, 160)
    assert inv["layers.3.ffn.experts.7.w2.weight"].shape == (5120, 1152)
    assert inv["layers.14.engram.embed.weight"].shape == (384016682, 256)
    assert inv["mtp.2.confidence_head.proj.weight"].shape == (1, 5376)
    assert "layers.20.attn.compressor.wgate.weight" not in inv and "layers.14.attn.compressor.wgate.weight" in inv
    assert "layers.24.attn.indexer.wk.weight" not in inv and "layers.24.attn.indexer.wq_b.weight" in inv


def test_tiny_a_inventory_is_exact(tiny_a, tiny_cfg):
    wm = read_weight_map(tiny_a)
    assert set(wm) == set(expected_tensors(tiny_cfg))


# ---------------------------------------------------------------------------------------------- loading

def test_load_tiny_a(tiny_a, tiny_cfg, tiny_weights):
    w = tiny_weights
    inv = expected_tensors(tiny_cfg)
    want = {k for k, s in inv.items() if s.fmt not in ("scale", "engram")}
    assert set(w) == want
    assert not any(k.endswith(".scale") for k in w)
    for k, s in inv.items():
        if k in w:
            assert tuple(w[k].shape) == (s.shape if s.fmt != "fp4" else (s.shape[0], 2 * s.shape[1])), k
            assert w[k].dtype == torch.float32
    # spot checks against the formula, read independently
    wm = read_weight_map(tiny_a)
    with safe_open(tiny_a / wm["layers.2.attn.wq_b.weight"], "pt") as f:
        q = f.get_tensor("layers.2.attn.wq_b.weight").float()
        e = f.get_tensor("layers.2.attn.wq_b.scale").view(torch.uint8).long()
        r, c = 37, 45
        assert w["layers.2.attn.wq_b.weight"][r, c] == q[r, c] * 2.0 ** (int(e[r // 32, c // 32]) - 127)
        p = f.get_tensor("layers.2.ffn.experts.5.w2.weight").view(torch.uint8)
        s = f.get_tensor("layers.2.ffn.experts.5.w2.scale").view(torch.uint8).long()
        for k in (10, 11):
            nib = (int(p[3, k // 2]) >> (4 * (k % 2))) & 0xF
            val = Q.E2M1_VALUES[nib & 7] * (-1 if nib & 8 else 1)
            assert w["layers.2.ffn.experts.5.w2.weight"][3, k] == val * 2.0 ** (int(s[3, k // 32]) - 127)
        assert torch.equal(w["layers.2.hc_attn_fn"], f.get_tensor("layers.2.hc_attn_fn"))
    assert "layers.1.engram.embed.weight" not in w and "layers.1.engram.wkv.weight" in w


def test_load_bf16(tiny_a, tiny_cfg, tiny_weights):
    w = load_weights(tiny_a, tiny_cfg, dtype=torch.bfloat16)
    assert w["embed.weight"].dtype == torch.bfloat16 and w["layers.0.hc_attn_fn"].dtype == torch.float32
    # FP8 / FP4 dequant is exact in bf16
    for k in ("layers.0.attn.wq_a.weight", "layers.0.ffn.experts.3.w1.weight"):
        assert torch.equal(w[k].float(), tiny_weights[k])


def test_rank_share_tp2_reassembles(tiny_a, tiny_cfg, tiny_weights):
    parts = [load_weights(tiny_a, tiny_cfg, share=RankShare(r, 2)) for r in range(2)]
    full = tiny_weights
    for name, dim in (("layers.3.attn.wq_b.weight", 0), ("layers.3.attn.attn_sink", 0), ("layers.3.attn.wo_a.weight", 0),
                      ("layers.3.attn.wo_b.weight", 1), ("layers.3.ffn.shared_experts.w1.weight", 0),
                      ("layers.3.ffn.shared_experts.w2.weight", 1), ("head.weight", 0), ("mtp.1.attn.wq_b.weight", 0)):
        assert torch.equal(torch.cat([p[name] for p in parts], dim), full[name]), name
    for name in ("layers.3.attn.wkv.weight", "embed.weight", "layers.6.attn.compressor.wkv.weight"):
        assert all(torch.equal(p[name], full[name]) for p in parts)
    e0 = {k for k in parts[0] if ".experts." in k and k.startswith("layers.0.")}
    e1 = {k for k in parts[1] if ".experts." in k and k.startswith("layers.0.")}
    assert not (e0 & e1) and len(e0) == len(e1) == 8 * 3
    assert "layers.0.ffn.experts.7.w1.weight" in e0 and "layers.0.ffn.experts.8.w1.weight" in e1
    with pytest.raises(ValueError):
        RankShare(2, 2)


# ---------------------------------------------------------------------------------------------- loader errors

def _linked_copy(src: Path, dst: Path) -> dict:
    """A checkpoint dir of symlinks to src's shards with an editable index; returns the index dict."""
    dst.mkdir(exist_ok=True)
    for p in src.iterdir():
        if p.name != "model.safetensors.index.json":
            os.symlink(p, dst / p.name)
    return json.loads((src / "model.safetensors.index.json").read_text())


def _write_index(dst: Path, idx: dict):
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_missing_tensor(tiny_a, tiny_cfg, tmp_path):
    idx = _linked_copy(tiny_a, tmp_path / "ck")
    del idx["weight_map"]["layers.4.attn.indexer.wk.weight"]
    _write_index(tmp_path / "ck", idx)
    with pytest.raises(WeightError) as ei:
        load_weights(tmp_path / "ck", tiny_cfg)
    assert ei.value.name == "layers.4.attn.indexer.wk.weight" and "missing" in str(ei.value)


def test_unexpected_tensor(tiny_a, tiny_cfg, tmp_path):
    idx = _linked_copy(tiny_a, tmp_path / "ck")
    idx["weight_map"]["layers.3.attn.indexer.wk.weight"] = idx["weight_map"]["layers.3.attn.wkv.weight"]
    _write_index(tmp_path / "ck", idx)
    with pytest.raises(WeightError, match="layers.3.attn.indexer.wk.weight: not expected"):
        load_weights(tmp_path / "ck", tiny_cfg)


@pytest.mark.parametrize("name,bad,what", [
    ("layers.2.attn.wkv.weight", torch.zeros(96, 128, dtype=torch.float8_e4m3fn), "shape"),
    ("layers.2.attn.wkv.scale", torch.zeros(4, 4, dtype=torch.uint8), "dtype"),
    ("layers.0.hc_ffn_fn", torch.zeros(24, 512, dtype=torch.bfloat16), "dtype"),
    ("layers.5.ffn.experts.2.w3.weight", torch.zeros(64, 128, dtype=torch.int8), "shape"),
    ("embed.weight", torch.zeros(512, 128, dtype=torch.float32), "dtype"),
])
def test_wrong_shape_or_dtype(tiny_a, tiny_cfg, tmp_path, name, bad, what):
    ck = tmp_path / "ck"
    idx = _linked_copy(tiny_a, ck)
    save_file({name: bad}, str(ck / "patch.safetensors"))
    idx["weight_map"][name] = "patch.safetensors"
    _write_index(ck, idx)
    with pytest.raises(WeightError) as ei:
        load_weights(ck, tiny_cfg)
    assert ei.value.name == name and what in str(ei.value)


def test_missing_shard_and_index(tiny_a, tiny_cfg, tmp_path):
    ck = tmp_path / "ck"
    idx = _linked_copy(tiny_a, ck)
    os.unlink(ck / "model-00012-of-00017.safetensors")
    _write_index(ck, idx)
    with pytest.raises(WeightError, match="model-00012-of-00017.safetensors is missing"):
        load_weights(ck, tiny_cfg)
    with pytest.raises(WeightError, match="no model.safetensors"):
        load_weights(tmp_path, tiny_cfg)
