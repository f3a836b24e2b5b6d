"""Image preprocessing and span layout against shared/vectors/vision (DeepSeek's release image_processor.py)."""
import base64
import hashlib
import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from dsv41.model.image_prep import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, NORMALIZE_LUT, TEXT,
                                    ImageError, ImagePrepConfig, decode_image, expand_image_placeholders,
                                    image_bytes_from_data_url, image_token_types, normalize_patches,
                                    plan_image_grid, prepare_image, resize_to_plan)

IMAGE_TOKEN_ID = 129264


@pytest.fixture(scope="module")
def records(shared):
    with open(shared / "vectors" / "vision" / "vectors.jsonl") as f:
        recs = [json.loads(line) for line in f]
    by_kind = {}
    for r in recs:
        by_kind.setdefault(r["kind"], []).append(r)
    return by_kind


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def bf16_sha(t: torch.Tensor) -> str:
    return sha256(t.contiguous().view(torch.int16).numpy().tobytes())


def plan_fields(plan, expected: dict) -> dict:
    """The plan's value for every field the record states (tuples compared as lists)."""
    out = {}
    for k in expected:
        v = getattr(plan, k)
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def png(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, **kw).save(buf, format="PNG")
    return buf.getvalue()


def test_normalisation_table_matches_lut_record(records):
    lut = records["lut"][0]
    bits = NORMALIZE_LUT.view(torch.int16).numpy().astype(np.uint16)
    assert [f"{b:04x}" for b in bits] == lut["bf16_bits"]
    assert NORMALIZE_LUT.float().tolist() == lut["values"]
    assert NORMALIZE_LUT[127].item() == -0.003936767578125  # the gray pad is not zero


def test_plan_records(records):
    assert len(records["plan"]) >= 40
    bad = []
    for r in records["plan"]:
        cfg = ImagePrepConfig(max_wh_ratio=r["max_wh_ratio"])
        expected = {k: v for k, v in r.items() if k not in ("kind", "id", "max_wh_ratio")}
        got = plan_fields(plan_image_grid(r["width"], r["height"], cfg), expected)
        if got != expected:
            bad.append((r["id"], {k: (got[k], v) for k, v in expected.items() if got[k] != v}))
    assert not bad


def test_image_records(records):
    assert len(records["image"]) >= 20
    bad = []
    for r in records["image"]:
        data = base64.b64decode(r["image"]["b64"])
        assert sha256(data) == r["image"]["sha256"]
        rgb, mode = decode_image(data)
        dec = r["decoded"]
        checks = {
            "mode": mode == dec["mode"],
            "size": rgb.size == (dec["width"], dec["height"]),
            "rgb_sha256": sha256(np.asarray(rgb).tobytes()) == dec["rgb_sha256"],
        }
        plan = plan_image_grid(rgb.width, rgb.height)
        checks["plan"] = plan_fields(plan, r["plan"]) == r["plan"]
        padded, placement = resize_to_plan(rgb, plan)
        checks["pad"] = all(getattr(placement, k) == v for k, v in r["pad"].items())
        checks["padded_rgb_sha256"] = sha256(np.asarray(padded).tobytes()) == r["padded_rgb_sha256"]
        patches = normalize_patches(padded, 14)
        px = r["pixels"]
        checks["shape"] = list(patches.shape) == px["shape"]
        checks["pixels.sha256"] = bf16_sha(patches) == px["sha256"]
        checks["samples"] = all(patches[p, c, y, x].item() == v for p, c, y, x, v, _ in px["samples"])
        checks["min_max"] = (patches.min().item(), patches.max().item()) == (px["min"], px["max"])
        checks["count_pad_value"] = int((patches == NORMALIZE_LUT[127]).sum()) == px["count_pad_value"]
        lay = r["layout"]
        types = image_token_types(plan.n_llm_h, plan.n_llm_w)
        checks["layout"] = ("".join(map(str, types.tolist())) == lay["token_types"]
                            and len(types) == lay["n_tokens"] == plan.num_image_tokens
                            and lay["input_id"] == IMAGE_TOKEN_ID)
        checks["counts"] = lay["counts"] == {"IMAGE_START": 1, "IMAGE": plan.n_llm_h * plan.n_llm_w,
                                             "IMAGE_NEW_LINE": plan.n_llm_h, "IMAGE_END": 1}
        # The whole pipeline in one call gives the same patches and plan.
        prepared = prepare_image(data)
        checks["prepare_image"] = (bf16_sha(prepared.patches) == px["sha256"] and prepared.plan == plan
                                   and prepared.source_mode == dec["mode"])
        failed = [k for k, ok in checks.items() if not ok]
        if failed:
            bad.append((r["id"], failed))
    assert not bad


def test_prompt_records(records, shared):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(shared / "tokenizer" / "tokenizer.json"))
    assert tok.token_to_id("<｜deepseek_image｜>") == IMAGE_TOKEN_ID
    assert records["prompt"]
    for r in records["prompt"]:
        assert sha256(r["prompt"].encode()) == r["prompt_sha256"]
        ids = tok.encode(r["prompt"], add_special_tokens=False).ids
        urls = [part["image_url"]["url"] for m in r["messages"] if isinstance(m.get("content"), list)
                for part in m["content"] if part.get("type") == "image_url"]
        assert len(urls) == r["n_images"]
        prepared = [prepare_image(image_bytes_from_data_url(u)) for u in urls]
        grids = [(p.plan.n_llm_h, p.plan.n_llm_w) for p in prepared]
        out = expand_image_placeholders(ids, grids, IMAGE_TOKEN_ID)
        assert out.tokens == r["tokens"], r["id"]
        assert out.token_types == r["token_types"], r["id"]
        assert len(out.image_starts) == len(r["images"])
        for start, p, img in zip(out.image_starts, prepared, r["images"]):
            assert start == img["start"]
            assert p.n_tokens == img["n_tokens"]
            assert (p.plan.n_vit_h, p.plan.n_vit_w) == (img["n_vit_h"], img["n_vit_w"])
            assert bf16_sha(p.patches) == img["patches_sha256"]
            span = out.token_types[start:start + p.n_tokens]
            assert "".join(map(str, span)) == img["token_types"]


def test_five_sizes_token_counts():
    rng = np.random.default_rng(0)
    sizes = [(64, 48), (800, 600), (300, 1200), (2000, 150), (1, 3000)]
    prepared = []
    for w, h in sizes:
        arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        p = prepare_image(png(arr))
        plan = p.plan
        assert (plan.width, plan.height) == (w, h)
        assert plan.best_width % 14 == 0 and plan.best_height % 14 == 0
        assert p.patches.shape == (plan.n_vit_h * plan.n_vit_w, 3, 14, 14)
        assert p.patches.dtype == torch.bfloat16
        assert (plan.n_llm_h, plan.n_llm_w) == (-(-plan.n_vit_h // 3), -(-plan.n_vit_w // 3))
        assert p.n_tokens == plan.n_llm_h * (plan.n_llm_w + 1) + 2 <= 1024
        prepared.append(p)
    assert len({(p.plan.n_llm_h, p.plan.n_llm_w) for p in prepared}) == 5
    ids = [0, 5]
    for _ in prepared:
        ids += [IMAGE_TOKEN_ID, 7]
    out = expand_image_placeholders(ids, [(p.plan.n_llm_h, p.plan.n_llm_w) for p in prepared], IMAGE_TOKEN_ID)
    assert len(out.tokens) == len(ids) - 5 + sum(p.n_tokens for p in prepared)
    for start, p in zip(out.image_starts, prepared):
        span = out.token_types[start:start + p.n_tokens]
        assert span[0] == IMAGE_START and span[-1] == IMAGE_END
        assert span.count(IMAGE) == p.plan.n_llm_h * p.plan.n_llm_w
        assert span.count(IMAGE_NEW_LINE) == p.plan.n_llm_h
        assert out.token_types[start - 1] == TEXT and out.token_types[start + p.n_tokens] == TEXT
        assert set(out.tokens[start:start + p.n_tokens]) == {IMAGE_TOKEN_ID}


@pytest.mark.parametrize("w,h,offset", [(300, 226, (0, 0)), (300, 213, (4, 0)), (41, 43, None), (900, 333, None)])
def test_pad_is_pillows_imageops_pad_with_half_even_offsets(w, h, offset):
    from PIL import ImageOps

    rgb = Image.fromarray(np.random.default_rng(w * h).integers(0, 256, size=(h, w, 3), dtype=np.uint8))
    plan = plan_image_grid(w, h)
    padded, placement = resize_to_plan(rgb, plan)
    size = (plan.best_width, plan.best_height)
    assert np.array_equal(np.asarray(padded), np.asarray(ImageOps.pad(rgb, size, color=(127, 127, 127))))
    if offset is not None:
        # 1 px of margin goes to the bottom (round(0.5) = 0); 7 px split 4 left / 3 right (round(3.5) = 4).
        assert (placement.offset_x, placement.offset_y) == offset
    a = np.asarray(padded)
    assert (a[:placement.pad_top] == 127).all() and (a[a.shape[0] - placement.pad_bottom:] == 127).all()
    assert (a[:, :placement.pad_left] == 127).all() and (a[:, a.shape[1] - placement.pad_right:] == 127).all()


def test_placeholder_count_mismatch_is_an_image_error():
    with pytest.raises(ImageError, match="2 image placeholders but 1 images"):
        expand_image_placeholders([IMAGE_TOKEN_ID, 3, IMAGE_TOKEN_ID], [(1, 1)], IMAGE_TOKEN_ID)


# -- formats -----------------------------------------------------------------------------------------------------


def encoded(arr_or_img, fmt: str, **kw) -> bytes:
    img = arr_or_img if isinstance(arr_or_img, Image.Image) else Image.fromarray(arr_or_img)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,kw", [("WEBP", {"lossless": True}), ("BMP", {}), ("TIFF", {}), ("PNG", {})])
def test_lossless_formats_decode_exactly(fmt, kw):
    arr = np.random.default_rng(1).integers(0, 256, size=(37, 53, 3), dtype=np.uint8)
    rgb, mode = decode_image(encoded(arr, fmt, **kw))
    assert mode == "RGB"
    assert np.array_equal(np.asarray(rgb), arr)


def test_gif_uses_first_frame():
    red = Image.new("RGB", (20, 10), (255, 0, 0))
    blue = Image.new("RGB", (20, 10), (0, 0, 255))
    data = encoded(red, "GIF", save_all=True, append_images=[blue])
    with Image.open(io.BytesIO(data)) as im:
        assert im.n_frames == 2
    rgb, mode = decode_image(data)
    assert mode == "P"
    assert set(map(tuple, np.asarray(rgb).reshape(-1, 3))) == {(255, 0, 0)}


def test_cmyk_uses_pillows_naive_conversion():
    # Pillow: R = 255 - min(255, C + K) per channel (no colour management), as the reference's convert("RGB").
    cmyk = Image.new("CMYK", (8, 8), (255, 0, 0, 0))
    cmyk.paste((0, 0, 0, 128), (0, 0, 4, 8))
    rgb, mode = decode_image(encoded(cmyk, "TIFF"))
    assert mode == "CMYK"
    a = np.asarray(rgb)
    assert (a[:, 4:] == (0, 255, 255)).all() and (a[:, :4] == (127, 127, 127)).all()
    # JPEG CMYK decodes too (lossy, so approximately).
    rgb, mode = decode_image(encoded(Image.new("CMYK", (16, 16), (0, 255, 0, 0)), "JPEG", quality=95))
    assert mode == "CMYK"
    assert np.abs(np.asarray(rgb).astype(int) - (255, 0, 255)).max() <= 8


def test_alpha_is_dropped_not_composited():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 2] = 200  # blue under fully transparent alpha stays blue (the HF port would give white)
    rgb, mode = decode_image(png(rgba, mode="RGBA"))
    assert mode == "RGBA"
    assert (np.asarray(rgb) == (0, 0, 200)).all()


def test_exif_orientation_is_an_option_off_by_default(records):
    r = next(r for r in records["image"] if r["id"] == "exif_rot90_900x600")
    data = base64.b64decode(r["image"]["b64"])
    assert r["decoded"]["exif_orientation"] == 6
    plain, _ = decode_image(data)
    assert plain.size == (900, 600)  # the reference ignores the tag
    assert prepare_image(data).plan.best_width > prepare_image(data).plan.best_height
    cfg = ImagePrepConfig(apply_exif_orientation=True)
    turned, _ = decode_image(data, cfg)
    assert turned.size == (600, 900)
    # Orientation 6 is "rotate 90 clockwise to display".
    assert np.array_equal(np.asarray(turned), np.asarray(plain.transpose(Image.Transpose.ROTATE_270)))
    plan = prepare_image(data, cfg).plan
    assert (plan.width, plan.height) == (600, 900)


# -- errors ------------------------------------------------------------------------------------------------------


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with no pixel data (Pillow reads the size from the header)."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_error_empty():
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"")


def test_error_not_bytes():
    with pytest.raises(ImageError, match="must be bytes"):
        decode_image("iVBORw0KGgo=")


def test_error_not_an_image():
    with pytest.raises(ImageError, match="not a readable image"):
        decode_image(b"hello, this is plainly text and not a picture" * 4)


def test_error_truncated_png():
    data = png(np.random.default_rng(2).integers(0, 256, size=(64, 64, 3), dtype=np.uint8))
    with pytest.raises(ImageError, match="truncated|broken"):
        decode_image(data[: len(data) // 2])


def test_error_truncated_jpeg():
    arr = np.random.default_rng(3).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    data = encoded(arr, "JPEG")
    with pytest.raises(ImageError, match="truncated|broken"):
        decode_image(data[: len(data) // 2])


def test_error_unsupported_format():
    data = encoded(np.zeros((8, 8, 3), dtype=np.uint8), "PPM")
    with Image.open(io.BytesIO(data)) as im:  # Pillow itself reads it ...
        assert im.format == "PPM"
    with pytest.raises(ImageError, match="unsupported image format PPM; convert it to PNG"):  # ... we do not
        decode_image(data)


def test_error_over_our_pixel_limit():
    data = png(np.zeros((40, 50, 3), dtype=np.uint8))
    with pytest.raises(ImageError, match=r"50x40 = 2000 pixels, over the limit of 1999; downscale"):
        decode_image(data, ImagePrepConfig(max_pixels=1999))
    decode_image(data, ImagePrepConfig(max_pixels=2000))  # at the limit is fine


def test_error_decompression_bomb_header():
    # 20000 x 20000 = 4e8 pixels: over our default limit and over Pillow's hard limit (2 x 89.5M).
    with pytest.raises(ImageError, match="too many pixels|over the limit"):
        decode_image(png_header_only(20000, 20000))
    with pytest.raises(ImageError, match="over the limit"):
        decode_image(png_header_only(9000, 9000))  # 8.1e7: under Pillow's limits, over ours (8192^2)


def test_error_data_urls():
    assert image_bytes_from_data_url("data:image/png;base64,aGk=") == b"hi"
    with pytest.raises(ImageError, match="data: URL"):
        image_bytes_from_data_url("https://example.com/cat.png")
    with pytest.raises(ImageError, match="base64"):
        image_bytes_from_data_url("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="not valid base64"):
        image_bytes_from_data_url("data:image/png;base64,@@@@")
