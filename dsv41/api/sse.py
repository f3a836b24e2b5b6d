"""Server-sent events: frames, and an iterator wrapper that sends `: keepalive` comments while nothing is due."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import msgspec

_enc = msgspec.json.Encoder()

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"
HEADERS = {"Cache-Control": "no-cache", "Connection": "close", "X-Accel-Buffering": "no"}


# JSON leaves U+0085, U+2028 and U+2029 raw, but line readers built on str.splitlines() (httpx's iter_lines among
# them) cut lines there: escape them so a frame is always one line whatever the tokens hold.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def frame(obj) -> bytes:
    data = _enc.encode(obj)
    for raw, esc in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, esc)
    return b"data: " + data + b"\n\n"


async def with_keepalive(source: AsyncIterator, interval_s: float) -> AsyncIterator:
    """Yield the items of `source`; yield KEEPALIVE after every `interval_s` without one.

    One pending __anext__ at a time, watched with asyncio.wait (never wait_for, which would cancel the producer);
    the pending step is cancelled and the source closed when the consumer goes away.
    """
    it = source.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            fut, pending = pending, None
            try:
                item = fut.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration, Exception):
                pass
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
