"""Engram hashing and table-row reads: rows/s of EngramStore.lookup (cold cache, warm cache, after prefetch) and
positions/s of EngramHasher, on a release-layout Engram shard with real row width (256 E4M3 + 8 E8M0 bytes).

    python bench/engram_bench.py [--rows 1000000] [--tokens 1,64,512] [--threads 1,8] [--out bench/results/engram.md]

The table file sits in a temporary directory; the OS page cache is not dropped (no privileges), so "cold" means
cold for the store's own LRU, not for the disk: it measures the map gather + dequant path, not the device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41.config import ModelConfig, release_config_dict  # noqa: E402
from dsv41.model.engram_hash import EngramHasher, load_token_map  # noqa: E402
from dsv41.model.engram_store import EngramStore  # noqa: E402


def write_table(d: Path, rows: int, dim: int = 256) -> None:
    """One shard holding layers.1.engram.embed.{weight,scale}, written by hand in the safetensors layout (streamed,
    so a large table needs no memory)."""
    w_bytes, s_bytes = rows * dim, rows * (dim // 32)
    header = {"__metadata__": {"format": "pt"},
              "layers.1.engram.embed.scale": {"dtype": "F8_E8M0", "shape": [rows, dim // 32],
                                              "data_offsets": [0, s_bytes]},
              "layers.1.engram.embed.weight": {"dtype": "F8_E4M3", "shape": [rows, dim],
                                               "data_offsets": [s_bytes, s_bytes + w_bytes]}}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    rng = np.random.default_rng(0)
    with open(d / "model-00001-of-00001.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.write(rng.integers(110, 130, size=s_bytes, dtype=np.uint8).tobytes())
        chunk = 1 << 16
        for a in range(0, rows, chunk):
            n = min(chunk, rows - a)
            b = rng.integers(0, 256, size=n * dim, dtype=np.uint8)
            b[(b & 0x7F) == 0x7F] = 0  # no NaN codes
            f.write(b.tobytes())
    wm = {"layers.1.engram.embed.weight": "model-00001-of-00001.safetensors",
          "layers.1.engram.embed.scale": "model-00001-of-00001.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def bench_cfg(rows: int) -> ModelConfig:
    d = release_config_dict()
    t = d["text_config"]
    # one Engram layer whose primes fit `rows` (the release's bucket sizes scaled down)
    t["engram_layer_ids"] = [1]
    t["engram_vocab_size"] = rows // 24
    from dsv41.model.engram_hash import engram_primes
    probe = ModelConfig.from_dict({**d, "text_config": {**t, "engram_num_embeddings": [10 ** 12]}}).text
    t["engram_num_embeddings"] = [int(engram_primes(probe)[0].sum())]
    return ModelConfig.from_dict(d)


def timeit(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--tokens", default="1,64,512")
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engram.md"))
    a = ap.parse_args()
    tokens = [int(x) for x in a.tokens.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cfg = bench_cfg(a.rows)
        rows = cfg.text.engram_num_embeddings[0]
        write_table(d, rows)
        g = torch.Generator().manual_seed(0)
        print(f"table: {rows:,} rows x 264 B = {rows * 264 / 1e6:.0f} MB")
        head = "| tokens | rows/lookup | threads | cold (ms) | cold rows/s | warm (ms) | prefetched (ms) |"
        lines += [head, "|---|---|---|---|---|---|---|"]
        print(head)
        for th in threads:
            for n in tokens:
                ids = [torch.randint(0, rows, (n, 24), generator=g) for _ in range(6)]
                with EngramStore(d, cfg, cache_bytes=0, threads=th) as cold:
                    it = iter(ids * 100)
                    t_cold = timeit(lambda: cold.lookup(1, next(it)), 5)
                with EngramStore(d, cfg, cache_bytes=1 << 30, threads=th) as warm:
                    warm.lookup(1, ids[0])
                    t_warm = timeit(lambda: warm.lookup(1, ids[0]), 5)
                    times = []
                    for b in ids[1:]:
                        warm.prefetch(1, b).result()
                        t0 = time.perf_counter()
                        warm.lookup(1, b)
                        times.append(time.perf_counter() - t0)
                    t_pre = sum(times) / len(times)
                row = (f"| {n} | {n * 24} | {th} | {t_cold * 1e3:.2f} | {n * 24 / t_cold:,.0f} | {t_warm * 1e3:.2f} | "
                       f"{t_pre * 1e3:.2f} |")
                lines.append(row)
                print(row)
        tm = load_token_map(ROOT / "kit" / "engram_token_map_v41.npy")
        hasher = EngramHasher(ModelConfig.from_dict(release_config_dict()), tm)
        lines += ["", "| hasher positions | ms | positions/s |", "|---|---|---|"]
        for n in (1, 512, 8192):
            ids = torch.randint(0, 129280, (n,), generator=g)
            t_h = timeit(lambda: hasher.hash_ids(ids), 5)
            row = f"| {n} | {t_h * 1e3:.3f} | {n / t_h:,.0f} |"
            lines.append(row)
            print(row)
    cmd = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, " \
              f"torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.1f}"
    text = "\n".join([
        "# Engram hashing and table-row reads", "", f"Command: `{cmd}`", "", f"Machine: {machine}", "",
        f"Table: {rows:,} rows of 256 E4M3 + 8 E8M0 bytes in one release-layout shard (page cache warm: this is "
        "the map gather + dequant path, not the disk). Lookups are 24 rows per token (3 n-gram sizes x 8 heads), one "
        "Engram layer; cold = no store cache; warm = the same rows again; prefetched = lookup after prefetch() "
        "finished.", "", *lines, ""])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
