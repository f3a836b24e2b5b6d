"""The V4.1 tokenizer: ids <-> text, tokenization with and without special-token matching, and an incremental,
UTF-8-safe detokenizer.

Two encoders are built from one tokenizer.json:
- `full`: the `tokenizers` object as shipped. Added tokens (`<｜User｜>`, `</think>`, `｜DSML｜`, ...) are matched
  anywhere in the text, the way DeepSeek's reference tokenizes a rendered prompt.
- `plain`: the same normalizer, pre-tokenizer and BPE model with the added-token table removed, so text is only ever
  byte-level BPE. Client text goes through it (the prompt shield).

`tokenizers` splits a string at added-token matches first and encodes each piece between them independently, so
"split at specials, encode the runs between them with `plain`" gives exactly the ids of `full.encode(whole)`; the
chat encoder relies on that to tokenize template text (specials matched) and client text (never) in one pass.

A server bounds each request's tokenization with a `TokenBudget` set for the thread that runs it (`token_budget`):
before any work, text that cannot fit the limit even at the longest token of the vocabulary per token is refused
(`TooManyTokens`), and between groups of chunks the tokens counted so far and the deadline are checked, so a text
that does not fit stops after about `limit` tokens, and a slow one at its deadline (`TokenizeTimeout`).
"""
from __future__ import annotations

import codecs
import contextlib
import json
import re
import threading
import time
from collections import OrderedDict
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer

from dsv41 import BUILTIN_TOKENIZER_DIR

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"


# A newline followed by a letter always ends a pre-token of this tokenizer's split regex (no alternative spans
# "\n" + letter, and no added token holds a newline), so a long text cut there encodes to the same ids piecewise;
# the pieces go through one parallel batch call.
_SAFE_CUT = re.compile(r"\n(?=[^\W\d_])")
CHUNK_CHARS = 16384


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """`text` cut at safe points into pieces of about `size` characters or more."""
    out, start = [], 0
    while len(text) - start > 2 * size:
        m = _SAFE_CUT.search(text, start + size)
        if m is None:
            break
        out.append(text[start:m.end()])
        start = m.end()
    out.append(text[start:])
    return out


GROUP = 16              # chunks per batch call: ~256K characters, a budget check between calls (the call holds the
                        # GIL for part of its work: ~20 ms a group on the 2-core box, ~0.5 s for a 5 MB batch)


class TooManyTokens(ValueError):
    """The text is at least `count` tokens, which reaches the budget's limit (it cannot fit)."""

    def __init__(self, count: int, limit: int):
        super().__init__(f"at least {count} tokens, limit {limit}")
        self.count, self.limit = count, limit


class TokenizeTimeout(TimeoutError):
    """The budget's deadline passed (or its request was given up) while tokenizing."""


class TokenBudget:
    """Bounds on one request's tokenization: `limit` tokens (None: none), a `deadline` (time.monotonic(); None:
    none), and `cancelled` (set from another thread to stop at the next check). `counted` is the tokens encoded
    under it so far, a lower bound of the prompt's length."""

    def __init__(self, limit: int | None = None, deadline: float | None = None):
        self.limit, self.deadline = limit, deadline
        self.counted = 0
        self.cancelled = False

    def check(self, more: int = 0) -> None:
        """Raise when `more` tokens beyond those counted reach the limit, or the time is up."""
        if self.cancelled or (self.deadline is not None and time.monotonic() > self.deadline):
            raise TokenizeTimeout("tokenizing took longer than its budget")
        if self.limit is not None and self.counted + more >= self.limit:
            raise TooManyTokens(self.counted + more, self.limit)


_budget = threading.local()


@contextlib.contextmanager
def token_budget(budget: TokenBudget | None):
    """Tokenization in this thread runs under `budget` inside the block."""
    old = getattr(_budget, "value", None)
    _budget.value = budget
    try:
        yield budget
    finally:
        _budget.value = old


def encode_many(enc: _HFTokenizer, texts: list[str], size: int = CHUNK_CHARS,
                max_token_chars: int | None = None) -> list[list[int]]:
    """Ids of each text, long ones cut into chunks encoded in parallel batches of GROUP chunks. Under a
    TokenBudget (this thread's): refused before any work when the texts cannot fit even at `max_token_chars`
    characters a token, and checked between batches."""
    budget: TokenBudget | None = getattr(_budget, "value", None)
    if budget is not None:
        budget.check(sum(-(-len(t) // max_token_chars) for t in texts) if max_token_chars else 0)
    parts, owner = [], []
    for k, t in enumerate(texts):
        for c in chunks(t, size):
            parts.append(c)
            owner.append(k)
    out: list[list[int]] = [[] for _ in texts]
    for g in range(0, len(parts), GROUP):
        if budget is not None and g:
            budget.check()
        for k, e in zip(owner[g:g + GROUP], enc.encode_batch_fast(parts[g:g + GROUP], add_special_tokens=False)):
            ids = e.ids
            out[k].extend(ids)
            if budget is not None:
                budget.counted += len(ids)
    if budget is not None and budget.limit is not None:
        budget.check()
    return out


class RunMemo:
    """Plain-BPE ids of long runs, kept across requests: an agent re-sends its whole history every turn, and each
    message is one run. Keyed by the run's text (one memo per Tokenizer, plain encoding only), least recently used
    evicted past `max_chars` of keys; ids are stored as tuples so no caller can change them."""

    def __init__(self, max_chars: int = 32 << 20, min_chars: int = 1024):
        self.max_chars, self.min_chars = max_chars, min_chars
        self._d: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._d.get(text)
            if ids is not None:
                self._d.move_to_end(text)
                self.hits += 1
            else:
                self.misses += 1
            return ids

    def put(self, text: str, ids: list[int]) -> None:
        if len(text) > self.max_chars:
            return
        with self._lock:
            if text not in self._d:
                self._chars += len(text)
            self._d[text] = tuple(ids)
            while self._chars > self.max_chars:
                old, _ = self._d.popitem(last=False)
                self._chars -= len(old)


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level alphabet: the printable character standing for each byte, inverted (char -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Tokenizer:
    """ids <-> text for one tokenizer.json (see module docstring for the two encoders)."""

    def __init__(self, tokenizer_json: str, path: Path | None = None):
        spec = json.loads(tokenizer_json)
        self.path = path  # the tokenizer.json it came from (None when built from a string)
        self.full = _HFTokenizer.from_str(tokenizer_json)
        added = spec.get("added_tokens", [])
        self._plain_json = json.dumps(dict(spec, added_tokens=[]))
        self.memo = RunMemo()
        self.added: dict[str, int] = {a["content"]: a["id"] for a in added}
        # tokenizers matches non-normalized added tokens first, then normalized ones in the remaining pieces, each
        # leftmost-longest; two regexes (alternatives longest first) reproduce that order.
        by_len = lambda toks: sorted(toks, key=len, reverse=True)  # noqa: E731
        raw = [a["content"] for a in added if not a.get("normalized", False)]
        norm = [a["content"] for a in added if a.get("normalized", False)]
        self._raw_re = re.compile("|".join(map(re.escape, by_len(raw)))) if raw else None
        self._norm_re = re.compile("|".join(map(re.escape, by_len(norm)))) if norm else None
        self.special_ids: frozenset[int] = frozenset(a["id"] for a in added if a.get("special", False))
        # id -> bytes, the way the ByteLevel decoder maps a token: every char through the byte alphabet, or the
        # token's own UTF-8 when one char is outside it (added tokens such as <｜User｜>).
        byte_of = _byte_level_table()
        vocab: dict[str, int] = dict(spec["model"]["vocab"])
        vocab.update(self.added)
        self.vocab_size = max(vocab.values()) + 1
        table: list[bytes | None] = [None] * self.vocab_size
        for text, i in vocab.items():
            try:
                table[i] = bytes(byte_of[c] for c in text)
            except KeyError:
                table[i] = text.encode("utf-8")
        self._bytes = table
        # the most bytes (so characters) of input one token can stand for: a text of n characters is at least
        # n / max_token_chars tokens, known before tokenizing it
        self.max_token_chars = max(len(b) for b in table if b is not None)
        self.bos_id = self.added[BOS]
        self.eos_id = self.added[EOS]
        self.think_start_id = self.added[THINK_START]
        self.think_end_id = self.added[THINK_END]
        self.image_id = self.added[IMAGE_PLACEHOLDER]

    @cached_property
    def plain(self) -> _HFTokenizer:
        """The BPE without the added-token table (built on first use: the reference path never needs it)."""
        enc = _HFTokenizer.from_str(self._plain_json)
        del self._plain_json
        return enc

    @classmethod
    def from_dir(cls, path: str | Path | None = None) -> "Tokenizer":
        """tokenizer.json from a checkpoint folder (or the file itself); None = the built-in kit/tokenizer."""
        p = Path(path) if path is not None else BUILTIN_TOKENIZER_DIR
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        return cls(f.read_text(encoding="utf-8"), path=f)

    @staticmethod
    @lru_cache(maxsize=1)
    def builtin() -> "Tokenizer":
        """The built-in tokenizer, loaded once per process (about 1 s)."""
        return Tokenizer.from_dir(None)

    # ---- encoding ----
    def encode(self, text: str, special: bool) -> list[int]:
        """Token ids of `text`. special=True matches added tokens anywhere (the reference); False: plain BPE only."""
        if not text:
            return []
        return encode_many(self.full if special else self.plain, [text], max_token_chars=self.max_token_chars)[0]

    def split_specials(self, text: str) -> list[tuple[str, int | None]]:
        """`text` cut into (piece, None) plain pieces and (token text, id) added-token matches, in order, as the
        `tokenizers` added vocabulary cuts it."""
        out: list[tuple[str, int | None]] = []
        for piece, tid in self._split(text, self._raw_re):
            if tid is not None:
                out.append((piece, tid))
            else:
                out.extend(self._split(piece, self._norm_re))
        return out

    def _split(self, text: str, rx: re.Pattern | None) -> Iterable[tuple[str, int | None]]:
        if rx is None:
            if text:
                yield text, None
            return
        pos = 0
        for m in rx.finditer(text):
            if m.start() > pos:
                yield text[pos:m.start()], None
            yield m.group(), self.added[m.group()]
            pos = m.end()
        if pos < len(text):
            yield text[pos:], None

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]], shield: bool) -> list[int]:
        """Ids of the concatenation of `pieces` = (text, is_client_text).

        shield False: the reference way, `encode(joined, special=True)` (added tokens matched in client text too).
        shield True: template text has its added tokens matched, client text never. Text between two matched
        specials is one run, encoded once with the plain BPE, so ids across a template/client boundary are what
        the whole string gives.
        """
        if not shield:
            return self.encode("".join(text for text, _ in pieces), special=True)
        items: list[str | int] = []  # str = a plain run being built, int = a special id
        run: list[str] = []
        for text, client in pieces:
            if client:
                run.append(text)
                continue
            for piece, tid in self.split_specials(text):
                if tid is None:
                    run.append(piece)
                else:
                    if run:
                        items.append("".join(run))
                        run = []
                    items.append(tid)
        if run:
            items.append("".join(run))
        known = {}
        todo = []
        for it in items:
            if isinstance(it, str) and it and it not in known:
                hit = self.memo.get(it) if len(it) >= self.memo.min_chars else None
                known[it] = hit
                if hit is None:
                    todo.append(it)
        for text, run_ids in zip(todo, encode_many(self.plain, todo, max_token_chars=self.max_token_chars)):
            known[text] = run_ids
            if len(text) >= self.memo.min_chars:
                self.memo.put(text, run_ids)
        ids: list[int] = []
        for it in items:
            if isinstance(it, int):
                ids.append(it)
            elif it:
                ids.extend(known[it])
        return ids

    # ---- decoding ----
    def token_bytes(self, tid: int) -> bytes:
        if not 0 <= tid < self.vocab_size or self._bytes[tid] is None:
            raise ValueError(f"token id {tid} is not in the vocabulary (size {self.vocab_size})")
        return self._bytes[tid]  # type: ignore[return-value]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens kept, invalid UTF-8 as U+FFFD (as `tokenizers` decodes)."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def id_to_text(self, tid: int) -> str:
        return self.token_bytes(tid).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Token ids in, text out, one id at a time. Bytes of a character split over several tokens are held until the
    character is complete, so no broken UTF-8 is ever emitted; the text joined over any split of the ids equals
    `tok.decode(ids)` once `finish()` is called."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        return self._dec.decode(self.tok.token_bytes(tid))

    def push_many(self, ids: Iterable[int]) -> str:
        return self._dec.decode(b"".join(self.tok.token_bytes(i) for i in ids))

    def finish(self) -> str:
        """Flush: bytes of an unfinished character come out as U+FFFD."""
        return self._dec.decode(b"", final=True)
