#!/usr/bin/env bash
# Long prompts on the H200 (docs/long.md): a real-shaped partial checkpoint (dsv41.tools.make_real; the one gpu.sh
# made is reused) takes the longest filler prompt toward 1,048,576 tokens that LONG_BUDGET_S allows, in prompt
# passes of LONG_CHUNK rows; then decode rounds after it, peak GPU and host memory against the memory plan, and four
# prompts at once == each alone (160K each when time allows, else shortened: the result file says so).
# Writes $OUT/bench/results/long-h200.md. Within all.sh's PART_LIMIT_S (240 s by default; the 1M prompt wants a call
# of its own: PART_LIMIT_S=570 LONG_BUDGET_S=330). Knobs (env): LONG_LAYERS (2), LONG_CHUNK (4096), LONG_BUDGET_S
# (90), LONG_FOUR (163840), LONG_FOUR_BUDGET_S (50). Degrades with a line saying what it skipped.
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
why=$(python3 - <<'PY'
import inspect
import torch
from dsv41.model.model import Model
if not torch.cuda.is_available():
    print("no CUDA device visible")
elif "device" not in inspect.signature(Model.load).parameters:
    print("Model.load has no device argument yet")
else:
    try:
        import dsv41.tools.make_real  # noqa: F401
    except ImportError:
        print("dsv41.tools.make_real does not exist yet")
PY
)
if [ -n "$why" ]; then
  echo "long.sh: SKIPPED the H200 long-prompt run: $why"
  exit 0
fi
ck=/tmp/dsv41-real-${LONG_LAYERS:-2}
if [ ! -f "$ck/config.json" ]; then
  timeout -k 5 100 python3 -m dsv41.tools.make_real --layers "${LONG_LAYERS:-2}" --out "$ck" 2>&1 | tail -3
fi
if [ ! -f "$ck/config.json" ]; then
  echo "long.sh: SKIPPED: make_real did not produce $ck"
  exit 0
fi
echo "long.sh: checkpoint $ck ($(du -sh "$ck" | cut -f1)) at $(( $(date +%s) - t0 ))s"
echo "long.sh: note: make_real has no Engram layers, so Engram row reads are not part of this run"
# what is left of the part's limit (all.sh's PART_LIMIT_S, 240 s by default) after the checkpoint: ~60 s to load
# and decode, the rest 60/40 prompt/four
left=$(( ${PART_LIMIT_S:-240} - 15 - ($(date +%s) - t0) - 60 ))
budget=${LONG_BUDGET_S:-90}; four_s=${LONG_FOUR_BUDGET_S:-50}
[ $(( left * 6 / 10 )) -lt "$budget" ] && budget=$(( left * 6 / 10 ))
[ $(( left * 4 / 10 / 2 )) -lt "$four_s" ] && four_s=$(( left * 4 / 10 / 2 ))
if [ "$budget" -lt 10 ]; then
  echo "long.sh: SKIPPED: only ${left}s left after making the checkpoint"
  exit 0
fi
echo "long.sh: prompt budget ${budget}s, four-prompt budget ${four_s}s"
timeout -k 5 $(( budget + 2 * four_s + 70 )) python3 bench/long_bench.py --checkpoint "$ck" --device cuda \
    --tokens 1048576 --chunk "${LONG_CHUNK:-4096}" --budget-s "$budget" --decode 16 --report-every 8 \
    --four "${LONG_FOUR:-163840}" --four-budget-s "$four_s" \
    --out "$OUT/bench/results/long-h200.md" 2>&1 | tail -60
echo "long.sh: rc=${PIPESTATUS[0]} done at $(( $(date +%s) - t0 ))s"
