"""Kept prompt states: resume a prompt from a saved sequence state at the longest kept boundary it starts with.

Two halves, because with tensor parallelism every rank holds its own share of a state while rank 0 alone plans:

- `KeptIndex` (rank 0, on the event loop, plain bookkeeping): which boundaries are kept, under which key, in which
  namespace, how many bytes each holds, and which to evict. A radix tree over token ids per namespace finds the
  longest kept boundary that is a prefix of a prompt. The scheduler turns its answers into plan ops
  (`RestoreState`, `SaveState`, `DropState` in dsv41.comm.plan).
- `KeptStates` (every rank, in the runner's thread): the snapshots themselves, key -> SeqState.

Rules:
- A namespace is (model identity, cache_salt): states written under one salt are only resumed by requests with the
  same salt; no salt is its own namespace. A key is sha256 over the namespace, the token ids and the digests of the
  images that start before the boundary, so the same ids with other image bytes never share a state.
- A boundary inside an image's placeholder span is never kept or resumed (its rows would need half an image).
- One state per token ids and namespace: the same ids with other image bytes replace the older state (its
  snapshot is dropped like an evicted one), so a resume past an image needs the bytes of the newest one.
- A resume leaves at least one prompt row to compute (the last row's logits draw the first reply token).
- A SeqState cannot be cut to a shorter length (its window rings hold only the last W positions), so shrinking a
  prefix means keeping several boundaries of it and dropping the longest: resuming a boundary also marks its kept
  ancestors as used, so one conversation's boundaries share a recency and eviction takes the least recently used
  first and, among equals, the longest first.
- Bytes are charged at an upper bound of a state's size at its length (`bytes_for`); the sum never exceeds the
  budget (`check()`).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MIN_BOUNDARY = 8            # shorter prefixes are not worth a snapshot


class KeptError(RuntimeError):
    """A kept-state operation that cannot be done (unknown key, wrong length): a scheduler bug or ranks out of step."""


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder rows [start, end) in a prompt and a digest of its bytes."""
    start: int
    end: int
    digest: bytes


def image_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def namespace(model_id: str, salt: str | None) -> bytes:
    """The namespace of a model identity and a cache salt (None: requests without a salt)."""
    h = hashlib.sha256(b"dsv41-kept-v1\0" + model_id.encode() + b"\0")
    h.update(b"\0" if salt is None else b"\1" + salt.encode())
    return h.digest()


def state_key(ns: bytes, ids: Sequence[int], images: Sequence[ImageSpan] = ()) -> bytes:
    """The key of the state after `ids` in namespace `ns` (images: the spans starting before len(ids))."""
    h = hashlib.sha256(ns)
    h.update(struct.pack(f"<{len(ids)}I", *ids))
    for im in images:
        h.update(struct.pack("<II", im.start, im.end) + im.digest)
    return h.digest()


@dataclass(eq=False)
class Kept:
    """One kept boundary."""
    key: bytes
    ns: bytes
    ids: tuple[int, ...]
    images: tuple[ImageSpan, ...]
    nbytes: int
    last_used: int = 0
    hits: int = 0

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass(eq=False)
class _Node:
    label: tuple[int, ...]                       # the ids on the edge from the parent
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    entry: Kept | None = None


class KeptIndex:
    """Which boundaries are kept (rank 0). Pure bookkeeping: the caller moves the snapshots."""

    def __init__(self, budget_bytes: int, bytes_for: Callable[[int], int], *, model_id: str = "",
                 user_id: int | None = None, assistant_id: int | None = None, window: int = 0, chunk: int = 0):
        self.budget = int(budget_bytes)
        self.bytes_for = bytes_for
        self.model_id = model_id
        self.user_id, self.assistant_id = user_id, assistant_id
        self.window, self.chunk = window, chunk
        self._roots: dict[bytes, _Node] = {}
        self._by_key: dict[bytes, Kept] = {}
        self._clock = 0
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.saves = 0
        self.hit_tokens = 0

    # --- queries -------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def namespace(self, salt: str | None) -> bytes:
        return namespace(self.model_id, salt)

    def lookup(self, ids: Sequence[int], salt: str | None = None, images: Sequence[ImageSpan] = ()) -> Kept | None:
        """The longest kept boundary b <= len(ids) - 1 whose ids are a prefix of `ids` and whose images match
        (a hit marks it and its kept ancestors used); counts a hit or a miss."""
        ns = self.namespace(salt)
        best = None
        for node, depth in self._path(ns, ids):
            e = node.entry
            if e is not None and depth <= len(ids) - 1 and self._usable(e, images):
                best = e
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.hit_tokens += best.length
        best.hits += 1
        self._touch(best)
        return best

    def marks(self, ids: Sequence[int], images: Sequence[ImageSpan] = ()) -> list[int]:
        """Boundaries worth keeping during a prompt pass, ascending: the end of the shared system + tools prefix
        (where the first user turn starts), the prompt without its generation header (after the last Assistant
        token: a thinking turn's next prompt drops the reasoning and shares only that much), and the last chunk end
        at or below len - window (a prompt that differs only in its tail). The end of prompt + reply is kept when
        the reply finishes (the scheduler asks `plan_save` then)."""
        n = len(ids)
        out = set()
        if self.user_id is not None:
            try:
                out.add(list(ids).index(self.user_id))
            except ValueError:
                pass
        if self.assistant_id is not None:
            for i in range(n - 1, -1, -1):
                if ids[i] == self.assistant_id:
                    out.add(i + 1)
                    break
        if self.chunk > 0 and n - self.window > 0:
            out.add((n - self.window) // self.chunk * self.chunk)
        return sorted(b for b in out if MIN_BOUNDARY <= b <= n - 1 and not _inside_image(b, images))

    # --- changes -------------------------------------------------------------------------------------------------
    def plan_save(self, ids: Sequence[int], salt: str | None = None,
                  images: Sequence[ImageSpan] = ()) -> tuple[Kept, list[Kept]] | None:
        """Admit the state after `ids`: returns (the new entry, the entries evicted to make room; the caller drops
        their snapshots before saving), or None when it is not to be kept (too short, inside an image, already
        kept (then marked used), or larger than the whole budget)."""
        n = len(ids)
        if n < MIN_BOUNDARY or _inside_image(n, images):
            return None
        ns = self.namespace(salt)
        spans = tuple(im for im in images if im.start < n)
        key = state_key(ns, ids, spans)
        old = self._by_key.get(key)
        if old is not None:
            self._touch(old)
            return None
        need = int(self.bytes_for(n))
        if need > self.budget:
            return None
        evicted = []
        same_ids = self._entry_at(ns, ids)
        if same_ids is not None:     # these ids with other image bytes: one state per ids, the newest replaces it
            self._remove(same_ids)
            evicted.append(same_ids)
        while self.bytes + need > self.budget:
            victim = min(self._by_key.values(), key=lambda e: (e.last_used, -e.length))
            self._remove(victim)
            self.evictions += 1
            evicted.append(victim)
        e = Kept(key, ns, tuple(ids), spans, need)
        self._insert(e)
        self._touch(e)
        self.saves += 1
        return e, evicted

    def forget(self, key: bytes) -> Kept | None:
        """Remove an entry (its snapshot was never written, or is being dropped)."""
        e = self._by_key.get(key)
        if e is not None:
            self._remove(e)
        return e

    # --- integrity -----------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the byte accounting and the tree: every entry sits at the node its ids lead to, its key is the
        hash of its namespace + ids + images, no node is redundant, and the bytes stay within the budget."""
        seen = 0
        total = 0
        for ns, root in self._roots.items():
            assert root.label == () and root.parent is None
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                if node is not root:
                    assert node.entry is not None or len(node.children) >= 2, "redundant radix node"
                for first, child in node.children.items():
                    assert child.label and child.label[0] == first and child.parent is node
                    stack.append((child, path + child.label))
                e = node.entry
                if e is not None:
                    seen += 1
                    total += e.nbytes
                    assert e.ns == ns and e.ids == path, "entry at the wrong node"
                    assert state_key(ns, e.ids, e.images) == e.key, "entry key does not match its ids"
                    assert self._by_key.get(e.key) is e
                    assert e.nbytes == int(self.bytes_for(e.length))
            assert root.children or root.entry is None
        assert seen == len(self._by_key), "entries missing from the tree"
        assert total == self.bytes, f"byte accounting {self.bytes} != sum of entries {total}"
        assert self.bytes <= self.budget, f"kept bytes {self.bytes} exceed the budget {self.budget}"

    def metric_values(self) -> list[tuple[str, str, float, str]]:
        """(kind, name, value, help) of the kept-state families on /metrics (dsv41/api/metrics.py)."""
        return [("gauge", "kept_states", len(self), "kept prompt states"),
                ("gauge", "kept_state_bytes", self.bytes, "bytes charged to kept prompt states"),
                ("gauge", "kept_state_budget_bytes", self.budget, "budget of kept prompt states (--prompt-cache-gib)"),
                ("counter", "kept_state_hits_total", self.hits, "prompts resumed from a kept state"),
                ("counter", "kept_state_misses_total", self.misses, "prompts with no kept state to resume"),
                ("counter", "kept_state_evictions_total", self.evictions, "kept states evicted for room"),
                ("counter", "kept_state_saves_total", self.saves, "kept states written"),
                ("counter", "kept_cached_tokens_total", self.hit_tokens, "prompt tokens resumed instead of computed")]

    # --- internals -----------------------------------------------------------------------------------------------
    def _usable(self, e: Kept, images: Sequence[ImageSpan]) -> bool:
        if _inside_image(e.length, images):
            return False
        return tuple(im for im in images if im.start < e.length) == e.images

    def _entry_at(self, ns: bytes, ids: Sequence[int]) -> Kept | None:
        """The entry kept after exactly these ids (whatever its images), if any."""
        for node, depth in self._path(ns, ids):
            if depth == len(ids):
                return node.entry
        return None

    def _touch(self, e: Kept) -> None:
        """Mark e and its kept ancestors used now (they form one recency group, evicted longest first)."""
        self._clock += 1
        for node, _ in self._path(e.ns, e.ids):
            if node.entry is not None:
                node.entry.last_used = self._clock

    def _path(self, ns: bytes, ids: Sequence[int]):
        """(node, depth) along the radix path of ids, for every node whose whole label matches."""
        node = self._roots.get(ns)
        if node is None:
            return
        depth = 0
        yield node, 0
        ids = tuple(ids)
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                return
            lab = child.label
            if ids[depth:depth + len(lab)] != lab:
                return
            node, depth = child, depth + len(lab)
            yield node, depth

    def _insert(self, e: Kept) -> None:
        root = self._roots.setdefault(e.ns, _Node(()))
        node, depth, ids = root, 0, e.ids
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                leaf = _Node(ids[depth:], node, entry=e)
                node.children[ids[depth]] = leaf
                self._by_key[e.key] = e
                self.bytes += e.nbytes
                return
            lab = child.label
            k = _common(lab, ids[depth:])
            if k < len(lab):                     # split the edge at k
                mid = _Node(lab[:k], node)
                node.children[lab[0]] = mid
                child.label, child.parent = lab[k:], mid
                mid.children[lab[k]] = child
                child = mid
            node, depth = child, depth + k
        assert node.entry is None
        node.entry = e
        self._by_key[e.key] = e
        self.bytes += e.nbytes

    def _remove(self, e: Kept) -> None:
        node = None
        for node, depth in self._path(e.ns, e.ids):
            pass
        assert node is not None and node.entry is e, "entry not found where its ids lead"
        node.entry = None
        del self._by_key[e.key]
        self.bytes -= e.nbytes
        # prune: a node without entry and children goes; one with a single child merges into it
        while node.parent is not None and node.entry is None and len(node.children) <= 1:
            parent = node.parent
            if not node.children:
                del parent.children[node.label[0]]
            else:
                (child,) = node.children.values()
                child.label = node.label + child.label
                child.parent = parent
                parent.children[child.label[0]] = child
            node = parent
        if node.parent is None and not node.children:
            self._roots.pop(e.ns, None)


def _common(a: tuple[int, ...], b: Sequence[int]) -> int:
    k, n = 0, min(len(a), len(b))
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _inside_image(b: int, images: Sequence[ImageSpan]) -> bool:
    return any(im.start < b < im.end for im in images)


class KeptStates:
    """The snapshots (every rank, runner thread): key -> SeqState at its boundary."""

    def __init__(self):
        self._states: dict[bytes, object] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._states)

    def save(self, key: bytes, state) -> None:
        old = self._states.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes()
        snap = state.snapshot()
        self._states[key] = snap
        self.bytes += snap.nbytes()

    def restore(self, key: bytes, state) -> int:
        """Set `state` to the snapshot under key; returns its length. Unknown key -> KeptError."""
        snap = self._states.get(key)
        if snap is None:
            raise KeptError(f"no kept state under key {key.hex()[:16]}")
        state.restore(snap)
        return snap.length

    def drop(self, key: bytes) -> None:
        snap = self._states.pop(key, None)
        if snap is not None:
            self.bytes -= snap.nbytes()

    def length(self, key: bytes) -> int | None:
        snap = self._states.get(key)
        return None if snap is None else snap.length
