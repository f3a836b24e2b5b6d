"""EXL3 packs (docs/exl3.md): `make_tiny --format exl3` writes the recipe's layout, the loader turns it into the
same model as its decoded weights (bitwise logits), a malformed pack fails naming the tensor, and the server serves
a pack end to end through the openai client."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv41.config import ModelConfig
from dsv41.model import model as model_module
from dsv41.model.exl3 import (
    MCG_MARKER,
    MUL1_MARKER,
    dequant_exl3,
    exl3_tensors,
    official_name,
)
from dsv41.model.exl3_load import (
    Exl3Linear,
    Exl3Packed,
    _Shards,
    decode_linear,
    pack_inventory,
)
from dsv41.model.model import Model, SeqInput
from dsv41.model.ops import reference_ops
from dsv41.model.weights import (
    WeightError,
    expected_tensors,
    load_weights,
    read_weight_map,
)
from dsv41.tools.make_tiny import main as make_tiny

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("exl3") / "pack"
    assert make_tiny(["--out", str(d), "--format", "exl3", "--vocab", "512", "--seed", "5"]) == 0
    return d


@pytest.fixture(scope="module")
def dense(pack) -> dict[str, torch.Tensor]:
    return load_weights(pack, ModelConfig.from_checkpoint(pack))


@pytest.fixture(scope="module")
def decoded(pack) -> dict[str, torch.Tensor]:
    return _decode_independently(pack, ModelConfig.from_checkpoint(pack))


def _read_all(d: Path) -> dict[str, torch.Tensor]:
    raw = {}
    for fname in sorted(set(read_weight_map(d).values())):
        raw.update(load_file(d / fname))
    return raw


def _decode_independently(d: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor in the pack's files, each `<m>.trellis` decoded with the reference decoder and put where
    exl3.official_name says, everything else as stored, in float32: not through exl3_load."""
    raw = _read_all(d)
    W, slices = {}, {}
    for name, x in raw.items():
        if name.endswith(".trellis"):
            mod = name[: -len(".trellis")]
            off, rows, _ = official_name(mod, cfg.text.o_lora_rank)
            w = dequant_exl3(exl3_tensors(raw, mod)).float().t()
            if rows is None:
                W[off] = w
            else:
                slices.setdefault(off, {})[rows[0]] = w
        elif not re.search(r"\.(suh|svh|su|sv|mcg|mul1)$", name):
            W[name] = x.float()
    for off, parts in slices.items():
        W[off] = torch.cat([parts[k] for k in sorted(parts)], dim=0)
    return W


def test_pack_layout(pack):
    cfg = ModelConfig.from_checkpoint(pack)
    assert cfg.quant.quant_method == "exl3" and cfg.quant.bits == 2.5 and cfg.quant.head_bits == 6
    t = cfg.text
    wm = read_weight_map(pack)
    with safe_open(pack / wm["layers.3.ffn.experts.5.w2.trellis"], framework="pt") as f:
        assert f.get_slice("layers.3.ffn.experts.5.w2.trellis").get_shape() == [t.moe_intermediate_size // 16,
                                                                               t.hidden_size // 16, 40]  # K 2.5
    widths = {}
    for name, fname in wm.items():
        if name.endswith(".trellis"):
            with safe_open(pack / fname, framework="pt") as f:
                widths[name] = f.get_slice(name).get_shape()[-1]
            assert name[: -len("trellis")] + "mul1" in wm
    assert widths["head.trellis"] == 96                                        # 6 bpw
    assert widths["layers.2.attn.indexer.wk.trellis"] == 128                   # 8 bpw
    assert widths["layers.0.attn.wo_a.slice.1.trellis"] == 64                  # attention 4 bpw
    assert widths["layers.1.engram.wkv.trellis"] == 64
    assert widths["mtp.0.ffn.experts.3.w1.trellis"] == 64 and widths["mtp.0.main_proj.trellis"] == 96
    assert all(w == 40 for n, w in widths.items() if n.startswith("layers.") and ".ffn.experts." in n)
    # no official quantised weight left, the 16-bit ones as they are, no Engram table in the pack
    official = expected_tensors(cfg)
    assert not [n for n in wm if n in official and official[n].fmt in ("fp8", "fp4", "scale")]
    assert "layers.0.attn.wo_a.weight" not in wm and "layers.0.ffn.gate.weight" in wm
    assert not [n for n in wm if ".engram.embed." in n]
    assert {p.name for p in (pack / "engram").glob("*.safetensors")}


def test_loaded_weights_are_the_decoded_weights(pack, dense, decoded):
    cfg = ModelConfig.from_checkpoint(pack)
    assert set(dense) == set(decoded)
    for name in decoded:
        assert dense[name].dtype == torch.float32 and torch.equal(dense[name], decoded[name]), name
    t = cfg.text
    assert dense["layers.0.attn.wo_a.weight"].shape == (t.o_groups * t.o_lora_rank,
                                                         t.num_attention_heads * t.head_dim // t.o_groups)
    # a tensor-parallel share is the matching part of the whole
    second = load_weights(pack, cfg, share=_share(1))
    n = t.hidden_size
    assert torch.equal(second["layers.0.attn.wo_b.weight"], dense["layers.0.attn.wo_b.weight"][:, n:])
    assert torch.equal(second["head.weight"], dense["head.weight"][t.vocab_size // 2:])
    assert "layers.0.ffn.experts.15.w1.weight" in second and "layers.0.ffn.experts.0.w1.weight" not in second


def _share(rank):
    from dsv41.model.weights import RankShare
    return RankShare(rank, 2)


def test_model_from_pack_equals_model_from_decoded_weights(pack, decoded, tmp_path, monkeypatch):
    """The decoded float32 weights, written as a plain safetensors file and read back, build (through the same
    Model.load, only its weight loader swapped) the same model as the pack: logits equal bit for bit."""
    m = Model.load(pack, engram=pack / "engram")
    save_file({k: v.contiguous() for k, v in decoded.items()}, str(tmp_path / "decoded.safetensors"))
    W = load_file(tmp_path / "decoded.safetensors")
    monkeypatch.setattr(model_module, "load_weights", lambda *a, **k: dict(W))
    ref = Model.load(pack, engram=pack / "engram")
    ids = torch.tensor([5, 77, 300, 12, 9, 401, 33, 7, 250, 18, 64, 3])
    outs = []
    for model in (m, ref):
        st = model.new_state()
        a = model.forward([SeqInput(state=st, ids=ids, logits="all")])[0]
        b = model.forward([SeqInput(state=st, ids=torch.tensor([42]), logits="all")])[0]
        outs.append(torch.cat([a, b]))
    assert torch.isfinite(outs[0]).all() and outs[0].std() > 0.1
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------- errors

def _variant(pack: Path, tmp: Path, drop=(), add: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of the pack (shards linked) whose index drops `drop` and points `add` at a new shard."""
    d = tmp / "variant"
    d.mkdir()
    for p in pack.iterdir():
        if p.suffix == ".safetensors" or p.name == "tokenizer.json":
            (d / p.name).symlink_to(p)
    shutil.copy(pack / "config.json", d / "config.json")
    idx = json.loads((pack / "model.safetensors.index.json").read_text())
    for n in drop:
        del idx["weight_map"][n]
    if add:
        save_file(add, str(d / "extra.safetensors"))
        idx["weight_map"].update({n: "extra.safetensors" for n in add})
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return d


def _load_error(d: Path) -> WeightError:
    with pytest.raises(WeightError) as ei:
        load_weights(d, ModelConfig.from_checkpoint(d))
    return ei.value


M = "layers.0.attn.wq_a"


def test_missing_parts_name_the_tensor(pack, tmp_path):
    assert _load_error(_variant(pack, tmp_path, drop=[f"{M}.trellis"])).name == f"{M}.trellis"


def test_missing_sign_scales_name_the_tensor(pack, tmp_path):
    assert _load_error(_variant(pack, tmp_path, drop=[f"{M}.svh"])).name == f"{M}.svh"


def test_missing_16bit_tensor(pack, tmp_path):
    assert _load_error(_variant(pack, tmp_path, drop=["layers.0.ffn.gate.weight"])).name == "layers.0.ffn.gate.weight"


def test_unexpected_tensor(pack, tmp_path):
    e = _load_error(_variant(pack, tmp_path, add={f"{M}.weight": torch.zeros(128, 128, dtype=torch.bfloat16)}))
    assert e.name == f"{M}.weight" and "not expected" in str(e)


def test_bias_is_unexpected(pack, tmp_path):
    """V4.1's linears have no bias; a pack with one would change the math, so it is refused."""
    assert _load_error(_variant(pack, tmp_path, add={f"{M}.bias": torch.zeros(128, dtype=torch.float16)})).name \
        == f"{M}.bias"


def test_ill_shaped_trellis(pack, tmp_path):
    e = _load_error(_variant(pack, tmp_path, add={f"{M}.trellis": torch.zeros(8, 4, 64, dtype=torch.int16)}))
    assert e.name == f"{M}.trellis" and "[8, 8, 16*K]" in str(e)


def test_wrong_dtype(pack, tmp_path):
    e = _load_error(_variant(pack, tmp_path, add={f"{M}.suh": torch.ones(128, dtype=torch.float32)}))
    assert e.name == f"{M}.suh" and "F16" in str(e)


def test_wrong_marker_value(pack, tmp_path):
    e = _load_error(_variant(pack, tmp_path, add={f"{M}.mul1": torch.tensor(123, dtype=torch.int32)}))
    assert e.name == M and "marker" in str(e)


def test_half_integer_rate_needs_mul1(pack, tmp_path):
    d = _variant(pack, tmp_path, drop=[f"{M}.mul1"],
                 add={f"{M}.trellis": torch.zeros(8, 8, 40, dtype=torch.int16)})
    e = _load_error(d)
    assert e.name == M and "mul1" in str(e)


def test_shard_missing(pack, tmp_path):
    d = _variant(pack, tmp_path)
    fname = read_weight_map(d)[f"{M}.trellis"]
    (d / fname).unlink()
    assert "missing" in str(_load_error(d))


# ---------------------------------------------------------------------------------------------- forms

def _one_linear(tmp: Path, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    save_file(parts, str(tmp / "one.safetensors"))
    wm = {n: "one.safetensors" for n in parts}
    import contextlib
    with contextlib.ExitStack() as stack:
        return decode_linear(Exl3Linear(M, f"{M}.weight", None, 128, 256), _Shards(tmp, wm, stack))


def test_sign_forms_and_codebooks(tmp_path):
    """Packed legacy signs decode like fp16 +-1 sign-scales; each marker selects its codebook (the decoder itself
    is checked against exllamav3 in test_exl3.py)."""
    g = torch.Generator().manual_seed(1)
    tr = torch.randint(-(1 << 15), 1 << 15, (8, 16, 48), generator=g, dtype=torch.int32).to(torch.int16)
    su_bits = torch.randint(0, 1 << 16, (8,), generator=g)
    su = (su_bits - ((su_bits >> 15) << 16)).to(torch.int16)                  # 16 signs per int16, set bit = -1
    suh = (1 - 2 * ((su_bits.unsqueeze(1) >> torch.arange(16)) & 1)).flatten().half()
    svh = torch.randn(256, generator=g).half()
    base = {f"{M}.trellis": tr, f"{M}.svh": svh}
    a = _one_linear(tmp_path, {**base, f"{M}.suh": suh})
    b = _one_linear(tmp_path, {**base, f"{M}.su": su})
    assert a.shape == (256, 128) and torch.equal(a, b)
    c = _one_linear(tmp_path, {**base, f"{M}.suh": suh, f"{M}.mcg": torch.tensor(MCG_MARKER, dtype=torch.int32)})
    d = _one_linear(tmp_path, {**base, f"{M}.suh": suh, f"{M}.mul1": torch.tensor(MUL1_MARKER, dtype=torch.int32)})
    assert not torch.equal(a, c) and not torch.equal(a, d) and not torch.equal(c, d)


def test_inventory_covers_every_quantised_weight():
    """Every FP8/FP4 weight of the release config has EXL3 linear(s) in the pack inventory (one table)."""
    from dsv41.config import release_config_dict
    cfg = ModelConfig.from_dict(release_config_dict())
    inv = pack_inventory(cfg)
    official = expected_tensors(cfg)
    quantised = {n for n, s in official.items() if s.fmt in ("fp8", "fp4") and ".engram.embed." not in n}
    assert quantised <= set(inv.linears)
    t = cfg.text
    wo_a = inv.linears["layers.0.attn.wo_a.weight"]
    assert [lin.module for lin in wo_a] == [f"layers.0.attn.wo_a.slice.{g}" for g in range(t.o_groups)]
    assert wo_a[3].rows == (3 * 1024, 4 * 1024) and (wo_a[3].n_in, wo_a[3].n_out) == (4096, 1024)
    # the BF16 linears the packs quantise (compressor, indexer wk, head) too
    assert "head.weight" in inv.linears and "embed.weight" in inv.plain
    for leaf, where in (("attn.compressor.wkv.weight", inv.linears), ("attn.indexer.wk.weight", inv.linears),
                        ("attn.indexer.weights_proj.weight", inv.plain), ("engram.q_weight", inv.plain)):
        found = [n for n in official if n.endswith(leaf)]
        assert found and all(n in where for n in found), leaf


# ---------------------------------------------------------------------------------------------- codes kept (GPU path)

def test_kept_codes_match_the_dense_weights(pack, dense):
    """keep_quant (the GPU path): the linears come back as Exl3Packed (codes), whose dense reconstruction is the
    CPU path's weight bit for bit and whose product (W never formed) agrees with it; shares slice the codes."""
    cfg = ModelConfig.from_checkpoint(pack)
    kept = load_weights(pack, cfg, keep_quant=True)
    assert set(kept) == set(dense)
    packed = [n for n, w in kept.items() if isinstance(w, Exl3Packed)]
    assert "head.weight" in packed and "layers.3.ffn.experts.2.w2.weight" in packed
    assert not [n for n in packed if ".compressor." in n]      # the compressor's stay dense (.float() there)
    g = torch.Generator().manual_seed(0)
    for n in ("head.weight", "layers.3.ffn.experts.2.w2.weight", "layers.0.attn.wo_a.weight", "mtp.0.main_proj.weight"):
        w = kept[n]
        assert tuple(w.shape) == tuple(dense[n].shape) and torch.equal(w.dequant(), dense[n]), n
        x = torch.randn(5, w.shape[1], generator=g)
        ref = x @ dense[n].t()
        assert (reference_ops().linear(x, w) - ref).abs().max() <= 2e-3 * ref.abs().max(), n
    wo_a = kept["layers.0.attn.wo_a.weight"]
    lo = cfg.text.o_lora_rank
    assert torch.equal(wo_a[lo:2 * lo].dequant(), dense["layers.0.attn.wo_a.weight"][lo:2 * lo])
    assert wo_a[lo:2 * lo] is wo_a[lo:2 * lo]                  # slices are kept (the model slices every call)
    halves = [load_weights(pack, cfg, share=_share(r), keep_quant=True) for r in (0, 1)]
    for n, dim in (("head.weight", 0), ("layers.0.attn.wo_b.weight", 1), ("layers.0.attn.wq_b.weight", 0)):
        assert torch.equal(torch.cat([h[n].dequant() for h in halves], dim), dense[n]), n


def test_kept_codes_model_rows_do_not_depend_on_the_batch(pack):
    m = Model.load(pack, engram=pack / "engram", keep_quant=True)
    a, b = torch.tensor([5, 77, 300, 12, 9, 401, 33]), torch.tensor([8, 8, 100, 2])
    solo = m.forward([SeqInput(state=m.new_state(), ids=a, logits="all")])[0]
    both = m.forward([SeqInput(state=m.new_state(), ids=b, logits="all"),
                      SeqInput(state=m.new_state(), ids=a, logits="all")])[1]
    assert torch.isfinite(solo).all() and torch.equal(solo, both)


def test_kept_codes_forward_names_every_device(pack):
    """The EXL3 linears inside a forward make no tensor without naming its device (tests/test_model_devices.py)."""
    from test_model_devices import FactoryAudit
    m = Model.load(pack, engram=pack / "engram", keep_quant=True)
    st, ids = m.new_state(), torch.tensor([5, 77, 300, 12])
    audit = FactoryAudit()
    with audit:
        m.forward([SeqInput(state=st, ids=ids, logits="all")])
    assert not audit.sites, sorted(audit.sites)


@pytest.mark.gpu
def test_pack_on_cuda(pack):
    """On the GPU the EXL3 linears run the fused Triton kernel on the codes: a row's logits do not depend on the
    batch, and each kept linear agrees with its dense weight."""
    m = Model.load(pack, device="cuda", engram=pack / "engram")
    assert "exl3_linear" in m.ops.kernels and m.blocks[0].attn.ops is m.ops
    w = m.head
    assert isinstance(w, Exl3Packed) and w.device.type == "cuda"
    x = torch.randn(7, w.shape[1], device="cuda")
    ref = x @ w.dequant().t()
    assert (m.ops.linear(x, w) - ref).abs().max() <= 2e-3 * ref.abs().max()
    a, b = torch.tensor([5, 77, 300, 12, 9, 401, 33]), torch.tensor([8, 8, 100, 2])
    solo = m.forward([SeqInput(state=m.new_state(), ids=a, logits="all")])[0]
    both = m.forward([SeqInput(state=m.new_state(), ids=b, logits="all"),
                      SeqInput(state=m.new_state(), ids=a, logits="all")])[1]
    assert torch.isfinite(solo).all() and torch.equal(solo, both)


def test_grouped_experts_equal_each_expert():
    """Exl3ExpertStack (one grouped launch per stack for a layer's routed experts) gives each row the same bits as
    running its experts one by one through the fused kernel, summed in slot order; rows of other ranks' experts
    get nothing. Kernels under TRITON_INTERPRET on the CPU."""
    from dsv41.model.exl3_load import exl3_routed, stack_exl3_experts
    from dsv41.model.linear import silu
    from dsv41.model.moe import Expert
    from kernels.exl3 import Exl3Weight, exl3_linear_triton
    g = torch.Generator().manual_seed(3)

    def parts(n_in, n_out):
        return {"trellis": torch.randint(-(1 << 15), 1 << 15, (n_in // 16, n_out // 16, 40), generator=g,
                                         dtype=torch.int32).to(torch.int16),
                "suh": (torch.randn(n_in, generator=g) * 0.3).half(), "svh": (torch.randn(n_out, generator=g) * 0.1).half(),
                "mul1": torch.tensor(MUL1_MARKER, dtype=torch.int32)}

    H, inter, limit = 128, 128, 2.0
    experts = {e: Expert(w1=Exl3Packed([parts(H, inter)]), w2=Exl3Packed([parts(inter, H)]),
                         w3=Exl3Packed([parts(H, inter)])) for e in (0, 2, 3)}          # expert 1: another rank
    before = {e: ex.w2.dequant() for e, ex in experts.items()}
    stack = stack_exl3_experts(experts, 4)
    assert experts[3].w2.blocks[0]["trellis"].data_ptr() == stack.w2.trellis[2].data_ptr()   # views, held once
    assert all(torch.equal(ex.w2.dequant(), before[e]) for e, ex in experts.items())
    x = torch.randn(5, H, generator=g)
    ids = torch.tensor([[0, 2], [3, 1], [2, 0], [1, 3], [0, 3]])
    weights = torch.rand(5, 2, generator=g)
    got = exl3_routed(stack, x, weights, ids, limit)

    def lin(v, w):
        return exl3_linear_triton(v, Exl3Weight.from_tensors(w.blocks[0], "cpu"))

    want = []
    for r in range(5):
        acc = None
        for s in range(2):
            e = experts.get(int(ids[r, s]))
            if e is None:
                y = torch.zeros(1, H)
            else:
                xr = x[r:r + 1]
                h = silu(torch.clamp(lin(xr, e.w1), max=limit)) * torch.clamp(lin(xr, e.w3), min=-limit, max=limit)
                y = lin(h * weights[r, s], e.w2)
            acc = y if acc is None else acc + y
        want.append(acc)
    want = torch.cat(want)
    assert torch.isfinite(got).all() and got.abs().max() > 0
    assert torch.equal(got, want)
    assert torch.equal(exl3_routed(stack, x[2:4], weights[2:4], ids[2:4], limit), got[2:4])
