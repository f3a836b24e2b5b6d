#!/bin/bash
# The prompt chunk after session 11's copy removals (issue 29; written without a GPU): run from the repo root on the H200;
# everything lands under $OUT/pmoe/. ~3 min.
# Env: PYTHONPATH=/tmp/site:$PWD; the 2-layer release-shape checkpoint at /tmp/r2
#   (python -m dsv41.tools.make_real --layers 2 --out /tmp/r2).
#
# Expected:
#  1. pytest.txt: all pass. GPU tests of the prompt GEMMs (bits == the CUDA C decode kernels, rows 1..300; the
#     op set's FP8 switch by rows incl. the new Ops.linear_cat of TP shards), the experts (the torch work list above
#     4096 pairs gives the same bits), apply_rope_ == apply_rope on CUDA, the strided-x products == contiguous.
#  2. prompt-gemm.md: the experts' prompt GEMM (prmt unpacking, d751143) at 2048/8192 rows, every MOE_SWEEP config,
#     against the decode kernels (was 33.3 ms vs 12.1 ms at 2048 rows with the arithmetic unpacking); wq_b as a
#     control for the FP8 kernel's LDY change (was 504 us at 2048 rows).
#  3. round-profile.md: a 2048-row prompt chunk after 2048 tokens. Against bench/results/round-profile.md
#     (81.3 ms wall; _work_list_kernel 3.6 ms, CatArrayBatchedCopy 3.2 + 1.3 ms, int64 add kernels 0.7 ms, gathers
#     1.7 ms): _work_list_kernel gone (the torch work list instead: a sort and scans, tens of us), the cats mostly gone
#     (rope in place, wq_b shards side by side), the CUDAFunctor_add<long> kernels gone (E2M1 codes by bucketize).
#     The 128 cutlass float32 sgemm calls (the mHC mixes) are gone only through main's kernels/mhc.py hc_pre, not this branch.
#  4. round-profile-shapes.md: the same chunk with record_shapes (GPU time per host op and input shapes) to
#     attribute what is left (Memcpy DtoD, gathers).
set -u
export PYTHONPATH=/tmp/site:$PWD
D=$OUT/pmoe
mkdir -p "$D"
git rev-parse --short HEAD > "$D/commit.txt"
{
  timeout 240 python -m pytest -q -m gpu tests/test_kernels_prompt_gemm.py tests/test_kernels_fp4_moe.py \
      tests/test_kernels_fp4_worklist.py 2>&1 | tail -25
  timeout 120 python -m pytest -q tests/test_model_rope.py tests/test_ops.py \
      -k "rope or column_slice or side_by_side or fp8_and_fp4 or grouped" 2>&1 | tail -15
} > "$D/pytest.txt" 2>&1
timeout 240 python3 bench/prompt_gemm_bench.py --only experts,wq_b --rows 2048,8192 --sweep \
    --out "$D/prompt-gemm.md" > "$D/prompt-gemm.log" 2>&1
timeout 240 python bench/round_profile.py --checkpoint /tmp/r2 --rows 1 --chunk 2048 --rounds 2 \
    --out "$D/round-profile.md" > "$D/round-profile.log" 2>&1
timeout 200 python bench/round_profile.py --checkpoint /tmp/r2 --rows 1 --chunk 2048 --rounds 2 --shapes \
    --out "$D/round-profile-shapes.md" > "$D/round-profile-shapes.log" 2>&1
echo done > "$D/finished.txt"
