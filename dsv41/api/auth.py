"""API keys: `Authorization: Bearer K` or `x-api-key: K`, compared in constant time on sha256 digests.

Keys come from `--api-key` (repeated; env DSV41_API_KEY comma-separated) and `--api-key-file` (read at start and
again on SIGHUP; refused when the group or others may read or write it). The server keeps only their digests and
never writes a key (or a presented one) to a log or an error message.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat

OPEN_PATHS = frozenset({"/", "/health", "/v1/health", "/openapi.json"})   # docs/apis.md: why these


class KeyFileError(ValueError):
    """The key file cannot be used; the message says why without quoting the file's contents."""


def read_key_file(path: str) -> list[str]:
    """The keys of a key file: one a line, `key` or `label: key` (the label names the key for people; it is not
    part of it), `#` comment lines and blank lines skipped. A missing or unreadable file, one the group or others
    may read or write (mode & 0o077, checked on the open file), or one holding no key raises KeyFileError: a server
    told to use keys must not start open, nor trust keys that others can read or add."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & 0o077:
                raise KeyFileError(f"the key file {path!r} is open to its group or others (mode "
                                   f"{stat.S_IMODE(mode):04o}); `chmod 600 {path}` and start again")
            data = f.read()
    except OSError as e:
        raise KeyFileError(f"cannot read the key file {path!r}: {e.strerror or type(e).__name__}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"the key file {path!r} is not UTF-8 text") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        label, sep, key = line.partition(":")
        key = key.strip() if sep else label
        if not key or any(c.isspace() for c in key):
            raise KeyFileError(f"the key file {path!r}, line {n}: expected `key` or `label: key` (a key has no "
                               f"blanks)")
        keys.append(key)
    if not keys:
        raise KeyFileError(f"the key file {path!r} holds no key (only blank or # comment lines)")
    return keys


class KeyCheck:
    def __init__(self, keys: list[str], from_file: int = 0):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]
        self.from_file = from_file                # how many of the keys came from --api-key-file

    @classmethod
    def from_config(cls, cfg) -> KeyCheck:
        """`--api-key` keys plus those of `--api-key-file` (either source alone enables the check)."""
        keys = list(cfg.api_key)
        file_keys = read_key_file(cfg.api_key_file) if cfg.api_key_file else []
        return cls(keys + file_keys, len(file_keys))

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
        for c in candidates:                     # every candidate against every digest: no early exit to time
            d = hashlib.sha256(c.encode()).digest()
            for k in self._digests:
                found |= hmac.compare_digest(d, k)
        return found
