#!/usr/bin/env bash
# Issue 7 on the H200: two ranks on the one GPU through the cuda-ipc ring. (1) the ring's exactness test on CUDA,
# (2) the ring latency for a decode round's tensors, (3) TP2 serving == TP1 on the GPU (both ranks on cuda:0),
# (4) the ring's share of a served round: `scripts/serve.sh --tp 2 --device cuda` on the real-shaped checkpoint
# (make_real K=2, shared with gpu.sh / long.sh) with the ranks' own timers (bench/tp2_bench.py hook), decode at 1
# and 8 streams -> $OUT/bench/results/tp2-h200-onegpu.md. Under 4 minutes. Knob: TP_ROUND_S (60, the bench budget).
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider tests/test_comm_ring.py -k cuda 2>&1 | tail -5
python3 bench/comm_bench.py --device cuda --out "$OUT/bench/results/comm-cuda.md" 2>&1 | tail -25
DSV41_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_tp_serve.py \
    -k "reply_as_one or kept_states" 2>&1 | tail -15
echo "tp.sh: tests done at $(( $(date +%s) - t0 ))s"
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" 2>&1 | tail -2
P=/tmp/tp-round; rm -rf "$P"; mkdir -p "$P/parts"
PYTHON="python3 bench/tp2_bench.py hook" DSV41_TP2_STATS="$P/stats" timeout -k 5 $(( ${TP_ROUND_S:-60} + 100 )) \
    scripts/serve.sh --tp 2 --master 127.0.0.1:29640 --device cuda --model "$ck" --port 18040 --max-streams 8 \
    --shutdown-grace-s 5 > "$P/serve.log" 2>&1 &
sp=$!
ok=0
for _ in $(seq 90); do
  kill -0 "$sp" 2>/dev/null || break
  python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:18040/health',timeout=3).status_code!=200)" \
      2>/dev/null && { ok=1; break; }
  sleep 1
done
if [ "$ok" = 1 ]; then
  echo "tp.sh: TP2 server on the real-shaped checkpoint ready at $(( $(date +%s) - t0 ))s"
  timeout -k 5 $(( ${TP_ROUND_S:-60} + 30 )) python3 bench/tp2_bench.py serve --url http://127.0.0.1:18040 \
      --stats "$P/stats" --checkpoint "$ck" --tokens 4 --budget-s "${TP_ROUND_S:-60}" --streams 1,8 --prompts "" \
      --out "$P/parts/serve.json" 2>&1 | tail -5
  python3 bench/tp2_bench.py report --parts "$P/parts" --out "$P/report.md" ${DSV41_COMMIT:+--commit "$DSV41_COMMIT"} \
      2>&1 | tail -3
  # the report's frame is the two-GPU one: say what this run is
  sed -e '1s/.*/# TP2 on ONE H200 (both ranks share the GPU; issue 7; bench\/tp2_bench.py)/' \
      -e 's#`bash scripts/h200x2/all.sh`#`bash scripts/h200/tp.sh`#' "$P/report.md" \
      > "$OUT/bench/results/tp2-h200-onegpu.md"
  cat "$OUT/bench/results/tp2-h200-onegpu.md" | head -40
else
  echo "tp.sh: the TP2 server did not come up:"; tail -20 "$P/serve.log"
fi
kill -TERM "$sp" 2>/dev/null; sleep 3; kill -KILL "$sp" 2>/dev/null; pkill -f "127.0.0.1:29640" 2>/dev/null
echo "tp.sh: done at $(( $(date +%s) - t0 ))s"
