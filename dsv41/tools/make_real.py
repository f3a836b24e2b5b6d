"""A real-shaped partial checkpoint: the release's tensor names, dtypes and shapes (weights.expected_tensors of the
release config) with random values, for K backbone layers + embed / head / norm (GPU measurements, docs/gpu.md),
optionally with the release's DSpark draft head (docs/drafts.md).

    python -m dsv41.tools.make_real --layers K --out DIR [--dspark] [--reuse DIR] [--seed 0] [--experts N] [--vocab N]

Layers: K of the release's compressed-layer kinds, in this order, cycling: a ratio-2 KV source with its indexer
(release layers 2, 8, 14), a ratio-1 KV source with its indexer and the candidate blocks (layer 20), a window-only
layer (0, 1). No Engram layers (a release table is ~100 GB), no vision tower; the config is the release's with
num_hidden_layers=K and the layer lists rewritten to match. --experts / --vocab shrink the routed experts / vocabulary
(tests on a small machine only; the GPU figures use the release's 384 / 129,280; --experts also caps the DSpark
stages' 128).

--dspark: the release's three DSpark stages `mtp.0..2` (window-only blocks with 128 routed experts, top 3), mtp.0's
main_proj / main_norm and mtp.2's norm, Markov head and confidence head, at release shapes. The release taps layers
37, 38, 39 (its last three); here the last min(3, K) layers, so main_proj reads 3 x 5120 as in the release when
K >= 3 and K x 5120 below (its only shape that differs). ~2.4 GB per stage. Without --dspark the config has
num_nextn_predict_layers=0.

--reuse DIR: shards of an earlier make_real checkpoint that hold exactly the tensors this one would write (same
names, dtypes and shapes, same seed, generated on the same kind of device) are linked (symlinks) instead of written
again: e.g. the DSpark stages beside an existing K-layer checkpoint, for the cost of the stages alone. Each shard's
values depend only on (seed, shard), so a linked shard is what this run would have written.

Values: FP8 weights are N(0,1) rounded to E4M3 with a power-of-two block scale near 1/sqrt(in); packed FP4 experts
are uniform random E2M1 codes with a scale near 1/(3 sqrt(in)); norms 1; embeddings (embed, the Markov head's)
N(0,1); head, gate, hc_fn and the other BF16 projections N(0, 1/in). A GPU, when present, generates the bytes (the
checkpoint is ~8.7 GB per layer).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41 import REPO_ROOT
from dsv41.config import ModelConfig, release_config_dict
from dsv41.model.weights import BF16, E8M0, FP8, I8, expected_tensors

KINDS = ("ratio2", "ratio1", "window")


def real_config(layers: int, experts: int | None = None, vocab: int | None = None, dspark: bool = False) -> dict:
    """The release config cut to `layers` backbone layers (kinds cycle through KINDS), without Engram / vision;
    with the release's DSpark stages tapping the last min(3, layers) layers when `dspark`, else none."""
    if layers < 1:
        raise ValueError("--layers must be at least 1")
    d = release_config_dict()
    d.pop("vision_config", None)
    t = d["text_config"]
    kinds = [KINDS[i % len(KINDS)] for i in range(layers)]
    ratios = [{"ratio2": 2, "ratio1": 1, "window": 0}[k] for k in kinds]
    sources = [i for i, r in enumerate(ratios) if r > 0]
    stages = t["num_nextn_predict_layers"] if dspark else 0
    taps = len(t["dspark_target_layer_ids"])
    t.update(num_hidden_layers=layers, compress_ratios=ratios + [0] * stages, kv_source_layer_ids=sources,
             index_source_layer_ids=sources, engram_layer_ids=[], engram_num_embeddings=[],
             num_nextn_predict_layers=stages,
             dspark_target_layer_ids=list(range(max(0, layers - taps), layers)) if dspark else [])
    ones = [i for i, r in enumerate(ratios) if r == 1]
    t["candidate_source_layer_id"] = ones[0] if ones else (sources[0] if sources else -1)
    if experts:
        t["n_routed_experts"] = experts
        t["num_experts_per_tok"] = min(t["num_experts_per_tok"], experts)
        t["dspark_n_routed_experts"] = min(t["dspark_n_routed_experts"], experts)
        t["dspark_num_experts_per_tok"] = min(t["dspark_num_experts_per_tok"], t["dspark_n_routed_experts"])
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
    elif name == "embed.weight" or name.endswith("markov_head.embed.weight"):   # embeddings
        v = torch.randn(shape, generator=g, device=dev)
    else:                                # head, gate, compressor, indexer, Markov / confidence projections,
                                         # hc_fn: N(0, 1/in)
        v = torch.randn(shape, generator=g, device=dev) / math.sqrt(shape[-1])
    return v.to(torch.bfloat16 if dtype == BF16 else torch.float32)


def _shard_of(name: str) -> str:
    if name.startswith(("layers.", "mtp.")):
        kind, i = name.split(".")[:2]
        return f"{kind}-{int(i):03d}" if kind == "layers" else f"mtp-{int(i)}"
    return "head" if name in ("head.weight", "norm.weight") else "globals"


def _shard_seed(seed: int, shard: str) -> int:
    """Each shard's own generator seed: its values depend on (seed, shard) only, not on the other shards."""
    return (seed * 1_000_003 + zlib.crc32(shard.encode())) % (1 << 63)


def _stamp(seed: int, dev: str, shard: str) -> str:
    return json.dumps({"seed": seed, "generator": torch.device(dev).type, "shard": shard}, sort_keys=True)


def _reusable(src: Path, names: list[str], inv: dict, stamp: str) -> bool:
    """Whether shard file `src` (of an earlier make_real) holds exactly `names` with inv's dtypes and shapes, made
    with the same stamp (seed, generator device, shard)."""
    if not src.is_file():
        return False
    try:
        with safe_open(src, framework="pt") as f:
            if (f.metadata() or {}).get("dsv41_make_real") != stamp or set(f.keys()) != set(names):
                return False
            for n in names:
                sl = f.get_slice(n)
                if sl.get_dtype() != inv[n].dtype or tuple(sl.get_shape()) != inv[n].shape:
                    return False
    except Exception:  # noqa: BLE001 - an unreadable file is simply not reused
        return False
    return True


def make(out: Path, layers: int, seed: int = 0, experts: int | None = None, vocab: int | None = None,
         tokenizer: Path | None = None, dspark: bool = False, reuse: Path | None = None) -> Path:
    """Write the checkpoint into `out`; returns `out`. `reuse`: link the matching shards of that checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)   # written last: an interrupted run leaves no config behind
    d = real_config(layers, experts, vocab, dspark)
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
    shards: dict[str, list[str]] = {}
    for name in inv:
        shards.setdefault(_shard_of(name), []).append(name)
    weight_map = {}
    linked = []
    for shard, names in shards.items():
        fname = f"model-{shard}.safetensors"
        dst = out / fname
        weight_map.update({n: fname for n in names})
        stamp = _stamp(seed, dev, shard)
        if reuse is not None and _reusable(Path(reuse) / fname, names, inv, stamp):
            src = (Path(reuse) / fname).resolve()
            if src != dst.resolve():
                if dst.is_symlink() or dst.exists():
                    dst.unlink()
                os.symlink(src, dst)
            linked.append(fname)
            continue
        g = torch.Generator(device=dev).manual_seed(_shard_seed(seed, shard))
        scales: dict[str, int] = {}
        # weights before their scales (the scale's exponent is decided with the weight)
        names = sorted(names, key=lambda n: n.endswith(".scale"))
        tensors = {}
        for n in names:
            spec = inv[n]
            tensors[n] = _tensor(n, spec.dtype, spec.shape, g, dev, scales).cpu()
        if dst.is_symlink():             # never write through a link into the checkpoint it came from
            dst.unlink()
        save_file(tensors, str(dst), metadata={"format": "pt", "dsv41_make_real": stamp})
        del tensors
    if linked:
        print(f"make_real: linked {len(linked)} shard(s) of {reuse}: {', '.join(linked)}", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(d, indent=1))      # last: its presence means a whole checkpoint
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.tools.make_real", description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, required=True, help="backbone layers K (kinds cycle ratio2, ratio1, window)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, help="routed experts per layer (default: the release's 384)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the release's 129,280)")
    ap.add_argument("--dspark", action="store_true",
                    help="also write the release's 3 DSpark stages and draft head (taps: the last min(3, K) layers)")
    ap.add_argument("--reuse", metavar="DIR",
                    help="link the shards of this earlier make_real checkpoint that match (same tensors and seed)")
    a = ap.parse_args(argv)
    try:
        make(Path(a.out), a.layers, a.seed, a.experts, a.vocab, dspark=a.dspark,
             reuse=Path(a.reuse) if a.reuse else None)
    except ValueError as e:
        print(f"make_real: {e}", file=sys.stderr)
        return 2
    print(f"make_real: wrote {a.layers} layers{' + 3 DSpark stages' if a.dspark else ''} to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
