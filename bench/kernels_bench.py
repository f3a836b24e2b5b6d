"""Micro-bench of kernels/fp8_linear.py, fp4_moe.py and sparse_attn.py at V4.1 shapes (random weights).

Decode rows (1, 8, 32, 64): time per call (one CUDA graph replay) against the bytes the call must read (the FP8
weight and its scales, or the packed FP4 weights and scales of the experts the round touches, + x and y; for
attention the q rows, the 640 latents of each row and the output), as a fraction of the device-to-device copy
bandwidth measured in the same run.
Prompt rows (4096): TFLOP/s against the bf16 GEMM rate (torch, 8192^3) measured in the same run.

  python3 bench/kernels_bench.py [--out bench/results/kernels.md] [--experts 384]
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.fp4_moe import fp4_moe
from kernels.fp8_linear import fp8_linear, fp8_split
from kernels.sparse_attn import sparse_attn

H, INTER, TOPK, LIMIT = 5120, 2304, 6, 10.0
HEADS, HEAD_DIM, WINDOW, INDEX_TOPK = 64, 512, 128, 512
FP8 = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_a group", 1024, 4096),
       ("wo_b", 5120, 8192), ("shared w1/w3", 2304, 5120), ("shared w2", 5120, 2304), ("indexer wq_b", 4096, 1280)]
DECODE_ROWS = (1, 8, 32, 64)
PROMPT_ROWS = 4096


def ceilings():
    n = 1 << 30                                   # 2 GiB buffers: far past the 60 MB L2
    a = torch.empty(n, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    t_copy = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50, return_mode="median") * 1e-3
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    t_mm = triton.testing.do_bench(lambda: x @ y, warmup=5, rep=50, return_mode="median") * 1e-3
    return 2 * n * 2 / t_copy, 2 * m ** 3 / t_mm


def time_graph(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3


def fp8_weight(out_f, in_f):
    w = (torch.randn(out_f, in_f, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(112, 122, (triton.cdiv(out_f, 32), in_f // 32), dtype=torch.uint8, device="cuda")
    return w, s


def write(path, rows_dec, rows_pre, bw, mm, partial, commit=""):
    """The results file; rewritten after each section so a run cut by its time limit keeps what it measured."""
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, check=False).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    lines = [
        "# Triton kernels: fp8_linear, fp4_moe and sparse_attn at V4.1 shapes", "",
        f"- command: `python3 {' '.join(sys.argv)}` (scripts/h200/kernels.sh), commit {commit}",
        (f"- machine: {torch.cuda.get_device_name()} ({socket.gethostname()}), torch {torch.__version__}, "
         f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"),
        (f"- ceilings measured in the same run: device copy {bw / 1e12:.2f} TB/s (read+write bytes), "
         f"bf16 GEMM (torch, 8192^3) {mm / 1e12:.0f} TFLOP/s"),
        "- times: median CUDA-graph replay of one call (triton.testing.do_bench_cudagraph); random weights"
        + ("; PARTIAL: the run stopped before its last section" if partial else ""),
        "", "## Decode rows: time vs bytes read", "",
        "| call | rows | bytes read (MB) | time (us) | TB/s | % of copy bandwidth |", "|---|---|---|---|---|---|"]
    for name, n, nb, t in rows_dec:
        lines.append(f"| {name} | {n} | {nb / 1e6:.1f} | {t * 1e6:.1f} | {nb / t / 1e12:.2f} | {nb / t / bw * 100:.0f}% |")
    lines += ["", f"## Prompt rows ({PROMPT_ROWS}): matrix rate", "",
              "| call | GFLOP | time (ms) | TFLOP/s | % of bf16 GEMM |", "|---|---|---|---|---|"]
    for name, fl, t in rows_pre:
        lines.append(f"| {name} | {fl / 1e9:.0f} | {t * 1e3:.3f} | {fl / t / 1e12:.0f} | {fl / t / mm * 100:.0f}% |")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernels.md"))
    ap.add_argument("--experts", type=int, default=384, help="routed experts in the stack (V4.1: 384)")
    ap.add_argument("--commit", default=os.environ.get("DSV41_COMMIT", ""),
                    help="the commit measured (the device copy's git HEAD can be stale); default: git rev-parse")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw, mm = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {mm / 1e12:.0f} TFLOP/s", flush=True)

    rows_dec, rows_pre = [], []
    for name, out_f, in_f in FP8:
        w, s = fp8_weight(out_f, in_f)
        for n in DECODE_ROWS:
            x = torch.randn(n, in_f, device="cuda")
            t = time_graph(lambda x=x, w=w, s=s: fp8_linear(x, w, s))
            nb = w.numel() + s.numel() + 4 * n * (in_f + out_f)
            rows_dec.append((f"fp8 {name} [{out_f}x{in_f}] S={fp8_split(out_f, in_f)}", n, nb, t))
            print(f"{rows_dec[-1][0]} rows {n}: {t * 1e6:.1f} us, {nb / t / 1e12:.2f} TB/s "
                  f"({nb / t / bw * 100:.0f}% of copy)", flush=True)
        x = torch.randn(PROMPT_ROWS, in_f, device="cuda")
        t = time_graph(lambda x=x, w=w, s=s: fp8_linear(x, w, s))
        fl = 2 * PROMPT_ROWS * out_f * in_f
        rows_pre.append((f"fp8 {name} [{out_f}x{in_f}]", fl, t))
        print(f"{rows_pre[-1][0]} rows {PROMPT_ROWS}: {fl / t / 1e12:.0f} TFLOP/s ({fl / t / mm * 100:.0f}% of bf16)",
              flush=True)
    torch.cuda.empty_cache()
    write(args.out, rows_dec, rows_pre, bw, mm, partial=True, commit=args.commit)

    E = args.experts
    w13 = torch.randint(-128, 128, (E, 2 * INTER, H // 2), dtype=torch.int8, device="cuda")
    s13 = torch.randint(118, 122, (E, 2 * INTER, H // 32), dtype=torch.uint8, device="cuda")
    w2 = torch.randint(-128, 128, (E, H, INTER // 2), dtype=torch.int8, device="cuda")
    s2 = torch.randint(118, 122, (E, H, INTER // 32), dtype=torch.uint8, device="cuda")
    per_expert = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
    for scaled in (False, True):
        how = "tl.dot_scaled" if scaled else "unpacked"
        for n in DECODE_ROWS + (PROMPT_ROWS,):
            ids = torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(n)]).to(torch.int32)
            wts = torch.rand(n, TOPK, device="cuda")
            x = torch.randn(n, H, device="cuda")
            try:
                t = time_graph(lambda x=x, ids=ids, wts=wts, sc=scaled: fp4_moe(x, w13, s13, w2, s2, ids, wts, LIMIT,
                                                                              scaled_dot=sc))
            except Exception as exc:  # noqa: BLE001 -- report the path that fails, keep the others' figures
                print(f"fp4_moe ({how}) rows {n} failed: {type(exc).__name__}: {exc}"[:400], flush=True)
                break
            touched = int(torch.unique(ids).numel())
            name = f"fp4_moe ({how}) top-{TOPK} of {E} ({touched} touched)"
            if n == PROMPT_ROWS:
                fl = 2 * n * TOPK * 3 * INTER * H
                rows_pre.append((name, fl, t))
                print(f"{name} rows {n}: {fl / t / 1e12:.0f} TFLOP/s ({fl / t / mm * 100:.0f}% of bf16)", flush=True)
            else:
                nb = touched * per_expert + 4 * n * H * 2
                rows_dec.append((name, n, nb, t))
                print(f"{name} rows {n}: {t * 1e6:.1f} us, {nb / t / 1e12:.2f} TB/s ({nb / t / bw * 100:.0f}% of copy)",
                      flush=True)

    write(args.out, rows_dec, rows_pre, bw, mm, partial=True, commit=args.commit)
    pool = torch.randn(65536, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(HEADS, device="cuda")
    keys = WINDOW + INDEX_TOPK
    for n in DECODE_ROWS + (PROMPT_ROWS,):
        q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        idx = torch.randint(0, pool.shape[0], (n, keys), device="cuda", dtype=torch.int32)
        t = time_graph(lambda q=q, idx=idx: sparse_attn(q, pool, idx, sink, HEAD_DIM ** -0.5))
        name = f"sparse_attn {HEADS} heads x {HEAD_DIM}, {keys} keys/row (bf16 latents)"
        if n == PROMPT_ROWS:
            fl = 4 * n * HEADS * keys * HEAD_DIM
            rows_pre.append((name, fl, t))
            print(f"sparse_attn rows {n}: {fl / t / 1e12:.0f} TFLOP/s ({fl / t / mm * 100:.0f}% of bf16)", flush=True)
        else:
            nb = n * (HEADS * HEAD_DIM * (2 + 4) + keys * (HEAD_DIM * 2 + 4))
            rows_dec.append((name, n, nb, t))
            print(f"sparse_attn rows {n}: {t * 1e6:.1f} us, {nb / t / 1e12:.2f} TB/s ({nb / t / bw * 100:.0f}% of copy)",
                  flush=True)

    write(args.out, rows_dec, rows_pre, bw, mm, partial=False, commit=args.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
