"""Rank 0's side of the lane (dsv41/sched/tp.py) against a real Follower channel in a thread, on loopback: the digest
is the one of the round's logits rows, a follower whose digest differs is caught (DigestMismatch naming it), and once
the lane failed every later round fails at once and the server is told, with the rank named.

The model is one rank's (world 1) on the shared tiny-a checkpoint: the lane logic does not depend on the split; the
two-process test (test_tp_serve.py) runs the split model."""
from __future__ import annotations

import asyncio
import threading

import pytest

from dsv41.comm.channel import Follower, Leader, round_digest
from dsv41.comm.plan import CommError, DigestMismatch, NewSeq, SeqRows, StepPlan
from dsv41.model.model import Model
from dsv41.sched.runner import ModelRunner, encode_params
from dsv41.sched.sampler import SamplingParams
from dsv41.sched.tp import DigestingModel, TPLane
from test_comm_channel import free_master


class _NoRing:
    """The lane's ring, unused here: the model is a world-1 one and never exchanges."""
    kind = "none"

    def all_reduce_sum(self, t):
        raise AssertionError("a world-1 model does not exchange")

    all_gather = all_reduce_sum

    def close(self):
        pass


def _plans():
    p = encode_params(SamplingParams(temperature=0.0))
    return [StepPlan(1, ops=[NewSeq(1, p)], rows=[SeqRows(1, 0, [0, 5, 9, 11], [3])]),
            StepPlan(2, rows=[SeqRows(1, 4, [7], [0])])]


@pytest.fixture(scope="module")
def model(shared):
    return Model.load(shared / "vectors/model/tiny-a/checkpoint")


def _run(model, follower_digest):
    """Rank 0 runs the two plans; the follower thread answers follower_digest(round, true digest)."""
    master = free_master()
    got = {}

    def follow():
        with Follower(master, 1, 2, heartbeat_interval=0.2, heartbeat_timeout=5, start_timeout=30) as f:
            dm = DigestingModel(model)
            runner = ModelRunner(dm)
            try:
                while (plan := f.recv()) is not None:
                    runner.execute(plan)
                    f.reply(plan.round, follower_digest(plan.round, dm.take_digest()))
            except CommError as e:
                got["follower"] = e

    th = threading.Thread(target=follow, daemon=True)
    th.start()
    leader = Leader(master, 2, heartbeat_interval=0.2, heartbeat_timeout=5, start_timeout=30, step_timeout=60)
    lane = TPLane(leader, _NoRing(), 2)
    told = []
    loop = asyncio.new_event_loop()
    lane._loop, lane._on_fatal = loop, told.append          # what attach() sets, without the watchdog task
    dm = DigestingModel(model)
    runner = lane.wrap(ModelRunner(dm))
    results, errors = [], []
    for plan in _plans():
        try:
            results.append(runner.execute(plan))
        except CommError as e:
            errors.append(e)
    loop.call_soon(loop.stop)
    loop.run_forever()
    lane.close()
    th.join(30)
    loop.close()
    return lane, results, errors, told, got


def test_lane_verifies_every_round(model):
    lane, results, errors, told, got = _run(model, lambda r, d: d)
    assert errors == [] and told == [] and "follower" not in got
    assert lane.rounds_verified == 2
    assert [[s.token_id for _, s in r.samples] for r in results] == [[results[0].samples[0][1].token_id],
                                                                       [results[1].samples[0][1].token_id]]


def test_digest_is_the_logits_rows_of_the_round(model):
    import torch

    from dsv41.model.model import SeqInput
    dm = DigestingModel(model)
    st = model.new_state()
    out = dm.forward([SeqInput(state=st, ids=torch.tensor([0, 5, 9, 11]), logits="last")])
    assert dm.take_digest() == round_digest((), [out[0]])
    assert dm.take_digest() == round_digest((), [])          # taken: the next round starts empty
    flipped = out[0].clone()
    flipped.view(torch.int32)[0, 7] ^= 1                      # one low bit of one logit
    assert round_digest((), [flipped]) != round_digest((), [out[0]])


def test_a_diverged_follower_fails_the_lane_naming_it(model):
    lane, results, errors, told, got = _run(model, lambda r, d: bytes(16) if r == 1 else d)
    assert results == []
    assert isinstance(errors[0], DigestMismatch) and errors[0].rank == 1
    # the second round is not even sent: the lane is dead
    assert isinstance(errors[1], CommError) and "rank 1 digest" in str(errors[1])
    assert len(told) == 1 and "rank 1" in told[0]
    assert lane.rounds_verified == 0
    assert "rank 0" in str(got.get("follower"))            # the follower was told why rank 0 stops


def test_an_idle_lane_tells_the_followers_left_which_rank_went():
    """Three ranks, idle: the watchdog finds rank 2 lost (die without telling: the socket is the round thread's);
    closing the lane tells rank 1, still alive, why: its recv raises naming rank 2, not only rank 0."""
    from dsv41.comm.plan import RankLost, RemoteError
    master = free_master()
    got = {}

    def follow(rank):
        with Follower(master, rank, 3, heartbeat_interval=0.2, heartbeat_timeout=10, start_timeout=30,
                      lost_after=0) as f:
            try:
                got[rank] = f.recv(timeout=30)
            except CommError as e:
                got[rank] = e

    threads = [threading.Thread(target=follow, args=(r,), daemon=True) for r in (1, 2)]
    for th in threads:
        th.start()
    leader = Leader(master, 3, heartbeat_interval=0.2, heartbeat_timeout=10, start_timeout=30, lost_after=0)
    lane = TPLane(leader, _NoRing(), 3)
    lane.die(RankLost(2, "its process 4242 exited"), tell=False)
    lane.close()
    for th in threads:
        th.join(timeout=30)
    assert isinstance(got.get(1), RemoteError) and got[1].rank == 0, got
    assert "rank 2 lost: its process 4242 exited" in str(got[1])
