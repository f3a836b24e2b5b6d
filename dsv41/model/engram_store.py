"""Engram table rows read by position from the checkpoint's safetensors files, without loading the tables.

The release's two tables are ~100 GB each (model-00047/48: `layers.{1,14}.engram.embed.weight` F8_E4M3
[rows, 256] + `.scale` F8_E8M0 [rows, 8]); a forward needs 24 rows per token per Engram layer. So:

- the safetensors header of each file is parsed once for the two tensors' data offsets (8-byte little-endian
  header length, JSON header, data_offsets relative to the end of the header);
- each table is mapped (np.memmap of its rows and of its scales): a batch of rows is two numpy gathers, the pages
  that hold them faulted in by the OS (numpy copies without the GIL, so the pool's threads fault in parallel);
- raw row bytes live in a bounded host-memory LRU cache (`cache_bytes`: one slab, a dict from row to slot, a use
  stamp per slot), dequantised on the way out;
- `prefetch(layer, ids)` reads missing rows into the cache in the background; `read_ahead(make_hash_ids)` hashes
  on a planner thread and prefetches every layer (the scheduler gives it the next prompt chunk while the current
  one computes, the runner every sequence's next decode row after sampling, all at once); a lookup waits for rows
  already in flight instead of reading them twice.

The tables may sit in another folder than the rest of the weights (`--engram DIR`, e.g. beside EXL3 weights that
lack them): that folder's index is used when it lists them, otherwise the headers of its `*.safetensors` files are
searched. Missing tables raise `EngramMissing` (the server then refuses to start unless `--no-engram`).

Why a map and not a read per row (session 15; it was two `os.pread`s a row, each with a dict entry and a bytes
object in the cache): a 32-row decode round looks up ~770 rows of each Engram layer (24 a token), and the
per-row Python cost (~4 us a row) was milliseconds of host time before the round could launch. A row is 264 bytes, far below O_DIRECT's
4 KiB alignment, so the page cache serves either way; the maps gather a batch in one call.

Rows are bytes from the file either way, so cache, prefetch and thread count never change a value.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
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
_FREE = np.iinfo(np.int64).max          # a free slot's use stamp: never the least recently used


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
    """One layer's table: its rows and scales mapped from their files (np.memmap: nothing is read until a row is
    gathered, then only the pages holding it)."""

    def __init__(self, name: str, w_path: Path, s_path: Path, rows: int, dim: int, w_off: int, s_off: int):
        self.name, self.rows, self.dim, self.sdim = name, rows, dim, dim // 32
        for path, off, width in ((w_path, w_off, dim), (s_path, s_off, self.sdim)):
            if os.path.getsize(path) < off + rows * width:
                raise WeightError(name, f"{Path(path).name} ends before the table does (truncated file?)")
        self.w = np.memmap(w_path, dtype=np.uint8, mode="r", offset=w_off, shape=(rows, dim))
        self.s = np.memmap(s_path, dtype=np.uint8, mode="r", offset=s_off, shape=(rows, self.sdim))

    def close(self):
        self.w = self.s = None          # the maps close with their last reference

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows [n, dim + dim/32] uint8: E4M3 bytes then E8M0 scales, gathered in two numpy ops (numpy drops the
        GIL while it copies, so the pool's threads fault pages in at once)."""
        out = np.empty((len(rows), self.dim + self.sdim), dtype=np.uint8)
        out[:, :self.dim] = self.w[rows]
        out[:, self.dim:] = self.s[rows]
        return out


class EngramStore:
    """Rows of every Engram layer's table. `lookup(layer_id, ids)` -> dequantised rows [*ids.shape, head_dim].

    The cache is one preallocated slab of `cache_bytes` of raw rows with a dict from (row, layer) key to slot and a
    use stamp per slot: a lookup is a few numpy ops and one dict probe per distinct row (a decode round of 32 rows
    asks ~770 rows of each Engram layer), and the least recently used rows go in batches of 1/16 of the slab."""

    def __init__(self, tables_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 cache_bytes: int = 256 << 20, threads: int = 8):
        t = cfg.text
        self.dtype = dtype
        self.dim = t.engram_head_dim
        self.row_bytes = self.dim + self.dim // 32
        self.cache_rows = max(0, cache_bytes // self.row_bytes)
        self._slot: dict[int, int] = {}                              # key -> slab slot
        self._slab = np.empty((self.cache_rows, self.row_bytes), dtype=np.uint8)   # pages touched as filled
        self._keys = np.full(self.cache_rows, -1, dtype=np.int64)     # slot -> key (-1: free)
        self._stamp = np.full(self.cache_rows, _FREE, dtype=np.int64)
        self._free = list(range(self.cache_rows - 1, -1, -1))         # free slots, popped from the end
        self._tick = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="engram-read")
        self._threads = max(1, threads)
        self.reads = 0  # rows read from the files (for tests and metrics)
        self.tables: dict[int, _Table] = {}
        self.layers = tuple(t.engram_layer_ids)
        self._inflight: dict[int, Future] = {}                       # key -> the prefetch part reading it
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
                w_off = self._locate(headers[wm[wname]], wname, "F8_E4M3", [rows, self.dim])
                s_off = self._locate(headers[wm[sname]], sname, "F8_E8M0", [rows, self.dim // 32])
                self.tables[layer] = _Table(wname, d / wm[wname], d / wm[sname], rows, self.dim, w_off, s_off)
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

    def _keys_of(self, layer: int, rows: np.ndarray) -> np.ndarray:
        return rows * len(self.layers) + self.layers.index(layer)

    def _read(self, tab: _Table, rows: np.ndarray) -> np.ndarray:
        """Rows from the files, split over the pool's threads when there are many."""
        n = len(rows)
        if n < 256 or self._threads == 1:
            got = tab.read_rows(rows)
        else:
            step = -(-n // self._threads)
            got = np.concatenate(list(self._pool.map(tab.read_rows, [rows[i:i + step] for i in range(0, n, step)])))
        with self._lock:
            self.reads += n
        return got

    def _insert(self, keys: np.ndarray, data: np.ndarray) -> None:
        """Raw rows into the slab (caller holds the lock); the least recently used go first when it is full."""
        if not self.cache_rows or not len(keys):
            return
        fresh = np.fromiter((k not in self._slot for k in keys.tolist()), dtype=bool, count=len(keys))
        keys, data = keys[fresh][-self.cache_rows:], data[fresh][-self.cache_rows:]
        n = len(keys)
        if n > len(self._free):
            need = min(max(n - len(self._free), self.cache_rows // 16), self.cache_rows - len(self._free))
            old = np.argpartition(self._stamp, need - 1)[:need]       # free slots' stamps sort last
            for k in self._keys[old].tolist():
                del self._slot[k]
            self._keys[old] = -1
            self._stamp[old] = _FREE
            self._free += old.tolist()
        slots = np.array(self._free[len(self._free) - n:][::-1], dtype=np.int64)
        del self._free[len(self._free) - n:]
        self._slab[slots] = data
        self._keys[slots] = keys
        self._tick += 1
        self._stamp[slots] = self._tick
        self._slot.update(zip(keys.tolist(), slots.tolist()))

    def _cached(self, keys: np.ndarray) -> np.ndarray:
        """Each key's slot or -1, and a use stamp on the hits (caller holds the lock)."""
        get = self._slot.get
        slots = np.fromiter((get(k, -1) for k in keys.tolist()), dtype=np.int64, count=len(keys))
        hit = slots[slots >= 0]
        if len(hit):
            self._tick += 1
            self._stamp[hit] = self._tick
        return slots

    def _unique_rows(self, tab: _Table, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        flat = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)  # ids: any device
        if flat.size and (flat.min() < 0 or flat.max() >= tab.rows):
            raise WeightError(tab.name, f"row id outside 0..{tab.rows - 1}")
        return np.unique(flat, return_inverse=True)

    def lookup(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, int) of layer's table, dequantised: [*ids.shape, head_dim] in self.dtype."""
        tab = self._table(layer)
        uniq, inv = self._unique_rows(tab, ids)
        keys = self._keys_of(layer, uniq)
        buf = np.empty((len(uniq), self.row_bytes), dtype=np.uint8)
        with self._lock:
            slots = self._cached(keys)
            hit = slots >= 0
            buf[hit] = self._slab[slots[hit]]
            waits = {}
            for i in np.flatnonzero(~hit).tolist():
                f = self._inflight.get(int(keys[i]))
                if f is not None:
                    waits.setdefault(f, []).append(i)
        for f, idx in waits.items():      # being read ahead: wait, then take them from the slab (or read them)
            f.result()
            idx = np.asarray(idx)
            with self._lock:              # slots looked up and copied in one hold: an insert may evict them after
                got = self._cached(keys[idx])
                ok = got >= 0
                buf[idx[ok]] = self._slab[got[ok]]
            hit[idx[ok]] = True
        miss = np.flatnonzero(~hit)
        if len(miss):
            data = self._read(tab, uniq[miss])
            buf[miss] = data
            with self._lock:
                self._insert(keys[miss], data)
        raw = torch.from_numpy(buf)
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
        keys = self._keys_of(layer, uniq)
        with self._lock:
            get, fly = self._slot.get, self._inflight
            want = np.fromiter(((get(k) is None and k not in fly) for k in keys.tolist()), dtype=bool,
                               count=len(keys))
            rows, keys = uniq[want], keys[want]
            step = max(1, -(-len(rows) // self._threads))
            parts = []
            for i in range(0, len(rows), step):
                fut = Future()
                fly.update(dict.fromkeys(keys[i:i + step].tolist(), fut))
                parts.append((rows[i:i + step], keys[i:i + step], fut))
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
                    done.set_result(sum(len(r) for r, _, _ in parts))

        for rows_, keys_, fut in parts:
            fut.add_done_callback(part_done)
            self._pool.submit(self._read_part, tab, rows_, keys_, fut)
        return done

    def _read_part(self, tab: _Table, rows: np.ndarray, keys: np.ndarray, fut: Future) -> None:
        # inside a pool worker: read in this thread (fanning out again from a worker could starve the pool)
        err = None
        try:
            data = tab.read_rows(rows)
            with self._lock:
                self.reads += len(rows)
                self._insert(keys, data)
        except BaseException as e:  # noqa: BLE001 - a waiting lookup re-raises it
            err = e
        with self._lock:
            for k in keys.tolist():
                self._inflight.pop(k, None)
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(len(rows))

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
            return len(self._slot)

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
