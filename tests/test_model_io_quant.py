"""FP8 / FP4 / E8M0 formats and the QAT fake-quant, against hand-built edge cases and an independent
brute-force reference (nearest grid value by enumeration, ties to the even code)."""
import math

import pytest
import torch

from dsv41.model import quant as Q

# ----------------------------------------------------------------------------------------------------------
# Independent references: enumerate the grids, pick the nearest, tie -> even code.

_E4M3_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_E4M3_OK = torch.isfinite(_E4M3_CODES)


def ref_e4m3(v: float) -> float:
    vals, codes = _E4M3_CODES[_E4M3_OK].double(), torch.arange(256)[_E4M3_OK]
    d = (vals - v).abs()
    best = d.min()
    cand = codes[d == best]
    # ties: the code with even mantissa LSB; -0 and +0 are the same value
    even = [int(c) for c in cand if int(c) % 2 == 0]
    c = even[0] if even else int(cand[0])
    r = float(_E4M3_CODES[c])
    return math.copysign(abs(r), v) if r == 0 else r


def ref_e2m1(v: float) -> float:
    grid = Q.E2M1_VALUES
    a = abs(v)
    d = [abs(a - g) for g in grid]
    best = min(d)
    idx = [i for i, x in enumerate(d) if x == best]
    i = [j for j in idx if j % 2 == 0][0] if len(idx) > 1 else idx[0]
    return math.copysign(grid[i], v)


def ref_pow2_ceil(x: float) -> float:
    m, e = math.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0 ** e


def ref_fake_quant(x: torch.Tensor, block: int, kind: str) -> torch.Tensor:
    out = []
    for blk in x.double().reshape(-1, block).tolist():
        blk = [float(torch.tensor(b, dtype=torch.float32)) for b in blk]
        amax = max(abs(b) for b in blk)
        if kind == "fp8":
            s = ref_pow2_ceil(float(torch.tensor(max(amax, 1e-4), dtype=torch.float32) / 448))
            out += [ref_e4m3(max(-448.0, min(448.0, b / s))) * s for b in blk]
        elif kind == "fp4_e4m3":
            a = float(torch.tensor(max(amax, 6 * 2.0 ** -9), dtype=torch.float32) / 6)
            s = ref_e4m3(float(torch.tensor(a, dtype=torch.float32)))
            out += [ref_e2m1(max(-6.0, min(6.0, float(torch.tensor(b / s, dtype=torch.float32))))) * s for b in blk]
        else:
            s = ref_pow2_ceil(float(torch.tensor(max(amax, 6 * 2.0 ** -126), dtype=torch.float32) / 6))
            out += [ref_e2m1(max(-6.0, min(6.0, b / s))) * s for b in blk]
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


# ----------------------------------------------------------------------------------------------------------

def test_e8m0_decode():
    codes = torch.tensor([0, 1, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    got = Q.e8m0_to_float(codes.view(torch.float8_e8m0fnu))
    want = [2.0 ** (c - 127) for c in [0, 1, 126, 127, 128, 200, 254]]
    assert got[:7].tolist() == want
    assert math.isnan(got[7])
    # encoder is the inverse
    assert torch.equal(Q.float_to_e8m0(got[:7]).view(torch.uint8), codes[:7])
    with pytest.raises(ValueError):
        Q.float_to_e8m0(torch.tensor([3.0]))


def test_pow2_ceil_exact_at_and_just_above_powers():
    xs = [2.0 ** k for k in range(-126, 100, 7)]
    xs += [math.nextafter(x, math.inf) for x in xs] + [math.nextafter(x, 0) for x in xs[1:]]
    xs += [1e-4 / 448, 0.3, 3.0, 448.0, 449.0]
    v = torch.tensor(xs, dtype=torch.float32)
    got = Q.pow2_ceil(v)
    want = [ref_pow2_ceil(float(x)) for x in v]
    assert got.tolist() == want


def test_e2m1_rounding_ties_and_signs():
    cases = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0,
             0.2499: 0.0, 0.2501: 0.5, 0.7499: 0.5, 0.7501: 1.0, 2.4999: 2.0, 2.5001: 3.0, 4.9999: 4.0,
             5.0001: 6.0, 6.0: 6.0, 0.0: 0.0, 1.5: 1.5, 3.0: 3.0}
    for v, want in cases.items():
        for sgn in (1.0, -1.0):
            got = Q.round_e2m1(torch.tensor([sgn * v]))
            assert got.item() == sgn * want, (sgn * v, got.item())
            assert got.item() == ref_e2m1(sgn * v)
    # -0.1 rounds to -0.0 (sign kept), its code is plain 0 (no negative zero code written)
    assert math.copysign(1.0, Q.round_e2m1(torch.tensor([-0.1])).item()) == -1.0
    assert Q.e2m1_codes(torch.tensor([-0.1])).item() == 0


def test_e2m1_rounding_next_to_every_midpoint_and_non_finite():
    """The code search (one bucketize) against the scalar rule at each midpoint, the float32 on either side of it,
    and the non-finite magnitudes: inf is the largest code, NaN rounds to 0 (as seven comparisons gave it)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    v = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 9.0)), torch.nextafter(mids, torch.zeros_like(mids)),
                   torch.tensor([1e-45, 6.0])])
    for sgn in (1.0, -1.0):
        got = Q.round_e2m1(sgn * v)
        assert got.tolist() == [ref_e2m1(sgn * float(x)) for x in v]
    assert Q.round_e2m1(torch.tensor([math.inf])).item() == 6.0
    nan = Q.round_e2m1(torch.tensor([math.nan, -math.nan]))
    assert nan.abs().tolist() == [0.0, 0.0]


def test_fp4_pack_unpack_every_code():
    codes = torch.arange(16)
    packed = Q.pack_fp4(codes.view(1, 16))
    assert packed.dtype == torch.int8 and packed.shape == (1, 8)
    # low nibble = even element
    assert (packed.view(torch.uint8)[0, 0].item() & 0xF) == 0 and (packed.view(torch.uint8)[0, 0].item() >> 4) == 1
    vals = Q.unpack_fp4(packed)[0].tolist()
    want = list(Q.E2M1_VALUES) + [-v for v in Q.E2M1_VALUES]
    assert vals == want
    enc = Q.e2m1_codes(torch.tensor(want))
    assert enc[8] == 0  # -0 encodes as plain 0
    assert torch.equal(enc[torch.arange(16) != 8], codes[torch.arange(16) != 8])


def test_dequant_fp8_hand_built_with_tail_rows():
    # 40 x 64 weight: 2 row blocks (second a partial tail of 8 rows) x 2 column blocks, 4 distinct scales
    q = torch.zeros(40, 64)
    q[0, 0], q[0, 32], q[39, 0], q[39, 63] = 1.0, -2.0, 448.0, 0.015625  # 2^-6 (smallest normal)
    q[5, 5] = 2.0 ** -9  # smallest subnormal
    codes = torch.tensor([[127, 128], [100, 140]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = Q.dequant_fp8(q.to(torch.float8_e4m3fn), codes, torch.float32)
    assert w[0, 0] == 1.0 and w[0, 32] == -4.0
    assert w[39, 0] == 448.0 * 2.0 ** -27 and w[39, 63] == 2.0 ** -6 * 2.0 ** 13
    assert w[5, 5] == 2.0 ** -9
    assert int((w != 0).sum()) == 5
    # bf16 output is exact as well
    assert torch.equal(Q.dequant_fp8(q.to(torch.float8_e4m3fn), codes, torch.bfloat16).float(), w)
    with pytest.raises(ValueError):
        Q.dequant_fp8(q.to(torch.float8_e4m3fn), codes[:1], torch.float32)


def test_dequant_fp4_hand_built():
    # row 0: byte 0x2F = low nibble F (-6), high nibble 2 (1.0); scale code 128 (x2) for the first 32 of K
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    packed[0, 0] = 0x2F
    packed[1, 31] = 0x97  # low 7 (6.0) at k=62, high 9 (-0.5) at k=63, second scale group
    scale = torch.tensor([[128, 127], [127, 120]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = Q.dequant_fp4(packed.view(torch.int8), scale)
    assert w[0, 0] == -12.0 and w[0, 1] == 2.0
    assert w[1, 62] == 6.0 * 2.0 ** -7 and w[1, 63] == -0.5 * 2.0 ** -7
    assert int((w != 0).sum()) == 4


def test_engram_rows_dequant():
    rows = torch.tensor([[1.0] * 32 + [-3.0] * 32, [0.5] * 64]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 129], [120, 127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = Q.dequant_fp8_rows(rows, scale)
    assert w[0, 0] == 1.0 and w[0, 40] == -12.0 and w[1, 0] == 0.5 * 2.0 ** -7 and w[1, 63] == 0.5


def test_quantisers_round_trip_and_scale_rule():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 96, generator=g) * 0.05
    q, s = Q.quant_fp8(w)
    assert q.shape == (70, 96) and s.shape == (3, 3)
    # scale rule: 2^ceil(log2(amax/448)) per 32x32 block
    blk = torch.zeros(96, 96)
    blk[:70] = w
    amax = blk.view(3, 32, 3, 32).abs().amax(dim=(1, 3))
    assert torch.equal(Q.e8m0_to_float(s), torch.tensor([[ref_pow2_ceil(float(a) / 448) for a in r] for r in amax]))
    deq = Q.dequant_fp8(q, s)
    assert ((deq - w).abs() <= w.abs() / 16 + 2.0 ** -9 * Q.e8m0_to_float(s).max()).all()  # half an E4M3 step
    # re-quantising dequantised weights is the identity (values and bytes)
    q2, s2 = Q.quant_fp8(deq)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    p, s4 = Q.quant_fp4(w)
    d4 = Q.dequant_fp4(p, s4)
    assert torch.equal(Q.dequant_fp4(*Q.quant_fp4(d4)), d4)
    ref = torch.tensor([[ref_e2m1(float(x) / float(sc)) * float(sc)
                         for x, sc in zip(row, Q.e8m0_to_float(s4r).repeat_interleave(32))]
                        for row, s4r in zip(w, s4)])
    assert torch.equal(d4, ref)  # by value: the packed code for -0 is 0


@pytest.mark.parametrize("kind,fn,block", [
    ("fp8", Q.fp8_fake_quant, 32),
    ("fp4_e4m3", Q.fp4_fake_quant_e4m3, 16),
    ("fp4_ue8m0", Q.fp4_fake_quant_ue8m0, 32),
])
def test_fake_quant_matches_brute_force_reference(kind, fn, block):
    g = torch.Generator().manual_seed(1)
    rows = [
        torch.randn(4 * block, generator=g),                     # ordinary
        torch.randn(2 * block, generator=g) * 1e-7,              # below the FP8 amax floor / tiny
        torch.zeros(block),                                      # all zero
        torch.randn(block, generator=g) * 300,                   # large
        torch.full((block,), -2.5),                              # exact ties after scaling
    ]
    tie = torch.zeros(block)
    tie[0] = 6.375  # fp4_e4m3: amax/6 = 1.0625 rounds to E4M3 1.0 -> 6.375 clamps to 6
    tie[1:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows.append(tie)
    x = torch.cat(rows).view(-1, block)
    got = fn(x, block)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert bitwise_equal(got, ref_fake_quant(x, block, kind))
    assert torch.equal(fn(torch.zeros(3, block), block), torch.zeros(3, block))
    # bf16 in -> bf16 out with the same values
    xb = x.to(torch.bfloat16)
    assert torch.equal(fn(xb, block).float(), ref_fake_quant(xb.float(), block, kind).to(torch.bfloat16).float())
    # idempotent: a quantised block is a fixed point
    assert bitwise_equal(fn(got, block), got)


def test_fake_quant_floors():
    # FP8: a block of 1e-6 uses the 1e-4 floor: scale 2^-22, 1e-6/2^-22 = 4.19 -> 4.0
    y = Q.fp8_fake_quant(torch.full((32,), 1e-6))
    assert y[0].item() == 4.0 * 2.0 ** -22
    # compressed KV FP4: amax floored at 6*2^-9 -> scale 2^-9; 1e-3 / 2^-9 = 0.512 -> 0.5
    y = Q.fp4_fake_quant_e4m3(torch.full((16,), 1e-3))
    assert y[0].item() == 0.5 * 2.0 ** -9
    # indexer FP4: floor 6*2^-126 keeps the scale a normal float; 1e-37 survives with its own scale
    y = Q.fp4_fake_quant_ue8m0(torch.full((32,), 1e-37))
    assert y[0].item() > 0 and y[0].item() == ref_fake_quant(torch.full((32,), 1e-37), 32, "fp4_ue8m0")[0].item()
    with pytest.raises(ValueError):
        Q.fp8_fake_quant(torch.zeros(30))
