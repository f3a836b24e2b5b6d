#!/usr/bin/env bash
# Serve dsv41 (OpenAI-compatible). Sets up .venv (scripts/setup.sh), then `python -m dsv41 serve "$@"` in it.
# No arguments: the built-in tiny checkpoint (made once, cached under ${XDG_CACHE_HOME:-~/.cache}/dsv41/) on
# 127.0.0.1:8000, on the GPU when there is one. `--model DIR`, `--host`, `--port`, all flags: docs/server.md.
# `--tp 2` (no --rank): both ranks on this host, rank 1 in the background, stopped with rank 0 (docs/tp.md).
# `--tp 2 --rank 1 --master HOST:PORT`: only that rank (a follower on another node).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh                     # .venv, made and filled when needed (PYTHON=... : that Python as it is)
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  PY="${DSV41_VENV:-$PWD/.venv}/bin/python"
fi

tp=${DSV41_TP:-1}
rank_given=${DSV41_RANK:+1}
grace=${DSV41_KILL_GRACE_S:-10}          # --kill-grace-s: the ranks left after one exits get SIGKILL after this
drain=${DSV41_SHUTDOWN_GRACE_S:-30}      # --shutdown-grace-s: rank 0's drain on SIGTERM comes on top of it
args=() fargs=() keys=()                 # rank 0's flags, the followers' flags (no key flags), the --api-key keys
prev=""
for a in "$@"; do
  case "$prev" in
    --tp) tp=$a ;;
    --kill-grace-s) grace=$a ;;
    --shutdown-grace-s) drain=$a ;;
  esac
  case "$a" in
    --tp=*) tp=${a#--tp=} ;;
    --rank|--rank=*) rank_given=1 ;;
    --kill-grace-s=*) grace=${a#*=} ;;
    --shutdown-grace-s=*) drain=${a#*=} ;;
  esac
  # API keys leave the ranks' command lines (anyone on the host reads those with `ps`) for DSV41_API_KEY; the
  # followers serve no HTTP and get no key flag at all
  if [ "$prev" = "--api-key" ]; then keys+=("$a"); prev=""; continue; fi
  case "$a" in
    --api-key) prev=$a; continue ;;
    --api-key=*) keys+=("${a#--api-key=}"); prev=""; continue ;;
  esac
  args+=("$a")
  case "$prev:$a" in
    --api-key-file:*|*:--api-key-file|*:--api-key-file=*) ;;
    *) fargs+=("$a") ;;
  esac
  prev=$a
done
if [ "$prev" = "--api-key" ]; then
  echo "dsv41: --api-key: expected a key after it" >&2
  exit 2
fi
if [ "${#keys[@]}" -gt 0 ]; then
  echo "dsv41: serve.sh: --api-key on a command line is visible to every user of this host (ps, /proc); prefer" \
       "--api-key-file FILE (mode 600) or DSV41_API_KEY; the ranks get the keys in DSV41_API_KEY" >&2
  DSV41_API_KEY=$(IFS=,; echo "${keys[*]}")
  export DSV41_API_KEY
fi
if [ "$tp" = "1" ] || [ -n "$rank_given" ]; then
  exec $PY -m dsv41 serve "${args[@]}"
fi

# every rank on this host: the followers in the background; rank 0 (HTTP) in front. Rank 0 stops them cleanly
# when it exits; if one of them dies or stops, rank 0 notices within --rank-lost-s and exits naming it. Whatever
# is left once a rank exited gets half of --kill-grace-s to end by itself, then SIGTERM (and SIGCONT, so a stopped
# rank takes it), then SIGKILL at the end of the grace: the script never waits forever, and exits non-zero unless
# every rank ended cleanly.
pids=()
for ((r = 1; r < tp; r++)); do
  $PY -m dsv41 serve "${fargs[@]}" --rank "$r" &
  pids+=($!)
done
$PY -m dsv41 serve "${args[@]}" --rank 0 &
r0=$!
tenths() { awk -v s="$1" 'BEGIN { printf "%d", s * 10 }'; }
wait_gone() {        # wait_gone TENTHS PID...: until every PID ended (0) or TENTHS tenths of a second passed (1)
  local n=$1 i p any
  shift
  for ((i = 0; i <= n; i++)); do
    any=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && any=1; done
    [ "$any" = 0 ] && return 0
    sleep 0.1
  done
  return 1
}
half=$(( $(tenths "$grace") / 2 ))
end_ranks() {        # end_ranks PID...: half the grace to end by themselves, then SIGTERM (+SIGCONT), then SIGKILL
  wait_gone "$half" "$@" && return 0
  echo "dsv41: serve.sh: rank process(es) $* still running: SIGTERM" >&2
  kill -TERM "$@" 2>/dev/null
  kill -CONT "$@" 2>/dev/null
  wait_gone "$half" "$@" && return 0
  echo "dsv41: serve.sh: rank process(es) $* still running after ${grace} s: SIGKILL" >&2
  kill -KILL "$@" 2>/dev/null
  return 0
}
exit_status() {      # rank 0's status, or 1 when it was 0 but a follower did not end cleanly
  local rc p
  wait "$r0" 2>/dev/null
  rc=$?
  for p in "${pids[@]}"; do
    wait "$p" 2>/dev/null || { [ "$rc" = 0 ] && rc=1; }
  done
  return "$rc"
}
on_signal() {        # SIGTERM/SIGINT to the script: rank 0 drains (--shutdown-grace-s), then stops the followers
  trap '' TERM INT
  kill -TERM "$r0" 2>/dev/null
  kill -CONT "$r0" 2>/dev/null
  wait_gone "$(( $(tenths "$drain") + $(tenths "$grace") ))" "$r0" || kill -KILL "$r0" 2>/dev/null
  end_ranks "${pids[@]}"
  exit "$1"
}
trap 'on_signal 143' TERM
trap 'on_signal 130' INT
set +e
while kill -0 "$r0" 2>/dev/null; do
  gone=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || gone=1; done
  [ "$gone" = 1 ] && break
  sleep 0.2
done
if kill -0 "$r0" 2>/dev/null; then
  echo "dsv41: serve.sh: a follower exited; rank 0 should stop by itself" >&2
  end_ranks "$r0"
fi
end_ranks "${pids[@]}"
exit_status
exit $?
