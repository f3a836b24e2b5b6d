#!/bin/bash
# issue 30 (EXL3 CUDA C kernel), helper exl3 (session 11; not run: no device that session) -- from the repo root
# (branch exl3 or main after its merge) on the H200, ~2.5-3 min:   bash exl3_device.sh
# env: PYTHONPATH=/tmp/site:$PWD (set below). Writes $OUT/exl3/: tests.txt (pytest), bench.txt (stdout), exl3.md
# (the bench's markdown, rewritten after every section so a cut run keeps what it measured), nvidia-smi.txt, commit.txt.
# Expected:
#  - tests/test_exl3_cuda.py all pass (first use compiles exl3.cu with NVRTC, ~25-40 s, the served kernels; the bench
#    forms are a second module, exl3.cu#EXL3_BENCH_FORMS, ~5 s at their first use in the bench; then the GPU
#    product vs reference for 17 rates, rows 1..70 bitwise invariant, grouped == per expert, graph replay, exllamav3
#    fixtures, V4.1 shapes, warp ring == served bits) and tests/test_cuda_launch_abi.py (ctypes layout vs cuda.h).
#  - the bench (--quick --no-triton: CUDA C only) prints, in order:
#    * ceilings (copy/read TB/s, fp16 GEMM);
#    * decode round B=1 and B=8: served CUDA C, and "cuda pdl" (the same launches as programmatic dependent
#      launches), then the routed launches alone on every form: served, pdl, w (warp ring), o (64 registers),
#      r (register-direct), n (no decode: wrong values), e (no stages: wrong values), split targets 132 and 792,
#      and the served exl3_routed path;
#    * "dependent launches, a chain of 3 linears in a graph: the plain launches' bits: True" (must be True);
#    * 4 single linears at rows 1 and 8;
#    * the split sweep (targets 132/396/792) and the forms per linear at 1 row (w, o, r at 8 rows too), with
#      "the served bits (8 rows): w True, o True, r True" (must all be True).
#  Reading it: e = the fixed chain (launch, partials, reduction, output rotation); n - e = streaming the weights;
#  served - n = the codebook arithmetic. Pick the served defaults (form, split target, pdl) from the routed rows
#  at B=1 and B=8 and the decode round; a form is only worth serving if its bits line says True.
#  - ncu.txt (only if ncu is there and time is left): SpeedOfLight / Occupancy / WarpStateStats of the served
#    kernel at 1 row on the expert w1 and wq_b shapes (issue-bound or latency-bound: the stall reasons say).
# exllamav3's own column is left out: its extension build (~273 s) does not fit a call.
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/out}/exl3
mkdir -p "$O"
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$O/nvidia-smi.txt" 2>&1
git log --oneline -1 > "$O/commit.txt" 2>&1
timeout -k 5 100 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE --durations=5 tests/test_exl3_cuda.py \
    tests/test_cuda_launch_abi.py 2>&1 | tee "$O/tests.txt" | tail -25
echo "exl3: tests done at $(( $(date +%s) - t0 ))s"
timeout -k 5 $(( 178 - $(date +%s) + t0 )) python3 bench/exl3_bench.py --quick --no-triton --out "$O/exl3.md" \
    2>&1 | tee "$O/bench.txt" | tail -40
echo "exl3: bench done at $(( $(date +%s) - t0 ))s"
# if ncu is there and time is left: speed-of-light, occupancy and warp stalls of the served kernel at 1 row
# (expert w1 2.5-bit MUL1, wq_b 4-bit 3INST), one launch each -> ncu.txt
left=$(( 178 - $(date +%s) + t0 ))
if command -v ncu >/dev/null && [ $left -gt 30 ]; then
  timeout -k 5 $left ncu --section SpeedOfLight --section Occupancy --section WarpStateStats -k regex:exl3_k \
    -c 2 python3 -c "
import torch, sys; sys.path.insert(0, '.')
from bench.exl3_bench import parts, CB_MUL1, CB_3INST
from kernels.exl3 import Exl3Weight, exl3_linear_cuda
g = torch.Generator().manual_seed(0)
for n_in, n_out, K, cb in ((5120, 2304, 2.5, CB_MUL1), (1280, 32768, 4, CB_3INST)):
    w = Exl3Weight.from_tensors(parts(n_in, n_out, K, cb, g), 'cuda')
    exl3_linear_cuda(torch.randn(1, n_in, device='cuda'), w)
torch.cuda.synchronize()
" > "$O/ncu.txt" 2>&1
fi
echo "exl3: done at $(( $(date +%s) - t0 ))s"
