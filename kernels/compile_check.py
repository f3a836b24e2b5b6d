"""Compile every kernel of fp8_linear, fp4_moe and sparse_attn for a CUDA target without a GPU (Triton's own ptxas),
in the configurations the wrappers launch. The interpreter runs kernels as Python, so it misses what only the
compiler rejects (non-constexpr globals, unsupported casts, shared memory over the limit); this catches those on a
CPU machine. Run with TRITON_INTERPRET unset (the kernels must be real JIT functions):

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
    from kernels import fp4_moe, fp8_linear, sparse_attn
    div = [["tt.divisibility", 16]]
    cfg8 = {"BM": fp8_linear.BLOCK_M, "BN": fp8_linear.BLOCK_N, "BK": fp8_linear.BLOCK_K, "INTERP": False}
    sig8 = {"x_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "out_ptr": "*fp32", "M": "i32", "N": "i32",
            "K": "i32", "stride_xm": "i32", "chunk_blocks": "i32", "chunks_per_prog": "i32", "BM": "constexpr",
            "BN": "constexpr", "BK": "constexpr", "EVEN_K": "constexpr", "INTERP": "constexpr"}
    opt8 = {"num_warps": fp8_linear.NUM_WARPS, "num_stages": fp8_linear.NUM_STAGES}
    yield ("fp8_linear fp32 x", fp8_linear._fp8_linear_kernel, sig8, {**cfg8, "EVEN_K": True},
           {(i,): div for i in (0, 1, 2, 3, 5, 6, 7)}, opt8)
    yield ("fp8_linear bf16 x", fp8_linear._fp8_linear_kernel, {**sig8, "x_ptr": "*bf16"},
           {**cfg8, "EVEN_K": True}, {(i,): div for i in (0, 1, 2, 3, 5, 6, 7)}, opt8)
    yield ("fp8_linear K tail (small test shapes)", fp8_linear._fp8_linear_kernel, sig8, {**cfg8, "EVEN_K": False},
           {}, opt8)
    yield ("fp8_linear partial sums", fp8_linear._sum_partials_kernel,
           {"p_ptr": "*fp32", "out_ptr": "*fp32", "MN": "i32", "S": "i32", "BLOCK": "constexpr"},
           {"BLOCK": fp8_linear.SUM_BLOCK}, {}, {})
    opt4 = {"num_warps": fp4_moe.NUM_WARPS, "num_stages": fp4_moe.NUM_STAGES}
    work = {"tile_e_ptr": "*i32", "tile_start_ptr": "*i32", "tile_cnt_ptr": "*i32", "order_ptr": "*i32"}
    for scaled in (False, True):
        how = "tl.dot_scaled" if scaled else "unpacked"
        yield (f"fp4_moe gate/up ({how})", fp4_moe._moe_up_kernel,
               {"x_ptr": "*fp32", "w_ptr": "*i8", "s_ptr": "*u8", **work, "rw_ptr": "*fp32", "h_ptr": "*fp32",
                "H": "i32", "I": "i32", "TOPK": "i32", "limit": "fp32", "BM": "constexpr", "BN": "constexpr",
                "BKB": "constexpr", "SCALED": "constexpr", "INTERP": "constexpr"},
               {"BM": fp4_moe.BLOCK_M, "BN": fp4_moe.BLOCK_N_UP, "BKB": fp4_moe.BLOCK_KB, "SCALED": scaled,
                "INTERP": False},
               {(i,): div for i in range(11)}, opt4)
        yield (f"fp4_moe down ({how})", fp4_moe._moe_down_kernel,
               {"h_ptr": "*fp32", "w_ptr": "*i8", "s_ptr": "*u8", **work, "y_ptr": "*fp32", "H": "i32",
                "I": "i32", "BM": "constexpr", "BN": "constexpr", "BKB": "constexpr", "SCALED": "constexpr",
                "INTERP": "constexpr"},
               {"BM": fp4_moe.BLOCK_M, "BN": fp4_moe.BLOCK_N_DOWN, "BKB": fp4_moe.BLOCK_KB, "SCALED": scaled,
                "INTERP": False},
               {(i,): div for i in range(10)}, opt4)
    yield ("fp4_moe slot sum", fp4_moe._slot_sum_kernel,
           {"y_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*fp32", "N": "i32", "H": "i32", "TOPK": "i32",
            "BR": "constexpr", "BH": "constexpr"}, {"BR": fp4_moe.SUM_ROWS, "BH": fp4_moe.SUM_COLS}, {}, {})
    for t, precise in (("fp32", True), ("fp32", False), ("bf16", False)):
        yield (f"sparse_attn {t}{' precise' if precise else ''}", sparse_attn._sparse_attn_kernel,
               {"q_ptr": f"*{t}", "pool_ptr": f"*{t}", "idx_ptr": "*i32", "sink_ptr": "*fp32", "o_ptr": "*fp32",
                "K": "i32", "scale_log2e": "fp32", "HEADS": "constexpr", "D": "constexpr", "BH": "constexpr",
                "BJ": "constexpr", "PRECISE": "constexpr", "INTERP": "constexpr"},
               {"HEADS": 64, "D": 512, "BH": sparse_attn.BLOCK_H, "BJ": sparse_attn.BLOCK_J, "PRECISE": precise,
                "INTERP": False},
               {(i,): div for i in range(6)},
               {"num_warps": sparse_attn.NUM_WARPS, "num_stages": sparse_attn.NUM_STAGES})


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
    return run(_cases(), _check)


if __name__ == "__main__":
    sys.exit(main())
