#!/usr/bin/env bash
# Issue 8's first Done-when on the H200: the server with --device cuda on the built-in tiny checkpoint gives the CPU
# server's greedy tokens (torch fallbacks) and each reply alone equals it inside a 32-stream burst (fallbacks, then
# kernels with CUDA graphs): tests/test_gpu_cuda.py -k server, three servers in turn. It ran past 200 s twice inside
# gpu.sh without a verdict, so it has a call part of its own now, and prints each stage's time past pytest's capture
# ("[server test +...s]" lines). Knob (env): GPU_SERVER_TEST_S (540; PART_LIMIT_S=570 for all.sh).
set -u
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0
t0=$(date +%s)
timeout -s INT -k 10 "${GPU_SERVER_TEST_S:-540}" python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs \
    tests/test_gpu_cuda.py -k server 2>&1
echo "gpuserver.sh: done at $(( $(date +%s) - t0 ))s"
