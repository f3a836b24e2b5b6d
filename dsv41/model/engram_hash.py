"""Engram n-gram hashing (arch.md §2.9): compressed token map, bucket primes, row offsets, multipliers, hash ids.

    token id --token map--> compressed id (tokens that normalise alike share a class; DEAD = -1 stays -1)
    for shifts s = 0..N-1: t_s = comp[p - s], or the pad class once p < s or a DEAD was met at a smaller shift
    r = t_0 m_0; for i = 1..N-1: r ^= t_i m_i; hash[i-1, h] = r mod P[i-1][h] + offset[(i-1)H + h]

The hash of a position depends only on the N = engram_max_ngram_size compressed ids ending at it, so the
incremental form needs just the last N-1 history ids before the new positions.

Build the map for a tokenizer: `python -m dsv41.model.engram_hash --tokenizer kit/tokenizer --out
kit/engram_token_map_v41.npy` (the real V4.1 tokenizer gives exactly 99,092 classes).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from dsv41.config import ModelConfig, TextConfig

DEAD = -1  # image-span (and batch padding) positions: the n-gram stops there
_SENTINEL = "\ue000"  # protects a token that is exactly one space from the final strip


class EngramError(ValueError):
    pass


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def build_token_map(tokenizer_json: str | Path) -> np.ndarray:
    """Token id -> compressed class (int64 [vocab]), classes numbered by first appearance in id order.
    Each id is decoded alone; text with U+FFFD (a partial UTF-8 byte token) is keyed by the raw token string."""
    from tokenizers import Tokenizer

    p = Path(tokenizer_json)
    if p.is_dir():
        p = p / "tokenizer.json"
    tok = Tokenizer.from_file(str(p))
    norm = _normalizer()
    n = tok.get_vocab_size(with_added_tokens=True)
    classes: dict[str, int] = {}
    out = np.empty(n, dtype=np.int64)
    for tid in range(n):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        out[tid] = classes.setdefault(key, len(classes))
    return out


def check_token_map(token_map: np.ndarray, t: TextConfig) -> None:
    n_classes = int(token_map.max()) + 1
    if n_classes != t.engram_compressed_vocab_size:
        raise EngramError(f"Engram token map has {n_classes} classes; the config's engram_compressed_vocab_size is "
                          f"{t.engram_compressed_vocab_size} (every multiplier depends on it)")
    if len(token_map) < t.vocab_size:
        raise EngramError(f"Engram token map covers {len(token_map)} ids; vocab_size is {t.vocab_size}")


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for q in small:
        if n % q == 0:
            return n == q
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:  # deterministic Miller-Rabin for n < 3.3e24
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(t: TextConfig) -> np.ndarray:
    """[n_layers, N-1, heads]: per layer, per n-gram size, per head, the next prime above engram_vocab_size - 1
    not used before (by any layer); each n-gram size restarts the search at engram_vocab_size."""
    seen: set[int] = set()
    out = []
    for _ in t.engram_layer_ids:
        per_layer = []
        for _ in range(t.engram_max_ngram_size - 1):
            cur, row = t.engram_vocab_size - 1, []
            for _ in range(t.engram_n_heads):
                cur += 1
                while cur in seen or not _is_prime(cur):
                    cur += 1
                seen.add(cur)
                row.append(cur)
            per_layer.append(row)
        out.append(per_layer)
    return np.array(out, dtype=np.int64)


def engram_offsets(primes: np.ndarray) -> np.ndarray:
    """[n_layers, (N-1)*heads]: each bucket range's first row in its layer's table (running sum, flat order)."""
    flat = primes.reshape(primes.shape[0], -1)
    return np.concatenate([np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], axis=1)


def engram_multipliers(t: TextConfig) -> np.ndarray:
    """[n_layers, N]: odd multipliers from numpy default_rng(10007 * layer_id)."""
    bound = max(1, (np.iinfo(np.int64).max // t.engram_compressed_vocab_size) // 2)
    rows = []
    for layer in t.engram_layer_ids:
        g = np.random.default_rng(10007 * layer)
        rows.append(g.integers(0, bound, size=(t.engram_max_ngram_size,), dtype=np.int64) * 2 + 1)
    return np.stack(rows)


class EngramHasher:
    """Hash ids of both Engram layers for positions of one sequence. Pure function of the history, so any split
    into calls gives the same ids."""

    def __init__(self, cfg: ModelConfig | TextConfig, token_map: np.ndarray | torch.Tensor):
        t = cfg.text if isinstance(cfg, ModelConfig) else cfg
        tm = np.asarray(token_map, dtype=np.int64)
        check_token_map(tm, t)
        self.ngram = t.engram_max_ngram_size
        self.heads = t.engram_n_heads
        primes = engram_primes(t)
        for i, (layer, rows) in enumerate(zip(t.engram_layer_ids, t.engram_num_embeddings)):
            if int(primes[i].sum()) != rows:
                raise EngramError(f"layer {layer}: the bucket primes sum to {int(primes[i].sum())}, "
                                  f"but engram_num_embeddings says {rows}")
        self.primes = torch.from_numpy(primes)                                  # [L, N-1, H]
        self.offsets = torch.from_numpy(engram_offsets(primes))                 # [L, (N-1)H]
        self.multipliers = torch.from_numpy(engram_multipliers(t))              # [L, N]
        self.token_map = torch.from_numpy(tm)
        self.pad_class = int(tm[t.engram_pad_token_id])

    def compress(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (DEAD = -1 kept) -> compressed ids."""
        ids = torch.as_tensor(ids, dtype=torch.int64, device="cpu")
        if bool(((ids < DEAD) | (ids >= len(self.token_map))).any()):
            raise EngramError("token id outside the vocabulary")
        return torch.where(ids == DEAD, DEAD, self.token_map[ids.clamp_min(0)])

    def hash_compressed(self, comp: torch.Tensor, start: int = 0) -> torch.Tensor:
        """comp: compressed ids of positions 0..T-1 (or any suffix holding at least the N-1 ids before `start`
        when `start` is counted within it; see hash_new). Returns int64 [T-start, n_layers, (N-1)*heads]."""
        comp = torch.as_tensor(comp, dtype=torch.int64, device="cpu")
        T = comp.shape[0]
        pos = torch.arange(start, T, device="cpu")
        shifted = []
        alive = torch.ones(T - start, dtype=torch.bool, device="cpu")
        for s in range(self.ngram):
            src = comp[(pos - s).clamp_min(0)]
            alive = alive & (pos >= s) & (src != DEAD)  # once cut, every longer shift is cut too
            shifted.append(torch.where(alive, src, self.pad_class))
        return self._mix(torch.stack(shifted, -1))

    def hash_round(self, before: torch.Tensor, starts: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """hash_compressed of B sequences' n new positions each at once (a decode or verify round: a few ops for the
        round, not a few dozen per sequence). before [B, N-1]: the compressed ids of positions start-N+1 .. start-1
        (any value where the position is < 0); starts [B]; new [B, n] the new compressed ids. -> [B * n, n_layers,
        (N-1)*heads], row b * n + i what hash_compressed gives sequence b's position start + i."""
        B, n = new.shape
        k = self.ngram - 1
        seq = torch.cat([before, new], 1)                             # column k + i: position start + i
        pos = starts[:, None] + torch.arange(n, device="cpu")
        shifted = []
        alive = torch.ones((B, n), dtype=torch.bool, device="cpu")
        for s in range(self.ngram):
            src = seq[:, k - s:k - s + n]
            alive = alive & (pos >= s) & (src != DEAD)
            shifted.append(torch.where(alive, src, self.pad_class))
        return self._mix(torch.stack(shifted, -1).view(B * n, self.ngram))

    def _mix(self, tok: torch.Tensor) -> torch.Tensor:
        """tok [n, N]: each position's N-gram of compressed ids (pad where cut) -> its hash ids."""
        prod = tok[:, None, :] * self.multipliers[None]               # [n, L, N]; < 2^63, no wrap
        r = prod[..., 0]
        out = []
        for i in range(1, self.ngram):
            r = torch.bitwise_xor(r, prod[..., i])
            out.append(r[..., None] % self.primes[None, :, i - 1])      # [n, L, H]
        return torch.cat(out, -1) + self.offsets[None]

    def hash_ids(self, history_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Token ids of positions 0..T-1 (DEAD = -1 at image-span positions) -> hash ids of positions start..T-1."""
        return self.hash_compressed(self.compress(history_ids), start)

    def hash_new(self, comp_tail: torch.Tensor, pos0: int, new_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Incremental form for the forward. comp_tail: the compressed ids of positions pos0-k .. pos0-1 (any
        k >= 0; only the last N-1 matter); new_ids: the token ids at pos0 .. (DEAD = -1 allowed).
        Returns (hash ids [len(new_ids), n_layers, (N-1)*heads], compressed ids of the new positions)."""
        comp_new = self.compress(new_ids)
        need = min(self.ngram - 1, pos0)
        if comp_tail.shape[0] < need:
            raise EngramError(f"hash_new needs the {need} compressed ids before position {pos0}")
        tail = torch.as_tensor(comp_tail, dtype=torch.int64)[comp_tail.shape[0] - need:]
        # Local positions differ from absolute ones only when need == N-1 < pos0, and then every shift's
        # "before the sequence start" test is false either way.
        return self.hash_compressed(torch.cat([tail, comp_new]), need), comp_new


def load_token_map(path: str | Path) -> np.ndarray:
    return np.load(path).astype(np.int64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.model.engram_hash",
                                 description="Build the Engram compressed-token map of a tokenizer (.npy, int64).")
    ap.add_argument("--tokenizer", required=True, help="tokenizer dir or tokenizer.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--classes", type=int, default=None, help="fail unless the map has exactly this many classes")
    a = ap.parse_args(argv)
    tm = build_token_map(a.tokenizer)
    n = int(tm.max()) + 1
    if a.classes is not None and n != a.classes:
        print(f"error: {n} classes, expected {a.classes}", file=sys.stderr)
        return 1
    np.save(a.out, tm)
    print(f"{a.out}: {len(tm)} token ids -> {n} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
