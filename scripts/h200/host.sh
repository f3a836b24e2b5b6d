#!/bin/bash
# Issue 25 after session 15 (written when no device could be started): the round's host side on the GPU, ~3 min.
# - serve-rate.md: bench/http_rate.py at 1 and 32 streams (targets: >= 90 % / >= 85 % of the engine-only rate;
#   the H100 at 391cd76: 94 % / 83 %), after the prepared-ahead round, the mapped Engram store and the parser fix.
# - sched-ab.md: sched_round_bench with the runner's prepare-ahead on and off (--no-ahead), the same rounds
#   (H100 at de79257: 2.4 -> 2.0 ms at 1 row, 8.0 -> 7.8 at 32; since then the sources' lengths are set when the
#   table is built, off the round's critical path).
# - long-2048.md / long-131072.md: the decode round after a 2K and a 128K prompt (target <= 1.3x) and the peak of
#   4096-row chunks against the memory plan (prompt_scratch_bytes still counts gathered keys).
# - round-profile-128k.md: round_profile of a 1-row decode round after 128K (kernels by GPU time).
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 100 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" > /dev/null 2>&1
timeout -k 5 90 python3 bench/http_rate.py --checkpoint "$ck" --device cuda --streams 1,32 --tokens 256 \
    --out "$OUT/serve-rate.md" ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} > "$OUT/http.log" 2>&1
echo "http rc=$?"; grep "^| [0-9]" "$OUT/serve-rate.md"
for a in ahead no-ahead; do
    f=""; [ "$a" = no-ahead ] && f=--no-ahead
    timeout -k 5 40 python3 bench/sched_round_bench.py --checkpoint "$ck" --device cuda --rows 1,32 --rounds 24 \
        --cases greedy $f --tag "${DSV41_COMMIT:-} $a" --out "$OUT/sched-ab.md" > "$OUT/sched-$a.log" 2>&1
    echo "$a rc=$?"
done
grep "^| greedy\|^##" "$OUT/sched-ab.md"
for n in 2048 131072; do
    timeout -k 5 60 python3 bench/long_bench.py --checkpoint "$ck" --device cuda --tokens $n --chunk 4096 \
        --budget-s 40 --decode 16 --four 0 --out "$OUT/long-$n.md" > "$OUT/long-$n.log" 2>&1
    echo "long $n rc=$?"; grep -i "decode after\|peak above\|^| prefill" "$OUT/long-$n.md"
done
# where the decode round's extra time after a long prompt goes (the 128K profile on record is session 9's H200)
timeout -k 5 120 python3 bench/round_profile.py --checkpoint "$ck" --context 131072 --rows 1 --chunk 4096 \
    --chunk-context 4096 --rounds 3 ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} --out "$OUT/round-profile-128k.md" \
    > "$OUT/profile-128k.log" 2>&1
echo "profile 128k rc=$?"; grep -A12 "decode round, 1 row: top kernels" "$OUT/round-profile-128k.md" | head -14
