"""Compile kernels/rowops.py for a CUDA target without a GPU and check its PTX: float32 division and square root
only in their correctly rounded forms (div.rn, sqrt.rn; no div.full / div.approx / sqrt.approx / rcp.approx), no
fused multiply-add (fma, nor a mul.f32 / add.f32 without a rounding mode, which ptxas may fuse: the torch
fallbacks round the product and the sum apart), no exp/log approximations. The
kernels must equal the torch fallbacks bitwise (kernels/rowops.py); this catches what the interpreter cannot.
Also compiles kernels/fp4_moe.py's work-list kernel (integers only).
Run with TRITON_INTERPRET unset:

  python -m kernels.rowops_check [--arch 90]        # one line per kernel; exit 1 on a failure
"""
from __future__ import annotations

import re
import sys

from kernels import compile_check

# fma / mad: a fused multiply-add; mul.f32 / add.f32 / sub.f32 without a rounding mode: ptxas may contract them into
# an fma (with enable_fp_fusion=False LLVM writes mul.rn / add.rn, which ptxas keeps apart)
BAD = re.compile(r"\b(fma\.\w+\.f32|mad\.\w*\.?f32|(?:mul|add|sub)\.f32|div\.(?:full|approx)\.\w*\.?f32|"
                 r"sqrt\.approx\.\w*\.?f32|rcp\.approx\.\w*\.?f32|rsqrt\.approx|ex2\.approx|lg2\.approx)")


def _cases():
    from kernels import fp4_moe, rowops
    opts = {"enable_fp_fusion": False}
    norm = {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "buf_ptr": "*fp32", "N": "i32", "inv_n": "fp32",
            "eps": "fp32", "HAS_W": "constexpr", "BLOCK": "constexpr"}
    for has_w in (True, False):
        yield (f"rms_norm{' weighted' if has_w else ''}", rowops._rms_norm_kernel, norm,
               {"HAS_W": has_w, "BLOCK": rowops.NORM_BLOCK}, {}, {**opts, "num_warps": rowops.NORM_WARPS},
               ("div.rn.f32", "sqrt.rn.f32", "mul.rn.f32", "add.rn.f32"))
    reg = {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "N": "i32", "inv_n": "fp32", "eps": "fp32",
           "HAS_W": "constexpr", "P": "constexpr", "OP": "constexpr", "LOG_P": "constexpr", "ODD": "constexpr",
           "TAIL": "constexpr"}
    for width in (5120, 1280):      # the hidden size (5 x 1024: a tail of three levels), the q LoRA rank
        yield (f"rms_norm in registers, {width} wide", rowops._rms_norm_reg_kernel, reg,
               {"HAS_W": True, **rowops.tree_shape(width)}, {}, {**opts, "num_warps": rowops.REG_WARPS},
               ("div.rn.f32", "sqrt.rn.f32", "mul.rn.f32", "add.rn.f32"))
    yield ("sinkhorn", rowops._sinkhorn_kernel,
           {"c_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "iters": "i32", "eps": "fp32", "HC": "constexpr",
            "BR": "constexpr"}, {"HC": 4, "BR": rowops.SINK_ROWS}, {}, {**opts, "num_warps": 1}, ("div.rn.f32",))
    elem = {"H": "i32", "HC": "constexpr", "BLOCK": "constexpr"}
    yield ("hc_collapse", rowops._hc_collapse_kernel, {"s_ptr": "*fp32", "pre_ptr": "*fp32", "out_ptr": "*fp32", **elem},
           {"HC": 4, "BLOCK": rowops.ELEM_BLOCK}, {}, {**opts, "num_warps": 4}, ("mul.rn.f32", "add.rn.f32"))
    yield ("hc_expand", rowops._hc_expand_kernel,
           {"y_ptr": "*fp32", "res_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*fp32", **elem},
           {"HC": 4, "BLOCK": rowops.ELEM_BLOCK}, {}, {**opts, "num_warps": 4}, ("mul.rn.f32", "add.rn.f32"))
    site = {"y_ptr": "*fp32", "y2_ptr": "*fp32", "res_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32", "streams_ptr": "*fp32",
            "pre_ptr": "*fp32", "w_ptr": "*fp32", "x_ptr": "*fp32", "buf_ptr": "*fp32", "H": "i32", "inv_n": "fp32",
            "eps": "fp32", "HC": "constexpr", "BLOCK": "constexpr", "EXPAND": "constexpr", "HAS_W": "constexpr",
            "Y2": "constexpr"}
    for expand in (True, False):
        yield (f"hc_site_in{' with the expand' if expand else ''}", rowops._hc_site_in_kernel, site,
               {"HC": 4, "BLOCK": rowops.NORM_BLOCK, "EXPAND": expand, "HAS_W": True, "Y2": expand}, {},
               {**opts, "num_warps": rowops.NORM_WARPS}, ("div.rn.f32", "sqrt.rn.f32", "mul.rn.f32", "add.rn.f32"))
    site_reg = {**{k: v for k, v in site.items() if k not in ("buf_ptr", "BLOCK")}, "P": "constexpr",
                "OP": "constexpr", "LOG_P": "constexpr", "ODD": "constexpr", "TAIL": "constexpr"}
    yield ("hc_site_in in registers, with the expand", rowops._hc_site_in_reg_kernel, site_reg,
           {"HC": 4, "EXPAND": True, "HAS_W": True, "Y2": True, **rowops.tree_shape(5120)}, {},
           {**opts, "num_warps": rowops.REG_WARPS}, ("div.rn.f32", "sqrt.rn.f32", "mul.rn.f32", "add.rn.f32"))
    from kernels import norm_rope_quant as nrq
    (_, vmax, values, scale), qb = nrq.KINDS["fp8"]
    yield ("norm / rope / fp8 quant (kernels/norm_rope_quant.py)", nrq._norm_rope_quant_kernel,
           {"x_ptr": "*fp32", "w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*fp32",
            "heads": "i32", "stride_row": "i32", "stride_head": "i32", "inv_n": "fp32", "eps": "fp32", "floor": "fp32",
            "inv_max": "fp32", "D": "constexpr", "LOG2D": "constexpr", "HALF": "constexpr", "NORM": "constexpr",
            "INVERSE": "constexpr", "QUANT": "constexpr", "QB": "constexpr", "VMAX": "constexpr", "VALUES": "constexpr",
            "SCALE": "constexpr", "INTERP": "constexpr"},
           {"D": 512, "LOG2D": 9, "HALF": 32, "NORM": True, "INVERSE": True, "QUANT": True, "QB": qb, "VMAX": vmax,
            "VALUES": values, "SCALE": scale, "INTERP": False}, {}, {**opts, "num_warps": 4},
           ("div.rn.f32", "sqrt.rn.f32", "mul.rn.f32", "add.rn.f32", "sub.rn.f32"))
    yield ("route_weights", rowops._route_weights_kernel,
           {"s_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*fp32", "n": "i32", "E": "i32", "eps": "fp32",
            "scaling": "fp32", "K": "constexpr", "KP": "constexpr", "BR": "constexpr"},
           {"K": 6, "KP": 8, "BR": rowops.ROUTE_ROWS}, {}, {**opts, "num_warps": 1}, ("div.rn.f32", "mul.rn.f32"))
    # the MoE work list (integers only): that it compiles
    yield ("fp4_moe work list", fp4_moe._work_list_kernel,
           {"ids_ptr": "*i32", "n_pairs": "i32", "n_exp": "i32", "n_tiles": "i32", "cursor_ptr": "*i32",
            "order_ptr": "*i32", "tile_e_ptr": "*i32", "tile_start_ptr": "*i32", "tile_cnt_ptr": "*i32",
            "EP": "constexpr", "BP": "constexpr", "BT": "constexpr", "BM": "constexpr"},
           {"EP": 512, "BP": fp4_moe.WL_PAIRS, "BT": fp4_moe.WL_TILES, "BM": fp4_moe.BLOCK_M},
           {}, {**opts, "num_warps": 4}, ())


def _check(name, k, triton, need):
    ptx = k.asm["ptx"]
    bad = sorted(set(BAD.findall(ptx)))
    missing = [op for op in need if op not in ptx]
    what = ("uses " + ", ".join(bad) if bad else "no inexact ops") + ("; lacks " + ", ".join(missing) if missing else "")
    return not bad and not missing, what


def main() -> int:
    return compile_check.run(_cases(), _check)


if __name__ == "__main__":
    sys.exit(main())
