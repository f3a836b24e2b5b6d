#!/bin/bash
# Issue 25's HTTP targets on the H200 (one stream >= 90 %, 32 streams >= 85 % of the engine-only rate): bench/http_rate.py
# on the 2-layer real-shaped checkpoint, the server with --device cuda in a subprocess, then the same engine in-process
# without HTTP; ~4-5 min (two model loads and graph captures). Writes $OUT/serve-rate-h200.md (copied into
# bench/results/ by the lead) and the server's log. Expected: the table's "HTTP / engine" column against the targets,
# and the server's event-loop CPU per streamed token (the budget at 32 streams: ~15 % of a round / 32).
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
t0=$(date +%s)
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" > /dev/null 2>&1
timeout -k 10 420 python3 bench/http_rate.py --checkpoint "$ck" --device cuda --streams 1,32 --tokens 256 \
    --server-log "$OUT/http-server.log" --out "$OUT/serve-rate-h200.md" ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} \
    > "$OUT/http.log" 2>&1
echo "http.sh: rc=$? at $(( $(date +%s) - t0 ))s" >> "$OUT/http.log"
# the engine's host time by phase (plan / forward / draw / commit / gap) at 1 and 32 rows, greedy and sampled: the
# draw's copies of its parameters no longer wait for the forward (session 14)
timeout -k 10 150 python3 bench/sched_round_bench.py --checkpoint "$ck" --device cuda --rows 1,32 --rounds 12 \
    --cases greedy,sampled --tag "h200 ${DSV41_COMMIT:-}" --out "$OUT/sched-round-h200.md" >> "$OUT/http.log" 2>&1
echo "http.sh: done at $(( $(date +%s) - t0 ))s" >> "$OUT/http.log"
