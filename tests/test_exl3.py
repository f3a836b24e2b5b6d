"""EXL3 torch reference decoder: exllamav3 1.6.5's own dequantisation (fixtures made on the H200 by
scripts/make_exl3_fixtures.py) reproduced bit for bit, and the format rules derived by hand from the spec."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsv41.model.exl3 import (
    CB_3INST,
    CB_MCG,
    CB_MUL1,
    EXL3_TO_OFFICIAL,
    MCG_MARKER,
    MUL1_MARKER,
    V41_PACK_BITS,
    Exl3FormatError,
    bits_of,
    codebook_of,
    decode_codebook,
    decode_trellis,
    dequant_exl3,
    exl3_linear,
    exl3_tensors,
    hadamard_128_rows,
    official_name,
    tile_positions,
    unpack_signs,
    unpack_windows,
    window_ends,
)

FIXTURE = Path(__file__).parent / "fixtures" / "exl3" / "exl3_fixtures.safetensors"
CB = {"3inst": CB_3INST, "mcg": CB_MCG, "mul1": CB_MUL1}


def _load_fixture():
    if not FIXTURE.exists():
        pytest.skip("tests/fixtures/exl3 not generated yet (scripts/make_exl3_fixtures.py on a GPU)")
    from safetensors import safe_open
    with safe_open(str(FIXTURE), "pt") as f:
        meta = json.loads(f.metadata()["cases"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cases = {}
    for name in meta:
        cases[name] = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
    return meta, cases


def _case_names():
    if not FIXTURE.exists():
        return ["missing"]
    from safetensors import safe_open
    with safe_open(str(FIXTURE), "pt") as f:
        return list(json.loads(f.metadata()["cases"]))


def _parts(case: dict) -> dict:
    return {k: v for k, v in case.items() if not k.startswith("expect_") and k != "x"}


def test_fixtures_cover_every_codebook_rate_and_sign_form():
    meta, _ = _load_fixture()
    assert {m["codebook"] for m in meta.values()} == {"3inst", "mcg", "mul1"}
    ks = {m["K"] for m in meta.values()}
    assert {2, 2.5, 3, 3.5, 4, 5, 6, 7, 8} <= ks
    assert {m["signs"] for m in meta.values()} >= {"h", "p", "pu", "pv"}


@pytest.mark.parametrize("name", _case_names())
def test_decoder_matches_exllamav3_bit_for_bit(name):
    meta, cases = _load_fixture()
    m, case = meta[name], cases[name]
    parts = _parts(case)
    w_rot = decode_trellis(parts["trellis"], m["K"], CB[m["codebook"]])
    assert torch.equal(w_rot.view(torch.int16), case["expect_w_rot"].view(torch.int16))
    w = dequant_exl3(parts)
    assert w.dtype == torch.float16 and w.shape == (m["in"], m["out"])
    assert torch.equal(w.view(torch.int16), case["expect_w"].view(torch.int16))


def test_reference_forward_agrees_with_exllamav3_forward():
    meta, cases = _load_fixture()
    checked = 0
    for name, m in meta.items():
        if not m.get("forward_rows"):
            continue
        case = cases[name]
        y = exl3_linear(case["x"].float(), _parts(case))
        ref = case["expect_y"]
        # exllamav3's fp16 kernels vs the float32 reference: fp16-level agreement
        assert (y - ref).abs().max() <= 4e-3 * ref.abs().max() + 1e-3, name
        checked += 1
    assert checked >= 2


# ---- the format, derived by hand from the spec (independent of the fixtures) ------------------------------------

def _trellis_from_ring_bytes(ring: list[int]) -> torch.Tensor:
    """One K=8 tile from its 256 ring bytes: 32-bit words MSB-first, stored as little-endian int16 pairs."""
    words = []
    for i in range(0, 256, 4):
        hi = (ring[i] << 8) | ring[i + 1]
        lo = (ring[i + 2] << 8) | ring[i + 3]
        words += [lo, hi]             # int16 2i is the word's low half
    t = torch.tensor(words, dtype=torch.int64)
    t = torch.where(t >= 32768, t - 65536, t)
    return t.to(torch.int16).view(1, 1, 128)


def test_windows_read_the_ring_msb_first_in_int16_pairs():
    g = torch.Generator().manual_seed(1)
    ring = torch.randint(0, 256, (256,), generator=g).tolist()
    win = unpack_windows(_trellis_from_ring_bytes(ring), 8)[0, 0]
    for t in range(256):     # K = 8: window t is bytes t-1 and t of the ring (tail-biting at t = 0)
        assert int(win[t]) == (ring[t - 1] << 8) | ring[t]


def test_window_ends_integer_and_half_rates():
    assert window_ends(6)[:4].tolist() == [3, 6, 9, 12]
    e = window_ends(5)      # K = 2.5: even positions 2 bits, odd positions 3 bits
    steps = torch.diff(torch.cat([torch.tensor([0]), e])).tolist()
    assert steps[:6] == [2, 3, 2, 3, 2, 3] and int(e[-1]) == 640
    assert int(window_ends(7)[-1]) == 256 * 3.5


def test_tile_permutation_is_tensor_core_lane_order():
    row, col = tile_positions()
    # exllamav3 tensor_core_perm: lane t holds rows r0, r0+1, r0+8, r0+9 (r0 = 2(t mod 4)) in columns t//4, t//4+8
    for t in range(32):
        r0, c0 = (t % 4) * 2, t // 4
        want = [(r0, c0), (r0 + 1, c0), (r0 + 8, c0), (r0 + 9, c0),
                (r0, c0 + 8), (r0 + 1, c0 + 8), (r0 + 8, c0 + 8), (r0 + 9, c0 + 8)]
        got = [(int(row[8 * t + j]), int(col[8 * t + j])) for j in range(8)]
        assert got == want
    assert len(set((row * 16 + col).tolist())) == 256


def test_codebook_values_by_hand():
    # 3INST, w = 0: x = 64248484 = 0x03D45AA4 -> (x & 0x8fff8fff) ^ 0x3b603b60 = 0x38B431C4:
    # fp16 0x31C4 = (1 + 452/1024)/8, fp16 0x38B4 = (1 + 180/1024)/2
    assert float(decode_codebook(torch.tensor([0]), CB_3INST)) == (1 + 452 / 1024) / 8 + (1 + 180 / 1024) / 2
    # MCG and MUL1 of w = 0 are x = 0: MCG -> 0x3b603b60 halves; MUL1 -> (1024 + 0) * inv + bias
    h = float(torch.tensor([0x3B60], dtype=torch.int16).view(torch.float16))
    assert float(decode_codebook(torch.tensor([0]), CB_MCG)) == 2 * h
    assert float(decode_codebook(torch.tensor([0]), CB_MUL1)) == pytest.approx(1024 * 1774 / 2 ** 18 - 1329 / 128,
                                                                              abs=5e-3)
    allw = torch.arange(65536)
    for cb, std in ((CB_3INST, 1.24371088), (CB_MCG, 1.24371088), (CB_MUL1, 1.0)):
        v = decode_codebook(allw, cb).double()
        assert abs(float(v.mean())) < 0.01 and abs(float(v.std()) - std) < 0.01


def test_packed_signs_lowest_bit_first():
    s = unpack_signs(torch.tensor([0b101, -32768], dtype=torch.int16))
    assert s[:4].tolist() == [-1, 1, -1, 1] and s[31] == -1 and (s[16:31] == 1).all()


def test_markers_rates_and_shapes_are_checked():
    tr = torch.zeros((8, 8, 40), dtype=torch.int16)
    base = {"trellis": tr, "suh": torch.ones(128).half(), "svh": torch.ones(128).half()}
    with pytest.raises(Exl3FormatError, match="mul1"):
        dequant_exl3(base)                                            # K = 2.5 needs mul1
    with pytest.raises(Exl3FormatError, match="marker"):
        dequant_exl3({**base, "mul1": torch.tensor(MCG_MARKER, dtype=torch.int32)})
    with pytest.raises(Exl3FormatError, match="both"):
        codebook_of({"mcg": torch.tensor(MCG_MARKER), "mul1": torch.tensor(MUL1_MARKER)})
    with pytest.raises(Exl3FormatError):
        bits_of(torch.zeros((8, 8, 72), dtype=torch.int16), CB_MUL1)  # K = 4.5 does not exist
    with pytest.raises(Exl3FormatError, match="suh"):
        dequant_exl3({**base, "mul1": torch.tensor(MUL1_MARKER, dtype=torch.int32), "suh": torch.ones(64).half()})
    with pytest.raises(Exl3FormatError, match="trellis"):
        exl3_tensors({"a.suh": torch.ones(1)}, "a")
    assert dequant_exl3({**base, "mul1": torch.tensor(MUL1_MARKER, dtype=torch.int32)}).shape == (128, 128)


def test_hadamard_is_orthonormal_sylvester():
    x = torch.randn(3, 256, dtype=torch.float64)
    y = hadamard_128_rows(x)
    assert torch.allclose(hadamard_128_rows(y), x, atol=1e-6)       # H H = I
    e = hadamard_128_rows(torch.eye(128, dtype=torch.float64))
    assert torch.allclose(e[5, 3] * 128 ** 0.5, torch.tensor(-1.0, dtype=torch.float64), atol=1e-6)  # 5&3=1


def _random_linear(n_in=256, n_out=128, K=3, cb=CB_MUL1, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"trellis": torch.randint(-32768, 32768, (n_in // 16, n_out // 16, int(16 * K)), generator=g,
                                  dtype=torch.int16),
         "suh": (0.05 * torch.randn(n_in, generator=g)).half(), "svh": (0.05 * torch.randn(n_out, generator=g)).half(),
         "bias": torch.randn(n_out, generator=g).half()}
    if cb == CB_MUL1:
        t["mul1"] = torch.tensor(MUL1_MARKER, dtype=torch.int32)
    return t


def test_linear_equals_dense_weight_and_is_row_invariant():
    t = _random_linear()
    x = torch.randn(37, 256)
    y = exl3_linear(x, t)
    dense = x @ dequant_exl3(t).float() + t["bias"].float()
    assert (y - dense).abs().max() < 2e-3 * dense.abs().max()
    for i in (0, 5, 36):                                             # a row alone == the same row in the batch
        assert torch.equal(exl3_linear(x[i:i + 1], t)[0], y[i])
    assert torch.equal(exl3_linear(x[:9], t), y[:9])


def test_mapping_table_names_official_tensors():
    assert official_name("layers.7.attn.wq_a") == ("layers.7.attn.wq_a.weight", None, "attention")
    assert official_name("layers.7.attn.wo_a.slice.3") == ("layers.7.attn.wo_a.weight", (3072, 4096), "attention")
    assert official_name("layers.39.ffn.experts.383.w2") == ("layers.39.ffn.experts.383.w2.weight", None,
                                                             "routed experts")
    assert official_name("mtp.2.ffn.experts.5.w1")[2] == "dspark"
    assert official_name("layers.14.engram.wkv")[0] == "layers.14.engram.wkv.weight"
    assert official_name("head") == ("head.weight", None, "head")
    with pytest.raises(KeyError):
        official_name("layers.3.ffn.gate")                           # router gate stays unquantised
    families = {f for _, _, f in EXL3_TO_OFFICIAL}
    assert families <= set(V41_PACK_BITS["bertholomus/DeepSeek-V4.1-Flash-1017-EXL3-2.5bpw"])
