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
prev=""
for a in "$@"; do
  case "$a" in
    --tp=*) tp=${a#--tp=} ;;
    --rank|--rank=*) rank_given=1 ;;
  esac
  [ "$prev" = "--tp" ] && tp=$a
  prev=$a
done
if [ "$tp" = "1" ] || [ -n "$rank_given" ]; then
  exec $PY -m dsv41 serve "$@"
fi

# every rank on this host: the followers in the background; rank 0 (HTTP) in front. Rank 0 stops them cleanly
# when it exits; if it is killed, the trap stops them; if one of them dies, rank 0 exits naming it.
pids=()
for ((r = 1; r < tp; r++)); do
  $PY -m dsv41 serve "$@" --rank "$r" &
  pids+=($!)
done
$PY -m dsv41 serve "$@" --rank 0 &
r0=$!
followers_done() {   # wait up to $1 tenths of a second for the followers to end by themselves
  for ((i = 0; i < $1; i++)); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.1
  done
}
stop() {
  kill -TERM "$r0" 2>/dev/null || true
  wait "$r0" 2>/dev/null || true
  followers_done 50                      # rank 0's Shutdown reaches them (a loaded host may take seconds)
  kill -TERM "${pids[@]}" 2>/dev/null || true
}
trap 'stop; exit 143' TERM
trap 'stop; exit 130' INT
set +e
wait "$r0"
rc=$?
followers_done 50                        # rank 0's Shutdown reaches the followers; then nothing may outlive us
kill -TERM "${pids[@]}" 2>/dev/null
wait "${pids[@]}" 2>/dev/null
exit "$rc"
