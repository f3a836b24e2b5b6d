"""EngramStore: rows read by offset from real-format shard files equal the tables loaded whole."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41.config import ModelConfig
from dsv41.model import quant as Q
from dsv41.model.engram_store import EngramStore, read_safetensors_header
from dsv41.model.weights import WeightError, read_weight_map


def _whole(ckpt: Path, layer: int) -> torch.Tensor:
    wm = read_weight_map(ckpt)
    w, s = f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"
    with safe_open(ckpt / wm[w], "pt") as f:
        return Q.dequant_fp8_rows(f.get_tensor(w), f.get_tensor(s))


@pytest.fixture(scope="module")
def tiny_a(shared):
    d = shared / "vectors" / "model" / "tiny-a" / "checkpoint"
    return d, ModelConfig.from_checkpoint(d)


def test_tiny_a_rows_equal_whole_tables(tiny_a):
    d, cfg = tiny_a
    g = torch.Generator().manual_seed(0)
    with EngramStore(d, cfg) as st:
        for layer, rows in zip(cfg.text.engram_layer_ids, cfg.text.engram_num_embeddings):
            whole = _whole(d, layer)
            ids = torch.randint(0, rows, (7, 12), generator=g)
            ids[0, 0], ids[0, 1], ids[1, 0] = 0, rows - 1, ids[2, 3]  # ends of the table and a duplicate
            got = st.lookup(layer, ids)
            assert got.shape == (7, 12, 64) and got.dtype == torch.float32
            assert torch.equal(got, whole[ids])
        with pytest.raises(WeightError):
            st.lookup(1, torch.tensor([cfg.text.engram_num_embeddings[0]]))
        with pytest.raises(WeightError):
            st.lookup(0, torch.tensor([0]))


def _write_release_like(dir: Path, rows=(7592, 8546), dim=256, hidden=64, seed=3) -> ModelConfig:
    """Two Engram shard files laid out like the release's model-00047/48 (the 6 tensors of one layer each), plus
    an index; the config is tiny-a's shape with these table sizes."""
    g = torch.Generator().manual_seed(seed)
    wm = {}
    for i, (layer, n) in enumerate(zip((1, 4), rows)):
        tab = torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 3
        q, s = Q.quant_fp8_rows(tab)
        wkv_q, wkv_s = Q.quant_fp8(torch.randn(5 * hidden, 3 * 4 * dim, generator=g) * 0.02)
        t = {f"layers.{layer}.engram.embed.weight": q, f"layers.{layer}.engram.embed.scale": s,
             f"layers.{layer}.engram.wkv.weight": wkv_q, f"layers.{layer}.engram.wkv.scale": wkv_s,
             f"layers.{layer}.engram.q_weight": torch.ones(4, hidden, dtype=torch.bfloat16),
             f"layers.{layer}.engram.k_weight": torch.ones(4, hidden, dtype=torch.bfloat16)}
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(t, str(dir / fname), metadata={"format": "pt"})
        wm.update({k: fname for k in t})
    (dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return rows


def _cfg_with(tiny_cfg: ModelConfig, rows, dim) -> ModelConfig:
    d = tiny_cfg.to_dict()
    d["text_config"]["engram_num_embeddings"] = list(rows)
    d["text_config"]["engram_head_dim"] = dim
    return ModelConfig.from_dict(d)


def test_release_layout_rows_prefetch_and_cache(tiny_a, tmp_path):
    _, tiny_cfg = tiny_a
    rows = _write_release_like(tmp_path)
    cfg = _cfg_with(tiny_cfg, rows, 256)
    hdr, base = read_safetensors_header(tmp_path / "model-00001-of-00002.safetensors")
    assert base % 8 == 0 and "layers.1.engram.embed.weight" in hdr
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, rows[0], (5, 24), generator=g) for _ in range(4)]
    whole = _whole(tmp_path, 1)
    # read-ahead off (no cache) vs on: same rows, equal to the whole table
    with EngramStore(tmp_path, cfg, cache_bytes=0, threads=1) as off, \
            EngramStore(tmp_path, cfg, cache_bytes=1 << 20, threads=4) as on:
        for b in batches:
            on.prefetch(1, b).result()
            reads = on.reads
            a, c = off.lookup(1, b), on.lookup(1, b)
            assert on.reads == reads  # every row came from the read-ahead
            assert torch.equal(a, whole[b]) and torch.equal(c, whole[b])
        assert off.cached_rows() == 0 and off.prefetch(1, batches[0]).result() == 0
        # bf16 output is the same values
    with EngramStore(tmp_path, cfg, dtype=torch.bfloat16, cache_bytes=50 * 264, threads=2) as small:
        for b in batches:
            assert torch.equal(small.lookup(1, b).float(), whole[b])
            assert small.cached_rows() <= 50
        assert torch.equal(small.lookup(4, batches[0] % rows[1]).float(), _whole(tmp_path, 4)[batches[0] % rows[1]])


def test_store_header_errors(tiny_a, tmp_path):
    _, tiny_cfg = tiny_a
    rows = _write_release_like(tmp_path)
    bad = _cfg_with(tiny_cfg, (rows[0] + 1, rows[1]), 256)
    with pytest.raises(WeightError, match="layers.1.engram.embed.weight: shape"):
        EngramStore(tmp_path, bad)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["layers.4.engram.embed.scale"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(WeightError, match="layers.4.engram.embed.scale: missing"):
        EngramStore(tmp_path, _cfg_with(tiny_cfg, rows, 256))


def test_prefetch_racing_lookups(tiny_a):
    """Read-ahead running while lookups of overlapping rows happen: every lookup still returns the file's rows."""
    d, cfg = tiny_a
    whole = _whole(d, 4)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, cfg.text.engram_num_embeddings[1], (16, 12), generator=g) for _ in range(8)]
    with EngramStore(d, cfg, cache_bytes=300 * 66, threads=3) as st:
        futures = [st.prefetch(4, b) for b in batches]
        for b in reversed(batches):
            assert torch.equal(st.lookup(4, b), whole[b])
        for f in futures:
            f.result()
        assert st.cached_rows() <= 300


def test_truncated_table_file_is_refused_at_open(tiny_a, tmp_path):
    """The tables are mapped: a shard that ends before its table does is a WeightError when the store opens (not a
    bus error at the first row past its end)."""
    _, tiny_cfg = tiny_a
    rows = _write_release_like(tmp_path)
    cfg = _cfg_with(tiny_cfg, rows, 256)
    shard = tmp_path / read_weight_map(tmp_path)["layers.4.engram.embed.weight"]
    with EngramStore(tmp_path, cfg) as st:          # whole: opens
        assert st.lookup(4, torch.tensor([rows[1] - 1])).shape == (1, 256)
    header, base = read_safetensors_header(shard)
    a, b = header["layers.4.engram.embed.weight"]["data_offsets"]
    shard.write_bytes(shard.read_bytes()[:base + (a + b) // 2])       # the file ends inside the table
    with pytest.raises(WeightError, match="truncated"):
        EngramStore(tmp_path, cfg)
