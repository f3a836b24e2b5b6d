"""The prompt chunks' products at V4.1 shapes (issue 29): kernels/prompt_gemm.py beside the decode kernels the op set
ran for them before (csrc/decode.cu) and the off-the-shelf products, as TFLOP/s and % of the bf16 rate measured in
the same run (torch's 8192^3 bf16 matmul).

- FP8 projections of a layer at 256 (a large decode round: where the op set's switch sits), 2048 and 8192 rows: the prompt kernel, the CUDA C decode kernel, cuBLAS FP8
  (`torch._scaled_mm`, x quantised to FP8 with row-wise scales: a cheaper, different product, the off-the-shelf
  speed) and cuBLAS bf16 of the dequantised weight (the dequantisation not timed);
- the routed experts (384, top-6, H 5120, I 2304, random routing; the whole stack, 6.8 GB of FP4, so the L2 holds
  none of it) at the same rows: the prompt grouped GEMM and the CUDA C decode kernels; FLOPs 2 · pairs · 3HI,
  and the bytes of the experts touched against the copy bandwidth.
"bits": whether the prompt kernel's result has the decode kernel's bits (the op set switches between them by row
count, so a row's bits must not depend on which one ran).

  python3 bench/prompt_gemm_bench.py [--rows 256,2048,8192] [--sweep] [--only experts,wo_b,wq_b] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import socket
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels import fp4_moe as M
from kernels import fp8_linear as F
from kernels import prompt_gemm as P

H, INTER, TOPK, LIMIT, N_EXPERTS = 5120, 2304, 6, 10.0, 384
FP8 = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_a group x8", 8 * 1024, 4096),
       ("wo_b", 5120, 8192), ("shared w1+w3", 4608, 5120), ("shared w2", 5120, 2304), ("indexer wq_b", 4096, 1280)]


SWEPT = tuple(name for name, _, _ in FP8)   # the FP8 shapes --sweep times every candidate on


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median") * 1e-3


def ceilings():
    n = 1 << 30
    src = torch.empty(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src))
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    return 2 * n * 2 / t_copy, 2 * m ** 3 / bench(lambda: a @ b)


def commit_of() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


class Report:
    def __init__(self, path: Path, bw: float, mm: float):
        self.path, self.mm = path, mm
        self.head = ["# Prompt-chunk products at V4.1 shapes (issue 29)", "",
                     f"- command: `python3 {' '.join(sys.argv)}`, commit {commit_of()}",
                     (f"- machine: {torch.cuda.get_device_name()} ({socket.gethostname()}), torch {torch.__version__}, "
                      f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"),
                     (f"- ceilings in the same run: bf16 GEMM (torch, 8192^3) {mm / 1e12:.0f} TFLOP/s, device copy "
                      f"{bw / 1e12:.2f} TB/s"),
                     "- times: median of triton.testing.do_bench", "",
                     "| product | rows | implementation | time (us) | TFLOP/s | % of bf16 rate | note |",
                     "|---|---|---|---|---|---|---|"]
        self.rows: list[str] = []

    def add(self, what, n, impl, t, flops, note=""):
        if isinstance(t, str):
            line = f"| {what} | {n} | {impl} | {t} | | | {note} |"
        else:
            line = (f"| {what} | {n} | {impl} | {t * 1e6:.0f} | {flops / t / 1e12:.0f} | "
                    f"{flops / t / self.mm * 100:.1f}% | {note} |")
        self.rows.append(line)
        print(line, flush=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.head + self.rows) + "\n")


_sweep = [False]


def sweep(cands, default, n):
    """The configurations to time: the default, and with --sweep (at chunk sizes, >= 2048 rows) every candidate
    (each must give the same bits)."""
    return [default] + [c for c in cands if c != default] if _sweep[0] and n >= 2048 else [default]


def short(cfg) -> str:
    return repr(cfg).replace("Config", "").replace(" ", "").replace("group_m=8,", "")


def attempt(fn):
    try:
        return bench(fn)
    except Exception as exc:  # noqa: BLE001 -- report what fails, keep the rest
        return f"{type(exc).__name__}: {str(exc)[:80]}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "bits == decode"
    return f"bits differ in {(a != b).any(dim=1).float().mean().item():.0%} of rows"


def fp8_case(rep: Report, name, out_f, in_f, rows):
    groups = 8 if "group" in name else 1
    w = (torch.randn(out_f, in_f, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(112, 122, (triton.cdiv(out_f, 32), in_f // 32), dtype=torch.uint8, device="cuda")
    k_all = in_f * groups
    wb = (w.float() * torch.exp2(s.float() - 127).repeat_interleave(32, 0)[:out_f].repeat_interleave(32, 1)
          ).bfloat16()
    for n in rows:
        x = torch.randn(n, k_all, device="cuda")
        flops = 2 * n * out_f * in_f
        y = P.prompt_fp8_linear(x, w, s, groups=groups)
        if groups > 1:
            def dec(x=x):
                return F.fp8_linear_grouped(x, w, s, groups)
        else:
            def dec(x=x):
                return F.fp8_linear(x, w, s, cfg=F.CUDA)
        note = same_bits(y[:512], dec()[:512])
        label = f"fp8 {name} [{out_f}x{in_f}] S={F.split_for(out_f // groups, in_f, F.CUDA)}"
        for cfg in sweep(P.FP8_SWEEP, P.fp8_config(out_f // groups, in_f), n if name in SWEPT else 0):
            try:
                same = torch.equal(P.prompt_fp8_linear(x, w, s, groups=groups, cfg=cfg), y)
                t = bench(lambda x=x, cfg=cfg: P.prompt_fp8_linear(x, w, s, groups=groups, cfg=cfg))
            except Exception as exc:  # noqa: BLE001 -- report what fails, keep the rest
                same, t = False, f"{type(exc).__name__}: {str(exc)[:80]}"
            rep.add(label, n, f"prompt_gemm {short(cfg)}", t, flops,
                    note if cfg == P.fp8_config(out_f // groups, in_f) else "" if same else "BITS DIFFER from default")
        rep.add(label, n, "decode kernel (CUDA C mma.sync)", bench(dec), flops)
        if groups == 1:
            xq = x.to(torch.float8_e4m3fn)
            sa = torch.ones(n, 1, device="cuda")
            sb = torch.ones(1, out_f, device="cuda")
            rep.add(label, n, "cuBLAS fp8 _scaled_mm (row-wise)", attempt(
                lambda xq=xq, sa=sa, sb=sb: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb,
                                                             out_dtype=torch.bfloat16)), flops)
            xb = x.bfloat16()
            rep.add(label, n, "cuBLAS bf16, weight dequantised", attempt(lambda xb=xb: xb @ wb.t()), flops)


def moe_case(rep: Report, rows, bw):
    w13 = torch.randint(-128, 128, (N_EXPERTS, 2 * INTER, H // 2), dtype=torch.int8, device="cuda")
    s13 = torch.randint(118, 122, (N_EXPERTS, 2 * INTER, H // 32), dtype=torch.uint8, device="cuda")
    w2 = torch.randint(-128, 128, (N_EXPERTS, H, INTER // 2), dtype=torch.int8, device="cuda")
    s2 = torch.randint(118, 122, (N_EXPERTS, H, INTER // 32), dtype=torch.uint8, device="cuda")
    per_expert = (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel())
    for n in rows:
        ids = torch.rand(n, N_EXPERTS, device="cuda").topk(TOPK, dim=1).indices.to(torch.int32)
        wts = torch.rand(n, TOPK, device="cuda")
        x = torch.randn(n, H, device="cuda")
        flops = 2 * n * TOPK * 3 * H * INTER
        touched = int(torch.unique(ids).numel())
        floor = touched * per_expert / bw
        y = P.prompt_fp4_moe(x, w13, s13, w2, s2, ids, wts, LIMIT)
        dec = M.fp4_moe(x[:512], w13, s13, w2, s2, ids[:512], wts[:512], LIMIT, cfg=M.CUDA)
        label = f"fp4 experts top-{TOPK} of {N_EXPERTS} ({touched} touched, byte floor {floor * 1e6:.0f} us)"
        note = same_bits(y[:512], dec)
        for cfg in sweep(P.MOE_SWEEP, P.MOE_DEFAULT, n):
            try:
                same = torch.equal(P.prompt_fp4_moe(x, w13, s13, w2, s2, ids, wts, LIMIT, cfg=cfg), y)
                t = bench(lambda cfg=cfg: P.prompt_fp4_moe(x, w13, s13, w2, s2, ids, wts, LIMIT, cfg=cfg))
            except Exception as exc:  # noqa: BLE001
                same, t = False, f"{type(exc).__name__}: {str(exc)[:80]}"
            rep.add(label, n, f"prompt_gemm {short(cfg)}", t, flops,
                    note if cfg == P.MOE_DEFAULT else "" if same else "BITS DIFFER from default")
        rep.add(label, n, "decode kernels (CUDA C mma.sync)",
                bench(lambda: M.fp4_moe(x, w13, s13, w2, s2, ids, wts, LIMIT, cfg=M.CUDA)), flops)


def guarded(rep: Report, what, fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 -- report what fails, keep the rest
        rep.add(what, "-", "-", f"FAILED {type(exc).__name__}: {str(exc)[:160]}", 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,2048,8192")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prompt-gemm.md"))
    ap.add_argument("--only", default="", help="comma-separated names of the cases to run: FP8 weights, 'experts' "
                    "for the routed experts (default all)")
    ap.add_argument("--sweep", action="store_true", help="time every prompt-kernel configuration candidate")
    args = ap.parse_args()
    _sweep[0] = args.sweep
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    bw, mm = ceilings()
    print(f"ceilings: bf16 GEMM {mm / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s", flush=True)
    rep = Report(Path(args.out), bw, mm)
    only = {s for s in args.only.split(",") if s}
    if not only or "experts" in only:
        guarded(rep, "fp4 experts", moe_case, rep, rows, bw)
        torch.cuda.empty_cache()
    for name, out_f, in_f in FP8:
        if not only or name in only:
            guarded(rep, f"fp8 {name}", fp8_case, rep, name, out_f, in_f, rows)
            torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
