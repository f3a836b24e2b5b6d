#!/usr/bin/env bash
# The shortest useful device call (~7 min; session 17): the GPU tests of the kernels changed without a device,
# then their timings and issue 25's round figures. Everything lands in $OUT/quick/, packed into $OUT/quick.tgz
# after each step (at most 8 files come back; a call cut at its limit keeps what ran).
# - tests.txt: the indexer round kernel's heads' sum as an FMA product == the per-sequence kernel bitwise
#   (test_gpu_indexer at V4.1 shapes, test_model_round's table test); hc_mix's warp form (reverted to) == torch.
# - topk.md: the round's indexer scores at T = 2K / 32K / 262K keys (1M positions / 4) for 1 and 32 rows, beside a
#   torch bmm form and the keys' read (before: 160 us a launch at 32K keys, 1 row, H100 at 27f3608).
# - sched.md: sched_round_bench's GPU busy share of the served rounds at 1 and 32 rows (target >= 95 %).
# - long-2048.md / long-131072.md: the decode round after 2K and 128K prompts (target <= 1.3x; 1.23x at 27f3608).
# Call (repo root on the device, carry [".whl-gpu", ".gpu-shared"]): bash scripts/h200/quick.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl-gpu/*.whl > /dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
export DSV41_SHARED=${DSV41_SHARED:-$PWD/.gpu-shared}
d="$OUT/quick"; mkdir -p "$d"
pack() { tar -C "$OUT" -czf "$OUT/quick.tgz" quick; }
t0=$(date +%s)
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 120 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" > /dev/null 2>&1 &
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_gpu_indexer.py \
    "tests/test_model_round.py::test_index_scores_table_kernel_equals_per_sequence_launches" \
    tests/test_kernels_mhc.py > "$d/tests.txt" 2>&1
echo "quick.sh: tests rc=$? at $(( $(date +%s) - t0 ))s"; tail -3 "$d/tests.txt"; pack
timeout -k 5 120 python3 bench/topk_bench.py --rows 1,32 --T 2048,32768,262144 --calls 10 --reps 10 \
    --out "$d/topk.md" > "$d/topk.log" 2>&1
echo "quick.sh: topk rc=$? at $(( $(date +%s) - t0 ))s"; grep "indexer scores" "$d/topk.md"; pack
wait
timeout -k 5 60 python3 bench/sched_round_bench.py --checkpoint "$ck" --device cuda --rows 1,32 --rounds 24 \
    --cases greedy --tag "${DSV41_COMMIT:-} busy" --out "$d/sched.md" > "$d/sched.log" 2>&1
echo "quick.sh: sched rc=$? at $(( $(date +%s) - t0 ))s"; grep "^| greedy" "$d/sched.md"; pack
for n in 2048 131072; do
    timeout -k 5 60 python3 bench/long_bench.py --checkpoint "$ck" --device cuda --tokens $n --chunk 4096 \
        --budget-s 40 --decode 16 --four 0 --out "$d/long-$n.md" > "$d/long-$n.log" 2>&1
    echo "quick.sh: long $n rc=$? at $(( $(date +%s) - t0 ))s"; grep -i "decode after\|^| prefill" "$d/long-$n.md"
    pack
done
