#!/bin/bash
# The FP4 experts lean decode form against t1 (issue 24; session 11 wrote it without a GPU, so it is off by default). Run from the
# repo root on the H200; ~3-4 min. Expected:
# - tests.txt: all pass (test_lean_decode_forms_give_the_t1_bits: every lean variant == the t1 bits, 1..64 rows,
#   scale codes above 128 too; test_v41_shapes_on_gpu[lean]: lean rows == the same rows among 2048 (t8 form)).
# - ab.txt: "equal=True" on every line; the lean forms (w1/w2/w4 warps a block; w2_packed = with the pack_x launch)
#   against t1 (the default now) and torch._scaled_grouped_mm at 1/8/32/64 rows. Target: >= 60 % of the copy
#   bandwidth at 1 and 32 rows and faster than the grouped-mm line. If a lean variant wins everywhere, set
#   fp4_moe.Config.lean to it and put the figures in bench/results/kernels.md (python bench/kernels_bench.py
#   --only experts --rows 1,8,32,64 times the default and lean=2 beside the grouped-mm column).
# - ncu.txt (if ncu is there): SpeedOfLight / occupancy / warp states of moe_*_t1 and moe_*_lean_w2 at 32 rows.
set -x
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/moe
git log --oneline -3 > $OUT/moe/commit.txt 2>&1; git status --short >> $OUT/moe/commit.txt 2>&1
timeout 150 python -m pytest -q -m gpu tests/test_kernels_fp4_moe.py tests/test_kernels_fp4_worklist.py \
    tests/test_kernels_prompt_gemm.py -k "moe or worklist or work_list" > $OUT/moe/tests.txt 2>&1
echo "tests rc=$?" >> $OUT/moe/tests.txt
timeout 150 python - > $OUT/moe/ab.txt 2>&1 <<'PY'
import sys, torch
sys.path.insert(0, "bench")
import kernels_bench as B
from kernels import fp4_moe as M
torch.manual_seed(0)
bw, _ = B.ceilings()
print(f"copy {bw/1e12:.2f} TB/s", flush=True)
stack = B.experts()
cfgs = {"t1": M.Config(impl="cuda", lean=0), "w1": M.Config(impl="cuda", lean=1),
        "w2": M.Config(impl="cuda", lean=2), "w4": M.Config(impl="cuda", lean=4),
        "w2_packed": M.Config(impl="cuda", lean=2, f32_rows=0)}
for k, c in cfgs.items():
    print("check", k, B.check_moe(stack, c), flush=True)
for n in (1, 8, 32, 64):
    ids = B.routings(n, 1)[0]; wts = torch.rand(n, B.TOPK, device="cuda"); x = torch.randn(n, B.H, device="cuda")
    outs = [M.fp4_moe(x, *stack, ids, wts, B.LIMIT, cfg=c) for c in cfgs.values()]
    eq = all(torch.equal(outs[0], o) for o in outs[1:])
    for name, cfg in cfgs.items():
        if (n in (8, 64) and name in ("w1", "w4")) or (n > 8 and name == "w2_packed"):
            continue
        t, nbytes, touched = B.time_moe(stack, n, cfg)
        print(f"rows {n} {name}: {t*1e6:.1f} us {nbytes/t/bw*100:.0f}% ({touched:.0f} touched) equal={eq}", flush=True)
del stack
torch.cuda.empty_cache()
for n in (1, 8, 32, 64):
    t, nbytes = B.grouped_mm_baseline(n)
    print(f"rows {n} torch._scaled_grouped_mm fp8: " + (t if isinstance(t, str) else
          f"{t*1e6:.1f} us {nbytes/t/bw*100:.0f}%"), flush=True)
PY
echo "ab rc=$?" >> $OUT/moe/ab.txt
if command -v ncu >/dev/null; then
timeout 60 ncu --kernel-name regex:"moe_(up|down)_(lean_w2|t1)" --launch-skip 4 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats python - > $OUT/moe/ncu.txt 2>&1 <<'PY'
import sys, torch
sys.path.insert(0, "bench")
import kernels_bench as B
from kernels import fp4_moe as M
stack = B.experts(64)
ids = B.routings(32, 1, 64)[0]; wts = torch.rand(32, B.TOPK, device="cuda"); x = torch.randn(32, B.H, device="cuda")
for cfg in (M.Config(impl="cuda", lean=0), M.Config(impl="cuda", lean=2)) * 3:
    M.fp4_moe(x, *stack, ids, wts, B.LIMIT, cfg=cfg)
torch.cuda.synchronize()
PY
fi
