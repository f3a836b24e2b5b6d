"""ModelConfig: a DeepSeek-V4.1 checkpoint's config.json, parsed and validated.

The released config is composite (arch.md §1.1): top-level ids and `quantization_config`, the text model under
`text_config`, the vision tower under `vision_config`. Field names stay those of config.json, so a reader can match
them one to one. Anything this code cannot run fails here with a ConfigError naming the field, never later as a
shape mismatch or, worse, as silently different math.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec


class ConfigError(ValueError):
    """An unsupported or inconsistent config.json field. `field` is its dotted path, e.g. `text_config.head_dim`."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"config.json: {field}: {message}")


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    """YaRN on the compressed-attention layers (ratio > 0): arch.md §2.5. No mscale / attention factor."""

    rope_type: str
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int


class TextConfig(msgspec.Struct, frozen=True, kw_only=True):
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScaling
    n_routed_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    gate_temp: float
    sliding_window: int
    compress_ratios: tuple[int, ...]
    compress_rope_theta: float
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2

    # Short names the model code uses; they are views of the fields above, not separate settings.
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_mtp(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def engram_pad_id(self) -> int:
        return self.engram_pad_token_id


class VisionConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None = None


class QuantConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Weight format of the checkpoint: `fp8` (the official release: FP8 E4M3 with ue8m0 32x32 block scales for
    dense weights, packed FP4 E2M1 for routed experts; the four fp8 fields are required) or `exl3` (an exllamav3
    pack, docs/exl3.md: every tensor describes its own rate and codebook, so only the nominal rates are kept)."""

    quant_method: str
    activation_scheme: str | None = None      # fp8 only
    weight_block_size: tuple[int, int] | None = None
    scale_fmt: str | None = None
    expert_dtype: str | None = None
    bits: float | None = None                 # exl3 only: the pack's nominal bits per weight (informational)
    head_bits: float | None = None


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    text: TextConfig
    vision: VisionConfig | None
    quant: QuantConfig
    image_token_id: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "ModelConfig":
        """Read `<dir>/config.json` (or the given config.json file) and validate it."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("config.json", f"not found at {p}") from None
        except json.JSONDecodeError as e:
            raise ConfigError("config.json", f"not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        return _parse(raw)

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (composite), as the release writes it."""
        text = json.loads(msgspec.json.encode(self.text))
        text = {"model_type": TEXT_MODEL_TYPE, **text}
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "image_token_id": self.image_token_id,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            "quantization_config": json.loads(msgspec.json.encode(self.quant)),
            "text_config": text,
        }
        if self.vision is not None:
            out["vision_config"] = {"model_type": VISION_MODEL_TYPE, **json.loads(msgspec.json.encode(self.vision))}
        return out


MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"
VISION_MODEL_TYPE = "deepseek_v41_vision"
ARCHITECTURE = "DeepseekV41ForCausalLM"

# Fields that carry no math for inference (bookkeeping of the HF tooling); ignored wherever they appear.
_HARMLESS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "initializer_range", "use_cache",
    "attention_dropout", "output_attentions", "output_hidden_states", "return_dict", "_name_or_path", "auto_map",
    "id2label", "label2id", "num_labels", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
})

# Fields that change the math; this code implements exactly one value of each. Absent means that value.
_FIXED_TEXT = {
    "model_type": TEXT_MODEL_TYPE,
    "num_key_value_heads": 1,        # one shared K=V head
    "n_shared_experts": 1,
    "hidden_act": "silu",
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "tie_word_embeddings": False,    # head.weight is its own tensor
    "attention_bias": False,
}
_FIXED_TOP = {
    "model_type": MODEL_TYPE,
    "tie_word_embeddings": False,
}
_FIXED_VISION = {"model_type": VISION_MODEL_TYPE}
_FIXED_QUANT = {
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
_ROPE_TYPES = ("yarn",)


def _check_fixed(section: dict[str, Any], fixed: dict[str, Any], prefix: str) -> None:
    for key, want in fixed.items():
        have = list(section[key]) if isinstance(section.get(key), tuple) else section.get(key)
        if key in section and have != want:
            raise ConfigError(f"{prefix}{key}", f"{section[key]!r} is not supported (only {want!r})")


def _convert(section: dict[str, Any], typ: type, prefix: str, fixed: dict[str, Any]) -> Any:
    known = set(typ.__struct_fields__)
    body = {}
    for key, value in section.items():
        if key in known:
            body[key] = value
        elif key in fixed or key in _HARMLESS:
            continue
        else:
            raise ConfigError(f"{prefix}{key}", "unknown field; it may change the model's math, so this code refuses it")
    try:
        return msgspec.convert(body, typ, strict=True)
    except msgspec.ValidationError as e:
        # msgspec names the path as `$.field...`; turn it into our dotted form.
        msg = str(e)
        field = prefix.rstrip(".") or "config"
        if " - at `$." in msg:
            msg, _, path = msg.partition(" - at `$.")
            field = prefix + path.rstrip("`")
        elif msg.startswith("Object missing required field `"):
            field = prefix + msg.split("`")[1]
        raise ConfigError(field, msg) from None


_EXL3_RATES = ("bits", "head_bits")


def _exl3_quant(qraw: dict[str, Any]) -> QuantConfig:
    """exllamav3 writes quant_method, version, bits, head_bits, calibration, out_scales, codebook. Each EXL3 tensor
    carries its own rate and codebook marker (the loader reads them), so the rest is bookkeeping; the fp8 fields
    would mean a config that mixes two formats."""
    mixed = [k for k in _FIXED_QUANT if k in qraw]
    if mixed:
        raise ConfigError("quantization_config.quant_method", f"'exl3' together with fp8 fields {mixed}")
    body = {"quant_method": "exl3"}
    for key in _EXL3_RATES:
        if qraw.get(key) is not None:
            if isinstance(qraw[key], bool) or not isinstance(qraw[key], (int, float)):
                raise ConfigError(f"quantization_config.{key}", f"must be a number, got {qraw[key]!r}")
            body[key] = float(qraw[key])
    return QuantConfig(**body)


def _parse(raw: dict[str, Any]) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError("config", "must be a JSON object")
    if "text_config" not in raw:
        raise ConfigError("text_config", "missing (a V4.1 config is composite: text_config, vision_config, "
                                         "quantization_config)")
    for key in raw:
        if key not in {"text_config", "vision_config", "quantization_config", "image_token_id", "bos_token_id",
                       "eos_token_id", "pad_token_id"} | set(_FIXED_TOP) | _HARMLESS:
            raise ConfigError(key, "unknown top-level field; it may change the model's math, so this code refuses it")
    _check_fixed(raw, _FIXED_TOP, "")
    if raw.get("model_type") is None:
        raise ConfigError("model_type", f"missing (expected {MODEL_TYPE!r})")
    arch = raw.get("architectures")
    if arch is not None and arch != [ARCHITECTURE]:
        raise ConfigError("architectures", f"{arch!r} is not supported (only [{ARCHITECTURE!r}])")

    text_raw = dict(raw["text_config"])
    if not isinstance(raw["text_config"], dict):
        raise ConfigError("text_config", "must be an object")
    # The release spells the Engram pad id `engram_pad_token_id`; HF and the reference ModelArgs `engram_pad_id`.
    if "engram_pad_id" in text_raw:
        alias = text_raw.pop("engram_pad_id")
        if "engram_pad_token_id" in text_raw and text_raw["engram_pad_token_id"] != alias:
            raise ConfigError("text_config.engram_pad_id",
                              f"{alias} disagrees with engram_pad_token_id {text_raw['engram_pad_token_id']}")
        text_raw["engram_pad_token_id"] = alias
    rs = text_raw.get("rope_scaling")
    if isinstance(rs, dict):
        rs = dict(rs)
        if "type" in rs and "rope_type" not in rs:  # older HF spelling
            rs["rope_type"] = rs.pop("type")
        rtype = rs.get("rope_type")
        if rtype not in _ROPE_TYPES:
            raise ConfigError("text_config.rope_scaling.rope_type", f"{rtype!r} is not supported (only 'yarn')")
        if rs.get("attention_factor", 1.0) != 1.0:
            raise ConfigError("text_config.rope_scaling.attention_factor", "only 1.0 (no mscale) is supported")
        rs.pop("attention_factor", None)
        for key in list(rs):
            if key not in RopeScaling.__struct_fields__:
                raise ConfigError(f"text_config.rope_scaling.{key}", "unknown field (e.g. mscale) is not supported")
        text_raw["rope_scaling"] = rs
    elif rs is None:
        raise ConfigError("text_config.rope_scaling", "missing; V4.1 uses YaRN on the compressed layers")
    _check_fixed(text_raw, _FIXED_TEXT, "text_config.")
    text = _convert(text_raw, TextConfig, "text_config.", _FIXED_TEXT)

    vision = None
    if raw.get("vision_config") is not None:
        vraw = raw["vision_config"]
        if not isinstance(vraw, dict):
            raise ConfigError("vision_config", "must be an object")
        _check_fixed(vraw, _FIXED_VISION, "vision_config.")
        vision = _convert(vraw, VisionConfig, "vision_config.", _FIXED_VISION)

    qraw = raw.get("quantization_config")
    if qraw is None:
        raise ConfigError("quantization_config", "missing; only the official FP8/FP4 checkpoint format is supported")
    method = qraw.get("quant_method")
    if method == "exl3":
        quant = _exl3_quant(qraw)
    elif method != "fp8":
        raise ConfigError("quantization_config.quant_method", f"{method!r} is not supported (only 'fp8', 'exl3')")
    else:
        _check_fixed(qraw, _FIXED_QUANT, "quantization_config.")
        for key in _FIXED_QUANT:
            if key not in qraw:
                raise ConfigError(f"quantization_config.{key}", f"missing (expected {_FIXED_QUANT[key]!r})")
        for key in _EXL3_RATES:
            if key in qraw:
                raise ConfigError(f"quantization_config.{key}", "an exl3 field in an fp8 config")
        quant = _convert(qraw, QuantConfig, "quantization_config.", {})

    top = {}
    for key, default in (("bos_token_id", text.bos_token_id), ("eos_token_id", text.eos_token_id),
                         ("pad_token_id", text.pad_token_id)):
        top[key] = raw.get(key, default)
        if top[key] != getattr(text, key):
            raise ConfigError(key, f"{top[key]} disagrees with text_config.{key} {getattr(text, key)}")
    if "image_token_id" not in raw:
        raise ConfigError("image_token_id", "missing")
    try:
        cfg = ModelConfig(text=text, vision=vision, quant=quant, image_token_id=int(raw["image_token_id"]), **top)
    except (TypeError, ValueError) as e:
        raise ConfigError("config", str(e)) from None
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    t = cfg.text
    T = "text_config."

    def need(cond: bool, field: str, msg: str) -> None:
        if not cond:
            raise ConfigError(field, msg)

    # Sizes every FP8 32x32 block / FP4 32-scale group must tile exactly.
    for name in ("hidden_size", "moe_intermediate_size", "q_lora_rank", "head_dim", "o_lora_rank",
                 "index_head_dim", "engram_head_dim"):
        v = getattr(t, name)
        need(v > 0 and v % 32 == 0, T + name, f"{v} must be a positive multiple of 32")
    for name in ("vocab_size", "num_hidden_layers", "num_attention_heads", "n_routed_experts",
                 "num_experts_per_tok", "index_n_heads", "index_topk", "candidate_topk_blocks",
                 "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "sliding_window", "engram_n_heads",
                 "engram_vocab_size", "engram_compressed_vocab_size", "dspark_block_size", "dspark_markov_rank",
                 "dspark_n_routed_experts", "dspark_num_experts_per_tok", "max_position_embeddings"):
        need(getattr(t, name) > 0, T + name, f"{getattr(t, name)} must be positive")
    need(t.num_nextn_predict_layers >= 0, T + "num_nextn_predict_layers", "must be >= 0")
    need(t.qk_rope_head_dim > 0 and t.qk_rope_head_dim % 2 == 0 and t.qk_rope_head_dim <= t.head_dim,
         T + "qk_rope_head_dim", f"{t.qk_rope_head_dim} must be even and <= head_dim")
    need(t.qk_rope_head_dim <= t.index_head_dim, T + "qk_rope_head_dim", "must be <= index_head_dim")
    need(t.num_attention_heads % t.o_groups == 0, T + "o_groups",
         f"{t.o_groups} must divide num_attention_heads {t.num_attention_heads}")
    need((t.num_attention_heads // t.o_groups * t.head_dim) % 32 == 0, T + "o_groups",
         "heads per group x head_dim must be a multiple of 32")
    need((t.o_groups * t.o_lora_rank) % 32 == 0, T + "o_lora_rank", "o_groups x o_lora_rank must tile by 32")
    need(t.num_experts_per_tok <= t.n_routed_experts, T + "num_experts_per_tok", "exceeds n_routed_experts")
    need(t.dspark_num_experts_per_tok <= t.dspark_n_routed_experts, T + "dspark_num_experts_per_tok",
         "exceeds dspark_n_routed_experts")
    need(t.rms_norm_eps > 0, T + "rms_norm_eps", "must be > 0")
    need(t.rope_theta > 0 and t.compress_rope_theta > 0, T + "rope_theta", "must be > 0")
    rs = t.rope_scaling
    need(rs.factor >= 1 and rs.original_max_position_embeddings > 0 and rs.beta_fast > rs.beta_slow > 0,
         T + "rope_scaling", f"implausible YaRN parameters {rs}")

    # Layer roles (arch.md §2.3).
    L, M = t.num_hidden_layers, t.num_nextn_predict_layers
    cr = t.compress_ratios
    need(len(cr) == L + M, T + "compress_ratios",
         f"has {len(cr)} entries; must be num_hidden_layers + num_nextn_predict_layers = {L + M}")
    for i, r in enumerate(cr):
        need(r in (0, 1, 2), T + "compress_ratios", f"entry {i} is {r}; only ratios 0, 1, 2 are supported")
    need(all(r == 0 for r in cr[L:]), T + "compress_ratios", "the DSpark (last num_nextn_predict_layers) entries "
                                                            "must be 0 (window-only)")

    def ids(name: str, seq: tuple[int, ...], hi: int) -> None:
        need(list(seq) == sorted(set(seq)), T + name, f"{list(seq)} must be strictly increasing")
        need(all(0 <= i < hi for i in seq), T + name, f"{list(seq)} has ids outside 0..{hi - 1}")

    ids("kv_source_layer_ids", t.kv_source_layer_ids, L)
    ids("index_source_layer_ids", t.index_source_layer_ids, L)
    kv_src = set(t.kv_source_layer_ids)
    for i in t.kv_source_layer_ids:
        need(cr[i] > 0, T + "kv_source_layer_ids", f"layer {i} has compress ratio 0")
    latest = None
    for i in range(L):
        if i in kv_src:
            latest = i
        if cr[i] > 0:
            need(latest is not None and cr[latest] == cr[i], T + "kv_source_layer_ids",
                 f"layer {i} (ratio {cr[i]}) has no preceding KV source of the same ratio")
    need(kv_src <= set(t.index_source_layer_ids), T + "index_source_layer_ids",
         "must include every kv source (each owns indexer keys)")
    need(t.candidate_source_layer_id in kv_src, T + "candidate_source_layer_id",
         f"{t.candidate_source_layer_id} is not a kv source")
    for i in t.index_source_layer_ids:
        if i not in kv_src:  # re-index layers score the candidate source's keys inside its candidates
            need(i > t.candidate_source_layer_id and cr[i] == cr[t.candidate_source_layer_id],
                 T + "index_source_layer_ids", f"re-index layer {i} must follow the candidate source with its ratio")
    for i in range(L):
        if cr[i] > 0:
            need(any(j <= i for j in t.index_source_layer_ids), T + "index_source_layer_ids",
                 f"layer {i} has no preceding index source")

    # Engram (arch.md §2.9).
    ids("engram_layer_ids", t.engram_layer_ids, L)
    need(len(t.engram_num_embeddings) == len(t.engram_layer_ids), T + "engram_num_embeddings",
         "needs one entry per engram layer")
    need(t.engram_max_ngram_size >= 2, T + "engram_max_ngram_size", "must be >= 2")
    need(0 <= t.engram_pad_token_id < t.vocab_size, T + "engram_pad_token_id", "outside the vocabulary")
    need(t.engram_compressed_vocab_size <= t.vocab_size, T + "engram_compressed_vocab_size", "exceeds vocab_size")
    min_rows = (t.engram_max_ngram_size - 1) * t.engram_n_heads * t.engram_vocab_size
    for n in t.engram_num_embeddings:
        need(n >= min_rows, T + "engram_num_embeddings", f"{n} is too small for its primes (>= {min_rows})")

    # DSpark (arch.md §2.11).
    ids("dspark_target_layer_ids", t.dspark_target_layer_ids, L)
    if M:
        need(len(t.dspark_target_layer_ids) > 0, T + "dspark_target_layer_ids", "empty with DSpark layers present")
    need(0 <= t.dspark_noise_token_id < t.vocab_size, T + "dspark_noise_token_id", "outside the vocabulary")
    need(0 <= cfg.image_token_id < t.vocab_size, "image_token_id", "outside the vocabulary")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        need(0 <= getattr(t, name) < t.vocab_size, T + name, "outside the vocabulary")
    need(math.isfinite(t.swiglu_limit) and t.swiglu_limit > 0, T + "swiglu_limit", "must be positive")

    v = cfg.vision
    if v is not None:
        V = "vision_config."
        need(v.hidden_size % v.num_attention_heads == 0, V + "num_attention_heads", "must divide hidden_size")
        need((v.hidden_size // v.num_attention_heads) % 4 == 0, V + "num_attention_heads",
             "head dim must be a multiple of 4 (2D RoPE over rows and columns)")
        for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "patch_size", "downsample_ratio",
                     "max_image_tokens", "min_pixels"):
            need(getattr(v, name) > 0, V + name, "must be positive")


def release_config_dict() -> dict[str, Any]:
    """The released DeepSeek-V4.1-Flash config.json (arch.md §1.1), for tests and sizing without the checkpoint."""
    text = {
        "model_type": TEXT_MODEL_TYPE, "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
        "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu",
        "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "attention_bias": False, "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "gate_temp": 1.0,
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "compress_rope_theta": 160000, "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "index_n_heads": 32, "index_head_dim": 128,
        "index_topk": 512, "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_vocab_size": 16000000,
        "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256, "dspark_n_routed_experts": 128,
        "dspark_num_experts_per_tok": 3, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    }
    vision = {
        "model_type": VISION_MODEL_TYPE, "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
        "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
        "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None,
    }
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": "bfloat16", "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": text, "vision_config": vision,
    }
