#!/usr/bin/env bash
# Issue 25's last round target: the decode round after a 1,048,560-token prompt against the round after 2K (target
# <= 2x), on the 2-layer make_real checkpoint, both on the same machine in one call; then gpu_bench's decode rows
# (issue 24's ratios) if time is left. Session 17's H200 run reached 954,368 tokens in its 280 s budget (3,391
# tok/s): 330 s takes the whole prompt there. ~9 min. Outputs in $OUT/million/, packed into $OUT/million.tgz.
# long_bench now prints the median round too (its mean swung +/-15 % run to run: each round reads its token on
# the host before the next is queued). Call (repo root, carry [".whl-gpu"]): bash scripts/h200/million.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl-gpu/*.whl > /dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
d="$OUT/million"; mkdir -p "$d"
pack() { tar -C "$OUT" -czf "$OUT/million.tgz" million; }
t0=$(date +%s)
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 120 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" > /dev/null 2>&1
timeout -k 5 60 python3 bench/long_bench.py --checkpoint "$ck" --device cuda --tokens 2048 --chunk 4096 \
    --budget-s 30 --decode 64 --four 0 --out "$d/long-2k.md" > "$d/long-2k.log" 2>&1
echo "million.sh: long 2K rc=$? at $(( $(date +%s) - t0 ))s"; grep -i "decode after" "$d/long-2k.md"; pack
timeout -k 5 390 python3 bench/long_bench.py --checkpoint "$ck" --device cuda --tokens 1048576 --chunk 4096 \
    --budget-s 330 --decode 64 --four 0 --out "$d/long-1m.md" > "$d/long-1m.log" 2>&1
echo "million.sh: long 1M rc=$? at $(( $(date +%s) - t0 ))s"
grep -i "decode after\|^| prefill\|tokens done\|peak above" "$d/long-1m.md"; pack
timeout -k 5 100 python3 bench/gpu_bench.py --checkpoint "$ck" --rows 1,8,32,64 --budget-s 45 --out "$d/gpu.md" \
    ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} > "$d/gpu.log" 2>&1
echo "million.sh: gpu_bench rc=$? at $(( $(date +%s) - t0 ))s"; grep "^| [0-9]" "$d/gpu.md" | head -4
pack
