"""EXL3 kernels on the GPU: the CUDA C kernel (kernels/csrc/exl3.cu) beside the Triton one, and exllamav3's own.

Decode round (batch B rows): every EXL3 linear of a backbone layer at the reference pack's rates (attention,
shared expert at 4 bpw, top-6 routed experts at 2.5 bpw mul1, grouped launches for the 8 wo_a slices and for the
routed experts), timed as one CUDA graph, once on each kernel. Compared with the bytes it must read (K/8 bytes a
weight + the fp16 sign scales) at the copy bandwidth measured in the same run.
Single linears at rows 1, 8, 32 and the routed experts' grouped launches alone at 1 and 8 rows, same comparison.
Prompt pass: M rows through a routed-expert matrix (5120 -> 2304 @ 2.5): the fused kernels and the
reconstruct-then-cuBLAS path, in TFLOP/s against the fp16 GEMM rate measured in the same run.
With --exllamav3 (its extension built), exllamav3's own forward on the same shapes and codes is timed as a baseline.

  python3 bench/exl3_bench.py [--out bench/results/exl3.md] [--exllamav3] [--quick] [--no-triton]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import socket
import sys
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.model.exl3 import CB_3INST, CB_MUL1, MUL1_MARKER  # noqa: E402
from dsv41.model.exl3_load import Exl3ExpertStack, exl3_routed  # noqa: E402
from kernels.exl3 import (CUDA_TARGET_BLOCKS, Exl3Weight, cuda_available, cuda_split,  # noqa: E402
                          exl3_grouped, exl3_grouped_cuda, exl3_linear_cuda, exl3_linear_prompt, exl3_linear_triton,
                          exl3_reconstruct)

DEVICE = "cuda"   # a smoke test on CPU (TRITON_INTERPRET=1) swaps this and the shapes
D, Q_RANK, HEADS_X_DIM, KV, O_GROUPS, O_RANK, INTER, TOPK, N_EXPERTS = 5120, 1280, 32768, 512, 8, 1024, 2304, 6, 384


def parts(n_in, n_out, K, cb, g):
    t = {"trellis": torch.randint(-32768, 32768, (n_in // 16, n_out // 16, int(16 * K)), generator=g,
                                  dtype=torch.int16),
         "suh": (0.02 * torch.randn(n_in, generator=g)).half(), "svh": (0.02 * torch.randn(n_out, generator=g)).half()}
    if cb == CB_MUL1:
        t["mul1"] = torch.tensor(MUL1_MARKER, dtype=torch.int32)
    return t


def nbytes(w: Exl3Weight, used: int | None = None) -> int:
    """Bytes a launch reads from the weight: trellis K/8 a weight + fp16 suh/svh, for `used` of the E matrices."""
    per = w.trellis[0].numel() * 2 + (w.in_features + w.out_features) * 2
    return per * (w.experts if used is None else used)


def ceilings():
    n = 1 << 30                                     # 2 GiB fp16 buffers: far past the 50 MB L2
    a = torch.empty(n, dtype=torch.float16, device=DEVICE)
    b = torch.empty_like(a)
    t_copy = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50, return_mode="median") * 1e-3
    t_read = triton.testing.do_bench(lambda: a.sum(dtype=torch.float32), warmup=5, rep=50,
                                     return_mode="median") * 1e-3
    m = 8192
    x = torch.randn(m, m, dtype=torch.float16, device=DEVICE)
    y = torch.randn(m, m, dtype=torch.float16, device=DEVICE)
    t_mm = triton.testing.do_bench(lambda: x @ y, warmup=5, rep=50, return_mode="median") * 1e-3
    return {"copy_TBps": 2 * n * 2 / t_copy / 1e12, "read_TBps": n * 2 / t_read / 1e12,
            "fp16_TFLOPs": 2 * m ** 3 / t_mm / 1e12}


IMPLS = {"triton": (exl3_linear_triton, exl3_grouped), "cuda": (exl3_linear_cuda, exl3_grouped_cuda),
         # the same kernels as programmatic dependent launches (a linear streams its first weights while the
         # previous kernel finishes)
         "cuda pdl": (functools.partial(exl3_linear_cuda, pdl=True), functools.partial(exl3_grouped_cuda, pdl=True))}
# CUDA C forms the bench compares at 1 (and 8) rows besides the served one (kernels/exl3.py cuda_kernel_name):
# warp ring, the served form held to 64 registers, register-direct; where the time goes (wrong values): the warp ring without the decode, and
# no stages at all (launch, partials, reduction, output rotation)
VARIANTS = {"w": "warp ring", "o": "64 regs", "r": "register-direct", "n": "warp ring, no decode",
            "e": "no stages"}
ROUTED_TARGETS = (132, 792)      # split targets tried on the routed launches besides the served one


def decode_layer(B: int, g: torch.Generator):
    """The linears of one backbone layer for a decode round of B rows; returns ({impl: fn}, bytes read, experts,
    {impl: the routed experts' two grouped launches alone}, their bytes)."""
    w = {
        "wq_a": Exl3Weight.from_tensors(parts(D, Q_RANK, 4, CB_3INST, g), DEVICE),
        "wq_b": Exl3Weight.from_tensors(parts(Q_RANK, HEADS_X_DIM, 4, CB_3INST, g), DEVICE),
        "wkv": Exl3Weight.from_tensors(parts(D, KV, 4, CB_3INST, g), DEVICE),
        "wo_a": Exl3Weight.from_tensors([parts(HEADS_X_DIM // O_GROUPS, O_RANK, 4, CB_3INST, g)
                                         for _ in range(O_GROUPS)], DEVICE),
        "wo_b": Exl3Weight.from_tensors(parts(O_GROUPS * O_RANK, D, 4, CB_3INST, g), DEVICE),
        "sh_w13": Exl3Weight.from_tensors([parts(D, INTER, 4, CB_3INST, g) for _ in range(2)], DEVICE),
        "sh_w2": Exl3Weight.from_tensors(parts(INTER, D, 4, CB_3INST, g), DEVICE),
    }
    # routed experts: a stack of distinct experts, enough for B rows x top-6 (each row picks its own 6)
    n_used = min(N_EXPERTS, TOPK * B)
    w["ex_w13"] = Exl3Weight.from_tensors([parts(D, INTER, 2.5, CB_MUL1, g) for _ in range(2 * n_used)], DEVICE)
    w["ex_w2"] = Exl3Weight.from_tensors([parts(INTER, D, 2.5, CB_MUL1, g) for _ in range(n_used)], DEVICE)
    dev = DEVICE
    x = torch.randn(B, D, device=dev)
    o = torch.randn(O_GROUPS, B, HEADS_X_DIM // O_GROUPS, device=dev)
    ids_o = torch.arange(O_GROUPS, dtype=torch.int32, device=dev)
    ids_sh = torch.arange(2, dtype=torch.int32, device=dev)
    # one group per (row, chosen expert): B*6 groups of one row (distinct experts: worst case for bytes)
    ids_13 = torch.arange(2 * n_used, dtype=torch.int32, device=dev)
    ids_2 = torch.arange(n_used, dtype=torch.int32, device=dev)
    xe13 = x[torch.arange(2 * n_used, device=dev) % B].unsqueeze(1).contiguous()
    xe2 = torch.randn(n_used, 1, INTER, device=dev)
    xs = x.unsqueeze(0).expand(2, B, D).contiguous()
    hsh = torch.randn(B, INTER, device=dev)
    q = torch.randn(B, Q_RANK, device=dev)

    def make(impl):
        linear, grouped = IMPLS[impl]

        def run():
            linear(x, w["wq_a"])
            linear(q, w["wq_b"])
            linear(x, w["wkv"])
            oa = grouped(o, w["wo_a"], ids_o)                            # [8, B, 1024]
            linear(oa.permute(1, 0, 2).reshape(B, -1), w["wo_b"])
            grouped(xs, w["sh_w13"], ids_sh)
            linear(hsh, w["sh_w2"])
            grouped(xe13, w["ex_w13"], ids_13)
            grouped(xe2, w["ex_w2"], ids_2)

        def routed():
            grouped(xe13, w["ex_w13"], ids_13)
            grouped(xe2, w["ex_w2"], ids_2)
        return run, routed

    total = sum(nbytes(v) for v in w.values())
    runs = {impl: make(impl) for impl in IMPLS if (TRITON if impl == "triton" else HAS_CUDA)}
    routed = {k: v[1] for k, v in runs.items()}
    if HAS_CUDA:
        # the same two grouped launches on the bench's other forms and splits (same codes and rows)
        def form(variant="", target=CUDA_TARGET_BLOCKS):
            def run():
                exl3_grouped_cuda(xe13, w["ex_w13"], ids_13, variant=variant, target=target)
                exl3_grouped_cuda(xe2, w["ex_w2"], ids_2, variant=variant, target=target)
            return run
        for v in VARIANTS:
            routed[f"cuda {v}"] = form(variant=v)
        for tg in ROUTED_TARGETS:
            routed[f"cuda target {tg}"] = form(target=tg)
        # the served path on the CUDA op set: exl3_routed's sync-free runs (sort on the device, two launches, the
        # slot sum), every row its own 6 experts
        stack = Exl3ExpertStack(w["ex_w13"], w["ex_w2"], torch.arange(n_used, device=dev))
        ids_r = (torch.arange(B * TOPK, device=dev) % n_used).view(B, TOPK)
        wts = torch.rand(B, TOPK, device=dev)
        routed["cuda, served (exl3_routed)"] = lambda: exl3_routed(stack, x, wts, ids_r, 7.0, exl3_grouped_cuda)
    return ({k: v[0] for k, v in runs.items()}, total, n_used, routed, nbytes(w["ex_w13"]) + nbytes(w["ex_w2"]))


def exllamav3_time(n_in, n_out, K, cb, tp, x1) -> float | None:
    """exllamav3 1.6.5's own forward on the same shape and codes (its extension must be built), as a baseline."""
    try:
        from exllamav3.modules.quant.exl3 import LinearEXL3
        kw = {"mul1": tp["mul1"].to(DEVICE)} if cb == CB_MUL1 else {}
        lin = LinearEXL3(None, n_in, n_out, suh=tp["suh"].to(DEVICE), svh=tp["svh"].to(DEVICE),
                         trellis=tp["trellis"].to(DEVICE), **kw)
        xh = x1.half()
        try:
            return time_graph(lambda: lin.forward(xh, {}))
        except Exception:   # its forward may refuse graph capture: plain events then (includes launch gaps)
            torch.cuda.synchronize()
            return triton.testing.do_bench(lambda: lin.forward(xh, {}), return_mode="median") * 1e-3
    except Exception as exc:
        print(f"exllamav3 baseline unavailable: {exc!r}", flush=True)
        return None


def pdl_chain_check(g: torch.Generator) -> bool:
    """wq_a -> wq_b -> a 32768 -> 5120 slice as dependent launches captured in a graph (each reads what the one
    before wrote) give the bits of plain launches."""
    ws = [Exl3Weight.from_tensors(parts(a, b, 4, CB_3INST, g), DEVICE) for a, b in ((D, Q_RANK), (Q_RANK, 4096),
                                                                                  (4096, D))]
    x = torch.randn(3, D, device=DEVICE)

    def chain(pdl):
        h = x
        for w in ws:
            h = exl3_linear_cuda(h, w, pdl=pdl)
        return h
    want = chain(False)
    chain(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(True)
    ok = True
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        ok = ok and torch.equal(got, want)
    return ok and torch.equal(chain(True), want)


def time_all(fns: dict, what: str) -> dict:
    """time_graph of each; a form the driver refuses in a graph (a dependent launch) is printed and left out."""
    t = {}
    for k, fn in fns.items():
        try:
            t[k] = time_graph(fn)
        except Exception as exc:
            print(f"{what} {k}: {exc!r}", flush=True)
            torch.cuda.synchronize()
    return t


def time_graph(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e-3


HAS_CUDA = False   # set in main: the CUDA C kernel runs here
TRITON = True      # set in main: time the Triton kernels too (--no-triton leaves them out of a short device run)


def fmt(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e6:.1f}"


def pct(ideal: float, t: float | None) -> str:
    return "n/a" if t is None else f"{ideal / t * 100:.1f}"


LINEARS = [("expert w1 5120->2304 @2.5 mul1", D, INTER, 2.5, CB_MUL1),
           ("expert w2 2304->5120 @2.5 mul1", INTER, D, 2.5, CB_MUL1),
           ("wq_a 5120->1280 @4 3inst", D, Q_RANK, 4, CB_3INST),
           ("wq_b 1280->32768 @4 3inst", Q_RANK, HEADS_X_DIM, 4, CB_3INST),
           ("wo_b 8192->5120 @4 mul1", O_GROUPS * O_RANK, D, 4, CB_MUL1),
           ("wkv 5120->512 @4 mul1", D, KV, 4, CB_MUL1),
           ("indexer wk 5120->128 @8 mul1", D, 128, 8, CB_MUL1),
           ("head shard 5120->64640 @6 mul1", D, 64640, 6, CB_MUL1)]


def main() -> int:
    global HAS_CUDA
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "exl3.md"))
    ap.add_argument("--prompt-rows", type=int, default=4096)
    ap.add_argument("--exllamav3", action="store_true", help="also time exllamav3's forward (extension built)")
    ap.add_argument("--quick", action="store_true", help="4 linears at rows 1 and 8, no prompt pass (a short device run)")
    ap.add_argument("--no-triton", action="store_true", help="leave the Triton kernels out (a short device run)")
    args = ap.parse_args()
    global TRITON
    TRITON = not args.no_triton
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    HAS_CUDA = cuda_available()
    print(f"CUDA C EXL3 kernel: {'yes' if HAS_CUDA else 'NOT available'}", flush=True)
    ceil = ceilings()
    bw = ceil["copy_TBps"] * 1e12
    print(f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, read {ceil['read_TBps']:.2f} TB/s, "
          f"fp16 GEMM {ceil['fp16_TFLOPs']:.0f} TFLOP/s", flush=True)

    def write_report() -> None:
        """bench/results-style markdown of what has been measured so far (written after every section, so a run cut
        short by its time limit still leaves its figures)."""
        cmd = "python3 " + " ".join(sys.argv)
        lines = [
            "# EXL3 kernels on the GPU: CUDA C (kernels/csrc/exl3.cu), Triton, exllamav3", "",
            f"- command: `{cmd}`",
            f"- machine: {torch.cuda.get_device_name()} ({socket.gethostname()}), torch {torch.__version__}, "
            f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- ceilings measured in the same run: device copy {ceil['copy_TBps']:.2f} TB/s (read+write bytes), "
            f"read {ceil['read_TBps']:.2f} TB/s, fp16 GEMM 8192^3 {ceil['fp16_TFLOPs']:.0f} TFLOP/s",
            "- times: median of CUDA-graph replays (`triton.testing.do_bench_cudagraph`); random trellis codes", "",
            "## Decode round, one backbone layer (every EXL3 linear; reference pack rates)", "",
            "Attention (wq_a, wq_b, wkv, 8 wo_a slices grouped, wo_b) and the shared expert at 4 bpw 3INST, "
            "top-6 routed experts at 2.5 bpw mul1 in two grouped launches (w1+w3, w2), each row its own 6 experts. "
            "Compressor/indexer (4 resp. 8 of 40 layers) not included.", "",
            "| rows B | distinct experts | bytes read (MB) | ideal at copy BW (us) | Triton (us) | % | CUDA C (us) | % | "
            "CUDA C, dependent launches (us) | % |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for B, n_used, nb, t_tr, t_cu, ideal, t_pdl in rows_dec:
            lines.append(f"| {B} | {n_used} | {nb / 1e6:.1f} | {ideal * 1e6:.1f} | {fmt(t_tr)} | {pct(ideal, t_tr)} | "
                         f"{fmt(t_cu)} | {pct(ideal, t_cu)} | {fmt(t_pdl)} | {pct(ideal, t_pdl)} |")
        lines += ["", "## The routed experts' grouped launches alone (w1+w3, then w2), and the served exl3_routed", "",
                  "The served column is the CUDA op set's exl3_routed: pairs sorted by expert on the device, the two "
                  "run-mode launches, SiLU and the slot sum (no host sync, so it is graph-timed too).", "",
                  "| rows B | distinct experts | bytes read (MB) | ideal (us) | Triton (us) | % | CUDA C (us) | % | "
                  "served CUDA (us) | % |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for B, n_used, nb, t_tr, t_cu, ideal, t_sv in rows_routed:
            lines.append(f"| {B} | {n_used} | {nb / 1e6:.1f} | {ideal * 1e6:.2f} | {fmt(t_tr)} | {pct(ideal, t_tr)} | "
                         f"{fmt(t_cu)} | {pct(ideal, t_cu)} | {fmt(t_sv)} | {pct(ideal, t_sv)} |")
        forms = [k for k in (rows_forms[0][1] if rows_forms else {}) if k.startswith("cuda ")]
        if forms:
            lines += ["", "The same two grouped launches on the CUDA C kernel's other forms and splits (bench-only; "
                      "\"n\" does not decode and \"e\" runs no stage, so their values are wrong: where the time goes):",
                      "", "| rows B | " + " | ".join(f"{k[5:]} (us, %)" for k in forms) + " |",
                      "|---|" + "---|" * len(forms)]
            for B, tr, ideal in rows_forms:
                lines.append(f"| {B} | " + " | ".join(f"{fmt(tr.get(k))}, {pct(ideal, tr.get(k))}" for k in forms)
                             + " |")
        lines += ["", "## Single linears (random codes; exllamav3 on the same codes)", "",
                  "| linear | rows | bytes (MB) | ideal (us) | Triton (us) | % | CUDA C (us) | % | exllamav3 (us) | % |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, rows, nb, t_tr, t_cu, ideal, base in rows_lin:
            lines.append(f"| {name} | {rows} | {nb / 1e6:.2f} | {ideal * 1e6:.2f} | {fmt(t_tr)} | {pct(ideal, t_tr)} | "
                         f"{fmt(t_cu)} | {pct(ideal, t_cu)} | {fmt(base)} | {pct(ideal, base)} |")
        if rows_sweep:
            lines += ["", f"## CUDA C split sweep at 1 row (blocks per matrix; served: {CUDA_TARGET_BLOCKS}), and the "
                      "bench-only forms (served split) at 1 and 8 rows", "",
                      "| linear | ideal (us) | " + " | ".join(f"target {tg}: S, us, %" for tg, _, _ in rows_sweep[0][2])
                      + " | " + " | ".join(f"{VARIANTS[v]}, {r} row(s): us, %" for v, r in rows_sweep[0][3]) + " |",
                      "|---|---|" + "---|" * (len(rows_sweep[0][2]) + len(rows_sweep[0][3]))]
            for name, ideal, res, tw, same in rows_sweep:
                lines.append(f"| {name} | {ideal * 1e6:.2f} | "
                             + " | ".join(f"{S}, {t * 1e6:.1f}, {ideal / t * 100:.1f}" for _, S, t in res) + " | "
                             + " | ".join(f"{t * 1e6:.1f}, {ideal / t * 100:.1f}" for t in tw.values()) + " |")
            lines += ["", "Forms with the served kernel's bits (8 rows, each linear): "
                      + "; ".join(f"{name}: " + ", ".join(f"{v} {ok}" for v, ok in same.items())
                                  for name, _, _, _, same in rows_sweep), ""]
        if rows_p:
            lines += ["", f"## Prompt pass, M = {M} rows, routed expert 5120 -> 2304 @ 2.5 bpw mul1", "",
                      "| path | time (ms) | TFLOP/s | % of fp16 GEMM |", "|---|---|---|---|"]
            for name, t in rows_p:
                lines.append(f"| {name} | {t * 1e3:.3f} | {flops / t / 1e12:.1f} | "
                             f"{flops / t / 1e12 / ceil['fp16_TFLOPs'] * 100:.1f} |")
            lines += ["", f"Reconstruct (trellis -> W~ fp16 in memory) alone: {t_rec * 1e6:.1f} us.", ""]
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines))

    rows_dec, rows_routed, rows_forms, rows_lin, rows_sweep, rows_p = [], [], [], [], [], []
    t_rec = None
    M = args.prompt_rows
    flops = 2 * M * D * INTER
    for B in (1, 8):
        runs, nb, n_used, routed, nb_r = decode_layer(B, g)
        t, tr = time_all(runs, f"decode round B={B}"), time_all(routed, f"routed B={B}")
        rows_dec.append((B, n_used, nb, t.get("triton"), t.get("cuda"), nb / bw, t.get("cuda pdl")))
        rows_routed.append((B, n_used, nb_r, tr.get("triton"), tr.get("cuda"), nb_r / bw,
                            tr.get("cuda, served (exl3_routed)")))
        rows_forms.append((B, tr, nb_r / bw))
        print(f"decode round B={B}: " + ", ".join(f"{k} {v * 1e6:.1f} us ({nb / bw / v * 100:.1f}%)"
                                                   for k, v in t.items())
              + f"; {nb / 1e6:.1f} MB read, ideal {nb / bw * 1e6:.1f} us; routed experts alone: "
              + ", ".join(f"{k} {v * 1e6:.1f} us ({nb_r / bw / v * 100:.1f}%)" for k, v in tr.items()), flush=True)
        del runs, routed
        torch.cuda.empty_cache()

    if HAS_CUDA:
        try:
            pdl_ok = pdl_chain_check(g)
        except Exception as exc:
            pdl_ok = repr(exc)
        print(f"dependent launches, a chain of 3 linears in a graph: the plain launches' bits: {pdl_ok}", flush=True)

    # single linears: where the time goes
    write_report()
    for name, n_in, n_out, K, cb in (LINEARS[:4] if args.quick else LINEARS):
        tp = parts(n_in, n_out, K, cb, g)
        wt = Exl3Weight.from_tensors(tp, DEVICE)
        nb = nbytes(wt)
        for rows in ((1, 8) if args.quick else (1, 8, 32)):
            x1 = torch.randn(rows, n_in, device=DEVICE)
            t_tr = time_graph(lambda: exl3_linear_triton(x1, wt)) if TRITON else None
            t_cu = time_graph(lambda: exl3_linear_cuda(x1, wt)) if HAS_CUDA else None
            base = exllamav3_time(n_in, n_out, K, cb, tp, x1) if args.exllamav3 else None
            rows_lin.append((name, rows, nb, t_tr, t_cu, nb / bw, base))
            print(f"  {name} rows {rows}: triton {fmt(t_tr)} us, cuda {fmt(t_cu)} us, exllamav3 {fmt(base)} us, "
                  f"ideal {nb / bw * 1e6:.2f} us (cuda {pct(nb / bw, t_cu)}%)", flush=True)
        del wt
        torch.cuda.empty_cache()

    # the split (blocks per matrix, cuda_split's target) swept at 1 row: the served default is CUDA_TARGET_BLOCKS
    write_report()
    if HAS_CUDA:
        targets = (132, CUDA_TARGET_BLOCKS, 792)
        for name, n_in, n_out, K, cb in LINEARS[:4]:
            wt = Exl3Weight.from_tensors(parts(n_in, n_out, K, cb, g), DEVICE)
            x1 = torch.randn(1, n_in, device=DEVICE)
            ts = [time_graph(lambda tg=tg: exl3_linear_cuda(x1, wt, target=tg)) for tg in targets]
            tw = {(v, r): time_graph(lambda v=v, r=r: exl3_linear_cuda(x1[:1].expand(r, -1).contiguous(), wt,
                                                                       variant=v))
                  for v, r in [(v, 1) for v in VARIANTS] + [("w", 8), ("o", 8)]}
            x8 = torch.randn(8, n_in, device=DEVICE)
            served = exl3_linear_cuda(x8, wt)
            same = {v: torch.equal(exl3_linear_cuda(x8, wt, variant=v), served) for v in VARIANTS if v not in ("n", "e")}
            rows_sweep.append((name, nbytes(wt) / bw, [(tg, cuda_split(n_in, n_out, tg)[0], t) for tg, t in
                                                       zip(targets, ts)], tw, same))
            print(f"  split sweep {name}: " + ", ".join(f"target {tg} (S={S}) {t * 1e6:.1f} us"
                                                       for tg, S, t in rows_sweep[-1][2])
                  + "; " + ", ".join(f"{VARIANTS[v]} rows {r}: {t * 1e6:.1f} us" for (v, r), t in tw.items())
                  + "; the served bits (8 rows): " + ", ".join(f"{v} {ok}" for v, ok in same.items()), flush=True)
        del wt
        torch.cuda.empty_cache()

    write_report()
    # prompt pass
    if not args.quick:
        wt = Exl3Weight.from_tensors(parts(D, INTER, 2.5, CB_MUL1, g), DEVICE)
        xp = torch.randn(M, D, device=DEVICE)
        t_fused = time_graph(lambda: exl3_linear_triton(xp, wt))
        t_rec = time_graph(lambda: exl3_reconstruct(wt))
        t_prompt = time_graph(lambda: exl3_linear_prompt(xp, wt))
        w_rot = exl3_reconstruct(wt)
        t_gemm = time_graph(lambda: exl3_linear_prompt(xp, wt, w_rot=w_rot))
        rows_p = [("Triton fused (decode in the GEMM loop, row-invariant)", t_fused)]
        if HAS_CUDA:
            rows_p.append(("CUDA C kernel (64-row blocks, row-invariant)", time_graph(lambda: exl3_linear_cuda(xp, wt))))
        rows_p += [("reconstruct W~ + cuBLAS fp16 GEMM", t_prompt),
                   ("cuBLAS GEMM + Hadamards only (W~ already decoded)", t_gemm)]
    for name, t in rows_p:
        print(f"prompt M={M}: {name}: {t * 1e3:.3f} ms, {flops / t / 1e12:.1f} TFLOP/s "
              f"({flops / t / 1e12 / ceil['fp16_TFLOPs'] * 100:.1f}% of fp16 GEMM)", flush=True)
    if t_rec is not None:
        print(f"reconstruct alone: {t_rec * 1e6:.1f} us", flush=True)

    write_report()
    print(open(args.out).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
