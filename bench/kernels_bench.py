"""Decode kernels at V4.1 shapes against their byte floor and the off-the-shelf path, on the GPU (issue 24).

For each FP8 projection of a layer (and the bf16 weights the GPU path multiplies) and for the routed experts of a
round (FP4), at decode rows 1, 8, 32, 64: time per call, the bytes the call must read (the weight as stored and its
scales, or the packed FP4 bytes and scales of the experts the round touches), and that as a fraction of the copy
bandwidth measured in the same run; beside it, on the same shapes in the same run, cuBLAS's FP8 product
(`torch._scaled_mm`, x quantised to FP8 with row-wise scales: a different, cheaper-to-feed product, shown as the
off-the-shelf speed), cuBLAS's bf16 product of the dequantised weight, and `torch._scaled_grouped_mm` for the
experts (FP8, twice the FP4 bytes).

Timing that the L2 cache cannot flatter: each timed CUDA graph runs the call on enough distinct copies of the
weight (or enough distinct routings of the 384-expert stack) that the copies together exceed the 50 MB L2 several
times over, back to back as a layer's calls run, and the time is the graph's median replay over the calls in it.

  python3 bench/kernels_bench.py [--out bench/results/kernels.md]     # the kernels as configured, + baselines
  python3 bench/kernels_bench.py --sweep [--out FILE]                 # every configuration candidate per shape
"""
from __future__ import annotations

import argparse
import dataclasses
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

from kernels import fp4_moe as M
from kernels import fp8_linear as F

H, INTER, TOPK, LIMIT, N_EXPERTS = 5120, 2304, 6, 10.0, 384
FP8 = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_a group", 1024, 4096),
       ("wo_b", 5120, 8192), ("shared w1+w3", 4608, 5120), ("shared w2", 5120, 2304),
       ("indexer wq_b", 4096, 1280)]
BF16 = [("compressor wkv", 512, 5120), ("router gate", 384, 5120), ("head", 129280, 5120)]
DECODE_ROWS = (1, 8, 32, 64)
STREAM_BYTES = 400 << 20        # the copies a timed graph cycles through: 8x the H200's L2

FP8_SWEEP = [F.CUDA,
             F.Config(bn=64, bk=64, swap=False, mt=4, warps=4, stages=4),
             F.Config(bn=256, bk=64, swap=True, mt=2, warps=8, stages=3)]
MOE_SWEEP = [M.CUDA,
             M.Config(bn_up=128, bn_down=128, bkb=16, post=True, warps=8, stages=6)]


def ceilings():
    n = 1 << 30                                   # 2 GiB buffers: far past the L2
    src = torch.empty(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median") * 1e-3
    src = dst = None
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    t_mm = triton.testing.do_bench(lambda: x @ y, warmup=5, rep=50, return_mode="median") * 1e-3
    return 2 * n * 2 / t_copy, 2 * m ** 3 / t_mm


def time_calls(calls) -> float:
    """Median seconds per call of `calls` (a list of thunks) run back to back in one CUDA graph."""
    def run():
        for c in calls:
            c()
    run()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run, rep=40, return_mode="median") * 1e-3 / len(calls)


def fp8_weights(out_f, in_f, copies):
    ws = []
    for _ in range(copies):
        w = (torch.randn(out_f, in_f, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.randint(112, 122, (triton.cdiv(out_f, 32), in_f // 32), dtype=torch.uint8, device="cuda")
        ws.append((w, s))
    return ws


def copies_for(nbytes: int) -> int:
    return max(2, min(64, STREAM_BYTES // max(1, nbytes)))


def dequant_fp8(w, s):
    f = torch.exp2(s.float() - 127).repeat_interleave(32, 0)[:w.shape[0]].repeat_interleave(32, 1)
    return w.float() * f


def check_fp8(w, s, cfg) -> str:
    """The configuration's result against the float32 product of bf16(x) and the dequantised weight (elementwise
    within 2^-20 of the terms' absolute sum), and its batch invariance (rows 1 / 32 / 64 / 300)."""
    x = torch.randn(300, w.shape[1], device="cuda")
    W = dequant_fp8(w, s) if s is not None else w.float()
    xb = x.bfloat16().float()
    ref = xb @ W.t()
    l1 = xb.abs() @ W.abs().t()
    y = F.fp8_linear(x, w, s, cfg=cfg)
    bad = ((y - ref).abs() > 2.0 ** -20 * w.shape[1] ** 0.5 * l1 + 1e-30).sum().item()
    inv = all(torch.equal(F.fp8_linear(x[:n], w, s, cfg=cfg), y[:n]) for n in (1, 32, 64))
    return ("ok" if not bad and inv else f"BAD ({bad} elements off, invariant {inv})")


def scaled_mm_baseline(out_f, in_f, n):
    """cuBLAS FP8 (row-wise scales; x quantised to FP8, rows padded to 16), and cuBLAS bf16, per call."""
    res = {}
    m = max(16, -(-n // 16) * 16)
    try:
        wq = [(torch.randn(out_f, in_f, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
              for _ in range(copies_for(out_f * in_f))]
        xq = torch.randn(m, in_f, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.ones(m, 1, device="cuda")
        sb = torch.ones(1, out_f, device="cuda")
        res["cuBLAS fp8 _scaled_mm"] = time_calls([
            (lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
            for w in wq])
        del wq
    except Exception as exc:  # noqa: BLE001 -- report what fails, keep the rest
        res["cuBLAS fp8 _scaled_mm"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    wb = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(2 * out_f * in_f))]
    xb = torch.randn(n, in_f, device="cuda", dtype=torch.bfloat16)
    res["cuBLAS bf16"] = time_calls([(lambda w=w: xb @ w.t()) for w in wb])
    return res


def experts(n_exp=N_EXPERTS):
    w13 = torch.randint(-128, 128, (n_exp, 2 * INTER, H // 2), dtype=torch.int8, device="cuda")
    s13 = torch.randint(118, 122, (n_exp, 2 * INTER, H // 32), dtype=torch.uint8, device="cuda")
    w2 = torch.randint(-128, 128, (n_exp, H, INTER // 2), dtype=torch.int8, device="cuda")
    s2 = torch.randint(118, 122, (n_exp, H, INTER // 32), dtype=torch.uint8, device="cuda")
    return w13, s13, w2, s2


def routings(n, count, n_exp=N_EXPERTS):
    return [torch.stack([torch.randperm(n_exp, device="cuda")[:TOPK] for _ in range(n)]).to(torch.int32)
            for _ in range(count)]


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_fp4(packed, scale):
    """Packed E2M1 [out, in/2] (low nibble = even k) and E8M0 [out, in/32] -> float32 [out, in], on the GPU."""
    table = torch.tensor(E2M1, device=packed.device)
    b = packed.to(torch.int32) & 0xFF
    v = torch.stack([table[b & 15], table[b >> 4]], dim=-1).reshape(packed.shape[0], -1)
    return v * torch.exp2(scale.float() - 127).repeat_interleave(32, 1)


_moe_case = {}


def check_moe(stack, cfg) -> str:
    """Rows 1..64 against a float32 reference with x and h rounded to bf16 (within 1e-5 of max|ref|), and a row's
    bits alone == among 64."""
    w13, s13, w2, s2 = stack
    if not _moe_case:
        n = 64
        ids = routings(n, 1, 16)[0]                   # the first 16 experts only: a small dequantised reference
        wts = torch.rand(n, TOPK, device="cuda")
        x = torch.randn(n, H, device="cuda")
        ref = torch.zeros(n, H, device="cuda")
        xb = x.bfloat16().float()
        for e in ids.unique().tolist():
            W13 = dequant_fp4(w13[e], s13[e])
            W2 = dequant_fp4(w2[e], s2[e])
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            g = torch.clamp(xb[rows] @ W13[:INTER].t(), max=LIMIT)
            u = torch.clamp(xb[rows] @ W13[INTER:].t(), min=-LIMIT, max=LIMIT)
            h = (g / (1 + torch.exp(-g)) * u * wts[rows, slot][:, None]).bfloat16().float()
            ref.index_add_(0, rows, h @ W2.t())
        _moe_case.update(ids=ids, wts=wts, x=x, ref=ref)
    ids, wts, x, ref = _moe_case["ids"], _moe_case["wts"], _moe_case["x"], _moe_case["ref"]
    y = M.fp4_moe(x, w13, s13, w2, s2, ids, wts, LIMIT, cfg=cfg)
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    inv = all(torch.equal(M.fp4_moe(x[r:r + 1], w13, s13, w2, s2, ids[r:r + 1], wts[r:r + 1], LIMIT, cfg=cfg)[0],
                          y[r]) for r in (0, 17, 63))
    # h is rounded to bf16 before the down product: a gate/up sum a few ulps off flips a rounding now and then,
    # ~2^-9 of one term; a wrong unpacking or routing is O(1)
    return "ok" if err < 2e-3 and inv else f"BAD (err {err:.2e}, invariant {inv})"


def time_moe(stack, n, cfg, count=8):
    w13, s13, w2, s2 = stack
    rts = routings(n, count)
    wts = torch.rand(n, TOPK, device="cuda")
    x = torch.randn(n, H, device="cuda")
    t = time_calls([(lambda ids=ids: M.fp4_moe(x, w13, s13, w2, s2, ids, wts, LIMIT, cfg=cfg)) for ids in rts])
    per_expert = w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel()
    touched = sum(int(torch.unique(ids).numel()) for ids in rts) / count
    return t, touched * per_expert, touched


def grouped_mm_baseline(n, count=8):
    """torch._scaled_grouped_mm over the touched experts in FP8 (gate/up then down; each group's rows padded to
    16), per round."""
    try:
        rts = routings(n, count)
        calls = []
        w13 = torch.randn(N_EXPERTS // 4, 2 * INTER, H, device="cuda").to(torch.float8_e4m3fn)   # 2.3 GB of FP8
        w2 = torch.randn(N_EXPERTS // 4, H, INTER, device="cuda").to(torch.float8_e4m3fn)
        for ids in rts:
            e_ids = (torch.unique(ids) % w13.shape[0]).unique()
            g = e_ids.numel()
            a1 = torch.randn(16 * g, H, device="cuda").to(torch.float8_e4m3fn)
            a2 = torch.randn(16 * g, INTER, device="cuda").to(torch.float8_e4m3fn)
            offs = torch.arange(16, 16 * g + 1, 16, device="cuda", dtype=torch.int32)
            b1 = w13[e_ids].transpose(-2, -1)
            b2 = w2[e_ids].transpose(-2, -1)
            sa1 = torch.ones(16 * g, device="cuda")
            sb1 = torch.ones(g, 2 * INTER, device="cuda")
            sb2 = torch.ones(g, H, device="cuda")

            def call(a1=a1, a2=a2, b1=b1, b2=b2, offs=offs, sa1=sa1, sb1=sb1, sb2=sb2):
                torch._scaled_grouped_mm(a1, b1, sa1, sb1, offs=offs, out_dtype=torch.bfloat16)
                torch._scaled_grouped_mm(a2, b2, sa1, sb2, offs=offs, out_dtype=torch.bfloat16)
            calls.append(call)
        t = time_calls(calls)
        touched = sum(int((torch.unique(ids) % w13.shape[0]).unique().numel()) for ids in rts) / count
        return t, touched * (3 * INTER * H)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:100]}", 0


def commit_of(given: str) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


class Report:
    def __init__(self, path, title, bw, mm, commit):
        self.path, self.bw = Path(path), bw
        self.head = [f"# {title}", "",
                     f"- command: `python3 {' '.join(sys.argv)}`, commit {commit}",
                     (f"- machine: {torch.cuda.get_device_name()} ({socket.gethostname()}), torch {torch.__version__},"
                      f" triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
                      " UTC"),
                     (f"- ceilings measured in the same run: device copy {bw / 1e12:.2f} TB/s (read+write bytes), "
                      f"bf16 GEMM (torch, 8192^3) {mm / 1e12:.0f} TFLOP/s"),
                     ("- times: median CUDA-graph replay per call, the graph cycling through copies of the weight "
                      f"(or routings) totalling >= {STREAM_BYTES >> 20} MB so the L2 cannot hold them"), "",
                     "| call | rows | config | bytes (MB) | time (us) | % of copy bandwidth | check |",
                     "|---|---|---|---|---|---|---|"]
        self.rows = []

    def add(self, call, n, cfg, nbytes, t, check=""):
        if isinstance(t, str):
            line = f"| {call} | {n} | {cfg} | {nbytes / 1e6:.1f} | {t} | | {check} |"
        else:
            line = (f"| {call} | {n} | {cfg} | {nbytes / 1e6:.1f} | {t * 1e6:.1f} | "
                    f"{nbytes / t / self.bw * 100:.0f}% | {check} |")
        self.rows.append(line)
        print(line, flush=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.head + self.rows) + "\n")


def _try_time(calls):
    """time_calls, or the error's first line (a fallback that cannot be captured in a graph)."""
    try:
        return time_calls(calls)
    except Exception as exc:  # noqa: BLE001 -- report it in the table, time the rest
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60] if str(exc) else ''}"


def rowops_section(rep, rows):
    """An mHC site's mixes (hc_site_mixes at each K chunk of the sweep; its serve chunk is mhc.PRE_KC), a site's
    input (expand + collapse + norm: the register form and the scratch-row form) and the norms at 5120 and 1280,
    beside the CUDA op set's torch fallbacks. Bytes: what the call must read and write once."""
    from dsv41.model import mhc as model_mhc
    from dsv41.model.ops import cuda_ops
    from kernels import mhc, rowops
    hc, H, NM = 4, 5120, 24
    fn = torch.randn(NM, hc * H, device="cuda") * 0.01
    base, scale = torch.randn(NM, device="cuda"), torch.rand(3, device="cuda") + 0.5
    fb = cuda_ops(kernels=False)
    for n in rows:
        streams = torch.randn(n, hc, H, device="cuda")
        nbytes = streams.numel() * 4 + fn.numel() * 4
        for i, (kc, bk, warps, mix) in enumerate(mhc.SITE_SWEEP):
            t = _try_time([lambda kc=kc, bk=bk, warps=warps, mix=mix: mhc.launch_site(
                streams, fn, scale, base, hc, 20, 1e-6, 1e-20, kc=kc, bk=bk, warps=warps, mix=mix)])
            rep.add("mHC site mixes" + (" (one launch)" if mix else " (m, then hc_mix: two launches)"), n,
                    f"K chunk {kc} step {bk}, {warps} warps{' (served)' if i == 0 else ''}", nbytes, t)
        m = torch.randn(n, NM, device="cuda")
        rep.add("hc_mix alone (one warp a block of rows)", n, "-", m.numel() * 4,
                _try_time([lambda: mhc.launch(m, scale, base, hc, 20, 1e-6)]))
        site = model_mhc.HcSite(fn=fn, base=base, scale=scale, ops=fb)
        rep.add("mHC site mixes: torch fallbacks", n, "-", nbytes,
                _try_time([lambda: model_mhc.hc_mixes(streams, site, 20, 1e-6, 1e-20)]))
        y, y2 = torch.randn(n, H, device="cuda"), torch.randn(n, H, device="cuda")
        pre, post = torch.rand(n, hc, device="cuda"), torch.rand(n, hc, device="cuda")
        comb = torch.rand(n, hc, hc, device="cuda")
        w = torch.rand(H, device="cuda") + 0.5
        nbytes = n * H * 4 * (2 + hc + hc + 1)
        keep = rowops.REG_ELEMENTS
        for form, limit in (("registers", keep), ("scratch row", 0)):
            rowops.REG_ELEMENTS = limit
            t = _try_time([lambda: rowops.hc_site_in((y, y2), streams, post, comb, pre, w, 1e-6)])
            rep.add("site input (expand of two partials + collapse + norm)", n, form, nbytes, t)
            for width in (5120, 1280):
                xw = torch.randn(n, width, device="cuda")
                t = _try_time([lambda xw=xw: rowops.rms_norm(xw, w[:width], 1e-6)])
                rep.add(f"rms_norm [{width}]", n, form, n * width * 8, t)
        rowops.REG_ELEMENTS = keep
        rep.add("site input: torch fallbacks", n, "-", nbytes,
                _try_time([lambda: fb.expand_collapse_norm((y, y2), streams, post, comb, pre, w, 1e-6)]))


def short(cfg) -> str:
    return repr(cfg).replace("Config", "").replace(" ", "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernels.md"))
    ap.add_argument("--sweep", action="store_true", help="time every configuration candidate per shape")
    ap.add_argument("--rows", default=",".join(map(str, DECODE_ROWS)))
    ap.add_argument("--commit", default=os.environ.get("DSV41_COMMIT", ""))
    ap.add_argument("--only", choices=("all", "linear", "experts", "rowops"), default="all",
                    help="time only the FP8/bf16 linears, only the routed experts (with their grouped-mm column), or "
                         "only the mHC site kernels and the norms (with the torch fallbacks beside them)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    bw, mm = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {mm / 1e12:.0f} TFLOP/s", flush=True)
    rep = Report(args.out, "Decode kernels at V4.1 shapes" + (": configuration sweep" if args.sweep else ""),
                 bw, mm, commit_of(args.commit))

    if args.only == "rowops":
        rowops_section(rep, sorted(set(rows) | {2048}))
        print(f"wrote {args.out}")
        return 0
    for name, out_f, in_f in (FP8 + BF16 if args.only != "experts" else []):
        is_fp8 = (name, out_f, in_f) in FP8
        nbytes = out_f * in_f + (triton.cdiv(out_f, 32) * (in_f // 32) if is_fp8 else out_f * in_f)
        copies = copies_for(nbytes)
        if is_fp8:
            ws = fp8_weights(out_f, in_f, copies)
        else:
            ws = [(torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16), None) for _ in range(copies)]
        cfgs = FP8_SWEEP if args.sweep else [F.config_for(out_f, in_f, torch.device("cuda", 0))]
        for cfg in cfgs:
            try:
                check = check_fp8(*ws[0], cfg)
            except Exception as exc:  # noqa: BLE001
                rep.add(name, "-", short(cfg), nbytes, f"{type(exc).__name__}: {str(exc)[:80]}")
                continue
            for n in rows:
                x = torch.randn(n, in_f, device="cuda")
                t = time_calls([(lambda w=w, s=s, x=x, cfg=cfg: F.fp8_linear(x, w, s, cfg=cfg)) for w, s in ws])
                rep.add(f"{'fp8' if is_fp8 else 'bf16'} {name} [{out_f}x{in_f}] S={F.fp8_split(out_f, in_f, cfg)}",
                        n, short(cfg), nbytes, t, check)
        del ws
        if not args.sweep or name in ("wq_b", "wo_b", "wkv", "head"):
            for n in rows:
                for what, t in scaled_mm_baseline(out_f, in_f, n).items():
                    wb = out_f * in_f * (1 if "fp8" in what else 2)
                    rep.add(f"{what} [{out_f}x{in_f}]", n, "-", wb, t)
        torch.cuda.empty_cache()
    if args.only == "linear":
        print(f"wrote {args.out}")
        return 0

    stack = experts()
    cfgs = MOE_SWEEP if args.sweep else [M.config_for(torch.device("cuda", 0))]
    if not args.sweep and cfgs[0].impl == "cuda" and not cfgs[0].lean:
        cfgs.append(dataclasses.replace(cfgs[0], lean=2))       # the lean decode form beside the default
    for cfg in cfgs:
        try:
            check = check_moe(stack, cfg)
        except Exception as exc:  # noqa: BLE001
            rep.add("fp4_moe", "-", short(cfg), 0, f"{type(exc).__name__}: {str(exc)[:80]}")
            continue
        for n in rows:
            t, nbytes, touched = time_moe(stack, n, cfg)
            rep.add(f"fp4_moe top-{TOPK} of {N_EXPERTS} ({touched:.0f} touched)", n, short(cfg), nbytes, t, check)
    del stack
    torch.cuda.empty_cache()
    for n in rows:
        t, nbytes = grouped_mm_baseline(n)
        rep.add("torch._scaled_grouped_mm fp8 (gate/up + down)", n, "-", nbytes, t)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
