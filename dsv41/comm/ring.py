"""Tensor exchange between ranks behind one interface, `Ring`.

Exactness: `all_reduce_sum` is an all-gather followed by a sum of the partials **in rank order**
(`((p0 + p1) + p2) ...`, elementwise in the tensor's dtype), so the result has the same bits on every rank and does
not depend on which rank was faster or on the transport. `rank_order_sum` is that sum, for tests and callers.

Transports, chosen once at start by `choose_transport(device, same_host)`:
- "shm"       CPU, one host: a shared-memory segment of preallocated slots (two per rank, used alternately) and one
              sequence counter per rank. Op k: write my slot k%2, publish seq=k (store-release), wait until every
              seq >= k (load-acquire; spin, then yield), read every slot k%2. A rank can only start op k+2 (the next
              write of slot k%2) after all ranks published k+1, i.e. after they finished reading op k: two slots and
              the counters are the whole handshake. Larger tensors go through in slot-sized pieces.
- "gloo"      CPU across hosts: torch.distributed all_gather_into_tensor on the bytes, then the rank-order sum.
- "shm-cuda"  GPU, one host, where the ranks' GPUs cannot reach each other by CUDA IPC (no peer access, or each
              process sees only its own GPU): the "shm" segment, registered with the GPU (cudaHostRegister), so the
              GPU copies a tensor into its slot and the other ranks' slots back by DMA, no staging copy; the
              rank-order sum runs on the GPU.
- "cuda-ipc"  GPU, one host: the same counters in host shared memory; each rank owns a device buffer of two slots x
              world regions and *pushes* its tensor into region [rank] of every rank's buffer (CUDA IPC handle,
              peer copy on the pusher's stream), records an interprocess event "ready[slot]"; readers wait for it
              on their stream, sum their own buffer's regions in rank order, and record "done[slot]", which a pusher
              waits on before it overwrites that slot two ops later. The CPU never waits for the GPU.
- "nccl"      GPU across hosts: torch.distributed NCCL, like gloo.

Ports: the torch.distributed store listens on the --master port + 2 (channel.py uses PORT and PORT+1). The shared
memory segment is named from the channel's session id, unique per start, so stale segments are never attached.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import pickle
import platform
import threading
import time
import warnings
from datetime import timedelta

import torch

from dsv41.comm.plan import CommError, RankLost, StartTimeout

DEFAULT_CAPACITY = 8 << 20        # bytes per slot: 64 rows x 5120 x fp32 is 1.25 MiB; bigger tensors go in pieces
_MAGIC = 0x64737634315F5247       # "dsv41_RG"
_LINE = 64                        # one cache line per rank's counters (no false sharing)
_BLOB = 4096                      # per-rank area for the CUDA ring's pickled IPC handles
_SPIN = 200                       # busy polls (~50 µs) before yielding the CPU
_SHM_DIR = "/dev/shm"


def rank_order_sum(parts) -> torch.Tensor:
    """p0 + p1 + ... in rank order, elementwise in the parts' dtype (a new tensor)."""
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


TRANSPORTS = ("shm", "gloo", "shm-cuda", "cuda-ipc", "nccl")


def cuda_peers_reach(world: int) -> bool:
    """Whether every pair of the GPUs ranks 0..world-1 take on this host (rank r: cuda:(r mod visible GPUs), as
    follower_device picks) can reach each other by CUDA IPC: the same GPU, or peer access. Every rank of a host
    with the same CUDA_VISIBLE_DEVICES computes the same answer."""
    n = torch.cuda.device_count()
    if n == 0:
        return False
    devs = sorted({r % n for r in range(world)})
    return all(a == b or torch.cuda.can_device_access_peer(a, b) for a in devs for b in devs)


def choose_transport(device: str | torch.device, same_host: bool, world: int = 2) -> str:
    dev = torch.device(device).type
    if dev == "cpu":
        return "shm" if same_host and _atomics() is not None else "gloo"
    if dev == "cuda":
        if not same_host:
            return "nccl"
        return "cuda-ipc" if cuda_peers_reach(world) else "shm-cuda"
    raise CommError(f"no ring transport for device type {dev!r}")


def open_ring(rank: int, world: int, device: str | torch.device, *, master: str, session: str, same_host: bool,
              timeout: float = 300.0, capacity: int = DEFAULT_CAPACITY, transport: str | None = None) -> "Ring":
    """The ring for this lane: `master` and `session`/`same_host` come from the channel (Leader/Follower).
    `transport`: one of TRANSPORTS instead of choose_transport's pick (benches and tests; every rank must pass the
    same one)."""
    from dsv41.comm.channel import parse_master
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:      # peers and NCCL need the index, not "the current one"
        device = torch.device("cuda", torch.cuda.current_device())
    kind = transport or choose_transport(device, same_host, world)
    if kind not in TRANSPORTS:
        raise CommError(f"no ring transport {kind!r} (one of {', '.join(TRANSPORTS)})")
    if (kind in ("shm", "gloo")) != (device.type == "cpu"):
        raise CommError(f"ring transport {kind!r} does not carry {device.type} tensors")
    if kind == "shm":
        return ShmRing(rank, world, session, capacity=capacity, timeout=timeout)
    if kind == "shm-cuda":
        return RegisteredShmRing(rank, world, session, device, capacity=capacity, timeout=timeout)
    if kind == "cuda-ipc":
        return CudaIpcRing(rank, world, session, device, capacity=capacity, timeout=timeout)
    host, port = parse_master(master)
    return DistRing(rank, world, kind, host, port + 2, timeout=timeout, device=device)


class Ring:
    kind = "?"
    rank: int
    world: int

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's t, in rank order (same on every rank)."""
        raise NotImplementedError

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The rank-order sum of every rank's t (a new tensor, same bits on every rank)."""
        return rank_order_sum(self.all_gather(t))

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's t on every rank (same shape and dtype everywhere; a new tensor except on src)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def set_abort(self, check) -> None:
        """`check()` -> an exception or None, looked at while this ring waits for another rank (every 10 ms on the
        shared-memory transports): a lane that knows a rank is lost (its process stopped, its socket closed) ends a
        collective at once instead of after the ring's timeout. The torch.distributed rings cannot be interrupted;
        they keep their own timeout."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _skip_empty(op):
    """A collective on a zero-element tensor sends nothing and takes no round: every rank runs the same plan, so
    every rank calls it with the same empty shape (and a 0-byte buffer cannot be viewed as another dtype)."""
    @functools.wraps(op)
    def wrapped(self, t: torch.Tensor, *args, **kw):
        if t.numel() == 0:
            return t.new_empty((self.world, *t.shape) if op.__name__ == "all_gather" else t.shape)
        return op(self, t, *args, **kw)
    return wrapped


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------------------- torch.distributed

class DistRing(Ring):
    """torch.distributed (gloo on CPU, NCCL on GPU); the store on host:port (rank 0 listens, the others retry)."""

    def __init__(self, rank: int, world: int, backend: str, host: str, port: int, *, timeout: float = 300.0,
                 device: str | torch.device = "cpu"):
        import torch.distributed as dist
        # all_gather_into_tensor is what both gloo and NCCL run on every torch we support; hush its rename notice
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated", category=FutureWarning)
        self.dist, self.rank, self.world, self.kind = dist, rank, world, backend
        self.device = torch.device(device)
        if backend == "nccl":
            torch.cuda.set_device(self.device)     # NCCL binds the process group to the current device
        try:
            store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout))
        except Exception as e:       # DistStoreError, RuntimeError: name the rendezvous
            raise StartTimeout(f"rank {rank}: torch.distributed {backend} rendezvous at {host}:{port} failed: "
                               f"{e}") from None

    @_skip_empty
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        b = _as_bytes(t)
        out = torch.empty(self.world * b.numel(), dtype=torch.uint8, device=b.device)
        self.dist.all_gather_into_tensor(out, b)
        return out.view(self.world, -1).view(t.dtype).view(self.world, *t.shape)

    @_skip_empty
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        buf = t.contiguous() if self.rank == src else torch.empty_like(t, memory_format=torch.contiguous_format)
        self.dist.broadcast(_as_bytes(buf), src)
        return buf

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- shared memory

_ATOMICS: object = False
_ATOMICS_LOCK = threading.Lock()


def _atomics():
    """(load_acquire(addr), store_release(addr, v)) for u64 in shared memory, or None where we have none.
    libatomic's __atomic_load_8/__atomic_store_8 give real acquire/release on any CPU (GB10 is ARM); on x86-64
    plain loads and stores are already ordered that way (TSO), so that is the fallback there."""
    global _ATOMICS
    with _ATOMICS_LOCK:
        if _ATOMICS is False:
            _ATOMICS = _find_atomics()
        return _ATOMICS


def _find_atomics():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("atomic") or "libatomic.so.1")
        load, store = lib.__atomic_load_8, lib.__atomic_store_8
        load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
        store.argtypes, store.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int], None
        return (lambda a: load(a, 2), lambda a, v: store(a, v, 3))        # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE
    except (OSError, AttributeError):
        if platform.machine() in ("x86_64", "AMD64"):
            return (lambda a: ctypes.c_uint64.from_address(a).value,
                    lambda a, v: setattr(ctypes.c_uint64.from_address(a), "value", v))
        return None


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False


class _Control:
    """The shared segment's header: magic, world, capacity; per rank a line (seq, pid, joined) and a blob area;
    then `data_bytes` of data. Rank 0 creates /dev/shm/dsv41_<tag>_<session>, the others open it (retrying until
    it exists), and rank 0 unlinks the name once all joined: the mapping lives on, nothing leaks if a rank dies.
    (Plain mmap rather than multiprocessing.shared_memory: its resource tracker would unlink or warn at exit.)"""

    def __init__(self, rank: int, world: int, session: str, data_bytes: int, timeout: float, tag: str):
        if not session:
            raise CommError("the ring needs the channel's session id (Leader/Follower.session)")
        if world < 2 or not 0 <= rank < world:
            raise CommError(f"a ring needs world >= 2 and 0 <= rank < world, got rank {rank} of {world}")
        self.rank, self.world, self.timeout = rank, world, timeout
        self.abort = None                # Ring.set_abort's check
        self.load, self.store = _atomics() or (None, None)
        if self.load is None:
            raise CommError(f"no shared-memory atomics on {platform.machine()}: use the gloo ring")
        self.blob_off = _LINE * (1 + world)
        self.data_off = -(-(self.blob_off + _BLOB * world) // 4096) * 4096
        size = self.data_off + data_bytes
        name = f"dsv41_{tag}_{session}"
        self.path = os.path.join(_SHM_DIR, name)
        deadline = time.monotonic() + timeout
        if rank == 0:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        else:
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                    if os.fstat(fd).st_size == size:
                        break
                    os.close(fd)       # rank 0 has not sized it yet, or it is for another shape
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise StartTimeout(f"rank {rank}: rank 0 did not create the ring segment {self.path} "
                                       f"({size} bytes) within {timeout:g} s")
                time.sleep(0.01)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            self._join(rank, world, data_bytes, name, deadline)
        except BaseException:
            self.close()
            if rank == 0:
                self._unlink()
            raise

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _join(self, rank: int, world: int, data_bytes: int, name: str, deadline: float) -> None:
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.addr = self.base.data_ptr()
        if rank == 0:
            self.store(self.addr + 8, world)
            self.store(self.addr + 16, data_bytes)
            self.store(self.addr, _MAGIC)
        else:
            while self.load(self.addr) != _MAGIC:
                if time.monotonic() > deadline:
                    raise StartTimeout(f"rank {rank}: ring segment {name} was never initialised")
                time.sleep(0.001)
            if self.load(self.addr + 8) != world or self.load(self.addr + 16) != data_bytes:
                raise CommError(f"rank {rank}: ring segment {name} is for world {self.load(self.addr + 8)} / "
                                f"{self.load(self.addr + 16)} data bytes, not {world} / {data_bytes}")
        self.store(self._line(rank) + 8, os.getpid())
        self.store(self._line(rank) + 16, 1)
        self.pids = {}
        for j in range(world):
            while self.load(self._line(j) + 16) != 1:
                if time.monotonic() > deadline:
                    raise StartTimeout(f"rank {j} did not join the ring segment {name} within {self.timeout:g} s")
                time.sleep(0.001)
            self.pids[j] = self.load(self._line(j) + 8)
        if rank == 0:
            self._unlink()           # everyone has it mapped: nothing to leak if a rank dies from here on

    def _line(self, r: int) -> int:
        return self.addr + _LINE * (1 + r)

    def blob(self, r: int) -> torch.Tensor:
        return self.base[self.blob_off + _BLOB * r: self.blob_off + _BLOB * (r + 1)]

    def data(self, offset: int, n: int) -> torch.Tensor:
        return self.base[self.data_off + offset: self.data_off + offset + n]

    def publish(self, k: int) -> None:
        self.store(self._line(self.rank), k)

    def wait(self, k: int) -> None:
        """Until every rank published op >= k; a dead peer (same host: its pid) or the timeout -> RankLost."""
        for j in range(self.world):
            if j == self.rank:
                continue
            addr = self._line(j)
            n = 0
            t0 = None
            while self.load(addr) < k:
                n += 1
                if n < _SPIN:
                    continue
                now = time.monotonic()
                if t0 is None:
                    t0 = now
                    next_check = now + 0.01
                elif now >= next_check:
                    if self.abort is not None and (err := self.abort()) is not None:
                        raise err
                    if _process_gone(self.pids[j]):
                        raise RankLost(j, f"its process {self.pids[j]} exited (ring op {k})")
                    if now - t0 > self.timeout:
                        raise RankLost(j, f"did not reach ring op {k} within {self.timeout:g} s")
                    next_check = now + 0.01
                if now - t0 < 0.001:
                    os.sched_yield()
                else:
                    time.sleep(50e-6)

    def close(self) -> None:
        self.base = None
        try:
            self.mm.close()
        except BufferError:
            pass                     # a caller still holds a view; the mapping goes with the process


class ShmRing(Ring):
    """CPU ring over one host's shared memory (see the module text for the handshake)."""
    kind = "shm"

    def __init__(self, rank: int, world: int, session: str, *, capacity: int = DEFAULT_CAPACITY,
                 timeout: float = 300.0, tag: str = "shm"):
        self.rank, self.world = rank, world
        self.cap = -(-capacity // 64) * 64
        self.ctl = _Control(rank, world, session, world * 2 * self.cap, timeout, tag)
        self.op = 0
        self.slots = [[self.ctl.data((r * 2 + s) * self.cap, self.cap) for s in (0, 1)] for r in range(world)]

    def _slot(self, r: int, k: int) -> torch.Tensor:
        return self.slots[r][k % 2]

    def set_abort(self, check) -> None:
        self.ctl.abort = check

    def _pieces(self, nbytes: int, esize: int):
        step = self.cap // esize * esize
        return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)] or [(0, 0)]

    def _round(self, src_bytes: torch.Tensor | None, a: int, b: int) -> int:
        """One op: write my piece [a, b) (if any), publish, wait for all; returns the op number (slot k % 2)."""
        self.op += 1
        k = self.op
        if src_bytes is not None:
            self._slot(self.rank, k)[: b - a].copy_(src_bytes[a:b])
        self.ctl.publish(k)
        self.ctl.wait(k)
        return k

    @_skip_empty
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        src = _as_bytes(t)
        out = torch.empty(self.world, src.numel(), dtype=torch.uint8)
        for a, b in self._pieces(src.numel(), t.element_size()):
            k = self._round(src, a, b)
            for j in range(self.world):
                out[j, a:b] = self._slot(j, k)[: b - a]
        return out.view(t.dtype).view(self.world, *t.shape)

    @_skip_empty
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        src = _as_bytes(t)
        out = torch.empty(t.shape, dtype=t.dtype)
        flat = out.view(-1)
        es = t.element_size()
        for a, b in self._pieces(src.numel(), es):
            k = self._round(src, a, b)
            acc = flat[a // es: b // es]
            part = [self._slot(j, k)[: b - a].view(t.dtype) for j in range(self.world)]
            torch.add(part[0], part[1], out=acc)            # one pass for p0 + p1, then the rest in rank order
            for p in part[2:]:
                acc.add_(p)
        return out

    @_skip_empty
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        mine = _as_bytes(t) if self.rank == src else None
        out = t.contiguous().clone() if self.rank == src else torch.empty(t.shape, dtype=t.dtype)
        ob = out.view(-1).view(torch.uint8)
        for a, b in self._pieces(ob.numel(), t.element_size()):
            k = self._round(mine, a, b)
            if self.rank != src:
                ob[a:b] = self._slot(src, k)[: b - a]
        return out

    def close(self) -> None:
        if self.ctl is not None:
            self.slots = []
            self.ctl.close()
            self.ctl = None


class RegisteredShmRing(ShmRing):
    """The shm ring for GPU tensors: the segment is registered with the GPU (cudaHostRegister, portable), so a
    tensor goes from the GPU into this rank's slot, and every rank's slot back to the GPU, as direct DMA copies
    (pageable memory would be staged through a driver buffer). The CPU publishes its counter once its copy is done
    (the stream is synchronised: the partial must be in the slot before anyone reads it); the copies back are
    queued on the stream, and are done before this rank publishes its next op, so no slot is overwritten while
    they read it. The rank-order sum runs on the GPU (elementwise adds: the CPU's bits)."""
    kind = "shm-cuda"

    def __init__(self, rank: int, world: int, session: str, device: torch.device, *,
                 capacity: int = DEFAULT_CAPACITY, timeout: float = 300.0):
        self.device = device
        self._registered = 0
        super().__init__(rank, world, session, capacity=capacity, timeout=timeout, tag="shmcuda")
        size = self.ctl.mm.size()
        try:
            with torch.cuda.device(device):
                cudart = torch.cuda.cudart()
                # cudaHostRegisterPortable (1): pinned for every CUDA context of this process, not the current one
                torch.cuda.check_error(cudart.cudaHostRegister(self.ctl.addr, size, 1))
        except RuntimeError as e:        # torch.cuda.CudaError (e.g. a memlock limit)
            super().close()
            raise CommError(f"rank {rank}: cudaHostRegister of the ring segment ({size} bytes) failed: {e}") from None
        self._registered = self.ctl.addr

    def _round(self, src_bytes: torch.Tensor | None, a: int, b: int) -> int:
        self.op += 1
        k = self.op
        stream = torch.cuda.current_stream(self.device)
        if src_bytes is not None:
            self._slot(self.rank, k)[: b - a].copy_(src_bytes[a:b], non_blocking=True)
        stream.synchronize()            # our piece is in the slot, and our reads of op k-1 are done
        self.ctl.publish(k)
        self.ctl.wait(k)
        return k

    def _gather_piece(self, k: int, n: int) -> torch.Tensor:
        """[world, n] bytes of op k's slots on the GPU (DMA from the registered segment)."""
        out = torch.empty(self.world, n, dtype=torch.uint8, device=self.device)
        for j in range(self.world):
            out[j].copy_(self._slot(j, k)[:n], non_blocking=True)
        return out

    @_skip_empty
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        src = _as_bytes(t)
        out = torch.empty(self.world, src.numel(), dtype=torch.uint8, device=self.device)
        for a, b in self._pieces(src.numel(), t.element_size()):
            k = self._round(src, a, b)
            out[:, a:b] = self._gather_piece(k, b - a)
        return out.view(t.dtype).view(self.world, *t.shape)

    @_skip_empty
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        src = _as_bytes(t)
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        flat = out.view(-1)
        es = t.element_size()
        for a, b in self._pieces(src.numel(), es):
            k = self._round(src, a, b)
            part = self._gather_piece(k, b - a).view(t.dtype)
            acc = flat[a // es: b // es]
            torch.add(part[0], part[1], out=acc)            # p0 + p1, then the rest in rank order
            for j in range(2, self.world):
                acc.add_(part[j])
        return out

    @_skip_empty
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        mine = _as_bytes(t) if self.rank == src else None
        out = (t.contiguous().clone() if self.rank == src
               else torch.empty(t.shape, dtype=t.dtype, device=self.device))
        ob = out.view(-1).view(torch.uint8)
        for a, b in self._pieces(ob.numel(), t.element_size()):
            k = self._round(mine, a, b)
            if self.rank != src:
                ob[a:b].copy_(self._slot(src, k)[: b - a], non_blocking=True)
        return out

    def close(self) -> None:
        if self.ctl is not None and self._registered:
            torch.cuda.synchronize(self.device)          # no copy still reads the segment
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self._registered))
            self._registered = 0
        super().close()


# ---------------------------------------------------------------------------------------------------- CUDA IPC

class CudaIpcRing(Ring):
    """GPU ring for ranks on one host (every process must see every rank's GPU: same CUDA_VISIBLE_DEVICES; two ranks
    may share a GPU). Counters in host shared memory as in ShmRing; data pushed into every rank's device buffer
    through CUDA IPC; order on the GPU by interprocess events (module text)."""
    kind = "cuda-ipc"

    def __init__(self, rank: int, world: int, session: str, device: torch.device, *,
                 capacity: int = DEFAULT_CAPACITY, timeout: float = 300.0):
        from torch.multiprocessing.reductions import reduce_tensor
        self.rank, self.world, self.device = rank, world, device
        self.cap = -(-capacity // 256) * 256
        self.ctl = _Control(rank, world, session, 0, timeout, "cuda")
        self.op = 0
        with torch.cuda.device(device):
            self.buf = torch.zeros(2, world, self.cap, dtype=torch.uint8, device=device)
            self.ready = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            self.done = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            torch.cuda.synchronize(device)
            blob = pickle.dumps((device.index, reduce_tensor(self.buf), [e.ipc_handle() for e in self.ready],
                                 [e.ipc_handle() for e in self.done]))
        if len(blob) + 8 > _BLOB:
            raise CommError(f"CUDA IPC handles take {len(blob)} bytes, more than the {_BLOB - 8} reserved")
        area = self.ctl.blob(rank)
        area[8: 8 + len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        self.ctl.store(self.ctl.addr + self.ctl.blob_off + _BLOB * rank, len(blob))
        self.peer_buf, self.peer_ready, self.peer_done = {}, {}, {}
        deadline = time.monotonic() + timeout
        for j in range(world):
            if j == rank:
                continue
            while (n := self.ctl.load(self.ctl.addr + self.ctl.blob_off + _BLOB * j)) == 0:
                if time.monotonic() > deadline:
                    raise StartTimeout(f"rank {j} did not publish its CUDA IPC handles within {timeout:g} s")
                time.sleep(0.001)
            dev, (rebuild, args), ready, done = pickle.loads(bytes(self.ctl.blob(j)[8: 8 + n].numpy()))
            self.peer_buf[j] = rebuild(*args)
            self.peer_ready[j] = [torch.cuda.Event.from_ipc_handle(dev, h) for h in ready]
            self.peer_done[j] = [torch.cuda.Event.from_ipc_handle(dev, h) for h in done]

    def set_abort(self, check) -> None:
        self.ctl.abort = check

    def _push(self, src_bytes: torch.Tensor | None, n: int) -> tuple[int, torch.cuda.Stream]:
        self.op += 1
        k, s = self.op, self.op % 2
        stream = torch.cuda.current_stream(self.device)
        if src_bytes is not None:
            for j in self.peer_buf:
                stream.wait_event(self.peer_done[j][s])        # j has read what op k-2 left in its slot s
                self.peer_buf[j][s, self.rank, :n].copy_(src_bytes, non_blocking=True)
            self.buf[s, self.rank, :n].copy_(src_bytes, non_blocking=True)
        self.ready[s].record(stream)
        self.ctl.publish(k)
        self.ctl.wait(k)
        for j in self.peer_ready:
            stream.wait_event(self.peer_ready[j][s])
        return k, stream

    def _pieces(self, nbytes: int, esize: int):
        step = self.cap // esize * esize
        return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)] or [(0, 0)]

    @_skip_empty
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        src = _as_bytes(t)
        out = torch.empty(self.world, src.numel(), dtype=torch.uint8, device=self.device)
        for a, b in self._pieces(src.numel(), t.element_size()):
            k, stream = self._push(src[a:b], b - a)
            out[:, a:b] = self.buf[k % 2, :, : b - a]
            self.done[k % 2].record(stream)
        return out.view(t.dtype).view(self.world, *t.shape)

    @_skip_empty
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        src = _as_bytes(t)
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        flat = out.view(-1)
        es = t.element_size()
        for a, b in self._pieces(src.numel(), es):
            k, stream = self._push(src[a:b], b - a)
            acc = flat[a // es: b // es]
            part = [self.buf[k % 2, j, : b - a].view(t.dtype) for j in range(self.world)]
            torch.add(part[0], part[1], out=acc)
            for p in part[2:]:
                acc.add_(p)
            self.done[k % 2].record(stream)
        return out

    @_skip_empty
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        out = t.contiguous().clone() if self.rank == src else torch.empty(t.shape, dtype=t.dtype,
                                                                          device=self.device)
        ob = out.view(-1).view(torch.uint8)
        for a, b in self._pieces(ob.numel(), t.element_size()):
            k, stream = self._push(ob[a:b] if self.rank == src else None, b - a)
            if self.rank != src:
                ob[a:b] = self.buf[k % 2, src, : b - a]
            self.done[k % 2].record(stream)
        return out

    def close(self) -> None:
        if self.ctl is not None:
            torch.cuda.synchronize(self.device)
            self.ctl.wait(self.op)          # no rank still reads our buffer when we free it
            self.ctl.publish(self.op + 1)   # ... and tell them we are through
            self.ctl.wait(self.op + 1)
            self.peer_buf = self.peer_ready = self.peer_done = {}
            self.ctl.close()
            self.ctl = None
