#!/usr/bin/env bash
# EXL3 on the H200 (docs/exl3.md), under 3 minutes: the CUDA tests of the Triton kernels at V4.1 shapes and of a
# tiny EXL3 pack on cuda (Exl3Packed linears on the fused kernel, grouped experts, batch invariance); the server
# serving that pack on the GPU through the openai client; bench/exl3_bench.py -> $OUT/bench/results/exl3.md.
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
timeout -k 5 55 python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs -m gpu \
    tests/test_exl3_triton.py tests/test_exl3_load.py 2>&1 | tail -20
echo "exl3.sh: cuda tests done at $(( $(date +%s) - t0 ))s"
if python3 -c "import openai, httpx" 2>&1 | tail -1; python3 -c "import openai, httpx" 2>/dev/null; then
  DSV41_DEVICE=cuda timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs \
      tests/test_exl3_serve.py 2>&1 | tail -20
else
  echo "exl3.sh: NOT RUN: the server on cuda needs the openai client (carry openai and its deps in .whl-gpu)"
fi
echo "exl3.sh: served on cuda at $(( $(date +%s) - t0 ))s"
timeout -k 5 55 python3 bench/exl3_bench.py --out "$OUT/bench/results/exl3.md" 2>&1 | tail -40
echo "exl3.sh: done at $(( $(date +%s) - t0 ))s"
