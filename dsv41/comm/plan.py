"""The wire between ranks: a handful of msgspec Structs, msgpack-encoded, plain data only (ints, lists, bytes).

Rank 0 (the leader) plans; every follower receives the same `StepPlan` each round, applies its state ops, runs the
same forward and answers with a `RoundDigest`. A plan is self-contained: a follower needs nothing else to stay in
step, and it holds no tensors, so the encoding is small and identical on every host. While a round runs, rank 0 may
tell the followers which decode rows the next round holds (`Ahead`, a hint), so they build its table as rank 0 does
(dsv41/sched/runner.py, _prepare_next).

Versioning: `WIRE_VERSION` travels in `Hello`; ranks of different versions refuse each other at the handshake, so a
follower never has to guess what a field means. Change a Struct -> bump the version.

Errors are typed (`CommError` and subclasses) and name the rank, round and field they concern.
"""
from __future__ import annotations

from typing import Annotated, Union

import msgspec

WIRE_VERSION = 3          # 2: SeqRows.images; 3: Ahead

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(ge=1)]


# ---------------------------------------------------------------------------------------------------- errors

class CommError(RuntimeError):
    """Anything that breaks the link between ranks. Fatal for the lane: restart both ranks."""


class ProtocolError(CommError):
    """A frame that is not a valid message of this wire version (garbage, wrong version, wrong world)."""


class PlanError(CommError, ValueError):
    """A plan that is inconsistent in itself (a scheduler bug); raised on rank 0 before it is sent."""


class StartTimeout(CommError):
    """The other rank did not show up within the start timeout."""


class RankLost(CommError):
    """A rank died or stopped answering (no heartbeat within the timeout, or its socket went away)."""

    def __init__(self, rank: int, why: str):
        self.rank = rank
        super().__init__(f"rank {rank} lost: {why}")


class RemoteError(CommError):
    """Another rank failed and said why before leaving."""

    def __init__(self, rank: int, message: str):
        self.rank = rank
        super().__init__(f"rank {rank} failed: {message}")


class DigestMismatch(CommError):
    """Two ranks computed different results for the same round: the ranks diverged."""

    def __init__(self, round: int, rank: int, expected: bytes, got: bytes):
        self.round, self.rank = round, rank
        super().__init__(f"round {round}: rank {rank} digest {got.hex()} != rank 0 digest {expected.hex()} "
                         f"(ranks diverged)")


# ---------------------------------------------------------------------------------------------------- state ops
# Applied to the follower's sequence table in list order. Keys name kept states (prefix-cache snapshots); they are
# opaque bytes chosen by rank 0 (e.g. a hash of salt + token prefix).

class NewSeq(msgspec.Struct, array_like=True, gc=False, tag="new", forbid_unknown_fields=True):
    """Open an empty sequence (position 0). `params`: the sampler's own encoding of its sampling parameters, for a
    follower that samples (opaque here so comm depends on nothing above it)."""
    seq: NonNeg
    params: bytes = b""


class FreeSeq(msgspec.Struct, array_like=True, gc=False, tag="free", forbid_unknown_fields=True):
    """Forget a sequence and its state."""
    seq: NonNeg


class SaveState(msgspec.Struct, array_like=True, gc=False, tag="save", forbid_unknown_fields=True):
    """Snapshot the sequence's state at its current token boundary under `key` (overwrites an older one)."""
    seq: NonNeg
    key: bytes


class RestoreState(msgspec.Struct, array_like=True, gc=False, tag="restore", forbid_unknown_fields=True):
    """Set the sequence's state to the snapshot under `key` (the snapshot is kept)."""
    seq: NonNeg
    key: bytes


class DropState(msgspec.Struct, array_like=True, gc=False, tag="drop", forbid_unknown_fields=True):
    """Forget the snapshot under `key`."""
    key: bytes


class Rollback(msgspec.Struct, array_like=True, gc=False, tag="rollback", forbid_unknown_fields=True):
    """Take back the last `n` tokens of a sequence (rejected draft rows)."""
    seq: NonNeg
    n: Pos


StateOp = Union[NewSeq, FreeSeq, SaveState, RestoreState, DropState, Rollback]


# ---------------------------------------------------------------------------------------------------- the plan

PENDING = -1    # a decode row's token id in a plan made before the round that draws it has run (the round thread
                # replaces it by that draw just before the runner executes the plan)


class SeqRows(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    """A run of consecutive tokens of one sequence in this round's forward: a prompt chunk, one decode row, or a
    decode row followed by draft tokens to verify (their logits all wanted)."""
    seq: NonNeg
    start: NonNeg            # absolute position of ids[0]; must equal the sequence's length before the forward
    ids: list[NonNeg]        # token ids, len >= 1
    logits: list[NonNeg]     # offsets into ids whose logits rows are wanted, ascending (e.g. [len(ids) - 1])
    draft: NonNeg = 0        # after the forward, propose this many DSpark draft tokens from the last row (0: none)
    images: bool = False     # some position of these rows is an image span position (rank 0 holds its rows and
                             # sends them through the ring, dsv41/sched/images.py); no row flagged: no collective


class Digest(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    round: NonNeg
    value: bytes


class StepPlan(msgspec.Struct, array_like=True, gc=False, tag="plan", forbid_unknown_fields=True):
    """One round. Order on every rank: `ops` (in order), then one batched forward of `rows` (in order; the logits
    come back in this order), then `after` (in order; e.g. a snapshot at the end of a prompt chunk).
    `prev`: rank 0's digest of an earlier round, so a follower checks it too (None while rank 0 has none yet)."""
    round: NonNeg
    ops: list[StateOp] = []
    rows: list[SeqRows] = []
    after: list[StateOp] = []
    prev: Digest | None = None

    @property
    def n_rows(self) -> int:
        return sum(len(r.ids) for r in self.rows)

    def validate(self) -> "StepPlan":
        """Cross-field checks msgspec cannot express; raises PlanError naming the round, sequence and field."""
        seen: set[int] = set()
        for i, r in enumerate(self.rows):
            where = f"round {self.round}: rows[{i}] (seq {r.seq})"
            if r.seq in seen:
                raise PlanError(f"{where}: sequence appears twice in one round")
            seen.add(r.seq)
            if not r.ids:
                raise PlanError(f"{where}: ids is empty")
            if any(b <= a for a, b in zip(r.logits, r.logits[1:])):
                raise PlanError(f"{where}: logits offsets must be strictly ascending, got {r.logits}")
            if r.logits and r.logits[-1] >= len(r.ids):
                raise PlanError(f"{where}: logits offset {r.logits[-1]} outside ids of length {len(r.ids)}")
            if r.draft and (not r.logits or r.logits[-1] != len(r.ids) - 1):
                raise PlanError(f"{where}: draft needs the last row's logits")
        if self.prev is not None and self.prev.round >= self.round:
            raise PlanError(f"round {self.round}: prev digest is for round {self.prev.round}, not an earlier one")
        return self


# ---------------------------------------------------------------------------------------------------- control

class Ahead(msgspec.Struct, array_like=True, gc=False, tag="ahead", forbid_unknown_fields=True):
    """The round queued behind the one running, when it is one decode row per sequence (`rows`: (seq, start), the
    ids drawn by the running round, so not known yet): a follower builds that round's table while its device runs
    the round before. Only a hint: the StepPlan of that round follows as usual and is what the round runs."""
    round: NonNeg
    rows: list[tuple[NonNeg, NonNeg]]

    def plan(self) -> StepPlan:
        """The rows as the runner's upcoming plan: one PENDING decode row each, its logits wanted."""
        return StepPlan(self.round, rows=[SeqRows(s, start, [PENDING], [0]) for s, start in self.rows])


class Hello(msgspec.Struct, array_like=True, gc=False, tag="hello"):
    """First message each way. Followers send theirs; rank 0 answers with its own once all ranks are in, carrying
    the session id (unique per start, names the shared-memory ring) and whether every rank is on one host."""
    version: int
    rank: NonNeg
    world: Pos
    host: str                 # host identity (hostname + boot id): equal strings = same machine
    pid: int
    session: str = ""         # rank 0 only
    same_host: bool = False   # rank 0 only


class Heartbeat(msgspec.Struct, array_like=True, gc=False, tag="hb"):
    rank: NonNeg
    beat: NonNeg              # counts up; the receiver only needs "something arrived"


class RoundDigest(msgspec.Struct, array_like=True, gc=False, tag="digest", forbid_unknown_fields=True):
    """A follower's answer to a round: its digest of what it computed."""
    round: NonNeg
    rank: NonNeg
    value: bytes


class Shutdown(msgspec.Struct, array_like=True, gc=False, tag="bye"):
    """A clean exit (not a failure): the receiver stops without error."""
    rank: NonNeg


class Error(msgspec.Struct, array_like=True, gc=False, tag="error"):
    """The sender failed; the receiver raises RemoteError with this text."""
    rank: NonNeg
    message: str


Message = Union[Hello, Heartbeat, StepPlan, Ahead, RoundDigest, Shutdown, Error]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Bytes -> one message; anything else is a ProtocolError (with msgspec's path to the bad field)."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad frame ({len(data)} bytes): {e}") from None
