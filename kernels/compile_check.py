"""Compile every kernel of fp8_linear, fp4_moe, sparse_attn, indexer, router, mhc, act, rope, fake_quant and topk
for a CUDA target without a GPU (Triton's own ptxas), in the configurations the wrappers launch. The interpreter runs kernels as Python, so it
misses what only the compiler rejects (non-constexpr globals, unsupported casts, shared memory over the limit); this
catches those on a CPU machine. Run with TRITON_INTERPRET unset (the kernels must be real JIT functions):

  python -m kernels.compile_check [--arch 90]      # prints each kernel's shared memory; exit 1 on a failure
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CUDA_SMEM_LIMIT = 232448   # bytes of shared memory a Hopper block may use (227 KiB)


def _cases():
    from kernels import (act, fake_quant, fp4_moe, fp8_linear, indexer, mhc, norm_rope_quant, rope, router, sparse_attn,
                         topk)
    div = [["tt.divisibility", 16]]
    sig8 = {"x_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "y_ptr": "*fp32", "part_ptr": "*fp32",
            "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "KB": "i32",
            "E0": "i32", "E1": "i32", "E2": "i32", "S0": "i32", "S1": "i32", "S2": "i32", "S3": "i32", "BM_": "constexpr", "MT_": "constexpr", "BN": "constexpr", "BK": "constexpr",
            "SWAP": "constexpr", "W_FP8": "constexpr", "SPLIT_PROGRAMS": "constexpr", "EVEN_K": "constexpr",
            "INTERP": "constexpr", "POST": "constexpr", "SH0": "constexpr", "SH1": "constexpr",
            "MULTI": "constexpr"}
    cfgs = sorted(set(fp8_linear.CONFIGS.values()) | {fp8_linear.DEFAULT}, key=repr)
    for cfg in cfgs:
        base = {"BM_": fp8_linear.BM, "MT_": cfg.mt, "BN": cfg.bn, "BK": cfg.bk, "SWAP": cfg.swap,
                "W_FP8": True, "EVEN_K": True, "INTERP": False, "POST": cfg.post, "MULTI": False,
                "SH0": cfg.bn if cfg.swap else fp8_linear.BM, "SH1": fp8_linear.BM if cfg.swap else cfg.bn}
        opt8 = {"num_warps": cfg.warps, "num_stages": cfg.stages}
        attrs8 = {(i,): div for i in (0, 1, 2, 3, 4, 5, 7, 8)}
        for split in (True, False):
            how = "split programs" if split else "chunks in program"
            yield (f"fp8_linear {cfg} fp32 x, {how}", fp8_linear._linear_kernel, sig8,
                   {**base, "SPLIT_PROGRAMS": split}, attrs8, opt8)
        yield (f"fp8_linear {cfg} bf16 x", fp8_linear._linear_kernel, {**sig8, "x_ptr": "*bf16"},
               {**base, "SPLIT_PROGRAMS": True}, attrs8, opt8)
        yield (f"bf16_linear {cfg}", fp8_linear._linear_kernel, {**sig8, "w_ptr": "*bf16", "s_ptr": "*bf16"},
               {**base, "W_FP8": False, "POST": False, "SPLIT_PROGRAMS": True}, attrs8, opt8)
        yield (f"fp8_linear {cfg} parts", fp8_linear._linear_kernel, sig8,   # several weights in one launch
               {**base, "SPLIT_PROGRAMS": True, "MULTI": True}, attrs8, opt8)
    yield ("fp8_linear K tail (small test shapes)", fp8_linear._linear_kernel, sig8,
           {"BM_": fp8_linear.BM, "MT_": 4, "BN": 128, "BK": 64, "SWAP": True, "W_FP8": True,
            "EVEN_K": False, "SPLIT_PROGRAMS": True, "INTERP": False, "POST": False, "MULTI": False, "SH0": 128,
            "SH1": fp8_linear.BM}, {}, {"num_warps": 4, "num_stages": 4})
    cfg4 = fp4_moe.DEFAULT
    opt4 = {"num_warps": cfg4.warps, "num_stages": cfg4.stages}
    work = {"tile_e_ptr": "*i32", "tile_start_ptr": "*i32", "tile_cnt_ptr": "*i32", "order_ptr": "*i32"}
    c4 = {"BM": fp4_moe.BLOCK_M, "BP_": fp4_moe.BP, "BKB": cfg4.bkb, "ASM": cfg4.asm, "INTERP": False,
          "POST": cfg4.post}
    yield ("fp4_moe gate/up", fp4_moe._moe_up_kernel,
           {"x_ptr": "*fp32", "w_ptr": "*i8", "s_ptr": "*u8", **work, "rw_ptr": "*fp32", "h_ptr": "*fp32",
            "H": "i32", "I": "i32", "TOPK": "i32", "limit": "fp32", "BM": "constexpr", "BP_": "constexpr",
            "BN": "constexpr", "BKB": "constexpr", "ASM": "constexpr", "INTERP": "constexpr",
            "POST": "constexpr"},
           {**c4, "BN": cfg4.bn_up}, {(i,): div for i in range(11)}, opt4)
    yield ("fp4_moe down", fp4_moe._moe_down_kernel,
           {"h_ptr": "*fp32", "w_ptr": "*i8", "s_ptr": "*u8", **work, "y_ptr": "*fp32", "H": "i32", "I": "i32",
            "BM": "constexpr", "BP_": "constexpr", "BN": "constexpr", "BKB": "constexpr", "ASM": "constexpr",
            "INTERP": "constexpr", "POST": "constexpr"},
           {**c4, "BN": cfg4.bn_down}, {(i,): div for i in range(10)}, opt4)
    for total in (False, True):
        yield (f"fp4_moe slot sum{' total' if total else ''}", fp4_moe._slot_sum_kernel,
               {"y_ptr": "*fp32", "ids_ptr": "*i32", "shard_ptr": "*i32", "out_ptr": "*fp32", "a0_ptr": "*fp32",
                "a1_ptr": "*fp32", "N": "i32", "H": "i32", "TOPK": "constexpr", "BR": "constexpr", "BH": "constexpr",
                "SHARDED": "constexpr", "TOTAL": "constexpr", "ADD0": "constexpr", "ADD1": "constexpr"},
               {"TOPK": 6, "BR": fp4_moe.SUM_ROWS, "BH": fp4_moe.SUM_COLS, "SHARDED": True, "TOTAL": total, "ADD0": total,
                "ADD1": total}, {}, {"num_warps": fp4_moe.SUM_WARPS})
    yield from _prompt_cases(work, div)
    consts = {"HEADS": "constexpr", "D": "constexpr", "BH": "constexpr", "BJ": "constexpr", "PRECISE": "constexpr",
              "INTERP": "constexpr", "ROWS": "constexpr"}
    attn_opts = {"num_warps": sparse_attn.NUM_WARPS, "num_stages": sparse_attn.NUM_STAGES}
    for t, precise, rows in (("fp32", True, False), ("fp32", False, False), ("bf16", False, False),
                             ("fp32", False, True)):
        c = {"HEADS": 64, "D": 512, "BH": sparse_attn.BLOCK_H, "BJ": sparse_attn.BLOCK_J, "PRECISE": precise,
             "INTERP": False, "ROWS": rows}
        what = f"{t}{' precise' if precise else ''}{', keys row by row' if rows else ''}"
        ins = {"q_ptr": f"*{t}", "pool_ptr": f"*{t}", "idx_ptr": "*i32", "sink_ptr": "*fp32"}
        yield (f"sparse_attn whole {what}", sparse_attn._whole_kernel,
               {**ins, "o_ptr": "*fp32", "K": "i32", "scale_log2e": "fp32", **consts},
               c, {(i,): div for i in range(5)}, attn_opts)
        yield (f"sparse_attn split {what}", sparse_attn._split_kernel,
               {**ins, "acc_ptr": "*fp32", "ml_ptr": "*fp32", "K": "i32", "S": "i32", "scale_log2e": "fp32",
                **consts}, c, {(i,): div for i in range(6)}, attn_opts)
    yield ("sparse_attn combine", sparse_attn._combine_kernel,
           {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "sink_ptr": "*fp32", "o_ptr": "*fp32", "S": "constexpr",
            "HEADS": "constexpr", "D": "constexpr", "BH": "constexpr", "INTERP": "constexpr"},
           {"S": 10, "HEADS": 64, "D": 512, "BH": sparse_attn.COMBINE_H, "INTERP": False},
           {(i,): div for i in range(4)},
           {"num_warps": 4})

    isig = {"D": "constexpr", "BM": "constexpr", "BN": "constexpr", "INTERP": "constexpr", "PREC": "constexpr"}
    ic = {"D": 128, "BM": indexer.BLOCK_M, "BN": indexer.BLOCK_N, "INTERP": False, "PREC": "tf32x3"}
    for prec in ("tf32x3", "tf32"):       # three TF32 passes; one where q and keys are exact in TF32 (QAT)
        icp = {**ic, "PREC": prec}
        yield (f"indexer scores, {prec}", indexer._index_scores_kernel,
               {"q_ptr": "*fp32", "w_ptr": "*fp32", "k_ptr": "*fp32", "out_ptr": "*fp32", "N": "i32", "T": "i32",
                "scale": "fp32", "H": "i32", **isig}, icp, {(i,): div for i in range(4)},
               {"num_warps": indexer.NUM_WARPS})
        for hp in (16, 32):        # the round kernel's head tile: small test shapes, the release's 32 heads
            yield (f"indexer round scores, {hp}-head tile, {prec}", indexer._index_scores_round_kernel,
                   {"tab_ptr": "*i64", "q_ptr": "*fp32", "w_ptr": "*fp32", "cnt_ptr": "*i64", "out_ptr": "*fp32",
                    "n": "i32", "T": "i32", "RB": "i32", "scale": "fp32", "H": "i32", "HP": "constexpr", **isig},
                   {"HP": hp, **icp}, {(i,): div for i in range(5)}, {"num_warps": indexer.ROUND_WARPS})
    for E, k in ((384, 6), (256, 8), (1024, 16)):   # V4.1's router (384 experts, top 6) and the limits
        be = 1 << (E - 1).bit_length()
        yield (f"router_topk E={E} k={k}", topk._router_topk_kernel,
               {"s_ptr": "*fp32", "val_ptr": "*fp32", "ids_ptr": "*i64", "n": "i32", "E": "i32", "K": "constexpr",
                "BE": "constexpr", "BR": "constexpr"},
               {"K": k, "BE": be, "BR": topk.ROUTER_ROWS}, {}, {"num_warps": 4 if be >= 512 else 2})
    for img in (False, True):
        yield (f"router_scores{' image rows' if img else ''}", router._router_scores_kernel,
               {"z_ptr": "*fp32", "bias_ptr": "*fp32", "vl_ptr": "*fp32", "img_ptr": "*u8", "s_ptr": "*fp32",
                "sb_ptr": "*fp32", "n": "i32", "E": "i32", "inv": "fp32", "HAS_IMG": "constexpr", "BE": "constexpr",
                "BR": "constexpr", "INTERP": "constexpr"},
               {"HAS_IMG": img, "BE": 512, "BR": router.ROWS, "INTERP": False}, {},
               {"num_warps": 4, **router.LAUNCH})
    for img in (False, True):
        yield (f"route (scores, pick, weights){' image rows' if img else ''}", router._route_kernel,
               {"z_ptr": "*fp32", "bias_ptr": "*fp32", "vl_ptr": "*fp32", "img_ptr": "*u8", "w_ptr": "*fp32",
                "ids_ptr": "*i64", "n": "i32", "E": "i32", "inv": "fp32", "eps": "fp32", "scaling": "fp32",
                "K": "constexpr", "KP": "constexpr", "HAS_IMG": "constexpr", "BE": "constexpr", "BR": "constexpr",
                "INTERP": "constexpr"},
               {"K": 6, "KP": 8, "HAS_IMG": img, "BE": 512, "BR": router.ROWS, "INTERP": False}, {},
               {"num_warps": 4, **router.LAUNCH})
    yield ("mhc mixes (pre, post, softmax, Sinkhorn)", mhc._hc_mix_kernel,
           {"m_ptr": "*fp32", "s_ptr": "*fp32", "b_ptr": "*fp32", "pre_ptr": "*fp32", "post_ptr": "*fp32",
            "comb_ptr": "*fp32", "n": "i32", "stride_m": "i32", "iters": "i32", "eps": "fp32", "HC": "constexpr",
            "BR": "constexpr", "INTERP": "constexpr"},
           {"HC": 4, "BR": mhc.ROWS, "INTERP": False}, {}, {"num_warps": 1, **mhc.LAUNCH})
    for inverse in (False, True):
        yield (f"rope{' inverse' if inverse else ''}", rope._rope_kernel,
               {"x_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "heads": "i32", "stride_row": "i32",
                "stride_head": "i32", "stride_cs": "i32", "first": "i32", "HALF": "constexpr", "HB": "constexpr",
                "INVERSE": "constexpr"}, {"HALF": 32, "HB": rope.HEADS, "INVERSE": inverse}, {},
               {"num_warps": 4, **rope.LAUNCH})
    for label, D, half, norm, quant in (("window KV", 512, 32, True, "fp8"), ("indexer q", 128, 32, False, "fp4_ue8m0"),
                                        ("entries", 512, 32, False, "fp4_e4m3")):
        (_, vmax, values, scale), qb = norm_rope_quant.KINDS[quant]
        yield (f"norm / rope / quant: {label}", norm_rope_quant._norm_rope_quant_kernel,
               {"x_ptr": "*fp32", "w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*fp32",
                "heads": "i32", "stride_row": "i32", "stride_head": "i32", "inv_n": "fp32", "eps": "fp32",
                "floor": "fp32", "inv_max": "fp32", "D": "constexpr", "LOG2D": "constexpr", "HALF": "constexpr",
                "NORM": "constexpr", "INVERSE": "constexpr", "QUANT": "constexpr", "QB": "constexpr",
                "VMAX": "constexpr", "VALUES": "constexpr", "SCALE": "constexpr", "INTERP": "constexpr"},
               {"D": D, "LOG2D": D.bit_length() - 1, "HALF": half, "NORM": norm, "INVERSE": False, "QUANT": True,
                "QB": qb, "VMAX": vmax, "VALUES": values, "SCALE": scale, "INTERP": False}, {},
               {"num_warps": 4, **norm_rope_quant.LAUNCH})
    from kernels import round_gather
    for comp in (False, True):
        yield (f"round keys{' with the compressed entries' if comp else ''}", round_gather._round_keys_kernel,
               {"ring_tab": "*i64", "rsel_ptr": "*i64", "nsel_ptr": "*i64", "kv_ptr": "*fp32", "pos_ptr": "*i64",
                "comp_tab": "*i64", "topk_ptr": "*i64", "keys_ptr": "*fp32", "valid_ptr": "*i8", "W": "i32",
                "T": "i32", "rts": "i32", "ss": "i32", "cts": "i32", "ts": "i32", "ps": "i32", "D": "constexpr",
                "BK": "constexpr", "COMP": "constexpr"},
               {"D": 512, "BK": round_gather.BLOCK_K, "COMP": comp}, {}, {"num_warps": 4})
    from kernels import compress_pool
    for r in (4, 128):
        yield (f"compressor pool + norm, ratio {r}", compress_pool._pool_norm_kernel,
               {"kv_ptr": "*fp32", "gate_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "inv_n": "fp32",
                "eps": "fp32", "R": "constexpr", "D": "constexpr", "LOG2D": "constexpr", "INTERP": "constexpr"},
               {"R": r, "D": 512, "LOG2D": 9, "INTERP": False}, {}, {"num_warps": 4, **compress_pool.LAUNCH})
    yield ("rope cos / sin", rope._cos_sin_kernel,
           {"pos_ptr": "*i64", "f_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "n": "i32",
            "HALF": "constexpr", "BR": "constexpr", "INTERP": "constexpr"},
           {"HALF": 32, "BR": rope.COS_SIN_ROWS, "INTERP": False}, {}, {"num_warps": 4, **rope.TRIG_LAUNCH})
    for label, (_, vmax, values, scale), block in (("fp8", fake_quant.FP8, 32), ("fp4 ue8m0", fake_quant.FP4_UE8M0, 32),
                                                   ("fp4 e4m3", fake_quant.FP4_E4M3, 16)):
        yield (f"{label} fake-quant", fake_quant._fake_quant_kernel,
               {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_blocks": "i32", "floor": "fp32", "inv_max": "fp32",
                "VMAX": "constexpr", "BLOCK": "constexpr", "BB": "constexpr", "VALUES": "constexpr",
                "SCALE": "constexpr", "INTERP": "constexpr"},
               {"VMAX": vmax, "BLOCK": block, "BB": fake_quant.BLOCKS, "VALUES": values, "SCALE": scale,
                "INTERP": False}, {}, {"num_warps": 4, **fake_quant.LAUNCH})
    yield ("swiglu", act._swiglu_kernel,
           {"g_ptr": "*fp32", "u_ptr": "*fp32", "h_ptr": "*fp32", "n": "i32", "limit": "fp32", "INTERP": "constexpr",
            "BLOCK": "constexpr"}, {"INTERP": False, "BLOCK": act.BLOCK}, {}, {"num_warps": 4, **act.LAUNCH})
    for kc, bk, warps, mix in mhc.SITE_SWEEP:       # the served form first, then the bench's variants
        yield (f"mhc site mixes (one launch), K chunk {kc} step {bk}, {warps} warps{'' if mix else ', m only'}",
               mhc._hc_site_mixes_kernel,
               {"x_ptr": "*fp32", "fn_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "m_ptr": "*fp32",
                "s_ptr": "*fp32", "b_ptr": "*fp32", "pre_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32",
                "n": "i32", "K": "i32", "stride_x": "i32", "inv_k": "fp32", "norm_eps": "fp32", "iters": "i32",
                "hc_eps": "fp32", "S": "constexpr", "KC": "constexpr", "BK": "constexpr", "NM": "constexpr",
                "NMP": "constexpr", "BR": "constexpr", "HC": "constexpr", "INTERP": "constexpr", "MIX": "constexpr"},
               {"S": 20480 // kc, "KC": kc, "BK": bk, "NM": 24, "NMP": 32, "BR": mhc.PRE_ROWS, "HC": 4,
                "INTERP": False, "MIX": mix}, {}, {"num_warps": warps, **mhc.LAUNCH})
    yield ("mhc pre partial products", mhc._hc_pre_partial_kernel,
           {"x_ptr": "*fp32", "fn_ptr": "*fp32", "part_ptr": "*fp32", "n": "i32", "K": "i32", "stride_x": "i32",
            "KC": "constexpr", "BK": "constexpr", "NM": "constexpr", "NMP": "constexpr", "BR": "constexpr"},
           {"KC": mhc.PRE_KC, "BK": mhc.PRE_BK, "NM": 24, "NMP": 32, "BR": mhc.PRE_ROWS}, {},
           {"num_warps": mhc.PRE_WARPS, **mhc.LAUNCH})
    yield ("mhc pre combine", mhc._hc_pre_combine_kernel,
           {"part_ptr": "*fp32", "m_ptr": "*fp32", "n": "i32", "inv_k": "fp32", "eps": "fp32", "S": "constexpr",
            "NM": "constexpr", "NMP": "constexpr", "BR": "constexpr"},
           {"S": 20480 // mhc.PRE_KC, "NM": 24, "NMP": 32, "BR": mhc.PRE_ROWS}, {}, {"num_warps": 1, **mhc.LAUNCH})
    opt = {"num_warps": topk.SELECT_WARPS}
    sig = {"s_ptr": "*fp32", "hist_ptr": "*i32", "cnt_ptr": "*i32", "T": "i32", "k": "i32", "CHUNK": "i32",
           "C": "i32", "BITS": "constexpr", "BLOCK": "constexpr"}
    sig_w = {"s_ptr": "*fp32", "hist_ptr": "*i32", "cnt_ptr": "*i32", "out_ptr": "*i64", "T": "i32", "k": "i32",
             "CHUNK": "i32", "C": "i32", "BITS": "constexpr", "BLOCK": "constexpr"}
    for block in (2048, topk.REG_T):
        yield (f"select_topk in registers, {block} entries", topk._select_reg_kernel,
               {"s_ptr": "*fp32", "out_ptr": "*i64", "T": "i32", "k": "i32", "BLOCK": "constexpr"},
               {"BLOCK": block}, {}, opt)
    for bits in (11, 8):
        c = {"BITS": bits, "BLOCK": topk.SELECT_BLOCK}
        for every in (False, True):
            yield (f"select_topk {bits}-bit digits{', T <= k (compaction only)' if every else ''}",
                   topk._select_topk_kernel, {"s_ptr": "*fp32", "out_ptr": "*i64", "T": "i32", "k": "i32",
                                              "BITS": "constexpr", "BLOCK": "constexpr", "ALL": "constexpr"},
                   {**c, "ALL": every}, {}, opt)
        for p in range(-(-32 // bits)):
            yield (f"select_topk split {bits}-bit, radix pass {p}", topk._split_hist_kernel,
                   {"s_ptr": "*fp32", "hist_ptr": "*i32", "T": "i32", "k": "i32", "CHUNK": "i32", "P": "constexpr",
                    "BITS": "constexpr", "BLOCK": "constexpr"}, {**c, "P": p}, {}, opt)
        yield (f"select_topk split {bits}-bit, counts", topk._split_count_kernel, sig, c, {}, opt)
        yield (f"select_topk split {bits}-bit, compaction", topk._split_write_kernel, sig_w, c, {}, opt)


def _prompt_cases(work, div):
    """kernels/prompt_gemm.py: the x packs, the FP8 linear and the experts' gate/up and down."""
    from kernels import fp4_moe
    from kernels import prompt_gemm as P
    for step in (P.FP8_BK, P.MOE_BK):
        for t in ("fp32", "bf16"):
            yield (f"prompt pack {t} step {step}", P._pack_kernel,
                   {"x_ptr": f"*{t}", "ldx": "i32", "out_ptr": "*bf16", "M": "i32", "K": "i32", "BR": "constexpr",
                    "BC": "constexpr", "STEP": "constexpr", "INTERP": "constexpr"},
                   {"BR": P.PACK_ROWS, "BC": P.PACK_COLS, "STEP": step, "INTERP": False}, {(i,): div for i in (0, 2)},
                   {})
    for c8 in sorted(set(P.FP8_CONFIGS.values()) | {P.FP8_DEFAULT}, key=repr):
        yield from _prompt_fp8_case(P, c8, div)
    yield from _prompt_moe_cases(P, fp4_moe, work, div)


def _prompt_fp8_case(P, c8, div):
    yield (f"prompt fp8_linear {c8}", P._fp8_kernel,
           {"xp_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "y_ptr": "*fp32", "M": "i32", "N": "i32",
            "K": "i32", "LDX": "i32", "LDY": "i32", "kchunk": "i32", "S": "i32", "XG": "i32", "BM": "constexpr",
            "BN": "constexpr", "BK": "constexpr", "GROUP_M": "constexpr", "TOT_MEM": "constexpr", "SWAP": "constexpr",
            "INTERP": "constexpr"},
           {"BM": c8.bm, "BN": c8.bn, "BK": P.FP8_BK, "GROUP_M": c8.group_m, "TOT_MEM": c8.tot_mem,
            "SWAP": c8.swap, "INTERP": False},
           {(i,): div for i in range(10)}, {"num_warps": c8.warps, "num_stages": c8.stages})


def _prompt_moe_cases(P, fp4_moe, work, div):
    moe = {"BP": P.MOE_DEFAULT.bm, "BN": P.MOE_DEFAULT.bn, "BK": P.MOE_BK, "SWAP": P.MOE_DEFAULT.swap,
           "INTERP": False}
    opt = {"num_warps": P.MOE_DEFAULT.warps, "num_stages": P.MOE_DEFAULT.stages}
    yield ("prompt experts gate/up", P._moe_up_kernel,
           {"xp_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*u8", **work, "rw_ptr": "*fp32", "h_ptr": "*bf16",
            "H": "i32", "I": "i32", "TOPK": "i32", "limit": "fp32", "BP": "constexpr", "BN": "constexpr",
            "BK": "constexpr", "SWAP": "constexpr", "INTERP": "constexpr"}, moe, {(i,): div for i in range(11)}, opt)
    yield ("prompt experts down", P._moe_down_kernel,
           {"h_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*u8", **work, "y_ptr": "*fp32", "H": "i32", "I": "i32",
            "BP": "constexpr", "BN": "constexpr", "BK": "constexpr", "SWAP": "constexpr", "INTERP": "constexpr"},
           moe, {(i,): div for i in range(10)}, opt)


def cuda_c(arch: int) -> tuple[bool, str]:
    """csrc/decode.cu compiled with nvcc for sm_`arch` (when nvcc is here): (ok, what). Fails on a compile error or
    on registers spilled by a kernel of up to four row tiles (the decode rounds' variants)."""
    import shutil
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return True, "nvcc not found: not compiled"
    src = os.path.join(os.path.dirname(__file__), "csrc", "decode.cu")
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([nvcc, "-cubin", f"-arch=sm_{arch}", "-O3", "-Xptxas", "-v", "-o",
                            os.path.join(d, "k.cubin"), src], capture_output=True, text=True, check=False)
    if r.returncode:
        return False, r.stderr[-2000:]
    spilled, fn = [], None
    for line in r.stderr.splitlines():
        if "Compiling entry function" in line:
            fn = line.split("'")[1]
        elif "bytes spill stores" in line and not line.strip().startswith("0 bytes stack") and fn:
            if not fn.endswith("_t8") and " 0 bytes spill stores" not in line:
                spilled.append(fn)
    return not spilled, f"spills in {spilled}" if spilled else "compiled, no spills below 8 row tiles"


def _spills(kernel, triton) -> bool:
    """Whether ptxas put registers in local memory: STL in the SASS (nvdisasm from Triton's bundle), else .local
    in the PTX."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        return ".local" in kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return " STL" in sass


def run(cases, check, argv: list[str] | None = None) -> int:
    """The driver every compile check shares: `--arch` (90), refuse TRITON_INTERPRET, compile each case
    (name, fn, signature, constexprs, attrs, options, *extra) for that CUDA target with Triton's own ptxas, then
    `check(name, kernel, triton, *extra) -> (ok, what)`; a case that does not compile is a failure. Prints one line
    per case; returns the exit code (0 all ok, 1 a failure, 2 under the interpreter)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter's functions cannot be compiled", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, fn, sig, consts, attrs, opts, *extra in cases:
        if "PDL" in getattr(fn, "arg_names", ()) and "PDL" not in consts:   # kernels/pdl.py: as launched on sm_90
            sig, consts = {**sig, "PDL": "constexpr"}, {**consts, "PDL": True}
        try:
            ok, what = check(name, triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=opts),
                             triton, *extra)
        except Exception as exc:  # noqa: BLE001 -- report every kernel, then fail
            ok, what = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"{'ok ' if ok else 'BAD'} {name}: {what}")
        failed += not ok
    return 1 if failed else 0


def _check(name, k, triton):
    smem = k.metadata.shared
    spill = _spills(k, triton)
    # the K-tail variant only serves small test shapes; precise attention is correct but not tuned (it spills)
    ok = smem <= CUDA_SMEM_LIMIT and (not spill or "K tail" in name or "precise" in name)
    return ok, f"shared {smem} B{', spills to local memory' if spill else ''}"


def main() -> int:
    rc = run(_cases(), _check)
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ok, what = cuda_c(ap.parse_args().arch)
    print(f"{'ok ' if ok else 'BAD'} csrc/decode.cu (nvcc): {what}")
    return rc or (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
