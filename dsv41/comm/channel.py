"""ZeroMQ control channel between rank 0 (the leader) and its followers: plans out, digests back, heartbeats both ways.

Sockets (ports counted from `--master HOST:PORT`):
- PORT: leader ROUTER (bound) <-> one DEALER per follower (connected, identity "rank<r>"). ROUTER/DEALER rather
  than PUSH/PULL: PUSH deals messages round-robin (it never copies one plan to every follower) and gives no way
  back; PUB drops messages to a late or slow subscriber. ROUTER addresses each follower by rank, carries the digests
  back on the same connection, and with ROUTER_MANDATORY a send to a follower that went away fails at once.
- PORT+1: the same pattern for heartbeats, served by one thread per process with its own socket, so a rank busy in
  a long forward (or a main thread blocked anywhere) still beats, and a beat never queues behind a plan.
- PORT+2 is left to ring.py (the torch.distributed store), so one --master names the whole lane.

Either rank may start first: ZeroMQ's connect retries until the leader binds; the handshake (`Hello` each way) then
waits up to `start_timeout` and names the missing rank. After it, silence longer than `heartbeat_timeout` makes the
other side raise `RankLost(rank)` at its next call (the wait loops check every 50 ms, so within the timeout).
Heartbeats alone are slow to judge a peer (a busy rank may be silent for a while), so the heartbeat thread also
watches what the operating system knows, every 0.1 s (`lost_after` > 0): the peer's process when it runs on this
host (gone or a zombie: lost at once; stopped, e.g. SIGSTOP: lost after `lost_after` s) and, on any host, its
heartbeat connection (closed for `lost_after` s: lost; a live peer's ZeroMQ reconnects within 0.1 s).
PORT should lie below the host's ephemeral port range (Linux: 32768-60999): a follower's retried connect to a port
in that range can be given that very port as its own source port, connect to itself and hold it, and rank 0's bind
then fails (seen once in CI with a test's random port; `free_lane_port` picks below the range).

Threading: a channel's methods are called from one thread at a time (the round loop); the heartbeat thread only
touches its own socket and a few fields read atomically.
"""
from __future__ import annotations

import collections
import hashlib
import os
import secrets
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Iterable, Sequence

import msgspec
import zmq

from dsv41.comm.plan import (
    PENDING, WIRE_VERSION, Ahead, CommError, Digest, DigestMismatch, Error, Heartbeat, Hello, ProtocolError, RankLost,
    RemoteError, RoundDigest, Shutdown, StartTimeout, StepPlan, decode, encode,
)

if TYPE_CHECKING:
    import torch

_SLICE_S = 0.05          # how often a waiting call looks at the heartbeat verdict
_KEEP_DIGESTS = 256      # a follower remembers this many of its own digests to check rank 0's `prev`


# ---------------------------------------------------------------------------------------------------- addressing

def parse_master(master: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port); the lane uses PORT, PORT+1, PORT+2."""
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise CommError(f"--master must be HOST:PORT, got {master!r}")
    p = int(port)
    if not 1 <= p <= 65533:
        raise CommError(f"--master port must be 1..65533 (the lane uses PORT..PORT+2), got {p}")
    return host.strip("[]"), p


def free_lane_port(host: str = "127.0.0.1", count: int = 3) -> int:
    """A PORT whose PORT..PORT+count-1 can be bound on `host` now, below the ephemeral port range (see the module
    docstring: a retried connect never lands on it), for tests and benches."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = secrets.SystemRandom()
    for _ in range(200):
        p = rng.randrange(max(1024, low - 12000), low - count)
        socks = []
        try:
            for q in range(p, p + count):
                sk = socket.socket()
                socks.append(sk)
                sk.bind((host, q))
            return p
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise CommError(f"no {count} free consecutive ports on {host} below {low}")


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _bind_endpoint(host: str, port: int) -> str:
    """Where rank 0 binds for --master HOST:PORT. A HOST that resolves to loopback binds there (a one-host lane,
    invisible to the network); any other binds every interface, since ZeroMQ cannot bind a host name and a node's
    own name often resolves to a loopback alias (127.0.1.1) that the other node could not reach."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise CommError(f"--master host {host!r} does not resolve: {e}") from None
    addrs = [i[4][0] for i in infos]
    loop = [a for a in addrs if a.startswith("127.") or a == "::1"]
    if loop and len(loop) == len(addrs):
        return _endpoint(min(loop, key=lambda a: ":" in a), port)     # IPv4 first: ZeroMQ sockets are IPv4 here
    return f"tcp://*:{port}"


def host_identity() -> str:
    """Hostname, this boot's id and the pid namespace: two processes with equal strings share memory (and
    /dev/shm) and see each other's pids (the ring and the heartbeat watch a same-host peer by its pid)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}/{boot}/{pidns}"


_HAVE_PROC = os.path.exists("/proc/self/stat")


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of process `pid` on this host, None when there is none. The start
    time tells a reused pid apart; state "?" = unreadable (never judged)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            tail = f.read().rpartition(")")[2].split()
        return tail[0], int(tail[19])
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        return "?", 0


# ---------------------------------------------------------------------------------------------------- digests

def logits_fingerprint(logits) -> "torch.Tensor":
    """[..., vocab] float32/bf16/fp16 -> [...] int64, on the logits' device: the exact integer sum of each row's bit
    patterns weighted by (column % 251 + 1). Integer sums do not depend on reduction order, so equal rows give equal
    fingerprints on any device, and any one changed bit changes it (|sum| < 2^56, no wrap). Cheap enough per round
    on a GPU without copying 33 MB of logits to the host."""
    import torch
    x = logits.contiguous()
    if x.element_size() not in (2, 4) or not x.is_floating_point():
        raise TypeError(f"logits_fingerprint wants 16/32-bit float logits, got {x.dtype}")
    bits = x.view(torch.int32 if x.element_size() == 4 else torch.int16).to(torch.int64)
    weight = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64) % 251 + 1
    return (bits * weight).sum(-1)


def round_digest(tokens: Iterable[int] = (), logits: Sequence | None = None) -> bytes:
    """16-byte digest of one round's result on one rank: the sampled token ids (in plan order) and the fingerprints
    of the logits rows it computed (a tensor or a list of tensors, in plan order)."""
    h = hashlib.sha256()
    toks = list(tokens)
    h.update(struct.pack(f"<q{len(toks)}q", len(toks), *toks))
    if logits is not None:
        for t in ([logits] if hasattr(logits, "shape") else logits):
            fp = logits_fingerprint(t).cpu().contiguous()
            h.update(struct.pack("<q", fp.numel()))
            h.update(fp.numpy().tobytes())
    return h.digest()[:16]


# ---------------------------------------------------------------------------------------------------- heartbeat

class _Heartbeat(threading.Thread):
    """Beats every `interval` to the peers and watches theirs. Once armed, a peer silent for `timeout` seconds sets
    `lost` (the channel's calls raise it). With `lost_after` > 0 it also watches, every 0.1 s, each peer's process
    on this host (`watch(rank, pid)`: gone at once, stopped for `lost_after` s) and each peer's heartbeat
    connection (closed for `lost_after` s). A follower that said Shutdown is not lost, it left; rank 0 counts a
    follower that leaves by itself as lost (only rank 0 ends a lane cleanly)."""

    def __init__(self, ctx: zmq.Context, rank: int, world: int, endpoint: str, leader: bool,
                 interval: float, timeout: float, lost_after: float = 1.0):
        super().__init__(name=f"dsv41-heartbeat-r{rank}", daemon=True)
        self.ctx, self.rank, self.endpoint, self.leader = ctx, rank, endpoint, leader
        self.interval, self.timeout, self.lost_after = interval, timeout, lost_after
        self.peers = list(range(1, world)) if leader else [0]
        self.last_seen: dict[int, float] = {}
        self.left: set[int] = set()
        self.lost: RankLost | None = None
        self.armed_at: float | None = None
        self.pids: dict[int, tuple[int, int]] = {}        # rank -> (pid, start time) of a peer on this host
        self._stopped_since: dict[int, float] = {}
        self._down_since: dict[int, float] = {}           # rank -> when its heartbeat connection was seen closed
        self._heard: set[int] = set()                     # peers whose beats arrived (their connection was up)
        self._probe = False
        self._halt = threading.Event()
        self._bye = False
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def watch(self, rank: int, pid: int) -> None:
        """Watch peer `rank`'s process `pid` (on this host; call before `arm`)."""
        if self.lost_after <= 0 or not _HAVE_PROC or pid <= 0:
            return
        st = process_state(pid)
        self.pids[rank] = (pid, -1 if st is None else st[1])

    def start_and_wait(self) -> None:
        self.start()
        self._ready.wait(10)
        if self._error is not None:
            raise CommError(f"heartbeat socket {self.endpoint}: {self._error}")

    def arm(self) -> None:
        now = time.monotonic()
        self.last_seen = {r: now for r in self.peers}
        self.armed_at = now

    def stop(self, bye: bool) -> None:
        self._bye = bye
        self._halt.set()
        if self.is_alive():
            self.join(5)

    def run(self) -> None:
        mon = None
        try:
            sock = self.ctx.socket(zmq.ROUTER if self.leader else zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 200)
            if self.leader:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # a send to a follower whose connection closed fails
                sock.bind(self.endpoint)
            else:
                sock.setsockopt(zmq.IDENTITY, f"rank{self.rank}".encode())
                sock.connect(self.endpoint)
            if self.lost_after > 0:
                mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if mon is not None:
            poller.register(mon, zmq.POLLIN)
        beat = 0
        next_beat = 0.0
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                if now >= next_beat or self._probe:
                    self._send(sock, encode(Heartbeat(self.rank, beat)))
                    beat += 1
                    if now >= next_beat:
                        next_beat = now + self.interval
                ready = dict(poller.poll(int(min(self.interval, 0.1) * 1000)))
                if sock in ready:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frame(frames[-1])
                if mon is not None and mon in ready:
                    self._on_monitor(mon)
                self._judge()
            if self._bye:
                self._send(sock, encode(Shutdown(self.rank)))
        finally:
            if mon is not None:
                sock.disable_monitor()
                mon.close(0)
            sock.close()

    def _send(self, sock, data: bytes) -> None:
        now = time.monotonic()
        if self.leader:
            for r in self.peers:
                try:
                    sock.send_multipart([f"rank{r}".encode(), data], zmq.NOBLOCK)
                    self._down_since.pop(r, None)
                except zmq.ZMQError as e:
                    # not connected (yet, or any more): once its beats came, a closed connection is watched
                    if e.errno == zmq.EHOSTUNREACH and r in self._heard:
                        self._down_since.setdefault(r, now)
            self._probe = bool(self._down_since)      # look again every 0.1 s while a connection is down
        else:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _on_monitor(self, mon) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while True:
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if self.leader:
                # which follower's connection closed is not in the event: probe them all now (ROUTER_MANDATORY)
                self._probe = self._probe or ev == zmq.EVENT_DISCONNECTED
            elif ev == zmq.EVENT_DISCONNECTED and 0 in self._heard:
                self._down_since.setdefault(0, time.monotonic())
            elif ev == zmq.EVENT_CONNECTED:
                self._down_since.pop(0, None)

    def _on_frame(self, data: bytes) -> None:
        try:
            msg = decode(data)
        except ProtocolError:
            return
        if isinstance(msg, Heartbeat) and msg.rank in self.peers:
            self.last_seen[msg.rank] = time.monotonic()
            self._heard.add(msg.rank)
        elif isinstance(msg, Shutdown) and msg.rank in self.peers:
            self.left.add(msg.rank)

    def _judge(self) -> None:
        if self.armed_at is None or self.lost is not None:
            return
        now = time.monotonic()
        for r in self.peers:
            if r in self.left:
                if self.leader:
                    self.lost = RankLost(r, "it shut down by itself")
                    return
                continue
            why = self._os_verdict(r, now) if self.lost_after > 0 else None
            if why is None and now - self.last_seen.get(r, self.armed_at) > self.timeout:
                why = f"no heartbeat for {self.timeout:g} s (heartbeat_timeout)"
            if why is not None:
                self.lost = RankLost(r, why)
                return

    def _os_verdict(self, r: int, now: float) -> str | None:
        """Why peer r is lost by what this host knows (its process, its connection), or None."""
        if r in self.pids:
            pid, start = self.pids[r]
            st = process_state(pid)
            if st is None or (st[0] != "?" and (st[1] != start or st[0] in "ZX")):
                return f"its process {pid} exited"
            if st[0] == "T":                           # stopped by a signal (SIGSTOP, SIGTSTP); "t" = a debugger
                since = self._stopped_since.setdefault(r, now)
                if now - since >= self.lost_after:
                    return f"its process {pid} is stopped (SIGSTOP?) for {now - since:.1f} s"
            else:
                self._stopped_since.pop(r, None)
        down = self._down_since.get(r)
        if down is not None and now - down >= self.lost_after:
            return f"its connection closed {now - down:.1f} s ago"
        return None


# ---------------------------------------------------------------------------------------------------- channels

class _Channel:
    def __init__(self, rank: int, world: int, master: str, *, leader: bool, heartbeat_interval: float,
                 heartbeat_timeout: float, start_timeout: float, lost_after: float = 1.0):
        if world < 2:
            raise CommError(f"a channel needs world >= 2, got {world}")
        if not 0 <= rank < world:
            raise CommError(f"rank {rank} outside world {world}")
        if not 0 < heartbeat_interval < heartbeat_timeout:
            raise CommError(f"need 0 < heartbeat_interval ({heartbeat_interval}) < heartbeat_timeout "
                            f"({heartbeat_timeout})")
        self.rank, self.world = rank, world
        self.host, self.port = parse_master(master)
        self.start_timeout = start_timeout
        self.session = ""
        self.same_host = False
        self._closed = False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER if leader else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 5000)   # close() waits this long at most for a last Shutdown/Error to leave
        try:
            if leader:
                self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self.sock.bind(_bind_endpoint(self.host, self.port))
            else:
                self.sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
                self.sock.connect(_endpoint(self.host, self.port))
        except (zmq.ZMQError, CommError) as e:
            self.sock.close(0)
            self.ctx.term()
            raise CommError(f"rank {rank}: cannot {'bind' if leader else 'connect'} "
                            f"{_endpoint(self.host, self.port)}: {e}") from None
        hb_at = _bind_endpoint(self.host, self.port + 1) if leader else _endpoint(self.host, self.port + 1)
        self.hb = _Heartbeat(self.ctx, rank, world, hb_at, leader, heartbeat_interval, heartbeat_timeout, lost_after)
        try:
            self.hb.start_and_wait()
        except CommError:
            self.sock.close(0)
            self.ctx.term()
            raise

    # one frame from the main socket, or None after `timeout` seconds (0: a frame already here, never waiting);
    # raises what the heartbeat found
    def _recv(self, timeout: float) -> tuple[int | None, object] | None:
        deadline = time.monotonic() + timeout
        while True:
            # what the peer sent before it went (an Error saying why) is read before the heartbeat's verdict
            if self.hb.lost is not None and not self.sock.poll(0):
                raise self.hb.lost
            left = deadline - time.monotonic()
            if self.sock.poll(int(min(left, _SLICE_S) * 1000) + 1 if left > 0 else 0):
                frames = self.sock.recv_multipart()
                sender = None
                if len(frames) == 2:           # ROUTER: [identity, payload]
                    ident = frames[0].decode(errors="replace")
                    sender = int(ident[4:]) if ident.startswith("rank") and ident[4:].isdigit() else -1
                return sender, decode(frames[-1])
            if left <= 0:
                return None

    def close(self) -> None:
        """Leave cleanly: peers see Shutdown on the heartbeat socket, not a lost rank."""
        if self._closed:
            return
        self._closed = True
        self.hb.stop(bye=True)
        self.sock.close()
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if ev is not None and not isinstance(ev, (RankLost, RemoteError)):
            self.fail(f"{et.__name__}: {ev}")
        self.close()


class Leader(_Channel):
    """Rank 0's end. `send(plan)` to every follower, `verify(round, digest)` against theirs."""

    def __init__(self, master: str, world: int = 2, *, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 30.0, start_timeout: float = 120.0, step_timeout: float = 900.0,
                 lost_after: float = 1.0):
        super().__init__(0, world, master, leader=True, heartbeat_interval=heartbeat_interval,
                         heartbeat_timeout=heartbeat_timeout, start_timeout=start_timeout, lost_after=lost_after)
        self.step_timeout = step_timeout
        self._digests: dict[tuple[int, int], bytes] = {}
        self._last: Digest | None = None
        try:
            self._handshake()
        except BaseException:
            self.hb.stop(bye=False)
            self.sock.close(1000)      # time for an Error telling the other rank why
            self.ctx.term()
            self._closed = True
            raise

    def _handshake(self) -> None:
        hosts = {0: host_identity()}
        pids: dict[int, int] = {}
        deadline = time.monotonic() + self.start_timeout
        while len(hosts) < self.world:
            got = self._recv(deadline - time.monotonic())
            if got is None:
                missing = [r for r in range(1, self.world) if r not in hosts]
                raise StartTimeout(f"rank(s) {missing} did not connect to {_endpoint(self.host, self.port)} within "
                                   f"{self.start_timeout:g} s (start_timeout): start them with the same --master")
            sender, msg = got
            if not isinstance(msg, Hello):
                continue                       # a stale frame from an earlier session
            if msg.version != WIRE_VERSION:
                self._send_to(sender, Error(0, f"wire version {msg.version} != rank 0's {WIRE_VERSION}"))
                raise ProtocolError(f"rank {msg.rank} speaks wire version {msg.version}, rank 0 {WIRE_VERSION}")
            if msg.world != self.world or msg.rank != sender:
                self._send_to(sender, Error(0, f"world/rank mismatch: rank 0 has world {self.world}"))
                raise ProtocolError(f"rank {msg.rank} (socket identity {sender}) says world {msg.world}, rank 0 "
                                    f"has world {self.world}")
            hosts[msg.rank] = msg.host
            pids[msg.rank] = msg.pid
        self.session = secrets.token_hex(8)
        self.same_host = len(set(hosts.values())) == 1
        for r in range(1, self.world):
            self._send_to(r, Hello(WIRE_VERSION, 0, self.world, hosts[0], os.getpid(), self.session, self.same_host))
            if hosts[r] == hosts[0]:
                self.hb.watch(r, pids[r])
        self.hb.arm()

    def _send_to(self, rank: int, msg) -> None:
        self._send_raw(rank, encode(msg))

    def _send_raw(self, rank: int, data: bytes) -> None:
        try:
            self.sock.send_multipart([f"rank{rank}".encode(), data])
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise RankLost(rank, "its connection is gone") from None
            raise CommError(f"send to rank {rank}: {e}") from None

    def _send_all(self, data: bytes) -> None:
        for r in range(1, self.world):
            self._send_raw(r, data)

    def send(self, plan: StepPlan) -> None:
        """Validate and send one plan to every follower. If the plan carries no `prev`, the last digest this leader
        verified goes with it, so followers check rank 0 as rank 0 checks them."""
        if self.hb.lost is not None:
            raise self.hb.lost
        plan.validate()
        if plan.prev is None and self._last is not None and self._last.round < plan.round:
            plan = msgspec.structs.replace(plan, prev=self._last)
        self._send_all(encode(plan))

    def send_ahead(self, plan: StepPlan) -> None:
        """Tell every follower the decode rows of the round queued behind the running one (`Ahead`; every row one
        PENDING token wanting its logits), so each builds that round's table while its device runs this one."""
        if self.hb.lost is not None:
            raise self.hb.lost
        if any(r.ids != [PENDING] or r.logits != [0] or r.draft for r in plan.rows):
            raise CommError(f"round {plan.round}: only rounds of PENDING decode rows are told ahead")
        self._send_all(encode(Ahead(plan.round, [(r.seq, r.start) for r in plan.rows])))

    def collect(self, round: int) -> dict[int, bytes]:
        """Every follower's digest of `round` (waits up to step_timeout; raises RankLost / RemoteError)."""
        deadline = time.monotonic() + self.step_timeout
        while True:
            missing = [r for r in range(1, self.world) if (round, r) not in self._digests]
            if not missing:
                return {r: self._digests.pop((round, r)) for r in range(1, self.world)}
            got = self._recv(deadline - time.monotonic())
            if got is None:
                raise RankLost(missing[0], f"no digest for round {round} within {self.step_timeout:g} s "
                                           f"(step_timeout)")
            sender, msg = got
            if isinstance(msg, RoundDigest) and msg.rank == sender:
                self._digests[(msg.round, msg.rank)] = msg.value
            elif isinstance(msg, Error):
                raise RemoteError(sender, msg.message)
            elif isinstance(msg, Shutdown):
                raise RankLost(sender, "it shut down while rank 0 was running")

    def verify(self, round: int, digest: bytes) -> None:
        """Compare rank 0's digest of `round` with every follower's; a difference is DigestMismatch (fatal)."""
        self._last = Digest(round, digest)
        for r, d in self.collect(round).items():
            if d != digest:
                raise DigestMismatch(round, r, digest, d)

    def shutdown(self) -> None:
        """Tell followers to stop (their recv() returns None), then close."""
        if not self._closed:
            for r in range(1, self.world):
                try:
                    self._send_to(r, Shutdown(0))
                except CommError:
                    pass
        self.close()

    def fail(self, message: str) -> None:
        """Tell followers why rank 0 is going down (they raise RemoteError(0, message))."""
        if not self._closed:
            for r in range(1, self.world):
                try:
                    self._send_to(r, Error(0, message))
                except CommError:
                    pass


class Follower(_Channel):
    """Rank r's end (r >= 1). `recv()` the next plan, `reply(round, digest)` after running it."""

    def __init__(self, master: str, rank: int = 1, world: int = 2, *, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 30.0, start_timeout: float = 120.0, lost_after: float = 1.0):
        if rank < 1:
            raise CommError(f"a follower has rank >= 1, got {rank}")
        super().__init__(rank, world, master, leader=False, heartbeat_interval=heartbeat_interval,
                         heartbeat_timeout=heartbeat_timeout, start_timeout=start_timeout, lost_after=lost_after)
        self._mine: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._held: collections.deque = collections.deque()    # read by poll_ahead, not an Ahead: recv's next
        try:
            self._handshake()
        except BaseException:
            self.hb.stop(bye=False)
            self.sock.close(1000)      # time for an Error telling the other rank why
            self.ctx.term()
            self._closed = True
            raise

    def _handshake(self) -> None:
        self.sock.send(encode(Hello(WIRE_VERSION, self.rank, self.world, host_identity(), os.getpid())))
        deadline = time.monotonic() + self.start_timeout
        while True:
            got = self._recv(deadline - time.monotonic())
            if got is None:
                raise StartTimeout(f"rank 0 did not answer at {_endpoint(self.host, self.port)} within "
                                   f"{self.start_timeout:g} s (start_timeout): is rank 0 started with this --master?")
            _, msg = got
            if isinstance(msg, Error):
                raise RemoteError(0, msg.message)
            if isinstance(msg, Hello):
                break
        if msg.version != WIRE_VERSION:
            raise ProtocolError(f"rank 0 speaks wire version {msg.version}, rank {self.rank} {WIRE_VERSION}")
        self.session, self.same_host = msg.session, msg.same_host
        if self.same_host:
            self.hb.watch(0, msg.pid)
        self.hb.arm()

    def recv(self, timeout: float | None = None, idle_s: float = 0.0, on_idle=None) -> StepPlan | None:
        """The next plan (validated, and rank 0's `prev` digest checked against this rank's own), or None when rank
        0 shut down cleanly. Waits forever by default: liveness is the heartbeat's business. `on_idle()` is called
        once when no plan has come for `idle_s` seconds (the follower hands its freed heap back then)."""
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        idle_at = t0 + idle_s if on_idle is not None else None
        while True:
            if self._held:
                got = self._held.popleft()
            else:
                left = _SLICE_S * 4 if deadline is None else deadline - time.monotonic()
                if idle_at is not None:
                    left = min(left, idle_at - time.monotonic())
                got = self._recv(max(left, 0.0))
            if got is None:
                if idle_at is not None and time.monotonic() >= idle_at:
                    idle_at = None
                    on_idle()
                    continue
                if deadline is None:
                    continue
                raise CommError(f"rank {self.rank}: no plan within {timeout:g} s")
            _, msg = got
            if isinstance(msg, StepPlan):
                plan = msg.validate()
                if plan.prev is not None and plan.prev.round in self._mine:
                    mine = self._mine[plan.prev.round]
                    if mine != plan.prev.value:
                        raise DigestMismatch(plan.prev.round, self.rank, plan.prev.value, mine)
                return plan
            if isinstance(msg, Shutdown):
                return None
            if isinstance(msg, Error):
                raise RemoteError(0, msg.message)

    def poll_ahead(self) -> StepPlan | None:
        """Rank 0's `Ahead` for a coming round, as the runner's upcoming plan (Ahead.plan), if one has arrived; never
        waits. Anything else read here (an Error, a Shutdown) is held for recv(); an Ahead that recv() meets instead
        (it came after the round it was for had started) is dropped there."""
        while (got := self._recv(0.0)) is not None:
            if isinstance(got[1], Ahead):
                return got[1].plan()
            self._held.append(got)
        return None

    def reply(self, round: int, digest: bytes) -> None:
        self._mine[round] = digest
        while len(self._mine) > _KEEP_DIGESTS:
            self._mine.popitem(last=False)
        self.sock.send(encode(RoundDigest(round, self.rank, digest)))

    def fail(self, message: str) -> None:
        """Tell rank 0 why this rank is going down (rank 0 raises RemoteError(rank, message))."""
        if not self._closed:
            try:
                self.sock.send(encode(Error(self.rank, message)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
