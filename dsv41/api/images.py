"""Image parts of a chat request -> the rows of their spans in the prompt (issue 11; docs/vision.md).

The chat policy renders one `image_token_id` placeholder per image and hands over each image's bytes (or its
http(s) URL when --image-urls is on). Here, per request:

1. fetch URL images (http/https only, at most --image-url-max-bytes within --image-url-timeout-s). The host is
   resolved first and every address it resolves to must be public (`address_refusal`: no loopback, private,
   link-local (cloud metadata), multicast, reserved or shared addresses, IPv4 inside IPv6 unwrapped) unless it lies
   in --image-url-allow-nets; the connection goes to the address that was checked (the Host header and TLS name
   stay the URL's), so a second lookup cannot swap it; redirects (3 at most) are followed by hand, each one checked
   the same way; no proxy from the environment is used;
2. decode + preprocess (dsv41.model.image_prep) and run the tower and the aligner (dsv41.model.vision), in one
   worker thread, one image per call, so an image's rows are a pure function of its bytes (Exactness);
3. expand each placeholder into its span `[START] ([IMAGE]*n_w [NEWLINE])*n_h [END]`.

Every refusal is a 400 that says what to change. The encoded rows are cached by the sha256 of the image bytes for
as long as a request holds them: the same image twice in one request, or in requests running at once, is encoded
once (a weak cache: rows go away with the last request that uses them).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv41.api.errors import ApiError, bad_request
from dsv41.model.image_prep import (
    ImageError,
    ImagePrepConfig,
    expand_image_placeholders,
    prepare_image,
)
from dsv41.model.vision import (
    EncodedImage,
    PromptImage,
    VisionTower,
    encode_image,
    has_vision_weights,
    image_sha256,
    load_vision_weights,
)

log = logging.getLogger("dsv41.images")

PARAM = "messages"


MAX_REDIRECTS = 3
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class UrlPolicy:
    allow: bool = False
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    allow_nets: tuple = ()          # ipaddress networks fetched although not public (--image-url-allow-nets)


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries to the same host: v4-mapped, v4-compatible, NAT64 (64:ff9b::/96), 6to4."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64 or ip in _V4COMPAT:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    return None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_V4COMPAT = ipaddress.ip_network("::/96")
# special-purpose blocks that Python's is_private/is_global miss in some versions (192.0.0.192 is Oracle Cloud's
# metadata service; 100.64.0.0/10 holds Alibaba Cloud's 100.100.100.200)
_NOT_PUBLIC = (ipaddress.ip_network("192.0.0.0/24"), ipaddress.ip_network("100.64.0.0/10"),
               ipaddress.ip_network("0.0.0.0/8"))


def address_refusal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allow_nets=()) -> str | None:
    """Why the server must not fetch from `ip` (None: it may): anything but a public unicast address, unless it
    lies in one of `allow_nets`."""
    if any(ip.version == n.version and ip in n for n in allow_nets):
        return None
    if ip.version == 6 and not (ip.is_loopback or ip.is_unspecified) and (v4 := _embedded_v4(ip)) is not None:
        why = address_refusal(v4, allow_nets)
        return None if why is None else f"{why} (inside the IPv6 address {ip})"
    for test, what in (("is_loopback", "a loopback address"),
                       ("is_link_local", "a link-local address (where cloud metadata services answer)"),
                       ("is_multicast", "a multicast address"), ("is_unspecified", "the unspecified address"),
                       ("is_private", "a private address"), ("is_reserved", "a reserved address")):
        if getattr(ip, test):
            return f"{ip} is {what}"
    if not ip.is_global or any(ip.version == n.version and ip in n for n in _NOT_PUBLIC):
        return f"{ip} is not a public address (special-purpose, shared or metadata)"
    return None


async def checked_address(host: str, port: int, allow_nets=()) -> str:
    """Resolve `host` and return the address to connect to; ValueError saying why when any address it resolves to
    is refused (a name that answers with one public and one private address is refused too)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"the host {host!r} does not resolve ({e})") from None
    addrs = list(dict.fromkeys(i[4][0] for i in infos))
    if not addrs:
        raise ValueError(f"the host {host!r} does not resolve")
    for a in addrs:
        why = address_refusal(ipaddress.ip_address(a.split("%", 1)[0]), allow_nets)
        if why is not None:
            what = why if a == host.strip("[]") else f"the host {host!r} resolves to {why}"
            raise ValueError(f"{what}; this server fetches image URLs from public addresses only "
                             "(--image-url-allow-nets allows others)")
    return addrs[0]


class ImageService:
    """The tower and the span rows of one checkpoint, with the per-request cache and the URL policy."""

    def __init__(self, tower: VisionTower, span_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 image_token_id: int, urls: UrlPolicy = UrlPolicy()):
        self.tower = tower
        self.prep: ImagePrepConfig = tower.prep
        self.start_row, self.newline_row, self.end_row = span_rows
        self.image_token_id = image_token_id
        self.urls = urls
        self._cache: weakref.WeakValueDictionary[bytes, EncodedImage] = weakref.WeakValueDictionary()
        self._pending: dict[bytes, asyncio.Future] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv41-images")
        self.encoded_total = 0              # images run through the tower (cache misses)
        self.reused_total = 0               # images served from the cache

    @classmethod
    def load(cls, ckpt: str | Path, cfg, device: str = "cpu") -> ImageService | None:
        """The service for a checkpoint with vision weights (None without), with the ServeConfig's image knobs."""
        from dsv41.config import ModelConfig
        if not has_vision_weights(ckpt):
            return None
        mc = ModelConfig.from_checkpoint(Path(ckpt))
        if mc.vision is None:
            return None
        w = load_vision_weights(ckpt, device)
        prep = ImagePrepConfig.from_vision_config(mc.vision, max_pixels=cfg.image_max_pixels,
                                                  apply_exif_orientation=cfg.image_exif_orientation)
        tower = VisionTower.load(w, mc.vision, dtype=torch.float32, device=device, prep=prep)
        rows = tuple(w[n].float() for n in ("image_start", "image_newline", "image_end"))
        return cls(tower, rows, mc.image_token_id,
                   UrlPolicy(cfg.image_urls, cfg.image_url_max_bytes, cfg.image_url_timeout_s,
                             tuple(ipaddress.ip_network(n, strict=False) for n in cfg.image_url_allow_nets)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- one image -----------------------------------------------------------------------------------------------
    def encode_sync(self, data: bytes) -> EncodedImage:
        """Bytes -> span rows, in the calling thread (tests, tools). Raises ImageError."""
        digest = image_sha256(data)
        got = self._cache.get(digest)
        if got is not None:
            return got
        enc = encode_image(self.tower, prepare_image(data, self.prep), digest, self.start_row, self.newline_row,
                           self.end_row)
        self._cache[digest] = enc
        return enc

    async def encode(self, data: bytes, k: int) -> EncodedImage:
        """One image's rows: from the cache, from an encode already running for the same bytes, or encoded now in
        the worker thread. ImageError -> 400 naming the image."""
        digest = image_sha256(data)
        got = self._cache.get(digest)
        if got is not None:
            self.reused_total += 1
            return got
        fut = self._pending.get(digest)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._executor, self._encode_new, data, digest)
            self._pending[digest] = fut
            fut.add_done_callback(lambda _f, d=digest: self._pending.pop(d, None))
        else:
            self.reused_total += 1
        try:
            return await asyncio.shield(fut)
        except ImageError as e:
            raise bad_request(f"image {k + 1}: {e}", param=PARAM) from None

    def _encode_new(self, data: bytes, digest: bytes) -> EncodedImage:
        enc = encode_image(self.tower, prepare_image(data, self.prep), digest, self.start_row, self.newline_row,
                           self.end_row)
        self._cache[digest] = enc
        self.encoded_total += 1
        return enc

    # --- a prompt ------------------------------------------------------------------------------------------------
    async def prompt_images(self, prompt) -> tuple[list[int], list[PromptImage]]:
        """A ChatPrompt's ids with every image placeholder expanded into its span, and the placed images."""
        datas = []
        for k, im in enumerate(prompt.images):
            datas.append(im.data if im.data is not None else await self.fetch(im.url, k))
        encoded = [await self.encode(d, k) for k, d in enumerate(datas)]
        try:
            out = expand_image_placeholders(prompt.token_ids, [(e.n_h, e.n_w) for e in encoded], self.image_token_id)
        except ImageError as e:
            raise bad_request(str(e), param=PARAM) from None
        return out.tokens, [PromptImage(s, e) for s, e in zip(out.image_starts, encoded)]

    async def prompt_ids(self, prompt) -> list[int]:
        """A ChatPrompt's ids with every placeholder expanded into its span, as prompt_images makes them, without the
        tower: each span's size comes from the image's preprocessing plan alone (what /tokenize and count_tokens
        count)."""
        grids = []
        loop = asyncio.get_running_loop()
        for k, im in enumerate(prompt.images):
            data = im.data if im.data is not None else await self.fetch(im.url, k)
            got = self._cache.get(image_sha256(data))
            if got is not None:
                grids.append((got.n_h, got.n_w))
                continue
            try:
                plan = (await loop.run_in_executor(self._executor, prepare_image, data, self.prep)).plan
            except ImageError as e:
                raise bad_request(f"image {k + 1}: {e}", param=PARAM) from None
            grids.append((plan.n_llm_h, plan.n_llm_w))
        try:
            return expand_image_placeholders(prompt.token_ids, grids, self.image_token_id).tokens
        except ImageError as e:
            raise bad_request(str(e), param=PARAM) from None

    async def fetch(self, url: str, k: int) -> bytes:
        """An http(s) image URL's bytes within the size and time limits (only when URLs are on)."""
        import httpx
        pol = self.urls
        if not pol.allow:    # the policy refuses URLs before this; kept as the last word
            raise bad_request("image input: image URLs are off on this server (send a base64 data URL)", param=PARAM)
        where = f"image {k + 1} ({url[:200]})"

        async def open_checked(c: httpx.AsyncClient, cur: str) -> tuple[httpx.URL, httpx.Response]:
            """GET `cur` from the address its host resolved to, once that address is checked."""
            u = httpx.URL(cur)
            if u.scheme not in ("http", "https") or not u.host:
                raise bad_request(f"{where}: {cur[:200]!r} is not an http(s) URL", param=PARAM)
            try:
                ip = await checked_address(u.host, u.port or (443 if u.scheme == "https" else 80), pol.allow_nets)
            except ValueError as e:
                raise bad_request(f"{where}: {e}", param=PARAM) from None
            req = c.build_request("GET", u.copy_with(host=ip), headers={"Host": u.netloc.decode("ascii")},
                                  extensions={"sni_hostname": u.host} if u.scheme == "https" else {})
            return u, await c.send(req, stream=True)

        async def get() -> bytes:
            # redirects by hand: every hop's host is resolved and checked like the first one's
            async with httpx.AsyncClient(follow_redirects=False, timeout=pol.timeout_s, trust_env=False) as c:
                cur = url
                for _ in range(MAX_REDIRECTS + 1):
                    u, r = await open_checked(c, cur)
                    try:
                        if r.status_code in _REDIRECTS and r.headers.get("location"):
                            cur = str(u.join(r.headers["location"]))
                            continue
                        if r.status_code != 200:
                            raise bad_request(f"{where}: the server answered HTTP {r.status_code}; send the image as "
                                              "a base64 data URL or a URL that serves it", param=PARAM)
                        size = r.headers.get("content-length")
                        if size is not None and size.isdigit() and int(size) > pol.max_bytes:
                            raise _too_big(where, pol.max_bytes)
                        buf = bytearray()
                        async for piece in r.aiter_bytes():
                            buf += piece
                            if len(buf) > pol.max_bytes:
                                raise _too_big(where, pol.max_bytes)
                        return bytes(buf)
                    finally:
                        await r.aclose()
                raise bad_request(f"{where}: more than {MAX_REDIRECTS} redirects; send the image as a base64 data "
                                  "URL", param=PARAM)

        try:
            return await asyncio.wait_for(get(), pol.timeout_s)
        except ApiError:
            raise
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise bad_request(f"{where}: the download took longer than {pol.timeout_s:g} s; send the image as a "
                              "base64 data URL", param=PARAM) from None
        except httpx.HTTPError as e:
            raise bad_request(f"{where}: the download failed ({type(e).__name__}: {e}); send the image as a base64 "
                              "data URL", param=PARAM) from None


def _too_big(where: str, limit: int) -> ApiError:
    return bad_request(f"{where}: the file is larger than this server's limit of {limit} bytes; downscale or "
                       "recompress it", param=PARAM)


__all__ = ["EncodedImage", "ImageService", "PromptImage", "UrlPolicy", "address_refusal", "checked_address"]
