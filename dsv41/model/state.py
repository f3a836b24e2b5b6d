"""SeqState: everything a sequence carries between forwards (arch.md §3).

- windows[layer]: the window-KV ring of every backbone layer and DSpark stage, [sliding_window, D]; position p
  lives in slot p % sliding_window (`window_pool` reads a prompt's windows from it, `write_window` writes).
- compressed[src] / index_keys[src]: per KV source, the compressed KV entries (RoPE'd, fake-quantised) and the
  indexer keys derived from the same latents; append-only.
- partial_kv[src] / partial_gate[src]: the tokens of a ratio-2 source's group that has not closed yet.
- engram_history: the compressed token id of every position (DEAD = -1 for image positions).
- published_keys: the release's "quirk" mode only (arch.md §2.8): which owner's index keys were published last,
  and how many there were then.

The state is a plain value: `snapshot()` returns an independent deep copy, `restore()` copies one back in, so a
snapshot can be restored any number of times.

Speculative decoding (dsv41/sched/drafting.py) needs a cheaper undo than a snapshot (which copies the whole
compressed KV of a long sequence every round): `mark(k)` before a forward of k rows records only what such a forward
overwrites (the <= k ring slots of every layer and DSpark stage, the lengths of the append-only compressed KV, index
keys and Engram history, the open ratio-2 groups, the published-keys record); during the forward the compressors
note the rows of the groups they touch (`note_group_rows`); `rollback(n)` then takes back the last n of those rows,
leaving the state equal (torch.equal) to one that was fed only the kept rows. The mark stays valid until the next
forward (several rollbacks may follow one mark, each taking back more).
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
    undo: Mark | None = None             # set by mark(), consumed by rollback(); never part of a snapshot

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
        self.undo = None

    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        total = self.engram_history.numel() * self.engram_history.element_size()
        for d in (self.windows, self.compressed, self.index_keys, self.partial_kv, self.partial_gate):
            total += sum(v.numel() * v.element_size() for v in d.values())
        return total

    # ---- window ring ------------------------------------------------------------------------------------------

    def window_pool(self, layer: int, new_kv: torch.Tensor, start: int, window: int) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
        """Each new row's window as indices into a small pool of latents: (pool [window - 1 + n, D], idx [n, window]
        int64, -1 where the position is before the sequence). Row i (position start+i) sees positions
        start+i-window+1 .. start+i, ascending; the pool holds the window-1 positions before `start` (from the ring,
        copied: the ring is written next) and the new rows."""
        n, d = new_kv.shape
        ring = self.windows.get(layer)
        lead = min(start, window - 1)
        if lead:
            slots = torch.arange(start - lead, start, device=new_kv.device) % window
            prev = ring[slots]
        else:
            prev = new_kv.new_zeros((0, d))
        seq = torch.cat([new_kv.new_zeros((window - 1 - lead, d)), prev, new_kv], dim=0)  # positions start-window+1..
        dv = new_kv.device
        idx = torch.arange(n, device=dv)[:, None] + torch.arange(window, device=dv)[None, :]     # [n, window]
        return seq, torch.where(start - window + 1 + idx >= 0, idx, -1)

    def write_window(self, layer: int, new_kv: torch.Tensor, start: int, window: int) -> None:
        ring = self.windows.get(layer)
        if ring is None:
            ring = self.windows[layer] = new_kv.new_zeros((window, new_kv.shape[1]))
        n = new_kv.shape[0]
        keep = min(n, window)
        slots = torch.arange(start + n - keep, start + n, device=new_kv.device) % window
        ring[slots] = new_kv[n - keep:]

    # ---- mark / rollback (speculative decoding) ----------------------------------------------------------------

    def mark(self, rows: int, window: int) -> None:
        """Before a forward of `rows` rows: remember what it overwrites, so `rollback` can take rows back."""
        start = self.length
        if rows >= window:
            slots = torch.arange(window)
        else:
            slots = torch.arange(start, start + rows) % window
        self.undo = Mark(
            start=start,
            rows=rows,
            window=window,
            slots=slots,
            ring_slots={k: v[slots].clone() for k, v in self.windows.items()},
            compressed_len={k: v.shape[0] for k, v in self.compressed.items()},
            index_keys_len={k: v.shape[0] for k, v in self.index_keys.items()},
            # copies: a decode round rewrites the open group's buffer in place (Model._compress_round)
            partial={k: (self.partial_kv[k].clone(), self.partial_gate[k].clone()) for k in self.partial_kv},
            published_keys=self.published_keys,
        )

    def unmark(self) -> None:
        self.undo = None

    def note_group_rows(self, layer: int, first: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """Called by a ratio > 1 compressor during a marked forward: the rows of positions first.. (its open group
        followed by the new rows, before pooling), so a rollback can reopen a group the forward closed."""
        if self.undo is not None:
            self.undo.group_rows[layer] = (first, kv, gate)

    def rollback(self, n: int, ratios: dict[int, int]) -> None:
        """Take back the last `n` tokens fed since `mark` (ratios: the compression ratio of each KV source)."""
        m = self.undo
        if m is None:
            raise ValueError("rollback without a mark (only the rows of the last marked forward can be taken back)")
        keep = self.length - n
        if n < 0 or keep < m.start:
            raise ValueError(f"cannot take back {n} tokens: {self.length - m.start} were fed since the mark")
        if n == 0:
            return
        if self.length != m.start + m.rows and not m.rolled:
            raise ValueError("the state was fed after its mark")
        # ring slots of the taken-back positions get their old contents (positions keep..length-1)
        if m.rows >= m.window:
            # a forward of >= window rows rewrote every slot: rebuild each slot from the old ring or the kept rows
            raise ValueError("rollback supports forwards shorter than the window")
        gone = torch.arange(keep, self.length) % m.window
        pick = torch.nonzero((m.slots[:, None] == gone[None, :]).any(dim=1)).view(-1)
        for k, ring in self.windows.items():
            old = m.ring_slots.get(k)
            if old is None:                     # a ring created by this forward: its slots were zeros before
                ring[m.slots[pick]] = 0
            else:
                ring[m.slots[pick]] = old[pick]
        for k, v in self.compressed.items():
            r = ratios[k]
            self.compressed[k] = v[:keep // r]
            ik = self.index_keys.get(k)
            if ik is not None:
                self.index_keys[k] = ik[:min(ik.shape[0], keep // r)]
            if r > 1:
                got = m.group_rows.get(k)
                if got is None:                 # no group rows this forward (nothing fed to this source)
                    continue
                first, kv, gate = got
                a = keep // r * r - first
                self.partial_kv[k] = kv[a:keep - first].clone()
                self.partial_gate[k] = gate[a:keep - first].clone()
        if self.published_keys is not None:
            owner, count = self.published_keys
            self.published_keys = (owner, min(count, self.index_keys[owner].shape[0]))
        self.engram_history = self.engram_history[:keep]
        self.length = keep
        m.rolled = True
        if keep == m.start:
            # nothing of the forward is left: everything is exactly as marked
            for k in list(self.compressed):
                if k not in m.compressed_len:
                    del self.compressed[k]
                    self.index_keys.pop(k, None)
            for k, (kv, gate) in m.partial.items():
                self.partial_kv[k], self.partial_gate[k] = kv, gate
            for k in list(self.partial_kv):
                if k not in m.partial:
                    del self.partial_kv[k], self.partial_gate[k]
            self.published_keys = m.published_keys


@dataclass
class Mark:
    """What a marked forward overwrote (SeqState.mark)."""
    start: int
    rows: int
    window: int
    slots: torch.Tensor
    ring_slots: dict[int, torch.Tensor]
    compressed_len: dict[int, int]
    index_keys_len: dict[int, int]
    partial: dict[int, tuple[torch.Tensor, torch.Tensor]]
    published_keys: tuple[int, int] | None
    group_rows: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    rolled: bool = False
