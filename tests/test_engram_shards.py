"""Engram tables in their own real-format shard files (`--engram DIR`, as the release's model-00047/48 can sit beside
weights that lack them): rows read by offset == rows loaded whole, and the logits do not depend on where the tables
sit, on the row cache or on read-ahead; without the tables the model refuses unless told to run degraded."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv41 import REPO_ROOT
from dsv41.config import ModelConfig
from dsv41.model import quant as Q
from dsv41.model.engram_store import EngramMissing, EngramStore, read_safetensors_header
from dsv41.model.model import Model, SeqInput

ARGS = ["--vocab", "512", "--layers", "7", "--hidden", "64", "--seed", "3"]


def _make(out: Path, *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "dsv41.tools.make_tiny", "--out", str(out), *ARGS, *extra], cwd=REPO_ROOT,
                   check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The same tiny checkpoint twice: tables inline (in its index), and tables split off into their own folder."""
    root = tmp_path_factory.mktemp("engram")
    _make(root / "inline")
    _make(root / "split", "--engram-out", str(root / "tables"))
    return root / "inline", root / "split", root / "tables"


def _prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g)


def _whole(path: Path, name: str) -> torch.Tensor:
    with safe_open(path, "pt") as f:
        return f.get_tensor(name)


def test_split_folder_holds_only_the_tables_in_real_layout(ckpts):
    _, split, tables = ckpts
    cfg = ModelConfig.from_checkpoint(split)
    files = sorted(tables.glob("*.safetensors"))
    assert len(files) == len(cfg.text.engram_layer_ids) and not (tables / "model.safetensors.index.json").exists()
    for f, layer, rows in zip(files, cfg.text.engram_layer_ids, cfg.text.engram_num_embeddings):
        hdr, base = read_safetensors_header(f)
        assert set(hdr) == {f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"}
        w = hdr[f"layers.{layer}.engram.embed.weight"]
        assert w["dtype"] == "F8_E4M3" and w["shape"] == [rows, cfg.text.engram_head_dim]
        assert hdr[f"layers.{layer}.engram.embed.scale"]["dtype"] == "F8_E8M0" and base % 8 == 0
    idx = (split / "model.safetensors.index.json").read_text()
    assert ".engram.embed." not in idx and ".engram.wkv.weight" in idx


def test_rows_by_offset_equal_whole_tables(ckpts):
    _, split, tables = ckpts
    cfg = ModelConfig.from_checkpoint(split)
    g = torch.Generator().manual_seed(0)
    with EngramStore(tables, cfg, cache_bytes=4096, threads=3) as st:
        for f, layer, rows in zip(sorted(tables.glob("*.safetensors")), cfg.text.engram_layer_ids,
                                  cfg.text.engram_num_embeddings):
            whole = Q.dequant_fp8_rows(_whole(f, f"layers.{layer}.engram.embed.weight"),
                                       _whole(f, f"layers.{layer}.engram.embed.scale"))
            ids = torch.randint(0, rows, (9, 8), generator=g)
            ids[0, 0], ids[0, 1] = 0, rows - 1
            st.prefetch(layer, ids[:4])          # some rows in flight or cached, the rest read by the lookup
            assert torch.equal(st.lookup(layer, ids), whole[ids])


def _logits(model: Model, ids: torch.Tensor, chunks: list[int], ahead: bool) -> torch.Tensor:
    st = model.new_state()
    out, a = [], 0
    for n in chunks:
        if ahead and a + n < ids.numel():      # the next chunk's rows are read while this one runs
            model.engram_read_ahead(st.engram_history[-3:] if a else torch.zeros(0, dtype=torch.long), a,
                                    ids[a:a + n])
        out.append(model.forward([SeqInput(st, ids[a:a + n], "all")])[0])
        a += n
    return torch.cat(out)


def test_logits_same_wherever_the_tables_sit_and_with_read_ahead_on_or_off(ckpts):
    inline, split, tables = ckpts
    ids = _prompt(40, 1)
    ref = _logits(Model.load(inline, engram_cache_bytes=0), ids, [40], ahead=False)   # no cache, no read-ahead
    on = Model.load(split, engram=tables, engram_cache_bytes=1 << 20)
    got = _logits(on, ids, [16, 16, 8], ahead=True)
    assert torch.equal(got, ref)
    # a second pass over the same prompt: every row comes from the cache, nothing is read from disk
    reads = on.engram_store.reads
    assert torch.equal(_logits(on, ids, [40], ahead=False), ref) and on.engram_store.reads == reads
    # read-ahead alone brings a later chunk's rows: the forward then reads nothing itself
    fresh = Model.load(split, engram=tables, engram_cache_bytes=1 << 20)
    more = _prompt(24, 2)
    for f in fresh.engram_read_ahead(torch.zeros(0, dtype=torch.long), 0, more).result():
        f.result()
    n = fresh.engram_store.reads
    assert n > 0
    st = fresh.new_state()
    fresh.forward([SeqInput(st, more, "last")])
    assert fresh.engram_store.reads == n


def test_without_tables_refuses_unless_degraded(ckpts):
    inline, split, tables = ckpts
    with pytest.raises(EngramMissing, match="engram.embed.weight"):
        Model.load(split)                       # the split checkpoint alone lacks them
    with pytest.raises(EngramMissing, match="does not exist"):
        Model.load(split, engram=tables / "nope")
    degraded = Model.load(split, engram_tables=False)
    assert degraded.engram_store is None and all(b.engram is None for b in degraded.blocks)
    ids = _prompt(20, 4)
    got = degraded.forward([SeqInput(degraded.new_state(), ids, "all")])[0]
    # "without Engram" == every Engram row zero: wkv has no bias, so the value added to the streams is 0
    full = Model.load(inline, engram_cache_bytes=0)
    for b in full.blocks:
        if b.engram is not None:
            b.engram.rows = lambda h, d=full.t.engram_head_dim: torch.zeros(*h.shape, d)
    zero = full.forward([SeqInput(full.new_state(), ids, "all")])[0]
    assert torch.equal(got, zero)
    normal = Model.load(inline, engram_cache_bytes=0).forward([SeqInput(full.new_state(), ids, "all")])[0]
    assert not torch.equal(got, normal)          # the tables matter: degraded is not the same model


def test_server_start_refuses_without_tables_and_says_degraded(ckpts, capsys):
    from dsv41 import BUILTIN_TOKENIZER_DIR
    from dsv41.api.engine import StartError, load_engine
    from dsv41.serve_config import ServeConfig
    _, split, tables = ckpts
    base = {"model": str(split), "tokenizer": str(BUILTIN_TOKENIZER_DIR), "device": "cpu", "max_images": 0,
            "prompt_cache_gib": 0, "state_budget_gib": 0.5, "max_streams": 2}
    with pytest.raises(StartError, match="--engram DIR.*--no-engram"):
        load_engine(ServeConfig(**base))
    eng = load_engine(ServeConfig(**base, no_engram=True))
    assert "replies are degraded" in capsys.readouterr().out
    assert eng.sched.runner.model.engram_store is None
    eng = load_engine(ServeConfig(**base, engram=str(tables), engram_cache_mib=1))
    store = eng.sched.runner.model.engram_store
    assert store is not None and store.cache_rows == (1 << 20) // store.row_bytes
    assert "degraded" not in capsys.readouterr().out


def test_read_ahead_of_the_next_decode_rows_brings_every_row_they_look_up(ckpts):
    """engram_read_ahead_next (the runner's, after a round's draws): the rows of each sequence's next decode row,
    hashed for all sequences at once, are the rows that round then looks up: it reads nothing itself. Sequences
    of different lengths (one shorter than the n-gram) and a token repeated across them."""
    _, split, tables = ckpts
    m = Model.load(split, engram=tables, engram_cache_bytes=1 << 20)
    states = [m.new_state() for _ in range(3)]
    for st, n in zip(states, (2, 9, 17)):
        m.forward([SeqInput(st, _prompt(n, n), "last")])
    nxt = [5, 77, 5]
    for f in m.engram_read_ahead_next(list(zip(states, nxt))).result():
        f.result()
    n = m.engram_store.reads
    m.forward([SeqInput(st, torch.tensor([t]), "last") for st, t in zip(states, nxt)])
    assert m.engram_store.reads == n
    # a different token than the one read ahead: its rows are read by the round itself
    m.forward([SeqInput(states[0], torch.tensor([91]), "last")])
    assert m.engram_store.reads > n
