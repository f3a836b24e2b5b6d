"""Where TP2 leaves TP1 on CUDA (issue 7, 2026-12-03: the H200's TP2 server sampled a token outside TP1's top 20
for one seeded job, with or without CUDA graphs or kept states; the CPU and the CPU-emulated kernel path agree to
~1e-3). Two ranks in one process (threads, an in-process exchange as tests/test_model_tp.py) against the whole
model on the built-in checkpoint, per layer: the largest |difference| of the streams after each layer, then of the
logits' two vocabulary halves. Usage (repo root, GPU): python scripts/h200/tpdiag.py [--device cuda]"""
import argparse
import random
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_model_tp import _ThreadComm  # noqa: E402

from dsv41.api.engine import builtin_checkpoint  # noqa: E402
from dsv41.model.model import Model, SeqInput  # noqa: E402
from dsv41.model.weights import RankShare  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--kernels", default="1")
a = ap.parse_args()
kernels = a.kernels == "1"
ck = str(builtin_checkpoint())
prompt = torch.tensor([0] + [random.Random(1).randrange(3, 120000) for _ in range(8)])
whole = Model.load(ck, device=a.device, kernels=kernels)
tw: dict = {}
ref = whole.forward([SeqInput(whole.new_state(), prompt, logits="last")], trace=tw)[0][0].cpu()
tc = _ThreadComm(2)
ranks = [Model.load(ck, device=a.device, share=RankShare(r, 2), comm=tc.for_rank(r), kernels=kernels)
         for r in range(2)]
out, traces = [None, None], [{}, {}]


def go(r):
    out[r] = ranks[r].forward([SeqInput(ranks[r].new_state(), prompt, logits="last")], trace=traces[r])[0][0].cpu()


th = [threading.Thread(target=go, args=(r,)) for r in range(2)]
for t in th:
    t.start()
for t in th:
    t.join()
print(f"device {a.device}, kernels {a.kernels}: ranks equal {torch.equal(out[0], out[1])}")
for i, (x, y) in enumerate(zip(tw["layer_out_streams"], traces[0]["layer_out_streams"])):
    print(f"layer {i}: max |tp2 - tp1| of the streams {(x.cpu() - y.cpu()).abs().max().item():.3e}")
half = ref.numel() // 2
d = (out[0] - ref).abs()
print(f"logits: max diff {d.max().item():.3e} (first half {d[:half].max().item():.3e}, second {d[half:].max().item():.3e})")
print(f"top-5 tp1 {ref.topk(5).indices.tolist()} tp2 {out[0].topk(5).indices.tolist()}")
