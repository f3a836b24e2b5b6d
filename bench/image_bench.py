"""What an image costs before its prompt is queued (issue 11): preprocessing on the host, then the tower + aligner.

    python bench/image_bench.py --sizes 640x480,1024x768         # CPU, a 2-layer release-width tower
    python bench/image_bench.py --device cuda --layers 32 --out bench/results/images-h200.md

For a few image sizes (random RGB, JPEG-encoded, as clients send photos):
- prep: `prepare_image` (decode, plan, resize + gray pad, bf16 patches) on the host: the API process's worker
  thread does this for every image, whatever the device;
- tower: `encode_image` (ViT, 3x3 merge, aligner, span layout) with release-shaped random weights
  (D 1024, 16 heads, I 2816, --layers of 32, aligner to --text-dim), float32 (what the server runs) and bfloat16
  (what the release runs), median of --reps after one warm-up, with a device sync.
The table lists patches, span positions and milliseconds; the machine line says where and how loaded it ran.
"""
from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np
import torch
from PIL import Image

from dsv41.config import VisionConfig
from dsv41.model.image_prep import ImagePrepConfig, prepare_image
from dsv41.model.vision import VisionTower, encode_image, vision_weight_shapes

SIZES = [(640, 480), (1024, 768), (1920, 1080), (4032, 3024), (3000, 600)]


def jpeg(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, reps: int, device: str) -> float:
    fn()
    sync(device)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2, help="ViT blocks (the release has 32)")
    ap.add_argument("--text-dim", type=int, default=4096, help="aligner output width (the text hidden size)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in SIZES), help="WxH,WxH,...")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    vcfg = VisionConfig(num_hidden_layers=a.layers, hidden_size=1024, num_attention_heads=16,
                        intermediate_size=2816, patch_size=14, rope_theta=10000.0, downsample_ratio=3,
                        max_image_tokens=1024, min_pixels=295936, max_wh_ratio=None)
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(s, generator=g) * (0.02 if len(s) == 2 else 1.0)
         for n, s in vision_weight_shapes(vcfg, a.text_dim).items()}
    rows = tuple(torch.randn(a.text_dim, generator=g) for _ in range(3))
    prep = ImagePrepConfig.from_vision_config(vcfg)
    towers = {dt: VisionTower.load(w, vcfg, dtype=dt, device=a.device, prep=prep)
              for dt in (torch.float32, torch.bfloat16)}
    lines = []
    header = "| image | JPEG KB | patches | span positions | prep ms (host) | tower fp32 ms | tower bf16 ms |"
    print(header, flush=True)
    lines += [header, "|---|---|---|---|---|---|---|"]
    for k, (wd, ht) in enumerate(sizes):
        data = jpeg(wd, ht, k)
        img = prepare_image(data, prep)
        t_prep = timed(lambda d=data: prepare_image(d, prep), a.reps, "cpu")
        t = {dt: timed(lambda tw=tw, im=img: encode_image(tw, im, b"", *rows), a.reps, a.device)
             for dt, tw in towers.items()}
        line = (f"| {wd}x{ht} | {len(data) // 1024} | {img.plan.n_vit_h * img.plan.n_vit_w} | {img.n_tokens} | "
                f"{t_prep:.1f} | {t[torch.float32]:.1f} | {t[torch.bfloat16]:.1f} |")
        print(line, flush=True)
        lines.append(line)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor() or "cpu"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine = (f"{dev}; {os.cpu_count()} CPUs, load {load:.1f}; torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads; ViT {a.layers} of 32 blocks, aligner to {a.text_dim}")
    print(machine)
    if a.out:
        cmd = "python bench/image_bench.py " + " ".join(sys.argv[1:])
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(f"# Image cost before queueing: host preprocessing and the tower\n\nCommand: `{cmd}`\n\n"
                         f"Machine: {machine}\n\n" + "\n".join(lines) + "\n\nMedian of "
                         f"{a.reps} after one warm-up. Random weights of the release's shapes; random-pixel JPEGs "
                         "(the worst case for decoding). The tower scales with the blocks: multiply the ViT part by "
                         "32 / layers for the release.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
