"""Ring latency for decode-round tensors: all_reduce_sum of [rows, 5120] fp32/bf16 between two processes.

    python bench/comm_bench.py                                  # CPU: shm ring vs gloo -> bench/results/comm-cpu.md
    python bench/comm_bench.py --device cuda        # GPUs: cuda-ipc (+ nccl with 2 GPUs) -> bench/results/comm-cuda.md
    python bench/comm_bench.py tp-plan                          # bytes per round, expert TP vs EP (docs/comm.md)

Two processes (rank 0, rank 1) on this host; each op is timed on rank 0 from call to result (on a GPU: to the
end of the stream). Prints a table of median / p90 microseconds and writes it as markdown with the command and
machine. Figures on a shared or oversubscribed host are noisy: the table says how many CPUs there were.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import random
import secrets
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.comm.channel import free_lane_port  # noqa: E402

HIDDEN = 5120
ROWS = (1, 2, 4, 8, 16, 32, 64)


def worker(rank: int, args, session: str, port: int, q) -> None:
    import torch
    from dsv41.comm.ring import CudaIpcRing, DistRing, ShmRing
    torch.set_num_threads(args.threads)
    dev = torch.device("cpu")
    if args.device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())     # one GPU: both ranks share it
        torch.cuda.set_device(dev)
    rings = {}
    for i, kind in enumerate(args.transports.split(",")):
        if kind == "shm":
            rings[kind] = ShmRing(rank, 2, session + str(i), timeout=60)
        elif kind == "cuda-ipc":
            rings[kind] = CudaIpcRing(rank, 2, session + str(i), dev, timeout=60)
        else:
            rings[kind] = DistRing(rank, 2, kind, "127.0.0.1", port + i, timeout=60, device=dev)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            t = torch.randn(rows, HIDDEN, device=dev).to(dtype)
            cell = {kind: [] for kind in rings}
            for it in range(args.warmup + args.iters):
                for kind, ring in rings.items():     # interleaved, so load changes hit every transport alike
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ring.all_reduce_sum(t)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    if it >= args.warmup:
                        cell[kind].append(time.perf_counter() - t0)
            for kind, times in cell.items():
                results[(kind, str(dtype).removeprefix("torch."), rows)] = times
    for ring in rings.values():
        ring.close()
    if rank == 0:
        q.put(results)


def run(args) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # the DistRing stores' ports (one per transport), below the ephemeral range: a rank's retried connect
    # could otherwise take one as its own source port
    session, port = secrets.token_hex(6), free_lane_port(count=len(args.transports.split(",")))
    ps = [ctx.Process(target=worker, args=(r, args, session, port, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    results = q.get(timeout=1800)
    for p in ps:
        p.join(60)
    kinds = args.transports.split(",")
    head = ["dtype", "rows", "bytes"] + [f"{k} median µs" for k in kinds] + [f"{k} p90 µs" for k in kinds]
    lines = []
    for dtype in ("float32", "bfloat16"):
        for rows in ROWS:
            row = [dtype, str(rows), str(rows * HIDDEN * (4 if dtype == "float32" else 2))]
            med, p90 = [], []
            for k in kinds:
                ts = sorted(results[(k, dtype, rows)])
                med.append(f"{statistics.median(ts) * 1e6:.0f}")
                p90.append(f"{ts[int(0.9 * (len(ts) - 1))] * 1e6:.0f}")
            lines.append(row + med + p90)
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in lines]
    print("\n".join(table))
    machine = f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    note = []
    if args.device == "cuda":
        import torch
        machine += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if torch.cuda.device_count() == 1:
            note = ["Both ranks share the one GPU: their CUDA contexts are time-sliced, so these figures are a "
                    "correctness run's, not the two-GPU latency.", ""]
    import torch
    text = [f"# Ring all_reduce_sum latency ({args.device}, 2 ranks, one host)", "",
            f"Command: `python bench/comm_bench.py {' '.join(sys.argv[1:])}`", "",
            f"Machine: {machine}; torch {torch.__version__}; torch threads per rank: {args.threads}; "
            f"{args.iters} timed ops after {args.warmup} warm-up per cell; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "", *note, *table, ""]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(text))
        print(f"wrote {args.out}")


# ------------------------------------------------------------------------------------------------ tp-plan arithmetic

def tp_plan(seed: int = 0, trials: int = 2000) -> str:
    """Bytes a rank moves per MoE layer and round, routed experts tensor-parallel vs expert-parallel (TP2), V4.1
    shapes. Routing and activations are replicated on both ranks (the router is cheap), so neither needs a token
    all-to-all: both end in the same [rows, 5120] fp32 all-reduce. They differ in weight bytes read from memory,
    which bounds a decode round: TP reads half of every touched expert on each rank, EP reads whole experts on the
    rank that owns them, and the round waits for the busier rank. Expert ids are drawn uniformly (top-6 distinct of
    384 per row); real routing is less uniform, which favours TP further."""
    n_exp, top_k, hidden, inter = 384, 6, 5120, 2304
    expert_bytes = 3 * hidden * inter // 2 + 3 * hidden * inter // 32       # FP4 + one E8M0 per 32
    rng = random.Random(seed)
    out = ["| rows | touched experts (mean) | TP: weight MB/rank | EP: weight MB, busier rank (mean) | EP/TP | "
           "all-reduce KB/rank (both) |", "|---|---|---|---|---|---|"]
    for rows in ROWS:
        touched, busier = [], []
        for _ in range(trials):
            s = set()
            for _ in range(rows):
                s.update(rng.sample(range(n_exp), top_k))
            touched.append(len(s))
            r0 = sum(1 for e in s if e < n_exp // 2)
            busier.append(max(r0, len(s) - r0))
        u, b = statistics.mean(touched), statistics.mean(busier)
        tp_mb, ep_mb = u * expert_bytes / 2 / 1e6, b * expert_bytes / 1e6
        out.append(f"| {rows} | {u:.1f} | {tp_mb:.0f} | {ep_mb:.0f} | {ep_mb / tp_mb:.2f} | "
                   f"{rows * hidden * 4 / 1e3:.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="latency", choices=["latency", "tp-plan"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--transports", default=None, help="comma list; default shm,gloo (cpu), cuda-ipc,nccl (2+ GPUs), cuda-ipc (1 GPU)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=None, help="markdown file (default bench/results/comm-<device>.md)")
    args = ap.parse_args()
    if args.what == "tp-plan":
        print(tp_plan())
        return
    if not args.transports and args.device == "cuda":
        import torch
        args.transports = "cuda-ipc,nccl" if torch.cuda.device_count() >= 2 else "cuda-ipc"
    args.transports = args.transports or "shm,gloo"
    args.out = args.out or str(ROOT / "bench" / "results" / f"comm-{args.device}.md")
    run(args)


if __name__ == "__main__":
    main()
