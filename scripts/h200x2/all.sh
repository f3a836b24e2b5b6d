#!/usr/bin/env bash
# Issue 14 on `nvidia-h200-x2` (two H200s of one host), one device call, under 9 minutes (docs/tp2.md):
#   env        nvidia-smi, the GPUs' link (nvidia-smi topo -m), torch / NCCL versions
#   limits     each GPU's copy bandwidth and bf16 matrix rate, the GPU0 -> GPU1 copy          (bench/tp2_bench.py)
#   ring       cuda-ipc vs NCCL all_reduce_sum latency on the two GPUs                       (bench/comm_bench.py)
#   ckpt       make_real --layers $TP2_LAYERS, in the background from here on
#   preflight  the ring opened exactly as the server opens it (rank 0 "cuda", rank 1 "cuda:1") + a Triton launch
#              on cuda:1 from rank 1's process; when it fails the serving parts are skipped (TP2_FORCE=1 runs them)
#   vectors    tiny-a: TP1 (cuda:0) and `scripts/serve.sh --tp 2` (cuda:0 + cuda:1): same tokens, burst == alone
#   serve      `scripts/serve.sh --tp 2 --device cuda` on the real-shaped checkpoint, ranks timed by the hook:
#              decode 1/8/32 streams (concurrent == solo), prompt 8K/32K/128K as the budget allows
#   kill       rank 1 SIGKILLed mid-stream: the stream errors naming it, rank 0 exits 1 with its message
#   report     bench/results/tp2-h200x2.md
# Call (repo root on the device, carry [".whl-gpu", ".gpu-shared"]): bash scripts/h200x2/all.sh
# Back under $OUT (at most 8 files): summary.txt, tp2-h200x2.md, comm-cuda-x2.md, tp2-bundle.tgz (parts, logs).
# Knobs: TP2_LAYERS (2), TP2_SERVE_S (bench budget, 200), TP2_TOKENS (4), TP2_STREAMS (1,8,32),
# TP2_PROMPTS (8192,32768,131072), TP2_FORCE (0), TP2_DEADLINE_S (500);
# TP2_CKPT=DIR serves DIR instead of making one; TP2_DEVICE=cpu (with TP2_CKPT, OUT set) is the CPU dry run of this
# script's orchestration (no limits / ring / preflight; the shm ring instead of cuda-ipc).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast stays OFF
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
P=$OUT/tp2; LOG=$OUT/tp2/logs
mkdir -p "$LOG"
say() { echo "[$(el)s] $*" | tee -a "$OUT/summary.txt"; }
LAYERS=${TP2_LAYERS:-2}; CK=${TP2_CKPT:-/tmp/dsv41-real-$LAYERS}; DEADLINE=${TP2_DEADLINE_S:-500}
DEV=${TP2_DEVICE:-cuda}
if [ "$DEV" = cuda ]; then                  # the device has no registry: the server's missing packages as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl-gpu/*.whl > "$LOG/install.log" 2>&1 || say "wheel install failed (see logs/install.log)"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 PYTHONUNBUFFERED=1
export PYTHON=${PYTHON:-python3}            # serve.sh runs this Python as it is (no .venv: the host has no registry)
VEC=${DSV41_SHARED:-$PWD/.gpu-shared}/vectors/model/tiny-a
COMMIT=${DSV41_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
B="python3 bench/tp2_bench.py"
pids=()                                     # every server this script starts; all stopped on the way out
stop_all() { [ ${#pids[@]} -gt 0 ] || return 0                # serve.sh stops its rank 1 on TERM
             for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; sleep 2
             for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done; pids=(); }
trap stop_all EXIT
stop_pids() {  # seconds pid...: TERM, up to `seconds` to go, then KILL; reaps them (never waits unbounded)
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
  nproc; env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' ; } > "$LOG/env.log" 2>&1
python3 -c "import torch; n=torch.cuda.device_count(); print(f'{n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, $(nproc) CPUs')" \
    > "$P/env.txt" 2>/dev/null
say "env: $(cat "$P/env.txt" 2>/dev/null)"
if [ "$DEV" = cuda ]; then
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  [ "$ngpu" -ge 2 ] || { say "needs 2 GPUs, found $ngpu: stopping"; exit 1; }
  # --- limits, ring latency ---------------------------------------------------------------------------------------
  timeout -k 5 60 $B limits --out "$P/limits.json" > "$LOG/limits.log" 2>&1; say "limits rc=$?"
  timeout -k 5 90 python3 bench/comm_bench.py --device cuda --iters 100 --out "$P/comm-cuda-x2.md" \
      > "$LOG/ring.log" 2>&1; say "ring (comm_bench cuda-ipc,nccl) rc=$?"
fi

# --- the real-shaped checkpoint, in the background ----------------------------------------------------------------
mk=0
if [ ! -f "$CK/config.json" ]; then
  ( timeout -k 5 240 python3 -m dsv41.tools.make_real --layers "$LAYERS" --out "$CK" > "$LOG/make_real.log" 2>&1
    echo $? > "$P/make_real.rc" ) &
  mk=$!
fi

# --- preflight ----------------------------------------------------------------------------------------------------
pre=0
if [ "$DEV" = cuda ]; then
  timeout -k 5 90 $B preflight --out "$P/preflight.json" > "$LOG/preflight.log" 2>&1
  pre=$?; say "preflight rc=$pre"
fi
if [ "$pre" -ne 0 ] && [ "${TP2_FORCE:-0}" != 1 ]; then
  say "preflight failed: the server's --tp 2 --device cuda path cannot work as is (scripts/h200x2/README.md, 'Blockers'); serving parts skipped"
  serving=0
else
  serving=1
fi

# --- tiny-a vectors: TP1 vs TP2 -----------------------------------------------------------------------------------
if [ "$serving" = 1 ] && [ -f "$VEC/vectors.safetensors" ]; then
  tiny=(--model "$VEC/checkpoint" --device "$DEV" --max-model-len 4096 --state-budget-gib 2 --prompt-cache-gib 0
        --shutdown-grace-s 3)
  python3 -m dsv41 serve "${tiny[@]}" --port 18001 > "$LOG/vectors-tp1.log" 2>&1 & t1=$!; pids+=("$t1")
  scripts/serve.sh --tp 2 --master 127.0.0.1:29600 "${tiny[@]}" --port 18002 > "$LOG/vectors-tp2.log" 2>&1 &
  t2=$!; pids+=("$t2")
  if health http://127.0.0.1:18001 120 "$t1" && health http://127.0.0.1:18002 120 "$t2"; then
    timeout -k 5 150 $B vectors --tp1 http://127.0.0.1:18001 --tp2 http://127.0.0.1:18002 --vectors "$VEC" \
        --out "$P/vectors.json" > "$LOG/vectors.log" 2>&1; say "vectors rc=$?"
  else
    say "vectors: a server did not come up (logs/vectors-tp*.log)"
  fi
  stop_pids 30 "$t1" "$t2"
  # rank 1's last line: its rounds and how many it prepared while the round before ran (rank 0's Ahead hints)
  say "vectors: $(grep -ho 'rank 0 shut down;.*' "$LOG/vectors-tp2.log" | tail -1)"
else
  say "vectors: skipped (serving=$serving, vectors at $VEC)"
fi

# --- the real-shaped checkpoint served on both GPUs ---------------------------------------------------------------
while [ "$mk" != 0 ] && kill -0 "$mk" 2>/dev/null && [ "$(el)" -lt 300 ]; do sleep 2; done
ckok=1
if [ "$mk" = 0 ]; then made="existing"
else made="make_real rc=$(cat "$P/make_real.rc" 2>/dev/null || echo 'still running')"
     [ "$(cat "$P/make_real.rc" 2>/dev/null)" = 0 ] || ckok=0; fi      # a half-written checkpoint is not served
say "checkpoint $CK: $made, $(du -sh "$CK" 2>/dev/null | cut -f1)"
if [ "$serving" = 1 ] && [ "$ckok" = 1 ] && [ -f "$CK/config.json" ]; then
  rm -rf "$P/stats"
  PYTHON="$B hook" DSV41_TP2_STATS="$P/stats" scripts/serve.sh --tp 2 --master 127.0.0.1:29610 --device "$DEV" \
      --model "$CK" --port 18003 --max-streams 32 --shutdown-grace-s 5 > "$LOG/serve.log" 2>&1 &
  sp=$!; pids+=("$sp")
  if health http://127.0.0.1:18003 150 "$sp"; then
    say "serve: ready at $(el)s"
    budget=$(( DEADLINE - $(el) - 45 )); [ "$budget" -gt "${TP2_SERVE_S:-200}" ] && budget=${TP2_SERVE_S:-200}
    timeout -k 5 $(( budget + 60 )) $B serve --url http://127.0.0.1:18003 --stats "$P/stats" --checkpoint "$CK" \
        --tokens "${TP2_TOKENS:-4}" --budget-s "$budget" --streams "${TP2_STREAMS:-1,8,32}" \
        --prompts "${TP2_PROMPTS:-8192,32768,131072}" --out "$P/serve.json" > "$LOG/serve-bench.log" 2>&1
    say "serve bench rc=$? (budget ${budget}s)"
    r1=$(pgrep -f -- "--master 127.0.0.1:29610 .*--rank 1" | head -1)
    if [ -n "$r1" ]; then
      timeout -k 5 90 $B kill --url http://127.0.0.1:18003 --pid "$r1" --rank 1 --server-pid "$sp" \
          --log "$LOG/serve.log" --checkpoint "$CK" --wait-s 60 --out "$P/kill.json" > "$LOG/kill.log" 2>&1
      say "kill rc=$?"
      if kill -0 "$sp" 2>/dev/null; then                   # it should have exited by itself: say so, stop it
        say "serve.sh still running after the kill"; echo "still running" > "$P/server_rc.txt"; stop_pids 20 "$sp"
      else
        wait "$sp"; echo $? > "$P/server_rc.txt"; say "serve.sh exited $(cat "$P/server_rc.txt")"
      fi
    else
      say "kill: rank 1 not found"
    fi
  else
    say "serve: not ready (logs/serve.log)"
  fi
else
  say "serve: skipped (serving=$serving, checkpoint ok=$ckok at $CK)"
fi
stop_all

# --- report, bundle -----------------------------------------------------------------------------------------------
$B report --parts "$P" --out "$OUT/tp2-h200x2.md" --commit "$COMMIT" --command "bash scripts/h200x2/all.sh" \
    > "$LOG/report.log" 2>&1; say "report rc=$?"
cp "$P/comm-cuda-x2.md" "$OUT/" 2>/dev/null
tar czf "$OUT/tp2-bundle.tgz" -C "$OUT" tp2 && rm -rf "$P"
say "done at $(el)s"
