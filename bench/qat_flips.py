"""Where the GPU's QAT roundings part from the CPU reference's, and whether float32 noise explains each one.

The model on CUDA with the torch fallbacks (cuda_ops(kernels=False)) and the CPU reference run one tiny-a vector
prompt side by side (prefill, then teacher-forced decode steps); every fake-quant call (window KV FP8, indexer q /
keys FP4, compressed entries FP4) is recorded on both, in call order. For each call pair: the inputs' largest
difference in ulps of its block's largest value (float32 noise: a few), how many outputs differ (a "flip": one
value rounded the other way, or a block's scale), and for each flipped value its CPU input's distance from the
nearest rounding boundary in the same units: a flip a few ulps from a boundary is noise; one far from any
boundary, with inputs that agree, is a bug.

  python bench/qat_flips.py [--prompt 5] [--steps 0] [--out bench/results/qat-flips.md]     (needs CUDA and the
                                                                                              tiny-a vectors)

A decode round fake-quantizes every compressor group that may close and masks those that do not, so some of a
decode step's calls read rows nothing wrote (uninitialised memory, different on every run); the prompt pass's
calls are all real rows: the default compares the prompt pass only.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41 import shared_dir  # noqa: E402
from dsv41.model import quant  # noqa: E402
from dsv41.model.model import Model, SeqInput  # noqa: E402
from dsv41.model.ops import cuda_ops, reference_ops  # noqa: E402

KINDS = ("fp8_fake_quant", "fp4_fake_quant_ue8m0", "fp4_fake_quant_e4m3")


def recording(ops, log):
    """ops with each fake-quant wrapped to append (kind, input, output) to log (host copies)."""
    def wrap(kind, fn):
        def f(x, block):
            y = fn(x, block)
            log.append((kind, x.detach().float().cpu().clone(), y.detach().float().cpu().clone()))
            return y
        return f
    return dataclasses.replace(ops, **{k: wrap(k, getattr(ops, k)) for k in KINDS})


def boundary_ulps(kind: str, x: torch.Tensor, block: int) -> torch.Tensor:
    """Each value's distance from its nearest rounding boundary, in ulps of the value: x / scale against the
    format's midpoints (the scale as the CPU computes it)."""
    v = x.reshape(-1, block)
    amax = v.abs().amax(-1, keepdim=True)
    if kind == "fp8_fake_quant":
        s = quant.pow2_ceil(amax.clamp_min(1e-4) / 448.0)
        grid = torch.tensor([m * 2.0 ** e for e in range(-9, 9) for m in (1.0, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75,
                                                                             1.875)])
    else:
        floor = 6 * 2.0 ** -126 if kind == "fp4_fake_quant_ue8m0" else 6 * 2.0 ** -9
        s = (quant.pow2_ceil(amax.clamp_min(floor) / 6.0) if kind == "fp4_fake_quant_ue8m0"
             else (amax.clamp_min(floor) / 6.0).clamp_max(448).to(torch.float8_e4m3fn).float())
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    q = (v / s).abs().reshape(-1)
    mids = (grid[1:] + grid[:-1]) / 2
    d = (q[:, None] - mids[None, :]).abs().amin(1) * s.expand_as(v).reshape(-1)
    # float32 noise in a block's values scales with the block's largest (the sums they come from): its ulp
    ulp = torch.finfo(torch.float32).eps * amax.clamp_min(1e-30).expand_as(v).reshape(-1)
    return (d / ulp).reshape(x.shape)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0, help="teacher-forced decode steps after the prompt (their "
                    "calls include masked groups' unset rows: pairs there may not compare)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: the CUDA op set on CPU tensors (a check of the script)")
    a = ap.parse_args()
    d = shared_dir() / "vectors/model/tiny-a"
    v = load_file(str(d / "vectors.safetensors"))
    ids = v[f"prompt.{a.prompt}.input_ids"].tolist()
    feed = v[f"prompt.{a.prompt}.decode_ids"].tolist()[:a.steps]
    logs = {"cpu": [], "cuda": []}
    models = {"cpu": Model.load(d / "checkpoint", ops=recording(reference_ops(), logs["cpu"])),
              "cuda": Model.load(d / "checkpoint", device=a.device,
                                 ops=recording(cuda_ops(kernels=False), logs["cuda"]))}
    lines = []
    for k, m in models.items():
        st = m.new_state()
        m.forward([SeqInput(st, torch.tensor(ids), logits="all")])
        for t in feed:
            m.forward([SeqInput(st, torch.tensor([t]), logits="all")])
    lines.append(f"prompt {a.prompt} ({len(ids)} tokens) + {len(feed)} decode steps; fake-quant calls: cpu "
                 f"{len(logs['cpu'])}, cuda {len(logs['cuda'])}")
    lines += ["", "| call | kind | values | input max diff (ulps of the block max) | flipped | "
                  "flips' boundary distance (same ulps, max) |", "|---|---|---|---|---|---|"]
    total = far = 0
    for i, ((kind, xc, yc), (kind2, xg, yg)) in enumerate(zip(logs["cpu"], logs["cuda"])):
        if kind != kind2 or xc.shape != xg.shape:
            lines.append(f"| {i} | {kind} / {kind2} | shapes {tuple(xc.shape)} / {tuple(xg.shape)} | call order "
                         "differs: stopped | | |")
            break
        ma, mb = xc.abs().max().item(), xg.abs().max().item()
        if not (0.5 * ma <= mb <= 2 * ma):
            # a decode round fake-quantizes every group that may close, then masks those that do not: their
            # inputs are unset rows (the two op sets' rounds differ there), not comparable
            lines.append(f"| {i} | {kind} | {xc.numel()} | not comparable (|max| {ma:.3g} / {mb:.3g}: a masked "
                         "group's unset row) | | |")
            continue
        block = 32 if kind != "fp4_fake_quant_e4m3" else 16
        bmax = xc.reshape(-1, block).abs().amax(-1, keepdim=True).clamp_min(1e-30)
        rel = ((xc - xg).abs().reshape(-1, block) / (bmax * torch.finfo(torch.float32).eps)).max().item()
        flip = yc != yg
        nf = int(flip.sum())
        total += nf
        dist = ""
        if nf:
            du = boundary_ulps(kind, xc, block)[flip]
            far += int((du > 64).sum())
            dist = f"{du.max().item():.3g}"
        if nf or rel > 64:
            lines.append(f"| {i} | {kind} | {xc.numel()} | {rel:.2e} | {nf} | {dist} |")
    lines += ["", f"flipped values in all: {total}; of them more than 64 ulps from a boundary: {far}"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        p = Path(a.out)
        dev = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (the CUDA op set on CPU tensors)"
        head = (f"## {datetime.date.today()} · {dev} · `python bench/qat_flips.py --prompt {a.prompt} "
                f"--steps {a.steps}`\n\n")
        old = p.read_text() if p.exists() else "# QAT roundings, GPU against the CPU reference (bench/qat_flips.py)\n"
        title, _, rest = old.partition("\n")
        p.write_text(title + "\n\n" + head + text + "\n" + ("\n" + rest.lstrip("\n") if rest.strip() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
