"""The two-GPU run of the TP2 server (issue 14): drives a running `scripts/serve.sh --tp 2` over HTTP and reads the
ranks' own round timings, then writes bench/results/tp2-h200x2.md. Subcommands (each writes one JSON part):

    python bench/tp2_bench.py limits   --out P.json                 # each GPU's copy bandwidth and bf16 matrix rate,
                                                                     # and the GPU0 -> GPU1 copy (the ring's link)
    python bench/tp2_bench.py preflight --out P.json                # the ring opened exactly as the server opens it
                                                                     # (rank 0 "cuda", rank 1 "cuda:1") + a Triton
                                                                     # launch on cuda:1 from rank 1's process
    python bench/tp2_bench.py vectors  --tp1 URL --tp2 URL --vectors DIR --out P.json
                                                                     # tiny-a: TP2 tokens == TP1 tokens (and the
                                                                     # oracle's), alone == burst bitwise
    python bench/tp2_bench.py serve    --url URL --stats DIR --checkpoint DIR --budget-s S --out P.json
                                                                     # decode 1/8/32 streams (concurrent == solo),
                                                                     # prompt 8K/32K/128K (as the budget allows)
    python bench/tp2_bench.py kill     --url URL --pid PID --log FILE --server-pid PID --out P.json
                                                                     # rank killed mid-stream -> the other stops
    python bench/tp2_bench.py report   --parts DIR --out bench/results/tp2-h200x2.md [--commit SHA]
    PYTHON="python3 bench/tp2_bench.py hook" DSV41_TP2_STATS=DIR scripts/serve.sh --tp 2 ...
                                                                     # the ranks with round / ring timers (below)

Why the running server and not the two ranks' model directly: the issue's figures are what a client of
`scripts/serve.sh --tp 2` gets (scheduler, plan send, digest check, sampling, HTTP included), and the exactness
checks (concurrent == solo, the kill) only mean something through the server. The one thing a client cannot see,
the ring's share of a round, comes from the ranks themselves: `hook` runs `python -m dsv41 ...` with timers wrapped
around the ring's collectives and the round's forward (class-level wrappers, no change to the served code path or its
results), and every rank writes cumulative per-round figures to DSV41_TP2_STATS/rank<R>.json after each forward.
Per collective: CPU seconds inside the call, and on CUDA the stream time between an event before and one after it
(the copies, the wait for the peer's ready event and the rank-order sum); each forward ends with a device sync so
its GPU events can be read (the runner needs the logits on the host at that point anyway).

Bounds (the two GPUs' limits measured in the same call): a decode round must read each rank's share of the layers'
weights (RankShare of the release tensors: replicated parts whole, split parts halved, the routed experts a rank holds
and a round touches, uniform routing expected) plus its head half, at the measured copy bandwidth; a prompt pass
needs 2 x the weights a token multiplies + attention / indexer scores (bench/gpu_bench.flops_per_token), at the
two GPUs' bf16 matrix rate. Extrapolated to the release's 40 layers as round x 40 / K (K = the checkpoint's layers;
the head and the per-round serving cost are scaled too, so this is on the high side), and said so in the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASE_LAYERS = 40
# NVLink multicast stays off in every process (the device docs: it can take the host's GPUs out of service)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)


# ============================================================================================== hook (inside a rank)

class RoundStats:
    """Cumulative per-bucket figures of one rank: rounds, rows, forward seconds, ring ops / bytes / seconds.
    Buckets: "decode/<n>" (every row of the round is one token; n sequences) and "prompt" (any longer row)."""

    FIELDS = ("rounds", "rows", "seqs", "wall_s", "ring_ops", "ring_bytes", "ring_cpu_s", "ring_gpu_s", "gpu_ops")

    def __init__(self, path: Path | None, rank: int):
        self.path, self.rank = path, rank
        self.buckets: dict[str, dict[str, float]] = {}
        self.device = None
        self.local = threading.local()   # per thread: the forward in progress (cur), its CUDA events, nesting depth
        self.lock = threading.Lock()

    def ring_op(self, nbytes: int, cpu_s: float, events, device) -> None:
        cur = getattr(self.local, "cur", None)
        with self.lock:
            if cur is None:                   # a collective outside a forward (e.g. image rows), or another thread
                cur = self._bucket("outside")
            cur["ring_ops"] += 1
            cur["ring_bytes"] += nbytes
            cur["ring_cpu_s"] += cpu_s
        if events is not None and getattr(self.local, "cur", None) is not None:
            self.local.events.append(events)
            self.device = device

    def _bucket(self, key: str) -> dict[str, float]:
        return self.buckets.setdefault(key, dict.fromkeys(self.FIELDS, 0.0))

    def begin(self) -> None:
        self.local.cur = dict.fromkeys(self.FIELDS, 0.0)
        self.local.events = []

    def abort(self) -> None:
        self.local.cur, self.local.events = None, []

    def end(self, lengths: list[int], wall_s: float) -> None:
        cur, events = self.local.cur, self.local.events
        self.abort()
        gpu = sum(e0.elapsed_time(e1) / 1e3 for e0, e1 in events)
        with self.lock:
            self._add(bucket_key(lengths), cur, lengths, wall_s, gpu, len(events))
            self.dump()

    def _add(self, key: str, cur: dict, lengths: list[int], wall_s: float, gpu: float, n_gpu: int) -> None:
        b = self._bucket(key)
        b["rounds"] += 1
        b["rows"] += sum(lengths)
        b["seqs"] += len(lengths)
        b["wall_s"] += wall_s
        for f in ("ring_ops", "ring_bytes", "ring_cpu_s"):
            b[f] += cur[f]
        b["ring_gpu_s"] += gpu
        b["gpu_ops"] += n_gpu

    def dump(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), "buckets": self.buckets}))
        os.replace(tmp, self.path)


def bucket_key(lengths: list[int]) -> str:
    if lengths and all(n == 1 for n in lengths):
        return f"decode/{len(lengths)}"
    return "prompt"


def install_hook(stats: RoundStats):
    """Wrap the ring transports' collectives and DigestingModel.forward with timers (class level: every ring and
    model the rank makes). Nested collectives (Ring.all_reduce_sum calling all_gather) count once. Returns a
    function that puts the originals back."""
    import torch

    import dsv41.comm.ring as ring_mod
    import dsv41.sched.tp as tp_mod

    def timed(op):
        def wrapped(self, t, *a, **k):
            if getattr(stats.local, "depth", 0):
                return op(self, t, *a, **k)
            stats.local.depth = 1
            ev = None
            if t.is_cuda:
                s = torch.cuda.current_stream(t.device)
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record(s)
            c0 = time.perf_counter()
            try:
                out = op(self, t, *a, **k)
            finally:
                stats.local.depth = 0
            c1 = time.perf_counter()
            if ev is not None:
                ev[1].record(torch.cuda.current_stream(t.device))
            stats.ring_op(t.numel() * t.element_size(), c1 - c0, ev, t.device if t.is_cuda else None)
            return out
        wrapped.__wrapped__ = op
        return wrapped

    saved = []
    for cls in (ring_mod.ShmRing, ring_mod.CudaIpcRing, ring_mod.DistRing, tp_mod.DigestingModel):
        for name in ("all_reduce_sum", "all_gather", "broadcast", "forward"):
            if hasattr(cls, name):
                saved.append((cls, name, cls.__dict__.get(name)))
    for cls in (ring_mod.ShmRing, ring_mod.CudaIpcRing, ring_mod.DistRing):
        for name in ("all_reduce_sum", "all_gather", "broadcast"):
            setattr(cls, name, timed(getattr(cls, name)))

    fwd = tp_mod.DigestingModel.forward

    def forward(self, inputs):
        stats.begin()
        c0 = time.perf_counter()
        try:
            out = fwd(self, inputs)
            if stats.device is not None:
                torch.cuda.synchronize(stats.device)
        except BaseException:
            stats.abort()
            raise
        stats.end([int(i.ids.numel()) for i in inputs], time.perf_counter() - c0)
        return out
    tp_mod.DigestingModel.forward = forward

    def undo():
        for cls, name, orig in saved:
            if orig is None:
                delattr(cls, name)
            else:
                setattr(cls, name, orig)
    return undo


def cmd_hook(argv: list[str]) -> int:
    """`hook -m dsv41 serve ...`: the server with timers; anything else (scripts/setup.sh's `-c ...`, pip) runs as
    plain python, so PYTHON="python3 bench/tp2_bench.py hook" works for scripts/serve.sh as a whole."""
    if argv[:2] != ["-m", "dsv41"]:
        os.execv(sys.executable, [sys.executable, *argv])
    sys.path.insert(0, str(ROOT))
    d = os.environ.get("DSV41_TP2_STATS")
    if d:
        rank = 0
        for i, a in enumerate(argv):
            if a == "--rank" and i + 1 < len(argv):
                rank = int(argv[i + 1])
            elif a.startswith("--rank="):
                rank = int(a.split("=", 1)[1])
        Path(d).mkdir(parents=True, exist_ok=True)
        install_hook(RoundStats(Path(d) / f"rank{rank}.json", rank))
    from dsv41.__main__ import main
    return main(argv[2:])


def read_stats(d: Path) -> dict[int, dict]:
    out = {}
    for p in sorted(Path(d).glob("rank*.json")):
        try:
            j = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        out[int(j["rank"])] = j["buckets"]
    return out


def diff_stats(after: dict[int, dict], before: dict[int, dict]) -> dict[int, dict]:
    """Per rank, per bucket: after - before (buckets with no new rounds dropped)."""
    out: dict[int, dict] = {}
    for r, buckets in after.items():
        prev = before.get(r, {})
        for key, b in buckets.items():
            p = prev.get(key, {})
            d = {f: b.get(f, 0.0) - p.get(f, 0.0) for f in RoundStats.FIELDS}
            if d["rounds"] > 0 or (key == "outside" and d["ring_ops"] > 0):
                out.setdefault(r, {})[key] = d
    return out


def ring_rows(delta: dict[int, dict], section: str = "") -> list[dict]:
    """One row per (rank, bucket): means per round and the ring's share of the forward (GPU share: None without
    CUDA events)."""
    rows = []
    for r in sorted(delta):
        buckets = dict(delta[r])
        if len([k for k in buckets if k != "outside"]) > 1:   # the section as a whole, too
            buckets["all"] = {f: sum(b.get(f, 0.0) for k, b in delta[r].items() if k != "outside")
                              for f in RoundStats.FIELDS}
        for key in sorted(buckets, key=_bucket_order):
            b = buckets[key]
            n = b["rounds"]
            if n <= 0:
                continue
            gpu = b.get("gpu_ops", 0) > 0 and b["wall_s"] > 0
            rows.append({"section": section, "rank": r, "bucket": key, "rounds": int(n), "rows_per_round": b["rows"] / n,
                         "round_ms": b["wall_s"] / n * 1e3, "ring_ops": b["ring_ops"] / n,
                         "ring_kb": b["ring_bytes"] / n / 1e3, "ring_cpu_ms": b["ring_cpu_s"] / n * 1e3,
                         "ring_gpu_ms": b["ring_gpu_s"] / n * 1e3 if gpu else None,
                         "cpu_share": b["ring_cpu_s"] / b["wall_s"] if b["wall_s"] > 0 else None,
                         "gpu_share": b["ring_gpu_s"] / b["wall_s"] if gpu else None})
    return rows


def _bucket_order(key: str):
    if key.startswith("decode/"):
        return (0, int(key.split("/")[1]))
    return {"prompt": (1, 0), "all": (2, 0)}.get(key, (3, 0))


# ================================================================================================ HTTP client

def _http():
    import httpx
    return httpx


def stream_completion(url: str, prompt: list[int], max_tokens: int, *, seed: int | None = None,
                      timeout: float = 900.0, on_token=None, deadline: float | None = None) -> dict:
    """A streamed /v1/completions request: token ids, logprobs, chunk times; an error event ends it. `deadline`
    (perf_counter): give up then, closing the stream (the server's keep-alives, every --keepalive-s, let a long
    prompt pass be abandoned in time; the server drops a request whose client went away)."""
    httpx = _http()
    body = {"model": "dsv41", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "logprobs": 0, "return_token_ids": True, "stream_options": {"include_usage": True}}
    body.update({"temperature": 0.0} if seed is None else {"temperature": 0.9, "top_p": 0.95, "seed": seed})
    res = {"ids": None, "lps": [], "times": [], "t0": time.perf_counter(), "error": None, "status": None}
    try:
        _stream_into(res, httpx, url, body, timeout, on_token, deadline)
    except httpx.HTTPError as e:             # a timeout or a dropped connection: the result says so
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def _stream_into(res: dict, httpx, url: str, body: dict, timeout: float, on_token, deadline) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        res["status"] = r.status_code
        if r.status_code != 200:
            r.read()
            res["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
            return
        for line in r.iter_lines():
            if deadline is not None and time.perf_counter() > deadline:
                res["error"] = "abandoned: past the bench's deadline"
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                res["error"] = ev["error"].get("message", str(ev["error"]))
                break
            for ch in ev.get("choices") or []:
                lp = ch.get("logprobs")
                if lp and lp.get("token_logprobs"):
                    now = time.perf_counter()
                    res["lps"] += lp["token_logprobs"]
                    res["times"] += [now] * len(lp["token_logprobs"])
                    if on_token is not None:
                        on_token(len(res["lps"]))
                if ch.get("token_ids") is not None:
                    res["ids"] = list(ch["token_ids"])


def burst(url: str, prompts: list[list[int]], max_tokens: int, seeds=None) -> tuple[list[dict], float]:
    """All prompts at once (released together); returns the results and the wall time."""
    seeds = seeds or [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def one(k):
        gate.wait()
        return stream_completion(url, prompts[k], max_tokens, seed=seeds[k])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as ex:
        out = list(ex.map(one, range(len(prompts))))
    return out, time.perf_counter() - t0


def aggregate_rate(results: list[dict]) -> float:
    """Decode tokens/s of a burst: tokens after each stream's first / (last token anywhere - first token anywhere).
    The prompts are short and share one prompt round, so every stream's first token comes from the same round."""
    firsts = [r["times"][0] for r in results if r["times"]]
    lasts = [r["times"][-1] for r in results if r["times"]]
    n = sum(max(0, len(r["times"]) - 1) for r in results)
    span = max(lasts) - min(firsts) if firsts else 0.0
    return n / span if span > 0 else float("nan")


def stream_rate(r: dict) -> float:
    t = r["times"]
    return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else float("nan")


def same(a: dict, b: dict) -> bool:
    return a["ids"] == b["ids"] and a["lps"] == b["lps"] and a["error"] is None and b["error"] is None


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    lo, hi = (1000, min(vocab, 100000)) if vocab > 2000 else (3, vocab)
    return [[random.Random(seed * 1000 + k).randrange(lo, hi) for _ in range(length)] for k in range(n)]


def est_round(round_s: dict[int, float], n: int) -> float:
    """A round of n streams, from the nearest measured row count at or above n scaled linearly (0: nothing known)."""
    if not round_s:
        return 0.0
    m = min((k for k in round_s if k >= n), default=max(round_s))
    return round_s[m] * n / m


def process_alive(pid: int) -> bool:
    """True while pid runs (a zombie, which a non-parent cannot reap, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def predict_prompt_s(measured: list[tuple[int, float]], length: int) -> float:
    """Seconds a prompt of `length` tokens should take from the longest measured one: the per-token cost grows
    with the context (indexer scores over every earlier entry), so scale by (L / L0)^1.5 (between linear and
    quadratic; the budget check errs long)."""
    if not measured:
        return float("nan")
    l0, s0 = max(measured)
    return s0 * (length / l0) ** 1.5


def wait_health(url: str, timeout: float) -> None:
    httpx = _http()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout:.0f} s")


def write_json(path: str, obj: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, default=str))
    print(f"wrote {p}", flush=True)


# ================================================================================================ sections

def cmd_serve(a) -> int:
    """Decode at 1/8/32 streams with concurrent == solo, prompt passes, ring share per bucket. Writes the part after
    every section, so a budget cut still leaves what ran."""
    t_start = time.monotonic()
    left = lambda: a.budget_s - (time.monotonic() - t_start)
    wait_health(a.url, 60)
    vocab = a.vocab or _vocab(a.checkpoint)
    part: dict = {"url": a.url, "checkpoint": a.checkpoint, "layers": _layers(a.checkpoint), "vocab": vocab,
                  "tokens": a.tokens, "prompt_len": a.prompt_len, "decode": [], "exact": [], "prompt": [],
                  "skipped": [], "notes": []}
    stats_dir = Path(a.stats) if a.stats else None

    def snap():
        return read_stats(stats_dir) if stats_dir else {}

    def save():
        part["elapsed_s"] = time.monotonic() - t_start
        write_json(a.out, part)

    streams = sorted({int(s) for s in a.streams.split(",")})
    n_max = max(streams)
    prompts = random_prompts(n_max, a.prompt_len, vocab, a.seed)
    # warm-up: kernels compile outside the timed sections (a short burst of every row count we will run)
    t0 = time.perf_counter()
    for n in streams:
        burst(a.url, prompts[:n], 2)
    part["warmup_s"] = time.perf_counter() - t0
    print(f"warm-up {part['warmup_s']:.1f} s", flush=True)
    solo: dict[int, dict] = {}
    round_s: dict[int, float] = {}
    for n in sorted(streams, reverse=True):
        if n == 1:
            continue
        need = (a.tokens + 1) * est_round(round_s, n) + 5
        if left() < need + a.reserve_s:
            part["skipped"].append(f"decode at {n} streams: {left():.0f} s left, ~{need:.0f} s needed")
            continue
        before = snap()
        res, wall = burst(a.url, prompts[:n], a.tokens)
        delta = diff_stats(snap(), before)
        errs = [r["error"] for r in res if r["error"]]
        rate = aggregate_rate(res)
        dec = delta.get(0, {}).get(f"decode/{n}")
        round_s[n] = dec["wall_s"] / dec["rounds"] if dec and dec["rounds"] else (wall / (a.tokens + 1))
        part["decode"].append({"streams": n, "tok_s": rate, "wall_s": wall, "errors": errs,
                               "round_ms": round_s[n] * 1e3, "ring": ring_rows(delta, f"decode {n}"),
                               "per_stream_tok_s": statistics.median(stream_rate(r) for r in res)})
        part.setdefault("_concurrent", {})[n] = res
        print(f"decode {n} streams: {rate:.2f} tok/s, round {round_s[n] * 1e3:.0f} ms, errors {len(errs)}",
              flush=True)
        save()
    # solo: each prompt alone (the 1-stream figure and the reference of every burst)
    per1 = round_s.get(min(round_s), 1.0) if round_s else 1.0
    before = snap()
    t_solo = time.perf_counter()
    for k in range(n_max):
        if left() < (a.tokens + 1) * per1 * 1.5 + a.reserve_s and k >= 1:
            part["skipped"].append(f"solo runs {k}..{n_max - 1}: time budget ({left():.0f} s left)")
            break
        solo[k] = stream_completion(a.url, prompts[k], a.tokens)
        if solo[k]["times"]:
            per1 = (solo[k]["times"][-1] - solo[k]["t0"]) / (a.tokens + 1)
    delta = diff_stats(snap(), before)
    if solo:
        rates = [stream_rate(r) for r in solo.values()]
        dec = delta.get(0, {}).get("decode/1")
        part["decode"].append({"streams": 1, "tok_s": statistics.median(rates), "wall_s": time.perf_counter() - t_solo,
                               "errors": [r["error"] for r in solo.values() if r["error"]],
                               "round_ms": dec["wall_s"] / dec["rounds"] * 1e3 if dec and dec["rounds"] else None,
                               "ring": ring_rows(delta, "decode 1 (solo)"),
                               "per_stream_tok_s": statistics.median(rates),
                               "solo_runs": len(solo)})
        print(f"decode 1 stream: {statistics.median(rates):.2f} tok/s over {len(solo)} solo runs", flush=True)
    for n, res in sorted(part.pop("_concurrent", {}).items()):
        compared = [k for k in range(n) if k in solo]
        bad = [k for k in compared if not same(solo[k], res[k])]
        part["exact"].append({"streams": n, "compared": len(compared), "equal": len(compared) - len(bad),
                              "first_bad": ({"k": bad[0], "solo": solo[bad[0]]["ids"], "burst": res[bad[0]]["ids"]}
                                            if bad else None)})
        print(f"concurrent {n} == solo: {len(compared) - len(bad)} / {len(compared)} equal (ids and logprobs)",
              flush=True)
    save()
    # prompt passes: one request each, 1 token out; tok/s = L / time to the reply
    measured: list[tuple[int, float]] = []
    for L in [int(x) for x in a.prompts.split(",") if x]:
        pred = predict_prompt_s(measured, L)
        if measured and left() < pred + a.reserve_s:
            part["skipped"].append(f"prompt {L}: predicted {pred:.0f} s from the {max(measured)[0]}-token pass, "
                                   f"{left():.0f} s left")
            continue
        if not measured and left() < a.reserve_s + 20:
            part["skipped"].append(f"prompt {L}: {left():.0f} s left")
            continue
        ids = random_prompts(1, L, vocab, a.seed + L)[0]
        before = snap()
        t0 = time.perf_counter()
        r = stream_completion(a.url, ids, 1, deadline=time.perf_counter() + max(30.0, left() - a.reserve_s))
        sec = time.perf_counter() - t0
        delta = diff_stats(snap(), before)
        part["prompt"].append({"tokens": L, "s": sec, "tok_s": L / sec, "error": r["error"],
                               "ring": ring_rows(delta, f"prompt {L}")})
        print(f"prompt {L}: {sec:.1f} s, {L / sec:.0f} tok/s, error {r['error']}", flush=True)
        save()
        if r["error"]:                        # a timed-out pass says nothing about the next, longer one
            break
        measured.append((L, sec))
    save()
    return 0


def cmd_kill(a) -> int:
    """Stream a long reply; SIGKILL `--pid` (a rank) after 3 tokens; the stream must end with an error naming that
    rank, the server (`--server-pid`, serve.sh or rank 0) must exit 1 and its log name the lost rank."""
    wait_health(a.url, 30)
    vocab = a.vocab or _vocab(a.checkpoint)
    killed: list[float] = []

    def on_token(n):
        if n == 3 and not killed:
            os.kill(a.pid, signal.SIGKILL)
            killed.append(time.monotonic())
    r = stream_completion(a.url, random_prompts(1, 16, vocab, 7)[0], a.max_tokens, on_token=on_token,
                          timeout=120)
    part = {"killed_rank": a.rank, "tokens_before_error": len(r["lps"]), "stream_error": r["error"]}
    if a.server_pid:                        # the caller's child: it waits for the status; we see it end
        deadline = time.monotonic() + a.wait_s
        while time.monotonic() < deadline and process_alive(a.server_pid):
            time.sleep(0.1)
        part["server_exited"] = not process_alive(a.server_pid)
        part["exit_after_kill_s"] = time.monotonic() - killed[0] if killed and part["server_exited"] else None
    log = Path(a.log).read_text(errors="replace") if a.log and Path(a.log).is_file() else ""
    want = f"rank {a.rank} lost" if a.rank else "rank 0 lost"
    part["log_line"] = next((ln for ln in log.splitlines() if "lane failed" in ln or "stopping after" in ln), None)
    part["ok"] = bool(killed and r["error"] and f"rank {a.rank}" in r["error"]
                      and part["log_line"] and want in part["log_line"] and part.get("server_exited", True))
    print(json.dumps(part, indent=1), flush=True)
    write_json(a.out, part)
    return 0 if part["ok"] else 1


def cmd_vectors(a) -> int:
    """tiny-a's vector prompts, greedy, 16 tokens: TP2 == TP1 token ids; TP2 alone == TP2 in a burst (ids and
    logprobs bitwise); how many of the oracle's greedy tokens each matches (the oracle ran float32 on a CPU)."""
    from safetensors import safe_open
    wait_health(a.tp1, 120)
    wait_health(a.tp2, 120)
    vec = Path(a.vectors)
    prompts, oracle = [], []
    with safe_open(str(vec / "vectors.safetensors"), "pt") as f:
        k, keys = 0, set(f.keys())
        while f"prompt.{k}.input_ids" in keys:
            prompts.append(f.get_tensor(f"prompt.{k}.input_ids").tolist())
            oracle.append(f.get_tensor(f"prompt.{k}.decode_ids").tolist())
            k += 1
    n = len(oracle[0]) if oracle else a.tokens
    one = [stream_completion(a.tp1, p, n) for p in prompts]
    two = [stream_completion(a.tp2, p, n) for p in prompts]
    both, _ = burst(a.tp2, prompts * a.copies, n)
    rows = []
    for k, p in enumerate(prompts):
        o = oracle[k]
        rows.append({"prompt": k, "len": len(p), "tp1": one[k]["ids"], "tp2": two[k]["ids"],
                     "tp2_eq_tp1": one[k]["ids"] == two[k]["ids"] and one[k]["error"] is None,
                     "burst_eq_alone": all(same(two[k], both[k + j * len(prompts)]) for j in range(a.copies)),
                     "tp1_oracle_match": _prefix(one[k]["ids"], o), "tp2_oracle_match": _prefix(two[k]["ids"], o),
                     "max_lp_diff": max((abs(x - y) for x, y in zip(one[k]["lps"], two[k]["lps"])), default=None),
                     "errors": [r["error"] for r in (one[k], two[k]) if r["error"]]})
    part = {"prompts": len(prompts), "tokens": n, "burst": len(prompts) * a.copies, "rows": rows,
            "ok": all(r["tp2_eq_tp1"] and r["burst_eq_alone"] for r in rows) and bool(rows)}
    for r in rows:
        print(f"prompt {r['prompt']} ({r['len']} ids): tp2==tp1 {r['tp2_eq_tp1']}, burst==alone "
              f"{r['burst_eq_alone']}, oracle prefix tp1 {r['tp1_oracle_match']}/{n} tp2 {r['tp2_oracle_match']}/{n}, "
              f"max |dlogprob| {r['max_lp_diff']}", flush=True)
    write_json(a.out, part)
    return 0 if part["ok"] else 1


def _prefix(a: list[int] | None, b: list[int]) -> int:
    n = 0
    for x, y in zip(a or [], b):
        if x != y:
            break
        n += 1
    return n


def _cfg_text(ckpt: str | None) -> dict:
    if not ckpt:
        return {}
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    return raw.get("text_config", raw)


def _vocab(ckpt: str | None) -> int:
    return int(_cfg_text(ckpt).get("vocab_size", 129280))


def _layers(ckpt: str | None) -> int | None:
    t = _cfg_text(ckpt)
    return int(t["num_hidden_layers"]) if "num_hidden_layers" in t else None


# ================================================================================================ device-side checks

def cmd_limits(a) -> int:
    """Per GPU: device copy bandwidth (read + write) and bf16 matrix rate; GPU0 -> GPU1 copy bandwidth; peer access."""
    import torch
    part: dict = {"gpus": [], "peer": None}
    n = torch.cuda.device_count()
    for i in range(n):
        with torch.cuda.device(i):
            a_ = torch.empty(a.gib << 30, dtype=torch.uint8, device=f"cuda:{i}")
            b_ = torch.empty_like(a_)
            b_.copy_(a_)
            torch.cuda.synchronize(i)
            t = time.perf_counter()
            for _ in range(10):
                b_.copy_(a_)
            torch.cuda.synchronize(i)
            bw = 2 * (a.gib << 30) * 10 / (time.perf_counter() - t)
            del a_, b_
            m = 8192
            x = torch.randn(m, m, device=f"cuda:{i}", dtype=torch.bfloat16)
            y = torch.randn(m, m, device=f"cuda:{i}", dtype=torch.bfloat16)
            x @ y
            torch.cuda.synchronize(i)
            t = time.perf_counter()
            for _ in range(20):
                x @ y
            torch.cuda.synchronize(i)
            rate = 2 * m ** 3 * 20 / (time.perf_counter() - t)
            del x, y
            torch.cuda.empty_cache()
        part["gpus"].append({"index": i, "name": torch.cuda.get_device_name(i), "copy_bw": bw, "bf16_rate": rate})
        print(f"cuda:{i}: copy {bw / 1e12:.2f} TB/s, bf16 {rate / 1e12:.0f} TFLOP/s", flush=True)
    if n >= 2:
        part["peer"] = {"0->1": torch.cuda.can_device_access_peer(0, 1), "1->0": torch.cuda.can_device_access_peer(1, 0)}
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:1")
        dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        part["p2p_bw"] = (1 << 30) * 10 / (time.perf_counter() - t)
        print(f"cuda:0 -> cuda:1 copy {part['p2p_bw'] / 1e9:.0f} GB/s; peer access {part['peer']}", flush=True)
    write_json(a.out, part)
    return 0


def _preflight_rank(rank: int, session: str, want: str, q) -> None:
    """One rank, opened as the server opens it: rank 0 with pick_device("cuda") ("cuda", no index), rank 1 with
    follower_device("cuda", 1, same_host=True) and no torch.cuda.set_device. (want "cpu": the same steps on the shm
    ring, a CPU check of this function.)"""
    os.environ.update(MULTICAST_OFF)
    out = {"rank": rank}
    try:
        import torch
        sys.path.insert(0, str(ROOT))
        from dsv41.api.engine import pick_device
        from dsv41.comm.ring import open_ring
        from dsv41.sched.follower import follower_device
        dev = pick_device(want) if rank == 0 else follower_device(want, rank, True)
        out["device"] = dev
        if want == "cuda":
            out["current_device"] = torch.cuda.current_device()
            # a Triton kernel on this rank's device, launched as kernels/ launch theirs (no device guard)
            out["triton"] = _triton_probe(torch, torch.device(dev))
        else:
            out["triton"] = "ok (not run on cpu)"
        ring = open_ring(rank, 2, dev, master="127.0.0.1:1", session=session, same_host=True, timeout=60)
        out["ring"] = ring.kind
        t = torch.full((4, 5120), float(rank + 1), device=dev)
        s = ring.all_reduce_sum(t)
        out["all_reduce_ok"] = bool((s == 3.0).all().item())
        g = ring.all_gather(torch.arange(8, dtype=torch.float32, device=dev) + 10 * rank)
        out["all_gather_ok"] = bool(torch.equal(g.cpu(), torch.stack([torch.arange(8.0), torch.arange(8.0) + 10])))
        ring.close()
    except BaseException as e:  # noqa: BLE001 - the report says what failed
        out["error"] = f"{type(e).__name__}: {e}"
    q.put(out)


def _triton_probe(torch, device) -> str:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x, y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n) + 1.0, mask=i < n)

    x = torch.arange(1024, dtype=torch.float32, device=device)
    y = torch.zeros_like(x)
    try:
        _add_one[(4,)](x, y, 1024, BLOCK=256)
        torch.cuda.synchronize(device)
        ok = torch.equal(y.cpu(), x.cpu() + 1)
        return ("ok" if ok else "WRONG RESULT") + f" (current device {torch.cuda.current_device()}, tensors on {device})"
    except BaseException as e:  # noqa: BLE001
        return f"FAILED: {type(e).__name__}: {str(e)[:200]} (current device {torch.cuda.current_device()}, " \
               f"tensors on {device})"


def cmd_preflight(a) -> int:
    import multiprocessing as mp
    import secrets
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    session = secrets.token_hex(6)
    ps = [ctx.Process(target=_preflight_rank, args=(r, session, a.device, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    got = []
    deadline = time.monotonic() + a.timeout
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            got.append(q.get(timeout=1))
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in ps) and q.empty():
                break
    for p in ps:
        p.join(5)
        if p.is_alive():
            p.kill()
    ranks = {g["rank"]: g for g in got}
    ok = len(ranks) == 2 and all("error" not in g and g.get("all_reduce_ok") and g.get("all_gather_ok")
                                  and str(g.get("triton", "")).startswith("ok") for g in ranks.values())
    part = {"ranks": ranks, "ok": ok}
    print(json.dumps(part, indent=1), flush=True)
    write_json(a.out, part)
    return 0 if ok else 1


# ================================================================================================ report

def rank_bytes(ckpt: str, rows: int, rank: int = 0, world: int = 2) -> dict:
    """Bytes rank `rank` must read in a decode round of `rows` one-token rows: its share of every layer's
    non-expert weights, the routed experts it holds that the round touches (uniform top-k expected), its head half.
    Not counted: the embedding and Engram tables (a round reads a few rows of them), the KV reads (short contexts
    here), DSpark stages."""
    sys.path.insert(0, str(ROOT))
    from dsv41.config import ModelConfig
    from dsv41.model.weights import RankShare, expected_tensors
    nbytes = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
    cfg = ModelConfig.from_checkpoint(Path(ckpt))
    t = cfg.text
    share = RankShare(rank, world)
    other = head = 0.0
    expert: dict[int, float] = {}
    held: set[int] = set()
    for name, spec in expected_tensors(cfg).items():
        if name.startswith(("mtp.", "embed", "image_")) or ".engram.embed." in name:
            continue
        n_exp = t.n_routed_experts
        if not share.wants(name, n_exp):
            continue
        b = math.prod(spec.shape) * nbytes[spec.dtype]
        sp = share.split(name, spec.shape)
        if sp is not None:
            dim, lo, hi = sp
            b = b * (hi - lo) / spec.shape[dim]
        if ".ffn.experts." in name:
            e = int(name.split(".ffn.experts.")[1].split(".")[0])
            held.add(e)
            expert[e] = expert.get(e, 0.0) + b
        elif name.startswith("head."):
            head += b
        else:
            other += b
    K = t.num_hidden_layers
    per_expert_layer = sum(expert.values()) / len(expert) / K if expert else 0.0    # one expert of one layer
    n, k = t.n_routed_experts, t.num_experts_per_tok
    touched = len(held) * (1 - (1 - k / n) ** rows)     # per layer: the rank's experts that some row picks
    experts_b = touched * per_expert_layer * K
    return {"other": other, "experts": experts_b, "head": head, "total": other + experts_b + head,
            "touched_per_layer": touched}


def prompt_flops(ckpt: str, tokens: int) -> float:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_bench import flops_per_token

    from dsv41.config import ModelConfig
    t = ModelConfig.from_checkpoint(Path(ckpt)).text
    K = t.num_hidden_layers
    return flops_per_token(t, list(t.compress_ratios[:K]), set(t.kv_source_layer_ids), tokens) * tokens


def _ring_of(section: dict, rank: int, bucket: str) -> dict | None:
    """The rank's ring row for the bucket, else for the whole section (drafted decode rows are longer than 1)."""
    rows = [r for r in section.get("ring", []) if r["rank"] == rank]
    return next((r for r in rows if r["bucket"] == bucket), None) or next((r for r in rows if r["bucket"] == "all"),
                                                                          None)


def _load(parts: Path, name: str) -> dict | None:
    p = parts / f"{name}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _pct(x, spec: str = ".1f") -> str:
    return _f(x * 100 if x is not None else None, spec) + ("%" if x is not None else "")


def _f(x, spec=".1f", none="–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def render(parts: Path, commit: str, command: str) -> str:
    lim, pre, vec = _load(parts, "limits"), _load(parts, "preflight"), _load(parts, "vectors")
    srv, kil, cmb = _load(parts, "serve"), _load(parts, "kill"), parts / "comm-cuda-x2.md"
    env = (parts / "env.txt").read_text().strip() if (parts / "env.txt").is_file() else ""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    L = ["# TP2 on two H200s of one host (issue 14; bench/tp2_bench.py)", "",
         f"- command: `{command}`; commit {commit or '?'}; {now}",
         f"- machine: {env or platform.node()}",
         ("- NVLink multicast off in every process: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, "
         "NVSHMEM_DISABLE_NVLS=1"), ""]
    bw = rate = None
    if lim and lim.get("gpus"):
        bw = min(g["copy_bw"] for g in lim["gpus"])
        rate = sum(g["bf16_rate"] for g in lim["gpus"][:2])
        L += ["## The two GPUs' limits (measured in this call)", "",
              "| GPU | copy bandwidth (read + write) | bf16 matrix rate (8192³) |", "|---|---|---|"]
        L += [f"| cuda:{g['index']} {g['name']} | {g['copy_bw'] / 1e12:.2f} TB/s | {g['bf16_rate'] / 1e12:.0f} TFLOP/s |"
              for g in lim["gpus"]]
        if lim.get("p2p_bw"):
            L += ["", f"cuda:0 → cuda:1 copy: {lim['p2p_bw'] / 1e9:.0f} GB/s; peer access {lim.get('peer')}"]
        L.append("")
    if pre is not None:
        L += ["## Preflight: the ring opened as the server opens it", "",
              f"ok: **{pre.get('ok')}**", ""]
        for r, g in sorted(pre.get("ranks", {}).items()):
            L.append(f"- rank {r}: device {g.get('device')} (current device {g.get('current_device')}), ring "
                     f"{g.get('ring')}, all_reduce {g.get('all_reduce_ok')}, all_gather {g.get('all_gather_ok')}, "
                     f"Triton {g.get('triton')}" + (f"; **error** {g['error']}" if g.get("error") else ""))
        L.append("")
    if vec is not None:
        L += ["## tiny-a vectors: TP2 (cuda:0 + cuda:1) against one rank (cuda:0)", "",
              (f"ok: **{vec.get('ok')}** ({vec.get('prompts')} prompts x {vec.get('tokens')} greedy tokens; burst of "
              f"{vec.get('burst')})"), "",
              "| prompt | ids | TP2 == TP1 | burst == alone | oracle prefix TP1 | oracle prefix TP2 | max abs dlogprob |",
              "|---|---|---|---|---|---|---|"]
        for r in vec.get("rows", []):
            L.append(f"| {r['prompt']} | {r['len']} | {r['tp2_eq_tp1']} | {r['burst_eq_alone']} | "
                     f"{r['tp1_oracle_match']} | {r['tp2_oracle_match']} | {_f(r['max_lp_diff'], '.2e')} |")
        L.append("")
    if srv is not None:
        K = srv.get("layers") or 0
        ck = srv.get("checkpoint")
        L += [f"## Serving `{ck}` ({K} layers) through `scripts/serve.sh --tp 2`", "",
              (f"Prompts of {srv.get('prompt_len')} random ids, {srv.get('tokens')} greedy tokens each; warm-up "
              f"{_f(srv.get('warmup_s'))} s. Extrapolation to {RELEASE_LAYERS} layers: round x {RELEASE_LAYERS}/{K} "
              "(an extrapolation, on the high side: the head and the per-round serving cost are scaled too)."), "",
              "### Decode", "",
              (f"| streams | tok/s ({K} layers) | round ms | per-stream tok/s | bytes/rank/round | bound ms at copy bw | "
               f"% of bound | tok/s {RELEASE_LAYERS} layers (extrap.) | ring share (CPU / GPU) |"),
              "|---|---|---|---|---|---|---|---|---|"]
        for d in sorted(srv.get("decode", []), key=lambda d: d["streams"]):
            n, rms = d["streams"], d.get("round_ms")
            rb = rank_bytes(ck, n) if ck and K else None
            bound = rb["total"] / bw * 1e3 if rb and bw else None
            ring0 = _ring_of(d, 0, f"decode/{n}")
            ext = n / (rms / 1e3 * RELEASE_LAYERS / K) if rms and K else None
            L.append(f"| {n} | {_f(d.get('tok_s'), '.2f')} | {_f(rms, '.0f')} | {_f(d.get('per_stream_tok_s'), '.2f')} "
                     f"| {_f(rb['total'] / 1e6 if rb else None, '.0f')} MB | {_f(bound, '.3f')} | "
                     f"{_pct(bound / rms if bound and rms else None, '.2f')} | {_f(ext, '.2f')} | "
                     f"{_pct(ring0 and ring0['cpu_share'])} / {_pct(ring0 and ring0['gpu_share'])} |")
        L += ["", "### Concurrent == solo (token ids and logprobs, bitwise)", ""]
        for e in srv.get("exact", []):
            L.append(f"- {e['streams']} streams: {e['equal']} / {e['compared']} equal"
                     + (f"; first difference: prompt {e['first_bad']['k']}" if e.get("first_bad") else ""))
        L += ["", "### Prompt passes (one request, 1 token out)", "",
              (f"| prompt tokens | s | tok/s ({K} layers) | tok/s {RELEASE_LAYERS} layers (extrap.) | TFLOP/s | "
               "% of both GPUs' bf16 rate | ring share (CPU / GPU) |"), "|---|---|---|---|---|---|---|"]
        for p in srv.get("prompt", []):
            fl = prompt_flops(ck, p["tokens"]) if ck and K else None
            ach = fl / p["s"] if fl else None
            ring0 = _ring_of(p, 0, "prompt")
            L.append(f"| {p['tokens']} | {p['s']:.1f} | {p['tok_s']:.0f} | {_f(p['tok_s'] * K / RELEASE_LAYERS, '.0f')} "
                     f"| {_f(ach / 1e12 if ach else None, '.2f')} | "
                     f"{_pct(ach / rate if ach and rate else None, '.2f')} | "
                     f"{_pct(ring0 and ring0['cpu_share'])} / {_pct(ring0 and ring0['gpu_share'])} |"
                     + (f" error: {p['error']}" if p.get("error") else ""))
        rows = [r for d in srv.get("decode", []) for r in d.get("ring", [])] + \
               [r for p in srv.get("prompt", []) for r in p.get("ring", [])]
        if rows:
            L += ["", "### The ring per round (both ranks, from the ranks' own timers)", "",
                  ("| section | rank | rounds (kind/seqs) | rows/round | round ms | ring ops | ring KB | ring CPU ms | "
                   "ring GPU ms | share CPU | share GPU |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in rows:
                L.append(f"| {r.get('section', '')} | {r['rank']} | {r['rounds']} {r['bucket']} | "
                         f"{r['rows_per_round']:.0f} | {r['round_ms']:.1f} | {r['ring_ops']:.0f} | {r['ring_kb']:.0f} | "
                         f"{r['ring_cpu_ms']:.2f} | {_f(r['ring_gpu_ms'], '.2f')} | {_pct(r['cpu_share'])} | "
                         f"{_pct(r['gpu_share'])} |")
        if srv.get("skipped"):
            L += ["", "Not run (time budget): " + "; ".join(srv["skipped"])]
        L.append("")
    if kil is not None:
        rc_file = parts / "server_rc.txt"
        kil["server_rc"] = rc_file.read_text().strip() if rc_file.is_file() else None
        L += ["## A rank killed mid-stream", "",
              (f"- rank {kil.get('killed_rank')} SIGKILLed after {kil.get('tokens_before_error')} tokens: ok "
              f"**{kil.get('ok')}**; the stream's error: `{kil.get('stream_error')}`; the server exited "
              f"{kil.get('server_exited')} (status {kil.get('server_rc')}) "
              f"{_f(kil.get('exit_after_kill_s'), '.1f')} s after the kill; its log: `{kil.get('log_line')}`"), ""]
    if cmb.is_file():
        L += ["## Ring latency alone: cuda-ipc vs NCCL (bench/comm_bench.py --device cuda, two GPUs)", "",
              *[ln for ln in cmb.read_text().splitlines() if ln.startswith("|")], ""]
    missing = [n for n, v in (("limits", lim), ("preflight", pre), ("vectors", vec), ("serve", srv), ("kill", kil))
               if v is None]
    if missing:
        L += [f"Parts with no result in this call: {', '.join(missing)} (see the call's logs)", ""]
    return "\n".join(L)


def cmd_report(a) -> int:
    text = render(Path(a.parts), a.commit, a.command or "bash scripts/h200x2/all.sh")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


# ================================================================================================ main

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hook"]:
        return cmd_hook(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("limits")
    p.add_argument("--gib", type=int, default=4)
    p.add_argument("--out", required=True)
    p = sub.add_parser("preflight")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", required=True)
    p = sub.add_parser("vectors")
    p.add_argument("--tp1", required=True)
    p.add_argument("--tp2", required=True)
    p.add_argument("--vectors", required=True, help="the tiny-a folder (vectors.safetensors)")
    p.add_argument("--copies", type=int, default=2, help="each prompt this many times in the burst")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--out", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--url", required=True)
    p.add_argument("--stats", default=None, help="DSV41_TP2_STATS of the ranks (hook)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--tokens", type=int, default=6, help="tokens per reply in the decode sections")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prompts", default="8192,32768,131072")
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--reserve-s", type=float, default=20, help="left for what runs after (the kill)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("kill")
    p.add_argument("--url", required=True)
    p.add_argument("--pid", type=int, required=True, help="the rank process to SIGKILL")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--server-pid", type=int, default=0, help="serve.sh (or rank 0): must exit by itself")
    p.add_argument("--log", default=None, help="the server's output (must name the lost rank)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--wait-s", type=float, default=60)
    p.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("--parts", required=True)
    p.add_argument("--out", default=str(ROOT / "bench/results/tp2-h200x2.md"))
    p.add_argument("--commit", default="")
    p.add_argument("--command", default="")
    a = ap.parse_args(argv)
    return {"limits": cmd_limits, "preflight": cmd_preflight, "vectors": cmd_vectors, "serve": cmd_serve,
            "kill": cmd_kill, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
