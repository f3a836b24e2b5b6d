#!/bin/bash
# Issues 24 / 25 on the H200 after session 13 (the whole-round graph merged; PDL, the row kernels' variants and
# qat_flips.py written after the device time): one call, ~8-9 minutes, outputs packed into $OUT/decode.tgz (at most
# 8 files come back from $OUT). Expected:
# - tests.txt: all pass (test_kernels_pdl: rounds with and without PDL the same bits; the graph / round /
#   batch-invariance tests; the row kernels' and the site mixes' GPU tests).
# - gpu.md: ms per layer at 1 / 8 / 32 / 64 rows against session 13's 0.79 / 1.29 / 2.64 / 4.09 (before PDL).
# - pdl.md: rounds with PDL on and off, "logits equal True" on every line, on / off below 1.
# - round-profile.md: GPU busy % of the graphed 1- and 32-row rounds (issue 25's >= 95 %), the top kernels.
# - kernels-rowops.md: the site mixes' forms (mhc.SITE_SWEEP): set mhc's served form to the fastest at 1-32 rows.
# - topk.md: the indexer select at T = 1024-4096: session 14's register form (the served one up to 4096 keys) beside
#   the radix forms (11- and 8-bit digits): the 1-row round's selects were 65 us (three radix passes) and 44 us (a
#   4096-key row: five launches).
# Session 14 (no device) also changed, to be seen in gpu.md / round-profile.md here and in kernels.sh's kernels.md:
# the split linears' tail (eight chunks' partials in flight: wkv, wo_a, wq_a, router, ~7 us at 1 row and ~25 us at
# 32 before), the slot sum (slots unrolled, 1x256 tiles), no sort in candidate_blocks (the ~22 us radix sort).
# - qat-flips.md: the GPU's first QAT flips near a rounding boundary (float32 order, issue 28's kind) or not.
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
d="$OUT/decode"
mkdir -p "$d"
t0=$(date +%s)
pack() { tar -C "$OUT" -czf "$OUT/decode.tgz" decode; }   # after every step: a call cut at its limit keeps the rest
git log --oneline -1 > "$d/commit.txt" 2>&1
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" > /dev/null 2>&1
timeout -s INT -k 10 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -x \
    tests/test_kernels_pdl.py tests/test_graphs.py tests/test_model_round.py \
    "tests/test_gpu_cuda.py::test_row_alone_equals_row_in_64_and_in_a_2048_chunk" \
    "tests/test_gpu_cuda.py::test_batch_of_four_equals_each_alone_on_cuda" \
    tests/test_kernels_rowops.py tests/test_kernels_mhc.py tests/test_sampler_gpu.py tests/test_sched_ahead.py \
    -k "gpu or cuda or pdl" \
    > "$d/tests.txt" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 ))s" >> "$d/tests.txt"
pack
timeout -k 5 90 python3 bench/gpu_bench.py --checkpoint "$ck" --rows 1,8,32,64 --budget-s 45 --prompts 8192 \
    --out "$d/gpu.md" > "$d/gpu.log" 2>&1
pack
timeout -k 5 100 python3 bench/pdl_bench.py --checkpoint "$ck" --out "$d/pdl.md" > "$d/pdl.log" 2>&1
pack
timeout -k 5 90 python3 bench/round_profile.py --checkpoint "$ck" --rows 1,32 --rounds 3 --out "$d/round-profile.md" \
    > "$d/round-profile.log" 2>&1
pack
timeout -k 5 90 python3 bench/kernels_bench.py --only rowops --rows 1,8,32 --out "$d/kernels-rowops.md" \
    > "$d/kernels-rowops.log" 2>&1
pack
timeout -k 5 60 python3 bench/topk_bench.py --rows 1,32 --T 1024,2048,4096 --out "$d/topk.md" > "$d/topk.log" 2>&1
pack
[ -n "${DSV41_SHARED:-}" ] && timeout -k 5 60 python3 bench/qat_flips.py --out "$d/qat-flips.md" > "$d/qat-flips.log" 2>&1
echo "decode_check.sh: done at $(( $(date +%s) - t0 ))s" >> "$d/tests.txt"
pack && rm -rf "$d"
echo done
