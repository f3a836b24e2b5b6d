#!/usr/bin/env bash
# The shortest useful device call (~3 min, written in session 16 without a device): the GPU tests of the kernels
# changed without a GPU since the last device run, then their timings at 1 / 8 / 32 rows.
# - tests.txt: test_kernels_mhc (hc_mix's comb in registers: bitwise torch's CUDA kernels), the fp8_linear GPU
#   tests (the split tail over all rows: bits, batch invariance), test_sched_ahead on CUDA (a follower told the
#   rounds ahead == one told nothing).
# - kernels-linear.md, kernels-rowops.md: kernels_bench --only linear / rowops (the split linears at 1 / 8 / 32
#   rows: 6.7-8.1 us at 1 row and 2.5-3x that at 32 on the H100 before; hc_mix 12.2 us, the site mixes ~30 us).
# Call (repo root on the device, carry [".whl-gpu", ".gpu-shared"]): bash scripts/h200/quick.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl-gpu/*.whl > "$OUT/install.log" 2>&1 || echo "wheel install failed (install.log)"
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
export DSV41_SHARED=${DSV41_SHARED:-$PWD/.gpu-shared}
t0=$(date +%s)
timeout -k 5 100 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -k "gpu or cuda" \
    tests/test_kernels_mhc.py tests/test_kernels_fp8_linear.py tests/test_sched_ahead.py > "$OUT/tests.txt" 2>&1
echo "quick.sh: tests rc=$? at $(( $(date +%s) - t0 ))s"; tail -3 "$OUT/tests.txt"
for part in linear rowops; do
    timeout -k 5 50 python3 bench/kernels_bench.py --only $part --rows 1,8,32 --out "$OUT/kernels-$part.md" \
        ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} > "$OUT/bench-$part.log" 2>&1
    echo "quick.sh: $part rc=$? at $(( $(date +%s) - t0 ))s"
done
grep -h "^| " "$OUT"/kernels-*.md | head -60
