"""Server-sent events: frames, and an iterator wrapper that sends `: keepalive` comments while nothing is due."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import msgspec

_enc = msgspec.json.Encoder()

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"
HEADERS = {"Cache-Control": "no-cache", "Connection": "close", "X-Accel-Buffering": "no"}


def frame(obj) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


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
