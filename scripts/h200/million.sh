#!/usr/bin/env bash
# Issue 25's last round target (session 17): the decode round after a 1,048,560-token prompt against the round
# after 2K (target <= 2x), on the 2-layer make_real checkpoint; first sched_round_bench's GPU busy share of the
# served 1- and 32-row rounds (target >= 95 %); then gpu_bench's decode rows (issue 24's ratios) if time is left.
# ~9 min on an H100 (the prompt ~4-5 min). Outputs in $OUT/million/, packed into $OUT/million.tgz after each step.
# Skips the prompt when the indexer round kernel's GPU test fails (its scores would not be the served bits).
# Call (repo root on the device, carry [".whl-gpu", ".gpu-shared"]): bash scripts/h200/million.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl-gpu/*.whl > /dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
d="$OUT/million"; mkdir -p "$d"
pack() { tar -C "$OUT" -czf "$OUT/million.tgz" million; }
t0=$(date +%s)
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 120 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" > /dev/null 2>&1
timeout -k 5 70 python3 bench/sched_round_bench.py --checkpoint "$ck" --device cuda --rows 1,32 --rounds 30 \
    --cases greedy --tag "${DSV41_COMMIT:-} busy" --out "$d/sched.md" > "$d/sched.log" 2>&1
echo "million.sh: sched rc=$? at $(( $(date +%s) - t0 ))s"; grep "^| greedy" "$d/sched.md"; pack
if timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_indexer.py > "$d/tests.txt" 2>&1; then
    timeout -k 5 340 python3 bench/long_bench.py --checkpoint "$ck" --device cuda --tokens 1048576 --chunk 4096 \
        --budget-s 280 --decode 16 --four 0 --out "$d/long-1m.md" > "$d/long-1m.log" 2>&1
    echo "million.sh: long 1M rc=$? at $(( $(date +%s) - t0 ))s"
    grep -i "decode after\|^| prefill\|tokens done\|peak above" "$d/long-1m.md"
else
    echo "million.sh: indexer GPU test failed, no 1M prompt"; tail -5 "$d/tests.txt"
fi
pack
timeout -k 5 100 python3 bench/gpu_bench.py --checkpoint "$ck" --rows 1,8,32,64 --budget-s 45 --out "$d/gpu.md" \
    ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} > "$d/gpu.log" 2>&1
echo "million.sh: gpu_bench rc=$? at $(( $(date +%s) - t0 ))s"; grep "^| [0-9]" "$d/gpu.md" | head -4
pack
