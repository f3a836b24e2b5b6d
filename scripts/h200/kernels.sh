#!/usr/bin/env bash
# Issue 8 (kernel half) on the H200: the kernels' CUDA tests (V4.1 shapes, batch invariance) and their micro-bench.
# About 4 minutes. Writes $OUT/bench/results/kernels.md (copied back into bench/results/ by the lead).
set -u
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
# (-k: the gpu-marked tests, and the device-generic ones of session 12's fused launches, which run on CUDA here)
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -k "gpu or one_launch or row_by_row" \
    tests/test_kernels_fp8_linear.py tests/test_kernels_fp4_moe.py tests/test_kernels_sparse_attn.py \
    tests/test_kernels_mhc.py tests/test_kernels_act.py tests/test_kernels_rope.py tests/test_kernels_rowops.py \
    tests/test_kernels_fake_quant.py tests/test_kernels_norm_rope_quant.py tests/test_kernels_topk.py \
    tests/test_kernels_pdl.py 2>&1 | tail -40
echo "kernels.sh: tests done at $(( $(date +%s) - t0 ))s"
timeout -k 5 100 python3 bench/kernels_bench.py --out "$OUT/bench/results/kernels.md" ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} 2>&1 | tail -70
echo "kernels.sh: done at $(( $(date +%s) - t0 ))s"
