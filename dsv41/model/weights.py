"""Checkpoint -> tensors, for the official DeepSeek-V4.1 release format (arch.md §4).

One inventory, `expected_tensors(cfg)`, says which tensors a config implies, with their on-disk dtype and shape; the
loader checks the checkpoint against it and make_tiny writes exactly it. Tensors are read one at a time through
safetensors' `safe_open` (never a whole shard), only those the rank's share needs, and FP8 / packed FP4 weights are
dequantised to the requested dtype with their `.scale` consumed (the returned dict has no `.scale` names).

Engram tables (`layers.N.engram.embed.*`, ~100 GB each in the release) are checked here but not loaded: read their
rows through `dsv41.model.engram_store.EngramStore`.

EXL3 packs (config `quant_method: exl3`, docs/exl3.md) are the second format: `load_weights` hands them to
`exl3_load.load_exl3_weights`, which has its own inventory (`.trellis/.suh/.svh/...` per linear) and returns the
same names.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dsv41.config import ModelConfig
from dsv41.model import device as dev
from dsv41.model import quant

BF16, F32, FP8, E8M0, I8 = "BF16", "F32", "F8_E4M3", "F8_E8M0", "I8"


class WeightError(ValueError):
    """A checkpoint that does not match its config: `name` is the tensor (or file) at fault."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(f"{name}: {message}")


@dataclass(frozen=True)
class TensorSpec:
    dtype: str                 # safetensors dtype string as stored
    shape: tuple[int, ...]
    fmt: str = "plain"         # plain | fp8 (has .scale, 32x32 blocks) | fp4 (packed, has .scale) | scale | engram
    alt_dtypes: tuple[str, ...] = ()  # also accepted (vision norms: BF16 or F32)


# ---------------------------------------------------------------------------------------------------------------
# The inventory

def _fp8(out: dict, name: str, rows: int, cols: int) -> None:
    out[f"{name}.weight"] = TensorSpec(FP8, (rows, cols), "fp8")
    out[f"{name}.scale"] = TensorSpec(E8M0, ((rows + 31) // 32, cols // 32), "scale")


def _fp4(out: dict, name: str, rows: int, cols: int) -> None:
    out[f"{name}.weight"] = TensorSpec(I8, (rows, cols // 2), "fp4")
    out[f"{name}.scale"] = TensorSpec(E8M0, (rows, cols // 32), "scale")


def _block(out: dict, p: str, cfg: ModelConfig, layer: int | None, n_experts: int) -> None:
    """The tensors every block has (backbone layer or DSpark stage) under prefix p."""
    t = cfg.text
    H, hc = t.hidden_size, t.hc_mult
    heads, hd = t.num_attention_heads, t.head_dim
    n_mix = (2 + hc) * hc
    out[f"{p}.attn_norm.weight"] = TensorSpec(BF16, (H,))
    out[f"{p}.ffn_norm.weight"] = TensorSpec(BF16, (H,))
    for site in ("attn", "ffn"):
        out[f"{p}.hc_{site}_fn"] = TensorSpec(F32, (n_mix, hc * H))
        out[f"{p}.hc_{site}_base"] = TensorSpec(F32, (n_mix,))
        out[f"{p}.hc_{site}_scale"] = TensorSpec(F32, (3,))
    _fp8(out, f"{p}.attn.wq_a", t.q_lora_rank, H)
    out[f"{p}.attn.q_norm.weight"] = TensorSpec(BF16, (t.q_lora_rank,))
    _fp8(out, f"{p}.attn.wq_b", heads * hd, t.q_lora_rank)
    _fp8(out, f"{p}.attn.wkv", hd, H)
    out[f"{p}.attn.kv_norm.weight"] = TensorSpec(BF16, (hd,))
    out[f"{p}.attn.attn_sink"] = TensorSpec(F32, (heads,))
    _fp8(out, f"{p}.attn.wo_a", t.o_groups * t.o_lora_rank, heads * hd // t.o_groups)
    _fp8(out, f"{p}.attn.wo_b", H, t.o_groups * t.o_lora_rank)
    if layer is not None:
        ratio = t.compress_ratios[layer]
        if layer in t.kv_source_layer_ids:
            out[f"{p}.attn.compressor.wkv.weight"] = TensorSpec(BF16, (hd, H))
            if ratio > 1:  # the gate pools a group; ratio 1 has nothing to pool
                out[f"{p}.attn.compressor.wgate.weight"] = TensorSpec(BF16, (hd, H))
            out[f"{p}.attn.compressor.norm.weight"] = TensorSpec(BF16, (hd,))
        if layer in t.index_source_layer_ids:
            _fp8(out, f"{p}.attn.indexer.wq_b", t.index_n_heads * t.index_head_dim, t.q_lora_rank)
            out[f"{p}.attn.indexer.weights_proj.weight"] = TensorSpec(BF16, (t.index_n_heads, H))
            if layer in t.kv_source_layer_ids:  # key owners project the compressor latent
                out[f"{p}.attn.indexer.wk.weight"] = TensorSpec(BF16, (t.index_head_dim, hd))
                out[f"{p}.attn.indexer.k_norm.weight"] = TensorSpec(BF16, (t.index_head_dim,))
        if layer in t.engram_layer_ids:
            rows = t.engram_num_embeddings[t.engram_layer_ids.index(layer)]
            ehd = t.engram_head_dim
            out[f"{p}.engram.embed.weight"] = TensorSpec(FP8, (rows, ehd), "engram")
            out[f"{p}.engram.embed.scale"] = TensorSpec(E8M0, (rows, ehd // 32), "engram")
            _fp8(out, f"{p}.engram.wkv", (hc + 1) * H, (t.engram_max_ngram_size - 1) * t.engram_n_heads * ehd)
            out[f"{p}.engram.q_weight"] = TensorSpec(BF16, (hc, H))
            out[f"{p}.engram.k_weight"] = TensorSpec(BF16, (hc, H))
    inter = t.moe_intermediate_size
    out[f"{p}.ffn.gate.weight"] = TensorSpec(BF16, (n_experts, H))
    out[f"{p}.ffn.gate.bias"] = TensorSpec(F32, (n_experts,))
    out[f"{p}.ffn.gate.bias_vl"] = TensorSpec(F32, (n_experts,))
    _fp8(out, f"{p}.ffn.shared_experts.w1", inter, H)
    _fp8(out, f"{p}.ffn.shared_experts.w2", H, inter)
    _fp8(out, f"{p}.ffn.shared_experts.w3", inter, H)
    for e in range(n_experts):
        _fp4(out, f"{p}.ffn.experts.{e}.w1", inter, H)
        _fp4(out, f"{p}.ffn.experts.{e}.w2", H, inter)
        _fp4(out, f"{p}.ffn.experts.{e}.w3", inter, H)


def vision_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """The DeepSeek-ViT tower and aligner (arch.md §5), names as in shared/vectors/vision/tiny_vision.safetensors."""
    v, out = cfg.vision, {}
    if v is None:
        return out
    D, H, inter = v.hidden_size, cfg.text.hidden_size, v.intermediate_size
    norm = dict(alt_dtypes=(F32,))
    out["vision.patch_embed.proj.weight"] = TensorSpec(BF16, (D, 3 * v.patch_size ** 2))
    out["vision.patch_embed.proj.bias"] = TensorSpec(BF16, (D,))
    for b in range(v.num_hidden_layers):
        p = f"vision.blocks.{b}"
        out[f"{p}.norm1.weight"] = TensorSpec(BF16, (D,), **norm)
        out[f"{p}.attn.wqkv.weight"] = TensorSpec(BF16, (3 * D, D))
        out[f"{p}.attn.wqkv.bias"] = TensorSpec(BF16, (3 * D,))
        out[f"{p}.attn.wo.weight"] = TensorSpec(BF16, (D, D))
        out[f"{p}.attn.wo.bias"] = TensorSpec(BF16, (D,))
        out[f"{p}.norm2.weight"] = TensorSpec(BF16, (D,), **norm)
        out[f"{p}.mlp.w1.weight"] = TensorSpec(BF16, (2 * inter, D))  # gate and up halves
        out[f"{p}.mlp.w2.weight"] = TensorSpec(BF16, (D, inter))
    out["vision.norm.weight"] = TensorSpec(BF16, (D,), **norm)
    out["aligner.w1.weight"] = TensorSpec(BF16, (H, D * v.downsample_ratio ** 2))
    out["aligner.w1.bias"] = TensorSpec(BF16, (H,))
    out["aligner.w2.weight"] = TensorSpec(BF16, (H, H))
    out["aligner.w2.bias"] = TensorSpec(BF16, (H,))
    return out


def expected_tensors(cfg: ModelConfig, vision: bool = False) -> dict[str, TensorSpec]:
    """Every tensor the config implies, in checkpoint names (no `model.` prefix), with stored dtype and shape.
    Vision tensors are included when `vision` is true (tiny-a ships none although its config has a vision_config)."""
    t = cfg.text
    out: dict[str, TensorSpec] = {}
    H, V = t.hidden_size, t.vocab_size
    out["embed.weight"] = TensorSpec(BF16, (V, H))
    for name in ("image_start", "image_newline", "image_end"):
        out[name] = TensorSpec(BF16, (H,))
    for i in range(t.num_hidden_layers):
        _block(out, f"layers.{i}", cfg, i, t.n_routed_experts)
    out["norm.weight"] = TensorSpec(BF16, (H,))
    out["head.weight"] = TensorSpec(BF16, (V, H))
    M = t.num_nextn_predict_layers
    for j in range(M):
        p = f"mtp.{j}"
        _block(out, p, cfg, None, t.dspark_n_routed_experts)
        if j == 0:  # forward_embed: the taps of the target layers -> one hidden
            _fp8(out, f"{p}.main_proj", H, len(t.dspark_target_layer_ids) * H)
            out[f"{p}.main_norm.weight"] = TensorSpec(BF16, (H,))
        if j == M - 1:  # the draft head
            r = t.dspark_markov_rank
            out[f"{p}.norm.weight"] = TensorSpec(BF16, (H,))
            out[f"{p}.markov_head.embed.weight"] = TensorSpec(BF16, (V, r))
            out[f"{p}.markov_head.head.weight"] = TensorSpec(BF16, (V, r))
            out[f"{p}.confidence_head.proj.weight"] = TensorSpec(BF16, (1, H + r))
    if vision:
        out.update(vision_tensors(cfg))
    return out


# ---------------------------------------------------------------------------------------------------------------
# A rank's share

# How tensor parallelism splits the checkpoint. A split product is cut into P parts (P = the world, or --tp-shards
# when that is wider: `parts`); rank r of a world of W holds parts [r P/W, (r+1) P/W) and computes them apart (each
# as the rank holding only that part would) and adds them in part order; the exchange adds the ranks' sums in rank
# order. Each family of tensors is cut only where no part boundary cuts a 32x32 FP8 block (or a head, an o_group,
# an expert); a family that cannot be cut into P parts is not split (`SplitPlan`):
#   family   tensors (per layer / DSpark stage)              cut                      when not cut
#   heads    attn.wq_b, attn.attn_sink | attn.wo_a | wo_b    rows by head | rows by   every rank holds and computes
#                                                            o_group | columns        the whole attention (no exchange)
#   shared   ffn.shared_experts.w1/w3 | w2                   rows | columns of inter  part 0 (rank 0) holds it whole
#   vocab    head.weight                                     rows                     every rank computes all logits
#   experts  ffn.experts.E.*                                 whole experts, contiguous ranges [p E/P, (p+1) E/P)
#   everything else (norms, wq_a, wkv, compressor, indexer, gate, hc_*, embed, engram, mtp extras, vision): whole on
#   every rank.
# The release cuts every family at 1, 2, 4 and 8 parts (tests/test_tp_shares.py); the built-in tiny checkpoint (4
# heads in 2 o_groups, a 64-wide shared expert) keeps its attention and shared expert whole at 4 parts.
# Worlds W and one rank with --tp-shards W give the same bits (docs/tp.md "Exactness"); TP_SHARDS, the default, makes
# one rank and two equal.
TP_SHARDS = 2
BLOCK = 32      # FP8 weights' 32x32 block scales: no part boundary inside a block


def tp_parts(world: int, shards: int = TP_SHARDS) -> int:
    """The parts every split product is cut into for a world of `world` ranks computing in `shards` shards: the
    wider of the two (the narrower one must divide it: both are powers of two)."""
    parts = max(world, shards)
    if parts % world or parts % shards:
        raise ValueError(f"--tp-shards {shards} and --tp {world}: one must divide the other")
    return parts


@dataclass(frozen=True)
class SplitPlan:
    """Which families a cut into `parts` parts splits (True) or keeps whole (False), for one config."""

    parts: int
    heads: bool     # attention: wq_b rows and attn_sink by head, wo_a rows by o_group, wo_b columns
    shared: bool    # the shared expert's intermediate width (w1/w3 rows, w2 columns)
    vocab: bool     # head.weight rows (the logits' columns)

    @classmethod
    def of(cls, t, parts: int) -> SplitPlan:
        """`t`: the TextConfig. A family is cut only where each part is whole heads / o_groups / 32-blocks."""
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        heads, groups = t.num_attention_heads, t.o_groups
        cut_heads = (heads % parts == 0 and groups % parts == 0 and heads // parts * t.head_dim % BLOCK == 0
                     and groups // parts * t.o_lora_rank % BLOCK == 0)
        cut_shared = t.moe_intermediate_size % (parts * BLOCK) == 0
        return cls(parts, cut_heads, cut_shared, t.vocab_size % parts == 0)

    def whole(self) -> list[str]:
        """The families not cut (docs and start-up lines name them)."""
        return [f for f in ("heads", "shared", "vocab") if not getattr(self, f)]


def part_range(n: int, part: int, parts: int) -> range:
    """Part `part` of `parts` of n units (experts): contiguous, sizes differing by at most one."""
    return range(part * n // parts, (part + 1) * n // parts)


_FAMILY = (
    ("heads", 0, re.compile(r"(attn\.wq_b|attn\.wo_a)\.(weight|scale)$|attn\.attn_sink$")),
    ("heads", 1, re.compile(r"attn\.wo_b\.(weight|scale)$")),
    ("shared", 0, re.compile(r"ffn\.shared_experts\.w[13]\.(weight|scale)$")),
    ("shared", 1, re.compile(r"ffn\.shared_experts\.w2\.(weight|scale)$")),
    ("vocab", 0, re.compile(r"^head\.weight$")),
)
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def split_family(name: str) -> tuple[str, int] | None:
    """(family, dim) of a tensor that tensor parallelism cuts, or None for one every rank holds whole."""
    for fam, dim, rx in _FAMILY:
        if rx.search(name):
            return fam, dim
    return None


@dataclass(frozen=True)
class RankShare:
    """Which part of the checkpoint a tensor-parallel rank holds. RankShare(0, 1) is the whole model. `plan` (from
    `planned`) says which families are cut; without one every family is cut over the world (EXL3 packs, benches)."""

    rank: int = 0
    world: int = 1
    plan: SplitPlan | None = None

    def __post_init__(self):
        if not (self.world >= 1 and 0 <= self.rank < self.world):
            raise ValueError(f"RankShare: rank {self.rank} outside world {self.world}")
        if self.plan is not None and self.plan.parts % self.world:
            raise ValueError(f"RankShare: {self.plan.parts} parts do not split over {self.world} ranks")

    def planned(self, t, shards: int = TP_SHARDS) -> RankShare:
        """This share with the plan of config `t` (TextConfig) cut into tp_parts(world, shards) parts."""
        return RankShare(self.rank, self.world, SplitPlan.of(t, tp_parts(self.world, shards)))

    def cut(self, family: str) -> bool:
        return self.plan is None or getattr(self.plan, family)

    def expert_range(self, n_experts: int) -> range:
        """The routed experts this rank holds: a contiguous range of about n_experts / world."""
        return part_range(n_experts, self.rank, self.world)

    def wants(self, name: str, n_experts: int) -> bool:
        m = _EXPERT.search(name)
        if m is not None:
            return int(m.group(1)) in self.expert_range(n_experts)
        fam = split_family(name)
        # a shared expert that is not cut belongs to part 0 alone (its sum is added once, by rank 0)
        return fam is None or fam[0] != "shared" or self.cut("shared") or self.rank == 0

    def split(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the stored tensor this rank reads, or None for the whole tensor.
        Scales split with their weight; stored widths are divided so blocks of 32 stay whole."""
        fam = split_family(name)
        if self.world == 1 or fam is None or not self.cut(fam[0]):
            return None
        dim = fam[1]
        n = shape[dim]
        if n % self.world:
            raise WeightError(name, f"dim {dim} ({n}) does not split over {self.world} ranks")
        per = n // self.world
        return dim, self.rank * per, (self.rank + 1) * per


def share_parts(inv: dict[str, TensorSpec], share: RankShare, cfg: ModelConfig) -> dict[str, tuple | None]:
    """name -> the slice this share reads ((dim, start, stop) or None: whole) of every weight it loads, scales
    beside their weight (in their own units), from the inventory's metadata alone: the shares of the release can be
    checked without its tensors (tests/test_tp_shares.py). Raises WeightError where a cut would split a block."""
    out: dict[str, tuple | None] = {}
    for name, spec in inv.items():
        if spec.fmt in ("scale", "engram"):
            continue
        n_exp = cfg.text.dspark_n_routed_experts if name.startswith("mtp.") else cfg.text.n_routed_experts
        if not share.wants(name, n_exp):
            continue
        part = share.split(name, spec.shape)
        out[name] = part
        if spec.fmt in ("fp8", "fp4"):
            out[name[: -len(".weight")] + ".scale"] = _scale_slice(name[: -len(".weight")] + ".scale", part,
                                                                   spec.fmt)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Loading

def read_weight_map(ckpt: str | Path) -> dict[str, str]:
    """tensor name -> shard file name, from model.safetensors.index.json (or a single model.safetensors)."""
    d = Path(ckpt)
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightError(idx.name, f"unreadable index: {e}") from None
        return dict(wm)
    single = d / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise WeightError(str(d), "no model.safetensors.index.json or model.safetensors")


def _vision_present(weight_map: dict[str, str]) -> bool:
    return any(k.startswith(("vision.", "aligner.")) for k in weight_map)


def check_inventory(weight_map: dict[str, str], cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Names only: every expected tensor present, nothing unknown. Returns the inventory that applies."""
    inv = expected_tensors(cfg, vision=_vision_present(weight_map))
    # The Engram tables may live in another folder (--engram DIR; EngramStore checks them there): absent here is fine.
    inv = {n: s for n, s in inv.items() if s.fmt != "engram" or n in weight_map}
    for name in inv:
        if name not in weight_map:
            raise WeightError(name, "missing from the checkpoint's weight_map")
    for name in weight_map:
        if name not in inv:
            raise WeightError(name, "not expected for this config (a tensor this code would ignore)")
    return inv


def _check_header(f, name: str, spec: TensorSpec) -> None:
    sl = f.get_slice(name)
    dt, shape = sl.get_dtype(), tuple(sl.get_shape())
    if dt != spec.dtype and dt not in spec.alt_dtypes:
        raise WeightError(name, f"dtype {dt}, expected {spec.dtype}")
    if shape != spec.shape:
        raise WeightError(name, f"shape {list(shape)}, expected {list(spec.shape)}")


def _read(f, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    if part is None:
        return f.get_tensor(name)
    dim, a, b = part
    sl = f.get_slice(name)
    # contiguous: a column share comes back as a strided view of the whole rows, which the kernels refuse
    return (sl[a:b] if dim == 0 else sl[:, a:b]).contiguous()


def load_weights(ckpt: str | Path, cfg: ModelConfig, share: RankShare = RankShare(0, 1),
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 keep_quant: bool = False) -> dict[str, torch.Tensor]:
    """Load and dequantise the share's tensors (see module doc). BF16 and FP8/FP4 tensors come back in `dtype`;
    F32 tensors (hc_*, attn_sink, gate bias) stay float32. Engram tables are checked but not returned.
    keep_quant=True (the GPU path): FP8 and packed FP4 weights come back in checkpoint form under `.weight` as
    `device.Fp8Weight` / `device.Fp4Weight` (weight + scale, not dequantised), and the BF16 product weights of
    BF16_KEPT as bf16 tensors."""
    if cfg.quant.quant_method == "exl3":   # an EXL3 pack: its own inventory and decoder (docs/exl3.md)
        from dsv41.model.exl3_load import load_exl3_weights
        return load_exl3_weights(ckpt, cfg, share=share, dtype=dtype, device=device, keep_quant=keep_quant)
    d = Path(ckpt)
    wm = read_weight_map(d)
    inv = check_inventory(wm, cfg)
    by_file: dict[str, list[str]] = {}
    for name in inv:
        by_file.setdefault(wm[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    share = share if share.plan is not None or share.world == 1 else share.planned(cfg.text)
    parts = share_parts(inv, share, cfg)
    for fname, names in by_file.items():
        path = d / fname
        if not path.is_file():
            raise WeightError(names[0], f"its shard {fname} is missing")
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise WeightError(name, f"listed in the index under {fname} but not in that file")
                _check_header(f, name, inv[name])
            for name in names:
                spec = inv[name]
                if name not in parts or spec.fmt == "scale":
                    continue  # another rank's; scales are read with their weight; Engram rows via the store
                t = _load_one(f, wm, d, name, spec, parts[name], dtype, keep_quant)
                out[name] = t.to(device) if isinstance(t, torch.Tensor) else dev.to_device(t, device)
    return out


# BF16 product weights (and the embedding, read by rows) that keep_quant leaves in bf16: the GPU path multiplies them
# as stored (issue 24: no float32 copies; the head alone is 2.6 GB as float32). The norms' gains and the other small
# BF16 tensors become float32 as before.
BF16_KEPT = ("embed.weight", "head.weight", ".ffn.gate.weight", ".attn.compressor.wkv.weight",
             ".attn.compressor.wgate.weight", ".attn.indexer.weights_proj.weight", ".attn.indexer.wk.weight",
             ".markov_head.head.weight")


def keeps_bf16(name: str) -> bool:
    return name in ("embed.weight", "head.weight") or name.endswith(BF16_KEPT[2:])


def _load_one(f, wm, d: Path, name: str, spec: TensorSpec, part, dtype, keep_quant: bool = False):
    if spec.fmt == "plain":
        t = _read(f, name, part)
        if keep_quant and t.dtype == torch.bfloat16 and keeps_bf16(name):
            return t
        return t if t.dtype == torch.float32 and spec.dtype == F32 else t.to(dtype)
    scale_name = name[: -len(".weight")] + ".scale"
    spart = _scale_slice(scale_name, part, spec.fmt)
    if wm[scale_name] == wm[name]:
        s = _scale_part(f, scale_name, spart)
    else:
        with safe_open(d / wm[scale_name], framework="pt") as g:
            s = _scale_part(g, scale_name, spart)
    w = _read(f, name, part)
    if keep_quant:
        return dev.Fp8Weight(w, s) if spec.fmt == "fp8" else dev.Fp4Weight(w, s)
    if spec.fmt == "fp8":
        return quant.dequant_fp8(w, s, dtype)
    if spec.fmt == "fp4":
        return quant.dequant_fp4(w, s, dtype)
    raise AssertionError(spec.fmt)


def _scale_slice(scale_name: str, part, fmt: str) -> tuple[int, int, int] | None:
    """The scale rows/columns of a weight slice: FP8 scales are per 32x32 block, so a slice must not cut a block."""
    if part is None:
        return None
    dim, a, b = part
    if fmt != "fp8":
        raise WeightError(scale_name, "only FP8 weights split (routed experts are held whole)")
    if a % BLOCK or b % BLOCK:  # FP8 blocks are 32x32: a share boundary must not cut one
        raise WeightError(scale_name, "a share boundary cuts a 32x32 block")
    return dim, a // BLOCK, b // BLOCK


def _scale_part(f, scale_name: str, part) -> torch.Tensor:
    """Read the scale slice `part` (from _scale_slice) of `scale_name`."""
    if part is None:
        return f.get_tensor(scale_name)
    dim, a, b = part
    sl = f.get_slice(scale_name)
    return (sl[a:b] if dim == 0 else sl[:, a:b]).contiguous()
