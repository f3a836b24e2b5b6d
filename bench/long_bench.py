"""Long prompts (docs/long.md): one prompt of up to `--tokens` filler-text tokens in prompt passes of `--chunk` rows,
then decode rounds after it, with peak device and host memory against the memory plan the server would print; and
four prompts at once against each alone (last-row logits compared with torch.equal).

The prompt pass runs through Model.forward directly (what the scheduler's rounds do, without HTTP). It stops at
`--budget-s` seconds (the length reached is reported, not the asked one) so it always finishes.

  python bench/long_bench.py --checkpoint DIR [--device cpu|cuda] [--tokens 1048576] [--chunk 2048]
                             [--budget-s 120] [--decode 16] [--four 4096] [--engram DIR | --no-engram]
                             [--out bench/results/long-cpu.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41 import BUILTIN_TOKENIZER_DIR
from dsv41.model.model import Model, SeqInput
from dsv41.sched.memory import memory_plan, state_cost

FILLER = ("The committee met again on Tuesday to go over the harvest figures, the state of the river road and the "
          "plans for the winter market. Each speaker kept to the agenda; the notes were read back and signed. ")
GIB = 1 << 30


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


NOTES: list[str] = []


def filler_ids(n: int, vocab: int, offset: int = 0) -> torch.Tensor:
    """FILLER's token ids repeated to n (ids folded into the vocabulary of a shrunk test checkpoint)."""
    try:
        from dsv41.chat.tokenizer import Tokenizer
        base = torch.tensor(Tokenizer.from_dir(BUILTIN_TOKENIZER_DIR).encode(FILLER, special=False), dtype=torch.long)
    except ImportError as e:       # a device image without `tokenizers`: a fixed id pattern stands in for the text
        if not NOTES:
            NOTES.append(f"filler: the tokenizer is unavailable ({e}); a fixed pattern of ids stood in for the text")
        base = (torch.arange(97) * 7919 + 1000) % 100_000
    reps = (n + offset) // base.numel() + 1
    return (base.repeat(reps)[offset:offset + n]) % vocab


def held_bytes(st) -> int:
    """Bytes of the storages behind the state's tensors (growth buffers' room included, unlike SeqState.nbytes)."""
    seen, total = set(), 0
    tensors = [st.engram_history]
    for d in (st.windows, st.compressed, st.index_keys, st.partial_kv, st.partial_gate):
        tensors += list(d.values())
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def host_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prefill(model: Model, ids: torch.Tensor, chunk: int, device: str, budget_s: float, report=None, mark=0):
    """Chunks of one prompt until done or out of time: (state, last logits row, tokens done, seconds, seconds to
    reach `mark` tokens or None) -- the rate up to `mark` sizes the four prompts, which are that long."""
    st = model.new_state()
    t0 = time.perf_counter()
    last = None
    a = 0
    t_mark = None
    while a < ids.numel():
        n = min(chunk, ids.numel() - a)
        last = model.forward([SeqInput(st, ids[a:a + n], "last")])[0]
        sync(device)
        a += n
        dt = time.perf_counter() - t0
        if t_mark is None and mark and a >= mark:
            t_mark = dt
        if report and (a // chunk) % report == 0:
            print(f"  {a:>9,} tokens  {dt:8.1f} s  {a / dt:9.1f} tok/s", flush=True)
        if dt > budget_s:
            break
    return st, last, a, time.perf_counter() - t0, t_mark


DECODE_WARM = 2   # decode rounds not timed: the first ones capture their CUDA graphs and compile decode shapes


def decode(model: Model, st, last: torch.Tensor, steps: int, device: str) -> tuple[float, int, float]:
    """Greedy decode rounds after the prompt: (tokens/s over the timed rounds, rounds not timed: the first
    DECODE_WARM, at least one round timed; the median round in ms). Each round reads its token on the host before
    the next is queued, so a round here is its device time plus its host time; the median is steadier than the
    mean against the host's hiccups (session 17: the mean rate after 2K swung 480-614 tok/s on one H200)."""
    warm = max(0, min(DECODE_WARM, steps - 1))
    t0 = time.perf_counter()
    each = []
    for k in range(steps):
        if k == warm:
            sync(device)
            t0 = time.perf_counter()
        t = time.perf_counter()
        nxt = last.reshape(-1).argmax().reshape(1).to(torch.long)
        last = model.forward([SeqInput(st, nxt.cpu(), "last")])[0]
        if k >= warm:
            each.append(time.perf_counter() - t)
    sync(device)
    med = statistics.median(each) * 1e3 if each else float("nan")
    return ((steps - warm) / (time.perf_counter() - t0) if steps else 0.0), warm, med


def four_at_once(model: Model, n: int, chunk: int, vocab: int, device: str) -> tuple[bool, float, float]:
    """Four prompts of n tokens in shared forwards (each chunk of each in one call) vs each alone: equal last rows?"""
    prompts = [filler_ids(n, vocab, offset=7 * i + 1) for i in range(4)]
    t0 = time.perf_counter()
    sts = [model.new_state() for _ in prompts]
    together = [None] * 4
    for a in range(0, n, chunk):
        outs = model.forward([SeqInput(s, p[a:a + chunk], "last") for s, p in zip(sts, prompts)])
        together = outs
    sync(device)
    t_together = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = []
    for p in prompts:
        st = model.new_state()
        for a in range(0, n, chunk):
            out = model.forward([SeqInput(st, p[a:a + chunk], "last")])[0]
        alone.append(out)
    sync(device)
    t_alone = time.perf_counter() - t0
    same = all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(together, alone))
    return same, t_together, t_alone


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=1_048_576)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop the long prompt pass after this many seconds")
    ap.add_argument("--decode", type=int, default=16, help="decode rounds after the long prompt")
    ap.add_argument("--four", type=int, default=4096, help="tokens of each of the four prompts (0 = skip)")
    ap.add_argument("--four-chunk", type=int, default=0, help="chunk of the four prompts (default --chunk)")
    ap.add_argument("--four-budget-s", type=float, default=0.0,
                    help="shorten the four prompts to fit this many seconds at the measured prefill rate (0 = never)")
    ap.add_argument("--engram", default=None, help="folder of the Engram tables (default: the checkpoint)")
    ap.add_argument("--no-engram", action="store_true", help="run without the Engram tables (degraded)")
    ap.add_argument("--report-every", type=int, default=16, help="print progress every N chunks")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "long-cpu.md"))
    a = ap.parse_args(argv)
    dev = a.device
    skipped = []
    t_load = time.perf_counter()
    try:
        model = Model.load(a.checkpoint, device=dev, engram=a.engram, engram_tables=not a.no_engram)
    except ValueError as e:
        print(f"long_bench: cannot load on {dev}: {e}", flush=True)
        return 2
    sync(dev)
    t_load = time.perf_counter() - t_load
    t = model.t
    vocab = t.vocab_size
    cuda = dev.startswith("cuda")
    weights_dev = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # the prompt and the decode rounds after it share the context: a full-context prompt leaves no room to decode
    tokens = min(a.tokens, t.max_position_embeddings - a.decode)
    if tokens < a.tokens:
        skipped.append(f"--tokens {a.tokens:,} and {a.decode} decode rounds exceed the model's "
                       f"max_position_embeddings {t.max_position_embeddings:,}: the prompt is {tokens:,} tokens")
    text_config = model.cfg.to_dict()["text_config"]
    cost = state_cost(text_config, elem_bytes=4)
    plan = memory_plan(text_config, cost, tokens, 1, a.chunk, 0)
    print("\n".join(plan.lines()), flush=True)
    print(f"long prompt: {tokens:,} filler tokens in chunks of {a.chunk} on {dev} (budget {a.budget_s:g} s)",
          flush=True)
    ids = filler_ids(tokens, vocab)
    host0 = host_peak()
    st, last, done, secs, t_mark = prefill(model, ids, a.chunk, dev, a.budget_s, report=a.report_every, mark=a.four)
    if done < tokens:
        skipped.append(f"the prompt pass stopped at {done:,} of {tokens:,} tokens after {secs:.0f} s (--budget-s)")
    prefill_tps = done / secs
    dec_tps, dec_warm, dec_med = decode(model, st, last, a.decode, dev)
    peak_dev = torch.cuda.max_memory_allocated() if cuda else 0
    state_bytes = held_bytes(st)
    host = host_peak()
    plan_done = memory_plan(text_config, cost, done + a.decode, 1, a.chunk, 0)
    four = None
    four_n = a.four
    if a.four and a.four_budget_s > 0:
        fc = a.four_chunk or a.chunk
        rate = a.four / t_mark if t_mark else prefill_tps       # the rate over the first --four tokens
        fits = int(rate * a.four_budget_s / 8) // fc * fc      # 4 prompts together, then 4 alone
        if max(fc, fits) < a.four:
            four_n = max(fc, fits)
            skipped.append(f"four prompts: {four_n:,} tokens each instead of {a.four:,} (--four-budget-s "
                           f"{a.four_budget_s:g} at {rate:,.0f} tok/s)")
    if a.four:
        del st
        four = four_at_once(model, four_n, a.four_chunk or a.chunk, vocab, dev)
    else:
        skipped.append("four prompts at once: --four 0")

    rows = [
        ("device", f"{dev}" + (f" ({torch.cuda.get_device_name()})" if cuda else "")),
        ("checkpoint", (f"{a.checkpoint}: {t.num_hidden_layers} layers, hidden {t.hidden_size}, vocab {vocab:,}, "
                        f"Engram {'off' if model.engram_store is None else 'on'}")),
        ("load", f"{t_load:.1f} s"),
        ("prompt tokens done / asked", f"{done:,} / {tokens:,}"),
        ("prefill", f"{prefill_tps:,.1f} tok/s ({secs:.1f} s, chunks of {a.chunk})"),
        (f"decode after it ({a.decode} rounds, 1 row; the first {dec_warm} not timed)",
         f"{dec_tps:,.2f} tok/s; median round {dec_med:.3f} ms"),
        ("state held (its tensors' storages)", f"{state_bytes / GIB:.3f} GiB"),
        ("plan: state lines for that length", f"{(plan_done.pool + plan_done.fixed) / GIB:.3f} GiB"),
        ("plan: + prompt-pass scratch", f"{(plan_done.pool + plan_done.fixed + plan_done.prompt_scratch) / GIB:.3f} GiB"),
    ]
    if cuda:
        rows += [("GPU weights (allocated after load)", f"{weights_dev / GIB:.2f} GiB"),
                 ("GPU peak above the weights", f"{(peak_dev - weights_dev) / GIB:.3f} GiB"),
                 ("GPU peak within plan (state + scratch)?",
                  str(peak_dev - weights_dev <= plan_done.pool + plan_done.fixed + plan_done.prompt_scratch))]
    rows += [("host peak RSS (before / after the prompt)", f"{host0 / GIB:.2f} / {host / GIB:.2f} GiB")]
    if four:
        rows += [(f"four prompts of {four_n:,} at once == each alone (torch.equal)", str(four[0])),
                 ("four: together / alone", f"{four[1]:.1f} s / {four[2]:.1f} s")]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = "?"
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, " \
              f"torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.1f}"
    md = [f"# Long prompts ({dev})", "",
          f"Command: `python bench/long_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
          f"Machine: {machine}; commit {commit}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
          "", "| what | figure |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    md += ["", "Memory plan the server prints for this prompt alone (`--window` = its length, 1 stream):", "", "```"]
    md += plan.lines() + ["```"]
    skipped += NOTES
    if skipped:
        md += ["", "Not measured / cut short:", ""] + [f"- {s}" for s in skipped]
    text = "\n".join(md) + "\n"
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
