"""API keys: `Authorization: Bearer K` or `x-api-key: K`, compared in constant time on sha256 digests."""
from __future__ import annotations

import hashlib
import hmac

OPEN_PATHS = frozenset({"/", "/health", "/v1/health"})


class KeyCheck:
    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def ok(self, headers) -> bool:
        if not self._digests:
            return True
        auth = headers.getlist("authorization") if hasattr(headers, "getlist") else [headers.get("authorization")]
        xkey = headers.getlist("x-api-key") if hasattr(headers, "getlist") else [headers.get("x-api-key")]
        candidates = []
        if len(auth) == 1 and auth[0] and auth[0][:7].lower() == "bearer ":
            candidates.append(auth[0][7:].strip())
        if len(xkey) == 1 and xkey[0]:           # a duplicated header counts as absent
            candidates.append(xkey[0].strip())
        found = False
        for c in candidates:
            d = hashlib.sha256(c.encode()).digest()
            for k in self._digests:
                found |= hmac.compare_digest(d, k)
        return found
