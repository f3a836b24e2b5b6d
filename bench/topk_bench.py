"""GPU time of the router's scores (kernels/router.py) and the top-k selections (kernels/topk.py) against the torch
paths they replace, at decode row counts: the router's elementwise part (`moe.router_scores`, image rows), its
pick (384 experts, top 6: `linear.stable_topk`, a full stable sort) and the indexer's selection (T keys per row,
top 512: `indexer.select_topk`, three torch.topk calls; the kernel in its forms: up to REG_T entries the row in
registers (the served form there); the radix passes one program per row and a row split in SPLIT_CHUNK-entry chunks
(select_topk picks by T > SPLIT_T), each with 11- and 8-bit radix digits),
each checked equal first (the scores' row says "NOT bitwise" where they differ). Beside them the indexer's scores
of a decode round (`kernels.indexer.index_scores_table`, 32 heads of 128, T float32 keys a sequence, a row a
sequence) against the same function in torch (bmm, relu, the heads' weighted sum; float32, not bitwise) and the
keys' read at the device's copy rate.

Each op is captured `--calls` times in one CUDA graph (inputs fixed), the graph replayed `--reps` times between CUDA
events: µs per call, launch overhead included as a graphed decode round has it.

    python bench/topk_bench.py [--rows 1,8,32] [--T 512,4096,65536] [--out bench/results/topk.md]
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def graphed_us(fn, calls: int, reps: int) -> float:
    """µs per call of fn() captured `calls` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * calls)


def copy_rate() -> float:
    """Bytes a second of a 1 GiB device copy (read + write)."""
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    us = graphed_us(lambda: y.copy_(x), 2, 10)
    return 2 * x.numel() * 4 / (us * 1e-6)


def index_scores_line(rows: int, T: int, g, dev, calls: int, reps: int, rate: float) -> str:
    """The decode round's indexer scores: `rows` sequences of one row, T keys each, V4.1's 32 heads of 128; rate:
    the device's copy rate (bytes a second) for the keys' read."""
    from kernels.indexer import index_scores_table
    H, D = 32, 128
    keys = [(torch.randn(T, D, generator=g)).to(dev) for _ in range(rows)]
    q = torch.randn(rows, H, D, generator=g).to(dev)
    w = (torch.randn(rows, H, generator=g) * H ** -0.5).to(dev)
    table = torch.tensor([k.data_ptr() for k in keys], dtype=torch.int64, device=dev)
    counts = torch.full((rows,), T, dtype=torch.int64, device=dev)
    kk = torch.stack(keys)                                                  # [rows, T, D] for the torch form

    def torch_form():
        s = torch.relu(torch.bmm(q, kk.transpose(1, 2))) * D ** -0.5       # [rows, H, T]
        return (s * w[:, :, None]).sum(1)

    got = index_scores_table(q, w, table, counts, T, D ** -0.5)
    close = torch.allclose(got, torch_form(), rtol=1e-4, atol=1e-4 * got.abs().max().item())
    t0 = graphed_us(torch_form, min(calls, 10), reps)
    t1 = graphed_us(lambda: index_scores_table(q, w, table, counts, T, D ** -0.5), min(calls, 10), reps)
    # QAT's inputs (FP4 values times powers of two, exact in TF32): the served one-pass form, its bits checked
    from dsv41.model.quant import fp4_fake_quant_ue8m0
    q.copy_(fp4_fake_quant_ue8m0(q))
    for k in keys:
        k.copy_(fp4_fake_quant_ue8m0(k))
    same = torch.equal(index_scores_table(q, w, table, counts, T, D ** -0.5, one_pass=True),
                       index_scores_table(q, w, table, counts, T, D ** -0.5))
    t2 = graphed_us(lambda: index_scores_table(q, w, table, counts, T, D ** -0.5, one_pass=True), min(calls, 10),
                    reps)
    floor = rows * T * D * 4 / rate * 1e6
    return (f"| indexer scores T={T} H={H}{'' if close else ' (NOT close to torch)'}, keys' read "
            f"{floor:.1f} us at copy rate | {rows} | {t0:.1f} | {t1:.1f} | {t0 / t1:.1f} |\n"
            f"| indexer scores T={T} H={H}, QAT inputs, one TF32 pass (served under QAT)"
            f"{'' if same else ' (NOT the three passes bits)'} | {rows} | {t0:.1f} | {t2:.1f} | {t0 / t2:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--T", default="512,4096,65536")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench/results/topk.md"))
    a = ap.parse_args()
    from dsv41.model.indexer import select_topk
    from dsv41.model.linear import stable_topk
    from dsv41.model.moe import router_scores
    from kernels import router, topk
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    rate = copy_rate()
    lines = ["| op | rows | torch µs | kernel µs | torch / kernel |", "|---|---:|---:|---:|---:|"]
    for rows in [int(r) for r in a.rows.split(",")]:
        z = (torch.randn(rows, 384, generator=g) * 4).to(dev)
        bias, img = (torch.randn(384, generator=g) * 0.1).to(dev), torch.zeros(rows, dtype=torch.bool, device=dev)
        same = [torch.equal(p, q) for p, q in zip(router_scores(z, 1.0, bias, bias, img),
                                                  router.router_scores(z, 1.0, bias, bias, img))]
        t0 = graphed_us(lambda z=z, i=img: router_scores(z, 1.0, bias, bias, i), a.calls, a.reps)
        t1 = graphed_us(lambda z=z, i=img: router.router_scores(z, 1.0, bias, bias, i), a.calls, a.reps)
        lines.append(f"| router scores E=384{'' if all(same) else ' (NOT bitwise)'} | {rows} | {t0:.1f} | "
                     f"{t1:.1f} | {t0 / t1:.1f} |")
        s = torch.randn(rows, 384, generator=g).to(dev)
        assert torch.equal(topk.router_topk(s, 6)[1], stable_topk(s, 6)[1])
        t0 = graphed_us(lambda s=s: stable_topk(s, 6), a.calls, a.reps)
        t1 = graphed_us(lambda s=s: topk.router_topk(s, 6), a.calls, a.reps)
        lines.append(f"| router pick E=384 k=6 | {rows} | {t0:.1f} | {t1:.1f} | {t0 / t1:.1f} |")
        for T in [int(t) for t in a.T.split(",")]:
            lines.append(index_scores_line(rows, T, g, dev, a.calls, a.reps, rate))
            x = torch.randn(rows, T, generator=g).to(dev)
            x[:, T - T // 8:] = float("-inf")                          # a round's padding
            want = select_topk(x, 512)
            t0 = graphed_us(lambda x=x: select_topk(x, 512), a.calls, a.reps)
            if T <= topk.REG_T:              # the served form up to REG_T: the row in registers
                assert torch.equal(topk.select_topk(x, 512), want)
                t1 = graphed_us(lambda x=x: topk.select_topk(x, 512), a.calls, a.reps)
                lines.append(f"| indexer select T={T} k=512 (the row in registers) | {rows} | {t0:.1f} | "
                             f"{t1:.1f} | {t0 / t1:.1f} |")
            for split in (False, True):      # one program per row; chunks of SPLIT_CHUNK a program each
                for bits in (11, 8):         # the radix digit: 3 passes of 2048 bins, 4 of 256
                    assert torch.equal(topk.select_topk(x, 512, split=split, bits=bits), want)
                    t1 = graphed_us(lambda x=x, sp=split, b=bits: topk.select_topk(x, 512, split=sp, bits=b),
                                    a.calls, a.reps)
                    how = f"split {topk.SPLIT_CHUNK}" if split else "a program per row"
                    lines.append(f"| indexer select T={T} k=512 ({how}, {bits}-bit digits) | {rows} | {t0:.1f} | "
                                 f"{t1:.1f} | {t0 / t1:.1f} |")
        print("\n".join(lines), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    head = [f"## topk_bench ({commit}, {torch.cuda.get_device_name()}, {platform.node()})", "",
            f"`python bench/topk_bench.py --rows {a.rows} --T {a.T}`: µs per call, {a.calls} calls per CUDA graph, "
            f"{a.reps} replays; each pair checked equal first; device copy {rate / 1e12:.2f} TB/s.", ""]
    out = Path(a.out)
    old = out.read_text() if out.exists() else "# Top-k selections: kernels/topk.py against the torch paths\n\n"
    title, _, rest = old.partition("\n\n")
    out.write_text(title + "\n\n" + "\n".join(head + lines) + "\n\n" + rest)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
