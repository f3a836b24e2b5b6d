"""Write a small random DeepSeek-V4.1 checkpoint in the official format.

    python -m dsv41.tools.make_tiny --out DIR --seed N [--layers N] [--vocab tokenizer|N] [--tokenizer DIR]
                                    [--hidden N] [--vision]

Real tensor names, dtypes and scale rules (FP8 E4M3 + E8M0 32x32 blocks, packed FP4 experts, Engram tables as
E4M3 rows + E8M0), the composite config.json, model.safetensors.index.json and shards laid out like the release
(globals first, one shard per layer, head+norm, one per DSpark stage, [vision], the Engram layers' tensors alone in
the last shards like model-00047/48). Every layer role is present: window-only, Engram, ratio-2 KV source and reuse,
ratio-1 KV source + candidate source, re-index, reuse, DSpark taps and mtp.0..2 with the draft head.

With a tokenizer (default: the bundled V4.1 tokenizer in kit/tokenizer) the vocabulary, special ids and Engram
compressed vocabulary come from it (129280 ids, image 129264, noise 128799, 99,092 classes) and tokenizer.json /
tokenizer_config.json are copied into DIR. `--vocab N` instead writes a small synthetic word-level tokenizer.

Weights are scaled like tiny-a's (shared/vectors/model/tiny-a): linear layers std 1/sqrt(in), norms 1 +- 0.1,
embed std 1, head std 2/sqrt(hidden); the shared expert and every fourth routed expert are larger so the SwiGLU
clamps engage. Output is a pure function of the arguments (each tensor has its own seeded generator).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv41 import BUILTIN_TOKENIZER_DIR
from dsv41.config import ModelConfig, release_config_dict
from dsv41.model import quant as Q
from dsv41.model.engram_hash import build_token_map, engram_primes
from dsv41.model.weights import TensorSpec, expected_tensors

# Bumped whenever the output for the same arguments changes (the server caches its built-in checkpoint by it).
VERSION = "2"   # 2: the built-in checkpoint carries the vision tower (make_tiny --vision)
MIN_LAYERS = 7  # 2 window-only + ratio-2 source/reuse + ratio-1 source, re-index, reuse


# ---------------------------------------------------------------------------------------------------------- config

def layer_layout(n: int) -> dict:
    """compress ratios and source/index/Engram/DSpark layer ids for n backbone layers (n >= 7), shaped like the
    release: two window-only layers, a ratio-2 half with sources every other layer, a ratio-1 half whose first
    layer is the KV + candidate source followed by re-index layers every other layer."""
    if n < MIN_LAYERS:
        raise ValueError(f"--layers must be >= {MIN_LAYERS} to hold every layer role")
    rest = n - 2
    n2 = rest // 2
    cand = 2 + n2
    src2 = list(range(2, cand, 2))
    reindex = list(range(cand + 2, n, 2))
    return {
        "compress_ratios": [0, 0] + [2] * n2 + [1] * (n - cand),
        "kv_source_layer_ids": src2 + [cand],
        "index_source_layer_ids": src2 + [cand] + reindex,
        "candidate_source_layer_id": cand,
        "engram_layer_ids": [1, src2[-1] if len(src2) > 1 else 3],
        "dspark_target_layer_ids": [n - 3, n - 2, n - 1],
    }


def tiny_config_dict(*, layers: int, hidden: int, vocab: int, compressed_vocab: int, image_token_id: int,
                     noise_token_id: int, bos: int, eos: int, pad: int) -> dict:
    d = release_config_dict()
    lay = layer_layout(layers)
    engram_vocab = 1000
    t = d["text_config"]
    t.update(
        vocab_size=vocab, hidden_size=hidden, moe_intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, head_dim=128, q_lora_rank=64, o_lora_rank=64, o_groups=2, n_routed_experts=16,
        num_experts_per_tok=4, sliding_window=8, index_n_heads=8, index_head_dim=128, index_topk=6,
        candidate_topk_blocks=3, candidate_block_size=4, engram_vocab_size=engram_vocab, engram_n_heads=4,
        engram_head_dim=64, engram_pad_token_id=pad, engram_compressed_vocab_size=compressed_vocab,
        dspark_noise_token_id=noise_token_id, dspark_markov_rank=32, dspark_n_routed_experts=8,
        dspark_num_experts_per_tok=2, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        compress_ratios=lay["compress_ratios"] + [0, 0, 0], **{k: v for k, v in lay.items() if k != "compress_ratios"},
    )
    d.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, image_token_id=image_token_id)
    # table rows = the sum of each layer's bucket primes, which depend only on the sizes set above
    probe = ModelConfig.from_dict({**d, "text_config": {**t, "engram_num_embeddings": [10 ** 9] * 2}}).text
    t["engram_num_embeddings"] = [int(p.sum()) for p in engram_primes(probe)]
    # The vision_config is always present (the composite config, as tiny-a); its tensors only with --vision.
    d["vision_config"].update(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96)
    return d


# ---------------------------------------------------------------------------------------------------------- tokenizer

_SPECIAL = {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "pad": "<｜▁pad▁｜>",
            "noise": "<｜System｜>", "image": "<｜deepseek_image｜>"}


def _tokenizer_ids(tok_json: Path) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_json))
    ids = {}
    for k, s in _SPECIAL.items():
        i = tok.token_to_id(s)
        if i is None:
            raise SystemExit(f"make_tiny: the tokenizer has no {s!r} token")
        ids[k] = i
    ids["vocab"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


def write_synthetic_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` ids with the V4.1 special-token names at tiny-a's positions (BOS 0, EOS 1,
    pad 2, <｜System｜> vocab-6, image vocab-1). Word i and i+1 differ only in case, so Engram classes merge."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if vocab < 64:
        raise SystemExit("make_tiny: --vocab must be >= 64")
    words = {}
    special = {0: _SPECIAL["bos"], 1: _SPECIAL["eos"], 2: _SPECIAL["pad"], vocab - 6: _SPECIAL["noise"],
               vocab - 1: _SPECIAL["image"], 3: " ", 4: "\n"}
    for i in range(vocab):
        if i in special:
            words[special[i]] = i
        else:
            stem = "".join(chr(97 + (i // 2 // 26 ** k) % 26) for k in range(3))
            words[stem.upper() if i % 2 else stem] = i
    tok = Tokenizer(models.WordLevel(words, unk_token=_SPECIAL["pad"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([_SPECIAL["bos"], _SPECIAL["eos"], _SPECIAL["pad"]])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": _SPECIAL["bos"], "eos_token": _SPECIAL["eos"], "pad_token": _SPECIAL["pad"],
        "model_max_length": 1048576, "tokenizer_class": "PreTrainedTokenizerFast"}, ensure_ascii=False, indent=1))


# ---------------------------------------------------------------------------------------------------------- weights

def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFFFFFFFFFF)


def _std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of a weight matrix (see module doc)."""
    fan_in = shape[-1]
    base = 1.0 / math.sqrt(fan_in)
    if name in ("head.weight",) or name.endswith("compressor.wgate.weight"):
        return 2 * base
    if re.search(r"shared_experts\.w[13]\.", name):
        return 5 * base
    if re.search(r"shared_experts\.w2\.", name):
        return 0.1 * base
    m = re.search(r"experts\.(\d+)\.w([123])\.", name)
    if m and int(m.group(1)) % 4 == 0:
        return 3 * base if m.group(2) in "13" else 0.5 * base
    return base


# --draft-agrees: a checkpoint whose DSpark head agrees with the target (speculative decoding tests, docs/drafts.md).
# Every layer's and stage's output projection is scaled down (x 1e-3) so the final hidden stays close to the current
# token's embedding; AGREE_CYCLE tokens get orthonormal embeddings u_k and head[c_{k+1}] = 2 u_k (every other head
# row x 1e-3), so after its first reply token the target's greedy continuation runs round the cycle; the Markov head
# maps c_k to c_{k+1} (orthonormal rank-space codes, logit 100) so every draft position predicts the cycle too, and
# the confidence head gives those drafts the logit 4.
AGREE_CYCLE = list(range(1000, 1016))
_AGREE_OUTPUTS = re.compile(r"(attn\.wo_b|experts\.\d+\.w2|shared_experts\.w2|engram\.wkv)\.weight$")


def _agree_codes(seed: int, dim: int) -> torch.Tensor:
    """Orthonormal unit vectors [len(AGREE_CYCLE), dim], one per cycle token."""
    q, _ = torch.linalg.qr(torch.randn(dim, len(AGREE_CYCLE), generator=_gen(seed, f"agree.{dim}")))
    return q.T.contiguous()


def _agreeing(name: str, x: torch.Tensor, seed: int, rank: int) -> torch.Tensor:
    """--draft-agrees: the embedding, head, Markov and confidence tensors of the agreeing checkpoint."""
    nxt = AGREE_CYCLE[1:] + AGREE_CYCLE[:1]
    if name == "embed.weight":
        x[AGREE_CYCLE] = _agree_codes(seed, x.shape[1]) * math.sqrt(x.shape[1])
    elif name == "head.weight":
        x = x * 1e-3
        x[nxt] = 2.0 * _agree_codes(seed, x.shape[1])
    elif name.endswith("markov_head.embed.weight"):
        x[AGREE_CYCLE] = 10.0 * _agree_codes(seed, rank)
    elif name.endswith("markov_head.head.weight"):
        x = torch.zeros_like(x)
        x[nxt] = 10.0 * _agree_codes(seed, rank)
    elif name.endswith("confidence_head.proj.weight"):
        x = torch.zeros_like(x)
        x[0, -rank:] = _agree_codes(seed, rank).sum(0) * 0.4
    return x


def make_tensor(name: str, spec: TensorSpec, cfg: ModelConfig, seed: int, agree: bool = False
                ) -> dict[str, torch.Tensor]:
    """The tensor `name` (and its .scale when quantised), drawn from its own generator (`agree`: --draft-agrees)."""
    g = _gen(seed, name)
    shape = spec.shape
    damp = 1e-3 if agree and _AGREE_OUTPUTS.search(name) else 1.0
    if spec.fmt == "fp8":
        q, s = Q.quant_fp8(torch.randn(shape, generator=g) * _std(name, shape) * damp)
        return {name: q, name[:-len(".weight")] + ".scale": s}
    if spec.fmt == "fp4":
        full = (shape[0], shape[1] * 2)
        q, s = Q.quant_fp4(torch.randn(full, generator=g) * _std(name, full) * damp)
        return {name: q, name[:-len(".weight")] + ".scale": s}
    if spec.fmt == "engram":
        if name.endswith(".scale"):
            return {}
        rows = torch.randn(shape, generator=g) * (0.5 + torch.rand(shape[0], 1, generator=g))
        q, s = Q.quant_fp8_rows(rows)
        return {name: q, name[:-len(".weight")] + ".scale": s}
    if spec.fmt == "scale":
        return {}
    dtype = torch.float32 if spec.dtype == "F32" else torch.bfloat16
    leaf = name.rsplit(".", 1)[-1] if "." in name else name
    if re.search(r"norm\d?\.weight$", name):
        x = 1 + 0.1 * torch.randn(shape, generator=g)
    elif name.endswith(("engram.q_weight", "engram.k_weight")):
        x = 1 + 0.3 * torch.randn(shape, generator=g)
    elif name.endswith("attn_sink") or name in ("embed.weight", "image_start", "image_newline", "image_end") \
            or name.endswith("markov_head.embed.weight"):
        x = torch.randn(shape, generator=g)
    elif re.search(r"hc_\w+_base$", name):
        x = 0.5 * torch.randn(shape, generator=g)
    elif re.search(r"hc_\w+_scale$", name):
        x = 1 + 0.3 * torch.randn(shape, generator=g)
    elif name.endswith(("gate.bias", "gate.bias_vl")):
        x = 0.3 * torch.randn(shape, generator=g)
    elif leaf == "bias":
        x = 0.02 * torch.randn(shape, generator=g)
    else:
        x = torch.randn(shape, generator=g) * _std(name, shape) * damp
    if agree:
        x = _agreeing(name, x, seed, cfg.text.dspark_markov_rank)
    return {name: x.to(dtype)}


def shard_plan(names: list[str], cfg: ModelConfig) -> list[list[str]]:
    """Group tensor names into shards in release order."""
    t = cfg.text
    groups: dict[str, list[str]] = {}

    def key(n: str) -> str:
        m = re.match(r"layers\.(\d+)\.engram\.", n)
        if m:
            return f"9engram.{int(m.group(1)):04d}"
        m = re.match(r"layers\.(\d+)\.", n)
        if m:
            return f"1layer.{int(m.group(1)):04d}"
        m = re.match(r"mtp\.(\d+)\.", n)
        if m:
            return f"3mtp.{int(m.group(1)):04d}"
        if n in ("head.weight", "norm.weight"):
            return "2head"
        if n.startswith(("vision.", "aligner.")):
            return "4vision"
        return "0globals"

    for n in names:
        groups.setdefault(key(n), []).append(n)
    assert len([k for k in groups if k.startswith("9engram")]) == len(t.engram_layer_ids)
    return [sorted(groups[k]) for k in sorted(groups)]


def write_checkpoint(out: Path, cfg_dict: dict, seed: int, vision: bool, engram_out: Path | None = None,
                     agree: bool = False) -> ModelConfig:
    cfg = ModelConfig.from_dict(cfg_dict)
    inv = expected_tensors(cfg, vision=vision)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, ensure_ascii=False) + "\n")
    shards = shard_plan(list(inv), cfg)
    weight_map, total = {}, 0
    for i, names in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for n in names:
            tensors.update(make_tensor(n, inv[n], cfg, seed, agree))
        assert set(tensors) == set(names), set(names) ^ set(tensors)
        if engram_out is not None:   # the tables alone, in same-named shard files of their own folder (no index)
            tables = {n: tensors.pop(n) for n in list(tensors) if ".engram.embed." in n}
            if tables:
                engram_out.mkdir(parents=True, exist_ok=True)
                save_file(tables, str(engram_out / fname), metadata={"format": "pt"})
                (engram_out / fname).chmod(0o644)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # safetensors writes 0600; the checkpoint is shared read-only data
        for n, x in tensors.items():
            weight_map[n] = fname
            total += x.numel() * x.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.tools.make_tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=10, help=f"backbone layers (>= {MIN_LAYERS}; default 10)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (multiple of 32; default 128)")
    ap.add_argument("--vocab", default="tokenizer",
                    help="'tokenizer' (vocabulary of --tokenizer) or N (synthetic word-level tokenizer of N ids)")
    ap.add_argument("--tokenizer", type=Path, default=BUILTIN_TOKENIZER_DIR,
                    help="tokenizer dir with tokenizer.json (default: the bundled V4.1 tokenizer)")
    ap.add_argument("--vision", action="store_true", help="include the vision tower and aligner tensors")
    ap.add_argument("--format", choices=("official", "exl3"), default="official",
                    help="official (FP8/FP4 release format) or exl3 (an EXL3 pack as the reference recipe serves it, "
                         "random trellis codes; Engram tables in DIR/engram or --engram-out; docs/exl3.md)")
    ap.add_argument("--draft-agrees", action="store_true",
                    help="weights whose DSpark draft head agrees with the target (its greedy continuation runs round "
                         "a cycle of 16 tokens that the head predicts): speculative decoding tests (docs/drafts.md)")
    ap.add_argument("--engram-out", type=Path, default=None,
                    help="write the Engram tables (layers.N.engram.embed.weight/.scale) into this folder instead, as "
                         "real-format shard files without an index (serve with --engram DIR)")
    a = ap.parse_args(argv)
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    if a.vocab == "tokenizer":
        src = a.tokenizer / "tokenizer.json" if a.tokenizer.is_dir() else a.tokenizer
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (src.parent / f).is_file() and (src.parent / f).resolve() != (out / f).resolve():
                shutil.copyfile(src.parent / f, out / f)
    else:
        try:
            n = int(a.vocab)
        except ValueError:
            ap.error("--vocab must be 'tokenizer' or an integer")
        write_synthetic_tokenizer(out, n)
    ids = _tokenizer_ids(out / "tokenizer.json")
    token_map = build_token_map(out / "tokenizer.json")
    cfg_dict = tiny_config_dict(
        layers=a.layers, hidden=a.hidden, vocab=ids["vocab"], compressed_vocab=int(token_map.max()) + 1,
        image_token_id=ids["image"], noise_token_id=ids["noise"], bos=ids["bos"], eos=ids["eos"], pad=ids["pad"])
    if a.format == "exl3":
        from dsv41.tools.make_tiny_exl3 import write_exl3_pack
        cfg = write_exl3_pack(out, cfg_dict, a.seed, a.vision, a.engram_out or out / "engram")
    else:
        cfg = write_checkpoint(out, cfg_dict, a.seed, a.vision, a.engram_out, a.draft_agrees)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"{out}: {cfg.text.num_hidden_layers} layers + {cfg.text.num_nextn_predict_layers} DSpark, hidden "
          f"{cfg.text.hidden_size}, vocab {cfg.text.vocab_size}, Engram classes "
          f"{cfg.text.engram_compressed_vocab_size}, {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
