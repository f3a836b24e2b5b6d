#!/usr/bin/env bash
# The GPU path on the H200 (docs/gpu.md): its CUDA tests (the model on CUDA == the CPU reference, batch invariance,
# the server with --device cuda is gpuserver.sh's), the kernel tests when kernels.sh does not run them, then a
# real-shaped partial checkpoint (dsv41.tools.make_real) and bench/gpu_bench.py -> $OUT/bench/results/gpu.md. Under
# 5.5 minutes (40 + 120 + ~25 + 120 s at most). The tests stop with SIGINT at their limit, so pytest prints where it
# stood. Knobs (env): GPU_TEST_S (120), GPU_LAYERS (2), GPU_BENCH_S (100). Vectors: DSV41_SHARED (tests skip without).
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
if [ ! -f scripts/h200/kernels.sh ] && ls tests/test_kernels_*.py > /dev/null 2>&1; then   # the kernel tests, first
  timeout -k 5 "${GPU_KERNEL_TEST_S:-90}" python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs --durations=8 \
      tests/test_kernels_*.py 2>&1
  echo "gpu.sh: kernel tests done at $(( $(date +%s) - t0 ))s"
fi
timeout -k 5 40 python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs tests/test_gpu_path.py \
    tests/test_gpu_indexer.py 2>&1
# (the server test runs in gpuserver.sh, a call of its own: it ran past 200 s here twice)
timeout -s INT -k 10 "${GPU_TEST_S:-120}" python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs --durations=12 \
    tests/test_gpu_cuda.py tests/test_model_round.py -k "not server" 2>&1
echo "gpu.sh: tests done at $(( $(date +%s) - t0 ))s"
ck=/tmp/dsv41-real-${GPU_LAYERS:-2}
[ -f "$ck/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers "${GPU_LAYERS:-2}" --out "$ck" 2>&1 | tail -3
echo "gpu.sh: checkpoint at $(( $(date +%s) - t0 ))s ($(du -sh "$ck" | cut -f1))"
timeout -k 5 $(( ${GPU_BENCH_S:-100} + 20 )) python3 bench/gpu_bench.py --checkpoint "$ck" --budget-s "${GPU_BENCH_S:-100}" \
    --prompts 8192,32768,131072 --out "$OUT/bench/results/gpu.md" ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} 2>&1 | tail -40
# the decode kernels' programmatic dependent launch on and off (kernels/pdl.py): rounds' ms and bits
timeout -k 5 120 python3 bench/pdl_bench.py --checkpoint "$ck" --out "$OUT/bench/results/pdl.md" 2>&1 | tail -12
echo "gpu.sh: done at $(( $(date +%s) - t0 ))s"
