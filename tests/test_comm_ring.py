"""The tensor ring with two real processes (CPU): all_reduce_sum over the shared-memory ring and over gloo gives the
same bits on both ranks, equal to the rank-order sum computed locally, whichever rank is faster; all_gather and
broadcast are exact; a dead peer is named."""
import hashlib
import multiprocessing as mp
import os
import time

import pytest
import torch

from dsv41.comm.channel import Follower, Leader
from dsv41.comm.plan import CommError, RankLost
from dsv41.comm.ring import ShmRing, choose_transport, open_ring, rank_order_sum

from test_comm_channel import free_master

CTX = mp.get_context("spawn")
# the channel only hands out the session here; a lenient heartbeat keeps a starved CI host from failing the ring test
HB = dict(heartbeat_interval=0.5, heartbeat_timeout=60.0)
HIDDEN = 5120
CASES = [(rows, dtype) for rows in (1, 3, 17, 64) for dtype in (torch.float32, torch.bfloat16)]


def partial(case: int, rank: int, rows: int, dtype) -> torch.Tensor:
    """Rank `rank`'s partial for one case; every process can make every rank's (seeded)."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    return (torch.randn(rows, HIDDEN, generator=g) * (1 + 1000 * rank)).to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def ring_worker(rank: int, master: str, q, device: str = "cpu"):
    torch.set_num_threads(1)
    rings = [(True, None), (False, None)]           # (same host, transport): shm and gloo
    if device == "cuda":
        n = torch.cuda.device_count()
        torch.cuda.set_device(rank % n)
        device = f"cuda:{rank % n}"
        # cuda-ipc (or the registered shm ring where the GPUs cannot peer), the registered shm ring, and nccl,
        # which refuses two ranks on one GPU
        rings = [(True, None), (True, "shm-cuda")] + ([(False, None)] if n >= 2 else [])
    try:
        ch = Leader(master, 2, start_timeout=30, **HB) if rank == 0 else Follower(master, 1, 2, start_timeout=30,
                                                                                   **HB)
        out = {}
        for same_host, transport in rings:
            # a 64 KiB slot sends the 64-row tensors in 20 pieces: the piecewise path is part of the test
            ring = open_ring(rank, 2, device, master=master, session=ch.session, same_host=same_host, timeout=30,
                             capacity=64 << 10, transport=transport)
            for i, (rows, dtype) in enumerate(CASES):
                parts = [partial(i, r, rows, dtype).to(device) for r in range(2)]
                if i % 3 == rank:
                    time.sleep(0.005)           # one rank late: the result must not care
                s = ring.all_reduce_sum(parts[rank])
                g = ring.all_gather(parts[rank])
                b = ring.broadcast(parts[1] if rank == 1 else torch.empty_like(parts[1]), src=1)
                out[(ring.kind, i)] = (digest(s.cpu()), torch.equal(s, rank_order_sum(parts)),
                                       torch.equal(g, torch.stack(parts)), torch.equal(b, parts[1]), s.dtype)
            empty = torch.empty(3, 0, device=device)     # a round with no rows of some kind: no bytes, same shape
            out[(ring.kind, "empty")] = [tuple(ring.all_gather(empty).shape), tuple(ring.all_reduce_sum(empty).shape),
                                         tuple(ring.broadcast(empty, src=1).shape)]
            odd = torch.arange(7, dtype=torch.float32, device=device) + rank
            out[(ring.kind, "odd")] = ring.all_reduce_sum(odd).tolist()
            big = partial(99, rank, 2048, torch.float32).to(device)    # a prompt chunk: 42 MB, 640 pieces
            out[(ring.kind, "big")] = digest(ring.all_reduce_sum(big).cpu())
            ring.close()
        if rank == 0:
            ch.shutdown()
        else:
            assert ch.recv(timeout=30) is None
            ch.close()
        if device != "cpu":
            q.put((rank, out))
            return
        # a dead peer: rank 1 takes part in one op, then exits without a word
        ring = ShmRing(rank, 2, ch.session + "dead", timeout=30)
        ring.all_reduce_sum(torch.ones(4))
        if rank == 1:
            q.put((rank, out))
            q.close()
            q.join_thread()
            os._exit(0)
        t0 = time.monotonic()
        try:
            ring.all_reduce_sum(torch.ones(4))
            out["dead"] = None
        except RankLost as e:
            out["dead"] = (e.rank, str(e), time.monotonic() - t0)
        q.put((rank, out))
    except BaseException as e:
        q.put((rank, repr(e)))
        raise


def run_pair(device: str) -> dict:
    master = free_master()
    q = CTX.Queue()
    ps = [CTX.Process(target=ring_worker, args=(r, master, q, device)) for r in (1, 0)]
    for p in ps:
        p.start()
    try:
        res = dict(q.get(timeout=120) for _ in ps)
    finally:
        for p in ps:
            p.join(10)
            p.kill()
    assert isinstance(res[0], dict) and isinstance(res[1], dict), res
    return res


def check_pair(res: dict, kinds: tuple[str, str]) -> None:
    for kind in kinds:
        for i, (rows, dtype) in enumerate(CASES):
            d0, sum_ok0, gather_ok0, bcast_ok0, dt = res[0][(kind, i)]
            d1, sum_ok1, gather_ok1, bcast_ok1, _ = res[1][(kind, i)]
            assert sum_ok0 and sum_ok1, (kind, rows, dtype)           # == local rank-order sum
            assert d0 == d1, (kind, rows, dtype)                        # same bits on both ranks
            assert gather_ok0 and gather_ok1 and bcast_ok0 and bcast_ok1, (kind, rows, dtype)
            assert dt == dtype
            parts = [partial(i, r, rows, dtype) for r in range(2)]
            assert d0 == digest(rank_order_sum(parts))                  # == the CPU's rank-order sum, any transport
        assert res[0][(kind, "empty")] == res[1][(kind, "empty")] == [(2, 3, 0), (3, 0), (3, 0)]
        assert res[0][(kind, "odd")] == res[1][(kind, "odd")] == [float(2 * x + 1) for x in range(7)]
        big = [partial(99, r, 2048, torch.float32) for r in range(2)]
        assert res[0][(kind, "big")] == res[1][(kind, "big")] == digest(rank_order_sum(big))


def test_all_reduce_sum_bit_identical_on_both_ranks_shm_and_gloo():
    res = run_pair("cpu")
    check_pair(res, ("shm", "gloo"))
    rank, msg, took = res[0]["dead"]
    assert rank == 1 and "rank 1 lost: its process" in msg and took < 5


@pytest.mark.gpu
def test_all_reduce_sum_bit_identical_on_gpus_cuda_ipc_registered_shm_and_nccl():
    """Two GPUs: cuda-ipc, the registered shm ring and nccl. One GPU: cuda-ipc and the registered shm ring with both
    ranks on it (IPC works within a device)."""
    res = run_pair("cuda")
    first = choose_transport("cuda", True)
    kinds = tuple(dict.fromkeys((first, "shm-cuda") + (("nccl",) if torch.cuda.device_count() >= 2 else ())))
    check_pair(res, kinds)


def test_transport_override_is_checked():
    with pytest.raises(CommError, match="no ring transport 'tcp'"):
        open_ring(0, 2, "cpu", master="127.0.0.1:1", session="x", same_host=True, transport="tcp")
    with pytest.raises(CommError, match="does not carry cpu tensors"):
        open_ring(0, 2, "cpu", master="127.0.0.1:1", session="x", same_host=True, transport="shm-cuda")


def test_atomics_found_once_under_concurrent_first_use():
    """Two rings opened from two threads at once both got the atomics (a lazy init once returned None to one)."""
    import threading
    from dsv41.comm import ring as ring_mod
    ring_mod._ATOMICS = False
    got = []
    ts = [threading.Thread(target=lambda: got.append(ring_mod._atomics())) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(got) == 8 and all(g is not None and g is got[0] for g in got)


def test_shm_ring_in_one_process_two_threads():
    """Two ranks as two threads of one process (the handshake does not care), plus the segment is gone after."""
    import threading
    out = {}

    def rank(r):
        with ShmRing(r, 2, f"threads{os.getpid()}", timeout=20, capacity=4096) as ring:
            parts = [partial(7, j, 3, torch.float32) for j in range(2)]
            out[r] = ring.all_reduce_sum(parts[r])

    ts = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    want = rank_order_sum([partial(7, j, 3, torch.float32) for j in range(2)])
    assert torch.equal(out[0], want) and torch.equal(out[1], want)
    assert not os.path.exists(f"/dev/shm/dsv41_shm_threads{os.getpid()}")


def test_a_ring_wait_ends_when_the_lane_finds_a_rank_lost():
    """A peer that never reaches the collective (stopped, hung) holds a ring wait until the ring's timeout; the
    lane's verdict (Ring.set_abort) ends it within the 10 ms check instead, with the lane's RankLost."""
    import threading
    rings, opened = {}, threading.Barrier(2)

    def open_rank(r):
        rings[r] = ShmRing(r, 2, f"abort{os.getpid()}", timeout=60, capacity=4096)
        opened.wait(20)

    ts = [threading.Thread(target=open_rank, args=(r,)) for r in (1, 0)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    verdict = []
    rings[0].set_abort(lambda: verdict[0] if verdict else None)
    threading.Timer(0.3, lambda: verdict.append(RankLost(1, "its process 1 is stopped"))).start()
    t0 = time.monotonic()
    with pytest.raises(RankLost, match="rank 1 lost: its process 1 is stopped"):
        rings[0].all_reduce_sum(torch.ones(4))          # rank 1 never calls it
    assert 0.3 <= time.monotonic() - t0 < 1.0
    for r in rings.values():
        r.close()


def test_registered_ring_data_path_on_cpu(monkeypatch):
    """shm-cuda's slot protocol (pieces, the copies around each op, the rank-order sum on the tensor's device) with
    three ranks in threads on CPU tensors: the CUDA calls it makes around that protocol (registration, stream syncs)
    are no-ops here, so what runs is the ring's own logic; the GPU test runs it for real."""
    import contextlib
    import secrets
    import threading

    from dsv41.comm import ring as R

    class _Stream:
        def synchronize(self):
            pass

    class _Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart())
    monkeypatch.setattr(torch.cuda, "check_error", lambda res: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    session, out = secrets.token_hex(4), {}

    def rank(r):
        ring = R.RegisteredShmRing(r, 3, session, torch.device("cpu"), capacity=4096, timeout=20)
        try:
            res = []
            for i, (rows, dt) in enumerate([(1, torch.float32), (7, torch.bfloat16), (64, torch.float32)]):
                parts = [partial(50 + i, j, rows, dt) for j in range(3)]     # 64 rows: 320 pieces of 4 KiB
                s = ring.all_reduce_sum(parts[r])
                g = ring.all_gather(parts[r])
                b = ring.broadcast(parts[2] if r == 2 else torch.empty_like(parts[2]), src=2)
                res.append((torch.equal(s, rank_order_sum(parts)), torch.equal(g, torch.stack(parts)),
                            torch.equal(b, parts[2])))
            out[r] = res
        finally:
            ring.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert out == {r: [(True, True, True)] * 3 for r in range(3)}
