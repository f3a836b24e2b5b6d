"""Lightning indexer and two-level top-k (arch.md §2.8).

Score of query row t against compressed entry s: I = Σ_h relu(q_h · k_s) · head_dim^-½ · w_h, with
w = weights_proj(x) · n_heads^-½, all float32 (as the HF port; the release rounds to bf16 along the way).
An entry s is visible to the query at position p iff s < ⌊(p+1)/r⌋.
- Level 1 (candidate source only): block score = max of I over candidate_block_size consecutive entries; the
  block holding the newest visible entry is forced in; the top candidate_topk_blocks blocks (finite ones) form
  the candidate mask that later re-index layers score inside.
- Level 2: top index_topk visible entries, ascending, padded with -1.

Exactness: q·k is computed in fixed tiles of ROW_TILE query rows × KEY_TILE keys (entry s always sits at the same
place of the same key tile), the head sum is written out term by term, and picks use a stable sort. So a row's
selection is a pure function of its own scores, however the rows were chunked. The scoring goes through the op
set (`Indexer.ops`, dsv41/model/ops.py): `index_scores` below in the op set's row tiles, or a kernel
(kernels/indexer.py) on the CUDA path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.linear import ROW_TILE, stable_topk, tiled
from dsv41.model.ops import Ops, reference_ops

KEY_TILE = 64
NEG_INF = float("-inf")


@dataclass
class Indexer:
    layer: int
    n_heads: int
    head_dim: int
    topk: int
    wq_b: torch.Tensor                 # [n_heads * head_dim, q_lora]
    weights_proj: torch.Tensor         # [n_heads, H]
    wk: torch.Tensor | None            # [head_dim, D] (key owners)
    k_norm: torch.Tensor | None        # [head_dim]
    eps: float
    ops: Ops = field(default_factory=reference_ops)   # the model's op set (given at load)

    def queries(self, q_res: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qat: bool):
        """q [n, heads, head_dim] (compress RoPE at the query positions, FP4 fake-quant) and head weights [n, heads]."""
        q = self.ops.linear(q_res, self.wq_b).view(-1, self.n_heads, self.head_dim)
        q = self.ops.norm_rope_quant(q, None, 0.0, cos, sin, "fp4_ue8m0" if qat else None, own=True)
        w = self.ops.linear(x, self.weights_proj) * self.n_heads ** -0.5
        return q, w

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qat: bool) -> torch.Tensor:
        """Indexer keys of new compressed entries: k_norm(wk(latent)), compress RoPE at the group's first token
        position (cos, sin: the compressed entries' own, Rope.cos_sin("compress", those positions)), FP4
        fake-quant."""
        return self.ops.norm_rope_quant(self.ops.linear(latent, self.wk), self.k_norm, self.eps, cos, sin,
                                        "fp4_ue8m0" if qat else None, own=True)

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               ratio: int) -> torch.Tensor:
        """Index scores [n, T] of one sequence's rows against its T keys, -inf where not yet visible."""
        T = keys.shape[0]
        out = self.raw_scores(q, w, keys)
        visible = (positions[:, None] + 1) // ratio
        return out.masked_fill(torch.arange(T, device=out.device)[None, :] >= visible, NEG_INF)

    def raw_scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Scores [n, T] of one sequence's rows against its T keys, before the visibility mask."""
        return self.ops.index_scores(q, w, keys, self.head_dim ** -0.5)

    def round_scores(self, q: torch.Tensor, w: torch.Tensor, keys: list[torch.Tensor], tpad: int,
                     limit: torch.Tensor, counts: torch.Tensor | None = None, table: torch.Tensor | None = None,
                     n: int | None = None) -> torch.Tensor:
        """Scores of a round of B sequences with n rows each: q [B*n, heads, head_dim], w [B*n, heads], keys: per
        sequence its [T_b, head_dim] keys (T_b <= tpad, a multiple of KEY_TILE), limit [B*n]: a row sees entries
        s < limit (its visible count capped by its sequence's key count); counts: the T_b as a [B] device tensor.
        Returns [B*n, tpad], -inf where not seen. Each value is the bits `scores` gives the sequence alone (the op
        set's `round_scores`: on the reference one batched product over the keys padded with zero rows, whose
        per-element result equals the 64-key tiles' (tests/test_model_round.py checks the primitive); on the CUDA
        path one launch of the round kernel reading each sequence's keys through a table of addresses, or the
        per-sequence scores). With `table` (each row's keys' address) counts are per row too, n is the rows per
        sequence and q may hold more rows than B*n (a CUDA graph's padding, rows like row 0's)."""
        out = self.ops.round_scores(q, w, keys, tpad, counts, self.head_dim ** -0.5, n, table)
        return out.masked_fill(torch.arange(tpad, device=out.device)[None, :] >= limit[:, None], NEG_INF)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float,
                 rows: int = ROW_TILE) -> torch.Tensor:
    """Scores [n, T] of rows q [n, heads, head_dim] (head weights w [n, heads]) against keys [T, head_dim], before
    the visibility mask: Σ_h relu(q_h · k) · scale · w_h, in KEY_TILE-key tiles × `rows`-row tiles (entry s always
    at the same place of the same key tile), the head sum term by term."""
    n, H, Di = q.shape
    T = keys.shape[0]
    cols = []
    for k0 in range(0, T, KEY_TILE):
        ktile = keys[k0:k0 + KEY_TILE]
        if ktile.shape[0] < KEY_TILE:
            ktile = torch.cat([ktile, ktile.new_zeros((KEY_TILE - ktile.shape[0], ktile.shape[1]))])
        kt = ktile.t()

        def tile_scores(qt, wt, kt=kt):
            r = qt.shape[0]
            s = (qt.reshape(r * H, Di) @ kt).view(r, H, KEY_TILE)
            s = torch.relu(s) * scale
            acc = s[:, 0] * wt[:, 0:1]
            for h in range(1, H):
                acc = acc + s[:, h] * wt[:, h:h + 1]
            return acc

        cols.append(tiled(tile_scores, q, w, rows=rows))
    return torch.cat(cols, dim=1)[:, :T] if cols else q.new_zeros((n, 0))


def round_scores_padded(q: torch.Tensor, w: torch.Tensor, keys: list[torch.Tensor], tpad: int, scale: float,
                        rows: int = ROW_TILE) -> torch.Tensor:
    """The reference's round scores [B*n, tpad] (before the mask): every sequence's keys copied into one zero-padded
    [B, tpad, head_dim] block, then every sequence's row tiles (`rows` rows, zero-padded as `tiled` pads) against
    all its keys in one bmm; the head sum term by term as `index_scores` writes it."""
    B = len(keys)
    Di = q.shape[2]
    padded = q.new_zeros((B, tpad, Di))
    dst = [padded[b, :k.shape[0]] for b, k in enumerate(keys) if k.shape[0]]
    torch._foreach_copy_(dst, [k for k in keys if k.shape[0]])
    return _bmm_scores(q, w, padded, scale, rows)


def _bmm_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float, R: int) -> torch.Tensor:
    B, Tpad, Di = keys.shape
    H = q.shape[1]
    n = q.shape[0] // B
    RT = -(-n // R)
    qp = q.reshape(B, n, H * Di)
    wp = w.reshape(B, n, H)
    if RT * R > n:
        qp = torch.cat([qp, qp.new_zeros((B, RT * R - n, H * Di))], dim=1)
        wp = torch.cat([wp, wp.new_zeros((B, RT * R - n, H))], dim=1)
    qp = qp.reshape(B * RT, R * H, Di)
    wp = wp.reshape(B * RT, R, H, 1)
    kt = keys.transpose(1, 2)                                     # [B, Di, Tpad], each a transposed view
    if RT > 1:
        kt = kt[:, None].expand(B, RT, Di, Tpad).reshape(B * RT, Di, Tpad)
    step = max(KEY_TILE, (1 << 22) // max(1, B * RT * R * H) // KEY_TILE * KEY_TILE)
    cols = []
    for c0 in range(0, Tpad, step):
        s = torch.bmm(qp, kt[:, :, c0:c0 + step])                 # [B*RT, R*H, c]
        s = torch.relu(s.view(B * RT, R, H, -1)) * scale
        acc = s[:, :, 0] * wp[:, :, 0]
        for h in range(1, H):
            acc = acc + s[:, :, h] * wp[:, :, h]
        cols.append(acc)                                          # [B*RT, R, c]
    out = torch.cat(cols, dim=2) if len(cols) > 1 else cols[0]
    return out.reshape(B, RT * R, Tpad)[:, :n].reshape(B * n, Tpad)


def candidate_blocks(scores: torch.Tensor, positions: torch.Tensor, ratio: int, n_blocks: int,
                     block_size: int, newest: torch.Tensor | None = None, select=None) -> torch.Tensor:
    """Level-1 candidate mask [n, T] (True = entry in a kept block) from index scores [n, T]. newest: the block
    forced in per row (default: the one holding the newest visible entry; a round of padded rows passes -1 where
    that block lies past the row's own keys). select: the op set's select_topk (default this module's).

    The kept blocks are a set: the n_blocks best by (block max descending, lower block first), those with a finite
    max. That is select_topk's pick (the k best finite entries, ties to the lower index), and, where every block
    is among the n_blocks (nb <= n_blocks: up to 16K compressed keys at V4.1's sizes), simply the finite blocks:
    no selection at all. (A stable sort of the block maxima gave the same set; on the GPU it was a radix sort
    launch of ~22 us in each indexer layer of a decode round.)"""
    n, T = scores.shape
    nb = -(-T // block_size)
    # each block's max read in place (the full blocks as a view, the partial last one apart): the max of a block
    # padded with -inf is its own, so no padded copy of the [n, T] scores (268 MB at 2048 rows and 128K keys)
    full = T // block_size
    block = scores[:, :full * block_size].view(n, full, block_size).amax(-1)
    if full < nb:
        block = torch.cat([block, scores[:, full * block_size:].amax(-1, keepdim=True)], dim=1)
    if newest is None:
        newest = ((positions + 1) // ratio - 1) // block_size   # the block holding the newest visible entry
    block = block.masked_fill(torch.arange(nb, device=scores.device)[None, :] == newest[:, None], float("inf"))
    if n_blocks >= nb:
        keep = block > NEG_INF
    else:
        picks = (select or select_topk)(block, n_blocks)              # ascending block ids, -1 padded
        keep = torch.zeros((n, nb + 1), dtype=torch.bool, device=scores.device)
        keep.scatter_(1, torch.where(picks >= 0, picks, nb), True)    # the padding into a spare column
        keep = keep[:, :nb]
    return keep.repeat_interleave(block_size, dim=1)[:, :T]


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k finite entries per row, ascending, padded with -1 to width k: [n, k] int64. The pick is the stable
    sort's (value descending, ties to the lower index) without sorting the row: a long prompt's rows hold up to 1M
    scores, and a full sort of each was the largest cost of a prompt chunk after the scores themselves. The k-th
    value v comes from torch.topk (its values are exact; only its tie order is unspecified); every entry above v
    is taken, and of the entries equal to v the lowest-index ones that fill k; the taken indices are then listed
    in ascending order by one more top-k over their negated index. tests/test_model_exact.py checks it against the
    stable sort on rows full of ties."""
    n, T = scores.shape
    kk = min(k, T)
    out = torch.full((n, k), -1, dtype=torch.long, device=scores.device)
    if kk == 0 or n == 0:
        return out
    kth = torch.topk(scores, kk, dim=1).values[:, -1:]                         # [n, 1]
    above = scores > kth
    tie = scores == kth
    need = kk - above.sum(1, keepdim=True)                                      # >= 1: kth itself ties
    rev = torch.arange(T, 0, -1, dtype=torch.int32, device=scores.device)       # T - index: larger = lower index
    low_ties = torch.topk(torch.where(tie, rev, 0), kk, dim=1).values           # lowest tie indices first
    last = T - low_ties.gather(1, need - 1)                                     # index of the need-th tie
    take = (above | (tie & (rev >= T - last))) & (scores > NEG_INF)
    picked = torch.topk(torch.where(take, rev, 0), kk, dim=1).values            # ascending index order
    out[:, :kk] = torch.where(picked > 0, T - picked, -1).long()
    return out


def select_topk_by_sort(scores: torch.Tensor, k: int) -> torch.Tensor:
    """select_topk written with the full stable sort (the definition it must equal; tests and benches only)."""
    n, T = scores.shape
    vals, idx = stable_topk(scores, min(k, T))
    idx = torch.where(vals > NEG_INF, idx, torch.full_like(idx, T))     # invalid picks sort last
    idx = torch.sort(idx, dim=1).values
    idx = torch.where(idx >= T, torch.full_like(idx, -1), idx)
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((n, k - idx.shape[1]), -1)], dim=1)
    return idx
