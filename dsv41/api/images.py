"""Image parts of a chat request -> the rows of their spans in the prompt (issue 11; docs/vision.md).

The chat policy renders one `image_token_id` placeholder per image and hands over each image's bytes (or its
http(s) URL when --image-urls is on). Here, per request:

1. fetch URL images (http/https only, at most --image-url-max-bytes within --image-url-timeout-s);
2. decode + preprocess (dsv41.model.image_prep) and run the tower and the aligner (dsv41.model.vision), in one
   worker thread, one image per call, so an image's rows are a pure function of its bytes (Exactness);
3. expand each placeholder into its span `[START] ([IMAGE]*n_w [NEWLINE])*n_h [END]`.

Every refusal is a 400 that says what to change. The encoded rows are cached by the sha256 of the image bytes for
as long as a request holds them: the same image twice in one request, or in requests running at once, is encoded
once (a weak cache: rows go away with the last request that uses them).
"""
from __future__ import annotations

import asyncio
import logging
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


@dataclass(frozen=True)
class UrlPolicy:
    allow: bool = False
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0


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
                   UrlPolicy(cfg.image_urls, cfg.image_url_max_bytes, cfg.image_url_timeout_s))

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

    async def fetch(self, url: str, k: int) -> bytes:
        """An http(s) image URL's bytes within the size and time limits (only when URLs are on)."""
        import httpx
        pol = self.urls
        if not pol.allow:    # the policy refuses URLs before this; kept as the last word
            raise bad_request("image input: image URLs are off on this server (send a base64 data URL)", param=PARAM)
        where = f"image {k + 1} ({url[:200]})"

        async def get() -> bytes:
            async with httpx.AsyncClient(follow_redirects=True, max_redirects=3, timeout=pol.timeout_s) as c, \
                    c.stream("GET", url) as r:
                if r.status_code != 200:
                    raise bad_request(f"{where}: the server answered HTTP {r.status_code}; send the image as a "
                                      "base64 data URL or a URL that serves it", param=PARAM)
                size = r.headers.get("content-length")
                if size is not None and size.isdigit() and int(size) > pol.max_bytes:
                    raise _too_big(where, pol.max_bytes)
                buf = bytearray()
                async for piece in r.aiter_bytes():
                    buf += piece
                    if len(buf) > pol.max_bytes:
                        raise _too_big(where, pol.max_bytes)
                return bytes(buf)

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


__all__ = ["EncodedImage", "ImageService", "PromptImage", "UrlPolicy"]
