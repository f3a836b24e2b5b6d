"""Image preprocessing for the DeepSeek-ViT tower, as DeepSeek's release `inference/image_processor.py` does it.

bytes -> Pillow `convert("RGB")` -> resize plan (min-area upscale, multiples of 14, token budget) -> aspect-fit bicubic
resize + gray-127 pad -> float32 normalisation cast once to bf16 -> ViT patches [n_vit_h*n_vit_w, 3, 14, 14].

Two grids describe an image: the ViT patch grid `n_vit_h x n_vit_w` (14-pixel patches) and the LLM token grid
`n_llm_h x n_llm_w` (3x3 patches per aligner cell, ceil). The image then occupies
`[IMAGE_START] ([IMAGE]*n_llm_w [IMAGE_NEW_LINE])*n_llm_h [IMAGE_END]` in the prompt: n_llm_h*(n_llm_w+1)+2 positions,
every one carrying `image_token_id`; only the token type tells them apart (arch.md §5, §5.1).

Every step follows the reference exactly (checked against shared/vectors/vision): these are the pixels the model
was trained on, so "improvements" (EXIF rotation, alpha compositing, a better budget search) change replies.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

# Token types inside a prompt (the reference's constants).
TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)

# Formats we decode. Pillow knows more (PPM, ICO, PSD, ...); those are refused with a clear message rather than
# silently accepted, so the supported surface stays the one we test.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")

# Default decompression-bomb limit on the stored pixel count (8192^2). It sits under Pillow's own warning threshold
# (Image.MAX_IMAGE_PIXELS, ~89.5M), so an accepted image never triggers Pillow's warning; Pillow's hard error at
# twice its threshold is mapped to the same ImageError.
DEFAULT_MAX_PIXELS = 8192 * 8192

# The reference normalisation per uint8 level: ((u8 / 255) - 0.5) / 0.5 in float32, then one cast to bf16
# (round-to-nearest-even). Elementwise float32 ops, so a table is bit-identical to doing it per pixel.
NORMALIZE_LUT = ((torch.arange(256, dtype=torch.float32) / 255 - 0.5) / 0.5).to(torch.bfloat16)

PAD_GRAY = (127, 127, 127)


class ImageError(ValueError):
    """A request's image cannot be used; the message says what to change. The server answers 400."""


@dataclass(frozen=True)
class ImagePrepConfig:
    """The preprocessing knobs: the checkpoint's vision_config fields plus two serving options."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 544 * 544
    max_wh_ratio: float | None = None
    # Serving options (not in the checkpoint):
    max_pixels: int = DEFAULT_MAX_PIXELS  # refuse images whose stored width*height is larger
    apply_exif_orientation: bool = False  # the reference ignores EXIF orientation; True deviates from it

    def __post_init__(self):
        for name in ("patch_size", "downsample_ratio", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImagePrepConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_image_tokens < 4:
            raise ValueError(f"ImagePrepConfig.max_image_tokens must be >= 4, got {self.max_image_tokens}")
        if self.max_wh_ratio is not None and self.max_wh_ratio <= 0:
            raise ValueError(f"ImagePrepConfig.max_wh_ratio must be > 0 or None, got {self.max_wh_ratio}")

    @classmethod
    def from_vision_config(cls, vision_cfg, *, max_pixels: int = DEFAULT_MAX_PIXELS,
                           apply_exif_orientation: bool = False) -> "ImagePrepConfig":
        """From an object with the checkpoint's vision_config field names (patch_size, downsample_ratio,
        max_image_tokens, min_pixels, max_wh_ratio)."""
        return cls(
            patch_size=int(vision_cfg.patch_size),
            downsample_ratio=int(vision_cfg.downsample_ratio),
            max_image_tokens=int(vision_cfg.max_image_tokens),
            min_pixels=int(vision_cfg.min_pixels),
            max_wh_ratio=vision_cfg.max_wh_ratio,
            max_pixels=max_pixels,
            apply_exif_orientation=apply_exif_orientation,
        )


# ----------------------------------------------------------------------------------------------------------------
# Decoding


def image_bytes_from_data_url(url: str) -> bytes:
    """The bytes of a `data:<mime>;base64,<payload>` URL (the form chat requests carry images in)."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ImageError("image URL must be a data: URL (data:image/png;base64,...); remote URLs are not fetched")
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("data: URL has no ',' before its payload; expected data:image/png;base64,<data>")
    if ";base64" not in header:
        raise ImageError(f"data: URL must be base64-encoded (';base64' missing in {header[:64]!r})")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data: URL payload is not valid base64 ({e})") from None


def _format_pillow_knows(data: bytes) -> str | None:
    """The format Pillow would recognise with every plugin enabled, to tell 'unsupported' from 'broken'."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.format
    except Exception:  # any failure here just means "not recognisable"
        return None


def _too_many_pixels(cfg: ImagePrepConfig) -> str:
    # Pillow refuses on its own above 2 * Image.MAX_IMAGE_PIXELS, before we see the size.
    limit = cfg.max_pixels if Image.MAX_IMAGE_PIXELS is None else min(cfg.max_pixels, 2 * Image.MAX_IMAGE_PIXELS)
    return f"the image has too many pixels (over the limit of {limit}); downscale it and send it again"


# What Pillow raises on broken or truncated data, across its plugins.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, struct.error, zlib.error)


def decode_image(data: bytes, cfg: ImagePrepConfig = ImagePrepConfig()) -> tuple[Image.Image, str]:
    """Decode image bytes to an RGB Pillow image, the reference's step 1 `Image.open(bytes).convert("RGB")`.

    Returns (rgb image, Pillow mode before conversion). Alpha is dropped, not composited; I;16 clips at 255; CMYK
    uses Pillow's conversion; GIF/WebP take the first frame; EXIF orientation only with cfg.apply_exif_orientation.
    Raises ImageError for empty, broken, truncated, unsupported or over-limit images.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"image data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise ImageError("the image is empty (0 bytes); send a PNG, JPEG, WebP, GIF, BMP or TIFF file")
    supported = "PNG, JPEG, WebP, GIF, BMP or TIFF"
    try:
        source = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except Image.DecompressionBombError:
        raise ImageError(_too_many_pixels(cfg)) from None
    except UnidentifiedImageError:
        fmt = _format_pillow_knows(data)
        if fmt is not None:
            raise ImageError(f"unsupported image format {fmt}; convert it to {supported}") from None
        raise ImageError(f"the data is not a readable image (broken, truncated or not an image file); "
                         f"send a complete {supported} file") from None
    except _DECODE_ERRORS as e:
        raise ImageError(f"the image file is broken ({e}); re-encode it as {supported}") from None
    with source:
        width, height = source.size
        if width < 1 or height < 1:
            raise ImageError(f"the image has no pixels ({width}x{height}); send a non-empty image")
        if width * height > cfg.max_pixels:
            raise ImageError(
                f"the image is {width}x{height} = {width * height} pixels, over the limit of {cfg.max_pixels}; "
                f"downscale it and send it again")
        mode = source.mode
        try:
            image = ImageOps.exif_transpose(source) if cfg.apply_exif_orientation else source
            rgb = image.convert("RGB")  # decodes the pixels: truncation shows up here
        except Image.DecompressionBombError:
            raise ImageError(_too_many_pixels(cfg)) from None
        except _DECODE_ERRORS as e:
            raise ImageError(f"the image data is broken or truncated ({e}); send the complete file") from None
    return rgb, mode


# ----------------------------------------------------------------------------------------------------------------
# The resize plan (pure integer/float arithmetic on the size, as the reference computes it)


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Prompt positions an image of this token grid takes: START + rows of (n_llm_w IMAGE + NEWLINE) + END."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(best_height: int, best_width: int, patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    """The aligner's token grid for a pixel size: ceil(patches / 3) each way (the aligner zero-pads)."""
    return (math.ceil((best_height // patch_size) / downsample_ratio),
            math.ceil((best_width // patch_size) / downsample_ratio))


def solve_resize_ratio(height, width, patch_size: int, downsample_ratio: int, max_n_token: int):
    """One closed-form shrink to the token budget (not a search: it may land well under it).

    Solves h*(w+1)+2 = budget for the LLM grid with h/w = height/width, floors both, and scales the pixel size by
    the tighter of the two. Extreme aspects collapse to a single column of (budget-2)//2 rows or a single row of
    budget-3 cells, whatever the aspect. Returns (best_height, best_width, branch, max_w_float, max_h_float).
    """
    r = height / width
    max_w_float = math.sqrt((max_n_token - 2) / r + 0.25) - 0.5
    max_h_float = max_w_float * r
    cell = patch_size * downsample_ratio
    if max_w_float < 1.0:
        return (max_n_token - 2) // 2 * cell, cell, "solve_collapse_column", max_w_float, max_h_float
    if max_h_float < 1.0:
        return cell, (max_n_token - 3) * cell, "solve_collapse_row", max_w_float, max_h_float
    beta = min(math.floor(max_w_float) * cell / width, math.floor(max_h_float) * cell / height)
    best_height = math.floor(height * beta / patch_size) * patch_size
    best_width = math.floor(width * beta / patch_size) * patch_size
    return best_height, best_width, "solve", max_w_float, max_h_float


@dataclass(frozen=True)
class ImagePlan:
    """The resize plan of one image; field names match the vectors' `plan` records."""

    width: int                      # input size (after convert("RGB"), before any clamp)
    height: int
    wh_clamped_width: float | None  # width after the max_wh_ratio clamp, None when it did not apply
    upscaled: bool                  # 0 < w*h < min_pixels: scaled up to that area, int()-truncated
    intermediate_size: tuple        # (w, h) after clamp and upscale
    rounded_size: tuple             # (w, h) rounded up to multiples of patch_size
    rounded_tokens: int             # token count of rounded_size (the budget test uses it)
    branch: str                     # fits | solve | solve_collapse_column | solve_collapse_row
    best_width: int                 # the target pixel size, multiples of patch_size
    best_height: int
    n_vit_h: int                    # ViT patch grid
    n_vit_w: int
    n_llm_h: int                    # LLM token grid (3x3 patches per cell)
    n_llm_w: int
    num_image_tokens: int           # n_llm_h*(n_llm_w+1)+2 <= max_image_tokens
    resize_mode: str                # pad (aspect-fit + gray pad) | stretch (only with max_wh_ratio)
    solve_max_w_float: float | None = None
    solve_max_h_float: float | None = None


def plan_image_grid(width: int, height: int, cfg: ImagePrepConfig = ImagePrepConfig()) -> ImagePlan:
    """The reference's `plan_image_grid` + `safe_resize`, with every intermediate kept for checking."""
    if width < 1 or height < 1:
        raise ImageError(f"the image has no pixels ({width}x{height}); send a non-empty image")
    p, ratio = cfg.patch_size, cfg.downsample_ratio
    in_width, in_height = width, height
    clamped = None
    if cfg.max_wh_ratio is not None and width > height * cfg.max_wh_ratio:
        width = clamped = height * cfg.max_wh_ratio
    upscaled = 0 < width * height < cfg.min_pixels
    if upscaled:
        # `** 0.5` and int() truncation exactly as the reference (it can land a little under min_pixels).
        scale = (cfg.min_pixels / (width * height)) ** 0.5
        width = int(width * scale)
        height = int(height * scale)
    best_width = math.ceil(width / p) * p
    best_height = math.ceil(height / p) * p
    rounded = (best_width, best_height)
    n_llm_h, n_llm_w = llm_grid(best_height, best_width, p, ratio)
    rounded_tokens = num_image_tokens(n_llm_h, n_llm_w)
    branch, max_w_float, max_h_float = "fits", None, None
    if rounded_tokens > cfg.max_image_tokens:
        # Solved on the upscaled (intermediate) size, not the rounded one.
        best_height, best_width, branch, max_w_float, max_h_float = solve_resize_ratio(
            height, width, p, ratio, cfg.max_image_tokens)
        n_llm_h, n_llm_w = llm_grid(best_height, best_width, p, ratio)
        if num_image_tokens(n_llm_h, n_llm_w) > cfg.max_image_tokens:  # the reference asserts this
            raise RuntimeError(f"resize solve for {in_width}x{in_height} exceeded the token budget")
    stretch = cfg.max_wh_ratio is not None and in_width >= cfg.max_wh_ratio * in_height
    return ImagePlan(
        width=in_width, height=in_height, wh_clamped_width=clamped, upscaled=upscaled,
        intermediate_size=(width, height), rounded_size=rounded, rounded_tokens=rounded_tokens, branch=branch,
        best_width=best_width, best_height=best_height, n_vit_h=best_height // p, n_vit_w=best_width // p,
        n_llm_h=n_llm_h, n_llm_w=n_llm_w, num_image_tokens=num_image_tokens(n_llm_h, n_llm_w),
        resize_mode="stretch" if stretch else "pad",
        solve_max_w_float=max_w_float, solve_max_h_float=max_h_float,
    )


# ----------------------------------------------------------------------------------------------------------------
# Resize, pad, normalise


@dataclass(frozen=True)
class PadPlacement:
    """Where the aspect-fit content sits inside the padded target (names match the vectors' `pad` records)."""

    content_width: int
    content_height: int
    offset_x: int
    offset_y: int
    target_width: int
    target_height: int

    @property
    def pad_left(self) -> int:
        return self.offset_x

    @property
    def pad_right(self) -> int:
        return self.target_width - self.content_width - self.offset_x

    @property
    def pad_top(self) -> int:
        return self.offset_y

    @property
    def pad_bottom(self) -> int:
        return self.target_height - self.content_height - self.offset_y


def resize_to_plan(rgb: Image.Image, plan: ImagePlan) -> tuple[Image.Image, PadPlacement | None]:
    """Resize an RGB image to the plan's target size.

    `pad` mode is `ImageOps.pad(rgb, size, color=(127,127,127))` spelled out so the placement is known: Pillow's
    `ImageOps.contain` (aspect-fit bicubic; one side equals the target, the other is rounded), then a paste centred
    at round(margin * 0.5) with Python's round-half-to-even. `stretch` mode is a plain bicubic resize.
    """
    size = (plan.best_width, plan.best_height)
    if plan.resize_mode == "stretch":
        return rgb.resize(size, resample=Image.Resampling.BICUBIC), None
    content = ImageOps.contain(rgb, size, Image.Resampling.BICUBIC)
    cw, ch = content.size
    x = round((size[0] - cw) * 0.5) if cw != size[0] else 0
    y = round((size[1] - ch) * 0.5) if cw == size[0] else 0
    placement = PadPlacement(cw, ch, x, y, size[0], size[1])
    if content.size == size:
        return content, placement
    out = Image.new("RGB", size, PAD_GRAY)
    if cw > 0 and ch > 0:  # an extreme aspect can round the content to zero width: all pad then
        out.paste(content, (x, y))
    return out, placement


def normalize_patches(rgb: Image.Image, patch_size: int) -> torch.Tensor:
    """Padded RGB image -> bf16 patches [n_vit_h*n_vit_w, 3, p, p]: row-major patch grid, each patch channel-major
    (the 588 = (c, py, px) order patch_embed flattens). Values are the reference's normalisation (NORMALIZE_LUT)."""
    width, height = rgb.size
    p = patch_size
    if width % p or height % p:
        raise ValueError(f"padded image {width}x{height} is not a multiple of the patch size {p}")
    n_vit_h, n_vit_w = height // p, width // p
    u8 = torch.from_numpy(np.array(rgb, dtype=np.uint8))  # [H, W, 3]
    u8 = u8.view(n_vit_h, p, n_vit_w, p, 3).permute(0, 2, 4, 1, 3).reshape(n_vit_h * n_vit_w, 3, p, p)
    return NORMALIZE_LUT[u8.long()]


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: bf16 patches plus the plan that sized them."""

    patches: torch.Tensor            # bf16 [n_vit_h*n_vit_w, 3, patch, patch]
    plan: ImagePlan
    placement: PadPlacement | None   # None in stretch mode
    source_mode: str                 # Pillow mode before convert("RGB")

    @property
    def n_tokens(self) -> int:
        return self.plan.num_image_tokens


def prepare_image(data: bytes, cfg: ImagePrepConfig = ImagePrepConfig()) -> PreparedImage:
    """Image bytes -> ViT patches, the reference's `load_image`. Raises ImageError for unusable images."""
    rgb, mode = decode_image(data, cfg)
    plan = plan_image_grid(rgb.width, rgb.height, cfg)
    padded, placement = resize_to_plan(rgb, plan)
    return PreparedImage(normalize_patches(padded, cfg.patch_size), plan, placement, mode)


# ----------------------------------------------------------------------------------------------------------------
# Prompt layout


def image_token_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """Token types of one image span: START, then per token-grid row n_llm_w IMAGE and one NEW_LINE, then END."""
    if n_llm_h < 1 or n_llm_w < 1:
        raise ValueError(f"image token grid must be at least 1x1, got {n_llm_h}x{n_llm_w}")
    types = [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]
    return torch.tensor(types, dtype=torch.int64)


@dataclass(frozen=True)
class ExpandedPrompt:
    tokens: list[int]        # placeholders replaced by their spans of image_token_id
    token_types: list[int]   # TEXT (-1) outside spans, 0..3 inside
    image_starts: list[int]  # each span's first position in `tokens`, in image order


def expand_image_placeholders(ids: Sequence[int], grids: Sequence[tuple[int, int]],
                              image_token_id: int) -> ExpandedPrompt:
    """Replace the i-th `image_token_id` in `ids` by image i's span (grids[i] = (n_llm_h, n_llm_w)).

    Positions run on across spans with no gaps; every span position carries image_token_id.
    """
    n_placeholders = sum(1 for t in ids if t == image_token_id)
    if n_placeholders != len(grids):
        raise ImageError(f"the prompt has {n_placeholders} image placeholders but {len(grids)} images were given; "
                         f"each image needs exactly one placeholder")
    tokens: list[int] = []
    token_types: list[int] = []
    starts: list[int] = []
    grid_iter = iter(grids)
    for t in ids:
        if t != image_token_id:
            tokens.append(int(t))
            token_types.append(TEXT)
            continue
        n_llm_h, n_llm_w = next(grid_iter)
        types = image_token_types(n_llm_h, n_llm_w).tolist()
        starts.append(len(tokens))
        tokens += [image_token_id] * len(types)
        token_types += types
    return ExpandedPrompt(tokens, token_types, starts)
