"""EXL3 weights: the bit-exact torch reference decoder (CPU) and the pack's tensor-name map.

One EXL3 linear stores (see docs/exl3.md and ../shared/spec/exl3.md, §8 of which wins):
  trellis  int16 [in/16, out/16, 16*K]  one 16x16 tile per (row tile, column tile), K bits per weight
  suh/svh  fp16 [in]/[out]              input/output sign x scale (or legacy packed signs su/sv, int16)
  mcg|mul1 int32 scalar                 codebook marker (absent: 3INST)
  bias     fp16 [out]                   optional
and the weight (in x out, y = x @ W) is W = diag(suh) . H128 . W~ . H128 . diag(svh), W~ the decoded trellis.

`dequant_exl3` reproduces exllamav3 1.6.5's dense reconstruction (`LinearEXL3.get_weight_tensor`) bit for bit;
`exl3_linear` is the reference forward in float32 (never forms W: Hadamard on the activations instead).
kernels/exl3.py holds the Triton kernels tested against these.
"""
from __future__ import annotations

import re
from functools import cache

import torch

from dsv41.model.linear import ROW_TILE, tiled
from kernels.exl3_format import (
    CB_3INST,
    CB_MCG,
    CB_MUL1,
    HAD_DIM,
    HAD_SCALE_F32,
    INST3_ADD,
    INST3_MULT,
    LOP3_MASK,
    LOP3_XOR,
    MCG_MARKER,
    MCG_MULT,
    MUL1_ACC,
    MUL1_BIAS_BITS,
    MUL1_INV_BITS,
    MUL1_MARKER,
    MUL1_MULT,
    Exl3FormatError,
    bits_of,
    codebook_of,
    sign_scales,
    unpack_signs,
)
from kernels.exl3_format import parse_exl3 as _parse
from kernels.exl3_format import sylvester as _sylvester

__all__ = [
    "CB_3INST",
    "CB_MCG",
    "CB_MUL1",
    "EXL3_TO_OFFICIAL",
    "MCG_MARKER",
    "MUL1_MARKER",
    "V41_PACK_BITS",
    "WO_A_SLICE_ROWS",
    "Exl3FormatError",
    "bits_of",
    "codebook_of",
    "decode_codebook",
    "decode_trellis",
    "dequant_exl3",
    "exl3_linear",
    "exl3_tensors",
    "hadamard_128_rows",
    "official_name",
    "sign_scales",
    "tile_positions",
    "unpack_signs",
    "unpack_windows",
    "window_ends",
]


SUBKEYS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias", "scale")


def exl3_tensors(all_tensors: dict, key: str) -> dict:
    """The EXL3 parts of linear `key` from a checkpoint's flat name -> tensor dict, by short name."""
    out = {s: all_tensors[f"{key}.{s}"] for s in SUBKEYS if f"{key}.{s}" in all_tensors}
    if "trellis" not in out:
        raise Exl3FormatError(f"{key}: no {key}.trellis")
    return out


@cache
def window_ends(K2: int) -> torch.Tensor:
    """Ring bit index where the 16-bit window of tile position p (0..255) ends, for K = K2/2 bits per weight.

    Integer K: (p+1)*K. Half-integer K = KA + 1/2: positions alternate KA and KA+1 bits, the odd ones carrying the
    extra bit (mask 0xAAAA), so the end is the running sum of those widths."""
    ka, half = K2 // 2, K2 % 2
    p = torch.arange(256, dtype=torch.int64, device="cpu")    # the trellis decodes on the host
    m1 = (p & 15) + 1
    return (p >> 4) * 8 * K2 + m1 * ka + half * (m1 >> 1)


@cache
def tile_positions() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) in the 16x16 tile of trellis position p = 8l + j (the tensor-core lane order, §8.3)."""
    p = torch.arange(256, dtype=torch.int64, device="cpu")
    lane, j = p >> 3, p & 7
    row = (lane % 4) * 2 + (j & 1) + 8 * ((j >> 1) & 1)
    col = lane // 4 + 8 * ((j >> 2) & 1)
    return row, col


def unpack_windows(trellis: torch.Tensor, K: float) -> torch.Tensor:
    """The 16-bit window (0..65535, int64) of every trellis position: [in/16, out/16, 256].

    A tile is a ring of 256*K bits held as 32-bit little-endian words of int16 pairs (2i, 2i+1), most significant
    bit first; the window of position p is the 16 bits ending at window_ends(p), wrapping around the ring."""
    K2 = round(2 * K)
    t = trellis.to(torch.int64) & 0xFFFF
    words = t[..., 0::2] | (t[..., 1::2] << 16)                  # [kt, nt, 4*K2] uint32 values
    nw = words.shape[-1]
    ring = nw * 32
    start = (window_ends(K2) - 16) % ring                          # [256]
    wi, o = start >> 5, start & 31
    a = words[..., wi]                                             # word holding the window's first bit
    b = words[..., (wi + 1) % nw]                                  # the next word (ring order)
    pair = (a << 32) | b                                           # 64 bits, fits: a < 2^32 so bit 63 may be set;
    return (pair >> (48 - o)) & 0xFFFF                             # the mask drops any sign fill


def _fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 holding 0..65535 -> float16 with those bits."""
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16)


_MUL1_INV = float(_fp16_from_bits(torch.tensor(MUL1_INV_BITS)).float())
_MUL1_BIAS = float(_fp16_from_bits(torch.tensor(MUL1_BIAS_BITS)).float())


def decode_codebook(w: torch.Tensor, cb: int) -> torch.Tensor:
    """fp16 value of 16-bit windows w (int64 tensor) under codebook cb, bit-exact with codebook.cuh.

    3INST/MCG add two fp16 halves with one fp16 rounding (their float32 sum is exact: both halves lie in
    [1/8, 2) in magnitude); MUL1's scale-and-offset is one fp16 fma, whose float32 form here is exact too
    (product of two 11-bit significands, sum within 22 bits), so a single float32 -> fp16 rounding matches."""
    w = w.to(torch.int64)
    if cb == CB_MUL1:
        x = (w * MUL1_MULT) & 0xFFFFFFFF
        s = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24) + MUL1_ACC
        h = _fp16_from_bits(s).float()
        return (h * _MUL1_INV + _MUL1_BIAS).half()
    if cb == CB_MCG:
        x = (w * MCG_MULT) & 0xFFFFFFFF
    elif cb == CB_3INST:
        x = (w * INST3_MULT + INST3_ADD) & 0xFFFFFFFF
    else:
        raise Exl3FormatError(f"unknown codebook {cb}")
    x = (x & LOP3_MASK) ^ LOP3_XOR
    lo = _fp16_from_bits(x & 0xFFFF).float()
    hi = _fp16_from_bits(x >> 16).float()
    return (lo + hi).half()


def decode_trellis(trellis: torch.Tensor, K: float, cb: int, chunk: int = 1024) -> torch.Tensor:
    """W~ (in x out, fp16): every tile's positions decoded and placed by the tensor-core permutation. Tiles are
    decoded `chunk` at a time (the int64 temporaries stay in cache; each tile's arithmetic is its own)."""
    kt, nt, width = trellis.shape
    flat = trellis.reshape(kt * nt, 1, width)
    vals = torch.empty((kt * nt, 256), dtype=torch.float16, device=trellis.device)
    for a in range(0, kt * nt, chunk):
        vals[a:a + chunk] = decode_codebook(unpack_windows(flat[a:a + chunk], K), cb)[:, 0]
    row, col = tile_positions()
    tile = torch.empty((kt, nt, 16, 16), dtype=torch.float16, device=trellis.device)
    tile[:, :, row, col] = vals.view(kt, nt, 256)
    return tile.permute(0, 2, 1, 3).reshape(kt * 16, nt * 16).contiguous()


def _had_rows_fp16(w: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """fp16 H128 . w over blocks of 128 rows, as exllamav3's preapply_had_l/_r compute it on the GPU: a float32
    GEMM with H = +-fp32(1/sqrt(128)), whose every output is the fused multiply-add chain over the 128 inputs in
    index order (checked against exllamav3 1.6.5 on the H200: this order matches all outputs, the exact sum does
    not), then rounded to fp16. Each fma is emulated in float64 (the product of an fp16 and an fp32 value is exact
    there) and rounded to float32. The block columns are processed `chunk` at a time so the accumulators stay in
    cache (the arithmetic per element is the same whatever the chunk)."""
    k, n = w.shape
    kb = k // HAD_DIM
    x = w.view(kb, HAD_DIM, n).permute(1, 0, 2).reshape(HAD_DIM, kb * n)      # [128 inputs, every block column]
    sgn = _sylvester(HAD_DIM)                                                   # [out i, in j], +-1
    out = torch.empty((HAD_DIM, kb * n), dtype=torch.float16)
    for c0 in range(0, kb * n, chunk):
        c1 = min(kb * n, c0 + chunk)
        xs = x[:, c0:c1].double() * HAD_SCALE_F32                              # exact: fp16 x fp32 in float64
        acc32 = torch.zeros((HAD_DIM, c1 - c0), dtype=torch.float32)
        acc64 = torch.empty((HAD_DIM, c1 - c0), dtype=torch.float64)
        for j in range(HAD_DIM):
            torch.addcmul(acc32, sgn[:, j:j + 1], xs[j:j + 1], out=acc64)     # acc + (+-1)(s x_j): one rounding
            acc32.copy_(acc64)                                                  # to float32: the fma's rounding
        out[:, c0:c1] = acc32
    return out.view(HAD_DIM, kb, n).permute(1, 0, 2).reshape(k, n)


def dequant_exl3(tensors: dict) -> torch.Tensor:
    """W (in x out, fp16; y = x @ W) exactly as exllamav3's dense reconstruction: W~ decoded, then H128 from the
    left, times suh per row, H128 from the right, times svh per column, rounding to fp16 after each step."""
    trellis, K, cb, suh, svh, _ = _parse(tensors)
    w = decode_trellis(trellis, K, cb)
    w = _had_rows_fp16(w)
    w = w * suh.cpu().unsqueeze(1)
    w = _had_rows_fp16(w.t().contiguous()).t()
    w = w * svh.cpu().unsqueeze(0)
    return w.contiguous()


def hadamard_128_rows(x: torch.Tensor) -> torch.Tensor:
    """x @ blockdiag(H128) along the last dimension (normalised Sylvester), in x's dtype, by butterflies: each
    element's arithmetic is independent of the other rows, so a row's result never depends on the batch."""
    shape = x.shape
    n = shape[-1]
    if n % HAD_DIM:
        raise Exl3FormatError(f"Hadamard over {n} features: not a multiple of 128")
    y = x.reshape(-1, n // HAD_DIM, HAD_DIM)
    h = 1
    while h < HAD_DIM:
        y = y.reshape(y.shape[0], y.shape[1], HAD_DIM // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return (y.reshape(shape) * HAD_SCALE_F32).to(x.dtype)


def exl3_linear(x: torch.Tensor, tensors: dict, w_rot: torch.Tensor | None = None,
                rows: int = ROW_TILE) -> torch.Tensor:
    """y = x @ W (+ bias) in float32 without forming W: y = H(H(x * suh) @ W~) * svh, H = blockdiag(H128).

    x: [..., in] any float dtype; returns float32 [..., out]. `w_rot` is W~ if the caller already decoded it
    (decode_trellis). The product runs in fixed tiles of `rows` rows (dsv41.model.linear.tiled; the op set's row
    tile), so each row's result is independent of how many rows share the call."""
    trellis, K, cb, suh, svh, bias = _parse(tensors)
    n_in, n_out = trellis.shape[0] * 16, trellis.shape[1] * 16
    if x.shape[-1] != n_in:
        raise Exl3FormatError(f"input has {x.shape[-1]} features, the EXL3 linear takes {n_in}")
    if w_rot is None:
        w_rot = decode_trellis(trellis, K, cb)
    lead = x.shape[:-1]
    xh = hadamard_128_rows(x.reshape(-1, n_in).float() * suh.float().to(x.device))
    w = w_rot.float().to(x.device)
    y = hadamard_128_rows(tiled(lambda t: t @ w, xh, rows=rows)) * svh.float().to(x.device)
    if bias is not None:
        y = y + bias.float().to(x.device)
    return y.reshape(*lead, n_out)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint side: how a published V4.1 EXL3 pack names its tensors (sources in docs/exl3.md).
#
# exllamav3's DeepSeek-V4.1 architecture (architecture/deepseek_v41.py, modules/dsv4.py) keys every module by the
# official checkpoint name without a "model." prefix, so EXL3 linear `<m>` is stored as `<m>.trellis`, `<m>.suh`,
# `<m>.svh`, `<m>.mcg|.mul1` (+ `.bias`) where the official checkpoint has `<m>.weight` (+ `.scale`), and the trellis
# is [in/16, out/16, 16K] (input rows first: W = weight.T). The one exception is `attn.wo_a`, quantised as 8
# per-group slices `attn.wo_a.slice.<g>` (4096 -> 1024 each), slice g being rows [1024g, 1024(g+1)) of the official
# wo_a.weight [8192, 4096]. Everything not listed stays in its official name and dtype (embed, norms, router gate
# and bias, attn_sink, hc_*, indexer weights_proj and k_norm, engram q/k weights, markov/confidence heads, vision).
# The Engram tables are not in the packs (read from the official shards). `mtp.<j>.` layers use the same names.
# ONE table: EXL3 module pattern -> (official weight name, slice along dim 0 of the official weight or None, family).
# ---------------------------------------------------------------------------------------------------------------

_L = r"((?:layers|mtp)\.\d+)"
EXL3_TO_OFFICIAL: tuple[tuple[str, str, str], ...] = (
    (_L + r"\.attn\.(wq_a|wq_b|wkv|wo_b)", r"\1.attn.\2.weight", "attention"),
    (_L + r"\.attn\.wo_a\.slice\.([0-7])", r"\1.attn.wo_a.weight", "attention"),
    (_L + r"\.attn\.compressor\.(wkv|wgate)", r"\1.attn.compressor.\2.weight", "kv compressor"),
    (_L + r"\.attn\.indexer\.wq_b", r"\1.attn.indexer.wq_b.weight", "indexer q"),
    (_L + r"\.attn\.indexer\.wk", r"\1.attn.indexer.wk.weight", "indexer wk"),
    (_L + r"\.ffn\.experts\.(\d+)\.(w1|w2|w3)", r"\1.ffn.experts.\2.\3.weight", "routed experts"),
    (_L + r"\.ffn\.shared_experts\.(w1|w2|w3)", r"\1.ffn.shared_experts.\2.weight", "shared experts"),
    (r"(layers\.\d+)\.engram\.wkv", r"\1.engram.wkv.weight", "engram wkv"),
    (r"mtp\.0\.main_proj", r"mtp.0.main_proj.weight", "dspark"),
    (r"head", r"head.weight", "head"),
)
WO_A_SLICE_ROWS = 1024   # o_lora_rank: rows of the official wo_a per EXL3 slice


def official_name(exl3_module: str, o_lora_rank: int = WO_A_SLICE_ROWS) -> tuple[str, tuple[int, int] | None, str]:
    """(official weight name, rows [lo, hi) of it or None for all, tensor family) of an EXL3 pack's module name
    (the name before .trellis). KeyError for a module the packs do not quantise. A wo_a slice is o_lora_rank rows
    (the release's 1024 by default)."""
    for pat, rep, family in EXL3_TO_OFFICIAL:
        m = re.fullmatch(pat, exl3_module)
        if m is None:
            continue
        rows = None
        if ".wo_a.slice." in exl3_module:
            g = int(m.group(2))
            rows = (g * o_lora_rank, (g + 1) * o_lora_rank)
        return m.expand(rep), rows, ("dspark" if exl3_module.startswith("mtp.") else family)
    raise KeyError(f"no official name for EXL3 module {exl3_module!r}")


# Bits per weight per tensor family in the published packs (spec exl3.md §6; 16 = left in its official dtype).
V41_PACK_BITS: dict[str, dict[str, object]] = {
    "bertholomus/DeepSeek-V4.1-Flash-1017-EXL3-2.5bpw": {
        "routed experts": 2.5, "attention": 4, "shared experts": 4, "kv compressor": 4, "indexer q": 4,
        "engram wkv": 4, "indexer wk": 8, "head": 6, "dspark": (4, 6),
        "not EXL3": "embed, router gate, norms, vision tower",
    },
    "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw": {
        "routed experts": "3 (2 on layers 18-22)", "shared experts": "5 (4 on layers 11-29)", "attention": 5,
        "head": 6, "indexer wk": 8, "engram wkv": (5, 4), "dspark": 4,
        "not EXL3": "embed, router gate and bias, norms, attn_sink, hc_*, vision tower, engram q/k weights, "
                    "indexer weights_proj",
    },
}
