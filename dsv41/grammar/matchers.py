"""Per-sequence grammar state, batched bitmask fills, and applying a bitmask to logits.

The scheduler's side of structured output:
    m = spec.matcher()                      # one per sequence
    bitmask = allocate_bitmask(rows)        # int32 [rows, 4040], pinned when CUDA is present
    fill_masks([m0, None, m2, ...], bitmask)  # row i <- matcher i (None: every token allowed); GIL released
    apply_mask(logits, bitmask)             # logits [rows, V] on CPU or GPU, in place
    m.consume(token)                        # every sampled token, reasoning included
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import llguidance as llg
import llguidance.torch as llg_torch
import numpy as np
import torch

from dsv41.grammar.compile import Vocab

VOCAB = 129280


class Matcher:
    """Grammar state of one sequence. Every sampled token must be passed to `consume`, in order."""

    def __init__(self, m: llg.LLMatcher, vocab: Vocab, thinking: bool = False):
        self._m = m
        self.vocab = vocab
        # Per consumed token: whether llguidance counted it. EOS taken by a matcher that is already stopped is not
        # counted by llguidance's rollback (serving.md §8 "rollback trap"), so rollback(n) must skip it.
        self._counted: list[bool] = []
        self._think_close_at: int | None = None if thinking else 0

    # -- state ----------------------------------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        """The reply may end here (EOS is allowed)."""
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but EOS can follow (grammar complete), or the matcher is in error."""
        return self._m.is_stopped()

    def is_error(self) -> bool:
        """A token outside the grammar was consumed, or the grammar dead-ended: end the stream with an error."""
        return self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def in_reasoning(self) -> bool:
        """Thinking grammars: `</think>` not consumed yet (the constraint has not started)."""
        return self._think_close_at is None

    def __len__(self) -> int:
        return len(self._counted)

    # -- advancing ------------------------------------------------------------------------------------------------
    def consume(self, token: int) -> bool:
        """Advance by one sampled token. False: the token breaks the grammar and the matcher is now in error."""
        token = int(token)
        counted = not (token == self.vocab.eos and self._m.is_stopped())
        ok = self._m.consume_token(token)
        if ok:
            self._counted.append(counted)
            if token == self.vocab.think_close and self._think_close_at is None:
                self._think_close_at = len(self._counted)
        return ok

    def consume_many(self, tokens: Sequence[int]) -> bool:
        for t in tokens:
            if not self.consume(t):
                return False
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens (rejected drafts)."""
        if n < 0 or n > len(self._counted):
            raise ValueError(f"cannot roll back {n} of {len(self._counted)} tokens")
        if n == 0:
            return
        k = sum(self._counted[-n:])
        del self._counted[-n:]
        if k and not self._m.rollback(k):
            raise RuntimeError(f"llguidance rollback failed: {self._m.get_error()}")
        if self._think_close_at is not None and self._think_close_at > len(self._counted):
            self._think_close_at = None

    def cut_draft(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar allows from here (drafts are cut before verify)."""
        tokens = [int(t) for t in tokens]
        return tokens[: self._m.validate_tokens(tokens)]

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """This matcher's allowed tokens into `bitmask[row]` (CPU int32)."""
        fill_masks([self], bitmask[row: row + 1])


# ---------------------------------------------------------------------------------------------------------------
# Batches.

# A JSON mask costs ~15 µs and a reasoning mask ~2 µs, so thread hand-off dominates a wide pool: on the H200 host
# (16 CPUs) 32 masks took 0.6 ms on 1 thread, 0.86 ms on 4 and 1.2 ms on llguidance's default 12
# (bench/results/grammar-h200.md). Four threads stay close to the best there and still split heavy grammars.
MASK_THREADS = 4
_EXECUTOR: llg.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> llg.LLExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llg.LLExecutor(max(1, min(MASK_THREADS, os.cpu_count() or 1)))
        return _EXECUTOR


def allocate_bitmask(rows: int, vocab: int = VOCAB) -> torch.Tensor:
    """int32 [rows, ceil(vocab/32)], all tokens allowed; pinned when CUDA is present (fast copy to the GPU)."""
    return llg_torch.allocate_token_bitmask(rows, vocab)


def _eos_only(bitmask: torch.Tensor, row: int, eos: int) -> None:
    # A matcher in error allows nothing; EOS keeps the row finite while the server ends the stream with an error.
    bitmask[row].zero_()
    if eos // 32 < bitmask.shape[1]:
        bitmask[row, eos // 32] = 1 << (eos % 32)


def fill_masks(matchers: Sequence[Matcher | None], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` <- the allowed tokens of `matchers[i]`; rows whose matcher is None allow every token.

    Runs the grammar work on llguidance's thread pool with the GIL released; safe to call from a worker thread
    (one call per batch; a matcher must not be used by two calls at once)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_cpu or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous CPU int32 tensor [rows, words]")
    if len(matchers) > bitmask.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for a bitmask of {bitmask.shape[0]} rows")
    work: dict[int, list] = {}
    for i, m in enumerate(matchers):
        if m is None:
            bitmask[i].fill_(-1)
        elif m.is_error():
            _eos_only(bitmask, i, m.vocab.eos)
        else:
            work.setdefault(m.vocab.words, []).append((m._m, i))
    for words, rows in work.items():
        if words == bitmask.shape[1]:
            llg_torch.fill_next_token_bitmask_par(_executor(), rows, bitmask)
            continue
        # Logits wider (padded vocabulary) or narrower than the tokenizer: fill at the tokenizer's width, copy the
        # overlap; ids past the tokenizer are never allowed.
        scratch = torch.zeros(bitmask.shape[0], words, dtype=torch.int32)
        llg_torch.fill_next_token_bitmask_par(_executor(), rows, scratch)
        w = min(words, bitmask.shape[1])
        for _, i in rows:
            bitmask[i].zero_()
            bitmask[i, :w] = scratch[i, :w]


def fill_draft_masks(items: Sequence[tuple[Matcher, int, Sequence[int]]], bitmask: torch.Tensor) -> None:
    """Masks for verifying drafts: for each (matcher, row, draft), `bitmask[row]` <- the mask now and
    `bitmask[row + 1 + j]` <- the mask after `draft[: j + 1]`. The draft must be legal (cut it with `cut_draft`
    first); the matchers are left where they were. Rows after an EOS in a draft are EOS-only (never sampled)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_cpu or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous CPU int32 tensor [rows, words]")
    work: dict[int, list] = {}
    for m, row, draft in items:
        draft = [int(t) for t in draft]
        if row + len(draft) >= bitmask.shape[0]:
            raise ValueError(f"draft rows {row}..{row + len(draft)} past a bitmask of {bitmask.shape[0]} rows")
        if m.is_error():
            for j in range(len(draft) + 1):
                _eos_only(bitmask, row + j, m.vocab.eos)
            continue
        if m.vocab.eos in draft:
            # llguidance's own rollback miscounts an EOS taken when stopped; nothing is sampled after EOS anyway.
            k = draft.index(m.vocab.eos)
            for j in range(k, len(draft)):
                _eos_only(bitmask, row + 1 + j, m.vocab.eos)
            draft = draft[:k]
        if len(m.cut_draft(draft)) != len(draft):
            raise ValueError("the draft is not legal here: cut it with Matcher.cut_draft first")
        work.setdefault(m.vocab.words, []).append((m._m, row, draft))
    for words, rows in work.items():
        target = bitmask if words == bitmask.shape[1] else torch.zeros(bitmask.shape[0], words, dtype=torch.int32)
        drafted = [r for r in rows if r[2]]
        plain = [(lm, row) for lm, row, draft in rows if not draft]   # llguidance refuses empty drafts
        if drafted:
            llg_torch.fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, target)
        if plain:
            llg_torch.fill_next_token_bitmask_par(_executor(), plain, target)
        if target is not bitmask:
            w = min(words, bitmask.shape[1])
            for _, row, draft in rows:
                for j in range(len(draft) + 1):
                    bitmask[row + j].zero_()
                    bitmask[row + j, :w] = target[row + j, :w]


_BITS: dict[torch.device, torch.Tensor] = {}


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf in place. `logits` [rows, V] (CPU or GPU, any float dtype); `bitmask` [rows, W]
    int32 on the CPU from `fill_masks`. Columns past the mask's 32*W are disallowed; all-ones rows are left alone."""
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    if bitmask.dim() == 1:
        bitmask = bitmask.unsqueeze(0)
    rows, vocab = logits.shape
    if bitmask.shape[0] != rows:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {rows}")
    width = min(vocab, bitmask.shape[1] * 32)
    if vocab > width:
        logits[:, width:] = float("-inf")
    if logits.device.type == "cpu":
        # numpy's bit unpacking is one pass in C; only rows that disallow something are touched.
        need = torch.nonzero((bitmask != -1).any(dim=1)).flatten().tolist()
        if not need:
            return
        bits = np.unpackbits(bitmask[need].contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        banned = torch.from_numpy(bits[:, :width] == 0)
        if len(need) == rows:
            logits[:, :width].masked_fill_(banned, float("-inf"))
        else:
            for j, i in enumerate(need):
                logits[i, :width].masked_fill_(banned[j], float("-inf"))
        return
    dev = logits.device
    mask = bitmask.to(dev, non_blocking=True)
    bits = _BITS.get(dev)
    if bits is None:
        bits = _BITS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().reshape(rows, -1)[:, :width]
    logits[:, :width].masked_fill_(~allowed, float("-inf"))
