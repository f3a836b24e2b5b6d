"""Rank shares at the release's shapes for 1, 2, 4 and 8 ranks (weights.RankShare / SplitPlan / share_parts).

The release checkpoint (~160 GB, and ~100 GB per Engram table) cannot be here, so the shares are computed from the
release inventory's metadata (weights.expected_tensors of the release config: every name, dtype and shape, vision
and DSpark stages included), through the same `share_parts` the loader reads with; one layer's split FP8 tensors at
release shapes are also written and read back slice by slice through the loader's own reads.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41.config import ModelConfig, release_config_dict
from dsv41.model import quant
from dsv41.model import weights as wt
from dsv41.model.weights import RankShare, SplitPlan, expected_tensors, share_parts

CFG = ModelConfig.from_dict(release_config_dict())
INV = expected_tensors(CFG, vision=True)
SIZE = {wt.BF16: 2, wt.F32: 4, wt.FP8: 1, wt.E8M0: 1, wt.I8: 1}


def _nbytes(shape, dtype, part=None) -> int:
    n = SIZE[dtype]
    for d, s in enumerate(shape):
        n *= (part[2] - part[1]) if part is not None and part[0] == d else s
    return n


def test_release_plan_cuts_every_family_up_to_eight_ranks():
    t = CFG.text
    for parts in (1, 2, 4, 8):
        assert SplitPlan.of(t, parts).whole() == [], parts
    # 16 ranks would leave half an o_group per rank: the attention stays whole there (the shared expert's 2304 =
    # 16 x 144 is not whole 32-blocks either); the vocabulary still cuts
    assert SplitPlan.of(t, 16).whole() == ["heads", "shared"]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_release_shares_tile_every_tensor_without_cutting_a_block(world):
    t = CFG.text
    shares = [share_parts(INV, RankShare(r, world).planned(t), CFG) for r in range(world)]
    split = 0
    for name, spec in INV.items():
        if spec.fmt == "engram":
            assert all(name not in s for s in shares)            # read through EngramStore, never loaded
            continue
        holders = [r for r, s in enumerate(shares) if name in s]
        m = wt._EXPERT.search(name)
        if m is not None:                                        # routed experts: whole, on exactly one rank
            n_exp = t.dspark_n_routed_experts if name.startswith("mtp.") else t.n_routed_experts
            assert holders == [int(m.group(1)) * world // n_exp], name
            assert shares[holders[0]][name] is None
            continue
        assert holders == list(range(world)), name
        parts = [s[name] for s in shares]
        fam = wt.split_family(name)
        if fam is None:
            assert parts == [None] * world, name                 # replicated: whole on every rank
            continue
        split += 1
        dim = fam[1]
        n = spec.shape[dim]
        assert [p[0] for p in parts] == [dim] * world
        assert parts[0][1] == 0 and parts[-1][2] == n and all(a[2] == b[1] for a, b in zip(parts, parts[1:])), name
        assert len({p[2] - p[1] for p in parts}) == 1, name      # equal shares
        if spec.fmt == "fp8":
            assert all(p[1] % 32 == 0 and p[2] % 32 == 0 for p in parts), f"{name} cuts a 32x32 block"
            scale = name[: -len(".weight")] + ".scale"
            assert [s[scale] for s in shares] == [(dim, p[1] // 32, p[2] // 32) for p in parts]
        if name.endswith("attn.wq_b.weight"):                   # whole heads: 64 / world heads of 512 rows
            assert parts[1][2] - parts[1][1] == 64 // world * t.head_dim
        if name.endswith("attn.wo_a.weight"):                   # whole o_groups
            assert (parts[1][2] - parts[1][1]) % t.o_lora_rank == 0
    # per layer and stage: wq_b, wo_a, wo_b and the shared expert's w1, w2, w3 with their scales, and attn_sink;
    # then the head
    assert split == 13 * (t.num_hidden_layers + t.num_nextn_predict_layers) + 1
    # what a rank reads: the replicated tensors plus 1/world of everything split and of the experts
    total = sum(_nbytes(s.shape, s.dtype) for s in INV.values() if s.fmt != "engram")
    per_rank = [sum(_nbytes(INV[n].shape, INV[n].dtype, p) for n, p in s.items()) for s in shares]
    whole = sum(_nbytes(s.shape, s.dtype) for n, s in INV.items()
                if s.fmt != "engram" and wt.split_family(n) is None and not wt._EXPERT.search(n))
    assert len(set(per_rank)) == 1
    assert per_rank[0] - whole == pytest.approx((total - whole) / world, rel=1e-9)


def test_tiny_shapes_keep_what_cannot_be_cut_whole():
    """The built-in checkpoint's shapes (make_tiny: 4 heads in 2 o_groups, a 64-wide shared expert) at 4 and 8
    ranks: the attention is whole on every rank (2 o_groups), the shared expert on rank 0 only (two 32-blocks), the
    rest split."""
    from dsv41.tools.make_tiny import tiny_config_dict
    cfg = ModelConfig.from_dict(tiny_config_dict(layers=7, hidden=256, vocab=129280, compressed_vocab=1000,
                                                 image_token_id=129264, noise_token_id=128799, bos=0, eos=1,
                                                 pad=2))
    inv = expected_tensors(cfg)
    assert SplitPlan.of(cfg.text, 2).whole() == []
    for world in (4, 8):
        assert SplitPlan.of(cfg.text, world).whole() == ["heads", "shared"]
        shares = [share_parts(inv, RankShare(r, world).planned(cfg.text), cfg) for r in range(world)]
        for r, s in enumerate(shares):
            assert s["layers.0.attn.wq_b.weight"] is None and s["layers.0.attn.wo_b.weight"] is None
            assert ("layers.0.ffn.shared_experts.w2.weight" in s) == (r == 0)
            assert s["head.weight"] == (0, r * 129280 // world, (r + 1) * 129280 // world)


def test_tp_parts_needs_nested_powers():
    assert [wt.tp_parts(w, 2) for w in (1, 2, 4, 8)] == [2, 2, 4, 8]
    assert wt.tp_parts(2, 8) == 8 and wt.tp_parts(8, 1) == 8
    with pytest.raises(ValueError):
        wt.tp_parts(3, 2)


def test_release_shaped_fp8_slices_read_back_as_the_whole(tmp_path):
    """One layer's split FP8 tensors at release shapes (wq_b rows, wo_a rows, wo_b columns, the shared expert's
    rows and columns), written with random E4M3 values and block scales, read slice by slice through the loader's
    _load_one for 8 ranks: the slices put back together are the whole dequantised tensor, bit for bit."""
    t = CFG.text
    g = torch.Generator().manual_seed(0)
    names = ["layers.3.attn.wq_b", "layers.3.attn.wo_a", "layers.3.attn.wo_b", "layers.3.ffn.shared_experts.w1",
             "layers.3.ffn.shared_experts.w2"]
    tensors = {}
    for n in names:
        rows, cols = INV[f"{n}.weight"].shape
        tensors[f"{n}.weight"] = (torch.randn(rows, cols, generator=g) * 4).to(torch.float8_e4m3fn)
        tensors[f"{n}.scale"] = torch.randint(120, 134, INV[f"{n}.scale"].shape, generator=g,
                                              dtype=torch.uint8).view(torch.float8_e8m0fnu)
    path = tmp_path / "layer.safetensors"
    save_file(tensors, str(path))
    wm = {k: path.name for k in tensors}
    world = 8
    shares = [share_parts({k: INV[k] for k in tensors}, RankShare(r, world).planned(t), CFG) for r in range(world)]
    with safe_open(path, framework="pt") as f:
        for n in names:
            w = f"{n}.weight"
            whole = quant.dequant_fp8(tensors[w], tensors[f"{n}.scale"])
            got = [wt._load_one(f, wm, tmp_path, w, INV[w], s[w], torch.float32) for s in shares]
            dim = shares[0][w][0]
            assert torch.equal(torch.cat(got, dim=dim), whole), n
