"""Engram table rows read by position from the checkpoint's safetensors files, without loading the tables.

The release's two tables are ~100 GB each (model-00047/48: `layers.{1,14}.engram.embed.weight` F8_E4M3
[rows, 256] + `.scale` F8_E8M0 [rows, 8]); a forward needs 24 rows per token per Engram layer. So:

- the safetensors header of each file is parsed once for the two tensors' data offsets (8-byte little-endian
  header length, JSON header, data_offsets relative to the end of the header);
- a row is two `os.pread`s (head_dim bytes of E4M3, head_dim/32 bytes of E8M0), issued from a thread pool;
- raw row bytes live in a bounded host-memory LRU cache (`cache_bytes`), dequantised on the way out;
- `prefetch(layer, ids)` reads missing rows into the cache in the background (the scheduler calls it with the
  next chunk's hash ids while the current one computes).

Rows are bytes from the file either way, so cache, prefetch and thread count never change a value.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dsv41.config import ModelConfig
from dsv41.model import quant
from dsv41.model.weights import WeightError, read_weight_map

_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1}


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """(header dict without __metadata__, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightError(str(path), "not a safetensors file (short header)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise WeightError(str(path), f"implausible safetensors header length {n}")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class _Table:
    """One layer's table: where its rows and scales sit in which file."""

    def __init__(self, name: str, w_path: Path, s_path: Path, rows: int, dim: int):
        self.name, self.rows, self.dim, self.sdim = name, rows, dim, dim // 32
        self.w_fd = os.open(w_path, os.O_RDONLY)
        self.s_fd = self.w_fd if s_path == w_path else os.open(s_path, os.O_RDONLY)
        self.w_off = self.s_off = 0

    def close(self):
        os.close(self.w_fd)
        if self.s_fd != self.w_fd:
            os.close(self.s_fd)

    def read(self, r: int) -> bytes:
        w = os.pread(self.w_fd, self.dim, self.w_off + r * self.dim)
        s = os.pread(self.s_fd, self.sdim, self.s_off + r * self.sdim)
        if len(w) != self.dim or len(s) != self.sdim:
            raise WeightError(self.name, f"short read at row {r} (truncated file?)")
        return w + s


class EngramStore:
    """Rows of every Engram layer's table. `lookup(layer_id, ids)` -> dequantised rows [*ids.shape, head_dim]."""

    def __init__(self, ckpt: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 cache_bytes: int = 256 << 20, threads: int = 8):
        t = cfg.text
        self.dtype = dtype
        self.dim = t.engram_head_dim
        self.row_bytes = self.dim + self.dim // 32
        self.cache_rows = max(0, cache_bytes // self.row_bytes)
        self._cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="engram-read")
        self._threads = max(1, threads)
        self.reads = 0  # rows read from disk (for tests and metrics)
        self.tables: dict[int, _Table] = {}
        d = Path(ckpt)
        wm = read_weight_map(d)
        headers: dict[str, tuple[dict, int]] = {}
        try:
            for layer, rows in zip(t.engram_layer_ids, t.engram_num_embeddings):
                wname, sname = f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"
                for n in (wname, sname):
                    if n not in wm:
                        raise WeightError(n, "missing from the checkpoint's weight_map")
                    if wm[n] not in headers:
                        headers[wm[n]] = read_safetensors_header(d / wm[n])
                tab = _Table(wname, d / wm[wname], d / wm[sname], rows, self.dim)
                self.tables[layer] = tab
                tab.w_off = self._locate(headers[wm[wname]], wname, "F8_E4M3", [rows, self.dim])
                tab.s_off = self._locate(headers[wm[sname]], sname, "F8_E8M0", [rows, self.dim // 32])
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _locate(hdr: tuple[dict, int], name: str, dtype: str, shape: list[int]) -> int:
        header, base = hdr
        if name not in header:
            raise WeightError(name, "listed in the index but not in its file")
        e = header[name]
        if e["dtype"] != dtype:
            raise WeightError(name, f"dtype {e['dtype']}, expected {dtype}")
        if list(e["shape"]) != shape:
            raise WeightError(name, f"shape {e['shape']}, expected {shape}")
        a, b = e["data_offsets"]
        if b - a != shape[0] * shape[1] * _DTYPE_BYTES[dtype]:
            raise WeightError(name, f"data_offsets span {b - a} bytes, expected {shape[0] * shape[1]}")
        return base + a

    # ----------------------------------------------------------------------------------------------------

    def _table(self, layer: int) -> _Table:
        try:
            return self.tables[layer]
        except KeyError:
            raise WeightError(f"layers.{layer}.engram.embed.weight", "not an Engram layer") from None

    def _read_many(self, tab: _Table, layer: int, rows: list[int]) -> dict[int, bytes]:
        if not rows:
            return {}
        n = len(rows)
        step = max(1, -(-n // self._threads))
        chunks = [rows[i:i + step] for i in range(0, n, step)]
        if len(chunks) == 1:
            results = [[tab.read(r) for r in chunks[0]]]
        else:
            results = list(self._pool.map(lambda c: [tab.read(r) for r in c], chunks))
        got = {r: b for c, res in zip(chunks, results) for r, b in zip(c, res)}
        self._insert(layer, got)
        return got

    def _insert(self, layer: int, got: dict[int, bytes]) -> None:
        with self._lock:
            self.reads += len(got)
            if not self.cache_rows:
                return
            for r, b in got.items():
                self._cache[(layer, r)] = b
                self._cache.move_to_end((layer, r))
            while len(self._cache) > self.cache_rows:
                self._cache.popitem(last=False)

    def _unique_rows(self, tab: _Table, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        flat = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= tab.rows):
            raise WeightError(tab.name, f"row id outside 0..{tab.rows - 1}")
        return np.unique(flat, return_inverse=True)

    def lookup(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, int) of layer's table, dequantised: [*ids.shape, head_dim] in self.dtype."""
        tab = self._table(layer)
        uniq, inv = self._unique_rows(tab, ids)
        have: dict[int, bytes] = {}
        with self._lock:
            for r in uniq.tolist():
                b = self._cache.get((layer, r))
                if b is not None:
                    self._cache.move_to_end((layer, r))
                    have[r] = b
        missing = [r for r in uniq.tolist() if r not in have]
        have.update(self._read_many(tab, layer, missing))
        buf = np.frombuffer(b"".join(have[r] for r in uniq.tolist()), dtype=np.uint8).reshape(len(uniq),
                                                                                          self.row_bytes)
        raw = torch.from_numpy(buf.copy())
        w = raw[:, : self.dim].view(torch.float8_e4m3fn)
        s = raw[:, self.dim:].view(torch.float8_e8m0fnu)
        rows = quant.dequant_fp8_rows(w, s, self.dtype)
        return rows[torch.from_numpy(inv.reshape(-1))].reshape(*torch.as_tensor(ids).shape, self.dim)

    def prefetch(self, layer: int, ids: torch.Tensor) -> Future:
        """Read the rows not yet cached into the cache, in the background. Returns the Future (result: rows read).
        A no-op when the cache is disabled (cache_bytes=0)."""
        tab = self._table(layer)
        uniq, _ = self._unique_rows(tab, ids)
        with self._lock:
            missing = [r for r in uniq.tolist() if (layer, r) not in self._cache]
        if not self.cache_rows or not missing:
            f: Future = Future()
            f.set_result(0)
            return f
        return self._pool.submit(lambda: len(self._read_many_serial(tab, layer, missing)))

    def _read_many_serial(self, tab: _Table, layer: int, rows: list[int]) -> dict[int, bytes]:
        # inside a pool worker: read in this thread (fanning out again from a worker could starve the pool)
        got = {r: tab.read(r) for r in rows}
        self._insert(layer, got)
        return got

    def cached_rows(self) -> int:
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for tab in self.tables.values():
            tab.close()
        self.tables = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
