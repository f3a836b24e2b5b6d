#!/usr/bin/env bash
# Issue 8's first Done-when on the H200: the server with --device cuda on the built-in tiny checkpoint gives the CPU
# reference's greedy tokens within the vectors' QAT criteria (torch fallbacks, teacher-forced) and each reply alone
# equals it inside a 32-stream burst (fallbacks, then kernels with CUDA graphs); then the server on a real-shaped
# partial checkpoint (make_real, 2 layers): 32 replies alone == in a 32-stream burst. tests/test_gpu_cuda.py -k
# server. It ran past 200 s twice inside gpu.sh without a verdict, so it has a call part of its own and prints each
# stage's time past pytest's capture ("[server test +...s]" lines). Knob (env): GPU_SERVER_TEST_S (540;
# PART_LIMIT_S=570 for all.sh).
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
t0=$(date +%s)
ck=/tmp/dsv41-real-2       # the real-shaped partial checkpoint (2 layers, release shapes) for the second server test
[ -f "$ck/config.json" ] || timeout -k 5 90 python3 -m dsv41.tools.make_real --layers 2 --out "$ck" 2>&1 | tail -1
export DSV41_REAL_CHECKPOINT=$ck
timeout -s INT -k 10 "${GPU_SERVER_TEST_S:-540}" python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs \
    tests/test_gpu_cuda.py -k server 2>&1
echo "gpuserver.sh: done at $(( $(date +%s) - t0 ))s"
