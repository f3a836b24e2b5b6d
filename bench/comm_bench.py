"""Ring latency for decode-round tensors: all_reduce_sum of [rows, 5120] fp32/bf16 between 2, 4 or 8 processes, and
a whole round's communication (the release's 80 all-reduces of [rows, 5120] fp32 + the logits all-gather).

    python bench/comm_bench.py [--world 2,4]                    # CPU: shm ring vs gloo -> bench/results/comm-cpu.md
    python bench/comm_bench.py --device cuda [--world 2,4,8]    # GPUs: cuda-ipc, shm-cuda (the registered host ring),
                                                                # nccl (when every rank has its own GPU)
                                                                # -> bench/results/comm-cuda.md
    python bench/comm_bench.py tp-plan                          # bytes per round, expert TP vs EP (docs/comm.md)

`world` processes on this host; each op is timed on rank 0 from call to result (on a GPU: to the end of the stream).
A round: 2 all-reduces per layer x 40 layers of the [rows, 5120] fp32 partials, then the all-gather of each rank's
[rows, 129280 / world] fp32 logits columns, timed as one sequence on rank 0. Prints the tables and puts them at the
top of the markdown file (newest run first) with the command and machine. Figures on a shared or oversubscribed host
are noisy (each rank spins while it waits): the table says how many CPUs there were.
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
VOCAB = 129280
LAYERS = 40
ROWS = (1, 2, 4, 8, 16, 32, 64)
ROUND_ROWS = (1, 8, 32, 64)


def _ring(kind: str, rank: int, world: int, session: str, port: int, dev):
    from dsv41.comm.ring import CudaIpcRing, DistRing, RegisteredShmRing, ShmRing
    if kind == "shm":
        return ShmRing(rank, world, session, timeout=120)
    if kind == "shm-cuda":
        return RegisteredShmRing(rank, world, session, dev, timeout=120)
    if kind == "cuda-ipc":
        return CudaIpcRing(rank, world, session, dev, timeout=120)
    return DistRing(rank, world, kind, "127.0.0.1", port, timeout=120, device=dev)


def worker(rank: int, world: int, args, session: str, port: int, q) -> None:
    import torch
    torch.set_num_threads(args.threads)
    dev = torch.device("cpu")
    if args.device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())     # fewer GPUs than ranks: they share
        torch.cuda.set_device(dev)
    kinds = args.transports.split(",")
    rings = {kind: _ring(kind, rank, world, session + str(i), port + i, dev) for i, kind in enumerate(kinds)}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            t = torch.randn(rows, HIDDEN, device=dev).to(dtype)
            cell = {kind: [] for kind in rings}
            for it in range(args.warmup + args.iters):
                for kind, ring in rings.items():     # interleaved, so load changes hit every transport alike
                    sync()
                    t0 = time.perf_counter()
                    ring.all_reduce_sum(t)
                    sync()
                    if it >= args.warmup:
                        cell[kind].append(time.perf_counter() - t0)
            for kind, times in cell.items():
                results[(kind, str(dtype).removeprefix("torch."), rows)] = times
    for rows in ROUND_ROWS:
        partial = torch.randn(rows, HIDDEN, device=dev)
        logits = torch.randn(rows, VOCAB // world, device=dev)
        cell = {kind: [] for kind in rings}
        for it in range(2 + args.rounds):
            for kind, ring in rings.items():
                sync()
                t0 = time.perf_counter()
                for _ in range(2 * LAYERS):
                    ring.all_reduce_sum(partial)
                ring.all_gather(logits)
                sync()
                if it >= 2:
                    cell[kind].append(time.perf_counter() - t0)
        for kind, times in cell.items():
            results[(kind, "round", rows)] = times
    for ring in rings.values():
        ring.close()
    if rank == 0:
        q.put(results)


def _pct(ts: list[float], p: float) -> float:
    ts = sorted(ts)
    return ts[int(p * (len(ts) - 1))]


def run_world(args, world: int) -> list[str]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    kinds = args.transports.split(",")
    # the DistRing stores' ports (one per transport), below the ephemeral range: a rank's retried connect
    # could otherwise take one as its own source port
    session, port = secrets.token_hex(6), free_lane_port(count=len(kinds))
    ps = [ctx.Process(target=worker, args=(r, world, args, session, port, q)) for r in range(world)]
    for p in ps:
        p.start()
    results = q.get(timeout=3600)
    for p in ps:
        p.join(60)
    head = ["dtype", "rows", "bytes"] + [f"{k} median µs" for k in kinds] + [f"{k} p90 µs" for k in kinds]
    lines = []
    for dtype in ("float32", "bfloat16"):
        for rows in ROWS:
            row = [dtype, str(rows), str(rows * HIDDEN * (4 if dtype == "float32" else 2))]
            med = [f"{statistics.median(results[(k, dtype, rows)]) * 1e6:.0f}" for k in kinds]
            p90 = [f"{_pct(results[(k, dtype, rows)], 0.9) * 1e6:.0f}" for k in kinds]
            lines.append(row + med + p90)
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in lines]
    rhead = (["rows", "bytes per rank"] + [f"{k} median ms" for k in kinds] + [f"{k} per op µs" for k in kinds]
             + [f"{k} MB/s per rank" for k in kinds])
    rlines = []
    for rows in ROUND_ROWS:
        nbytes = 2 * LAYERS * rows * HIDDEN * 4 + rows * (VOCAB // world) * 4     # what each rank contributes
        med = [statistics.median(results[(k, "round", rows)]) for k in kinds]
        rlines.append([str(rows), f"{nbytes / 1e6:.1f} MB"] + [f"{m * 1e3:.1f}" for m in med]
                      + [f"{m / (2 * LAYERS + 1) * 1e6:.0f}" for m in med] + [f"{nbytes / m / 1e6:.0f}" for m in med])
    rtable = (["| " + " | ".join(rhead) + " |", "|" + "---|" * len(rhead)]
              + ["| " + " | ".join(r) + " |" for r in rlines])
    out = [f"### {world} ranks: all_reduce_sum of [rows, {HIDDEN}]", "", *table, "",
           f"### {world} ranks: a decode round's communication ({2 * LAYERS} all_reduce_sum of [rows, {HIDDEN}] fp32 "
           f"+ all_gather of [rows, {VOCAB // world}] fp32; median of {args.rounds} rounds)", "", *rtable, ""]
    print("\n".join(out))
    return out


def run(args) -> None:
    import torch
    worlds = [int(w) for w in args.world.split(",")]
    body = []
    for world in worlds:
        body += run_world(args, world)
    machine = f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    note = []
    if args.device == "cuda":
        n = torch.cuda.device_count()
        machine += f", {n} x {torch.cuda.get_device_name(0)}"
        if n < max(worlds):
            note = [f"{max(worlds)} ranks on {n} GPU(s): ranks share GPUs, their CUDA contexts time-sliced, so these "
                    "figures are a correctness run's, not the latency of one GPU per rank.", ""]
    elif (os.cpu_count() or 1) < max(worlds) * args.threads:
        note = [f"{max(worlds)} ranks on {os.cpu_count()} CPUs: the ranks outnumber the cores and each spins while "
                "it waits, so the wider rings measure the oversubscription as much as the transport.", ""]
    text = [f"## Ring latency ({args.device}, {', '.join(map(str, worlds))} ranks, one host), "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
            f"Command: `python bench/comm_bench.py {' '.join(sys.argv[1:])}`", "",
            f"Machine: {machine}; torch {torch.__version__}; commit {_commit()}; torch threads per rank: "
            f"{args.threads}; {args.iters} timed ops after {args.warmup} warm-up per cell", "", *note, *body]
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        title = "# Ring all_reduce_sum latency and a round's communication (newest run first)"
        old = path.read_text() if path.is_file() else ""
        if old.startswith(title):
            old = old[len(title):].lstrip("\n")
        elif old.startswith("# "):      # the file's first run, written before runs were kept: a section now
            old = "#" + old
        path.write_text("\n".join([title, "", *text, ""]) + ("\n" + old if old else ""))
        print(f"wrote {args.out}")


def _commit() -> str:
    import subprocess
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or "?"


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
    ap.add_argument("--world", default="2", help="comma list of rank counts, e.g. 2,4")
    ap.add_argument("--transports", default=None,
                    help="comma list; default shm,gloo (cpu); cuda: cuda-ipc where the GPUs reach each other, "
                         "shm-cuda, and nccl where every rank has its own GPU")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per row count")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=None, help="markdown file (default bench/results/comm-<device>.md)")
    args = ap.parse_args()
    if args.what == "tp-plan":
        print(tp_plan())
        return
    if not args.transports and args.device == "cuda":
        import torch

        from dsv41.comm.ring import cuda_peers_reach
        widest = max(int(w) for w in args.world.split(","))
        kinds = (["cuda-ipc"] if cuda_peers_reach(widest) else []) + ["shm-cuda"]
        args.transports = ",".join(kinds + (["nccl"] if torch.cuda.device_count() >= widest else []))
    args.transports = args.transports or "shm,gloo"
    args.out = args.out or str(ROOT / "bench" / "results" / f"comm-{args.device}.md")
    run(args)


if __name__ == "__main__":
    main()
