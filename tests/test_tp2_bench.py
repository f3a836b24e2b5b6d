"""bench/tp2_bench.py's logic on the CPU (the two-GPU run itself is scripts/h200x2/all.sh, docs/tp2.md): the ranks'
round / ring timers through the real shm ring and DigestingModel, the per-section differences and shares, the
bytes a rank must read (RankShare of the checkpoint), the budget predictions, and the report."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import tp2_bench as tb


def test_hook_times_the_ring_inside_a_forward_and_undoes(tmp_path):
    import dsv41.comm.ring as ring_mod
    import dsv41.sched.tp as tp_mod
    from dsv41.model.model import SeqInput
    originals = {n: ring_mod.ShmRing.__dict__[n] for n in ("all_reduce_sum", "all_gather", "broadcast")}
    fwd = tp_mod.DigestingModel.forward
    stats = tb.RoundStats(tmp_path / "rank0.json", 0)
    undo = tb.install_hook(stats)
    try:
        assert ring_mod.ShmRing.all_reduce_sum is not originals["all_reduce_sum"]
        got = {}

        class Fake:                    # a model whose forward does one all-reduce of [rows, 5120] fp32
            def __init__(self, ring):
                self.ring = ring

            def forward(self, inputs):
                x = torch.ones(sum(int(i.ids.numel()) for i in inputs), 5120) * (self.ring.rank + 1)
                got[self.ring.rank] = self.ring.all_reduce_sum(x)
                return [x[-1:] for _ in inputs]

        def rank(r):
            with ring_mod.ShmRing(r, 2, f"tp2b{os.getpid()}", timeout=20, capacity=1 << 16) as ring:
                if r == 0:             # rank 0 through DigestingModel (timed), rank 1 bare (counted as outside)
                    tp_mod.DigestingModel(Fake(ring)).forward([SeqInput(None, torch.tensor([5]))])
                    tp_mod.DigestingModel(Fake(ring)).forward([SeqInput(None, torch.tensor([5, 6, 7]))])
                else:
                    Fake(ring).forward([SeqInput(None, torch.tensor([5]))])
                    Fake(ring).forward([SeqInput(None, torch.tensor([5, 6, 7]))])
        ts = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert torch.equal(got[0], torch.full((3, 5120), 3.0))   # the wrapped ring still sums in rank order
        b = json.loads((tmp_path / "rank0.json").read_text())["buckets"]
        assert b["decode/1"]["rounds"] == 1 and b["decode/1"]["ring_ops"] == 1
        assert b["decode/1"]["ring_bytes"] == 5120 * 4
        assert b["prompt"]["rows"] == 3 and b["prompt"]["ring_bytes"] == 3 * 5120 * 4
        assert 0 < b["prompt"]["ring_cpu_s"] <= b["prompt"]["wall_s"]
        assert b["decode/1"]["gpu_ops"] == 0
        assert stats.buckets["outside"]["ring_ops"] == 2          # rank 1's collectives, outside any forward
    finally:
        undo()
    assert {n: ring_mod.ShmRing.__dict__[n] for n in originals} == originals
    assert "all_reduce_sum" not in ring_mod.DistRing.__dict__     # inherited again, as before
    assert tp_mod.DigestingModel.forward is fwd


def test_diff_and_ring_rows():
    zero = dict.fromkeys(tb.RoundStats.FIELDS, 0.0)
    before = {0: {"decode/8": dict(zero, rounds=2, wall_s=1.0, ring_ops=10, ring_cpu_s=0.1)}}
    after = {0: {"decode/8": dict(zero, rounds=6, rows=32, seqs=32, wall_s=3.0, ring_ops=30, ring_bytes=4e5,
                                  ring_cpu_s=0.5, ring_gpu_s=0.2, gpu_ops=20),
                 "prompt": dict(zero, rounds=1, rows=256, wall_s=1.0, ring_ops=5, ring_cpu_s=0.1)},
             1: {"decode/8": dict(zero, rounds=1, wall_s=0.5)}}
    d = tb.diff_stats(after, before)
    assert d[0]["decode/8"]["rounds"] == 4 and d[0]["decode/8"]["wall_s"] == 2.0
    rows = {(r["rank"], r["bucket"]): r for r in tb.ring_rows(d, "s")}
    r = rows[(0, "decode/8")]
    assert r["round_ms"] == pytest.approx(500) and r["ring_ops"] == 5
    assert r["cpu_share"] == pytest.approx(0.2) and r["gpu_share"] == pytest.approx(0.1)
    assert rows[(0, "prompt")]["gpu_share"] is None                # no CUDA events: no GPU figure
    assert rows[(0, "all")]["rounds"] == 5                         # the section as a whole
    assert (1, "all") not in rows                                  # one bucket only: no total row
    assert tb._ring_of({"ring": list(rows.values())}, 0, "decode/9")["bucket"] == "all"


def test_rates_and_budget_predictions():
    res = [{"times": [1.0, 2.0, 3.0]}, {"times": [1.0, 2.0, 3.0]}]
    assert tb.aggregate_rate(res) == pytest.approx(2.0)            # 4 tokens after the first, over 2 s
    assert tb.stream_rate(res[0]) == pytest.approx(1.0)
    assert tb.est_round({8: 1.0, 32: 2.0}, 16) == pytest.approx(1.0)  # from 32 rows, scaled down
    assert tb.est_round({}, 8) == 0.0
    assert tb.predict_prompt_s([(8192, 10.0)], 32768) == pytest.approx(80.0)
    a = {"ids": [1, 2], "lps": [-0.5, -0.25], "error": None}
    assert tb.same(a, dict(a)) and not tb.same(a, dict(a, lps=[-0.5, -0.2500001]))
    assert tb.bucket_key([1, 1, 1]) == "decode/3" and tb.bucket_key([1, 2]) == "prompt"


def test_rank_bytes_follow_the_rank_share(shared):
    ck = str(shared / "vectors/model/tiny-a/checkpoint")
    cfg = json.loads((Path(ck) / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    one, many = tb.rank_bytes(ck, 1), tb.rank_bytes(ck, 64)
    assert one["head"] == t["vocab_size"] * t["hidden_size"] * 2 / 2   # BF16 head, half the vocabulary
    assert one["other"] == many["other"] and many["experts"] > one["experts"] > 0
    # every expert touched: the rank reads all the experts it holds (rank 0: the first half of each layer's)
    from dsv41.config import ModelConfig
    from dsv41.model.weights import expected_tensors
    n_exp = t["n_routed_experts"]
    held = sum(math.prod(s.shape) for n, s in expected_tensors(ModelConfig.from_checkpoint(Path(ck))).items()
               if ".ffn.experts." in n and not n.startswith("mtp.")
               and int(n.split(".ffn.experts.")[1].split(".")[0]) < n_exp // 2)
    assert tb.rank_bytes(ck, 10**6)["experts"] == pytest.approx(held)
    assert tb.rank_bytes(ck, 10**6, world=1)["experts"] == pytest.approx(2 * held)
    # one row: its top-k of n experts, about k/2 of them on each rank, in every layer
    per_expert = held / (n_exp // 2) / t["num_hidden_layers"]
    assert one["experts"] == pytest.approx((n_exp // 2) * (1 - (1 - t["num_experts_per_tok"] / n_exp))
                                           * per_expert * t["num_hidden_layers"])


def test_report_from_parts(tmp_path, shared):
    ck = str(shared / "vectors/model/tiny-a/checkpoint")
    (tmp_path / "limits.json").write_text(json.dumps({"gpus": [
        {"index": i, "name": "H200", "copy_bw": 4e12, "bf16_rate": 8e14} for i in (0, 1)], "p2p_bw": 3e11}))
    ring = [{"section": "decode 8", "rank": 0, "bucket": "decode/8", "rounds": 4, "rows_per_round": 8,
             "round_ms": 100.0, "ring_ops": 21, "ring_kb": 300, "ring_cpu_ms": 5.0, "ring_gpu_ms": 2.0,
             "cpu_share": 0.05, "gpu_share": 0.02}]
    (tmp_path / "serve.json").write_text(json.dumps({
        "checkpoint": ck, "layers": 10, "prompt_len": 32, "tokens": 4, "warmup_s": 3.0,
        "decode": [{"streams": 8, "tok_s": 70.0, "round_ms": 100.0, "per_stream_tok_s": 9.0, "ring": ring}],
        "exact": [{"streams": 8, "compared": 8, "equal": 8, "first_bad": None}],
        "prompt": [{"tokens": 8192, "s": 4.0, "tok_s": 2048.0, "error": None, "ring": []}],
        "skipped": ["prompt 131072: predicted 900 s"]}))
    (tmp_path / "server_rc.txt").write_text("1\n")
    (tmp_path / "kill.json").write_text(json.dumps({"killed_rank": 1, "ok": True, "server_exited": True}))
    text = tb.render(tmp_path, "abc123", "bash scripts/h200x2/all.sh")
    assert "| cuda:1 H200 | 4.00 TB/s | 800 TFLOP/s |" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| 8 | 70.00 |"))
    assert row.endswith("| 20.00 | 5.0% / 2.0% |")               # 8 / (0.1 s x 40 / 10) tok/s extrapolated
    assert "8 streams: 8 / 8 equal" in text and "prompt 131072: predicted 900 s" in text
    assert "(status 1)" in text and "preflight, vectors" in text    # parts that did not run are named


def test_hook_passes_other_python_invocations_through():
    out = subprocess.run([sys.executable, str(ROOT / "bench/tp2_bench.py"), "hook", "-c", "print(6 * 7)"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "42"
