"""Where the host time of a decode round goes in the scheduler + runner (issue 25), on any device, in-process.

Runs B requests through a real Scheduler + ModelRunner on a checkpoint (default: the built-in tiny one, the real
129,280-token vocabulary) and times every decode round that carries B rows, split into:
- plan: Scheduler.plan_round (on the event loop);
- forward: Model.forward (on a GPU: the time to queue it, unless something in it waits);
- draw: the rest of ModelRunner.execute (logits to the host and sampling before issue 25, the batched device draw
  after; grammar masks, now filled during the forward; matcher consumes; bookkeeping);
- masks: of that, the grammar mask fills (ModelRunner.grammar_seconds; in parallel with the forward after issue 25);
- commit: Scheduler.commit_round (token events, stops, grammar and reasoning controls);
- gap: the engine thread idle between two rounds' execute calls (commit + plan + the event loop's own latency):
  time the model cannot run.
- GPU busy (on CUDA; issue 25's >= 95 %): the device's work a round (the union of its kernel and copy intervals,
  recorded with CUDA activity only while the middle rounds run, per round) over the median round of the unrecorded
  rounds (the recording slows the host side: the round's own share inside the recorded span is printed beside it).
  The share the device is not busy is host time the rounds do not hide, or gaps between the graph's kernels.
Cases: greedy, sampled (T 0.7, top-k 20, top-p 0.95: the server's defaults), sampled with every row under a
48-property JSON schema (bench/grammar_bench.py's), and sampled with top-k off (1024 candidates).

    OMP_NUM_THREADS=2 python bench/sched_round_bench.py [--checkpoint DIR] [--rows 1,8,32] [--rounds 12]
                                                        [--device cpu|cuda] [--no-overlap] [--tag after]
                                                        [--out bench/results/sched-round-cpu.md]
    DSV41_ROOT=/tmp/old python bench/sched_round_bench.py --tag before    # another tree's code (git archive)

Medians over the rounds that carried all B rows. The results file keeps one section per tag (a re-run with the same
tag replaces it), newest first. Figures on a shared 2-core host are noisy: the machine line says the load.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("DSV41_ROOT", Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from dsv41.sched.memory import MemoryBudget, state_cost  # noqa: E402
from dsv41.sched.request import Request  # noqa: E402
from dsv41.sched.runner import ModelRunner  # noqa: E402
from dsv41.sched.sampler import SamplingParams  # noqa: E402
from dsv41.sched.scheduler import Scheduler  # noqa: E402

CASES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.7, top_k=20, top_p=0.95),
    "sampled+json": dict(temperature=0.7, top_k=20, top_p=0.95),
    "top-k off": dict(temperature=1.0, top_k=0, top_p=1.0),
}


class Clock:
    """Per-round phase times, filled by wrappers around the scheduler's, runner's and model's methods; keyed by the
    round (overlapped, round N+1 is planned while N runs)."""

    def __init__(self):
        self.rounds: list[dict] = []
        self.by_round: dict[int, dict] = {}
        self.running: dict | None = None       # the record of the round the round thread runs
        self.exec_end: float | None = None
        self.full = 0                          # rounds begun that carried every row
        self.profile_at: tuple[int, int] | None = None   # (first, last) such round to record the device over
        self.prof = None


def instrument(sched: Scheduler, runner: ModelRunner, model, clock: Clock) -> None:
    plan, commit, execute, forward = sched.plan_round, sched.commit_round, runner.execute, model.forward

    def plan_round():
        t = time.perf_counter()
        p = plan()
        clock.by_round[p.round] = {"plan": time.perf_counter() - t, "rows": len(p.rows),
                                   "decode": sum(1 for r in p.rows if r.logits and len(r.ids) == 1)}
        return p

    def timed_execute(p, *a):
        t = time.perf_counter()
        rec = clock.running = clock.by_round.setdefault(p.round, {})
        if clock.exec_end is not None and p.rows:
            rec["gap"] = t - clock.exec_end
        g0 = runner.grammar_seconds
        rec["forward"] = 0.0
        if clock.profile_at is not None and p.rows and all(r.logits and len(r.ids) == 1 for r in p.rows):
            clock.full += 1
            rec["recorded"] = clock.profile_at[0] <= clock.full <= clock.profile_at[1]   # (the stop's sync too)
            if clock.full == clock.profile_at[0]:
                from torch.profiler import ProfilerActivity, profile
                clock.prof = profile(activities=[ProfilerActivity.CUDA])
                clock.prof.start()
            elif clock.full == clock.profile_at[1] and clock.prof is not None:
                torch.cuda.synchronize()
                clock.prof.stop()
        out = execute(p, *a)
        clock.exec_end = time.perf_counter()
        rec["execute"] = clock.exec_end - t
        rec["masks"] = runner.grammar_seconds - g0
        return out

    def timed_forward(inputs, **kw):
        t = time.perf_counter()
        out = forward(inputs, **kw)
        clock.running["forward"] += time.perf_counter() - t
        return out

    def commit_round(p, result):
        t = time.perf_counter()
        commit(p, result)
        rec = clock.by_round.pop(p.round, {})
        rec["commit"] = time.perf_counter() - t
        clock.rounds.append(rec)

    sched.plan_round, sched.commit_round, runner.execute, model.forward = (plan_round, commit_round, timed_execute,
                                                                             timed_forward)


def device_busy(prof) -> tuple[float, float]:
    """(µs some kernel or copy covers, the share of the span from the first recorded device interval to the last
    that they cover)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not spans:
        return float("nan"), float("nan")
    covered, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            covered += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    covered += cur_e - cur_s
    return covered, (covered / (spans[-1][1] - spans[0][0]) if len(spans) > 1 else 1.0)


def matchers(n: int):
    import tokenizers
    from grammar_bench import large_schema

    from dsv41 import BUILTIN_TOKENIZER_DIR
    from dsv41.grammar import compile_request
    hf = tokenizers.Tokenizer.from_file(str(BUILTIN_TOKENIZER_DIR / "tokenizer.json"))
    req = {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": large_schema(48),
                                                                      "strict": True}}}
    spec = compile_request(req, hf, None, False)
    return [spec.matcher() for _ in range(n)]


def run_case(model, cost, rows: int, rounds: int, case: str, extra: dict, ahead: bool = True,
             busy: bool = False, launch: bool = True) -> tuple[list[dict], tuple[float, float]]:
    params = dict(CASES[case])
    ms = matchers(rows) if case.endswith("+json") else [None] * rows

    async def go():
        runner = ModelRunner(model)
        runner.launch_ahead = launch
        if not ahead:
            runner.upcoming = None
        sched = Scheduler(runner, MemoryBudget(1 << 40, cost), max_streams=max(rows, 1), prefill_chunk=2048, **extra)
        clock = Clock()
        if busy:            # the middle rounds: past the first (graph captures) and before the last rows finish
            k0 = max(2, rounds // 3)
            clock.profile_at = (k0, k0 + max(4, rounds // 3))
        instrument(sched, runner, model, clock)
        sched.start()
        reqs = [Request([0] + [100 + (7 * i + j) % 5000 for j in range(24)], SamplingParams(seed=i, **params),
                        max_tokens=rounds + 2, ignore_eos=True, matcher=ms[i]) for i in range(rows)]
        for r in reqs:
            sched.submit(r)

        async def drain(r):
            async for _ in sched.stream(r):
                pass
        await asyncio.gather(*[drain(r) for r in reqs])
        await sched.stop()
        got = [c for c in clock.rounds if c.get("decode") == rows and c.get("rows") == rows]
        print(f"rows {rows}: {runner.rounds_ahead} rounds prepared ahead, {runner.rounds_launched} launched ahead",
              flush=True)
        if clock.prof is None:
            return got, (float("nan"), float("nan"))
        covered, share = device_busy(clock.prof)
        return got, (covered / 1e3 / (clock.profile_at[1] - clock.profile_at[0]), share)
    return asyncio.run(go())


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tag", default="after")
    ap.add_argument("--no-overlap", action="store_true", help="commit each round before planning the next")
    ap.add_argument("--no-ahead", action="store_true",
                    help="the runner is not told the queued plan: each round's table is built when it starts")
    ap.add_argument("--no-launch", action="store_true",
                    help="plain decode rounds are prepared ahead but not launched ahead (queued on the device with "
                         "their ids read from the round before's draws there; only without Engram layers)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "sched-round-cpu.md"))
    args = ap.parse_args()

    import json

    from dsv41.api.engine import builtin_checkpoint
    from dsv41.model.model import Model
    ckpt = Path(args.checkpoint) if args.checkpoint else builtin_checkpoint()
    model = Model.load(str(ckpt), device=args.device)
    cfg = json.loads((ckpt / "config.json").read_text())
    cost = state_cost(cfg.get("text_config", cfg))

    busy = args.device.startswith("cuda")
    lines = ["| case | rows | rounds | plan | forward | draw | (masks) | commit | gap | round | GPU work a round | "
             "GPU busy | (recorded span's share) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in args.cases.split(","):
        for rows in [int(x) for x in args.rows.split(",")]:
            got, (work, share) = run_case(model, cost, rows, args.rounds, case,
                                  {"overlap": False} if args.no_overlap else {}, ahead=not args.no_ahead,
                                  busy=busy, launch=not args.no_launch)
            got = [c for c in got if not c.get("recorded")]      # (on CUDA the recorded rounds ran slower)
            col = {k: med([c[k] for c in got if k in c]) for k in ("plan", "forward", "execute", "masks", "commit",
                                                                    "gap")}
            draw = med([c["execute"] - c["forward"] for c in got])
            whole = med([c["execute"] + c.get("gap", 0.0) for c in got])
            lines.append(f"| {case} | {rows} | {len(got)} | {col['plan']:.2f} | {col['forward']:.1f} | {draw:.2f} | "
                         f"{col['masks']:.2f} | {col['commit']:.2f} | {col['gap']:.2f} | {whole:.2f} | "
                         + (f"{work:.2f} | {work / whole:.1%} | {share:.1%} |" if work == work else "- | - | - |"))
            print(lines[-1], flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "? (not a git tree)"
    cmd = shlex.join(["python"] + sys.argv)
    head = (f"## {args.tag}\n\n`{cmd}` (code at {ROOT}, commit {commit}), {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
            f"UTC, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
            f"{os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}, checkpoint {ckpt.name}, "
            f"device {args.device}.\nMilliseconds, median over the decode rounds that carried every row; round = "
            f"execute + gap (one decode round as the engine thread sees it); on CUDA every column is of the rounds "
            f"not recorded; GPU work a round: the device's kernels and copies over the recorded middle rounds (CUDA "
            f"activity only); GPU busy: that over the round.\n\n")
    section = head + "\n".join(lines) + "\n"
    out = Path(args.out)
    title = "# Scheduler + runner host time per decode round (bench/sched_round_bench.py)\n\n"
    old = out.read_text() if out.exists() else title
    body = old[len(title):] if old.startswith(title) else old
    kept = [s for s in re.split(r"(?m)^(?=## )", body) if s.strip() and not s.startswith(f"## {args.tag}\n")]
    out.write_text(title + section + "\n" + "\n".join(s.rstrip() + "\n" for s in kept))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
