#!/usr/bin/env bash
# TP2 / TP4 / TP8 on one host with several GPUs (issue 32): one device call per world (each under 10 minutes).
#   TPN_WORLD=4 bash scripts/tpn/all.sh        # one world (the lead's call on nvidia-h200-x4)
#   bash scripts/tpn/all.sh                    # every world of 2, 4, 8 that the visible GPUs hold, while
#                                              # TPN_DEADLINE_S (540) allows: worlds after the first get what is left
# Parts per world N (each with its own time limit and log):
#   env     nvidia-smi, the GPUs' links (topo -m), torch / NCCL versions
#   ring    bench/comm_bench.py --device cuda --world N: cuda-ipc, shm-cuda (the host ring registered with the
#           GPU) and nccl; all_reduce_sum of [1..64, 5120] and a decode round's communication
#   test    the ring's GPU test (tests/test_comm_ring.py -k gpus: cuda-ipc, shm-cuda, nccl on two ranks), once
#   exact   tiny-a: one rank on cuda:0 with --tp-shards N against scripts/serve.sh --tp N --tp-shards N (rank r on
#           cuda:r): the vector prompts' ids and logprobs equal, alone == in a burst (bench/tp2_bench.py vectors)
#   serve   make_real --layers $TPN_LAYERS (2) served by scripts/serve.sh --tp N --device cuda, the ranks timed by
#           bench/tp2_bench.py hook: decode 1 / 8 / 32 streams (concurrent == solo), prompt passes as the budget
#           allows (bench/tp2_bench.py serve)
#   kill    rank N-1 SIGKILLed after 3 streamed tokens: the stream's error names it, serve.sh exits 1
# Back under $OUT: summary.txt, comm-cuda-tp<N>.md (newest run first, as bench/results/comm-cuda.md), and
# tp<N>-bundle.tgz (every part's JSON, the ranks' timers, every log).
# Knobs: TPN_WORLD, TPN_LAYERS (2), TPN_SERVE_S (150, the serve bench's budget per world), TPN_TOKENS (4),
# TPN_STREAMS (1,8,32), TPN_PROMPTS (8192,32768), TPN_DEADLINE_S (540), TPN_CKPT (serve that checkpoint instead).
# Call (repo root on the device, carry [".whl-gpu", ".gpu-shared"] as for scripts/h200x2/all.sh):
#   run(kind="nvidia-h200-x4", carry=[".whl-gpu", ".gpu-shared"], timeout_s=600,
#       command="TPN_WORLD=4 DSV41_COMMIT=<sha> bash scripts/tpn/all.sh")
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast stays OFF
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/tpn-out}
mkdir -p "$OUT"
say() { echo "[$(el)s] $*" | tee -a "$OUT/summary.txt"; }
LAYERS=${TPN_LAYERS:-2}; CK=${TPN_CKPT:-/tmp/dsv41-real-$LAYERS}; DEADLINE=${TPN_DEADLINE_S:-540}
if ls .whl-gpu/*.whl > /dev/null 2>&1; then   # the device has no registry: the server's missing packages as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl-gpu/*.whl > "$OUT/install.log" 2>&1 || say "wheel install failed (see install.log)"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 PYTHONUNBUFFERED=1
export PYTHON=${PYTHON:-python3}            # serve.sh runs this Python as it is
VEC=${DSV41_SHARED:-$PWD/.gpu-shared}/vectors/model/tiny-a
COMMIT=${DSV41_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
B="python3 bench/tp2_bench.py"
pids=()                                     # every server this script starts; all stopped on the way out
stop_all() { [ ${#pids[@]} -gt 0 ] || return 0
             for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; sleep 2
             for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done; pids=(); }
trap stop_all EXIT
stop_pids() {  # seconds pid...: TERM, up to `seconds` to go, then KILL; reaps them
  local t=$(( $(date +%s) + $1 )); shift
  kill -TERM "$@" 2>/dev/null
  while [ "$(date +%s)" -lt "$t" ]; do
    local alive=0; for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break; sleep 0.5
  done
  kill -KILL "$@" 2>/dev/null; wait "$@" 2>/dev/null; true; }
health() {  # url seconds pid: wait for /health 200 while pid lives
  local t=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$t" ]; do
    kill -0 "$3" 2>/dev/null || return 1
    python3 -c "import httpx,sys; sys.exit(httpx.get('$1/health',timeout=3).status_code!=200)" 2>/dev/null && return 0
    sleep 1
  done; return 1; }

# --- env ----------------------------------------------------------------------------------------------------------
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  nproc; env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' ; } > "$OUT/env.log" 2>&1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
say "env: $ngpu GPU(s), $(nproc) CPUs, commit $COMMIT"
[ "$ngpu" -ge 2 ] || { say "needs 2+ GPUs, found $ngpu: stopping"; exit 1; }
worlds=${TPN_WORLD:-}
if [ -z "$worlds" ]; then
  worlds=""; for n in 2 4 8; do [ "$n" -le "$ngpu" ] && worlds="$worlds $n"; done
fi

# --- the real-shaped checkpoint, in the background from here on ---------------------------------------------------
mk=0
if [ ! -f "$CK/config.json" ]; then
  ( timeout -k 5 240 python3 -m dsv41.tools.make_real --layers "$LAYERS" --out "$CK" > "$OUT/make_real.log" 2>&1
    echo $? > "$OUT/make_real.rc" ) &
  mk=$!
fi

# --- the ring's GPU test (two ranks), once ------------------------------------------------------------------------
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/test_comm_ring.py -k gpus > "$OUT/ring-test.log" 2>&1
say "ring test (cuda-ipc, shm-cuda, nccl) rc=$? ($(tail -1 "$OUT/ring-test.log"))"

port=29700
for N in $worlds; do
  [ "$N" -le "$ngpu" ] || { say "tp$N: needs $N GPUs, $ngpu visible: skipped"; continue; }
  left=$(( DEADLINE - $(el) ))
  [ "$left" -gt 150 ] || { say "tp$N: ${left}s left of the deadline: skipped"; continue; }
  P=$OUT/tp$N; LOG=$P/logs; mkdir -p "$LOG"
  port=$(( port + 20 ))
  # --- ring ---------------------------------------------------------------------------------------------------
  timeout -k 5 120 python3 bench/comm_bench.py --device cuda --world "$N" --iters 50 --rounds 5 \
      --out "$OUT/comm-cuda-tp$N.md" > "$LOG/ring.log" 2>&1; say "tp$N ring (comm_bench) rc=$?"
  # --- exact: tiny-a, one rank with N shards vs N ranks ------------------------------------------------------
  if [ -f "$VEC/vectors.safetensors" ]; then
    tiny=(--model "$VEC/checkpoint" --device cuda --max-model-len 4096 --state-budget-gib 2 --prompt-cache-gib 0
          --shutdown-grace-s 3 --tp-shards "$N")
    python3 -m dsv41 serve "${tiny[@]}" --port $(( port + 1 )) > "$LOG/exact-tp1.log" 2>&1 & t1=$!; pids+=("$t1")
    scripts/serve.sh --tp "$N" --master "127.0.0.1:$port" "${tiny[@]}" --port $(( port + 2 )) \
        > "$LOG/exact-tp$N.log" 2>&1 & t2=$!; pids+=("$t2")
    if health "http://127.0.0.1:$(( port + 1 ))" 150 "$t1" && health "http://127.0.0.1:$(( port + 2 ))" 150 "$t2"; then
      timeout -k 5 150 $B vectors --tp1 "http://127.0.0.1:$(( port + 1 ))" --tp2 "http://127.0.0.1:$(( port + 2 ))" \
          --vectors "$VEC" --out "$P/exact.json" > "$LOG/exact.log" 2>&1; say "tp$N exact (tiny-a) rc=$?"
    else
      say "tp$N exact: a server did not come up (tp$N/logs/exact-*.log)"
    fi
    stop_pids 30 "$t1" "$t2"
  else
    say "tp$N exact: skipped (no vectors at $VEC)"
  fi
  # --- serve + kill: the real-shaped checkpoint --------------------------------------------------------------
  while [ "$mk" != 0 ] && kill -0 "$mk" 2>/dev/null && [ "$(el)" -lt 300 ]; do sleep 2; done
  if [ "$mk" != 0 ] && [ "$(cat "$OUT/make_real.rc" 2>/dev/null)" != 0 ]; then
    say "tp$N serve: skipped (make_real rc=$(cat "$OUT/make_real.rc" 2>/dev/null || echo 'still running'))"
  else
    rm -rf "$P/stats"
    sport=$(( port + 3 ))
    PYTHON="$B hook" DSV41_TP2_STATS="$P/stats" scripts/serve.sh --tp "$N" --master "127.0.0.1:$(( port + 10 ))" \
        --device cuda --model "$CK" --port "$sport" --max-streams 32 --shutdown-grace-s 5 > "$LOG/serve.log" 2>&1 &
    sp=$!; pids+=("$sp")
    if health "http://127.0.0.1:$sport" 180 "$sp"; then
      say "tp$N serve: ready at $(el)s"
      budget=$(( DEADLINE - $(el) - 60 )); [ "$budget" -gt "${TPN_SERVE_S:-150}" ] && budget=${TPN_SERVE_S:-150}
      timeout -k 5 $(( budget + 60 )) $B serve --url "http://127.0.0.1:$sport" --stats "$P/stats" --checkpoint "$CK" \
          --tokens "${TPN_TOKENS:-4}" --budget-s "$budget" --streams "${TPN_STREAMS:-1,8,32}" \
          --prompts "${TPN_PROMPTS:-8192,32768}" --out "$P/serve.json" > "$LOG/serve-bench.log" 2>&1
      say "tp$N serve bench rc=$? (budget ${budget}s)"
      last=$(( N - 1 ))
      rl=$(pgrep -f -- "--master 127.0.0.1:$(( port + 10 )) .*--rank $last" | head -1)
      if [ -n "$rl" ]; then
        timeout -k 5 90 $B kill --url "http://127.0.0.1:$sport" --pid "$rl" --rank "$last" --server-pid "$sp" \
            --log "$LOG/serve.log" --checkpoint "$CK" --wait-s 60 --out "$P/kill.json" > "$LOG/kill.log" 2>&1
        say "tp$N kill (rank $last) rc=$?"
        if kill -0 "$sp" 2>/dev/null; then
          say "tp$N: serve.sh still running after the kill"; stop_pids 20 "$sp"
        else
          wait "$sp"; say "tp$N: serve.sh exited $?"
        fi
      else
        say "tp$N kill: rank $last not found"
      fi
    else
      say "tp$N serve: not ready (tp$N/logs/serve.log)"
    fi
    stop_pids 20 "$sp"
  fi
  tar czf "$OUT/tp$N-bundle.tgz" -C "$OUT" "tp$N" && rm -rf "$P"
done
stop_all
say "done at $(el)s"
