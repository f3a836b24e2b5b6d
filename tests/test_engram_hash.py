"""Engram hashing against tiny-a's oracle arrays, a scalar re-statement of arch.md §2.9, and the real tokenizer."""

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dsv41 import BUILTIN_TOKENIZER_DIR, REPO_ROOT
from dsv41.config import ModelConfig, release_config_dict
from dsv41.model.engram_hash import DEAD, EngramError, EngramHasher, build_token_map, engram_primes, main


@pytest.fixture(scope="module")
def tiny(shared):
    d = shared / "vectors" / "model" / "tiny-a"
    cfg = ModelConfig.from_checkpoint(d / "checkpoint")
    vec = safe_open(str(d / "vectors.safetensors"), "pt")
    return d, cfg, vec


@pytest.fixture(scope="module")
def tiny_hasher(tiny):
    d, cfg, _ = tiny
    return EngramHasher(cfg, build_token_map(d / "checkpoint" / "tokenizer.json"))


def test_tiny_a_tables(tiny, tiny_hasher):
    d, cfg, vec = tiny
    h = tiny_hasher
    assert torch.equal(h.token_map, vec.get_tensor("engram.token_map"))
    assert torch.equal(h.primes, vec.get_tensor("engram.primes"))
    assert torch.equal(h.offsets, vec.get_tensor("engram.offsets"))
    assert torch.equal(h.multipliers, vec.get_tensor("engram.multipliers"))
    assert h.pad_class == int(vec.get_tensor("engram.pad_compressed_id"))


def _prompt(vec, i):
    return torch.cat([vec.get_tensor(f"prompt.{i}.input_ids"), vec.get_tensor(f"prompt.{i}.decode_ids")])


def test_tiny_a_hash_ids_every_prompt(tiny, tiny_hasher):
    _, _, vec = tiny
    for i in range(7):
        assert torch.equal(tiny_hasher.hash_ids(_prompt(vec, i)), vec.get_tensor(f"prompt.{i}.hash_ids")), i


def _scalar_hash(h: EngramHasher, ids: list[int]) -> list:
    """arch.md §2.9 written out position by position in plain Python ints."""
    comp = [DEAD if t == DEAD else int(h.token_map[t]) for t in ids]
    out = []
    for p in range(len(ids)):
        toks, cut = [], False
        for s in range(h.ngram):
            if not cut and (p < s or comp[p - s] == DEAD):
                cut = True
            toks.append(h.pad_class if cut else comp[p - s])
        per_layer = []
        for li in range(h.primes.shape[0]):
            m = [int(x) for x in h.multipliers[li]]
            r = toks[0] * m[0]
            row = []
            for i in range(1, h.ngram):
                r ^= toks[i] * m[i]
                for hd in range(h.heads):
                    row.append(r % int(h.primes[li, i - 1, hd]) + int(h.offsets[li, (i - 1) * h.heads + hd]))
            per_layer.append(row)
        out.append(per_layer)
    return out


def test_dead_positions_and_scalar_restatement(tiny, tiny_hasher):
    _, _, vec = tiny
    ids = _prompt(vec, 4).clone()
    ids[5] = DEAD
    ids[9:12] = DEAD
    ids[-1] = DEAD
    got = tiny_hasher.hash_ids(ids)
    assert got.tolist() == _scalar_hash(tiny_hasher, ids.tolist())
    # the n-grams ending right after a DEAD equal those at a sequence start with the same current token
    fresh = tiny_hasher.hash_ids(ids[12:13])
    assert torch.equal(got[12], fresh[0])
    # without the DEAD the row differs (the test can fail)
    assert not torch.equal(got[12], tiny_hasher.hash_ids(_prompt(vec, 4))[12])


def test_incremental_equals_one_pass(tiny, tiny_hasher):
    _, _, vec = tiny
    h = tiny_hasher
    ids = _prompt(vec, 5)
    ids[40:43] = DEAD
    full = h.hash_ids(ids)
    for cuts in ([1, 2, 3, 4, 50], [7, 41, 42, 100], [3], list(range(1, 20))):
        comp_hist = torch.empty(0, dtype=torch.int64)
        parts, pos = [], 0
        for end in cuts + [len(ids)]:
            hid, comp_new = h.hash_new(comp_hist[-3:], pos, ids[pos:end])
            parts.append(hid)
            comp_hist = torch.cat([comp_hist, comp_new])
            pos = end
        assert torch.equal(torch.cat(parts), full), cuts
    # windowed one-pass form: positions from `start` only need the history
    assert torch.equal(h.hash_ids(ids, start=60), full[60:])
    with pytest.raises(EngramError):
        h.hash_new(torch.tensor([1]), 10, ids[10:12])


def test_round_hashes_equal_each_sequence_alone(tiny, tiny_hasher):
    """hash_round (a round's sequences at once) gives every row the bits of hash_compressed on its own history: at
    starts 0..2 (n-grams cut at the sequence start), with DEAD positions before and inside the new rows, n 1 and 3."""
    _, _, vec = tiny
    h = tiny_hasher
    k = h.ngram - 1
    g = torch.Generator().manual_seed(5)
    for n in (1, 3):
        hists = [h.compress(_prompt(vec, i)[:start + n]) for i, start in enumerate([0, 1, 2, 5, 40])]
        hists[3][3] = DEAD
        hists[4][40 + n - 1] = DEAD
        starts = [c.shape[0] - n for c in hists]
        before = torch.randint(0, 50, (len(hists), k), generator=g)     # positions < 0: any value
        for b, (c, s) in enumerate(zip(hists, starts)):
            m = min(k, s)
            before[b, k - m:] = c[s - m:s]
        got = h.hash_round(before, torch.tensor(starts), torch.stack([c[s:] for c, s in zip(hists, starts)]))
        want = torch.cat([h.hash_compressed(c, s) for c, s in zip(hists, starts)])
        assert torch.equal(got, want), n


def test_class_count_is_checked(tiny):
    d, cfg, _ = tiny
    tm = build_token_map(d / "checkpoint" / "tokenizer.json")
    tm2 = tm.copy()
    tm2[5] = tm.max() + 1
    with pytest.raises(EngramError, match="classes"):
        EngramHasher(cfg, tm2)
    with pytest.raises(EngramError, match="vocabulary"):
        EngramHasher(cfg, tm).compress(torch.tensor([512]))


def test_release_primes():
    cfg = ModelConfig.from_dict(release_config_dict())
    p = engram_primes(cfg.text)
    assert p.shape == (2, 3, 8)
    assert int(p[0].sum()) == 384_006_168 and int(p[1].sum()) == 384_016_682
    assert int(p[0, 0, 0]) == 16_000_057
    assert len(set(p.ravel().tolist())) == 48


def test_real_tokenizer_map_is_kit_file(tmp_path):
    """The kit map is what the builder makes from the bundled tokenizer: 99,092 classes, as the release config."""
    tm = build_token_map(BUILTIN_TOKENIZER_DIR)
    assert len(tm) == 129280 and int(tm.max()) + 1 == 99092
    kit = np.load(REPO_ROOT / "kit" / "engram_token_map_v41.npy")
    assert np.array_equal(tm, kit)
    cfg = ModelConfig.from_dict(release_config_dict())
    h = EngramHasher(cfg, kit)
    # normalisation merges classes: whitespace runs, case
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(BUILTIN_TOKENIZER_DIR / "tokenizer.json"))
    sp, two = tok.token_to_id("Ġ"), tok.token_to_id("ĠĠ")
    assert tm[sp] == tm[two]  # whitespace runs collapse to one space
    assert tm[tok.token_to_id("Hello")] == tm[tok.token_to_id("hello")]
    out = h.hash_ids(torch.tensor([0, 19923, 11, 2058, DEAD, 3]))
    assert out.shape == (6, 2, 24) and bool((out[:, 0] < 384_006_168).all())
    # the builder CLI refuses a wrong class count
    assert main(["--tokenizer", str(BUILTIN_TOKENIZER_DIR), "--out", str(tmp_path / "m.npy"), "--classes", "5"]) == 1
