#!/usr/bin/env bash
# Issue 10 on the H200 (docs/drafts.md): bench/draft_bench.py on CUDA -> $OUT/bench/results/drafts-h200.md.
# (1) a real-shaped partial checkpoint with the release's DSpark stages: dsv41.tools.make_real --layers 2 (shared
#     with gpu.sh / long.sh as /tmp/dsv41-real-2, made here when missing, ~25 s), then --dspark --reuse of it into
#     /tmp/dsv41-real-2-dspark (its backbone shards linked, only the 3 stages written: ~7 GB, ~10 s; the taps are
#     the cut's 2 layers, so main_proj reads 2 x 5120 where the release reads 3 x 5120): verify-forward time by rows
#     for 1/8/32 streams x 0..5 draft tokens, the DSpark ring fill inside it, the draft pass MEASURED at release
#     shape, tokens/s at acceptance 0.3/0.5/0.7 vs serial, projected to the release's 40 backbone layers;
#     (2) the tiny checkpoint: the on-device exactness check (verify rows == one-row decoding, torch.equal).
#     Under 3 minutes.
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" 2>&1 | tail -3
ckd=/tmp/dsv41-real-2-dspark
[ -f "$ckd/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers 2 --dspark --reuse "$ck" \
    --out "$ckd" 2>&1 | tail -3
echo "drafts.sh: checkpoints at $(( $(date +%s) - t0 ))s"; df -h /tmp | tail -1
timeout -k 5 90 python3 bench/draft_bench.py --model "$ckd" --device cuda --streams 1,8,32 --context 256 --reps 3 \
    --project-layers 40 --out "$OUT/bench/results/drafts-h200.md" 2>&1 | tail -45
echo "drafts.sh: real-shaped bench at $(( $(date +%s) - t0 ))s"
timeout -k 5 50 python3 bench/draft_bench.py --device cuda --streams 1,8 --context 128 --reps 2 --check \
    --out "$OUT/bench/results/drafts-h200-tiny.md" 2>&1 | tail -30
echo "drafts.sh: done at $(( $(date +%s) - t0 ))s"
