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
selection is a pure function of its own scores, however the rows were chunked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.model import device as dev
from dsv41.model import quant
from dsv41.model.linear import linear, rms_norm, stable_topk, tiled
from dsv41.model.rope import Rope, apply_rope

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

    def queries(self, q_res: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qat: bool):
        """q [n, heads, head_dim] (compress RoPE at the query positions, FP4 fake-quant) and head weights [n, heads]."""
        q = linear(q_res, self.wq_b).view(-1, self.n_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        if qat:
            q = quant.fp4_fake_quant_ue8m0(q, 32)
        w = linear(x, self.weights_proj) * self.n_heads ** -0.5
        return q, w

    def keys(self, latent: torch.Tensor, positions: torch.Tensor, rope: Rope, qat: bool) -> torch.Tensor:
        """Indexer keys of new compressed entries: k_norm(wk(latent)), compress RoPE at the group's first token
        position, FP4 fake-quant."""
        k = rms_norm(linear(latent, self.wk), self.k_norm, self.eps)
        cos, sin = rope.cos_sin("compress", positions)
        k = apply_rope(k, cos, sin)
        return quant.fp4_fake_quant_ue8m0(k, 32) if qat else k

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               ratio: int) -> torch.Tensor:
        """Index scores [n, T] of one sequence's rows against its T keys, -inf where not yet visible."""
        n, T = q.shape[0], keys.shape[0]
        scale = self.head_dim ** -0.5
        out = dev.index_scores(q, w, keys, scale)   # one Triton launch on CUDA when kernels/ has it
        if out is not None:
            visible = (positions[:, None] + 1) // ratio
            return out.masked_fill(torch.arange(T, device=out.device)[None, :] >= visible, NEG_INF)
        cols = []
        for k0 in range(0, T, KEY_TILE):
            ktile = keys[k0:k0 + KEY_TILE]
            if ktile.shape[0] < KEY_TILE:
                ktile = torch.cat([ktile, ktile.new_zeros((KEY_TILE - ktile.shape[0], ktile.shape[1]))])
            kt = ktile.t()

            def tile_scores(qt, wt, kt=kt):
                r = qt.shape[0]
                s = (qt.reshape(r * self.n_heads, self.head_dim) @ kt).view(r, self.n_heads, KEY_TILE)
                s = torch.relu(s) * scale
                acc = s[:, 0] * wt[:, 0:1]
                for h in range(1, self.n_heads):
                    acc = acc + s[:, h] * wt[:, h:h + 1]
                return acc

            cols.append(tiled(tile_scores, q, w))
        out = torch.cat(cols, dim=1)[:, :T] if cols else q.new_zeros((n, 0))
        visible = (positions[:, None] + 1) // ratio
        return out.masked_fill(torch.arange(T)[None, :] >= visible, NEG_INF)


def candidate_blocks(scores: torch.Tensor, positions: torch.Tensor, ratio: int, n_blocks: int,
                     block_size: int) -> torch.Tensor:
    """Level-1 candidate mask [n, T] (True = entry in a kept block) from index scores [n, T]."""
    n, T = scores.shape
    nb = -(-T // block_size)
    padded = torch.cat([scores, scores.new_full((n, nb * block_size - T), NEG_INF)], dim=1)
    block = padded.view(n, nb, block_size).amax(-1)
    newest = ((positions + 1) // ratio - 1) // block_size   # the block holding the newest visible entry
    block = block.masked_fill(torch.arange(nb)[None, :] == newest[:, None], float("inf"))
    vals, idx = stable_topk(block, min(n_blocks, nb))
    keep = torch.zeros((n, nb), dtype=torch.bool)
    keep.scatter_(1, idx, vals > NEG_INF)
    return keep.repeat_interleave(block_size, dim=1)[:, :T]


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k finite entries per row, ascending, padded with -1 to width k: [n, k] int64."""
    n, T = scores.shape
    vals, idx = stable_topk(scores, min(k, T))
    idx = torch.where(vals > NEG_INF, idx, torch.full_like(idx, T))     # invalid picks sort last
    idx = torch.sort(idx, dim=1).values
    idx = torch.where(idx >= T, torch.full_like(idx, -1), idx)
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((n, k - idx.shape[1]), -1)], dim=1)
    return idx
