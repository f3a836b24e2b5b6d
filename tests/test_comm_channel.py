"""The control channel with real processes: plans round-trip, digests catch a divergent rank, a killed or silent
rank is named within the heartbeat timeout, either rank may start first. Each test is bounded by timeouts."""
import contextlib
import multiprocessing as mp
import time

import pytest
import zmq

from dsv41.comm import plan
from dsv41.comm.channel import Follower, Leader, free_lane_port, round_digest
from dsv41.comm.plan import (
    Digest, DigestMismatch, Hello, NewSeq, ProtocolError, RankLost, RemoteError, Rollback, SaveState, SeqRows,
    StartTimeout, StepPlan,
)

HB = dict(heartbeat_interval=0.1, heartbeat_timeout=1.0)
HB_ONLY = dict(HB, lost_after=0)          # heartbeats alone judge a peer (no process or socket watch)
CTX = mp.get_context("spawn")


def free_master() -> str:
    """A loopback HOST:PORT whose PORT..PORT+2 are free now."""
    return f"127.0.0.1:{free_lane_port()}"


def plan_digest(p: StepPlan) -> bytes:
    """What a follower 'computes' for a plan in these tests: a digest of everything it was told."""
    return round_digest([t for r in p.rows for t in [r.seq, r.start, *r.ids, *r.logits]] + [len(p.ops)])


def follower_main(master, q, delay=0.0, diverge_at=-1, hang_at=-1, hb=HB, other_host=False):
    """Rank 1: receive plans until shutdown, answer digests; report what happened on q. other_host: say another
    host's identity (rank 0 then cannot watch this process, only its connection)."""
    time.sleep(delay)
    if other_host:
        from dsv41.comm import channel
        channel.host_identity = lambda: "elsewhere/0/0"
    try:
        with Follower(master, 1, 2, start_timeout=20, **hb) as f:
            q.put(("session", f.session, f.same_host))
            while True:
                p = f.recv()
                if p is None:
                    q.put(("bye",))
                    return
                q.put(("plan", plan.encode(p)))
                if p.round == hang_at:
                    time.sleep(60)                  # busy in a 'forward'; the test kills us here
                d = plan_digest(p)
                if p.round == diverge_at:
                    d = bytes(16)
                f.reply(p.round, d)
    except Exception as e:
        q.put(("error", type(e).__name__, str(e), getattr(e, "rank", None)))


def leader_main(master, q, rounds, delay=0.0, hb=HB, other_host=False):
    time.sleep(delay)
    if other_host:
        from dsv41.comm import channel
        channel.host_identity = lambda: "elsewhere/0/0"
    try:
        with Leader(master, 2, start_timeout=20, **hb) as lead:
            q.put(("session", lead.session, lead.same_host))
            for r in range(rounds):
                p = StepPlan(r, rows=[SeqRows(1, r, [r], [0])])
                lead.send(p)
                lead.verify(r, plan_digest(p))
            q.put(("ran",))
            time.sleep(60)                   # the test kills us here
    except Exception as e:
        q.put(("error", type(e).__name__, str(e), getattr(e, "rank", None)))


def get(q, timeout=20):
    return q.get(timeout=timeout)


@contextlib.contextmanager
def spawned(target, *extra, q=None):
    """The other rank in a process running `target(master, q, *extra)` on a fresh master address: yields
    (master, q, the process), killed on the way out. q: the queue it reports on (default a new one)."""
    master = free_master()
    q = CTX.Queue() if q is None else q
    proc = CTX.Process(target=target, args=(master, q, *extra))
    proc.start()
    try:
        yield master, q, proc
    finally:
        proc.kill()


@contextlib.contextmanager
def leader_with(target):
    """Rank 1 running `target(master, q)` in a process, rank 0 (a Leader) here: yields (lead, q); on the way out
    rank 0 shuts down and rank 1 must say bye and exit 0."""
    with spawned(target) as (master, q, fp):
        with Leader(master, 2, start_timeout=20, **HB) as lead:
            yield lead, q
            lead.shutdown()
        assert get(q) == ("bye",)
        fp.join(10)
        assert fp.exitcode == 0


def plans():
    yield StepPlan(0, ops=[NewSeq(1, b"params"), NewSeq(2)], rows=[SeqRows(1, 0, list(range(40)), [39]),
                                                                 SeqRows(2, 0, [7, 8], [0, 1])])
    yield StepPlan(1, rows=[SeqRows(1, 40, [11], [0]), SeqRows(2, 2, [12, 13, 14], [0, 1, 2], draft=2)],
                   after=[SaveState(1, b"key")])
    yield StepPlan(2, ops=[Rollback(2, 2)], rows=[SeqRows(2, 3, [15], [0])])
    yield StepPlan(3)


def run_leader_rounds(lead, q):
    sent = []
    for p in plans():
        lead.send(p)
        lead.verify(p.round, plan_digest(p))
        got = plan.decode(get(q)[1])
        sent.append((p, got))
    return sent


def test_follower_first_plans_round_trip_and_shutdown():
    with spawned(follower_main) as (master, q, fp):      # rank 1 before rank 0
        time.sleep(0.5)
        with Leader(master, 2, start_timeout=20, **HB) as lead:
            assert get(q) == ("session", lead.session, True)
            assert lead.same_host and len(lead.session) == 16
            for p, got in run_leader_rounds(lead, q):
                # what arrived is the plan, plus rank 0's digest of the round before (for the follower's check)
                want_prev = None if p.round == 0 else Digest(p.round - 1, plan_digest(
                    next(x for x in plans() if x.round == p.round - 1)))
                assert got.prev == want_prev
                assert plan.encode(got) == plan.encode(plan.msgspec.structs.replace(p, prev=want_prev))
            lead.shutdown()
        assert get(q) == ("bye",)
        fp.join(10)
        assert fp.exitcode == 0


def test_leader_first_and_divergent_rank_is_caught():
    with spawned(follower_main, 1.0, 2) as (master, q, fp):     # rank 0 first; rank 1 lies at round 2
        t0 = time.monotonic()
        with Leader(master, 2, start_timeout=20, **HB) as lead:
            assert time.monotonic() - t0 > 0.5          # it waited for rank 1
            get(q)
            with pytest.raises(DigestMismatch) as e:
                for p in plans():
                    lead.send(p)
                    if p.round <= 2:                 # the follower reports only while it lives
                        get(q)
                    lead.verify(p.round, plan_digest(p))
            assert e.value.round == 2 and e.value.rank == 1
            assert "round 2: rank 1 digest 00000000000000000000000000000000" in str(e.value)
            lead.fail(str(e.value))
        kind, name, msg, rank = get(q)
        assert (kind, name, rank) == ("error", "RemoteError", 0) and "diverged" in msg
        fp.join(10)


def test_follower_checks_rank0_digest_too():
    with spawned(follower_main) as (master, q, _):
        with Leader(master, 2, start_timeout=20, **HB) as lead:
            get(q)
            p0 = StepPlan(0, rows=[SeqRows(1, 0, [1], [0])])
            lead.send(p0)
            lead.verify(0, plan_digest(p0))
            get(q)
            lead.send(StepPlan(1, prev=Digest(0, b"\x01" * 16)))   # rank 0 claims another result for round 0
            kind, name, msg, rank = get(q)
            assert (kind, name, rank) == ("error", "DigestMismatch", 1) and "round 0" in msg
            with pytest.raises(RemoteError, match="rank 1 failed: DigestMismatch") as e:
                lead.collect(1)
            assert e.value.rank == 1


@pytest.mark.parametrize("watch", [True, False])
@pytest.mark.parametrize("when", ["in_step", "between_steps"])
def test_killed_follower_is_named_within_heartbeat_timeout(when, watch):
    """in_step: rank 0 waits for round 2's digest when rank 1 dies (its process is gone at once; heartbeats only:
    the heartbeat finds it); between_steps: rank 1 dies after answering round 2, rank 0 finds it when it sends
    round 3 (or by the watch or the heartbeat)."""
    hb = HB if watch else HB_ONLY
    with spawned(follower_main, 0.0, -1, 2 if when == "in_step" else -1, hb) as (master, q, fp):
        with pytest.raises(RankLost) as e:
            with Leader(master, 2, start_timeout=20, **hb) as lead:
                get(q)
                for p in plans():
                    lead.send(p)
                    if p.round <= 2:                 # the follower reports only while it lives
                        get(q)
                    if p.round == 2 and when == "between_steps":
                        lead.verify(p.round, plan_digest(p))
                    if p.round == 2:
                        fp.kill()                    # SIGKILL mid-stream: no goodbye
                        fp.join(5)
                        t0 = time.monotonic()
                        if when == "between_steps":
                            continue
                    lead.verify(p.round, plan_digest(p))
        took = time.monotonic() - t0
        assert e.value.rank == 1 and str(e.value).startswith("rank 1 lost: ")
        if when == "in_step":
            assert (f"its process {fp.pid} exited" if watch else "no heartbeat for 1 s") in str(e.value)
        assert took < (0.5 if watch else HB["heartbeat_timeout"] + 1.0), took


@pytest.mark.parametrize("watch", [True, False])
def test_killed_leader_is_named_by_the_follower(watch):
    hb = HB if watch else HB_ONLY
    with spawned(leader_main, 2, 0.0, hb) as (master, q, lp):
        with Follower(master, 1, 2, start_timeout=20, **hb) as f:
            assert get(q)[0] == "session"
            for _ in range(2):
                p = f.recv()
                f.reply(p.round, plan_digest(p))
            assert get(q) == ("ran",)
            lp.kill()
            t0 = time.monotonic()
            want = f"rank 0 lost: its process {lp.pid} exited" if watch else "rank 0 lost: no heartbeat"
            with pytest.raises(RankLost, match=want) as e:
                f.recv()
            assert e.value.rank == 0
            assert time.monotonic() - t0 < (0.5 if watch else HB["heartbeat_timeout"] + 1.0)


def wait_lost(hb, timeout: float) -> float:
    """Seconds until the heartbeat thread judges a peer lost (AssertionError after `timeout`)."""
    t0 = time.monotonic()
    while hb.lost is None:
        assert time.monotonic() - t0 < timeout, "the peer was never judged lost"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_stopped_follower_is_lost_within_lost_after_while_idle():
    """SIGSTOP keeps the socket open and the kernel answering: heartbeats alone would wait heartbeat_timeout. The
    process state (same host) shows it stopped; after lost_after it is lost, naming the rank and the pid."""
    import os
    import signal
    hb = dict(HB, heartbeat_timeout=30.0, lost_after=0.5)
    with spawned(follower_main, 0.0, -1, -1, hb) as (master, q, fp):
        try:
            with Leader(master, 2, start_timeout=20, **hb) as lead:
                get(q)
                time.sleep(0.3)
                assert lead.hb.lost is None                # a live, idle follower is not lost
                os.kill(fp.pid, signal.SIGSTOP)
                took = wait_lost(lead.hb, 5)
                assert 0.5 <= took < 1.0, took
                assert str(lead.hb.lost).startswith(f"rank 1 lost: its process {fp.pid} is stopped")
                with pytest.raises(RankLost, match="is stopped"):      # the next channel call raises it
                    lead.send(StepPlan(0))
        finally:
            os.kill(fp.pid, signal.SIGCONT)   # (then spawned kills it)


def test_follower_on_another_host_is_lost_when_its_connection_closes():
    """No process to watch (another host): the heartbeat connection closing is the sign, judged after lost_after
    (a live peer reconnects within 0.1 s), long before heartbeat_timeout."""
    hb = dict(HB, heartbeat_interval=1.0, heartbeat_timeout=30.0, lost_after=0.5)
    with spawned(follower_main, 0.0, -1, -1, hb, True) as (master, q, fp):
        with Leader(master, 2, start_timeout=20, **hb) as lead:
            get(q)
            assert not lead.same_host and lead.hb.pids == {}
            time.sleep(1.5)                              # its beats came: its connection is known to have been up
            fp.kill()
            took = wait_lost(lead.hb, 5)
            assert took < 1.5, took
            assert str(lead.hb.lost).startswith("rank 1 lost: its connection closed")
    # the other way round: a follower sees rank 0's connection close
    hb = dict(hb, lost_after=0.5)
    with spawned(leader_main, 1, 0.0, hb, True, q=q) as (master, q, lp):
        with Follower(master, 1, 2, start_timeout=20, **hb) as f:
            assert get(q)[0] == "session" and not f.same_host
            p = f.recv()
            f.reply(p.round, plan_digest(p))
            assert get(q) == ("ran",)
            time.sleep(1.5)
            lp.kill()
            took = wait_lost(f.hb, 5)
            assert took < 1.5, took
            with pytest.raises(RankLost, match="rank 0 lost: its connection closed"):
                f.recv()


def test_start_timeouts_name_the_missing_rank():
    master = free_master()
    t0 = time.monotonic()
    with pytest.raises(StartTimeout, match=r"rank\(s\) \[1\] did not connect"):
        Leader(master, 2, start_timeout=0.5, **HB)
    with pytest.raises(StartTimeout, match="rank 0 did not answer"):
        Follower(master, 1, 2, start_timeout=0.5, **HB)
    with pytest.raises(StartTimeout):                      # a host name binds too (resolved, here to loopback)
        Leader(master.replace("127.0.0.1", "localhost"), 2, start_timeout=0.3, **HB)
    assert time.monotonic() - t0 < 6


def test_bind_address_rule():
    from dsv41.comm.channel import _bind_endpoint
    assert _bind_endpoint("127.0.0.1", 5) == "tcp://127.0.0.1:5"
    assert _bind_endpoint("localhost", 5) in ("tcp://127.0.0.1:5", "tcp://[::1]:5")
    assert _bind_endpoint("10.1.2.3", 5) == "tcp://*:5"
    with pytest.raises(plan.CommError, match="does not resolve"):
        _bind_endpoint("no-such-host.invalid", 5)


def test_wrong_wire_version_is_refused():
    master = free_master()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"rank1")
    s.setsockopt(zmq.LINGER, 0)
    s.connect("tcp://" + master)
    s.send(plan.encode(Hello(plan.WIRE_VERSION + 1, 1, 2, "h", 1)))
    try:
        with pytest.raises(ProtocolError, match="wire version"):
            Leader(master, 2, start_timeout=5, **HB)
        assert s.poll(2000)
        assert isinstance(plan.decode(s.recv()), plan.Error)     # and rank 1 is told why
    finally:
        s.close()
        ctx.term()


def test_three_ranks_every_follower_gets_every_plan():
    """ROUTER addresses each follower: with two followers both see every plan (PUSH would deal them out)."""
    master = free_master()
    qs = [CTX.Queue(), CTX.Queue()]
    fps = [CTX.Process(target=follower3_main, args=(master, r, qs[r - 1])) for r in (1, 2)]
    for p in fps:
        p.start()
    try:
        with Leader(master, 3, start_timeout=20, **HB) as lead:
            for p in plans():
                lead.send(p)
                lead.verify(p.round, plan_digest(p))
            lead.shutdown()
        for q in qs:
            assert [get(q) for _ in range(5)] == [r for r in range(4)] + ["bye"]
    finally:
        for p in fps:
            p.kill()


def follower3_main(master, rank, q):
    try:
        with Follower(master, rank, 3, start_timeout=20, **HB) as f:
            while (p := f.recv()) is not None:
                q.put(p.round)
                f.reply(p.round, plan_digest(p))
            q.put("bye")
    except Exception as e:
        q.put(repr(e))


def test_free_lane_port_lies_below_the_ephemeral_range_and_binds():
    """A lane port in the ephemeral range can be taken by a retried connect's own source port (a self-connect):
    free_lane_port picks below the range, three consecutive ports that bind."""
    import socket
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(20):
        p = free_lane_port()
        assert 1024 <= p and p + 2 < low
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", p))
            b.bind(("127.0.0.1", p + 2))


def ahead_follower_main(master, q):
    """Rank 1 for the Ahead test: polls for rank 0's hint while 'running' each round, reports what it saw."""
    try:
        with Follower(master, 1, 2, start_timeout=20, **HB) as f:
            while True:
                p = f.recv()
                if p is None:
                    q.put(("bye",))
                    return
                seen = None
                deadline = time.monotonic() + {0: 2.0, 1: 0.3}.get(p.round, 0.0)   # round 2 does not poll
                while seen is None and time.monotonic() < deadline:     # the device 'runs' the round
                    seen = f.poll_ahead()
                    time.sleep(0.001)
                q.put(("round", p.round, None if seen is None else plan.encode(seen)))
                f.reply(p.round, plan_digest(p))
    except Exception as e:
        q.put(("error", type(e).__name__, str(e), getattr(e, "rank", None)))


def test_ahead_reaches_a_polling_follower_and_a_late_one_is_dropped():
    """Rank 0 tells rank 1 the next round's decode rows while this round runs (Leader.send_ahead); the follower's
    poll_ahead returns them as PENDING rows, and None when none came (round 1). A hint the follower did not poll for
    (sent while round 2 runs, which polls nothing) never reaches recv(): round 3's plan comes next."""
    with leader_with(ahead_follower_main) as (lead, q):
        p0 = StepPlan(0, rows=[SeqRows(1, 0, [5, 6, 7], [2]), SeqRows(2, 0, [8], [0])])
        p1 = StepPlan(1, rows=[SeqRows(1, 3, [plan.PENDING], [0]), SeqRows(2, 1, [plan.PENDING], [0])])
        lead.send(p0)
        lead.send_ahead(p1)                     # while round 0 runs
        lead.verify(0, plan_digest(p0))
        assert get(q) == ("round", 0, plan.encode(p1))
        with pytest.raises(plan.CommError):      # only rounds of PENDING decode rows are told ahead
            lead.send_ahead(p0)
        for k in (1, 2, 3):
            pk = StepPlan(k, rows=[SeqRows(1, 2 + k, [10 + k], [0]), SeqRows(2, k, [20 + k], [0])])
            lead.send(pk)
            if k == 2:
                lead.send_ahead(StepPlan(3, rows=[SeqRows(1, 5, [plan.PENDING], [0])]))
            lead.verify(k, plan_digest(pk))        # the follower's digest of what it received: the plan itself
            assert get(q) == ("round", k, None)


def idle_follower_main(master, q):
    try:
        with Follower(master, 1, 2, start_timeout=20, **HB) as f:
            while True:
                p = f.recv(idle_s=0.2, on_idle=lambda: q.put(("idle",)))
                if p is None:
                    q.put(("bye",))
                    return
                q.put(("round", p.round))
                f.reply(p.round, plan_digest(p))
    except Exception as e:
        q.put(("error", type(e).__name__, str(e), getattr(e, "rank", None)))


def test_recv_calls_on_idle_once_when_no_plan_comes():
    """A follower's recv(idle_s, on_idle) calls on_idle once when no plan has come for idle_s (the follower hands
    its heap back then), and not while plans keep coming."""
    with leader_with(idle_follower_main) as (lead, q):
        time.sleep(0.8)                           # four idle periods long: still one call
        for k in range(3):                       # back to back: no idle call between them
            p = StepPlan(k, rows=[SeqRows(1, k, [5 + k], [0])])
            lead.send(p)
            lead.verify(k, plan_digest(p))
        assert [get(q) for _ in range(4)] == [("idle",), ("round", 0), ("round", 1), ("round", 2)]
        time.sleep(0.5)
        assert get(q) == ("idle",)
