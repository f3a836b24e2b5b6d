#!/usr/bin/env bash
# Issue 11 on the H200 (docs/vision.md): (1) the image tests' GPU case (the server's tower on cuda == cpu rows,
# types on the host) plus the CPU image tests on the fast host; (2) bench/image_bench.py with the release-shaped
# 32-block tower on cuda (fp32 as served, bf16 as released), 5 image sizes -> $OUT/bench/results/images-h200.md.
# Under 4 minutes.
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
if ! python3 -c "import PIL, numpy, safetensors" 2>/dev/null; then
  echo "images.sh: Pillow/numpy/safetensors missing on this host: add a pillow wheel to .whl-gpu (docs/gpu.md)"
  exit 1
fi
timeout -k 5 100 python3 -m pytest -q -x tests/test_images.py 2>&1 | tail -15
echo "images.sh: tests at $(( $(date +%s) - t0 ))s"
timeout -k 5 120 python3 bench/image_bench.py --device cuda --layers 32 --reps 5 \
    --out "$OUT/bench/results/images-h200.md" 2>&1 | tail -12
echo "images.sh: done at $(( $(date +%s) - t0 ))s"
