"""`make_tiny --format exl3`: a tiny EXL3 pack in the layout the reference recipe serves (docs/exl3.md).

Same config and 16-bit tensors as the official tiny checkpoint, with three sizes raised to 128 (q_lora_rank,
o_lora_rank, moe_intermediate_size: EXL3 linears need both dimensions to be multiples of 128), and every linear the
packs quantise written as an EXL3 linear with random trellis codes (every bit pattern is a valid code; the decoder
defines the weights) at the reference pack's rate for its family, the mul1 codebook (exllamav3's default) and fp16
sign-scales whose output side carries the official tiny checkpoint's weight scale. The Engram tables are not in the
pack (as in the published packs): they are written in the official format to DIR/engram, served with
`--engram DIR/engram`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv41.config import ModelConfig
from dsv41.model.exl3 import MUL1_MARKER, official_name
from dsv41.model.exl3_load import Exl3Linear, pack_inventory
from dsv41.model.weights import expected_tensors
from dsv41.tools.make_tiny import _gen, _std, make_tensor, shard_plan

# Bits per weight by tensor family, as `bertholomus/DeepSeek-V4.1-Flash-1017-EXL3-2.5bpw` (exl3.V41_PACK_BITS).
# Its card says "DSpark 4 and 6" without saying which: here the DSpark routed experts get 4, its other linears 6.
PACK_BITS = {"routed experts": 2.5, "attention": 4, "shared experts": 4, "kv compressor": 4, "indexer q": 4,
             "engram wkv": 4, "indexer wk": 8, "head": 6}
DSPARK_BITS = {"routed experts": 4, "other": 6}
EXL3_DIM = 128


def exl3_config_dict(d: dict) -> dict:
    """The official tiny config turned into a pack's: sizes EXL3 can tile, quantization_config as exllamav3
    writes it."""
    t = d["text_config"]
    if t["hidden_size"] % EXL3_DIM:
        raise SystemExit(f"make_tiny --format exl3: --hidden must be a multiple of {EXL3_DIM}")
    if t["vocab_size"] % EXL3_DIM:
        raise SystemExit(f"make_tiny --format exl3: the vocabulary ({t['vocab_size']}) must be a multiple of "
                         f"{EXL3_DIM} (the head is an EXL3 linear)")
    t.update(q_lora_rank=EXL3_DIM, o_lora_rank=EXL3_DIM, moe_intermediate_size=EXL3_DIM)
    d["quantization_config"] = {"quant_method": "exl3", "version": "1.6.5", "bits": 2.5, "head_bits": 6,
                                "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto",
                                "codebook": "mul1"}
    return d


def bits_for(lin: Exl3Linear, o_lora_rank: int) -> float:
    _, _, family = official_name(lin.module, o_lora_rank)
    if family == "dspark":
        return DSPARK_BITS["routed experts" if ".ffn.experts." in lin.module else "other"]
    return PACK_BITS[family]


def make_linear(lin: Exl3Linear, K: float, seed: int) -> dict[str, torch.Tensor]:
    """Random codes, fp16 sign-scales (input side ~1, output side the official weight's std), mul1 marker."""
    g = _gen(seed, lin.module)
    w = int(16 * K)
    trellis = torch.randint(-(1 << 15), 1 << 15, (lin.n_in // 16, lin.n_out // 16, w), generator=g,
                            dtype=torch.int32).to(torch.int16)
    sign_u = torch.randint(0, 2, (lin.n_in,), generator=g) * 2 - 1
    sign_v = torch.randint(0, 2, (lin.n_out,), generator=g) * 2 - 1
    std = _std(lin.official, (lin.n_out, lin.n_in))
    suh = sign_u * (1 + 0.1 * torch.randn(lin.n_in, generator=g))
    svh = sign_v * std * (1 + 0.1 * torch.randn(lin.n_out, generator=g))
    m = lin.module
    return {f"{m}.trellis": trellis, f"{m}.suh": suh.half(), f"{m}.svh": svh.half(),
            f"{m}.mul1": torch.tensor(MUL1_MARKER, dtype=torch.int32)}


def _write_shards(out: Path, tensors_by_shard: list[dict[str, torch.Tensor]]) -> None:
    weight_map, total = {}, 0
    n = len(tensors_by_shard)
    for i, tensors in enumerate(tensors_by_shard, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)
        for k, x in tensors.items():
            weight_map[k] = fname
            total += x.numel() * x.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_exl3_pack(out: Path, cfg_dict: dict, seed: int, vision: bool, engram_out: Path) -> ModelConfig:
    d = exl3_config_dict(cfg_dict)
    cfg = ModelConfig.from_dict(d)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n")
    inv = pack_inventory(cfg, vision=vision)
    official = expected_tensors(cfg, vision=vision)
    # shard like the release: one group per official tensor, each EXL3 linear's parts where its weight would be
    groups = shard_plan([n for n in official if official[n].fmt not in ("scale", "engram")], cfg)
    shards = []
    for names in groups:
        tensors: dict[str, torch.Tensor] = {}
        for n in names:
            if n in inv.plain:
                tensors.update(make_tensor(n, official[n], cfg, seed))
            else:
                for lin in inv.linears[n]:
                    tensors.update(make_linear(lin, bits_for(lin, cfg.text.o_lora_rank), seed))
        shards.append(tensors)
    _write_shards(out, shards)
    # the Engram tables, in the official format, in a folder of their own (the published packs do not carry
    # them): shard files without an index, as `make_tiny --engram-out` writes them (EngramStore reads the headers)
    engram_out.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(n for n in inv.engram_tables if n.endswith(".weight")):
        fname = engram_out / f"engram-{i:05d}.safetensors"
        save_file(make_tensor(name, official[name], cfg, seed), str(fname), metadata={"format": "pt"})
        fname.chmod(0o644)
    return cfg

