"""Speculative decoding: a round's time by its rows, and the tokens per second a stream would get at draft acceptance
rates 0.3 / 0.5 / 0.7 against serial decoding (issue 10, docs/drafts.md).

    python bench/draft_bench.py                                  # built-in tiny checkpoint on the CPU
    python bench/draft_bench.py --model DIR --device cuda --streams 1,8,32 --out bench/results/drafts-h200.md

For B streams (each holding a --context-token prompt) and draft length n = 0..5, one round is the verify forward of
B x (1 + n) rows (`[pending, d1..dn]` per stream, every row's logits, exactly what the server's runner runs); each
timing marks the states and rolls them back after (SeqState.mark / rollback), so every repeat starts from the same
states. The DSpark draft pass (B blocks of block_size positions through the 3 stages + head) is timed too; a
checkpoint without DSpark stages (dsv41.tools.make_real) gets it estimated as 3 / n_layers of a backbone forward of
B x block_size rows (marked "est.").

Tokens per second at acceptance rate a (each draft token accepted with probability a given the ones before it):
a round of n drafts yields E(n) = 1 + a + ... + a^n tokens and takes T(B, n) + draft(B) seconds; the best n per
(B, a) is reported against serial decoding's 1 / T(B, 0). `--check` also verifies on the device that the verify
rows equal serial one-row decoding bit for bit (torch.equal) and that the rolled-back state decodes alike.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from dsv41.model.model import Model, SeqInput

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


def ratios(model) -> dict[int, int]:
    return {r.index: r.ratio for r in model.layout.layers if r.owns_compressor}


def verify_time(model, states, n: int, reps: int, device: str) -> float:
    """Best seconds of one verify forward of len(states) x (1 + n) rows (states rolled back after each)."""
    W, rs = model.t.sliding_window, ratios(model)
    best = float("inf")
    for k in range(reps + 1):
        inputs = []
        for i, st in enumerate(states):
            st.mark(1 + n, W)
            inputs.append(SeqInput(st, torch.tensor([(101 + 7 * i + j) % 30000 + 100 for j in range(1 + n)]),
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


def check_exact(model, device: str) -> str:
    """Verify rows == serial one-row decoding (torch.equal), and rollback leaves a state that decodes alike."""
    st = fill(model, 1, 40)[0]
    serial = st.snapshot()
    toks = [321, 4321, 99, 1234, 777, 4242]
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
                    help="also project the tokens/s table to a model of this many backbone layers (round time x "
                         "L / n_layers, the draft pass as measured or estimated: e.g. 43 for the release)")
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
        for B in streams:
            for n in range(a.max_draft + 1):
                T[B, n] = verify_time(model, states[:B], n, a.reps, a.device)
                print(f"B={B:3d} n={n} rows={B * (1 + n):4d} round {T[B, n] * 1e3:9.2f} ms", flush=True)
            D[B] = draft_time(model, states[:B], a.reps, a.device)
            print(f"B={B:3d} draft pass {D[B][0] * 1e3:9.2f} ms{' (est.)' if D[B][1] else ''}", flush=True)
        check = check_exact(model, a.device) if a.check else ""
    lines = ["# Speculative decoding: round time by rows, tokens/s per stream at acceptance 0.3 / 0.5 / 0.7", "",
             f"Command: `python bench/{Path(__file__).name} {' '.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"Machine: {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, torch "
             f"{torch.__version__}, device {a.device}"
             + (f" ({torch.cuda.get_device_name()})" if a.device.startswith("cuda") else "")
             + f", OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}",
             (f"Checkpoint: {ckpt} ({model.t.num_hidden_layers} layers, hidden {model.t.hidden_size}, vocab "
              f"{model.t.vocab_size}, DSpark {'yes' if model.dspark is not None else 'no (draft pass estimated)'}); "
              f"{a.context}-token prompt per stream; best of {a.reps}"), ""]
    if check:
        lines += [f"Exactness on {a.device}: {check}", ""]
    lines += ["## Round time by rows (verify forward of B x (1 + n) rows)", "",
              "| B | " + " | ".join(f"n={n}: ms (rows)" for n in range(a.max_draft + 1)) + " | draft pass ms |",
              "|---|" + "---|" * (a.max_draft + 2)]
    for B in streams:
        cells = [f"{T[B, n] * 1e3:.2f} ({B * (1 + n)})" for n in range(a.max_draft + 1)]
        lines.append(f"| {B} | " + " | ".join(cells) + f" | {D[B][0] * 1e3:.2f}{' est.' if D[B][1] else ''} |")
    def table(title: str, scale: float) -> None:
        nonlocal lines
        lines += ["", title, "", "| B | serial tok/s | " + " | ".join(f"a={r}: n, tok/s, x" for r in RATES) + " |",
                  "|---|---|" + "---|" * len(RATES)]
        for B in streams:
            serial = 1.0 / (T[B, 0] * scale)
            cells = []
            for r in RATES:
                def rate(n, r=r, B=B):
                    return sum(r ** i for i in range(n + 1)) / (T[B, n] * scale + D[B][0])
                best = max(range(1, a.max_draft + 1), key=rate)
                cells.append(f"{best}, {rate(best):.3g}, {rate(best) / serial:.2f}x")
            lines.append(f"| {B} | {serial:.3g} | " + " | ".join(cells) + " |")

    table("## Tokens per second per stream (best draft length n for each rate)", 1.0)
    if a.project_layers:
        K = len(model.layout.layers)
        table(f"## Projected to {a.project_layers} backbone layers (round time x {a.project_layers}/{K}, the draft "
              f"pass unchanged)", a.project_layers / K)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
