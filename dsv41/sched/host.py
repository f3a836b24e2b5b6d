"""What the server asks of its host process: the heap handed back when idle, the OS names of its threads.

Both through glibc / Linux calls by ctypes; where they are missing (another libc, another OS) each is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:
    _libc = None
_trim = getattr(_libc, "malloc_trim", None)
if _trim is not None:
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
_prctl = getattr(_libc, "prctl", None)
_PR_SET_NAME = 15

IDLE_TRIM_S = 0.5     # seconds idle after a busy spell before the freed heap is handed back (scheduler, follower)


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the system (glibc keeps what was freed in its arenas, so a server's
    resident size would stay at its busiest minute's); False where there is no malloc_trim. Called by the scheduler
    once idle after a busy spell and by the API after a large body (api/limits.py)."""
    if _trim is None:
        return False
    _trim(0)
    return True


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its Python name as the OS sees it (/proc/PID/task/TID/comm, top -H, py-spy), at most
    15 bytes: the per-thread CPU of a served round (bench/http_rate.py) then tells the round thread from torch's
    and the Engram readers'. A ThreadPoolExecutor's initializer."""
    if _prctl is None:
        return
    raw = (name or threading.current_thread().name).encode()[:15]
    _prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)
