"""Torch ops (and Triton launches) per layer of the row-wise parts of a layer (issue 8): the mHC mixes with their
Sinkhorn iterations, hc_collapse / hc_expand, RMSNorm, and the MoE (routing, experts, combine), at V4.1 row shapes
(hidden 5120, hc 4, 20 Sinkhorn iterations; the MoE with 384 experts, top-6, at a small expert width: its op count
does not depend on the width). On a GPU each non-view op is about one kernel launch, whatever the row count.

Counts every aten op dispatched (TorchDispatchMode) apart from view ops and bare allocations (no kernel on a
GPU), plus the Triton launches (the interpreter's own copies of their arguments not counted), for rows 1 / 8 / 32, on three paths, all on the CPU:
- `cpu`: the CPU reference path;
- `cuda (fallbacks)`: the CUDA path's functions (fixed-tree row sums, the per-expert MoE loop) on CPU tensors
  (the op set cuda_ops(kernels=False));
- `cuda (kernels)`: the same with the row-op kernels (kernels/rowops.py) and the grouped MoE kernel, run by the
  Triton interpreter (launches counted, not timed).
A layer = 2 x (hc_mixes + hc_collapse + rms_norm + hc_expand) + moe (attention, compressor, indexer not counted).

    OMP_NUM_THREADS=1 python bench/layer_ops.py [--rows 1,8,32] [--json F] [--before F.json]
                                                [--out bench/results/layer-ops-cpu.md]

--before: a --json file written by a run of an earlier checkout (the table then shows before -> after; run that
checkout's own copy of this script).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
from functools import partial
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")   # the kernels run in the interpreter (counted, not timed)

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv41.model import device, mhc, quant
from dsv41.model.moe import Expert, MoE
from dsv41.model.ops import cuda_ops, reference_ops

H, HC, ITERS = 5120, 4, 20
N_EXP, TOP_K, MOE_H, MOE_I = 384, 6, 128, 64
GROUPS = ("hc_mixes", "hc_collapse", "rms_norm", "hc_expand", "moe")
PATHS = ("cpu", "cuda (fallbacks)", "cuda (kernels)")
# no kernel on a GPU: views' metadata, and allocations without a fill
NO_LAUNCH = {"detach", "alias", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        # the interpreter's own copies of a launch's arguments are not ops of the path (one launch on a GPU)
        if not (func.is_view or name in NO_LAUNCH or _in_launch[0]):
            self.ops += 1
        return func(*args, **(kwargs or {}))


_launches = [0]
_in_launch = [False]


def _count_launches():
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    run = interpreter.InterpretedFunction.run

    def counted(self, *a, **k):
        _launches[0] += 1
        _in_launch[0] = True
        try:
            return run(self, *a, **k)
        finally:
            _in_launch[0] = False
    interpreter.InterpretedFunction.run = counted


def path_ops(name: str):
    """The op set of a path (dsv41/model/ops.py)."""
    return {"cpu": reference_ops(), "cuda (fallbacks)": cuda_ops(kernels=False), "cuda (kernels)": cuda_ops()}[name]


def _moe(g, quantised: bool) -> MoE:
    def fp4(rows, cols):
        w = torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8)
        s = torch.randint(120, 124, (rows, cols // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return device.Fp4Weight(w, s) if quantised else quant.dequant_fp4(w, s)
    experts = {e: Expert(fp4(MOE_I, MOE_H), fp4(MOE_H, MOE_I), fp4(MOE_I, MOE_H)) for e in range(N_EXP)}
    shared = Expert(torch.randn(MOE_I, MOE_H, generator=g) * 0.1, torch.randn(MOE_H, MOE_I, generator=g) * 0.1,
                    torch.randn(MOE_I, MOE_H, generator=g) * 0.1)
    moe = MoE(gate=torch.randn(N_EXP, MOE_H, generator=g), bias=torch.zeros(N_EXP), bias_vl=torch.zeros(N_EXP),
              experts=experts, shared=shared, top_k=TOP_K, gate_temp=1.0, scaling=1.5, limit=10.0)
    if quantised:
        moe.stack = device.stack_experts(experts, N_EXP)
    return moe


def measure(rows_list: list[int]) -> dict:
    g = torch.Generator().manual_seed(0)
    parts = {"fn": torch.randn((2 + HC) * HC, HC * H, generator=g) * 0.01,
             "base": torch.randn((2 + HC) * HC, generator=g) * 0.1, "scale": torch.rand(3, generator=g)}
    norm_w = torch.rand(H, generator=g) + 0.5
    moes = {False: _moe(g, False), True: _moe(g, True)}
    out: dict = {}
    for p in PATHS:
        ops = path_ops(p)
        site = mhc.HcSite(**parts, ops=ops)
        moe = dataclasses.replace(moes[p == "cuda (kernels)"], ops=ops)
        for rows in rows_list:
            g = torch.Generator().manual_seed(rows)   # the same inputs on every path
            streams = torch.randn(rows, HC, H, generator=g)
            y = torch.randn(rows, H, generator=g)
            xm = torch.randn(rows, MOE_H, generator=g)
            pre, post, comb = mhc.hc_mixes(streams, site, ITERS, 1e-6, 1e-20)
            calls = {
                "hc_mixes": partial(mhc.hc_mixes, streams, site, ITERS, 1e-6, 1e-20),
                "hc_collapse": partial(ops.hc_collapse, streams, pre),
                "rms_norm": partial(ops.rms_norm, y, norm_w, 1e-20),
                "hc_expand": partial(ops.hc_expand, y, streams, post, comb),
                "moe": partial(moe, xm),
            }
            counts = {}
            for name, fn in calls.items():
                fn()   # warm (caches, lazy imports)
                _launches[0] = 0
                with Counter() as c:
                    fn()
                counts[name] = c.ops + _launches[0]
            counts["layer"] = 2 * sum(counts[k] for k in GROUPS[:4]) + counts["moe"]
            out[f"{p}|{rows}"] = counts
    return out


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"


def render(after: dict, before: dict | None, rows_list: list[int], command: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout
    lines = ["# Ops per layer of the row-wise parts (bench/layer_ops.py)", "",
             f"Command: `{command}`", f"Machine: {_machine()}", f"Checkout: {commit.strip()} (+ working tree)", "",
             "Aten ops other than views and bare allocations, + Triton launches (each about one GPU launch). Shapes: hidden 5120, hc 4, 20 Sinkhorn "
             "iterations; MoE 384 experts top-6 (small width). layer = 2 x (hc_mixes + hc_collapse + rms_norm + "
             "hc_expand) + moe." + (" Cells: before -> after." if before else ""), ""]
    for p in PATHS:
        lines += [f"## {p}", "", "| rows | " + " | ".join(GROUPS) + " | layer |",
                  "|---:|" + "---:|" * (len(GROUPS) + 1)]
        for rows in rows_list:
            a = after.get(f"{p}|{rows}")
            b = (before or {}).get(f"{p}|{rows}")
            if a is None:
                continue
            cells = [f"{b[k]} -> {a[k]}" if b else str(a[k]) for k in GROUPS + ("layer",)]
            lines.append(f"| {rows} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--json")
    ap.add_argument("--before")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows_list = [int(r) for r in a.rows.split(",")]
    _count_launches()
    res = measure(rows_list)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    before = json.loads(Path(a.before).read_text()) if a.before else None
    text = render(res, before, rows_list, "OMP_NUM_THREADS=1 python " + " ".join(["bench/layer_ops.py", *sys.argv[1:]]))
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
