"""What one request may cost the server (issue 27): its body, its tokenization and grammar, its memory.

- **The body** is read whole by the Guard middleware before any route runs (`read_body`): at most
  `--max-body-bytes` (a Content-Length above it is refused before a byte is read: 413), within `--body-timeout-s`
  from the request's start (408), and a client that goes away meanwhile is a client event (499 in the metrics, one
  log line, no traceback), not a server error. A refused body that is still coming is read and dropped (up to
  DRAIN_BYTES more, within the timeout) so the client can read the 413; a larger one gets the answer with
  `Connection: close`.
- **Tokenization and grammar compilation** run in worker threads (`off_loop`), never on the event loop, under a
  TokenBudget (dsv41/chat/tokenizer.py): text that cannot fit the context is refused before it is tokenized, or
  after about a context's worth of tokens, and the whole preparation has `--prepare-timeout-s`.
- **Memory**: after a request whose body was large, freed heap memory is handed back to the system
  (`trim_memory_soon`: glibc's malloc_trim in a worker thread), so a refused 50 MB body does not leave the process
  gigabytes larger.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dsv41.api.errors import ApiError, bad_request
from dsv41.sched.host import name_os_thread, release_free_heap

log = logging.getLogger("dsv41.api")

DRAIN_BYTES = 64 << 20          # a refused body still coming is read and dropped up to this much, then the reply closes
TRIM_AFTER_BYTES = 1 << 20      # bodies at least this large hand freed memory back once their request ends
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyError(ApiError):
    """The body could not be taken: too large (413), too slow (408), or the client went away (499)."""

    def __init__(self, status: int, message: str, code: str, received: int, close: bool = False):
        super().__init__(status, message, code=code,
                         headers={"Connection": "close"} if close else None)
        self.received = received


def _too_large(limit: int, size: int, known: bool) -> BodyError:
    what = f"{size} bytes" if known else f"more than {limit} bytes"
    return BodyError(413, f"the request body is {what}; this server takes at most {limit} bytes "
                          "(--max-body-bytes): shorten the prompt or send fewer or smaller images",
                     "request_too_large", 0)


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


async def _drain(receive, deadline: float, budget: int, err: BodyError) -> None:
    """Read and drop the rest of a refused body, so the client (which sends it all before it reads) gets the
    answer; past the deadline or `budget` bytes the answer closes the connection instead. err.received counts."""
    loop = asyncio.get_running_loop()
    got = 0
    while got <= budget:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            msg = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            break
        if msg["type"] != "http.request":
            break
        got += len(msg.get("body", b""))
        err.received += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return
    err.headers = {"Connection": "close"}


async def read_body(scope, receive, max_bytes: int, timeout_s: float):
    """The whole request body, read under the limits, as (a receive callable that replays it to the app, its
    size). Raises BodyError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    cl = _header(scope, b"content-length")
    size = int(cl) if cl is not None and cl.isdigit() else None
    if size is not None and size > max_bytes:
        err = _too_large(max_bytes, size, True)
        if size > DRAIN_BYTES or _header(scope, b"expect") is not None:   # too much to read, or not sent yet
            err.headers = {"Connection": "close"}
        else:
            await _drain(receive, deadline, size, err)
        raise err
    chunks: list[bytes] = []
    n = 0
    while True:
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            msg = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            raise BodyError(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout-s; "
                                 f"{n} bytes came)", "request_timeout", n, close=True) from None
        if msg["type"] == "http.disconnect":
            raise BodyError(499, "the client closed the connection while sending the request body",
                            "client_closed_request", n)
        body = msg.get("body", b"")
        n += len(body)
        if n > max_bytes:
            chunks.clear()
            err = _too_large(max_bytes, n, False)
            err.received = n
            if msg.get("more_body", False):
                await _drain(receive, deadline, DRAIN_BYTES, err)
            raise err
        if body:
            chunks.append(body)
        if not msg.get("more_body", False):
            break
    data = b"".join(chunks)
    chunks.clear()
    replayed = False

    async def replay():
        nonlocal replayed, data
        if not replayed:
            replayed = True
            out, data = data, b""
            return {"type": "http.request", "body": out, "more_body": False}
        return await receive()

    return replay, n


_gone_logged = False


def client_gone(path: str, err: BodyError) -> None:
    """One log line for the first client that leaves while sending its body; later ones at debug level (they are
    counted as requests_total{status="499"})."""
    global _gone_logged
    msg = "client closed the connection while sending its request body (%d bytes came) on %s: a client event, " \
          "counted as requests_total{status=\"499\"}"
    if not _gone_logged:
        _gone_logged = True
        log.info(msg + "; further ones are logged at debug level", err.received, path)
    else:
        log.debug(msg, err.received, path)


# ------------------------------------------------------------------------------------------------ preparation
_prep: ThreadPoolExecutor | None = None
_prep_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _prep
    with _prep_lock:
        if _prep is None:
            # two: one slow preparation does not hold up every other request's
            _prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dsv41-prep", initializer=name_os_thread)
        return _prep


async def off_loop(eng, fn, *args, limit: int | None = None, param: str | None = None, what: str = "prompt"):
    """`fn(*args)` in a preparation thread under a TokenBudget: `limit` tokens (the context: a prompt that reaches
    it is refused as context_length_exceeded, naming `param`), and --prepare-timeout-s from now for the whole
    call (tokenization stops at its next check; code that cannot stop, a grammar compile, is given up on and
    finishes in its thread). `what`: "prompt" (a timeout is 413) or "grammar" (400)."""
    from dsv41.chat.tokenizer import TokenBudget, TokenizeTimeout, TooManyTokens, token_budget
    timeout = eng.cfg.prepare_timeout_s
    budget = TokenBudget(limit, time.monotonic() + timeout)

    def work():
        with token_budget(budget):
            try:
                return fn(*args), None
            except (ApiError, TooManyTokens, TokenizeTimeout) as e:
                # a refusal comes back as a value without its traceback: the worker's frames hold the request's
                # text, and an exception raised through asyncio's futures would keep them in a reference cycle
                # until the next full garbage collection (+20 MB per refused 20 MB body, measured)
                _drop_tracebacks(e)
                return None, e

    fut = asyncio.get_running_loop().run_in_executor(_executor(), work)
    try:
        value, exc = await asyncio.wait_for(asyncio.shield(fut), timeout + 0.5)
    except asyncio.TimeoutError:
        value, exc = None, TokenizeTimeout()
    finally:
        fut = None
    if exc is None:
        return value
    try:
        if isinstance(exc, TooManyTokens):
            raise ApiError(400, f"This server's maximum context length is {exc.limit} tokens, but the prompt has at "
                                f"least {exc.count} tokens (counted before all of it was tokenized). Shorten the "
                                "prompt.", param=param, code="context_length_exceeded")
        if isinstance(exc, TokenizeTimeout):
            budget.cancelled = True              # a worker still running stops at its next check
            if what == "grammar":
                raise bad_request(f"compiling the request's grammar took longer than {timeout:g} s "
                                  "(--prepare-timeout-s); simplify its schema", param=param)
            raise ApiError(413, f"tokenizing the prompt took longer than {timeout:g} s (--prepare-timeout-s); "
                                "shorten it", param=param, code="request_too_large")
        raise exc
    finally:
        exc = None


def _drop_tracebacks(e: BaseException | None) -> None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__


# ------------------------------------------------------------------------------------------------ memory
_trimming = threading.Lock()


def trim_memory() -> bool:
    """Free what a large request left behind and hand it back to the system: a collection of the young garbage
    generations first (cycles the request made, e.g. an exception and the frames that hold its text), then
    glibc's malloc_trim (freed chunks stay in malloc's arenas otherwise). False where there is no malloc_trim."""
    if not _trimming.acquire(blocking=False):     # one at a time; a trim running now covers this request too
        return True
    try:
        t0 = time.perf_counter()
        found = gc.collect(1)       # the young generations: what the request left (~1 ms; a full one: ~120 ms)
        t1 = time.perf_counter()
        done = release_free_heap()
        log.debug("after a large body: gc found %d objects in %.1f ms, malloc_trim %.1f ms", found,
                  (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        return done
    finally:
        _trimming.release()


def trim_memory_soon() -> None:
    """trim_memory in a worker thread (it walks the heap: a few ms, off the event loop)."""
    asyncio.get_running_loop().run_in_executor(None, trim_memory)
