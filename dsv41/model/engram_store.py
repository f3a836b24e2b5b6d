"""Engram table rows read by position from the checkpoint's safetensors files, without loading the tables.

The release's two tables are ~100 GB each (model-00047/48: `layers.{1,14}.engram.embed.weight` F8_E4M3
[rows, 256] + `.scale` F8_E8M0 [rows, 8]); a forward needs 24 rows per token per Engram layer. So:

- the safetensors header of each file is parsed once for the two tensors' data offsets (8-byte little-endian
  header length, JSON header, data_offsets relative to the end of the header);
- a row is two `os.pread`s (head_dim bytes of E4M3, head_dim/32 bytes of E8M0), issued from a thread pool;
- raw row bytes live in a bounded host-memory LRU cache (`cache_bytes`), dequantised on the way out;
- `prefetch(layer, ids)` reads missing rows into the cache in the background; `read_ahead(make_hash_ids)` hashes
  on a planner thread and prefetches every layer (the scheduler gives it the next prompt chunk while the current
  one computes, the runner the next decode row after sampling, the forward both layers' rows of its own call);
  a lookup waits for rows already in flight instead of reading them twice.

The tables may sit in another folder than the rest of the weights (`--engram DIR`, e.g. beside EXL3 weights that
lack them): that folder's index is used when it lists them, otherwise the headers of its `*.safetensors` files are
searched. Missing tables raise `EngramMissing` (the server then refuses to start unless `--no-engram`).

Why plain `os.pread` from a thread pool and not O_DIRECT / io_uring: a row is 264 bytes, far below O_DIRECT's
4 KiB alignment (each row would cost a 4-8 KiB aligned read and a bounce copy), and no io_uring binding for Python is
both well kept and installable here; the page cache plus preads issued from several threads already keep many
requests in flight on NVMe, and the rows of the next chunk are read while the current one computes.

Rows are bytes from the file either way, so cache, prefetch and thread count never change a value.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dsv41.config import ModelConfig
from dsv41.model import quant
from dsv41.model.weights import WeightError, read_weight_map

log = logging.getLogger("dsv41.engram")

_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1}


class EngramMissing(WeightError):
    """The Engram tables are not where they were looked for."""


def table_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"


def find_tables(d: Path, names: list[str]) -> dict[str, str]:
    """name -> file name (in d) for each of `names`: from d's index when it lists any of them (then it must list
    all), else from the headers of d's *.safetensors files. Missing ones raise EngramMissing naming the first."""
    try:
        wm = read_weight_map(d)
    except WeightError:
        wm = {}
    if any(n in wm for n in names):
        for n in names:
            if n not in wm:
                raise EngramMissing(n, f"missing from the weight_map of {d}")
            if not (d / wm[n]).is_file():
                raise EngramMissing(n, f"its shard {wm[n]} is not in {d}")
        return {n: wm[n] for n in names}
    found: dict[str, str] = {}
    for f in sorted(d.glob("*.safetensors")):
        try:
            header, _ = read_safetensors_header(f)
        except (WeightError, OSError, ValueError):
            continue
        for n in names:
            if n in header and n not in found:
                found[n] = f.name
    for n in names:
        if n not in found:
            raise EngramMissing(n, f"not found in {d} (no index lists it and no *.safetensors file there holds it)")
    return found


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

    def __init__(self, tables_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
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
        self.layers = tuple(t.engram_layer_ids)
        self._inflight: dict[tuple[int, int], tuple[Future, dict]] = {}
        self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-ahead")
        d = Path(tables_dir)
        if not d.is_dir():
            raise EngramMissing(str(d), "the Engram tables folder does not exist")
        wm = find_tables(d, [n for layer in self.layers for n in table_names(layer)])
        headers: dict[str, tuple[dict, int]] = {}
        try:
            for layer, rows in zip(t.engram_layer_ids, t.engram_num_embeddings):
                wname, sname = table_names(layer)
                for n in (wname, sname):
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
        flat = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)  # or GPU
        if flat.size and (flat.min() < 0 or flat.max() >= tab.rows):
            raise WeightError(tab.name, f"row id outside 0..{tab.rows - 1}")
        return np.unique(flat, return_inverse=True)

    def lookup(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, int) of layer's table, dequantised: [*ids.shape, head_dim] in self.dtype."""
        tab = self._table(layer)
        uniq, inv = self._unique_rows(tab, ids)
        have: dict[int, bytes] = {}
        waits: dict[int, tuple[Future, dict]] = {}
        with self._lock:
            for r in uniq.tolist():
                b = self._cache.get((layer, r))
                if b is not None:
                    self._cache.move_to_end((layer, r))
                    have[r] = b
                elif (layer, r) in self._inflight:
                    waits[r] = self._inflight[(layer, r)]
        missing = [r for r in uniq.tolist() if r not in have and r not in waits]
        have.update(self._read_many(tab, layer, missing))
        for r, (fut, got) in waits.items():   # being read ahead: take the bytes that read brings
            fut.result()
            have[r] = got[r]
        buf = np.frombuffer(b"".join(have[r] for r in uniq.tolist()), dtype=np.uint8).reshape(len(uniq),
                                                                                          self.row_bytes)
        raw = torch.from_numpy(buf.copy())
        w = raw[:, : self.dim].view(torch.float8_e4m3fn)
        s = raw[:, self.dim:].view(torch.float8_e8m0fnu)
        rows = quant.dequant_fp8_rows(w, s, self.dtype)
        return rows[torch.from_numpy(inv.reshape(-1))].reshape(*np.shape(ids) if not isinstance(ids, torch.Tensor)
                                                               else ids.shape, self.dim)

    def prefetch(self, layer: int, ids: torch.Tensor) -> Future:
        """Read the rows neither cached nor already in flight into the cache, in the background (split over the
        pool's threads). Returns a Future whose result is the number of rows read. A no-op when the cache is
        disabled (cache_bytes=0)."""
        tab = self._table(layer)
        uniq, _ = self._unique_rows(tab, ids)
        done: Future = Future()
        if not self.cache_rows:
            done.set_result(0)
            return done
        with self._lock:
            missing = [r for r in uniq.tolist() if (layer, r) not in self._cache and (layer, r) not in self._inflight]
            step = max(1, -(-len(missing) // self._threads))
            parts = []
            for i in range(0, len(missing), step):
                rows, got, fut = missing[i:i + step], {}, Future()
                for r in rows:
                    self._inflight[(layer, r)] = (fut, got)
                parts.append((rows, got, fut))
        if not parts:
            done.set_result(0)
            return done
        left = [len(parts)]

        def part_done(_):
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                errs = [f.exception() for _, _, f in parts if f.exception() is not None]
                if errs:
                    done.set_exception(errs[0])
                else:
                    done.set_result(sum(len(g) for _, g, _ in parts))

        for rows, got, fut in parts:
            fut.add_done_callback(part_done)
            self._pool.submit(self._read_part, tab, layer, rows, got, fut)
        return done

    def _read_part(self, tab: _Table, layer: int, rows: list[int], got: dict, fut: Future) -> None:
        # inside a pool worker: read in this thread (fanning out again from a worker could starve the pool)
        try:
            for r in rows:
                got[r] = tab.read(r)
            self._insert(layer, got)
        except BaseException as e:  # noqa: BLE001 - a waiting lookup re-raises it
            with self._lock:
                for r in rows:
                    self._inflight.pop((layer, r), None)
            fut.set_exception(e)
            return
        with self._lock:
            for r in rows:
                self._inflight.pop((layer, r), None)
        fut.set_result(len(got))

    def prefetch_hashes(self, hash_ids: torch.Tensor) -> list[Future]:
        """prefetch() of every Engram layer's rows: hash_ids [n, n_layers, cols] as EngramHasher gives them."""
        return [self.prefetch(layer, hash_ids[:, i]) for i, layer in enumerate(self.layers)]

    def read_ahead(self, make_hash_ids: Callable[[], torch.Tensor]) -> Future:
        """Hash on the planner thread (off the caller's), then prefetch every layer's rows. The Future's result is
        the list of per-layer prefetch Futures. Errors are logged, never raised into the caller: a failed read-ahead
        only means the forward reads the rows itself."""
        def run():
            try:
                return self.prefetch_hashes(make_hash_ids()) if self.cache_rows else []
            except Exception:  # noqa: BLE001
                log.exception("Engram read-ahead failed (the forward reads the rows itself)")
                return []
        return self._planner.submit(run)

    def cached_rows(self) -> int:
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        self._planner.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        for tab in self.tables.values():
            tab.close()
        self.tables = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
