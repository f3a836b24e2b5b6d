#!/usr/bin/env bash
# CUDA graphs of decode rounds on the H200 (dsv41/model/graphs.py, issue 8): the CUDA test (real graphs == eager
# rounds bitwise, no piece fell back), then the real-shaped checkpoint (make_real K=2, shared with gpu.sh / tp.sh)
# and bench/gpu_bench.py's decode rows with graphs and eager side by side -> $OUT/bench/results/gpu-graphs.md.
# Under 4 minutes. Knobs (env): GRAPHS_BENCH_S (90), GRAPHS_ROWS (1,8,32,64).
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
timeout -s INT -k 10 90 python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs tests/test_graphs.py 2>&1 | tail -15
echo "graphs.sh: test done at $(( $(date +%s) - t0 ))s"
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" 2>&1 | tail -2
echo "graphs.sh: checkpoint at $(( $(date +%s) - t0 ))s"
timeout -k 5 $(( ${GRAPHS_BENCH_S:-90} + 30 )) python3 bench/gpu_bench.py --checkpoint "$ck" \
    --budget-s "${GRAPHS_BENCH_S:-90}" --rows "${GRAPHS_ROWS:-1,8,32,64}" --prompts 8192 \
    --out "$OUT/bench/results/gpu-graphs.md" ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} 2>&1 | tail -25
echo "graphs.sh: done at $(( $(date +%s) - t0 ))s"
