"""The model's GPU path on a real-shaped partial checkpoint (dsv41.tools.make_real): decode rounds and prompt passes
against the GPU's limits measured in the same run (docs/gpu.md).

Ceilings (same run): copy bandwidth (a device-to-device copy of 4 GiB: read + write bytes / time) and the bf16 matrix
rate (8192³ cuBLAS products).
Decode: R sequences (R = 1..64) each holding a `--context`-token prompt (one prefill, then snapshots) decode one
token per round through Model.forward (logits "none": the K layers; the head is timed apart). Per layer: the round
time / K against the bytes the round must read in checkpoint form: the layer's non-expert weights (FP8, BF16 and
F32 as stored), the routed experts its rows touched (counted in the round), and per row its KV reads at their
quantised widths (window 128 x 512 FP8; 512 selected compressed entries x 512 FP4; the indexer keys x 128 FP4).
Prompt pass: one prompt of P tokens in chunks of `--chunk` rows; FLOPs per token = 2 x the weights a token multiplies
(its 6 routed experts + shared + attention/indexer/compressor projections + mHC) + attention and indexer scores.
Extrapolated to the release's 40 layers as 40 x (mean per-layer time) + head, and said so.

  python bench/gpu_bench.py --checkpoint DIR [--context 2048] [--prompts 8192,32768] [--budget-s 150]
                            [--out bench/results/gpu.md] [--commit SHA]
"""
from __future__ import annotations

import argparse
import datetime
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.config import ModelConfig
from dsv41.model import device as dev
from dsv41.model.model import Model, SeqInput
from dsv41.model.weights import TP_SHARDS, expected_tensors

BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
RELEASE_LAYERS = 40


DEVICE = "cuda"   # --device cpu: a smoke run of the script's logic at small sizes


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(gib: int = 4) -> float:
    a = torch.empty(gib << 30, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync()
    dt = (time.perf_counter() - t) / 10
    del a, b
    return 2 * (gib << 30) / dt


def matrix_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    a @ b
    sync()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    sync()
    return 2 * n ** 3 * 20 / (time.perf_counter() - t)


def layer_bytes(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(non-expert bytes of the layer in checkpoint form, bytes of one routed expert)."""
    inv = expected_tensors(cfg)
    p = f"layers.{layer}."
    other = expert = 0
    for name, spec in inv.items():
        if not name.startswith(p):
            continue
        nb = math.prod(spec.shape) * BYTES[spec.dtype]
        if ".ffn.experts." in name:
            if ".ffn.experts.0." in name:
                expert += nb
        else:
            other += nb
    return other, expert


def kv_bytes_per_row(t, ratio: int, context: int) -> float:
    """A decode row's KV reads at the quantised widths (FP8 window, FP4 compressed entries and indexer keys)."""
    b = t.sliding_window * t.head_dim * 1.0
    if ratio:
        entries = context // ratio
        b += min(t.index_topk, entries) * t.head_dim * 0.5 + entries * t.index_head_dim * 0.5
    return b


def flops_per_token(t, ratios: list[int], sources: set[int], prompt: int) -> float:
    """Prompt-pass FLOPs per token over the given layers (mean over the prompt's positions)."""
    H, D, heads = t.hidden_size, t.head_dim, t.num_attention_heads
    total = 0.0
    for i, r in enumerate(ratios):
        w = (t.q_lora_rank * H + heads * D * t.q_lora_rank + D * H + heads * D * t.o_lora_rank
             + H * t.o_groups * t.o_lora_rank + t.n_routed_experts * H
             + 3 * t.moe_intermediate_size * H * (t.num_experts_per_tok + 1)
             + 2 * (2 + t.hc_mult) * t.hc_mult * t.hc_mult * H)
        keys = t.sliding_window
        if r:
            keys += min(t.index_topk, prompt // (2 * r))
            w += t.index_n_heads * t.index_head_dim * t.q_lora_rank + t.index_n_heads * H
            if i in sources:
                w += (2 if r > 1 else 1) * D * H + t.index_head_dim * D / r
            total += 2 * t.index_n_heads * t.index_head_dim * prompt / (2 * r)   # indexer scores, mean visible
        total += 2 * w + 4 * heads * D * keys
    return total


def time_rounds(model, states, rounds: int) -> float:
    g = torch.Generator().manual_seed(len(states))
    for k in range(rounds + 2):
        if k == 2:
            sync()
            t = time.perf_counter()
        toks = torch.randint(3, min(1000, model.t.vocab_size), (len(states),), generator=g)
        model.forward([SeqInput(st, toks[i:i + 1], logits="none") for i, st in enumerate(states)])
    sync()
    return (time.perf_counter() - t) / rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompts", default="8192,32768")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip what would not finish in this time")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gpu.md"))
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--graphs", default="cuda", choices=("cuda", "emulate", "off"),
                    help="decode rounds' CUDA graphs (emulate: the CPU smoke run of their bookkeeping)")
    ap.add_argument("--tp-shards", type=int, default=TP_SHARDS,
                    help="shards one rank computes its products in (1: whole products, what the shards cost)")
    a = ap.parse_args(argv)
    global DEVICE
    DEVICE = a.device
    t_start = time.monotonic()
    left = lambda: a.budget_s - (time.monotonic() - t_start)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT, check=False).stdout.strip() or "?"
    if DEVICE == "cuda":
        dev.setup_cuda("cuda")
        gpu = torch.cuda.get_device_name()
        bw, rate = copy_bandwidth(), matrix_rate()
    else:
        gpu, bw, rate = "cpu (smoke run)", 1e10, matrix_rate(256)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matrix rate {rate / 1e12:.0f} TFLOP/s", flush=True)

    t0 = time.perf_counter()
    model = Model.load(a.checkpoint, device=DEVICE, keep_quant=True, cuda_graphs=a.graphs == "cuda",
                       tp_shards=a.tp_shards)
    if a.graphs == "emulate":
        from dsv41.model.graphs import PieceGraphs
        model.graphs = PieceGraphs("emulate")
    sync()
    load_s = time.perf_counter() - t0
    cfg, t = model.cfg, model.t
    K = t.num_hidden_layers
    ratios = list(t.compress_ratios[:K])
    kernels = list(model.ops.kernels)
    mem = torch.cuda.memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    print(f"loaded {K} layers in {load_s:.1f} s, {mem:.1f} GiB; kernels "
          f"{kernels or 'none (torch fallbacks)'}", flush=True)

    # experts touched per layer in a round: the router's picks, kept on the device (no sync) and counted after
    touched: list[list[torch.Tensor]] = [[] for _ in range(K)]
    for i, blk in enumerate(model.blocks):
        route = blk.moe.route

        def spy(x, image=None, route=route, i=i):
            w, ids = route(x, image)
            touched[i].append(ids)
            return w, ids
        blk.moe.route = spy
    per_layer = [layer_bytes(cfg, i) for i in range(K)]
    decode, prefill, ctx_s = [], [], float("nan")
    graph_held = 0   # bytes the captured graphs hold (CUDA), read by report()

    def report() -> list[str]:
        """Write the results so far (a later step may not finish in time)."""
        cmd = "python bench/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        lines = [
            "# GPU path: decode rounds and prompt passes (bench/gpu_bench.py)", "",
            f"- machine: {gpu}; commit {commit}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- command: `{cmd}`",
            (f"- checkpoint: `python -m dsv41.tools.make_real --layers {K}` (release shapes, random values; layers "
             f"{ratios} by compress ratio; no Engram / DSpark)"),
            f"- TP shards one rank computes in: {a.tp_shards} (`--tp-shards`)",
            f"- kernels: {', '.join(kernels) if kernels else 'none (torch fallbacks: dequantise per product, fp32)'}",
            (f"- ceilings measured in this run: copy bandwidth **{bw / 1e12:.2f} TB/s** (4 GiB device copy, read + "
             f"write), bf16 matrix rate **{rate / 1e12:.0f} TFLOP/s** (8192³ cuBLAS)"),
            f"- load {load_s:.1f} s; {a.context}-token context prefill {ctx_s:.2f} s", "",
            "## Decode round (per layer; extrapolated to 40 layers = 40 x mean layer + head, an extrapolation)", "",
            (f"CUDA graphs: {'on' if model.graphs is not None else 'off'} (dsv41/model/graphs.py; 'ms / layer' is "
             "with them when on, 'eager' the same rounds without them)"
             + (f"; {model.graphs.stats['captures']} captures hold {graph_held / 2**30:.2f} GiB (allocated after "
                "the decode rows less before: pool and static buffers)" if graph_held else "")), "",
            ("| rows | ms / layer | eager ms / layer | MB the layer must read | bound at copy bw (ms) | % of bound | "
             "head ms | 40-layer round ms (extrap.) | tok/s (extrap.) |"),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for R, ls, le, mb, bs, hs, ext in decode:
            lines.append(f"| {R} | {ls * 1e3:.2f} | {le * 1e3:.2f} | {mb / 1e6:.0f} | {bs * 1e3:.3f} | {bs / ls:.1%} | "
                         f"{hs * 1e3:.2f} | {ext * 1e3:.0f} | {R / ext:.1f} |")
        lines += ["", "## Prompt pass", "",
                  (f"| prompt tokens | s ({K} layers) | tok/s ({K} layers) | tok/s 40 layers (extrap.) | TFLOP/s | "
                   "% of bf16 rate |"), "|---|---|---|---|---|---|"]
        for P, tps, ach, frac, sec in prefill:
            lines.append(f"| {P} | {sec:.2f} | {tps:.0f} | {tps * K / RELEASE_LAYERS:.0f} | {ach / 1e12:.1f} | "
                         f"{frac:.1%} |")
        d1 = {R: bs / ls for R, ls, _, _, bs, _, _ in decode}
        p32 = {P: frac for P, _, _, frac, _ in prefill}
        lines += ["", "## Gap to the targets", "",
                  f"- decode, 1 row: {d1.get(1, float('nan')):.1%} of the bandwidth bound (target >= 70 %)",
                  f"- decode, 32 rows: {d1.get(32, float('nan')):.1%} (target >= 60 %)",
                  f"- prompt pass, 32K: {p32.get(32768, float('nan')):.1%} of the bf16 matrix rate (target >= 40 %)"]
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        return lines


    # one small forward first: the kernels compile outside every timing
    model.forward([SeqInput(model.new_state(), torch.arange(3, 40), logits="none")])
    sync()
    # decode rounds
    base = model.new_state()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, min(1000, model.t.vocab_size), (a.context,), generator=g)
    sync()
    t0 = time.perf_counter()
    for s in range(0, a.context, a.chunk):
        model.forward([SeqInput(base, prompt[s:s + a.chunk], logits="none")])
    sync()
    ctx_s = time.perf_counter() - t0
    print(f"context prefill {a.context} tokens: {ctx_s:.2f} s", flush=True)
    head_x = torch.randn(64, t.hidden_size, device=DEVICE)
    held0 = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    for R in [int(r) for r in a.rows.split(",")]:
        if left() < 20:
            print(f"rows {R}: skipped (time budget)", flush=True)
            continue
        # eager rounds first: they count the experts the rows touch (a graph replay runs no Python, so the
        # router spy sees only the capture), and give the time without graphs
        graphs, model.graphs = model.graphs, None
        states = [base.snapshot() for _ in range(R)]
        for s in touched:
            s.clear()
        sec_eager = time_rounds(model, states, a.rounds)
        model.graphs = graphs
        n_rounds = a.rounds + 2
        counted = [sum(ids.unique().numel() for ids in touched[i]) / n_rounds for i in range(K)]   # mean per round
        sec = sec_eager
        if graphs is not None:
            del states
            states = [base.snapshot() for _ in range(R)]
            sec = time_rounds(model, states, a.rounds)
        moved = 0.0
        for i in range(K):
            other, expert = per_layer[i]
            moved += other + counted[i] * expert + R * kv_bytes_per_row(t, ratios[i], a.context)
        xh = head_x[:R]
        model.ops.linear(xh, model.head)
        sync()
        th = time.perf_counter()
        for _ in range(5):
            model.ops.linear(xh, model.head)
        sync()
        head_s = (time.perf_counter() - th) / 5
        layer_s = sec / K
        bound_s = moved / K / bw
        ext = RELEASE_LAYERS * layer_s + head_s
        decode.append((R, layer_s, sec_eager / K, moved / K, bound_s, head_s, ext))
        print(f"rows {R}: {layer_s * 1e3:.2f} ms/layer ({sec_eager / K * 1e3:.2f} eager), {moved / K / 1e6:.0f} "
              f"MB/layer -> bound {bound_s * 1e3:.3f} ms ({bound_s / layer_s:.1%}); head {head_s * 1e3:.2f} ms; "
              f"40 layers ~ {ext * 1e3:.0f} ms/round ({R / ext:.1f} tok/s)", flush=True)
        del states

    if model.graphs is not None:
        if DEVICE == "cuda":   # what the memory plan does not count yet: the graphs' pool and static buffers
            graph_held = torch.cuda.memory_allocated() - held0
        print(f"graphs: {dict(model.graphs.stats)}; failed captures: {model.graphs.failed or 'none'}; memory they "
              f"hold {graph_held / 2**30:.2f} GiB", flush=True)
    report()
    # prompt passes
    sources = set(t.kv_source_layer_ids)
    last = None
    for P in [int(p) for p in a.prompts.split(",")]:
        if last is not None and left() < last[1] * (P / last[0]) * 1.3 + 10:
            print(f"prompt {P}: skipped (time budget)", flush=True)
            continue
        if last is None and left() < 30:
            print(f"prompt {P}: skipped (time budget)", flush=True)
            continue
        st = model.new_state()
        ids = torch.randint(3, min(1000, model.t.vocab_size), (P,), generator=g)
        sync()
        t0 = time.perf_counter()
        for s in range(0, P, a.chunk):
            model.forward([SeqInput(st, ids[s:s + a.chunk], logits="none")])
        sync()
        sec = time.perf_counter() - t0
        last = (P, sec)
        fl = flops_per_token(t, ratios, sources, P)
        achieved = fl * P / sec
        prefill.append((P, P / sec, achieved, achieved / rate, sec))
        print(f"prompt {P}: {sec:.2f} s, {P / sec:.0f} tok/s ({K} layers), {achieved / 1e12:.1f} TFLOP/s = "
              f"{achieved / rate:.1%} of the bf16 rate", flush=True)
        del st
        report()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    lines = report()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
