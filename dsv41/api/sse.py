"""Server-sent events: frames, the end marker and the keepalive comment (Request.stream yields it while nothing is
due)."""
from __future__ import annotations

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
