"""Serving on several ranks (tensor parallel), the parts both sides share and rank 0's side.

Rank 0 owns the HTTP server and the scheduler; every other rank runs only the model (dsv41/sched/follower.py). Each
round rank 0 sends the scheduler's StepPlan to the followers *before* its own forward, every rank runs the same
forward (heads, experts and vocabulary split by RankShare, partials summed in rank order by the ring, logits
all-gathered), and after it rank 0 compares every follower's digest of the round with its own. While a round runs,
rank 0 also tells the followers the decode rows of the round queued behind it when its runner prepares that round's
table ahead (`Ahead`), so they build theirs meanwhile too: a follower's host work would otherwise hold back the
round's first collective on every rank.

Only rank 0 samples for the replies: grammar masks exist only there. So the digest covers the logits rows alone
(`round_digest((), rows)`), which every rank computes bit for bit the same; a follower's runner draws nothing (it
runs the same ModelRunner code on the same plans, with follower=True) and takes rank 0's decisions where a
decision changes its state (drafts: `_agree`).

Any failure of the lane (a rank lost or silent past the heartbeat timeout, a rank's error, diverged digests, or any
error once a plan was sent, after which the ranks may be out of step) is fatal: the round's requests get an error
event, every later round fails at once (so queued requests end too), and `on_fatal` tells the server to exit with
the message, which names the rank.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import torch

from dsv41.comm.channel import Leader, round_digest
from dsv41.comm.plan import CommError, StepPlan
from dsv41.comm.ring import open_ring

log = logging.getLogger("dsv41.tp")


def ring_comm(ring, world: int):
    """The model's Comm over a ring: rank-order sums, logits gathered along the vocabulary."""
    from dsv41.model.model import Comm

    def all_gather_cols(t: torch.Tensor) -> torch.Tensor:
        # a round whose rows want no logits gathers an empty [0, V/world]: the ring returns [world, 0, V/world]
        return torch.cat(list(ring.all_gather(t)), dim=1)

    return Comm(world=world, all_reduce=ring.all_reduce_sum, all_gather_cols=all_gather_cols)


class DigestingModel:
    """The model as the runner sees it, keeping the logits rows of the last forward so the round can be digested.
    `take_digest()` returns the digest of the rows since the last call (no forward: the digest of no rows)."""

    def __init__(self, model):
        self.model = model
        self._rows: list[torch.Tensor] = []

    def forward(self, inputs, **kw):
        outs = self.model.forward(inputs, **kw)
        self._rows += [o for o, i in zip(outs, inputs) if i.logits != "none"]
        return outs

    def take_digest(self) -> bytes:
        rows, self._rows = self._rows, []
        return round_digest((), rows)

    def __getattr__(self, name):
        return getattr(self.model, name)


class TPLane:
    """Rank 0's end of the lane: the Leader, the ring, and the model's Comm over it."""

    def __init__(self, leader: Leader, ring, world: int):
        self.leader, self.ring, self.world = leader, ring, world
        self.comm = ring_comm(ring, world)
        self.fatal: BaseException | None = None
        self._told = False          # the followers were sent the failure's reason
        self.rounds_verified = 0
        self._on_fatal = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: asyncio.Task | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, master: str, world: int, device: str, *, heartbeat_interval: float, heartbeat_timeout: float,
             start_timeout: float, step_timeout: float, lost_after: float = 1.0) -> TPLane:
        """Wait for every follower (start_timeout), then open the ring with them. `lost_after`: the channel's watch
        of the followers' processes and connections (dsv41/comm/channel.py); the ring's waits end as soon as it
        finds a rank lost."""
        print(f"dsv41: rank 0 of {world}: waiting for the other ranks at {master}", flush=True)
        leader = Leader(master, world, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
                        start_timeout=start_timeout, step_timeout=step_timeout, lost_after=lost_after)
        try:
            ring = open_ring(0, world, device, master=master, session=leader.session, same_host=leader.same_host,
                             timeout=heartbeat_timeout)
        except BaseException as e:
            leader.fail(f"rank 0 could not open the ring: {e}")
            leader.close()
            raise
        ring.set_abort(lambda: leader.hb.lost)
        print(f"dsv41: rank 0: {world} ranks joined, ring {ring.kind}", flush=True)
        return cls(leader, ring, world)

    def wrap(self, runner) -> TPRunner:
        return TPRunner(runner, self)

    # --- failure -------------------------------------------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop, on_fatal) -> None:
        """Call `on_fatal(message)` on `loop` once the lane fails; watch the heartbeat while no round runs."""
        self._loop, self._on_fatal = loop, on_fatal
        if self.fatal is not None:
            loop.call_soon(on_fatal, self.message())
        self._watch = loop.create_task(self._watchdog(), name="dsv41-tp-watch")

    async def _watchdog(self) -> None:
        # an idle server makes no channel calls, so a lost follower would go unnoticed until the next request
        while self.fatal is None:
            lost = self.leader.hb.lost
            if lost is not None:
                self.die(lost, tell=False)      # the socket belongs to the round thread; the peer is gone anyway
                return
            await asyncio.sleep(0.1)

    def die(self, err: BaseException, tell: bool = True) -> None:
        """Mark the lane failed (once), tell the followers why (`tell`, from the round thread only) and the server."""
        with self._lock:
            if self.fatal is not None:
                return
            self.fatal = err
        log.error("tensor-parallel lane failed: %s", err)
        if tell:
            self.leader.fail(f"{type(err).__name__}: {err}")
            self._told = True
        if self._loop is not None and self._on_fatal is not None:
            self._loop.call_soon_threadsafe(self._on_fatal, self.message())

    def message(self) -> str:
        e = self.fatal
        return f"tensor-parallel lane failed: {e}" if e is not None else ""

    def close(self) -> None:
        """A clean exit: followers' loops end (or, after a failure, they have been told why)."""
        if self._watch is not None:
            self._watch.cancel()
        try:
            self.ring.close()
        except Exception as e:  # noqa: BLE001 - closing after a lost rank may fail; nothing is left to do
            log.debug("ring close: %s", e)
        if self.fatal is None:
            self.leader.shutdown()
            return
        if not self._told:
            # the watchdog's verdict (an idle lane) was not sent from the loop: the rounds have stopped now, so the
            # socket is free; the followers still alive (3+ ranks) learn which rank went, not only that rank 0 did
            self._told = True
            self.leader.fail(f"{type(self.fatal).__name__}: {self.fatal}")
        self.leader.close()


class TPRunner:
    """The scheduler's runner on rank 0: send the plan, run it here, check every follower's digest."""

    def __init__(self, runner, lane: TPLane):
        self.runner, self.lane = runner, lane
        self.model: DigestingModel = runner.model
        runner.tell_ahead = lane.leader.send_ahead    # the plans it prepares ahead, prepared by the followers too

    def execute(self, plan: StepPlan, matchers: dict | None = None, images: dict | None = None):
        lane = self.lane
        if lane.fatal is not None:
            raise CommError(lane.message())
        try:
            lane.leader.send(plan)
        except BaseException as e:
            lane.die(e)
            raise
        try:
            self.model.take_digest()                    # rows of a failed earlier forward are not this round's
            result = self.runner.execute(plan, matchers, images)
            lane.leader.verify(plan.round, self.model.take_digest())
        except BaseException as e:
            # the followers ran (or are running) this plan: after any failure here the ranks may be out of step
            lane.die(e)
            raise
        lane.rounds_verified += 1
        return result

    def __getattr__(self, name):
        # drop / state_bytes / states / kept ...: the local runner's; drop only follows a failure, which is fatal
        return getattr(self.runner, name)
