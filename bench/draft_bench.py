"""Speculative decoding: a round's time by its rows, and the tokens per second a stream would get at draft acceptance
rates 0.3 / 0.5 / 0.7 against serial decoding (issue 10, docs/drafts.md).

    python bench/draft_bench.py                                  # built-in tiny checkpoint on the CPU
    python bench/draft_bench.py --model DIR --device cuda --streams 1,8,32 --out bench/results/drafts-h200.md

For B streams (each holding a --context-token prompt) and draft length n = 0..5, one round is the verify forward of
B x (1 + n) rows (`[pending, d1..dn]` per stream, every row's logits, exactly what the server's runner runs); each
timing marks the states and rolls them back after (SeqState.mark / rollback), so every repeat starts from the same
states. The DSpark draft pass (B blocks of block_size positions through the 3 stages + head) is timed too when
the checkpoint has the stages (`dsv41.tools.make_real --dspark` writes them at release shape); only a checkpoint
without them gets it estimated, as 3 / n_layers of a backbone forward of B x block_size rows (marked "est." wherever
it is used). With the stages, every backbone forward also writes the stages' rings (main_proj of the taps + each
stage's wkv, per row): timed on its own ("ring fill") and kept out of the per-layer scaling of `--project-layers`.

Tokens per second at acceptance rate a (each draft token accepted with probability a given the ones before it):
a round of n drafts yields E(n) = 1 + a + ... + a^n tokens and takes T(B, n) + draft(B) seconds; the best n per
(B, a) is reported against serial decoding's 1 / T(B, 0). `--check` also verifies on the device that the verify
rows equal serial one-row decoding bit for bit (torch.equal) and that the rolled-back state decodes alike.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from dsv41.model.model import Model, SeqInput
from dsv41.sched.drafting import DraftPolicy, RoundCosts
from dsv41.serve_config import ServeConfig

RATES = (0.3, 0.5, 0.7)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fill(model, n_streams: int, context: int, chunk: int = 256) -> list:
    g = torch.Generator().manual_seed(0)
    states = []
    for _ in range(n_streams):
        st = model.new_state()
        ids = torch.randint(100, min(model.t.vocab_size, 50000), (context,), generator=g)
        ids[0] = 0
        for a in range(0, context, chunk):
            model.forward([SeqInput(st, ids[a:a + chunk], logits="none")])
        states.append(st)
    return states


def policy_rate(B: int, r: float, round_s, draft_s: float, max_draft: int, round_rows: int) -> tuple[float, float]:
    """(mean draft length, tokens/s per stream) of what DraftPolicy picks for B streams at acceptance r: round_s(n)
    the round of B x (1 + n) rows; a calibrated head (confidence logit(r) at every position, expected ==
    accepted), its acceptance history r, the pass costing draft_s."""
    costs = RoundCosts([B * (1 + n) for n in range(max_draft + 1)], [round_s(n) for n in range(max_draft + 1)])
    pol = DraftPolicy(costs, round_rows)
    pol.record_pass(draft_s, B)
    pol.verified, pol.accepted = 100_000, round(r * 100_000)
    pol.expected = pol.accepted
    if not pol.proposing(1, streams=B, base_rows=B, block=max_draft):
        return 0.0, 1.0 / round_s(0)
    c = math.log(r / (1 - r))
    lens = pol.lengths(B, B, {s: ([c] * max_draft, max_draft) for s in range(B)})
    tokens = sum(sum(r ** i for i in range(n + 1)) for n in lens.values())
    return sum(lens.values()) / B, tokens / B / (costs(B + sum(lens.values())) + draft_s)


def ratios(model) -> dict[int, int]:
    return {r.index: r.ratio for r in model.layout.layers if r.owns_compressor}


def verify_time(model, states, n: int, reps: int, device: str) -> float:
    """Best seconds of one verify forward of len(states) x (1 + n) rows (states rolled back after each)."""
    W, rs = model.t.sliding_window, ratios(model)
    span = min(model.t.vocab_size, 30100) - 100   # ids 100 .. (a shrunk vocabulary in tests)
    best = float("inf")
    for k in range(reps + 1):
        inputs = []
        for i, st in enumerate(states):
            st.mark(1 + n, W)
            inputs.append(SeqInput(st, torch.tensor([(101 + 7 * i + j) % span + 100 for j in range(1 + n)]),
                                   logits="all"))
        sync(device)
        t0 = time.perf_counter()
        model.forward(inputs)
        sync(device)
        dt = time.perf_counter() - t0
        for st in states:
            st.rollback(1 + n, rs)
        if k:                           # the first is a warm-up
            best = min(best, dt)
    return best


def draft_time(model, states, reps: int, device: str) -> tuple[float, bool]:
    """Seconds of the DSpark pass for len(states) streams; (estimate, True) without DSpark stages."""
    if model.dspark is not None:
        best = float("inf")
        for k in range(reps + 1):
            sync(device)
            t0 = time.perf_counter()
            model.dspark.draft([(st, 100 + i) for i, st in enumerate(states)])
            sync(device)
            if k:
                best = min(best, time.perf_counter() - t0)
        return best, False
    block = int(model.t.dspark_block_size or 5)
    stages = int(model.t.num_nextn_predict_layers or 3) or 3
    return verify_time(model, states, block - 1, reps, device) * stages / len(model.layout.layers), True


def ring_fill_time(model, rows: int, reps: int, device: str) -> float:
    """Best seconds of the DSpark ring fill a forward of `rows` rows does (main_x of the taps, then each stage's
    window KV: the pure part of DSpark.fill_rings, without the ring writes); 0 without DSpark stages."""
    ds = model.dspark
    if ds is None:
        return 0.0
    taps = len(model.t.dspark_target_layer_ids)
    h = torch.randn(rows, taps * model.t.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
    pos = torch.arange(64, 64 + rows, device=device)
    best = float("inf")
    for k in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        cos, sin = model.rope.cos_sin("main", pos)
        if model.graphs is not None:    # as the round runs it (a piece of the forward's graphs)
            model.graphs.run(("dspark_fill", 0), ds._stage_kvs, (h, cos, sin))
        else:
            ds._stage_kvs(h, cos, sin)
        sync(device)
        if k:
            best = min(best, time.perf_counter() - t0)
    return best


def check_exact(model, device: str) -> str:
    """Verify rows == serial one-row decoding (torch.equal), and rollback leaves a state that decodes alike."""
    st = fill(model, 1, 40)[0]
    serial = st.snapshot()
    toks = [x % model.t.vocab_size for x in (321, 4321, 99, 1234, 777, 4242)]
    spec = serial.snapshot()
    spec.mark(len(toks), model.t.sliding_window)
    rows = model.forward([SeqInput(spec, torch.tensor(toks), logits="all")])[0]
    ok = True
    for j, t in enumerate(toks):
        one = model.forward([SeqInput(serial, torch.tensor([t]), logits="last")])[0]
        ok &= torch.equal(one[-1].cpu(), rows[j].cpu())
    spec.rollback(3, ratios(model))                       # keep 3 of 6, then both decode one more token
    ref = fill(model, 1, 40)[0]
    model.forward([SeqInput(ref, torch.tensor(toks[:3]), logits="none")])
    a = model.forward([SeqInput(spec, torch.tensor([5]), logits="last")])[0]
    b = model.forward([SeqInput(ref, torch.tensor([5]), logits="last")])[0]
    ok2 = torch.equal(a.cpu(), b.cpu())
    return f"verify rows == serial decoding: {ok}; after rollback == fed the kept rows only: {ok2}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="checkpoint folder (default: the built-in tiny checkpoint)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", default="1,4,16", help="comma-separated stream counts B")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens each stream holds")
    ap.add_argument("--max-draft", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="also check verify == serial on the device (torch.equal)")
    ap.add_argument("--project-layers", type=int, default=0,
                    help="also project the tokens/s table to a model of this many backbone layers ((round time - "
                         "ring fill) x L / n_layers + ring fill, the draft pass as measured or estimated: e.g. 40 "
                         "for the release)")
    ap.add_argument("--round-rows", type=int, default=ServeConfig().round_rows,
                    help="the policy's row budget per round (the server's --round-rows)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.model:
        ckpt = Path(a.model)
    else:
        from dsv41.api.engine import builtin_checkpoint
        ckpt = builtin_checkpoint()
    t0 = time.monotonic()
    model = Model.load(str(ckpt), device=a.device)
    print(f"loaded {ckpt} on {a.device} in {time.monotonic() - t0:.1f} s", flush=True)
    streams = [int(x) for x in a.streams.split(",")]
    states = fill(model, max(streams), a.context)
    with torch.no_grad():
        T: dict[tuple[int, int], float] = {}
        D: dict[int, tuple[float, bool]] = {}
        F: dict[tuple[int, int], float] = {}
        for B in streams:
            for n in range(a.max_draft + 1):
                T[B, n] = verify_time(model, states[:B], n, a.reps, a.device)
                F[B, n] = min(ring_fill_time(model, B * (1 + n), a.reps, a.device), T[B, n])
                print(f"B={B:3d} n={n} rows={B * (1 + n):4d} round {T[B, n] * 1e3:9.2f} ms"
                      + (f" (ring fill {F[B, n] * 1e3:.2f})" if model.dspark is not None else ""), flush=True)
            D[B] = draft_time(model, states[:B], a.reps, a.device)
            print(f"B={B:3d} draft pass {D[B][0] * 1e3:9.2f} ms{' (est.)' if D[B][1] else ''}", flush=True)
        check = check_exact(model, a.device) if a.check else ""
    t = model.t
    if model.dspark is not None:
        dspark = (f"DSpark: {len(model.dspark.stages)} stages, draft pass measured ({t.dspark_n_routed_experts} "
                  f"routed experts, top {t.dspark_num_experts_per_tok}; taps {list(t.dspark_target_layer_ids)}, "
                  f"main_proj {len(t.dspark_target_layer_ids) * t.hidden_size} -> {t.hidden_size})")
    else:
        dspark = "DSpark: none in the checkpoint, draft pass ESTIMATED (est.)"
    lines = ["# Speculative decoding: round time by rows, tokens/s per stream at acceptance 0.3 / 0.5 / 0.7", "",
             f"Command: `python bench/{Path(__file__).name} {' '.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"Machine: {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, torch "
             f"{torch.__version__}, device {a.device}"
             + (f" ({torch.cuda.get_device_name()})" if a.device.startswith("cuda") else "")
             + f", OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}",
             (f"Checkpoint: {ckpt} ({t.num_hidden_layers} layers, hidden {t.hidden_size}, vocab "
              f"{t.vocab_size}, {t.n_routed_experts} routed experts); {a.context}-token prompt per stream; best of "
              f"{a.reps}"), "", dspark, ""]
    if check:
        lines += [f"Exactness on {a.device}: {check}", ""]
    lines += ["## Round time by rows (verify forward of B x (1 + n) rows)", ""]
    if model.dspark is not None:
        lines += ["(after the rows: the DSpark ring fill included in the round, ms)", ""]
    lines += ["| B | " + " | ".join(f"n={n}: ms (rows)" for n in range(a.max_draft + 1)) + " | draft pass ms |",
              "|---|" + "---|" * (a.max_draft + 2)]
    for B in streams:
        cells = [f"{T[B, n] * 1e3:.2f} ({B * (1 + n)}"
                 + (f"; {F[B, n] * 1e3:.2f})" if model.dspark is not None else ")") for n in range(a.max_draft + 1)]
        lines.append(f"| {B} | " + " | ".join(cells) + f" | {D[B][0] * 1e3:.2f}{' est.' if D[B][1] else ''} |")

    def table(title: str, scale: float) -> None:
        nonlocal lines
        lines += ["", title, "", "| B | serial tok/s | " + " | ".join(f"a={r}: n, tok/s, x" for r in RATES)
                  + " | " + " | ".join(f"a={r} policy: n, tok/s, x" for r in RATES) + " |",
                  "|---|---|" + "---|" * (2 * len(RATES))]

        def round_s(B, n):           # the layers scale, the ring fill does not
            return (T[B, n] - F[B, n]) * scale + F[B, n]
        for B in streams:
            serial = 1.0 / round_s(B, 0)
            cells = []
            for r in RATES:
                def rate(n, r=r, B=B):
                    return sum(r ** i for i in range(n + 1)) / (round_s(B, n) + D[B][0])
                best = max(range(1, a.max_draft + 1), key=rate)
                cells.append(f"{best}, {rate(best):.3g}, {rate(best) / serial:.2f}x"
                             + (" (est.)" if D[B][1] else ""))
            for r in RATES:
                n, tps = policy_rate(B, r, functools.partial(round_s, B), D[B][0], a.max_draft, a.round_rows)
                cells.append(f"{n:.2g}, {tps:.3g}, {tps / serial:.2f}x" + (" (est.)" if D[B][1] else ""))
            lines.append(f"| {B} | {serial:.3g} | " + " | ".join(cells) + " |")

    lines += ["", "Best n: the draft length (1..max) with the most tokens/s at that acceptance, an oracle's pick. Policy: "
              "what the server's DraftPolicy picks (dsv41/sched/drafting.py) from these round costs and the pass time "
              f"with a calibrated head at that acceptance (--round-rows {a.round_rows}): whether to propose at all "
              "(n 0: serial) and each stream's length (n: the mean), and the tokens/s that gives."]
    table("## Tokens per second per stream (best draft length n for each rate)", 1.0)
    if a.project_layers:
        K = len(model.layout.layers)
        table(f"## Projected to {a.project_layers} backbone layers ((round time - ring fill) x {a.project_layers}/{K}"
              f" + ring fill, the draft pass unchanged)", a.project_layers / K)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
