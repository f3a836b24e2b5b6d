"""SeqState: everything a sequence carries between forwards (arch.md §3).

- windows[layer]: the window-KV ring of every backbone layer and DSpark stage, [sliding_window, D]; position p
  lives in slot p % sliding_window.
- compressed[src] / index_keys[src]: per KV source, the compressed KV entries (RoPE'd, fake-quantised) and the
  indexer keys derived from the same latents; append-only.
- partial_kv[src] / partial_gate[src]: the tokens of a ratio-2 source's group that has not closed yet.
- engram_history: the compressed token id of every position (DEAD = -1 for image positions).
- published_keys: the release's "quirk" mode only (arch.md §2.8): which owner's index keys were published last,
  and how many there were then.

The state is a plain value: `snapshot()` returns an independent deep copy, `restore()` copies one back in, so a
snapshot can be restored any number of times.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

DEAD = -1


@dataclass
class SeqState:
    length: int = 0
    windows: dict[int, torch.Tensor] = field(default_factory=dict)
    compressed: dict[int, torch.Tensor] = field(default_factory=dict)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    partial_kv: dict[int, torch.Tensor] = field(default_factory=dict)
    partial_gate: dict[int, torch.Tensor] = field(default_factory=dict)
    engram_history: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    published_keys: tuple[int, int] | None = None

    def snapshot(self) -> SeqState:
        """An independent copy at the current token boundary (tensors cloned)."""
        return SeqState(
            length=self.length,
            windows={k: v.clone() for k, v in self.windows.items()},
            compressed={k: v.clone() for k, v in self.compressed.items()},
            index_keys={k: v.clone() for k, v in self.index_keys.items()},
            partial_kv={k: v.clone() for k, v in self.partial_kv.items()},
            partial_gate={k: v.clone() for k, v in self.partial_gate.items()},
            engram_history=self.engram_history.clone(),
            published_keys=copy.copy(self.published_keys),
        )

    def restore(self, snap: SeqState) -> None:
        """Back to the snapshot's boundary exactly (the snapshot stays usable)."""
        s = snap.snapshot()
        self.length = s.length
        self.windows, self.compressed, self.index_keys = s.windows, s.compressed, s.index_keys
        self.partial_kv, self.partial_gate = s.partial_kv, s.partial_gate
        self.engram_history, self.published_keys = s.engram_history, s.published_keys

    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        total = self.engram_history.numel() * self.engram_history.element_size()
        for d in (self.windows, self.compressed, self.index_keys, self.partial_kv, self.partial_gate):
            total += sum(v.numel() * v.element_size() for v in d.values())
        return total

    # ---- window ring ------------------------------------------------------------------------------------------

    def window_keys(self, layer: int, new_kv: torch.Tensor, start: int, window: int) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
        """Keys of each new row's window in ascending position order: [n, window, D] and a validity mask
        [n, window]. Row i (position start+i) sees positions start+i-window+1 .. start+i."""
        n, d = new_kv.shape
        ring = self.windows.get(layer)
        # The window-1 positions before `start` (from the ring), then the new rows.
        lead = min(start, window - 1)
        if lead:
            slots = torch.arange(start - lead, start) % window
            prev = ring[slots]
        else:
            prev = new_kv.new_zeros((0, d))
        seq = torch.cat([new_kv.new_zeros((window - 1 - lead, d)), prev, new_kv], dim=0)  # positions start-window+1..
        idx = torch.arange(n)[:, None] + torch.arange(window)[None, :]                       # [n, window]
        pos = start - window + 1 + idx
        return seq[idx], pos >= 0

    def write_window(self, layer: int, new_kv: torch.Tensor, start: int, window: int) -> None:
        ring = self.windows.get(layer)
        if ring is None:
            ring = self.windows[layer] = new_kv.new_zeros((window, new_kv.shape[1]))
        n = new_kv.shape[0]
        keep = min(n, window)
        slots = torch.arange(start + n - keep, start + n) % window
        ring[slots] = new_kv[n - keep:]
