"""Layer roles of DeepSeek-V4.1, derived from the config (arch.md §2.3). Nothing else hard-codes layer numbers.

Backbone layer i has compress ratio r = compress_ratios[i]:
- r == 0: window-only attention (plain RoPE).
- r > 0 and i in kv_source_layer_ids: owns a compressor (its compressed KV and indexer keys live in the state).
- r > 0 otherwise: reads the latest preceding KV source's compressed KV ("reuse").
- i in index_source_layer_ids: runs the lightning indexer and publishes a top-k list; a KV source also derives
  the indexer keys ("owns keys"); an index source that is not a KV source re-indexes the latest owner's keys inside
  the candidate blocks ("re-index"). The candidate source also publishes the level-1 candidate block mask.
- Layers that are not index sources take the latest published top-k list.
The DSpark stages (mtp.*) are the last num_nextn_predict_layers entries of compress_ratios, all window-only.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv41.config import TextConfig


@dataclass(frozen=True)
class LayerRole:
    index: int                 # backbone layer number (DSpark stages: num_hidden_layers + stage)
    name: str                  # checkpoint prefix: "layers.7" or "mtp.0"
    ratio: int                 # compress ratio (0 = window-only)
    kv_source: int | None      # the layer whose compressed KV this layer attends (None when ratio == 0)
    owns_compressor: bool      # kv source: runs its own compressor
    index_source: bool         # runs the indexer (publishes a top-k list)
    owns_index_keys: bool      # derives indexer keys from its compressor latent (wk, k_norm)
    candidate_source: bool     # publishes the level-1 candidate blocks
    uses_candidates: bool      # re-index layer: scores only inside the published candidate blocks
    engram: int | None         # index into engram_layer_ids, or None
    dspark_tap: int | None     # index into dspark_target_layer_ids, or None

    @property
    def rope(self) -> str:
        """Which RoPE table: 'compress' (θ = compress_rope_theta with YaRN) above ratio 0, else 'main'."""
        return "compress" if self.ratio > 0 else "main"

    def describe(self) -> str:
        parts = [f"{self.name}: ratio {self.ratio}"]
        if self.ratio == 0:
            parts.append("window-only")
        elif self.owns_compressor:
            parts.append("KV source")
        else:
            parts.append(f"reuses layer {self.kv_source}'s compressed KV")
        if self.index_source:
            parts.append("indexer (own keys)" if self.owns_index_keys else "re-index inside candidates")
        elif self.ratio > 0:
            parts.append("reuses the latest top-k")
        if self.candidate_source:
            parts.append("candidate source")
        if self.engram is not None:
            parts.append("Engram")
        if self.dspark_tap is not None:
            parts.append("DSpark tap")
        return ", ".join(parts)


@dataclass(frozen=True)
class Layout:
    layers: tuple[LayerRole, ...]   # backbone
    stages: tuple[LayerRole, ...]   # DSpark stages

    @property
    def kv_sources(self) -> tuple[int, ...]:
        return tuple(r.index for r in self.layers if r.owns_compressor)

    @classmethod
    def from_config(cls, t: TextConfig) -> Layout:
        L = t.num_hidden_layers
        kv_src = set(t.kv_source_layer_ids)
        idx_src = set(t.index_source_layer_ids)
        latest_kv = None
        layers = []
        for i in range(L):
            r = t.compress_ratios[i]
            if i in kv_src:
                latest_kv = i
            owns = i in kv_src
            layers.append(LayerRole(
                index=i, name=f"layers.{i}", ratio=r,
                kv_source=latest_kv if r > 0 else None,
                owns_compressor=owns,
                index_source=r > 0 and i in idx_src,
                owns_index_keys=r > 0 and owns and i in idx_src,
                candidate_source=i == t.candidate_source_layer_id,
                uses_candidates=(i in idx_src and not owns and 0 <= t.candidate_source_layer_id < i),
                engram=t.engram_layer_ids.index(i) if i in t.engram_layer_ids else None,
                dspark_tap=(t.dspark_target_layer_ids.index(i) if i in t.dspark_target_layer_ids else None),
            ))
        stages = tuple(
            LayerRole(index=L + j, name=f"mtp.{j}", ratio=0, kv_source=None, owns_compressor=False,
                      index_source=False, owns_index_keys=False, candidate_source=False, uses_candidates=False,
                      engram=None, dspark_tap=None)
            for j in range(t.num_nextn_predict_layers)
        )
        return cls(layers=tuple(layers), stages=stages)
