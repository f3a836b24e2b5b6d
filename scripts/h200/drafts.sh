#!/usr/bin/env bash
# Issue 10 on the H200 (docs/drafts.md): bench/draft_bench.py on CUDA -> $OUT/bench/results/drafts-h200.md.
# (1) a real-shaped partial checkpoint (dsv41.tools.make_real, 2 layers, shared with gpu.sh's /tmp/dsv41-real-2):
#     verify-forward time by rows for 1/8/32 streams x 0..5 draft tokens, tokens/s at acceptance 0.3/0.5/0.7 vs
#     serial (its draft pass is estimated: make_real has no DSpark stages); (2) the tiny checkpoint, which has the
#     DSpark head: measured draft pass and the on-device exactness check (verify rows == one-row decoding,
#     torch.equal). Under 3 minutes.
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
mkdir -p "$OUT/bench/results"
t0=$(date +%s)
ck=/tmp/dsv41-real-2
[ -f "$ck/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" 2>&1 | tail -3
echo "drafts.sh: checkpoint at $(( $(date +%s) - t0 ))s"
timeout -k 5 60 python3 bench/draft_bench.py --model "$ck" --device cuda --streams 1,8,32 --context 256 --reps 3 \
    --project-layers 43 --out "$OUT/bench/results/drafts-h200.md" 2>&1 | tail -40
echo "drafts.sh: real-shaped bench at $(( $(date +%s) - t0 ))s"
timeout -k 5 60 python3 bench/draft_bench.py --device cuda --streams 1,8,32 --context 128 --reps 2 --check \
    --out "$OUT/bench/results/drafts-h200-tiny.md" 2>&1 | tail -30
echo "drafts.sh: done at $(( $(date +%s) - t0 ))s"
