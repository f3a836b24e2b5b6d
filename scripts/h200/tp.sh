#!/usr/bin/env bash
# Issue 7 on the H200: two ranks on the one GPU through the cuda-ipc ring. (1) the ring's exactness test on CUDA,
# (2) the ring latency for a decode round's tensors, (3) TP2 serving == TP1 on the GPU (both ranks on cuda:0).
set -u
python3 -m pytest -q -p no:cacheprovider tests/test_comm_ring.py -k cuda 2>&1 | tail -5
python3 bench/comm_bench.py --device cuda --out "$OUT/bench/results/comm-cuda.md" 2>&1 | tail -25
DSV41_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_tp_serve.py \
    -k "reply_as_one or kept_states" 2>&1 | tail -15
