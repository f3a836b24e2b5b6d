#!/usr/bin/env bash
# Issue 8 (per-layer row ops) on the H200: the CUDA tests of kernels/rowops.py and of the one-launch MoE work list
# (bitwise against the torch fallbacks at V4.1 shapes), then the old-vs-new per-layer timing. Under 3 minutes.
# Writes $OUT/bench/results/layerops.md (copied back into bench/results/ by the lead); the bench writes the row
# groups' table before it builds the MoE, so a cut MoE part still leaves figures. Repo root, PYTHONPATH as all.sh.
set -u
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
timeout -k 5 55 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_kernels_rowops.py \
    tests/test_kernels_fp4_worklist.py 2>&1 | tail -30
echo "layerops.sh: tests done at $(( $(date +%s) - t0 ))s"
timeout -k 5 115 python3 bench/layerops_gpu.py --out "$OUT/bench/results/layerops.md" 2>&1 | tail -40
echo "layerops.sh: done at $(( $(date +%s) - t0 ))s"
