"""A real-shaped partial checkpoint: the release's tensor names, dtypes and shapes (weights.expected_tensors of the
release config) with random values, for K backbone layers + embed / head / norm (GPU measurements, docs/gpu.md).

    python -m dsv41.tools.make_real --layers K --out DIR [--seed 0] [--experts N] [--vocab N]

Layers: K of the release's compressed-layer kinds, in this order, cycling: a ratio-2 KV source with its indexer
(release layers 2, 8, 14), a ratio-1 KV source with its indexer and the candidate blocks (layer 20), a window-only
layer (0, 1). No Engram layers (a release table is ~100 GB), no DSpark stages, no vision tower; the config is the
release's with num_hidden_layers=K and the layer lists rewritten to match. --experts / --vocab shrink the routed
experts / vocabulary (tests on a small machine only; the GPU figures use the release's 384 / 129,280).

Values: FP8 weights are N(0,1) rounded to E4M3 with a power-of-two block scale near 1/sqrt(in); packed FP4 experts
are uniform random E2M1 codes with a scale near 1/(3 sqrt(in)); norms 1; embed N(0,1); head, gate, hc_fn
N(0, 1/in). A GPU, when present, generates the bytes (the checkpoint is ~8.7 GB per layer).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv41 import REPO_ROOT
from dsv41.config import ModelConfig, release_config_dict
from dsv41.model.weights import BF16, E8M0, FP8, I8, expected_tensors

KINDS = ("ratio2", "ratio1", "window")


def real_config(layers: int, experts: int | None = None, vocab: int | None = None) -> dict:
    """The release config cut to `layers` backbone layers (kinds cycle through KINDS), without Engram / DSpark /
    vision."""
    if layers < 1:
        raise ValueError("--layers must be at least 1")
    d = release_config_dict()
    d.pop("vision_config", None)
    t = d["text_config"]
    kinds = [KINDS[i % len(KINDS)] for i in range(layers)]
    ratios = [{"ratio2": 2, "ratio1": 1, "window": 0}[k] for k in kinds]
    sources = [i for i, r in enumerate(ratios) if r > 0]
    t.update(num_hidden_layers=layers, compress_ratios=ratios, kv_source_layer_ids=sources,
             index_source_layer_ids=sources, engram_layer_ids=[], engram_num_embeddings=[],
             num_nextn_predict_layers=0, dspark_target_layer_ids=[])
    ones = [i for i, r in enumerate(ratios) if r == 1]
    t["candidate_source_layer_id"] = ones[0] if ones else (sources[0] if sources else -1)
    if experts:
        t["n_routed_experts"] = experts
        t["num_experts_per_tok"] = min(t["num_experts_per_tok"], experts)
    if vocab:   # make_tiny's synthetic word-level tokenizer's ids (written next to the config by make())
        t["vocab_size"] = vocab
        t["dspark_noise_token_id"] = vocab - 6
        d["image_token_id"] = vocab - 1
    return d


def _pow2_scale(e: int, shape, device) -> torch.Tensor:
    return torch.full(shape, 127 + e, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)


def _tensor(name: str, dtype: str, shape: tuple[int, ...], g: torch.Generator, dev: str, scales: dict):
    if dtype == FP8:                     # N(0,1) on the E4M3 grid; block scale 2^-round(log2 sqrt(in))
        q = torch.randn(shape, generator=g, device=dev).clamp_(-448, 448).to(torch.float8_e4m3fn)
        scales[name[:-len(".weight")] + ".scale"] = -round(math.log2(math.sqrt(shape[1])))
        return q
    if dtype == I8:                      # uniform E2M1 codes (RMS ~3.2): scale ~ 1 / (3 sqrt(in))
        scales[name[:-len(".weight")] + ".scale"] = -round(math.log2(3 * math.sqrt(2 * shape[1])))
        return torch.randint(-128, 128, shape, generator=g, device=dev, dtype=torch.int8)
    if dtype == E8M0:
        return _pow2_scale(scales.pop(name), shape, dev)
    if name.endswith(("norm.weight", "hc_attn_scale", "hc_ffn_scale")):
        v = torch.ones(shape, device=dev)
    elif name.endswith(("_base", "attn_sink", "gate.bias", "gate.bias_vl")) or name.startswith("image_"):
        v = torch.zeros(shape, device=dev)
    elif name == "embed.weight":
        v = torch.randn(shape, generator=g, device=dev)
    else:                                # head, gate, compressor, indexer projections, hc_fn: N(0, 1/in)
        v = torch.randn(shape, generator=g, device=dev) / math.sqrt(shape[-1])
    return v.to(torch.bfloat16 if dtype == BF16 else torch.float32)


def _shard_of(name: str) -> str:
    if name.startswith("layers."):
        return f"layers-{int(name.split('.')[1]):03d}"
    return "head" if name in ("head.weight", "norm.weight") else "globals"


def make(out: Path, layers: int, seed: int = 0, experts: int | None = None, vocab: int | None = None,
         tokenizer: Path | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    d = real_config(layers, experts, vocab)
    if vocab:
        from dsv41.model.engram_hash import build_token_map
        from dsv41.tools.make_tiny import write_synthetic_tokenizer
        write_synthetic_tokenizer(out, vocab)
        d["text_config"]["engram_compressed_vocab_size"] = int(build_token_map(out / "tokenizer.json").max()) + 1
    else:
        tok = tokenizer or REPO_ROOT / "kit" / "tokenizer"
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (tok / f).is_file():
                shutil.copy(tok / f, out / f)
    cfg = ModelConfig.from_dict(d)
    inv = expected_tensors(cfg)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    shards: dict[str, list[str]] = {}
    for name in inv:
        shards.setdefault(_shard_of(name), []).append(name)
    weight_map = {}
    for shard, names in shards.items():
        fname = f"model-{shard}.safetensors"
        scales: dict[str, int] = {}
        # weights before their scales (the scale's exponent is decided with the weight)
        names = sorted(names, key=lambda n: n.endswith(".scale"))
        tensors = {}
        for n in names:
            spec = inv[n]
            tensors[n] = _tensor(n, spec.dtype, spec.shape, g, dev, scales).cpu()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(d, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.tools.make_real", description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, required=True, help="backbone layers K (kinds cycle ratio2, ratio1, window)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, help="routed experts per layer (default: the release's 384)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the release's 129,280)")
    a = ap.parse_args(argv)
    try:
        make(Path(a.out), a.layers, a.seed, a.experts, a.vocab)
    except ValueError as e:
        print(f"make_real: {e}", file=sys.stderr)
        return 2
    print(f"make_real: wrote {a.layers} layers to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
