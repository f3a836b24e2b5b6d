"""What a launch costs inside a CUDA graph on this GPU, and what programmatic dependent launch (PDL) saves (issue 24).

A 1-row decode layer is ~57 launches (bench/results/launches-cpu.md); most move a few KB, so the floor of a layer is
set by the gap between dependent kernels in the round's graph, not by bytes. This measures that gap on chains of
dependent Triton kernels replayed as one CUDA graph, and the same chains launched with PDL (`launch_pdl=True`, each
kernel waiting with `griddepcontrol.wait` before it reads its input, so the next kernel's launch and prologue overlap
the previous kernel's tail), in two shapes:

- tiny: one program, 256 floats in, 256 out (a norm / RoPE / mix of one row);
- gemv: 132 programs, each reading a 32 KB slice of a weight (4.1 MB: a small projection) and the previous kernel's
  output; with PDL the weight slice is loaded before the wait (weights are no kernel's output), so its read
  overlaps the previous kernel too.

  python3 bench/pdl_bench.py [--out bench/results/pdl.md]
  python3 bench/pdl_bench.py --checkpoint /tmp/r2 [--rows 1,32] [--out ...]   # also: graphed decode rounds of a
      checkpoint with the decode kernels' PDL (kernels/pdl.py) on and off, each with its own captures, and whether
      the rounds' logits are the same bits both ways
"""
from __future__ import annotations

import argparse
import datetime
import socket
import subprocess
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

ROOT = Path(__file__).resolve().parent.parent


@triton.jit
def _tiny(x_ptr, y_ptr, N: tl.constexpr, PDL: tl.constexpr):
    offs = tl.arange(0, N)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, x * 0.5 + 1.0)


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, K: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    k = tl.arange(0, K)
    c = tl.arange(0, COLS)
    w = tl.load(w_ptr + pid * COLS * K + c[:, None] * K + k[None, :])      # not a kernel's output: before the wait
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + k)
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + pid * COLS + c, y)


def chain_time(kind: str, pdl: bool, n: int) -> float:
    """Median µs per kernel of a chain of n dependent kernels replayed as one CUDA graph."""
    if kind == "tiny":
        bufs = [torch.randn(256, device="cuda") for _ in range(n + 1)]

        def run():
            for i in range(n):
                _tiny[(1,)](bufs[i], bufs[i + 1], N=256, PDL=pdl, num_warps=1, launch_pdl=pdl)
    else:
        K, COLS, P = 128, 128, 132            # x: 128 floats; each program 128 x 128 bf16 = 32 KB of weight
        ws = [torch.randn(P * COLS, K, device="cuda").to(torch.bfloat16) for _ in range(n)]
        bufs = [torch.randn(P * COLS, device="cuda") for _ in range(n + 1)]

        def run():
            for i in range(n):
                _gemv[(P,)](bufs[i], ws[i], bufs[i + 1], K=K, COLS=COLS, PDL=pdl, num_warps=4, launch_pdl=pdl)
    run()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3 / n


def model_rows(checkpoint: str, rows: list[int], context: int = 2048, rounds: int = 20) -> list[str]:
    """ms per graphed decode round (gpu_bench's time_rounds) with kernels/pdl.py's ENABLED on, then off (a model
    loaded for each: its graphs captured so), the rows holding `context` tokens; then one more round's logits of
    every row compared bitwise."""
    import sys
    sys.path.insert(0, str(ROOT))
    from gpu_bench import time_rounds

    from dsv41.model.model import Model, SeqInput
    from kernels import pdl
    out, logits = [], {}
    for on in (True, False):
        pdl.ENABLED = on
        model = Model.load(checkpoint, device="cuda")
        base = model.new_state()
        g = torch.Generator().manual_seed(0)
        V = min(1000, model.t.vocab_size)
        model.forward([SeqInput(base, torch.randint(3, V, (context,), generator=g), logits="none")])
        for n in rows:
            states = [base.snapshot() for _ in range(n)]
            out.append((on, n, time_rounds(model, states, rounds) * 1e3))
            toks = torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(n))
            got = model.forward([SeqInput(st, toks[i:i + 1], logits="last") for i, st in enumerate(states)])
            logits[(on, n)] = torch.cat(got).cpu()
        del model
        torch.cuda.empty_cache()
    pdl.ENABLED = True
    lines = ["| rows | PDL on ms / round | PDL off ms / round | on / off | logits equal |", "|---|---|---|---|---|"]
    for n in rows:
        on_ms = next(ms for o, r, ms in out if o and r == n)
        off_ms = next(ms for o, r, ms in out if not o and r == n)
        lines.append(f"| {n} | {on_ms:.3f} | {off_ms:.3f} | {on_ms / off_ms:.2f} | "
                     f"{torch.equal(logits[(True, n)], logits[(False, n)])} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--rows", default="1,32")
    a = ap.parse_args()
    rows = []
    for kind in ("tiny", "gemv"):
        plain = chain_time(kind, False, a.chain)
        pdl = chain_time(kind, True, a.chain)
        rows.append(f"| {kind} | {plain:.2f} | {pdl:.2f} | {pdl / plain:.2f} |")
        print(rows[-1], flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip() or "(no git)"
    except OSError:
        commit = "(no git)"
    text = "\n".join([
        f"## {datetime.date.today()} · {torch.cuda.get_device_name()} · {socket.gethostname()} · commit {commit}",
        "", f"`python3 bench/pdl_bench.py` — chains of {a.chain} dependent kernels replayed as one CUDA graph; µs "
        "per kernel (median replay / chain length), PDL against plain launches in the same run.", "",
        "| chain | plain µs/kernel | PDL µs/kernel | PDL / plain |", "|---|---|---|---|", *rows, ""])
    if a.checkpoint:
        table = model_rows(a.checkpoint, [int(r) for r in a.rows.split(",")])
        print("\n".join(table), flush=True)
        text += "\n".join(["", f"Graphed decode rounds of `{a.checkpoint}` (2048-token context; timed as gpu_bench "
                           "does, the bits compared on one more round's logits), the decode kernels' PDL on and off "
                           "(kernels/pdl.py), each with its own captures:", "",
                           *table, ""])
    print(text)
    if a.out:
        p = Path(a.out)
        old = p.read_text() if p.exists() else "# Launch gaps in a CUDA graph, plain and PDL (bench/pdl_bench.py)\n\n"
        head, _, rest = old.partition("\n## ")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(head.rstrip() + "\n\n" + text + ("\n## " + rest if rest else ""))


if __name__ == "__main__":
    main()
