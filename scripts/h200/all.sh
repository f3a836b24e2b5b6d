#!/usr/bin/env bash
# One device call for every part's H200 evidence: install the carried wheels once, then run each part's script
# under its own time limit. Usage (on the H200, repo root): bash scripts/h200/all.sh [part ...]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
mkdir -p "$OUT/bench/results"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  parts=($(ls scripts/h200/*.sh | xargs -n1 basename | sed 's/\.sh$//' | grep -v '^all$'))
fi
limit=${PART_LIMIT_S:-240}
for p in "${parts[@]}"; do
  start=$(date +%s)
  timeout -k 10 "$limit" bash "scripts/h200/$p.sh" > "$OUT/$p.log" 2>&1
  rc=$?
  echo "$p rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
done
