#!/usr/bin/env bash
# The shortest useful device call (~8-9 min with a fresh machine's compiles; written in session 17 after its device
# time was spent): rounds launched ahead (runner._launch: a plain decode round queued with its ids read from the
# round before's draws on the device, before they reach the host; models without Engram layers) on a GPU for the
# first time, and the indexer's one-pass TF32 products under QAT.
# Outputs in $OUT/quick/, packed into $OUT/quick.tgz after each step (at most 8 files come back).
# - tests.txt: test_sched_ahead on CUDA (launched == run when they start, bitwise, rows gathered in another order;
#   the served scheduler's replies with and without; the cases that must not launch), test_sampler_gpu, the
#   indexer's one-pass products == the three passes' bits for QAT inputs (test_gpu_indexer), a row alone == in 64.
# - topk.md: the indexer round scores in one TF32 pass for QAT's inputs (the op set's choice under QAT) beside the
#   three passes (H100 at 60ee317: 21 us at 32K keys and 1 row; 664 us at 32 rows, compute-bound).
# - sched.md: sched_round_bench at 1 and 32 rows with launch ahead and without (--no-launch): the GPU busy share
#   (issue 25's >= 95 %; H200 at 67a9ef7 without launching: 64.4 % at 1 row, 73.4 % at 32).
# - serve-rate.md: http_rate at 1 and 32 streams (H100 at 27f3608: 91 % / 87 % of the engine-only rate).
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
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_sched_ahead.py \
    tests/test_sampler_gpu.py tests/test_gpu_indexer.py "tests/test_gpu_cuda.py::test_row_alone_equals_row_in_64_and_in_a_2048_chunk" \
    -k "cuda or gpu or one_tf32" > "$d/tests.txt" 2>&1
echo "quick.sh: tests rc=$? at $(( $(date +%s) - t0 ))s"; tail -3 "$d/tests.txt"; pack
timeout -k 5 90 python3 bench/topk_bench.py --rows 1,32 --T 32768,262144 --calls 10 --reps 10 \
    --out "$d/topk.md" > "$d/topk.log" 2>&1
echo "quick.sh: topk rc=$? at $(( $(date +%s) - t0 ))s"; grep "indexer scores" "$d/topk.md"; pack
wait
for v in launch no-launch; do
    f=""; [ "$v" = no-launch ] && f=--no-launch
    timeout -k 5 120 python3 bench/sched_round_bench.py --checkpoint "$ck" --device cuda --rows 1,32 --rounds 30 \
        --cases greedy,sampled $f --tag "${DSV41_COMMIT:-} $v" --out "$d/sched.md" > "$d/sched-$v.log" 2>&1
    echo "quick.sh: sched $v rc=$? at $(( $(date +%s) - t0 ))s"; pack
done
grep "^| greedy\|^| sampled\|^## " "$d/sched.md"; grep -H "launched ahead" "$d"/sched-*.log
timeout -k 5 100 python3 bench/http_rate.py --checkpoint "$ck" --device cuda --streams 1,32 --tokens 256 \
    --out "$d/serve-rate.md" ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} > "$d/http.log" 2>&1
echo "quick.sh: http rc=$? at $(( $(date +%s) - t0 ))s"; grep "^| [0-9]" "$d/serve-rate.md"; pack
